"""Heartbeat side channel: each rank tells every other rank, a few times per stall timeout,
that it is alive and how far it got, over UDP beside MPI.

Why not MPI: the job initialises MPI without thread support, and the moment this is
needed (a rank stuck in a collective) MPI is the thing that hangs. A sleeping laptop,
a SIGSTOPped or crashed process, or a pulled cable all stop its heartbeats, so the
ranks left waiting can name it. Packets go only to the job's own ranks (addresses
all-gathered once at start) and are accepted only from them (source address and a
per-job token).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

Status = Callable[[], tuple[int, str | None]]


def local_address(hosts: list[str], me: int) -> str:
    """The address this rank's peers reach it on: loopback when all ranks share this host,
    else the source address the OS routes toward a peer host (the interface MPI uses too).
    `MLXDIST_RING_IP` overrides it, as it does for the ring backend."""
    override = os.environ.get("MLXDIST_RING_IP")
    if override:
        return override
    others = [h for h in hosts if h != hosts[me]]
    if not others:
        return "127.0.0.1"
    target = socket.gethostbyname(others[0])
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((target, 9))
        return s.getsockname()[0]
    finally:
        s.close()


class Heartbeat:
    """One UDP socket and one daemon thread per rank: send every `interval`, receive between."""

    def __init__(self, rank: int, hosts: list[str], address: str, interval: float, status: Status):
        self.rank, self.hosts, self.interval, self.status = rank, hosts, interval, status
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((address, 0))
        self.address = self.sock.getsockname()
        self.token = secrets.token_hex(8)
        self.peers: list[tuple[str, int]] = []
        n = len(hosts)
        self.last_seen: list[float | None] = [None] * n
        self.progress: list[int | None] = [None] * n
        self.doing: list[str | None] = [None] * n
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")

    @classmethod
    def start(cls, world: Any, interval: float, status: Status) -> Heartbeat:
        """Collective (all ranks call it from the main thread, before training starts)."""
        hosts = world.allgather(world.host)
        hb = cls(world.rank, hosts, local_address(hosts, world.rank), interval, status)
        table = world.allgather((hb.address, hb.token))
        hb.peers = [tuple(addr) for addr, _ in table]
        hb.token = table[0][1]
        hb._thread.start()
        atexit.register(hb.close)
        return hb

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval * 2 + 1)
        self.sock.close()

    def _send(self) -> None:
        progress, doing = self.status()
        packet = json.dumps([self.token, self.rank, progress, doing]).encode()
        for r, peer in enumerate(self.peers):
            if r != self.rank:
                # unreachable now: the silence is what the peer will report
                with contextlib.suppress(OSError):
                    self.sock.sendto(packet, peer)

    def _receive(self, data: bytes, source: tuple[str, int]) -> None:
        try:
            token, rank, progress, doing = json.loads(data)
        except (ValueError, TypeError):
            return
        if token != self.token or not isinstance(rank, int) or not 0 <= rank < len(self.peers) \
                or tuple(source) != self.peers[rank] or rank == self.rank:
            return
        self.last_seen[rank] = time.monotonic()
        self.progress[rank] = progress if isinstance(progress, int) else None
        self.doing[rank] = doing if isinstance(doing, str) else None

    def _run(self) -> None:
        next_send = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_send:
                self._send()
                next_send = now + self.interval
            self.sock.settimeout(max(0.01, next_send - time.monotonic()))
            try:
                data, source = self.sock.recvfrom(1024)
            except OSError:  # timeout, or the socket closed under us at exit
                continue
            self._receive(data, source)
