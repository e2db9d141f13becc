"""`python -m mlxdist.export RUN --out DIR` for a run that trained a Task: files the user's own code loads.

The checkpoint holds the trained parameters and the rest of the state that ever changed
(buffers, BatchNorm statistics); a frozen base that never changed is not in it, only its
fingerprint. So the model is rebuilt here as the engine built it (the task's `build(ctx)`, same
seed, on the CPU), the checkpoint is loaded over it, and the model's *whole* state is written:

  model.safetensors       torch `model.state_dict()` / MLX `tree_flatten(model.parameters())`, each
                          tensor in the model's own dtype: `load_state_dict(..., strict=True)` /
                          `model.load_weights(path, strict=True)` take it as it is
  model_ema.safetensors   the same with the checkpoint's EMA (`train.ema`) over it, if it has one
  adapter/                a PEFT model's adapter (`save_pretrained`), read by
                          `PeftModel.from_pretrained(base_model, DIR/adapter)`
  README.txt              how to load each file

Each file is loaded strictly into a freshly built model and compared with what was written
before the export counts as done; everything is written into a temporary directory first, so
a failed export leaves no half of one behind. The run's checkpoints are only read.

Rebuilding the model means importing the task's module and calling its factory, which runs
that code. A checkpoint is only data that anyone who can write the folder can rewrite (its
sha256 manifest catches a torn write, not someone who re-hashes), so the factory is the one
the user names (`--task`), imported only when the checkpoint names the same one.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError, config_from_dict
from ..engine.model_files import TaskExportError, few, one_line
from ..engine.registry import engine_spec
from ..state import checkpoint as ckpt
from ..tasks import Task, TaskContext
from ..tasks.load import task_from_factory


@dataclass
class Result:
    files: list[str]  # written into --out, in order
    lines: list[str]  # what to print: one per file, how to load it


# ------------------------------------------------------------------------------------------------


def find_peft(model: Any) -> Any:
    """The `peft.PeftModel` in a torch model: the model itself, its `.peft` attribute (how the
    built-in LM holds one, outside its children), or a child module; None without one."""
    peft = sys.modules.get("peft")  # a PeftModel exists only where peft was imported
    if peft is None:
        return None
    kind = peft.PeftModel
    if isinstance(model, kind):
        return model
    attr = getattr(model, "peft", None)
    if isinstance(attr, kind):
        return attr
    for m in model.modules() if hasattr(model, "modules") else ():
        if isinstance(m, kind):
            return m
    return None


class _Build:
    """The task's model as the engine built it: same seed, same context, on the CPU."""

    def __init__(self, task: Task, cfg, engine: Any, micro_batch: int):
        self.task, self.cfg, self.engine, self.micro_batch = task, cfg, engine, micro_batch

    def __call__(self) -> tuple[Any, str | None]:
        from ..models.build import built_from_task

        self.engine.seed(self.cfg.train.seed)
        ctx = TaskContext(self.engine.name, "cpu", self.cfg.train.seed, self.cfg, self.micro_batch)
        try:
            obj = self.task.build(ctx)
        except Exception as e:  # noqa: BLE001 - the user's build failed: say where, exit 2
            raise TaskExportError(f"task {self.task.name}: build(ctx) raised {type(e).__name__}: "
                                  f"{one_line(e)}") from None
        try:
            built = built_from_task(obj, engine_spec(self.engine.name).load("adopt"), "cpu", self.task.name)
        except ConfigError as e:
            raise TaskExportError(str(e)) from None
        except Exception as e:  # noqa: BLE001 - the user's module misbehaves when inspected
            raise TaskExportError(f"task {self.task.name}: the model build(ctx) returned fails to be inspected: "
                                  f"{type(e).__name__}: {one_line(e)}") from None
        if hasattr(built.module, "eval"):
            built.module.eval()
        return built.module, built.fingerprint


def shown(value: Any) -> str:
    """A name read from a checkpoint, printable on one line whatever it holds."""
    plain = isinstance(value, str) and value and value.isprintable() and value.strip() == value
    return value if plain else repr(value)


def trained_factory(state: dict[str, Any]) -> Any:
    """The task.factory a checkpoint's state.json names (None for the built-in LM), read as
    plain data: never imported here."""
    config = state.get("config") if isinstance(state, dict) else None
    task = config.get("task") if isinstance(config, dict) else None
    return task.get("factory") if isinstance(task, dict) else None


