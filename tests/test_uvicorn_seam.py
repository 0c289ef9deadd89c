"""What service/edge/uvicorn_seam.py relies on in the installed uvicorn, item by item.

The edge subclasses uvicorn's private ``HttpToolsProtocol``; the seam's docstring lists
every internal it reads or calls. An upgrade that renames or reshapes one must fail
here, naming it, rather than somewhere in the edge's behaviour. Two kinds of check:
what uvicorn's source assigns and defines (read from the installed modules with
``ast``/``inspect``), and how it behaves, on a real uvicorn server in a thread of its own
running a protocol that records what the seam's hooks see, over 127.0.0.1.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import socket
import sys
import textwrap
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httptools
import pytest
import uvicorn
import uvloop
from uvicorn.protocols.http import flow_control, httptools_impl

from service.edge import answers
from service.edge.uvicorn_seam import UvicornHttp
from tests.procs import free_port, wait_until

pytestmark = pytest.mark.integration


def assigned(cls: type, method: str) -> set[str]:
    """The ``self.<name>`` a method of ``cls`` assigns, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(cls, method))))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def parameters(cls: type, method: str) -> list[str]:
    return list(inspect.signature(getattr(cls, method)).parameters)


def test_the_protocol_sets_the_attributes_the_seam_reads() -> None:
    protocol = httptools_impl.HttpToolsProtocol
    set_up = assigned(protocol, "__init__") | assigned(protocol, "connection_made")
    missing = {
        "parser", "cycle", "pipeline", "flow", "headers", "scope", "app", "app_state",
        "server_state", "client", "server", "transport", "loop", "timeout_keep_alive",
        "timeout_keep_alive_task", "expect_100_continue",
    } - set_up  # fmt: skip
    assert not missing, f"uvicorn's HttpToolsProtocol no longer sets {sorted(missing)}"
    assert "url" in assigned(protocol, "on_message_begin"), "the request target moved"
    assert "flow" in assigned(protocol, "connection_made"), (
        "the seam replaces `flow` after connection_made; uvicorn sets it elsewhere now"
    )


def test_the_cycle_and_flow_control_have_what_the_seam_uses() -> None:
    cycle = assigned(httptools_impl.RequestResponseCycle, "__init__")
    missing = {
        "body", "more_body", "message_event", "keep_alive", "response_complete",
        "response_started", "disconnected", "on_response",
    } - cycle  # fmt: skip
    assert not missing, f"uvicorn's RequestResponseCycle no longer sets {sorted(missing)}"
    flow = assigned(flow_control.FlowControl, "__init__")
    assert {"read_paused", "write_paused"} <= flow, f"FlowControl sets {sorted(flow)}"
    for method in ("pause_reading", "resume_reading", "pause_writing", "resume_writing"):
        assert parameters(flow_control.FlowControl, method) == ["self"], method
    assert parameters(flow_control.FlowControl, "__init__") == ["self", "transport"]


@pytest.mark.parametrize(("method", "params"), [
    ("on_message_begin", ["self"]),
    ("on_url", ["self", "url"]),
    ("on_header", ["self", "name", "value"]),
    ("on_headers_complete", ["self"]),
    ("on_body", ["self", "body"]),
    ("on_message_complete", ["self"]),
    ("on_response_complete", ["self"]),
    ("send_400_response", ["self", "msg"]),
    ("timeout_keep_alive_handler", ["self"]),
    ("shutdown", ["self"]),
    ("_unset_keepalive_if_required", ["self"]),
    ("data_received", ["self", "data"]),
    ("connection_made", ["self", "transport"]),
    ("connection_lost", ["self", "exc"]),
    ("resume_writing", ["self"]),
])  # fmt: skip
def test_the_protocol_methods_the_seam_calls_or_routes(method: str, params: list[str]) -> None:
    assert parameters(httptools_impl.HttpToolsProtocol, method) == params, (
        f"uvicorn's HttpToolsProtocol.{method} changed its signature"
    )


def test_on_response_complete_is_still_the_steps_the_seam_copies() -> None:
    """The seam has its own on_response_complete (the idle timer armed lazily): uvicorn's
    must still be these steps, in this order, or the copy is out of date."""
    source = inspect.getsource(httptools_impl.HttpToolsProtocol.on_response_complete)
    steps = ["self.server_state.total_requests += 1", "self.transport.is_closing()",
             "self._unset_keepalive_if_required()", "self.flow.resume_reading()",
             "self.pipeline.pop()", "self._start_asgi_task(cycle, app)",
             "self.timeout_keep_alive_task = self.loop.call_later("]
    at = [source.find(step) for step in steps]
    assert -1 not in at and at == sorted(at), dict(zip(steps, at, strict=True))
    assert parameters(httptools_impl.HttpToolsProtocol, "_start_asgi_task") == [
        "self", "cycle", "app"]
    code = ast.parse(textwrap.dedent(source))
    calls = sum(isinstance(node, ast.Call) for node in ast.walk(code))
    assert calls == 6, f"uvicorn's on_response_complete makes {calls} calls now, not 6"


def test_uvicorn_writes_the_status_lines_the_edge_writes() -> None:
    assert httptools_impl.STATUS_LINE == answers.STATUS_LINES


def test_a_parser_error_reaches_send_400_response_inside_its_except_block() -> None:
    source = inspect.getsource(httptools_impl.HttpToolsProtocol.data_received)
    handler = source[source.index("except httptools.HttpParserError"):]
    assert "self.send_400_response(" in handler.split("except", 2)[1], (
        "data_received no longer calls send_400_response in its HttpParserError handler: "
        "the edge's 400 reads the parser's error with sys.exception() there"
    )


