"""The fleet benchmarks' subscriptions in one C process (bench/receiver.c), built on first
use with the machine's C compiler and driven over its stdin and stdout.

Why a separate reader: the propagation of a push is measured where it arrives, and a
Python event loop reading thousands of subscriptions adds its own delay (about 100 ms a
push at 4,000 on this machine), far above Redis's share. The C reader stamps each arrival
with CLOCK_MONOTONIC, the clock of ``time.perf_counter()``, so the bench subtracts its own
send times from them.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

SOURCE = Path(__file__).with_name("receiver.c")


def build() -> Path:
    """The compiled reader, cached by its source's hash (rebuilt when the source changes)."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    binary = Path(tempfile.gettempdir()) / f"detour-bench-receiver-{digest}"
    if binary.exists():
        return binary
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("the fleet bench's reader needs a C compiler (make system-deps)")
    partial = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
    subprocess.run([cc, "-O2", "-o", str(partial), str(SOURCE)], check=True, timeout=120)
    partial.replace(binary)  # atomic: a concurrent build never runs a half-written binary
    return binary


class Receiver:
    """``n`` subscriptions to ``channel``, subscription i on ``ports[i % len(ports)]``."""

    def __init__(self, channel: str, n: int, ports: Sequence[int]) -> None:
        self.channel, self.n, self.ports = channel, n, list(ports)
        self._proc: asyncio.subprocess.Process | None = None
        #: subscriptions the servers closed (each is a push it will never see)
        self.closed = 0

    async def start(self, timeout_s: float = 120) -> None:
        """Start the reader; returns once every subscription is confirmed."""
        self._proc = await asyncio.create_subprocess_exec(
            str(build()), self.channel, str(self.n), *map(str, self.ports),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=1 << 20,
        )
        assert self._proc.stdout is not None
        line = await asyncio.wait_for(self._proc.stdout.readline(), timeout_s)
        if line != b"ready\n":
            code = await asyncio.wait_for(self._proc.wait(), 10)
            raise RuntimeError(f"the reader did not start (exit {code}): {line!r}")

    async def arrivals(self, timeout_s: float = 30) -> list[tuple[bytes, int, float]]:
        """Every arrival since the last call: (broker name, subscription, perf_counter s)."""
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"dump\n")
        await proc.stdin.drain()
        out: list[tuple[bytes, int, float]] = []
        async with asyncio.timeout(timeout_s):
            while True:
                line = await proc.stdout.readline()
                if not line:
                    raise RuntimeError("the reader exited")
                if line.startswith(b"end "):
                    self.closed = int(line.split()[1])
                    return out
                name, sub, t = line.split()
                out.append((name, int(sub), int(t) / 1e9))

    async def close(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        assert proc.stdin is not None
        proc.stdin.write(b"quit\n")
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()