def check_factory(loaded: ckpt.Loaded, given: str | None, where: str = "--task") -> str:
    """`given` once it is the factory the checkpoint was trained with. The user's name is what
    makes importing it acceptable; the checkpoint's is only compared with it, so a rewritten
    state.json can refuse an export but never choose the code it runs."""
    trained = trained_factory(loaded.state)
    if given is None:
        raise TaskExportError(f"{loaded.path}: the checkpoint was trained with task.factory {shown(trained)}; export "
                              "imports and calls it to rebuild the model, and imports only code you name: pass "
                              f"--task {shown(trained)} if you trust that code")
    if given != trained:
        raise TaskExportError(f"{where} names task.factory {shown(given)}, but {loaded.path} was trained with "
                              f"task.factory {shown(trained)}; nothing was imported: pass --task {shown(trained)} "
                              f"if you trust that code, or export a run of {shown(given)}")
    return given


def export_task(loaded: ckpt.Loaded, out: str | os.PathLike, factory: str,
                args: dict[str, Any] | None = None) -> Result:
    """Write the task run's checkpoint `loaded` into `out` (which exists and may hold files,
    replaced by name). `factory` is the task.factory the user named: it must be the one the
    checkpoint was trained with (see `check_factory`). `args` (the user's task.args) replace the
    checkpoint's, which are only data handed to the code the user named. Raises TaskExportError
    (one line) for anything the user must fix."""
    check_factory(loaded, factory)
    state = loaded.state
    try:
        cfg = config_from_dict(state.get("config", {}))
    except ConfigError as e:
        raise TaskExportError(f"{loaded.path}: its saved config does not read: {e}") from None
    if args is not None:
        cfg = replace(cfg, task=replace(cfg.task, args=dict(args)))  # build(ctx) sees them
    try:
        task = task_from_factory(factory, dict(cfg.task.args))
    except ConfigError as e:  # TaskError is one
        raise TaskExportError(str(e)) from None
    engine_name = state.get("engine", "mlx")
    try:
        engine = engine_spec(engine_name).load("model_files")()
    except ValueError as e:  # a name no engine registers
        raise TaskExportError(f"{loaded.path}: {e}") from None
    except ImportError as e:
        raise TaskExportError(f"{loaded.path}: trained on the {engine_name} engine, and {e.name} does not import "
                              f"here: {e}") from None
    try:
        micro = ((state.get("controllers") or {}).get("micro") or [None])[0]  # rank 0's when it was saved
        build = _Build(task, cfg, engine, micro if isinstance(micro, int) else cfg.train.batch_size)
        model, fingerprint = build()
    except ConfigError as e:  # TaskError is one
        raise TaskExportError(str(e)) from None
    where = f"{loaded.path.name} of task {task.name}"
    trained_at = state.get("base_fingerprint")
    if trained_at and fingerprint and trained_at != fingerprint:
        def crc(fp: str) -> str:
            return fp.removeprefix("frozen weights ")

        raise TaskExportError(f"{where}: the frozen weights build(ctx) makes here ({crc(fingerprint)}) are not the ones "
                              f"the run trained on ({crc(trained_at)}); they are not in the checkpoint, so export "
                              "needs the same base: the same files and settings build() reads")

    tensors, trained = engine.state(model), engine.trained(model)
    weights = loaded.weights
    unknown = set(weights) - set(tensors)
    if unknown:
        raise TaskExportError(f"{where}: holds {len(unknown)} entr{'y' if len(unknown) == 1 else 'ies'} the model "
                              f"built by {task.name} lacks: {few(unknown)} (was the model changed since the run?)")
    lacking = trained - set(weights)
    if lacking:
        raise TaskExportError(f"{where}: lacks {len(lacking)} trained parameter(s) of the model built by {task.name}: "
                              f"{few(lacking)} (was the model changed since the run?)")
    _check_shapes(where, engine, tensors, weights, trained)
    ema = getattr(loaded, "extra", {}).get("ema") or {}
    if ema:
        stray = set(ema) - set(tensors)
        if stray:
            raise TaskExportError(f"{loaded.path.name}/ema.safetensors: {few(stray)} not in the model built by "
                                  f"{task.name}")
        _check_shapes(f"{loaded.path.name}/ema.safetensors", engine, tensors, ema, trained)

    out = Path(out)
    created = not out.exists()
    tmp = out / f".export-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    done = False
    try:
        written = _write(engine, model, trained, weights, ema, tmp)
        del model, tensors
        _verify(engine, build, tmp, written)
        readme = _readme(engine, loaded, task.name, written, out.resolve())
        (tmp / "README.txt").write_text(readme)
        written.append("README.txt")
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.rglob("*"):  # the safetensors package makes its files 0600
            if f.is_file():
                os.chmod(f, 0o666 & ~umask)
        for name in written:
            dest = out / name
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            os.replace(tmp / name, dest)
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if created and not done and not any(out.iterdir()):
            out.rmdir()  # a failed export leaves no trace
    return Result(written, _lines(engine, written, out))


