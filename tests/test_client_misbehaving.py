"""The SDK keeps producing whatever Detour, or something in front of it, does.

A real Detour process sits behind ``tests.faulty.FaultyFront``, a real socket server:
the client first learns routes and config from Detour through it, then the front
starts to misbehave (trickle bytes, answer the wrong shape, 401/403, redirect, send
an event-stream line without end). Every send must still succeed on a local
decision, within its deadline, and the misbehaviour must show in ``stats()``; when
the front behaves again, what was queued reaches Detour.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from detour.client import (
    AsyncDetourClient,
    ClientStats,
    DetourClient,
    SelectedQueue,
    SendResult,
    TopicNotFound,
)
from tests.faulty import (
    STREAM_PATH,
    FaultyFront,
    Reply,
    Request,
    answer,
    endless_line,
    hang_up,
    response,
    trickle,
    two_broker_topic,
)
from tests.procs import ServiceProcess, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

_topics = itertools.count(1)


@pytest.fixture
def front(service: ServiceProcess) -> Iterator[FaultyFront]:
    with FaultyFront(service.url) as f:
        yield f


@pytest.fixture
def topic(service: ServiceProcess) -> str:
    return two_broker_topic(service.url, f"mb{next(_topics)}")


def fault_items(url: str) -> dict[str, dict[str, Any]]:
    body = httpx.get(f"{url}/fault-items", timeout=5).json()
    return {i["brokerName"]: i for i in body["items"]}


def on(method: str, path: str, reply: Reply) -> Callable[[Request], Reply | None]:
    """A behaviour: ``reply`` to ``method path``, everything else goes to Detour."""
    return lambda r: reply if (r.method, r.path) == (method, path) else None


def always(reply: Reply) -> Callable[[Request], Reply | None]:
    return lambda r: reply


class Producer:
    """The sync or the async client behind one blocking face, so each scenario runs on
    both. The async client's loop runs while a call runs (its flusher included)."""

    def __init__(self, kind: str, url: str, **settings: Any) -> None:
        self.kind = kind
        self.delay_s = 0.0
        if kind == "sync":
            self.sync: DetourClient | None = DetourClient(url, **settings)
        else:
            self.sync = None
            self.loop = asyncio.new_event_loop()
            self.aio = AsyncDetourClient(url, **settings)

    def _deliver(self, q: SelectedQueue, payload: int) -> str:
        time.sleep(self.delay_s)  # the broker's latency in this scenario
        return q.broker_name

    async def _adeliver(self, q: SelectedQueue, payload: int) -> str:
        await asyncio.sleep(self.delay_s)
        return q.broker_name

    def send(self, topic: str) -> SendResult[str]:
        if self.sync is not None:
            return self.sync.send(topic, 0, self._deliver)
        return self.loop.run_until_complete(self.aio.send(topic, 0, self._adeliver))

    def timed_send(self, topic: str) -> tuple[SendResult[str], float]:
        start = time.monotonic()
        result = self.send(topic)
        return result, time.monotonic() - start

    def flush(self, timeout: float) -> bool:
        if self.sync is not None:
            return self.sync.flush(timeout)
        return self.loop.run_until_complete(self.aio.flush(timeout))

    def stats(self) -> ClientStats:
        return self.sync.stats() if self.sync is not None else self.aio.stats()

    def since(self, before: ClientStats, *fields: str) -> tuple[int, ...]:
        """How much each counter grew since ``before``."""
        now = self.stats()
        return tuple(getattr(now, f) - getattr(before, f) for f in fields)

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()
            return
        try:
            self.loop.run_until_complete(self.aio.aclose())
        finally:
            self.loop.close()


MakeProducer = Callable[..., tuple[Producer, ClientStats]]


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def producer(
    kind: str, front: FaultyFront, topic: str
) -> Iterator[MakeProducer]:
    """Makes a producer that has sent through the behaving front, so it knows the route and
    config, and its stats then; closes it after the test."""
    made: list[Producer] = []

    def make(**settings: Any) -> tuple[Producer, ClientStats]:
        # Each call is awaited whole (or to its timeout and deadline), which is what these
        # scenarios are about; the decision deadline has its own (test_client_deadline.py).
        settings.setdefault("decide_within", None)
        p = Producer(kind, front.url, **settings)
        made.append(p)
        # A busy machine may miss a 200 ms timeout once: the counters are compared from here.
        wait_until(lambda: not p.send(topic).queue.local, 20, "a send Detour answered")
        # A warm-up send that was decided locally queued its report: it leaves now, not
        # during the scenario, where it would count among the scenario's own reports.
        assert p.flush(10), f"the warm-up's reports never left: {p.stats()}"
        return p, p.stats()

    yield make
    for p in made:
        p.close()


