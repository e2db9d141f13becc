"""`python -m mlxdist.plan --config C [--hosts studio=128GB,macbook=16GB | --hostfile H] [k=v ...]`:
the bytes each rank would hold under every `dist.shard` mode, against each host's budget, and
the mode `dist.shard=auto` would choose, without training; for the built-in LM on 2+ ranks also
the cut `dist.mode=pipeline` would make (`control/pipeline_cut.py`: each rank's stages and bytes),
and what data parallel, ZeRO-1/2, ZeRO-3 and the pipeline move a step over `--link` (default 1gbit);
with `--tflops` (each Mac's sustained training TFLOP/s, one number or one per rank) their predicted
step (`control/mode_time.py`) and which to use.

Hosts, one rank each and in rank order: `--hosts NAME=SIZE,...`; else the hostfile's hosts
(`slots=N`: N ranks sharing that host's memory), sized by `--memory` (`SIZE` for every host, or
`NAME=SIZE,...`), a host of this machine (localhost, its name) by its own memory limit; with
neither, this machine as one rank. A SIZE is the limit the trainer measures memory against (on
a Mac: Metal's recommended working set, about 3/4 of RAM; its banner prints it): `128GB`,
`16GiB`, `512MB`, `1.5TB` (GB and GiB both 2^30 bytes, as macOS's "128 GB" is) or bytes.
This machine's limit is the one the trainer reads (MLXDIST_MEMORY_LIMIT_BYTES overrides it).

The built-in LM's numbers come from its preset; a task's model is built on the CPU to count
its parameters, and its activations are counted only with `--activation-gb` (per sample).
Exit status: 0 a mode fits, 2 none does (one line names the rank) or the input is wrong.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence

from ..config import Config, ConfigError, load_config
from ..control.memory_plan import GIB, lm_facts, plan
from ..control.mode_time import advice_lines, parse_link, parse_tflops, predict
from ..control.pipeline_cut import LAST_RUN, cut_lines, cut_stages, lm_stage_elements, stage_loads
from ..engine.registry import ENGINES, engine_spec
from ..optim import make_optimizer
from ..sync.strategy import memory_lines, mode_strategy

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": GIB, "gb": GIB, "gib": GIB, "t": 2**40, "tb": 2**40, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str, where: str = "size") -> int:
    """`128GB` -> 128 * 2^30 bytes (GB and GiB alike); a bare number is bytes."""
    m = _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise ConfigError(f"{where}: cannot read '{text}' as a memory size (e.g. 128GB, 16GiB, 512MB)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_hosts(text: str, where: str = "--hosts") -> list[tuple[str, int]]:
    """`studio=128GB,macbook=16GB` -> [("studio", 128 GiB), ("macbook", 16 GiB)], in order."""
    out = []
    for item in (s.strip() for s in text.split(",")):
        name, eq, size = item.partition("=")
        if not item or not eq or not name.strip():
            raise ConfigError(f"{where}: '{item}' is not NAME=SIZE (e.g. studio=128GB,macbook=16GB)")
        out.append((name.strip(), parse_size(size, f"{where} {name.strip()}")))
    return out


def local_memory() -> int:
    """This machine's limit as the trainer reads it: MLXDIST_MEMORY_LIMIT_BYTES/_FILE, else
    Metal's recommended working set on a Mac (when MLX loads), else the cgroup's or RAM."""
    from ..engine.memory import METAL_WORKING_SET_KEY, MemoryReading, process_reading, with_override

    if sys.platform == "darwin":
        try:
            import mlx.core as mx

            working_set = mx.device_info().get(METAL_WORKING_SET_KEY)
        except Exception:  # noqa: BLE001 - no MLX, or no Metal: RAM it is
            working_set = None
        if isinstance(working_set, int) and working_set > 0:
            return with_override(MemoryReading(0, 0, working_set)).limit
    return process_reading().limit  # the override, else the cgroup's limit or RAM


def hostfile_ranks(path: str, memory: str | None) -> list[tuple[str, int]]:
    """The hostfile's ranks (host, its memory / slots), sized by `--memory` or, for this
    machine, by its own limit."""
    from ..launch.hosts import LOCAL_NAMES, LaunchError, read_hostfile

    try:
        entries = read_hostfile(path)
    except LaunchError as e:
        raise ConfigError(str(e)) from None
    every = sizes = None
    if memory and "=" in memory:
        sizes = {k.lower(): v for k, v in parse_hosts(memory, "--memory")}
    elif memory:
        every = parse_size(memory, "--memory")
    ranks = []
    for e in entries:
        size = every or (sizes or {}).get(e.name.lower()) or (sizes or {}).get(e.name.split(".")[0].lower())
        if size is None and e.name in LOCAL_NAMES:
            size = local_memory()
        if size is None:
            raise ConfigError(f"hostfile {path}: host '{e.name}': its memory is unknown here; add "
                              f"--memory {e.name}=SIZE (e.g. 128GB) or --memory SIZE for every host")
        ranks += [(e.name, size // e.slots)] * e.slots
    return ranks


def model_numbers(cfg: Config, engine: str) -> tuple[int, int | None, int, str]:
    """(trained parameters, activation bytes per sample or None, ZeRO-3 unit, what it is)."""
    facts = lm_facts(cfg)
    if facts is not None:
        from ..models.presets import human

        return (facts.n_params, facts.activation_bytes_per_sample, facts.gather_params,
                f"model: preset {cfg.model.preset}, {human(facts.n_params)} parameters; data.seq_len "
                f"{cfg.data.seq_len}")
    if not cfg.task.factory:
        from ..models.build import inspect_base

        if cfg.finetune.method != "full":
            raise ConfigError(f"finetune.method={cfg.finetune.method}: only the adapters train, and their state is "
                              "small; the planner sizes full training (finetune.method=full)")
        info = inspect_base(cfg)
        return info.n_params, None, 0, f"model: {info.model_type} from {info.path}, {info.n_params:,} parameters"
    from ..models.build import built_from_task
    from ..tasks import TaskContext
    from ..tasks.load import resolve_task

    task = resolve_task(cfg)
    spec = engine_spec(engine)
    spec.load("on_cpu")()
    built = built_from_task(task.build(TaskContext(engine, "cpu", cfg.train.seed, cfg, cfg.train.batch_size)),
                            spec.load("adopt"), "cpu", task.name)
    sizes = [math.prod(v.shape) for v in built.params.values()]
    return sum(sizes), None, max(sizes), f"{built.summary} (built on the CPU with {engine})"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxdist.plan",
                                description="Memory each rank would hold under each dist.shard mode, and "
                                            "the one dist.shard=auto picks; nothing is trained.")
    p.add_argument("--config", help="the run's YAML config")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hosts", help="NAME=SIZE,... one rank each, in rank order (studio=128GB,macbook=16GB)")
    where.add_argument("--hostfile", help="an Open MPI hostfile; sizes from --memory or this machine's")
    p.add_argument("--memory", help="with --hostfile: SIZE for every host, or NAME=SIZE,...")
    p.add_argument("--activation-gb", type=float, default=None,
                   help="activation memory per sample in GiB (a task's, or a measured one for the LM)")
    p.add_argument("--link", default="1gbit", help="the link between the Macs (1gbit, 100mbit, 40gbit): what the "
                   "exchange of each mode costs a step")
    p.add_argument("--tflops", help="each Mac's sustained training TFLOP/s (one number, or one per rank): predicts "
                   "data parallel's, ZeRO-3's and the pipeline's step and says which to use")
    p.add_argument("--engine", choices=ENGINES, default="mlx", help="a task's model is built with it")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (model.preset=1b data.seq_len=2048)")
    args = p.parse_intermixed_args(argv)
    try:
        if args.memory and not args.hostfile:
            raise ConfigError("--memory: sizes a --hostfile's hosts; with --hosts write NAME=SIZE there")
        from ..tasks.load import config_file

        config_file(args.config, "--config")
        cfg = load_config(args.config, args.overrides)
        if args.hosts:
            hosts, source = parse_hosts(args.hosts), "--hosts"
        elif args.hostfile:
            hosts, source = hostfile_ranks(args.hostfile, args.memory), f"hostfile {args.hostfile}"
        else:
            import socket

            hosts, source = [(socket.gethostname().split(".")[0], local_memory())], "this machine"
        n_params, act, unit, what = model_numbers(cfg, args.engine)
        if args.activation_gb is not None:
            if args.activation_gb < 0:
                raise ConfigError("--activation-gb: must be >= 0")
            act, what = int(args.activation_gb * GIB), what + f"; activations {args.activation_gb:g} GiB/sample (given)"
        elif act is not None:
            what += f"; activations ~{act / 2**20:.0f} MiB/sample (estimated)"
        link_bps = parse_link(args.link)
        tflops = parse_tflops(args.tflops, len(hosts)) if args.tflops else None
        facts = lm_facts(cfg) if args.activation_gb is None else None
        result = plan(cfg, hosts, n_params, act, memory=memory_lines(), gather_params=unit,
                      staged_act_per_sample=facts.staged_activation_bytes_per_sample if facts else None,
                      shardable=mode_strategy(cfg).shardable)
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"mlxdist.plan: {what}; {len(hosts)} rank(s) from {source}; dist.shard={cfg.dist.shard}")
    for line in result.table_lines(choice=False):
        print(line)
    elements = lm_stage_elements(cfg)
    if elements is not None and len(hosts) > 1:
        speeds = [cfg.node_for(h, i).speed for i, (h, _) in enumerate(hosts)]
        state_bytes = make_optimizer(cfg.train.optimizer, cfg.train).state_bytes
        for line in cut_lines(elements, state_bytes, [h for h, _ in hosts], [r.budget for r in result.ranks], speeds):
            print(line)
        for line in _mode_lines(cfg, result, elements, state_bytes, n_params, hosts, speeds, link_bps, tflops,
                                args.link):
            print(line)
    if result.choice is None:
        print(f"error: {result.no_fit_line()}", file=sys.stderr)
        return 2
    print(result.choice_line())
    if cfg.dist.shard != "auto" and result.problem(cfg.dist.shard):
        print(f"warning: dist.shard={cfg.dist.shard} as configured does not fit: {result.problem(cfg.dist.shard)}")
    return 0


def _mode_lines(cfg: Config, result, elements: list[int], state_bytes: int, n_params: int,
                hosts: list[tuple[str, int]], speeds: list[float], link_bps: float, tflops: list[float] | None,
                link: str) -> list[str]:
    """Data parallel, ZeRO-1/2, ZeRO-3 and the pipeline on these hosts over `link`: each one's bytes a step,
    and with `tflops` the predicted step and which to use."""
    from ..models.presets import resolve

    samples = [cfg.node_for(h, i).batch_size for i, (h, _) in enumerate(hosts)]
    flops = [t * 1e12 for t in tflops] if tflops else [s * 1e12 for s in speeds]
    if tflops and len(set(tflops)) > 1 and len(set(speeds)) == 1:
        speeds = [t / max(tflops) for t in tflops]  # the cut a run gets with nodes: speed set so
    costs, nbytes = stage_loads(elements, state_bytes)
    try:
        cuts = cut_stages(costs, nbytes, speeds, [r.budget for r in result.ranks], LAST_RUN)
    except ConfigError:
        cuts = None
    times = predict(n_params, elements, cuts or [(0, len(elements))] * len(hosts), samples,
                    [r.micro_batch for r in result.ranks], cfg.data.seq_len, resolve(cfg.model).dim, link_bps, flops)
    fits = {"data parallel": result.problem("none") is None,
            "ZeRO-1/2": result.problem("optimizer") is None or result.problem("gradients") is None,
            "ZeRO-3": result.problem("weights") is None, "pipeline": cuts is not None}
    if tflops:
        lines = advice_lines(times, fits, link)
        if cuts is not None and speeds != [cfg.node_for(h, i).speed for i, (h, _) in enumerate(hosts)]:
            lines.append("  (the pipeline cut by --tflops: " + ", ".join(
                f"rank {r} stages {a}-{b - 1}" for r, (a, b) in enumerate(cuts)) + "; set nodes: {HOST: {speed: ...}} "
                f"to {', '.join(f'{v:.2g}' for v in speeds)} so the run cuts so)")
        return lines
    moved = ", ".join(f"{t.mode} {t.exchange_bytes / 1e6:.4g} MB ({t.exchange_bytes * 8 / link_bps:.3g} s)"
                      for t in times)
    return [f"exchange a step over the busiest link at {link}: {moved}; give --tflops (each Mac's training "
            "TFLOP/s) to predict each mode's step and pick one"]


if __name__ == "__main__":
    sys.exit(main())