def _check_shapes(where: str, engine, tensors: dict, arrays: dict, trained: set[str]) -> None:
    for n, a in arrays.items():
        want = engine.shape(tensors[n])
        if n in trained and engine.flipped(n):
            want = want[::-1]
        if tuple(np.shape(a)) != want:
            raise TaskExportError(f"{where}: {n} has shape {tuple(np.shape(a))}, the model built here {want} "
                                  "(was the model changed since the run?)")


def _write(engine, model, trained: set[str], weights: dict, ema: dict, tmp: Path) -> list[str]:
    written = []
    engine.load(model, weights, trained)
    engine.write(model, tmp / "model.safetensors")
    written.append("model.safetensors")
    peft_model = find_peft(model) if engine.peft else None
    if peft_model is not None:
        peft_model.save_pretrained(str(tmp / "adapter"))
        written.append("adapter")
    if ema:
        engine.load(model, ema, trained)
        engine.write(model, tmp / "model_ema.safetensors")
        written.append("model_ema.safetensors")
        if peft_model is not None:
            peft_model.save_pretrained(str(tmp / "adapter_ema"))
            written.append("adapter_ema")
    return written


def _verify(engine, build: _Build, tmp: Path, written: list[str]) -> None:
    """Each file strictly into a freshly built model, equal to what was written."""
    fresh, _ = build()
    for name in ("model.safetensors", "model_ema.safetensors"):
        if name not in written:
            continue
        saved = engine.load_strict(fresh, tmp / name)
        bad = engine.differs(fresh, saved)
        if bad:
            raise TaskExportError(f"{name}: after a strict load into a fresh {type(fresh).__name__}, "
                                  f"{few(bad)} differ from what was written (does the model's load_state_dict "
                                  "change what it loads?)")
        adapter = "adapter" if name == "model.safetensors" else "adapter_ema"
        if adapter in written:
            _verify_adapter(find_peft(fresh), tmp / adapter)


def _verify_adapter(peft_model, directory: Path) -> None:
    import torch
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    if peft_model is None:
        raise TaskExportError(f"{directory.name}/: a fresh build holds no PeftModel (does build() wrap the model "
                              "in peft only sometimes?)")
    want = get_peft_model_state_dict(peft_model)
    got = load_peft_weights(str(directory), device="cpu")
    bad = sorted(set(want) ^ set(got)) or [n for n in want if not torch.equal(want[n].cpu(), got[n])]
    if bad:
        raise TaskExportError(f"{directory.name}/: PEFT reads it back unlike the model's adapter ({few(bad)})")


_WHAT = {
    "model.safetensors": "the model's whole state ({kind}), each tensor in the model's own dtype",
    "model_ema.safetensors": "the same, with the run's EMA (train.ema) of the trained weights and float buffers",
    "adapter": "the PEFT adapter (adapter_config.json, adapter_model.safetensors) on the base build() loads",
    "adapter_ema": "the PEFT adapter of the EMA weights",
}


def _lines(engine, written: list[str], out: Path) -> list[str]:
    return [f"{out / n}: {engine.how[n].format(p=out / n)}" for n in written if n in engine.how]


def _readme(engine, loaded: ckpt.Loaded, task: str, written: list[str], out: Path) -> str:
    kind = engine.kind
    step = loaded.state.get("step")
    lines = [f"Exported by `python -m mlxdist.export` from {loaded.path} (step {step}), task {task}, "
             f"{engine.name} engine, into {out}.", "",
             "Build the model the way your task's build(ctx) does (your own class), then, with paths relative "
             "to this directory:", ""]
    for n in written:
        if n in engine.how:
            lines += [f"{n}{'/' if n.startswith('adapter') else ''}: {_WHAT[n].format(kind=kind)}",
                      f"    {engine.how[n].format(p=n)}", ""]
    if "adapter" in written:
        lines += ["base_model is the model the PeftModel wraps, as build() makes it before get_peft_model.", ""]
    return "\n".join(lines).rstrip() + "\n"