JSON = {"content-type": "application/json"}


def a_select_answer(topic: str, /, **fields: object) -> bytes:
    body = {"topic": topic, "brokerName": f"{topic}-a", "queueId": 0, "address": None,
            "decision": "available", "avoidedBrokers": [], "degraded": False, **fields}
    return json.dumps(body).encode()


# ------------------------------------------------------------------------- a trickle
@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_trickling_detour_holds_no_send_past_its_deadline(
    where: str, front: FaultyFront, topic: str, producer: MakeProducer
) -> None:
    # A valid answer, one byte every 20 ms: 6 s to read whole, and a byte arrives well
    # within every 200 ms read timeout, so httpx's own timeouts never fire.
    data = response(200, a_select_answer(topic).ljust(300), {"content-type": "application/json"})
    at_once = data.index(b"\r\n\r\n") + 4 if where == "body" else 0
    p, before = producer(timeout=0.2, deadline=1.0)
    front.misbehave(on("POST", "/select", trickle(data, 0.02, at_once)))
    for _ in range(3):
        result, took = p.timed_send(topic)
        assert result.queue.local and result.value in (f"{topic}-a", f"{topic}-b")
        # Uncut it would take 6 s; a busy machine may add a little to the 1 s deadline.
        assert took < 1.0 + 1.0, f"a send took {took:.2f} s, past its 1 s deadline"
    assert p.since(before, "local_selects")[0] == 3 and p.stats().detour_failures > 0
    wait_until(lambda: front.written, 10, "the trickle to notice the hang-up")
    for cut in front.written:  # the client hung up early, every time
        assert cut.hung_up and cut.sent < len(data) and cut.seconds < 1.0 + 1.0

    front.misbehave(None)
    assert p.flush(5)  # what was queued reaches Detour once it answers again
    assert p.since(before, "sent_reports") == (3,)


def test_the_send_deadline_cuts_a_call_that_the_timeout_would_allow(
    front: FaultyFront, topic: str, service: ServiceProcess,
    producer: MakeProducer,
) -> None:
    # Reports trickle; the select is answered by Detour. The delivery takes 0.5 s of the
    # 1 s deadline, so the report may have the 0.5 s left, not its 5 s timeout.
    slow = response(200, b'{"brokerName": "x"}'.ljust(400), {"content-type": "application/json"})
    p, before = producer(timeout=5.0, deadline=1.0)
    front.misbehave(on("POST", "/report-latency", trickle(slow, 0.02)))
    p.delay_s = 0.5
    result, took = p.timed_send(topic)
    assert not result.queue.local  # Detour chose the queue
    # Uncut: 0.5 s + the 5 s call; a busy machine may add a little to the 1 s deadline.
    assert took < 1.0 + 1.0, f"the send took {took:.2f} s (0.5 s + a 5 s call uncut)"
    assert p.since(before, "pending_reports", "detour_failures") == (1, 1)

    front.misbehave(None)
    assert p.flush(5)
    broker = result.queue.broker_name
    assert fault_items(service.url)[broker]["currentLatencyMs"] >= 500


# ---------------------------------------------------------------- the wrong answer
def _deep() -> bytes:
    return b"[" * 100_000 + b"]" * 100_000


WRONG_SELECT_ANSWERS: dict[str, Callable[[str], bytes]] = {
    "a list": lambda t: b"[]",
    "empty": lambda t: b"",
    "null": lambda t: b"null",
    "a string": lambda t: b'"broker-a"',
    "not JSON": lambda t: b"<html><body>Welcome to nginx</body></html>",
    "nested past the parser": lambda t: _deep(),
    "an unknown decision": lambda t: a_select_answer(t, decision="whatever"),
    "a queueId string": lambda t: a_select_answer(t, queueId="0"),
    "a negative queueId": lambda t: a_select_answer(t, queueId=-1),
    "a fractional queueId": lambda t: a_select_answer(t, queueId=1.5),
    "a boolean queueId": lambda t: a_select_answer(t, queueId=True),
    "no queueId": lambda t: a_select_answer(t, queueId=None).replace(b'"queueId": null, ', b""),
    "a broker number": lambda t: a_select_answer(t, brokerName=7),
    "another topic": lambda t: a_select_answer(t, topic="not-this-one"),
    "avoided as a string": lambda t: a_select_answer(t, avoidedBrokers="a"),
    "an address object": lambda t: a_select_answer(t, address={"host": "x"}),
}


