"""What the SDK follows, and what it counts: answers are checked against Detour's contract
and the route before a producer acts on them, and every report ends up counted.

A real Detour behind ``tests.faulty.FaultyFront``: the front relays to Detour until a test
makes it answer something else (a compressed body, an address the route does not give,
avoided brokers by the thousand, a gateway's ``200 {"status": "ok"}`` to a report, Detour's
own refusal of one). Each scenario runs on the sync and the async client.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from detour.client import DetourClient, DetourRequestError, DetourUnavailable, Report
from detour.client import local as local_table
from detour.client.core import ClientCore
from detour.client.local import LocalTable
from detour.model import Config, FaultItem, Route
from tests.faulty import (
    STREAM_PATH,
    FaultyFront,
    Reply,
    Request,
    Written,
    answer,
    hang_up,
    trickle,
    two_broker_topic,
)
from tests.procs import ServiceProcess, wait_until
from tests.test_client_misbehaving import JSON, Producer, a_select_answer, on

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

_topics = itertools.count(1)
#: Detour's own refusal of a report (its error body, exactly).
REFUSED = answer(409, b'{"error": "TABLE_FULL", "message": "full", "field": null}', JSON)


@pytest.fixture
def front(service: ServiceProcess) -> Iterator[FaultyFront]:
    with FaultyFront(service.url) as f:
        yield f


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def made(kind: str, front: FaultyFront) -> Iterator[Callable[..., Producer]]:
    """Makes producers of ``kind`` through the front (whole calls: ``decide_within=None``
    unless given); closes them after the test."""
    producers: list[Producer] = []

    def make(**settings: Any) -> Producer:
        settings.setdefault("decide_within", None)
        settings.setdefault("timeout", 1.0)
        p = Producer(kind, front.url, **settings)
        producers.append(p)
        return p

    yield make
    for p in producers:
        p.close()


def run(p: Producer, method: str, *args: Any) -> Any:
    """``method`` of the producer's client, awaited for the async one."""
    if p.sync is not None:
        return getattr(p.sync, method)(*args)
    return p.loop.run_until_complete(getattr(p.aio, method)(*args))


def polled(p: Producer, check: Callable[[], bool]) -> Callable[[], bool]:
    """``check``, after letting the async client's loop run a moment (its background
    tasks run only while the loop does)."""

    def poll() -> bool:
        if p.sync is None:
            p.loop.run_until_complete(asyncio.sleep(0.01))
        return check()

    return poll


def core_of(p: Producer) -> ClientCore:
    return (p.sync or p.aio)._core  # type: ignore[union-attr]


def learned(p: Producer, topic: str) -> None:
    """The producer has had a send Detour answered: it knows the route and the config."""
    wait_until(lambda: not p.send(topic).queue.local, 20, "a send Detour answered")


def new_topic(service: ServiceProcess) -> str:
    return two_broker_topic(service.url, f"tr{next(_topics)}")


def put_route(url: str, topic: str, brokers: dict[str, str | None]) -> str:
    body = {"brokers": [{"brokerName": b, "writeQueueNums": 1, "address": a}
                        for b, a in brokers.items()]}
    httpx.put(f"{url}/routes/{topic}", json=body, timeout=10).raise_for_status()
    return topic


def select_reply(topic: str, **fields: object) -> Callable[[Request], Reply | None]:
    return on("POST", "/select", answer(200, a_select_answer(topic, **fields), JSON))


# ------------------------------------------------ F3: no decoding, bounds on wire bytes
def _bomb() -> bytes:
    return gzip.compress(gzip.compress(b"\0" * (64 << 20), 9), 9)


