"""Heads Detour does not serve, on a live server, both ways in (service/edge/heads.py).

A protocol upgrade (WebSocket, h2c, CONNECT), a version other than HTTP/1.0 and 1.1, a
second Host, and an HTTP/1.1 request without a Host or with one that is not host[:port]
are each refused 400 in the Error shape, naming the header where there is
one, and the connection closed: nothing after them on the connection is answered, and
nothing they carried is applied. Before, a WebSocket upgrade went to uvicorn's WebSocket
protocol (a plain-text 403, and the peer's connection slot never given back), an h2c
upgrade lost its body and hung its connection, and the others were served. Also here:
the Host of an absolute-form target is the one judged, a Host with something other than
a port after its name is foreign, and a repeated Content-Type is no JSON type, on both
ways in alike. Raw sockets to ``python -m service`` on 127.0.0.1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.procs import ServiceProcess
from tests.test_malformed import answers_until_closed as exchange

pytestmark = [pytest.mark.e2e]

#: Per-peer connections: small, so that a slot never given back shows at once.
PER_PEER = 4


@pytest.fixture(scope="module", params=["direct lane", "ASGI only"])
def svc(request: pytest.FixtureRequest) -> Iterator[ServiceProcess]:
    env = {"DETOUR_MAX_CONNECTIONS_PER_PEER": str(PER_PEER)}
    if request.param == "ASGI only":
        env["DETOUR_DIRECT_LANE"] = "false"
    with ServiceProcess(env=env) as proc:
        httpx.put(proc.url + "/routes/orders", timeout=10, json={
            "brokers": [{"brokerName": "broker-a", "writeQueueNums": 2}]}).raise_for_status()
        yield proc


REPORT = b'{"brokerName": "upgraded", "latencyMs": 5000}'
HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
WEBSOCKET = (b"GET /routes HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: Upgrade\r\n"
             b"upgrade: websocket\r\nsec-websocket-version: 13\r\n"
             b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
#: (request, the field the 400 names)
REFUSED = {
    "WebSocket upgrade": (WEBSOCKET, "Upgrade"),
    "h2c upgrade with a body": (
        b"POST /report-latency HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
        b"\r\nconnection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\n"
        b"http2-settings: AAMAAABkAAQAoAAAAAIAAAAA\r\ncontent-length: %d\r\n\r\n%s"
        % (len(REPORT), REPORT), "Upgrade"),
    "CONNECT": (b"CONNECT 127.0.0.1:80 HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n", None),
    "HTTP/2.0 written as text": (b"GET /routes HTTP/2.0\r\nhost: 127.0.0.1\r\n\r\n", None),
    "a version-less line": (b"GET /routes\r\n\r\n", None),
    "two Hosts": (b"GET /routes HTTP/1.1\r\nhost: 127.0.0.1\r\nhost: 127.0.0.1\r\n\r\n", "Host"),
    "HTTP/1.1 without a Host": (b"GET /routes HTTP/1.1\r\n\r\n", "Host"),
    "a select without a Host": (
        b"POST /select HTTP/1.1\r\ncontent-type: application/json\r\ncontent-length: 19\r\n"
        b"\r\n{\"topic\": \"orders\"}", "Host"),
    "a probe's Host with a space": (b"GET /healthz HTTP/1.1\r\nhost: a b\r\n\r\n", "Host"),
    "a Host with a user": (b"GET /routes HTTP/1.1\r\nhost: u@127.0.0.1\r\n\r\n", "Host"),
    "a probe's Host with a path": (b"GET /readyz HTTP/1.1\r\nhost: 127.0.0.1/x\r\n\r\n",
                                   "Host"),
    "a Host with no port after it": (b"GET /routes HTTP/1.1\r\nhost: localhost:http\r\n\r\n",
                                     "Host"),
}  # fmt: skip


@pytest.mark.parametrize("what", REFUSED)
@pytest.mark.parametrize("behind", ["nothing", "an answered probe"])
def test_a_head_detour_does_not_serve_is_400_json_and_closes(
    svc: ServiceProcess, what: str, behind: str
) -> None:
    raw, field = REFUSED[what]
    first = HEALTHZ if behind != "nothing" else b""
    out = exchange(svc.port, first + raw + HEALTHZ)
    if first:
        assert out[0][0] == 200, out
        out = out[1:]
    assert len(out) == 1, out  # the probe sent after it is never answered
    status, body = out[0]
    error = json.loads(body)
    assert status == 400 and set(error) == {"error", "message", "field"}, out
    assert error["error"] == "BAD_REQUEST" and error["field"] == field, error
    # What an upgrade carried was not applied.
    items = httpx.get(svc.url + "/fault-items", timeout=10).json()["items"]
    assert all(item["brokerName"] != "upgraded" for item in items)


@pytest.mark.parametrize("raw", [
    b"GET /routes HTTP/1.0\r\n\r\n",
    b"GET /healthz HTTP/1.1\r\nhost:\r\nconnection: close\r\n\r\n",
    b"GET /routes HTTP/1.1\r\nhost: [::1]:8080\r\nconnection: close\r\n\r\n",
    b"GET /routes HTTP/1.1\r\nhost: LOCALHOST.\r\nconnection: close\r\n\r\n",
], ids=["HTTP/1.0 without a Host", "an empty Host on a probe", "an IPv6 literal and a port",
        "a name with its root dot"])  # fmt: skip
def test_a_host_the_rfc_allows_is_served(svc: ServiceProcess, raw: bytes) -> None:
    """HTTP/1.0 needs no Host, and an empty Host is one (a target without an authority)."""
    assert [s for s, _ in exchange(svc.port, raw)] == [200]


def test_upgrades_give_their_connection_slots_back(svc: ServiceProcess) -> None:
    """Five times the per-peer cap of WebSocket upgrades, then a select from the same
    address is served (a slot never given back locked the address out until restart)."""
    for _ in range(5 * PER_PEER):
        assert [s for s, _ in exchange(svc.port, WEBSOCKET)] == [400]
    with httpx.Client(base_url=svc.url, timeout=10) as c:
        assert c.post("/select", json={"topic": "orders"}).status_code == 200


@pytest.mark.parametrize(("target", "host", "status"), [
    (b"http://rebind.example/routes", b"127.0.0.1", 421),
    (b"http://127.0.0.1/routes", b"rebind.example", 200),
    (b"http://user@127.0.0.1/routes", b"127.0.0.1", 421),
    (b"/routes", b"[::1]rebind.example", 400),  # not host[:port]: malformed
    (b"/routes", b"localhost:not-a-port", 400),
    (b"/routes", b"localhost:8080", 200),
    (b"/routes", b"[::1]:8080", 200),
])  # fmt: skip
def test_the_host_judged_is_the_one_the_request_names(
    svc: ServiceProcess, target: bytes, host: bytes, status: int
) -> None:
    """An absolute-form target's host is judged, not the Host header (RFC 9112 3.2.2), and
    a Host is a name and at most a port (anything else is malformed: 400)."""
    raw = b"GET %s HTTP/1.1\r\nhost: %s\r\nconnection: close\r\n\r\n" % (target, host)
    out = exchange(svc.port, raw)
    assert [s for s, _ in out] == [status], out
    if status == 421:
        assert json.loads(out[0][1])["error"] == "HOST_NOT_ALLOWED"


@pytest.mark.parametrize("types", [
    (b"text/plain", b"application/json"),
    (b"application/json", b"text/plain"),
    (b"application/json", b"application/json"),
], ids=["plain then json", "json then plain", "json twice"])  # fmt: skip
@pytest.mark.parametrize("path", [b"/report-latency", b"/select"])
def test_a_repeated_content_type_is_no_json_type_on_either_way_in(
    svc: ServiceProcess, types: tuple[bytes, bytes], path: bytes
) -> None:
    body = (b'{"brokerName": "typed-twice", "latencyMs": 5000}' if path == b"/report-latency"
            else b'{"topic": "orders"}')  # fmt: skip
    raw = (b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: %s\r\ncontent-type: %s\r\n"
           b"content-length: %d\r\nconnection: close\r\n\r\n%s"
           % (path, types[0], types[1], len(body), body))  # fmt: skip
    out = exchange(svc.port, raw)
    assert [s for s, _ in out] == [415], out
    assert json.loads(out[0][1])["field"] == "Content-Type"
    items = httpx.get(svc.url + "/fault-items", timeout=10).json()["items"]
    assert all(item["brokerName"] != "typed-twice" for item in items)


@pytest.mark.parametrize("path", ["/select/", "/routes/", "/config/"])
def test_a_trailing_slash_is_a_path_detour_does_not_have(svc: ServiceProcess, path: str) -> None:
    """404 in the Error shape, not a 307 to a Location built from the client's Host."""
    r = httpx.post(svc.url + path, json={"topic": "orders"}, timeout=10, headers={"host": "x.test"})
    assert r.status_code in (404, 421), r.text  # 421 where Host names are checked
    assert "location" not in r.headers
    r = httpx.get(svc.url + path, timeout=10)
    assert r.status_code == 404 and r.json()["error"] == "NOT_FOUND", r.text