@pytest.mark.parametrize("shape", list(WRONG_SELECT_ANSWERS))
def test_a_2xx_of_the_wrong_shape_means_decide_locally(
    shape: str, front: FaultyFront, topic: str,
    producer: MakeProducer,
) -> None:
    body = WRONG_SELECT_ANSWERS[shape](topic)
    p, before = producer(timeout=1.0)
    front.misbehave(on("POST", "/select", answer(200, body)))
    assert p.send(topic).queue.local
    counted = p.since(before, "bad_answers", "detour_failures", "rejected_calls")
    assert counted == (1, 1, 0)


@pytest.mark.parametrize(("status", "body", "ctype"), [
    (404, b"<html>404 Not Found</html>", "text/html"),  # a proxy that does not know /select
    (405, b"Method Not Allowed", "text/plain"),
    (400, b'{"detail": "bad"}', "application/json"),  # JSON, but not Detour's error body
    # A gateway's own JSON with an "error" key: not Detour's shape (no message, no field,
    # not a code), so not raised as Detour's 404 for the topic.
    (404, b'{"error": "Not Found"}', "application/json"),
    (404, b'{"error": "NOT_FOUND", "message": "no route", "field": "topic", "trace": "x"}',
     "application/json"),
])
def test_a_4xx_that_is_not_detours_means_decide_locally(
    status: int, body: bytes, ctype: str, front: FaultyFront, topic: str,
    producer: MakeProducer,
) -> None:
    p, before = producer(timeout=1.0)
    front.misbehave(on("POST", "/select", answer(status, body, {"content-type": ctype})))
    assert p.send(topic).queue.local
    assert p.since(before, "bad_answers") == (1,)


def test_an_answer_naming_a_queue_not_in_the_route_is_refused(
    front: FaultyFront, topic: str, producer: MakeProducer
) -> None:
    """A 2xx of the right shape whose broker, or queue, the route this producer knows does
    not have: the send is decided locally, the answer counted as bad, and the route
    fetched again (a route Detour changed since is learned, not a wrong answer followed)."""
    p, before = producer(timeout=1.0)
    for n, wrong in enumerate(({"brokerName": "elsewhere"}, {"queueId": 7}), 1):
        front.misbehave(on("POST", "/select", answer(200, a_select_answer(topic, **wrong), JSON)))
        # Every send decides locally; the first the wrong answer reaches counts it, once.
        # On a busy machine that may not be the first send: a call the 1 s timeout cut short
        # opens the circuit, and sends decide locally without asking until it closes.
        deadline = time.monotonic() + 20
        while p.since(before, "bad_answers")[0] < n:
            assert time.monotonic() < deadline, f"wrong answer {n} never counted: {p.stats()}"
            result = p.send(topic)
            assert result.queue.local and result.value in (f"{topic}-a", f"{topic}-b")
            time.sleep(0.02)  # (polling the circuit's own timer, which has no event)
        front.misbehave(None)
        # The next select, answered by Detour, asks for the route again (in the background:
        # the send does not wait for it).
        wait_until(lambda: not p.send(topic).queue.local, 10, "Detour followed again")
        wait_until(lambda: f"/routes/{topic}" in front.paths(), 10, "the route asked for again")
        front.requests.clear()
    assert p.since(before, "bad_answers") == (2,)


def test_a_refetch_of_a_refused_route_that_fails_is_asked_for_again(
    front: FaultyFront, topic: str, producer: MakeProducer
) -> None:
    """The route fetch that follows a refused answer fails (the connection is hung up under
    it): the route stays due, and a later select Detour answers fetches it again, instead
    of the producer keeping the route Detour contradicted for 30 s."""
    p, before = producer(timeout=1.0)
    wrong = answer(200, a_select_answer(topic, brokerName="x"), JSON)
    front.misbehave(on("POST", "/select", wrong))
    assert p.send(topic).queue.local
    route = f"/routes/{topic}"
    failed: list[Request] = []

    def fail_the_first_refetch(request: Request) -> Reply | None:
        if request.path == route and not failed:
            failed.append(request)
            return hang_up()
        return None

    front.requests.clear()
    front.misbehave(fail_the_first_refetch)
    wait_until(lambda: p.send(topic) is not None and front.paths("GET").count(route) >= 2, 10,
               "the route asked for again after the failed fetch")
    assert failed
    assert p.since(before, "bad_answers") == (1,)


