"""Ranks on one host share rank_state/step_N folders: one rank's retention must neither fail
on a folder another rank removed nor remove a file another rank is writing."""

import numpy as np

from mlxdist.state import rank_state


def _save(root, step, rank, keep):
    info = rank_state.RankStateInfo(step, rank, 2, ["h0"], step)
    return rank_state.save(root, info, {"w": np.full(3, step, np.float32)}, keep)


def test_pruning_leaves_a_file_another_rank_is_writing(tmp_path):
    _save(tmp_path, 2, 1, keep=1)
    writing = tmp_path / "step_00000002" / ".rank0.safetensors.999.tmp"
    writing.write_bytes(b"half written")
    _save(tmp_path, 4, 1, keep=1)
    assert writing.read_bytes() == b"half written"
    assert not (tmp_path / "step_00000002" / "rank1.json").exists()


def test_a_folder_removed_between_mkdir_and_write_is_made_again(tmp_path, monkeypatch):
    real = rank_state.write_synced
    removed = []

    def remove_then_write(path, blob):
        if not removed:
            removed.append(path.parent)
            path.parent.rmdir()
        real(path, blob)

    monkeypatch.setattr(rank_state, "write_synced", remove_then_write)
    _save(tmp_path, 6, 0, keep=2)
    assert removed and rank_state.load(tmp_path, 6, 0, 2, ["h0"])[1] == 6


def _rank_saves(root, rank, steps, errors):
    try:
        for step in range(steps):
            _save(root, step, rank, keep=1)
    except Exception as e:  # noqa: BLE001 - the test reports what a rank met
        errors.append(f"rank {rank}: {e!r}")


def test_two_ranks_saving_and_pruning_at_once_never_fail(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    with ctx.Manager() as manager:
        errors = manager.list()
        procs = [ctx.Process(target=_rank_saves, args=(tmp_path, r, 300, errors)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert list(errors) == [] and [p.exitcode for p in procs] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000299"]
    for r in range(2):
        assert rank_state.load(tmp_path, 299, r, 2, ["h0"])[1] == 299
