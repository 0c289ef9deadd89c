"""Requests the HTTP parser refuses, on a live server: 400 in the Error shape, then close.

uvicorn answers a parser error with ``400 Invalid HTTP request received.`` in plain text;
Detour's contract is one JSON shape for every error (README, docs/security.md). Each
request below is refused by the parser, on the ASGI way in and on the direct lane's, at
the start of a connection and behind a request that was answered, and must get the
Error shape with 400 and a closed connection. Raw sockets to ``python -m service`` on
127.0.0.1.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.procs import ServiceProcess

pytestmark = [pytest.mark.e2e]

SELECT_BODY = json.dumps({"topic": "orders"}).encode()
SELECT = (b"POST /select HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
          b"content-length: %d\r\n\r\n%s" % (len(SELECT_BODY), SELECT_BODY))
HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"

MALFORMED = {
    "unknown method": b"FOO /select HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n",
    "control character in the target": b"GET /sel\x01ect HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n",
    "control character in a header":
        b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\nx: a\x01b\r\n\r\n",
    "bare LF": b"GET /healthz HTTP/1.1\nhost: 127.0.0.1\n\n",
    "not HTTP": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,
    "bad chunk size": b"PUT /config HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
                      b"\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
}


@pytest.fixture(scope="module")
def svc() -> Iterator[ServiceProcess]:
    with ServiceProcess() as proc:
        httpx.put(proc.url + "/routes/orders", timeout=10, json={
            "brokers": [{"brokerName": "broker-a", "writeQueueNums": 2}]}).raise_for_status()
        yield proc


def answers_until_closed(port: int, data: bytes) -> list[tuple[int, bytes]]:
    """Send ``data``; every answer (status, body) until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    out = []
    while buf:
        head, _, rest = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").lower().split("\r\n")
        length = int(next(ln.split(":")[1] for ln in lines if ln.startswith("content-length")))
        out.append((int(lines[0].split()[1]), rest[:length]))
        buf = rest[length:]
    return out


def is_bad_request(answer: tuple[int, bytes]) -> None:
    status, body = answer
    assert status == 400, answer
    error = json.loads(body)
    assert set(error) == {"error", "message", "field"}, error
    assert error["error"] == "BAD_REQUEST" and error["message"].startswith("malformed HTTP")


@pytest.mark.parametrize("what", MALFORMED)
@pytest.mark.parametrize("behind", ["nothing", "an answered select", "an answered probe"])
def test_a_request_the_parser_refuses_is_400_json_and_closes(
    svc: ServiceProcess, what: str, behind: str
) -> None:
    first = {"nothing": b"", "an answered select": SELECT, "an answered probe": HEALTHZ}[behind]
    # The connection is closed after the 400: nothing sent after it is answered.
    out = answers_until_closed(svc.port, first + MALFORMED[what] + HEALTHZ)
    if first:
        assert out[0][0] == 200, out
        out = out[1:]
    assert len(out) == 1, out
    is_bad_request(out[0])


def test_parser_refusals_are_counted(svc: ServiceProcess) -> None:
    def count() -> float:
        for line in httpx.get(svc.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith('detour_edge_refused_total{reason="malformed"}'):
                return float(line.split()[-1])
        return 0.0

    before = count()
    is_bad_request(answers_until_closed(svc.port, MALFORMED["unknown method"])[0])
    assert count() == before + 1