def test_a_route_refused_while_its_refetch_is_on_the_way_is_fetched_again(
    front: FaultyFront, topic: str, producer: MakeProducer
) -> None:
    """A select refuses an answer while the refetch an earlier refusal asked for is on its
    way: that refetch's answer may be the route from before, so it does not settle the
    route; the refresh goes round again rather than keeping it for 30 s."""
    p, before = producer(timeout=5.0)
    route = f"/routes/{topic}"
    wrong = answer(200, a_select_answer(topic, brokerName="elsewhere"), JSON)
    answering_wrong = threading.Event()
    fetch_held, fetch_go = threading.Event(), threading.Event()

    def behave(request: Request) -> Reply | None:
        if (request.method, request.path) == ("POST", "/select") and answering_wrong.is_set():
            return wrong
        if request.path == route and not fetch_held.is_set():
            fetch_held.set()  # the first refetch waits in the front, then goes to Detour
            fetch_go.wait(10)
        return None

    # One behaviour throughout: switching with ``misbehave`` hangs up every connection,
    # which would fail the held fetch instead of answering it late.
    front.misbehave(behave)
    front.requests.clear()

    def refuse(n: int) -> None:
        answering_wrong.set()
        wait_until(lambda: p.send(topic) is not None
                   and p.since(before, "bad_answers")[0] >= n, 10, f"wrong answer {n} counted")
        answering_wrong.clear()

    refuse(1)  # the route is due
    wait_until(lambda: p.send(topic) is not None and fetch_held.is_set(), 10,
               "the refetch asked for (and held)")
    refuse(2)  # found stale again while that refetch is on its way
    fetch_go.set()  # it ends, answered by Detour
    wait_until(lambda: p.send(topic) is not None and front.paths("GET").count(route) >= 2,
               10, "the route asked for again after the refetch that was on its way")
    assert p.since(before, "bad_answers") == (2,)


def test_an_answer_too_large_is_not_read_whole(
    front: FaultyFront, topic: str, producer: MakeProducer
) -> None:
    huge = b'{"pad": "' + b"x" * (8 * 1024 * 1024) + b'"}'
    p, before = producer(timeout=2.0)
    front.misbehave(on("POST", "/select", answer(200, huge)))
    assert p.send(topic).queue.local
    assert p.since(before, "bad_answers") == (1,)


# ------------------------------------------------------- rejections: 401, 403, 3xx
REJECTIONS = {
    "401": (401, b'{"error": "UNAUTHORIZED", "message": "unknown token", "field": null}', {}),
    "403": (403, b'{"error": "FORBIDDEN", "message": "not your namespace", "field": null}', {}),
    "302": (302, b"", {"location": "/login?next=/select"}),
    "307": (307, b"", {"location": "https://detour.elsewhere.example/select"}),
}


@pytest.mark.parametrize("case", list(REJECTIONS))
def test_a_rejection_fails_open_counted_and_logged_once(
    case: str, front: FaultyFront, topic: str, caplog: pytest.LogCaptureFixture,
    producer: MakeProducer,
) -> None:
    status, body, extra = REJECTIONS[case]
    headers = {"content-type": "application/json", **extra}
    # A short circuit pause, so the queued reports' flusher meets the rejection again
    # and again within the test.
    p, before = producer(timeout=1.0, backoff_initial=0.02, backoff_max=0.02)
    front.misbehave(always(answer(status, body, headers)))
    with caplog.at_level(logging.WARNING, logger="detour.client"):
        results = [p.send(topic) for _ in range(3)]
        assert all(r.queue.local for r in results)

        def rejected_thrice() -> bool:
            p.flush(0.05)  # drives the async client's loop; the sync one's flusher runs alone
            return p.stats().rejected_calls >= 3

        wait_until(rejected_thrice, 10, "three rejections")
    stats = p.stats()
    assert stats.last_rejected_status == status
    assert p.since(before, "bad_answers", "pending_reports", "dropped_reports") == (0, 3, 0)
    loud = [r for r in caplog.records if r.name == "detour.client" and f"HTTP {status}" in
            r.getMessage()]
    assert len(loud) == 1 and loud[0].levelno == logging.ERROR  # once, not once per call
    assert "/login" not in front.paths()  # the redirect was not followed

    front.misbehave(None)
    assert p.flush(5)
    assert p.since(before, "sent_reports") == (3,)


