"""Print a Prometheus `scrape_configs` block for every rank a hostfile launches.

Each rank serves its metrics on `metrics.port + local rank`, so the ports on a host
depend on how many slots it has; writing the targets by hand invites an off-by-one that
silently drops a rank from the dashboard. Reading the same hostfile that `launch/mlxrun`
uses keeps the two in step.

    python -m mlxdist.scrape_config --hostfile hostfiles/studio+macbook.hosts [--port 9400]
        [--rules configs/prometheus-rules.yml]

With `--rules` the output is a whole Prometheus config (`prometheus --config.file=...`): the
alert rules are loaded and evaluated as often as the ranks are scraped.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..launch.hosts import HostEntry, LaunchError, read_hostfile

JOB = "mlxdist"


def targets(hosts: list[HostEntry], port: int) -> list[tuple[int, str]]:
    """(global rank, "host:port") in Open MPI's default by-slot order, the order ranks are numbered in."""
    out, rank = [], 0
    for h in hosts:
        name = f"[{h.name}]" if ":" in h.name else h.name  # IPv6 literals need brackets before a port
        for local in range(h.slots):
            out.append((rank, f"{name}:{port + local}"))
            rank += 1
    return out


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"  # a YAML single-quoted scalar


def render(hosts: list[HostEntry], port: int, interval: str = "5s", rules: Sequence[Path] = ()) -> str:
    # Written by hand rather than with yaml.dump so each target carries its rank as a comment.
    lines: list[str] = []
    if rules:
        # Prometheus evaluates rules every minute by default: a stalled rank would be seen late.
        lines += ["global:", f"  evaluation_interval: {interval}", "rule_files:"]
        # Absolute: Prometheus resolves relative rule paths against the config file's folder.
        lines += [f"  - {_quoted(str(r.resolve()))}" for r in rules]
    lines += ["scrape_configs:",
             f"  - job_name: {JOB}",
             f"    scrape_interval: {interval}",
             "    # rank and host come from the metrics' own labels; keep them over target labels",
             "    honor_labels: true",
             "    static_configs:",
             "      - targets:"]
    lines += [f"          - '{t}'  # rank {r}" for r, t in targets(hosts, port)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlxdist.scrape_config",
                                 description="Prometheus scrape_configs for the ranks of an Open MPI hostfile.")
    ap.add_argument("--hostfile", required=True, help="Open MPI hostfile (`name slots=N` lines)")
    ap.add_argument("--port", type=int, default=9400, help="metrics.port of the run (rank i on a host uses port+i)")
    ap.add_argument("--interval", default="5s", help="scrape_interval (default 5s: steps are short)")
    ap.add_argument("--rules", action="append", default=[], type=Path, metavar="FILE",
                    help="alert rules to load (configs/prometheus-rules.yml); makes a whole Prometheus config")
    args = ap.parse_args(argv)
    if not 0 < args.port < 65536:
        print(f"scrape_config: --port {args.port} is not a TCP port (1-65535)", file=sys.stderr)
        return 2
    try:
        hosts = read_hostfile(args.hostfile)
    except LaunchError as e:
        print(f"scrape_config: {e}", file=sys.stderr)
        return 2
    top = args.port + max(h.slots for h in hosts) - 1
    if top > 65535:
        print(f"scrape_config: ports {args.port}..{top} run past 65535; choose a lower --port", file=sys.stderr)
        return 2
    for r in args.rules:
        if not r.is_file():
            print(f"scrape_config: --rules {r}: no such file; pass the path of configs/prometheus-rules.yml",
                  file=sys.stderr)
            return 2
    sys.stdout.write(render(hosts, args.port, args.interval, args.rules))
    return 0


if __name__ == "__main__":
    sys.exit(main())
