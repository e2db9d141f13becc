"""Turn a run's JSONL event logs into PNG plots and a short Markdown summary.

The logs are the only record that survives after the Prometheus endpoints are gone, so
this works offline from `RUN_DIR/logs/rank*.jsonl` alone. The summary never needs
matplotlib: on a bare cluster node you still get the numbers, and the plots can be made
later on a laptop.

    python -m mlxdist.report RUN_DIR [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import gate

_RANK_FILE = re.compile(r"rank(\d+)\.jsonl$")
_COUNTED = ("drift_repair", "rollback", "balance", "checkpoint")


class ReportError(Exception):
    """A problem with the run directory that the user can fix; printed as one line."""


@dataclass
class Run:
    """Events of one run, split the way the plots need them."""

    # rank -> step events, one per step (the last one wins; see load_run)
    steps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    # rank -> every other event, in file order
    other: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    bad_lines: int = 0
    first_bad: str = ""  # the first unreadable line: file:line and why

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.steps) | set(self.other))

    @property
    def main(self) -> int:
        """Rank whose copy of cluster-wide events (loss, eval, balance...) we trust: 0 if present."""
        return self.ranks[0]

    def events(self, name: str, rank: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.other.get(self.main if rank is None else rank, []) if e["event"] == name]

    def label(self, rank: int) -> str:
        return f"{self.hosts.get(rank, '?')} rank {rank}"


# The fields the report computes with, and what they must be for its arithmetic to hold; the
# rest of a line is plain data it passes over. sync_s and data_wait_s are divided, so not null.
_NUMBER = gate.Maybe(gate.Float(finite=False))
_EVENT = gate.Dict(
    fields={"event": gate.Str(200), "step": gate.Int(lo=0), "host": gate.Str(),
            "shares": gate.Maybe(gate.List(gate.Int(), max_len=1 << 16)),
            "sync_s": gate.Float(finite=False), "data_wait_s": gate.Float(finite=False),
            **{k: _NUMBER for k in ("loss", "eval_loss", "step_s", "units_per_s", "tokens_per_s",
                                    "cluster_units_per_s", "cluster_tokens_per_s", "memory_active_bytes",
                                    "memory_peak_bytes")}},
    required=("event",), values=gate.Tree())
_STEPPED = ("step", "eval", "rollback", "balance")  # events the report places by their step


def load_run(run_dir: Path) -> Run:
    """The run's events. A line that cannot be read (half written by a killed rank, not UTF-8,
    a field of the wrong type) is skipped and counted, and the first one is named in the
    summary: a post-mortem still comes out of a log with one bad line, and says where it is."""
    logs = run_dir / "logs"
    files = sorted((p for p in logs.glob("rank*.jsonl") if _RANK_FILE.search(p.name)),
                   key=lambda p: int(_RANK_FILE.search(p.name).group(1))) if logs.is_dir() else []
    if not files:
        raise ReportError(f"{run_dir}: no event logs (expected {logs}/rank0.jsonl from `python -m mlxdist.train`)")
    run = Run()
    for path in files:
        rank = int(_RANK_FILE.search(path.name).group(1))
        by_step: dict[int, dict[str, Any]] = {}
        other: list[dict[str, Any]] = []
        try:
            for n, raw in gate.jsonl_lines(path, "event log"):
                if not raw.strip():
                    continue
                try:
                    e = gate.check(gate.parse_json_line(raw, path, n, "event log"), _EVENT, f"{path}:{n}")
                    if e["event"] in _STEPPED and "step" not in e:
                        raise gate.refuse(f"{path}:{n}", f"a '{e['event']}' event without 'step'")
                except gate.FileRefused as bad:
                    run.bad_lines += 1
                    run.first_bad = run.first_bad or str(bad)
                    continue
                if "host" in e:
                    run.hosts[rank] = e["host"]
                if e["event"] == "step":
                    # Logs are appended across resumes and rollbacks redo steps: the latest
                    # record of a step is the one whose weights carried on.
                    by_step[e["step"]] = e
                else:
                    other.append(e)
        except gate.FileRefused as e:  # not a regular file, or a line too long to be a log's
            raise ReportError(str(e)) from None
        run.steps[rank] = [by_step[s] for s in sorted(by_step)]
        run.other[rank] = other
    if not any(run.steps.values()) and not any(run.other.values()):
        raise ReportError(f"{run_dir}: event logs are empty (did the run reach its first step?)"
                          + (f"; {run.bad_lines} unreadable lines, the first: {run.first_bad}" if run.bad_lines else ""))
    return run


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _num(x: float | None, fmt: str = ".4f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and x == x and abs(x) != float("inf")


def summarize(run: Run, run_dir: Path) -> str:
    main = run.steps.get(run.main, [])
    losses = [(e["step"], e["loss"]) for e in main if _finite(e.get("loss")) and not e.get("skipped")]
    evals = [(e["step"], e["eval_loss"]) for e in run.events("eval") if _finite(e.get("eval_loss"))]
    end = run.events("end")
    last_step = max([e["step"] for e in main] + [e.get("step", 0) for e in end] or [0])
    lines = [f"# Run report: {run_dir}", ""]
    lines.append(f"- steps: {last_step}" + (f" (ended: {end[-1].get('reason', '?')})" if end else " (no end event: still running or crashed)"))
    lines.append(f"- ranks: {len(run.ranks)} ({', '.join(run.label(r) for r in run.ranks)})")
    if losses:
        best = min(losses, key=lambda sl: sl[1])
        lines.append(f"- loss: first {losses[0][1]:.4f}, final {losses[-1][1]:.4f}, best {best[1]:.4f} at step {best[0]}")
    if evals:
        best = min(evals, key=lambda sl: sl[1])
        lines.append(f"- eval loss: final {evals[-1][1]:.4f} at step {evals[-1][0]}, best {best[1]:.4f} at step {best[0]}")
    cluster = _mean([e.get("cluster_units_per_s", e.get("cluster_tokens_per_s")) for e in main])
    lines.append(f"- cluster tokens/s (mean): {_num(cluster, ',.0f')}")
    skipped = sum(1 for e in main if e.get("skipped"))
    counts = {name: len(run.events(name)) for name in _COUNTED}
    lines.append(f"- skipped steps (non-finite): {skipped}; drift repairs: {counts['drift_repair']}; "
                 f"rollbacks: {counts['rollback']}; balance changes: {counts['balance']}; "
                 f"checkpoints: {counts['checkpoint']}")
    if run.bad_lines:
        lines.append(f"- unreadable log lines ignored: {run.bad_lines} (the first: {run.first_bad})")
    lines += ["", "| rank | host | steps | tokens/s (mean) | sync / step | data wait / step | peak memory |",
              "|---|---|---|---|---|---|---|"]
    all_sync: list[float] = []
    all_wait: list[float] = []
    for r in run.ranks:
        ev = run.steps.get(r, [])
        timed = [e for e in ev if _finite(e.get("step_s")) and e["step_s"] > 0]
        sync = [e.get("sync_s", 0.0) / e["step_s"] for e in timed]
        wait = [e.get("data_wait_s", 0.0) / e["step_s"] for e in timed]
        all_sync += sync
        all_wait += wait
        peaks = [e["memory_peak_bytes"] for e in ev if _finite(e.get("memory_peak_bytes"))]
        peak = f"{max(peaks) / 2**30:.2f} GiB" if peaks else "n/a"
        lines.append(f"| {r} | {run.hosts.get(r, '?')} | {len(ev)} | "
                     f"{_num(_mean([e.get('units_per_s', e.get('tokens_per_s')) for e in ev]), ',.0f')} | "
                     f"{_pct(_mean(sync))} | {_pct(_mean(wait))} | {peak} |")
    lines += ["", f"Mean sync fraction of step time: {_pct(_mean(all_sync))}; "
              f"mean data-wait fraction: {_pct(_mean(all_wait))}."]
    return "\n".join(lines) + "\n"


def plot(run: Run, out: Path) -> list[Path]:
    """Write the PNGs; raises ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def new(title: str, ylabel: str, nrows: int = 1):
        fig, axes = plt.subplots(nrows, 1, figsize=(9, 4 * nrows), sharex=True, squeeze=False)
        axes = [a[0] for a in axes]
        axes[0].set_title(title)
        for ax in axes:
            ax.grid(True, alpha=0.3)
            ax.set_ylabel(ylabel)
        axes[-1].set_xlabel("step")
        return fig, axes

    main = run.steps.get(run.main, [])

    # Loss: cluster-wide token mean, so one rank's copy is the whole story.
    fig, (ax,) = new("Loss", "loss")
    pts = [(e["step"], e["loss"]) for e in main if _finite(e.get("loss"))]
    if pts:
        ax.plot(*zip(*pts, strict=True), label="train loss", lw=1.2)
    evals = [(e["step"], e["eval_loss"]) for e in run.events("eval") if _finite(e.get("eval_loss"))]
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss", lw=1.5, ms=5)
    bad = [e["step"] for e in main if e.get("skipped")]
    for i, s in enumerate(bad):
        ax.axvline(s, color="red", alpha=0.3, lw=0.8, label="skipped step" if i == 0 else None)
    for i, e in enumerate(run.events("rollback")):
        ax.axvline(e["step"], color="black", ls="--", lw=1, label="rollback" if i == 0 else None)
    ax.legend()
    save(fig, "loss.png")

    # Throughput: per rank shows which machine is the straggler; the cluster line shows the total.
    fig, (ax,) = new("Throughput", "tokens/s")
    for r in run.ranks:
        ev = run.steps.get(r, [])
        ax.plot([e["step"] for e in ev], [e.get("units_per_s", e.get("tokens_per_s", 0)) for e in ev],
                label=run.label(r), lw=1)
    if len(run.ranks) > 1:
        ax.plot([e["step"] for e in main], [e.get("cluster_units_per_s", e.get("cluster_tokens_per_s", 0)) for e in main],
                "k--", label="cluster", lw=1.2)
    ax.set_ylim(bottom=0)
    ax.legend()
    save(fig, "throughput.png")

    # Batch split: the balancer's decisions made visible; the shares list is identical on all ranks.
    fig, (ax,) = new("Batch split (samples of each global step per rank)", "samples")
    shared = [e for e in main if isinstance(e.get("shares"), list)]
    n = max((len(e["shares"]) for e in shared), default=0)
    if shared and n:
        steps = [e["step"] for e in shared]
        stacks = [[e["shares"][i] if i < len(e["shares"]) else 0 for e in shared] for i in range(n)]
        ax.stackplot(steps, stacks, labels=[run.label(i) if i in run.hosts else f"rank {i}" for i in range(n)],
                     step="post", alpha=0.8)
        for i, e in enumerate(run.events("balance")):
            ax.axvline(e["step"], color="black", ls=":", lw=0.8, label="rebalance" if i == 0 else None)
        ax.legend(loc="lower right")
    save(fig, "shares.png")

    # Memory: only once the trainer logs it; an empty plot would only mislead.
    if any(_finite(e.get("memory_active_bytes")) or _finite(e.get("memory_peak_bytes"))
           for ev in run.steps.values() for e in ev):
        fig, (ax,) = new("Memory per rank", "GiB")
        for i, r in enumerate(run.ranks):
            ev = run.steps.get(r, [])
            # One colour per rank: solid = active, dashed = peak.
            for key, style in (("memory_active_bytes", "-"), ("memory_peak_bytes", "--")):
                pts = [(e["step"], e[key] / 2**30) for e in ev if _finite(e.get(key))]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, color=f"C{i % 10}", lw=1,
                            label=f"{run.label(r)} {key.split('_')[1]}")
        ax.set_ylim(bottom=0)
        ax.legend()
        save(fig, "memory.png")

    # Where the step time goes besides compute: all-reduce and waiting for data.
    fig, (ax1, ax2) = new("Sync and data wait per step", "seconds", nrows=2)
    for r in run.ranks:
        ev = run.steps.get(r, [])
        steps = [e["step"] for e in ev]
        ax1.plot(steps, [e.get("sync_s", 0) for e in ev], lw=1, label=run.label(r))
        ax2.plot(steps, [e.get("data_wait_s", 0) for e in ev], lw=1, label=run.label(r))
    ax1.set_ylabel("all-reduce (s)")
    ax2.set_ylabel("data wait (s)")
    ax1.legend()
    save(fig, "timing.png")
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlxdist.report",
                                 description="Plots and a summary from a run's event logs.")
    ap.add_argument("run_dir", type=Path, help="the train.out_dir of a run (holds logs/rank*.jsonl)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/report)")
    args = ap.parse_args(argv)
    try:
        run = load_run(args.run_dir)
    except ReportError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    text = summarize(run, args.run_dir)
    (out / "summary.md").write_text(text)
    print(text, end="")
    try:
        written = plot(run, out)
    except ImportError:
        print(f"report: plots need matplotlib (pip install matplotlib); wrote only {out / 'summary.md'}",
              file=sys.stderr)
        return 2
    print(f"wrote {out / 'summary.md'} and {len(written)} plots: {', '.join(p.name for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