def test_a_cached_client_counts_a_rejected_stream(front: FaultyFront, topic: str) -> None:
    with DetourClient(front.url, mode="cached") as client:
        assert client.wait_ready(15)
        front.misbehave(always(answer(401, b'{"error": "UNAUTHORIZED", "message": "", '
                                           b'"field": null}')))
        wait_until(lambda: client.stats().rejected_calls >= 1, 10, "the stream's 401")
        assert client.send(topic, 0, lambda q, p: q.broker_name).queue.local
        assert client.stats().last_rejected_status == 401
        front.misbehave(None)
        wait_until(lambda: client.stats().stream_connected, 15, "the stream back")


def test_a_cached_client_without_its_stream_asks_for_an_unknown_route(
    front: FaultyFront, topic: str
) -> None:
    """The stream refused from the start: a topic the client has never seen is not an
    error while Detour answers ``GET /routes/{topic}``; an unknown one is still 404."""
    busy = b'{"error": "SYSTEM_BUSY", "message": "busy", "field": null}'
    front.misbehave(on("GET", STREAM_PATH, answer(503, busy)))
    with DetourClient(front.url, mode="cached", timeout=1.0) as client:
        assert not client.wait_ready(0.5)
        result = client.send(topic, 0, lambda q, p: q.broker_name)
        assert result.queue.local and result.value in (f"{topic}-a", f"{topic}-b")
        assert f"/routes/{topic}" in front.paths()
        with pytest.raises(TopicNotFound):
            client.select("never-registered")


# ------------------------------------------------------------ an endless stream line
def test_an_endless_stream_line_is_dropped_and_the_stream_reconnected(
    front: FaultyFront, topic: str
) -> None:
    total = 300 * 1024 * 1024  # the line that once took a producer to 350 MB
    with DetourClient(front.url, mode="cached") as client:
        assert client.wait_ready(15)
        front.misbehave(on("GET", STREAM_PATH, endless_line(total)))
        wait_until(lambda: client.stats().stream_too_large >= 2, 20, "two drops")
        assert client.send(topic, 0, lambda q, p: q.broker_name).queue.local
    streams = [w for w in front.written if w.attempted == total]
    assert len(streams) >= 2  # dropped, reconnected, dropped
    for w in streams:
        # The default bound is 16 MiB; the rest is what the sockets' buffers held.
        assert w.hung_up and w.sent < 100 * 1024 * 1024


def test_the_async_reader_bounds_lines_and_events_too(front: FaultyFront, topic: str) -> None:
    total = 8 * 1024 * 1024
    many_lines = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + (
        b"data: " + b"y" * 1000 + b"\n") * 200  # 200 KB of one event's data, never dispatched

    async def main() -> ClientStats:
        async with AsyncDetourClient(front.url, mode="cached",
                                     max_event_bytes=64 * 1024) as client:
            assert await client.wait_ready(15)
            front.misbehave(on("GET", STREAM_PATH, endless_line(total)))
            deadline = time.monotonic() + 20
            while client.stats().stream_too_large < 1:
                assert time.monotonic() < deadline, "the endless line was never dropped"
                await asyncio.sleep(0.01)
            front.misbehave(on("GET", STREAM_PATH, trickle(many_lines, 0, len(many_lines))))
            while client.stats().stream_too_large < 2:
                assert time.monotonic() < deadline, "the endless event was never dropped"
                await asyncio.sleep(0.01)
            result = await client.send(topic, 0, _echo)
            assert result.queue.local
            return client.stats()

    stats = asyncio.run(main())
    assert stats.stream_too_large >= 2
    line = next(w for w in front.written if w.attempted == total)
    assert line.hung_up and line.sent < total


async def _echo(q: SelectedQueue, payload: int) -> str:
    return q.broker_name


# ------------------------------------------------------------------------ remote stats
def test_remote_mode_has_no_clock_offset(front: FaultyFront, topic: str) -> None:
    with DetourClient(front.url, timeout=2.0) as remote, \
            DetourClient(front.url, mode="cached") as cached:
        remote.send(topic, 0, lambda q, p: None)
        assert cached.wait_ready(15)
        assert remote.stats().clock_offset_ms is None
        assert isinstance(cached.stats().clock_offset_ms, float)