@pytest.mark.parametrize("body", ["a valid answer", "a bomb"])
def test_a_compressed_answer_is_refused_unread(
    body: str, made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    """Whatever it holds, an answer encoded other than ``identity`` is not decoded: a bad
    answer, decided locally at once (a 2 KB bomb once held a send for 7 s and 2 GB)."""
    topic = new_topic(service)
    p = make_learned(made, topic)
    before = p.stats()
    data = gzip.compress(a_select_answer(topic)) if body == "a valid answer" else _bomb()
    headers = {**JSON, "content-encoding": "gzip" if body == "a valid answer" else "gzip, gzip"}
    front.misbehave(on("POST", "/select", answer(200, data, headers)))
    result, took = p.timed_send(topic)
    assert result.queue.local and took < 1.0
    assert p.since(before, "bad_answers") == (1,)


def make_learned(made: Callable[..., Producer], topic: str, **settings: Any) -> Producer:
    p = made(**settings)
    learned(p, topic)
    return p


def test_an_identity_encoded_answer_is_followed(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    p = make_learned(made, topic)
    front.misbehave(on("POST", "/select", answer(
        200, a_select_answer(topic), {**JSON, "content-encoding": "identity"})))
    assert not p.send(topic).queue.local


def test_a_compressed_event_stream_is_refused_and_reconnected(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    snapshot = b'event: snapshot\ndata: {"now": 1, "config": {}, "routes": [], "items": []}\n\n'
    front.misbehave(on("GET", STREAM_PATH, answer(200, gzip.compress(snapshot), {
        "content-type": "text/event-stream", "content-encoding": "gzip"})))
    p = made(mode="cached")
    assert not run(p, "wait_ready", 0.2)  # (starts the async client's stream)
    wait_until(polled(p, lambda: p.stats().bad_answers >= 2), 20,
               "the stream refused, reconnected, refused")
    assert not p.stats().stream_connected and p.stats().stream_snapshots == 0


# ---------------------------------------------- F10: application/json, each key once
@pytest.mark.parametrize("case", ["text/html", "no content type", "a repeated key"])
def test_a_select_answer_not_json_or_with_a_key_twice_is_refused(
    case: str, made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    p = make_learned(made, topic)
    before = p.stats()
    body, headers = a_select_answer(topic), JSON
    if case == "text/html":
        headers = {"content-type": "text/html"}
    elif case == "no content type":
        headers = {}
    else:
        body = body[:-1] + f', "brokerName": "{topic}-b"}}'.encode()
    front.misbehave(on("POST", "/select", answer(200, body, headers)))
    assert p.send(topic).queue.local
    assert p.since(before, "bad_answers") == (1,)


def test_unknown_fields_in_an_answer_are_accepted(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    """Forward compatibility: a newer Detour may add fields."""
    topic = new_topic(service)
    p = make_learned(made, topic)
    front.misbehave(select_reply(topic, newerField={"x": 1}))
    result = p.send(topic)
    assert not result.queue.local and result.value == f"{topic}-a"


# ------------------------------------------------------- F1: the address is the route's
def test_an_answer_with_another_address_than_the_routes_is_refused(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = f"tr{next(_topics)}"
    addresses = {f"{topic}-a": "10.0.0.1:10911", f"{topic}-b": "10.0.0.2:10911"}
    put_route(service.url, topic, addresses)
    p = make_learned(made, topic)
    before = p.stats()
    for n, wrong in enumerate(("6.6.6.6:10911", "10.0.0.2:10911", None), 1):
        front.misbehave(select_reply(topic, address=wrong))
        result = p.send(topic)
        assert result.queue.local and result.queue.address == addresses[result.value]
        assert p.since(before, "bad_answers") == (n,)
    front.misbehave(select_reply(topic, address="10.0.0.1:10911"))
    wait_until(lambda: not p.send(topic).queue.local, 10, "the right address followed")


# -------------------------------------------------------- F2: the route before the first
def test_the_first_select_of_a_topic_is_checked_against_its_route(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    front.misbehave(select_reply(topic, brokerName="evil-broker", queueId=4242))
    p = made()
    result = p.send(topic)
    assert result.queue.local and result.value in (f"{topic}-a", f"{topic}-b")
    assert p.stats().bad_answers == 1
    paths = front.paths()
    assert paths.index(f"/routes/{topic}") < paths.index("/select")


def test_without_its_route_a_first_answer_is_not_followed(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    front.misbehave(on("GET", f"/routes/{topic}", hang_up()))
    p = made()
    with pytest.raises(DetourUnavailable, match="no route is known"):
        p.send(topic)
    assert p.stats().remote_selects == 0


# -------------------------------------------------- F4: avoided names, the table's cap
def test_avoided_names_outside_the_route_never_reach_the_table(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    p = make_learned(made, topic)
    names = [f"x{i}" for i in range(5000)] + ["", "not a broker!", f"{topic}-b"]
    front.misbehave(select_reply(topic, avoidedBrokers=names))
    for _ in range(3):
        assert not p.send(topic).queue.local
    faults = core_of(p).table.view.faults
    assert f"{topic}-b" in faults and set(faults) <= {f"{topic}-a", f"{topic}-b"}


def test_an_answer_avoiding_its_own_choice_is_refused(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    p = make_learned(made, topic)
    before = p.stats()
    front.misbehave(select_reply(topic, avoidedBrokers=[f"{topic}-a"]))
    assert p.send(topic).queue.local
    assert p.since(before, "bad_answers") == (1,)


def test_the_tables_cap_holds_for_many_answers_and_reports(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A route larger than the cap (made small here): answers' avoided brokers and the
    producer's own reports never take the table past it."""
    cap = 8
    monkeypatch.setattr(local_table, "MAX_ITEMS", cap)
    topic = f"tr{next(_topics)}"
    brokers = [f"{topic}-b{i}" for i in range(20)]
    put_route(service.url, topic, dict.fromkeys(brokers))
    p = make_learned(made, topic)
    faults = core_of(p).table.view.faults
    for n in range(30):
        avoided = [brokers[1 + (n * 5 + k) % 19] for k in range(5)]
        front.misbehave(select_reply(topic, brokerName=brokers[0], avoidedBrokers=avoided))
        assert not p.send(topic).queue.local
        assert len(faults) <= cap
    front.misbehave(None)
    for b in brokers:
        run(p, "report", b, 5000, True)
        assert len(faults) <= cap


def test_the_tables_cap_holds_for_the_stream_too() -> None:
    """Items from a stream event or a snapshot past the cap are not taken either."""
    table = LocalTable(lambda: 1_000)
    far = 10**12
    for i in range(local_table.MAX_ITEMS + 5):
        table.set_fault(f"b{i}", FaultItem(f"b{i}", 0, far))
    assert len(table.view.faults) == local_table.MAX_ITEMS
    many = {f"s{i}": FaultItem(f"s{i}", 0, far) for i in range(local_table.MAX_ITEMS + 5)}
    table.replace(Config(), [Route.from_brokers("t", [])], many)
    assert len(table.view.faults) == local_table.MAX_ITEMS


# ------------------------------------------------- F5, F11: cached mode finds its routes
def stalled_stream(release: threading.Event) -> Reply:
    """An event stream that sends a snapshot without routes, then nothing (until
    ``release``): a copy that is connected and behind."""
    body = json.dumps({"now": int(time.time() * 1000), "config": {}, "routes": [], "items": []})
    data = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
            + f"event: snapshot\ndata: {body}\n\n".encode())

    def reply(conn: Any) -> Written:
        conn.sendall(data)
        release.wait(30)
        return Written(len(data), len(data), ends_connection=True)

    return reply


def test_a_connected_cached_client_fetches_a_route_its_copy_lacks(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    release = threading.Event()
    try:
        front.misbehave(on("GET", STREAM_PATH, stalled_stream(release)))
        p = made(mode="cached")
        assert run(p, "wait_ready", 10) and p.stats().stream_connected
        topic = new_topic(service)  # pushed to nobody: the stream is stalled
        result = p.send(topic)
        assert result.queue.local and result.value in (f"{topic}-a", f"{topic}-b")
        with pytest.raises(DetourRequestError) as info:  # Detour's own 404: TopicNotFound
            p.send(f"tr-none-{next(_topics)}")
        assert info.value.status == 404
    finally:
        release.set()


def test_a_route_fetch_answered_late_is_not_written_over_the_streams_newer_route(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    """A cached copy that lacks a route fetches it. If the stream brings the topic's route
    while that fetch is on its way, the fetch's answer, read by Detour before, is not
    written over it: in cached mode nothing would fetch the route again, and the copy
    kept the older route until the topic's next change."""
    topic = f"tr{next(_topics)}"
    route = f"/routes/{topic}"
    release, held, go = threading.Event(), threading.Event(), threading.Event()

    def behave(r: Request) -> Reply | None:
        if r.path == STREAM_PATH and not release.is_set():
            return stalled_stream(release)  # connected, and nothing pushed
        if (r.method, r.path) == ("GET", route) and not held.is_set():
            before = httpx.get(f"{service.url}{route}", timeout=10).content  # Detour's now
            held.set()
            go.wait(20)  # answered after the stream's push
            return answer(200, before, JSON)
        return None

    # One behaviour throughout: switching with ``misbehave`` hangs up every connection.
    front.misbehave(behave)
    p = made(mode="cached", timeout=20.0, deadline=30.0)
    core = core_of(p)
    try:
        assert run(p, "wait_ready", 10)
        put_route(service.url, topic, {f"{topic}-a": None, f"{topic}-b": None})
        sent: list[Any] = []
        sender = threading.Thread(target=lambda: sent.append(p.send(topic)), daemon=True)
        sender.start()
        assert held.wait(10), "the route's fetch never came"
        newer = {f"{topic}-a", f"{topic}-b", f"{topic}-c"}
        put_route(service.url, topic, dict.fromkeys(newer))
        release.set()  # the stream reconnects: its snapshot has the newer route

        def pushed() -> bool:
            known = core.table.view.routes.get(topic)
            return known is not None and set(known.by_broker) == newer

        wait_until(pushed, 20, "the stream's push of the newer route")
    finally:
        go.set()
        release.set()
    sender.join(30)
    assert sent and sent[0].value in newer
    assert pushed(), f"the late fetch undid the push: {core.table.view.routes.get(topic)}"
    assert front.paths("GET").count(route) == 1


def test_a_cached_select_without_a_snapshot_keeps_to_its_deadline(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    """The stream never syncs: a send waits for it at most half of its deadline, fetches
    the route and decides locally, and once the route is known waits for nothing."""
    topic = new_topic(service)
    busy = b'{"error": "SYSTEM_BUSY", "message": "x", "field": null}'
    front.misbehave(on("GET", STREAM_PATH, answer(503, busy, JSON)))
    # A deadline long enough for the route's fetch on a busy machine: what is checked is
    # that the send never waits out the timeout for a snapshot (the code before waited the
    # whole 2 s, then raised), and that once the route is known it waits for the stream no
    # more (half the deadline, 0.5 s).
    p = made(mode="cached", deadline=1.0, timeout=2.0, decide_within=0.003)
    result, took = p.timed_send(topic)
    assert result.queue.local and took < 1.5
    for _ in range(3):
        result, took = p.timed_send(topic)
        assert result.queue.local and took < 0.5


# ------------------------------------------------------------- F6: report ids and fork
def test_report_ids_do_not_repeat_in_a_forked_child(front: FaultyFront, service: ServiceProcess
                                                     ) -> None:
    topic = new_topic(service)
    a = f"{topic}-a"
    client = DetourClient(front.url, decide_within=None, timeout=2.0)
    try:
        client.report(a, 1)
        front.misbehave(on("POST", "/report-latency", answer(503, b"busy")))
        client.report(a, 2)  # queued: the parent's to send
        front.misbehave(None)
        assert client.stats().pending_reports == 1
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, tell the parent what it saw, leave
            code = 1
            try:
                fresh = client.stats()
                for ms in (3, 4, 5):
                    client.report(a, ms)
                client.flush(5)  # (queued if the circuit the parent opened is still open)
                after = client.stats()
                os.write(write, json.dumps([fresh.pending_reports, fresh.sent_reports,
                                            after.sent_reports, after.dropped_reports]).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(read) as pipe:
            seen = json.loads(pipe.read() or "null")
        assert status == 0 and seen == [0, 0, 3, 0]
        for ms in (6, 7, 8):
            client.report(a, ms)
        assert client.flush(5)
        stats = client.stats()
        assert (stats.sent_reports, stats.dropped_reports, stats.pending_reports) == (5, 0, 0)
    finally:
        client.close()
    contents: dict[str, set[float]] = {}
    for r in front.requests:
        if r.path.startswith("/report-latency"):
            body = json.loads(r.body)
            for x in body.get("reports", [body]):
                contents.setdefault(x["reportId"], set()).add(x["latencyMs"])
    assert all(len(v) == 1 for v in contents.values()), contents  # no id for two reports
    assert len(contents) == 8
    prefixes = {i.rsplit("-", 1)[0] for i in contents}
    assert len(prefixes) == 2  # the parent's and the child's


# -------------------------------------------------- F7: refused reports are counted
def test_reports_detour_refuses_are_counted_as_dropped(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    p = make_learned(made, topic)
    before = p.stats()
    front.misbehave(on("POST", "/report-latency", REFUSED))
    for _ in range(3):
        p.send(topic)
    assert p.since(before, "dropped_reports", "sent_reports", "pending_reports") == (3, 0, 0)


def test_a_late_refusal_is_counted_too(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    p = make_learned(made, topic, decide_within=0.003, timeout=2.0)
    before = p.stats()
    body = b'{"error": "TABLE_FULL", "message": "full", "field": null}'
    late = (b"HTTP/1.1 409 Conflict\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode() + body)
    front.misbehave(on("POST", "/report-latency", trickle(late, 0.002)))
    core = core_of(p)  # nothing queued or late: the report goes straight to Detour
    wait_until(polled(p, lambda: not core.slow() and not len(core.pending)), 10, "no call late")
    before = p.stats()
    run(p, "report", f"{topic}-a", 1)
    wait_until(polled(p, lambda: p.since(before, "dropped_reports") == (1,)), 10,
               "the refusal counted")
    assert p.since(before, "late_answers")[0] >= 1


def test_a_refused_batch_chunk_is_counted_and_the_later_chunks_sent(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    p = make_learned(made, topic)
    before = p.stats()
    refused: list[Request] = []

    def refuse_the_first_batch(request: Request) -> Reply | None:
        if request.path == "/report-latency:batch" and not refused:
            refused.append(request)
            return REFUSED
        return None

    front.misbehave(refuse_the_first_batch)
    with pytest.raises(DetourRequestError):
        run(p, "report_batch", [Report(f"{topic}-a", 1)] * 1500)
    assert p.since(before, "dropped_reports") == (1000,)
    assert p.flush(5)
    assert p.since(before, "dropped_reports", "sent_reports", "pending_reports") == (1000, 500, 0)


# -------------------------------------------- F9: a report answer must be Detour's
def test_a_report_answer_that_is_not_detours_leaves_the_reports_pending(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    p = make_learned(made, topic)
    before = p.stats()
    ok = answer(200, b'{"status": "ok"}', JSON)
    front.requests.clear()
    front.misbehave(lambda r: ok if r.path.startswith("/report-latency") else None)
    p.send(topic)
    run(p, "report_batch", [Report(f"{topic}-a", 1)] * 3)
    assert not p.flush(0.5)
    assert p.since(before, "sent_reports") == (0,)
    assert p.since(before, "bad_answers")[0] >= 1 and p.stats().pending_reports == 4
    first_ids = set(_report_ids(front.requests))
    front.requests.clear()
    front.misbehave(None)
    assert p.flush(5)
    assert p.since(before, "sent_reports", "dropped_reports") == (4, 0)
    replayed = _report_ids(front.requests)
    assert first_ids and first_ids <= set(replayed) and len(set(replayed)) == 4  # the same ids


def _report_ids(requests: list[Request]) -> list[str]:
    out = []
    for r in requests:
        if r.path.startswith("/report-latency"):
            body = json.loads(r.body)
            out += [x["reportId"] for x in body.get("reports", [body])]
    return out


def test_a_batch_answer_with_a_result_missing_is_not_counted_as_sent(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    p = make_learned(made, topic)
    before = p.stats()
    one = {"brokerName": f"{topic}-a", "latencyMs": 1, "notAvailableDurationMs": 0,
           "availableAt": 1, "degraded": False}
    short = answer(200, json.dumps({"results": [one]}).encode(), JSON)
    front.misbehave(on("POST", "/report-latency:batch", short))
    run(p, "report_batch", [Report(f"{topic}-a", 1)] * 2)
    assert p.since(before, "sent_reports", "bad_answers") == (0, 1)
    assert p.stats().pending_reports == 2


# ---------------------------------------------------- F8: ids Detour no longer knows
def declined_as_expired(request: Request) -> Reply | None:
    """Detour's answer shape, every report declined as ``expired`` (as a server that can
    no longer prove it has not applied an id'd report answers)."""
    if not request.path.startswith("/report-latency"):
        return None
    body = json.loads(request.body)

    def result(r: dict[str, Any]) -> dict[str, Any]:
        return {"brokerName": r["brokerName"], "latencyMs": 1, "notAvailableDurationMs": 0,
                "availableAt": 1, "degraded": False, "duplicate": False, "expired": True}

    out = {"results": [result(r) for r in body["reports"]]} if "reports" in body else result(body)
    return answer(200, json.dumps(out).encode(), JSON)


def test_reports_detour_declines_as_expired_are_counted_so(
    made: Callable[..., Producer], front: FaultyFront, service: ServiceProcess
) -> None:
    topic = new_topic(service)
    p = make_learned(made, topic)
    before = p.stats()
    front.misbehave(declined_as_expired)
    run(p, "report_batch", [Report(f"{topic}-a", 1)] * 2)
    run(p, "report", f"{topic}-a", 1)
    assert p.since(before, "expired_reports", "sent_reports", "dropped_reports") == (3, 0, 0)
    assert p.stats().pending_reports == 0
