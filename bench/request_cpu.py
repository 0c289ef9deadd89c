"""Server CPU per request, one request at a time: ``python -m bench.request_cpu [TREE ...]``.

wrk's ratios against a raw app (bench/throughput.py) move with the machine: the raw app's
own cost swung 2x between runs in one noisy hour. This asks less of the machine. One
keep-alive connection sends a request and waits for its answer, 20,000 times per route,
to a Detour of each given tree (a checkout's directory; default this one) on its own
redis-server. The number is the Detour process's CPU (``/proc/<pid>/stat``) over the
requests, in µs. Trees alternate, twice, so a slow minute falls on both.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = 20_000
WARM_UP = 2_000


def _post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


ROUTES = {
    "select": _post("/select", b'{"topic": "t"}'),
    # under 550 ms: kept on the replica, the direct lane's report
    "report": _post("/report-latency", b'{"brokerName": "b1", "latencyMs": 20}'),
}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _exchange(sock: socket.socket, request: bytes) -> None:
    sock.sendall(request)
    if not sock.recv(65536):
        raise RuntimeError("the server closed the connection")


def measure(tree: Path) -> dict[str, float]:
    """µs of server CPU per request, per route, for a Detour run from ``tree``."""
    port, redis_port = free_port(), free_port()
    redis = subprocess.Popen(
        ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    detour = subprocess.Popen(
        [sys.executable, "-m", "service", "--port", str(port),
         "--redis-url", f"redis://127.0.0.1:{redis_port}/0"],
        cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(200):  # bounded: 20 s
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"{tree}: Detour did not start")
        with sock:
            route = b'{"brokers": [{"brokerName": "b1", "writeQueueNums": 4}]}'
            put = _post("/routes/t", route).replace(b"POST", b"PUT", 1)
            _exchange(sock, put)
            out = {}
            for name, request in ROUTES.items():
                for _ in range(WARM_UP):
                    _exchange(sock, request)
                start = _cpu_s(detour.pid)
                for _ in range(REQUESTS):
                    _exchange(sock, request)
                out[name] = round((_cpu_s(detour.pid) - start) / REQUESTS * 1e6, 1)
            return out
    finally:
        detour.terminate()
        detour.wait(10)
        redis.terminate()
        redis.wait(10)


def main(argv: list[str]) -> int:
    trees = [Path(a).resolve() for a in argv] or [ROOT]
    for round_ in (1, 2):
        for tree in trees:
            print(json.dumps({"round": round_, "tree": str(tree), "us": measure(tree)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