# -- behaviour on a live server --------------------------------------------------------

class Seen:
    def __init__(self) -> None:
        self.malformed: list[BaseException | None] = []
        self.done = 0
        self.resume_asked = 0
        self.queued: list[int] = []
        #: The idle timer after each answer (held, so that ids are not reused).
        self.timers: list[object] = []
        self.idle_closed = threading.Event()


SEEN = Seen()


class Recording(UvicornHttp):
    def malformed(self, message: str) -> None:
        SEEN.malformed.append(sys.exception())
        super().malformed(message)

    def response_done(self) -> None:
        SEEN.done += 1
        SEEN.timers.append(self.timeout_keep_alive_task)

    def may_resume_reading(self) -> bool:
        SEEN.resume_asked += 1
        return True

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        SEEN.queued.append(self.queued())

    def idle_timeout(self) -> None:
        SEEN.idle_closed.set()
        super().idle_timeout()


async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@contextmanager
def server(keep_alive_s: int = 5) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=Recording,
                            log_level="critical", lifespan="on",
                            timeout_keep_alive=keep_alive_s)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_until(lambda: srv.started, 20, "the server started")
    global SEEN
    SEEN = Seen()
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(20)


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_behaviour_the_seam_relies_on() -> None:
    post = b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\nab"
    with server() as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        # Three pipelined requests in one write, then a close: uvicorn answers them in
        # order, queueing the later two behind the first (``pipeline``), calls the cycle's
        # ``on_response`` (the seam's ``response_done``) once per answer, and reading a
        # body asks to resume reading (the seam's ``may_resume_reading``).
        s.sendall(post * 3 + b"GET /x HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
        out = read_all(s)
    assert out.count(b"HTTP/1.1 200 ") == 4
    assert SEEN.queued[0] == 0 and max(SEEN.queued) >= 1, SEEN.queued
    assert SEEN.done == 4
    assert SEEN.resume_asked >= 1
    with server() as port, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"FOO / HTTP/1.1\r\n\r\n")
        out = read_all(s)
    assert out.startswith(b"HTTP/1.1 400 ")  # uvicorn's own, from the seam's default
    assert len(SEEN.malformed) == 1
    assert isinstance(SEEN.malformed[0], httptools.HttpParserError), SEEN.malformed


def test_re_arming_the_idle_timer_keeps_it_on_uvloops_millisecond_clock() -> None:
    """uvloop's clock counts milliseconds: re-armed in the millisecond the timer was made,
    its ``when()`` can exceed ``time() + delay`` in a float's last digit (for about one
    millisecond in twelve, measured), and the timer was replaced. Made in 300 different
    milliseconds and re-armed at once each time, it is never replaced."""

    async def replaced_timers() -> int:
        conn = types.SimpleNamespace(loop=asyncio.get_running_loop(),
                                     timeout_keep_alive_task=None, _idle_check=lambda: None)
        replaced = 0
        for _ in range(300):
            conn.timeout_keep_alive_task = None
            UvicornHttp.arm_idle(conn, 5.0)  # type: ignore[arg-type]
            made = conn.timeout_keep_alive_task
            await asyncio.sleep(0)  # the next iteration, most often in the same millisecond
            UvicornHttp.arm_idle(conn, 5.0)  # type: ignore[arg-type]
            replaced += conn.timeout_keep_alive_task is not made
            conn.timeout_keep_alive_task.cancel()
            await asyncio.sleep(0.001)  # the next round in another millisecond
        return replaced

    assert uvloop.run(replaced_timers()) == 0


def test_the_idle_timer_is_made_once_per_connection_and_closes_when_uvicorns_would() -> None:
    """uvicorn makes and cancels an idle timer per request; the seam keeps one per
    connection, moved when it fires. A connection busier than the timeout is never
    closed; one idle for the timeout is, at about the time uvicorn's own timer would."""
    post = b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\nab"
    answer = b"HTTP/1.1 200 "
    with server(keep_alive_s=1) as port, socket.create_connection(("127.0.0.1", port),
                                                                   timeout=10) as s:
        started = time.monotonic()
        for _ in range(200):  # back to back: one timer for all of them
            s.sendall(post)
            got = b""
            while got.count(b"ab") < 1 or answer not in got:
                chunk = s.recv(65536)
                assert chunk, "closed while busy"
                got += chunk
        took = time.monotonic() - started
        made = {id(t) for t in SEEN.timers if t is not None}
        # One timer, and one more each time it fired (once a second at most: a busy machine
        # may take seconds for the 200), against uvicorn's 200.
        assert len(SEEN.timers) == 200 and len(made) <= 2 + int(took), (len(made), took)
        # Busy across more than two timeouts, a request every 0.4 s: the timer fires,
        # finds the connection idle for less than 1 s, waits out the rest; never closes.
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            assert not SEEN.idle_closed.wait(0.4), "closed a connection idle for < 1 s"
            s.sendall(post)
            assert s.recv(65536).startswith(answer)
        # Idle now: closed about 1 s after the last answer.
        last = time.monotonic()
        assert s.recv(65536) == b"", "the idle connection was not closed"
        waited = time.monotonic() - last
        assert SEEN.idle_closed.is_set()
        assert 0.9 <= waited <= 5, waited
