"""Keeping a Mac awake while it trains: `caffeinate` (macOS only), behind pure functions
that take the platform, so their logic is tested on Linux.

`caffeinate -i` stops idle sleep, the kind that ends a long run on a MacBook left alone.
It does not stop sleep when a MacBook's lid closes (docs/running-on-macs.md, "On a Mac").
"""

from __future__ import annotations

import subprocess
import sys


def keep_awake_prefix(platform: str) -> list[str]:
    """Words to put before a rank's command so the Mac stays awake while it runs
    (`caffeinate -i python ...`); nothing elsewhere."""
    return ["caffeinate", "-i"] if platform == "darwin" else []


def keep_awake_argv(platform: str, pid: int) -> list[str]:
    """A command that holds the Mac awake until process `pid` exits (`caffeinate -i -w PID`),
    started beside a running rank rather than around it; nothing elsewhere."""
    return ["caffeinate", "-i", "-w", str(pid)] if platform == "darwin" else []


def hold_awake(pid: int, platform: str = sys.platform) -> subprocess.Popen | None:
    """Start `keep_awake_argv` for `pid` (None where there is nothing to start, or
    `caffeinate` is missing). The helper ends by itself when `pid` does."""
    argv = keep_awake_argv(platform, pid)
    if not argv:
        return None
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None
