"""The suite's one-hop test client (tests/asgi_client.py) is Starlette's, seen from the app
and from the test: the same scope and messages, the same answers, errors raised the same
way; streamed bodies and endless answers go Starlette's way."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient as StarletteClient
from starlette.types import Message, Receive, Scope, Send

from tests.asgi_client import TestClient

pytestmark = pytest.mark.unit


class Recorder:
    """An ASGI app that answers what it saw: its scope (minus state), the messages it
    received, and the request body; ``/boom`` raises, ``/boom-late`` raises after its
    answer has started, ``/chunks`` answers in three body messages."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []
        self.received: list[list[Message]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.scopes.append({k: v for k, v in scope.items() if k != "state"})
        got: list[Message] = []
        body = b""
        while True:
            message = await receive()
            got.append(message)
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        self.received.append(got)
        if scope["path"] == "/boom":
            raise RuntimeError("boom")
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"text/plain"), (b"x-two", b"a"),
                                (b"x-two", b"b")]})
        if scope["path"] == "/boom-late":
            raise RuntimeError("late")
        parts = [b"one-", b"two-", body] if scope["path"] == "/chunks" else [body or b"empty"]
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part,
                        "more_body": i < len(parts) - 1})


def both(**kwargs: Any) -> tuple[tuple[Recorder, TestClient], tuple[Recorder, StarletteClient]]:
    ours, theirs = Recorder(), Recorder()
    return (ours, TestClient(ours, **kwargs)), (theirs, StarletteClient(theirs, **kwargs))


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/a%20b/c?x=1&y=%2F", None),
    ("POST", "/r", b'{"k": 1}'),
    ("PUT", "/chunks", b"tail"),
    ("HEAD", "/h", None),
    ("DELETE", "/d", None),
])
def test_the_app_sees_and_the_test_gets_what_starlettes_client_gives(
    method: str, path: str, body: bytes | None
) -> None:
    (ours, fast), (theirs, slow) = both()
    with fast, slow:
        headers = {"x-one": "1", "content-type": "application/json"}
        a = fast.request(method, path, content=body, headers=headers)
        b = slow.request(method, path, content=body, headers=headers)
    assert ours.scopes == theirs.scopes
    assert ours.received == theirs.received
    assert (a.status_code, a.headers.multi_items(), a.content) == (
        b.status_code, b.headers.multi_items(), b.content)
    assert a.headers.get_list("x-two") == ["a", "b"]


def test_an_error_of_the_app_is_raised_or_a_500_as_with_starlettes() -> None:
    (_, fast), (_, slow) = both()
    with fast, slow:
        for client in (fast, slow):
            with pytest.raises(RuntimeError, match="boom"):
                client.get("/boom")
            with pytest.raises(RuntimeError, match="late"):
                client.get("/boom-late")
    (_, fast), (_, slow) = both(raise_server_exceptions=False)
    with fast, slow:
        assert fast.get("/boom").status_code == slow.get("/boom").status_code == 500


def test_a_streamed_request_body_reaches_the_app_as_with_starlettes() -> None:
    (ours, fast), (theirs, slow) = both()

    def parts() -> Any:
        yield b"ab"
        yield b"cd"

    with fast, slow:
        a, b = fast.post("/s", content=parts()), slow.post("/s", content=parts())
    assert a.content == b.content == b"abcd"
    assert ours.received == theirs.received
    assert ours.scopes == theirs.scopes
