"""The PyTorch engine against the MLX model and against the AdamW contract both engines share.

These pin what cross-engine checkpoints rely on: identical parameter names and math
(logits and gradients match MLX), and identical optimizer math/state layout.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mlxdist.config import Config  # noqa: E402
from mlxdist.engine.base import local_step  # noqa: E402
from mlxdist.engine.torch_engine import (  # noqa: E402
    TorchEngine,
    compile_enabled,
    select_device,
)
from mlxdist.models import torch_model  # noqa: E402
from mlxdist.models.init import initial_weights, param_shapes  # noqa: E402
from mlxdist.models.presets import PRESETS, ModelArgs  # noqa: E402

TINY = ModelArgs(**PRESETS["tiny"], vocab_size=258)
SMALLER = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=64)


def _tokens(b: int, t: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (b, t)).astype(np.int32)


def _cfg(**train) -> Config:
    return dataclasses.replace(Config(), train=dataclasses.replace(Config().train, **train))


@pytest.fixture(autouse=True)
def _no_compile(monkeypatch):
    # CPU never compiles by default; this keeps the tests fast even if run on a CUDA box.
    monkeypatch.setenv("DISABLE_COMPILE", "1")
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


# ------------------------------------------------------------- parity with MLX


@pytest.mark.parametrize(
    "args",
    [TINY, dataclasses.replace(TINY, grad_checkpoint_every=2, tie_embeddings=False)],
    ids=["tiny-gqa-tied", "tiny-ckpt2-untied"],
)
def test_logits_and_grads_match_mlx(args: ModelArgs) -> None:
    mx = pytest.importorskip("mlx.core")
    import mlx.nn as mnn
    from mlx.utils import tree_flatten, tree_unflatten

    from mlxdist.models import mlx_model

    assert args.n_kv_heads < args.n_heads  # grouping of query heads onto kv heads is exercised
    w = initial_weights(args, 3, np)
    # Non-trivial norm weights so a transposed/misnamed norm would show up.
    rng = np.random.default_rng(7)
    for k in w:
        if k.endswith("norm.weight"):
            w[k] = (1 + 0.1 * rng.standard_normal(w[k].shape)).astype(np.float32)

    mm = mlx_model.Transformer(args)
    mm.update(tree_unflatten(list({k: mx.array(v) for k, v in w.items()}.items())))
    tm = torch_model.Transformer(args)
    assert set(tm.state_dict()) == set(param_shapes(args))
    tm.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})

    toks = _tokens(2, 25, args.vocab_size, 1)
    inp, tgt = toks[:, :-1], toks[:, 1:]

    # Training mode with grad enabled, so checkpointed layers take the recompute path.
    lt = tm(torch.from_numpy(inp).long())
    lm = mm(mx.array(inp))
    diff = float(np.abs(np.array(lm) - lt.detach().numpy()).max())
    assert diff < 1e-4, diff

    loss_t = torch.nn.functional.cross_entropy(
        lt.reshape(-1, args.vocab_size), torch.from_numpy(tgt).long().reshape(-1), reduction="sum"
    )
    loss_t.backward()

    def loss_fn(model, x, y):
        return mnn.losses.cross_entropy(model(x), y, reduction="sum")

    loss_m, grads_m = mnn.value_and_grad(mm, loss_fn)(mm, mx.array(inp), mx.array(tgt))
    assert abs(float(loss_m) - loss_t.item()) < 1e-3 * loss_t.item()
    gm = dict(tree_flatten(grads_m))
    for name, p in tm.named_parameters():
        g = np.array(gm[name])
        scale = max(float(np.abs(g).max()), 1e-3)
        assert np.abs(g - p.grad.numpy()).max() < 1e-3 * scale, name


def test_rope_matches_mlx() -> None:
    mx = pytest.importorskip("mlx.core")
    import mlx.nn as mnn

    x = np.random.default_rng(0).standard_normal((2, 3, 17, 16)).astype(np.float32)
    ref = np.array(mnn.RoPE(16, traditional=False, base=500.0)(mx.array(x)))
    cos, sin = torch_model.rope_tables(16, 17, 500.0, torch.device("cpu"))
    got = torch_model.apply_rope(torch.from_numpy(x), cos, sin).numpy()
    np.testing.assert_allclose(got, ref, atol=1e-5)


# ------------------------------------------------------------- training


def test_engine_trains_and_samples() -> None:
    eng = TorchEngine(_cfg(), "cpu", TINY)
    toks = _tokens(4, 33, TINY.vocab_size, 0)
    losses = []
    for _ in range(30):
        eng.micro_step(toks[:2])
        eng.micro_step(toks[2:])  # accumulation: two micro-batches per step
        st = local_step(eng, 3e-3)
        assert not st.skipped and st.tokens == 4 * 32
        losses.append(st.loss)
    assert losses[-1] < 0.5 * losses[0], losses
    loss_sum, n = eng.eval_loss(toks)
    assert n == 4 * 32 and loss_sum / n < losses[0]
    assert eng.logits(toks[:, :-1]).shape == (4, 32, TINY.vocab_size)

    out = eng.sample([1, 2, 3], 6, temperature=0.8, seed=5, context=8)
    assert len(out) == 6 and all(0 <= t < TINY.vocab_size for t in out)
    assert out == eng.sample([1, 2, 3], 6, temperature=0.8, seed=5, context=8)


def test_nonfinite_step_is_skipped() -> None:
    eng = TorchEngine(_cfg(), "cpu", SMALLER)
    before = eng.get_weights()
    eng.micro_step(_tokens(2, 9, SMALLER.vocab_size, 0))
    eng._params[0].grad[0, 0] = float("nan")
    st = local_step(eng, 1e-2)
    assert st.skipped
    after = eng.get_weights()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert eng.get_optimizer_state()[1] == 0
    eng.micro_step(_tokens(2, 9, SMALLER.vocab_size, 0))  # accumulators were reset
    assert not local_step(eng, 1e-2).skipped


# ------------------------------------------------------------- AdamW contract


def _reference_adamw(w, m, v, g, t, lr, b1, b2, eps, wd, clip):
    """The formula the MLX engine implements; `g` are mean-loss gradients."""
    norm = np.sqrt(sum(float((x.astype(np.float64) ** 2).sum()) for x in g.values()))
    coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
    for k in w:
        gk = g[k] * coef
        if w[k].ndim >= 2:
            w[k] = w[k] - lr * wd * w[k]
        m[k] = b1 * m[k] + (1 - b1) * gk
        v[k] = b2 * v[k] + (1 - b2) * gk * gk
        mhat = m[k] / (1 - b1**t)
        vhat = v[k] / (1 - b2**t)
        w[k] = w[k] - lr * mhat / (np.sqrt(vhat) + eps)
    return norm


def _mean_loss_grads(args: ModelArgs, w: dict, toks: np.ndarray) -> dict:
    model = torch_model.Transformer(args)
    model.load_state_dict({k: torch.from_numpy(v.astype(np.float32)) for k, v in w.items()})
    t = torch.from_numpy(toks).long()
    logits = model(t[:, :-1])
    torch.nn.functional.cross_entropy(
        logits.reshape(-1, args.vocab_size), t[:, 1:].reshape(-1)
    ).backward()
    return {k: p.grad.numpy().astype(np.float64) for k, p in model.named_parameters()}


def test_adamw_matches_reference_formula() -> None:
    hp = dict(beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.3, grad_clip=0.5)
    eng = TorchEngine(_cfg(**hp), "cpu", SMALLER)
    w = {k: v.astype(np.float64) for k, v in eng.get_weights().items()}
    m = {k: np.zeros_like(x) for k, x in w.items()}
    v = {k: np.zeros_like(x) for k, x in w.items()}
    lrs = [1e-2, 5e-3, 2e-3]
    for t, lr in enumerate(lrs, start=1):
        toks = _tokens(3, 11, SMALLER.vocab_size, t)
        g = _mean_loss_grads(SMALLER, w, toks)
        ref_norm = _reference_adamw(
            w,
            m,
            v,
            g,
            t,
            lr,
            hp["beta1"],
            hp["beta2"],
            hp["eps"],
            hp["weight_decay"],
            hp["grad_clip"],
        )
        eng.micro_step(toks[:1])
        eng.micro_step(toks[1:])
        st = local_step(eng, lr)
        assert ref_norm > hp["grad_clip"]  # clipping is exercised
        assert abs(st.grad_norm - ref_norm) < 1e-4 * ref_norm
    got = eng.get_weights()
    for k in w:
        np.testing.assert_allclose(got[k], w[k], atol=1e-5, err_msg=k)
    state, step = eng.get_optimizer_state()
    assert step == 3
    for k in w:
        np.testing.assert_allclose(state[f"m.{k}"], m[k], atol=1e-5, err_msg=k)
        np.testing.assert_allclose(state[f"v.{k}"], v[k], atol=1e-7, err_msg=k)


def test_optimizer_state_round_trip() -> None:
    cfg = _cfg()
    a = TorchEngine(cfg, "cpu", SMALLER)
    for i in range(2):
        a.micro_step(_tokens(2, 9, SMALLER.vocab_size, i))
        local_step(a, 1e-2)
    state, step = a.get_optimizer_state()
    assert step == 2 and set(state) == {f"{p}.{n}" for p in "mv" for n in param_shapes(SMALLER)}

    saved = {k: x.copy() for k, x in state.items()}

    b = TorchEngine(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=9)), "cpu", SMALLER)
    b.set_weights(a.get_weights())
    b.set_optimizer_state(state, step)
    last = _tokens(2, 9, SMALLER.vocab_size, 99)
    for eng in (a, b):
        eng.micro_step(last)
    sa, sb = local_step(a, 1e-2), local_step(b, 1e-2)
    assert sa.loss_sum == sb.loss_sum and sa.grad_norm == sb.grad_norm
    wa, wb = a.get_weights(), b.get_weights()
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)
    assert b.get_optimizer_state()[1] == 3
    # Neither engine may alias the arrays it was given or handed out.
    assert all(np.array_equal(state[k], saved[k]) for k in saved)


# ------------------------------------------------------------- devices and flags


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda_is_a_clear_error() -> None:
    with pytest.raises(
        RuntimeError, match=r"^--device cuda: no CUDA GPU visible to torch .*--device auto"
    ):
        select_device("cuda")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without MPS")
def test_missing_mps_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"^--device mps: "):
        select_device("mps")


def test_device_selection() -> None:
    assert select_device("cpu")[0] == "cpu"
    dev, why = select_device("auto")
    assert dev in ("cuda", "mps", "cpu") and why
    with pytest.raises(RuntimeError, match="unknown device"):
        select_device("tpu")


def test_torch_ranks_refuse_an_mlx_backend() -> None:
    from mlxdist.config import ConfigError
    from mlxdist.training.wiring import make_world

    cfg = dataclasses.replace(_cfg(), dist=dataclasses.replace(_cfg().dist, backend="mlx-ring"))
    with pytest.raises(ConfigError, match="dist.backend=mlx-ring: the torch engine sums its gradients over mpi4py"):
        make_world("torch", cfg, "cpu")


def test_disable_compile(monkeypatch) -> None:
    monkeypatch.delenv("DISABLE_COMPILE")
    assert (
        compile_enabled("cuda")[0]
        and not compile_enabled("cpu")[0]
        and not compile_enabled("mps")[0]
    )
    monkeypatch.setenv("DISABLE_COMPILE", "0")
    assert compile_enabled("cuda")[0]
    monkeypatch.setenv("DISABLE_COMPILE", "1")
    assert compile_enabled("cuda") == (False, "DISABLE_COMPILE set")
    eng = TorchEngine(_cfg(), "cpu", SMALLER)
    assert "compile off (DISABLE_COMPILE set)" in eng.describe()
    assert eng.name == "torch" and eng.device == "cpu"
