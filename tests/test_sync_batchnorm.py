"""`train.sync_batchnorm` (torch engine): BatchNorm statistics over every rank's samples, so a
model whose samples are coupled by BatchNorm (transformers' ResNetForImageClassification, with
its own SGD) trains on 2 ranks with 3+5 samples exactly as 1 rank with 8: weights, running
statistics and batch counters; the checkpoint still loads strictly into the user's class; and
what cannot work is refused in one line (exit 2)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import run_train
from safetensors.numpy import load_file

from mlxdist.cluster.world import World
from mlxdist.config import ConfigError, load_config
from mlxdist.control import StepPlan
from mlxdist.engine.base import Capabilities
from mlxdist.sync.batchnorm import install_sync_batchnorm, sync_batchnorm_layers

HERE = Path(__file__).parent
SPLIT = "nodes={rank0: {batch_size: 3}, rank1: {batch_size: 5}}"
COMMON = ["metrics.port=0", "train.progress=false", "train.eval_every=0", "train.warmup_steps=0",
          "train.schedule=constant", "train.grad_clip=0", "dist.sync_weights_every=0"]
RESNET = ["--engine", "torch", "--device", "cpu", "task.factory=bn_tasks:resnet", "train.lr=0.1",
          "train.steps=3", "checkpoint.every=3"]


def _train(args, np_=0):
    r = run_train([*COMMON, *args], np_=np_, cwd=HERE)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _model(run: Path) -> dict[str, np.ndarray]:
    return load_file(run / "checkpoints" / "step_00000003" / "model.safetensors")


def _worst(a: dict, b: dict, keys) -> float:
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in keys)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sync-bn")
    _train([*RESNET, "train.sync_batchnorm=true", "train.batch_size=8", f"train.out_dir={root / 'one'}"])
    _train([*RESNET, "train.sync_batchnorm=true", SPLIT, f"train.out_dir={root / 'two'}"], np_=2)
    _train([*RESNET, SPLIT, f"train.out_dir={root / 'plain'}"], np_=2)
    return root


@pytest.mark.cluster
def test_3_plus_5_equal_one_rank_with_8(runs):
    one, two = _model(runs / "one"), _model(runs / "two")
    assert one.keys() == two.keys()
    stats = [k for k in one if k.endswith(("running_mean", "running_var"))]
    counters = [k for k in one if k.endswith("num_batches_tracked")]
    weights = [k for k in one if k not in stats and k not in counters]
    assert len(stats) == 12 and len(counters) == 6 and weights
    assert _worst(one, two, weights) <= 1e-5, _worst(one, two, weights)
    assert _worst(one, two, stats) <= 1e-5, _worst(one, two, stats)
    assert all(int(one[k]) == int(two[k]) == 3 for k in counters)
    for k in stats:  # they moved off their initial zeros and ones
        assert np.abs(one[k] - (1.0 if k.endswith("var") else 0.0)).max() > 1e-3, k


@pytest.mark.cluster
def test_without_it_3_plus_5_differ_from_8(runs):
    one, plain = _model(runs / "one"), _model(runs / "plain")
    weights = [k for k in one if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    assert _worst(one, plain, weights) > 1e-3


@pytest.mark.cluster
def test_checkpoint_loads_strictly_into_the_users_class(runs):
    sys.path.insert(0, str(HERE))
    try:
        import bn_tasks
    finally:
        sys.path.remove(str(HERE))
    saved = _model(runs / "two")
    model = bn_tasks.resnet_model()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in saved.items()}, strict=True)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), saved[k], err_msg=k)


@pytest.mark.parametrize("layer,shape", [(torch.nn.BatchNorm2d(4), (5, 4, 3, 3)),
                                         (torch.nn.BatchNorm1d(4, momentum=None), (7, 4, 5)),
                                         (torch.nn.BatchNorm1d(4, affine=False), (7, 4))])
def test_on_one_rank_the_patched_layer_is_torch_batchnorm(layer, shape):
    torch.manual_seed(0)
    ref, got = copy.deepcopy(layer), copy.deepcopy(layer)
    params, names = list(got.parameters()), list(got.state_dict())
    assert sync_batchnorm_layers(torch.nn.Sequential(got), World()) == ["0"]
    assert list(got.parameters()) == params and list(got.state_dict()) == names
    for _ in range(3):
        x, w = torch.randn(*shape) * 3 + 2, torch.randn(*shape)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        (ref(xa) * w).sum().backward()
        (got(xb) * w).sum().backward()
        torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-5)
    for (n, a), b in zip(ref.named_parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5, msg=n)
    for (n, a), b in zip(ref.named_buffers(), got.buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=n)
    ref.eval(), got.eval()
    x = torch.randn(*shape)
    torch.testing.assert_close(got(x), ref(x))


class _Behind(World):
    """Two ranks in one process: the other one is an exchange behind."""

    def allreduce_arrays(self, arrays):
        buf = arrays["bn"]
        other = buf.copy()
        other[-2] -= 1
        other[-1] = other[-2] ** 2
        return {"bn": buf + other}


def test_ranks_out_of_step_stop_with_an_error_and_eval_does_not_communicate():
    layer = torch.nn.BatchNorm1d(4)
    sync_batchnorm_layers(layer, _Behind(size=2))
    layer.eval()
    layer(torch.randn(3, 4))
    layer.train()
    with pytest.raises(RuntimeError, match="out of step") as e:
        layer(torch.randn(3, 4))
    assert "out of memory" not in str(e.value)  # the loop would take it for one and retry


def _install(overrides, model=None, ranks=2, accum=1):
    cfg = load_config(None, ["train.sync_batchnorm=true", *overrides])
    model = model if model is not None else torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4))
    engine = SimpleNamespace(name="torch", model=model, capabilities=Capabilities("t:f"))
    return install_sync_batchnorm(cfg, World(size=ranks), engine, StepPlan.initial([4] * ranks, accum, None))


@pytest.mark.parametrize("overrides,kwargs,says", [
    (["dist.mode=diloco"], {}, "dist.mode=diloco"),
    (["control.adapt_batch=true"], {}, "set control.adapt_batch=false"),
    (["control.balance=true"], {}, "set control.balance=false"),
    ([], {"accum": 2}, "rank 0 runs 2 micro-batches per step"),
    ([], {"model": torch.nn.Linear(2, 2)}, "task t:f has no BatchNorm layer"),
])
def test_refusals_name_the_key(overrides, kwargs, says):
    with pytest.raises(ConfigError, match="train.sync_batchnorm") as e:
        _install(overrides, **kwargs)
    assert says in str(e.value)


def test_one_rank_needs_nothing_and_off_is_a_no_op():
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4))
    assert "one rank" in _install(["control.adapt_batch=true"], model, ranks=1, accum=2)[0]
    assert "forward" not in vars(model[1])
    cfg = load_config(None, [])
    assert install_sync_batchnorm(cfg, World(size=2), SimpleNamespace(name="mlx"), None) == []


def test_mlx_engine_is_refused(tmp_path):
    r = run_train([*COMMON, "task.factory=bn_tasks:mlx_batchnorm", "train.sync_batchnorm=true",
                   f"train.out_dir={tmp_path}"], cwd=HERE)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "error: train.sync_batchnorm: the mlx engine is not supported" in r.stderr


@pytest.mark.cluster
def test_gradient_accumulation_is_refused(tmp_path):
    r = run_train([*COMMON, "--engine", "torch", "--device", "cpu", "task.factory=bn_tasks:torch_mlp",
                   "train.sync_batchnorm=true", "train.batch_size=2", "train.accum=2", f"train.out_dir={tmp_path}"],
                  np_=2, cwd=HERE)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("error: train.sync_batchnorm: rank 0 runs 2 micro-batches per step") == 1, r.stderr
