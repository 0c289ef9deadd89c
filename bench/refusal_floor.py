"""The refusal floor: a server that refuses every request, and does nothing else.

``python -m bench.refusal_floor --port N`` serves HTTP/1.1 on 127.0.0.1 with the same
machinery as Detour's protocol (uvloop, httptools' parser, one ``asyncio.Protocol`` per
connection) and answers every complete request with Detour's own 503 SYSTEM_BUSY bytes,
precomputed. It has no app, no metrics, no shedding policy, no answers: whatever rate it
cannot refuse under a CPU cap, no shedding policy on this stack can refuse either, since
each request must still be read, parsed and answered. ``bench/overload.py --floor``
offers it the same loads as Detour under the same cap, so the bar is checked against
what is possible, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

import httptools
import uvloop

from service.edge import answers

#: Byte for byte what Detour's shedder writes (service/edge/answers.py).
BUSY = answers.BUSY


class Refuser(asyncio.Protocol):
    """One connection: every request it completes is answered 503, in order."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.pending = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()
            return
        if self.pending and self.transport is not None:
            # One write per read, as Detour's outbox does per turn.
            self.transport.write(BUSY * self.pending)
            self.pending = 0

    def on_message_complete(self) -> None:
        self.pending += 1


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Refuser, "127.0.0.1", port, backlog=2048)
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    loop.add_signal_handler(signal.SIGINT, stop.set_result, None)
    print(f"refusal floor on 127.0.0.1:{port}", flush=True)
    await stop
    server.close()


@contextlib.contextmanager
def running(port: int) -> Iterator[subprocess.Popen[str]]:
    """The floor in a process of its own on ``port``, until the block ends."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "bench.refusal_floor", "--port", str(port)],
                            cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if not proc.stdout.readline().startswith("refusal floor on"):
            raise RuntimeError("the refusal floor did not start")
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.refusal_floor", description=__doc__)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    uvloop.run(serve(args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
