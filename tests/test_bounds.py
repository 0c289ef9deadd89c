"""Streams, scrapes and connections: a live Detour bounds each, and another tenant never notices.

Every test runs ``python -m service`` as its own process on 127.0.0.1 and measures it
from outside: status codes, the server's RSS (``/proc/<pid>/status``) and CPU time
(``/proc/<pid>/stat``), and the latency another namespace's selects see meanwhile.
Every load loop is bounded in count and in time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import (
    ServiceProcess,
    ahead_of_the_machine,
    end_process,
    wait_until,
    write_tokens,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOKENS = {
    "admin-a": ("tok-admin-a", "admin", "a"),
    "prod-a": ("tok-prod-a", "producer", "a"),
    "prod-a2": ("tok-prod-a2", "producer", "a"),
    "admin-b": ("tok-admin-b", "admin", "b"),
    "prod-b": ("tok-prod-b", "producer", "b"),
    "scrape-b": ("tok-scrape-b", "metrics", "b"),
    "scrape-all": ("tok-scrape-all", "metrics", "*"),
}
#: What the other tenant's selects must keep: every one answered, p99 under this, or
#: under ``CALM_FACTOR`` times their own p99 measured just before the load where the
#: machine is too busy for that (CI shares 2 cores with other work): the flood must not
#: be what slows them.
P99_S = 0.050
CALM_FACTOR = 3.0
#: The same while the replica writes 600 non-reading clients their snapshots (an eighth of
#: ``DETOUR_STREAM_SEND_TIMEOUT_S``, which a select held behind one of them would wait).
STREAM_FLOOD_P99_S = 0.250


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name][0]}"}


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    return write_tokens(tmp_path / "tokens.json", TOKENS)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(http: httpx.Client, sample: str) -> float:
    """One sample of the live server's /metrics, scraped with the every-namespace token."""
    r = http.get("/metrics", headers=auth("scrape-all"))
    assert r.status_code == 200
    for line in r.text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no {sample}")


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


#: Namespace b's producer, in a process of its own so that the load this test makes
#: does not delay its measurements: selects at a producer's pace until told to stop.
_SELECTS = """
import json, os, sys, time
import httpx
url, token, max_n, max_s, stop = sys.argv[1:6]
latencies, statuses, errors = [], [], []
deadline = time.monotonic() + float(max_s)
with httpx.Client(base_url=url, timeout=10, headers={"Authorization": "Bearer " + token}) as c:
    c.post("/select", json={"topic": "t"})  # connected
    print("ready", flush=True)
    while len(statuses) < int(max_n) and time.monotonic() < deadline:
        if os.path.exists(stop):
            break
        start = time.perf_counter()
        r = c.post("/select", json={"topic": "t"})
        latencies.append(time.perf_counter() - start)
        statuses.append(r.status_code)
        if r.status_code != 200:
            errors.append(r.json().get("error"))
        time.sleep(0.002)
print(json.dumps({"latencies": latencies, "statuses": statuses, "errors": errors}), flush=True)
"""


class Selects:
    """Namespace b's producer selecting beside the load, in its own process, until stopped."""

    def __init__(self, url: str, max_n: int = 3000, max_s: float = 30) -> None:
        self._stop = Path(tempfile.mkdtemp(prefix="detour-selects-")) / "stop"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _SELECTS, url, TOKENS["prod-b"][0], str(max_n), str(max_s),
             str(self._stop)], stdout=subprocess.PIPE, text=True)
        self.max_s = max_s
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self.errors: list[str] = []

    def __enter__(self) -> Selects:
        assert self._proc.stdout is not None
        assert self._proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.touch()
        try:
            out, _ = self._proc.communicate(timeout=self.max_s + 30)
        finally:
            end_process(self._proc)
            shutil.rmtree(self._stop.parent, ignore_errors=True)
        result = json.loads(out)
        self.latencies, self.statuses = result["latencies"], result["statuses"]
        self.errors = result["errors"]

    def wait(self, timeout_s: float) -> None:
        """Until it has made all its selects (or ``timeout_s``)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout_s)

    def check(self, least: int = 100, calm_p99_s: float = 0.0, shed_per_mille: int = 0,
              p99_s: float = P99_S, calm_again: str | None = None) -> None:
        """Every select answered, p99 within the bound: ``p99_s``, or ``CALM_FACTOR`` times
        ``calm_p99_s`` (the same producer's p99 with no load beside it, from ``calm_p99``).

        ``calm_again``: the replica's URL, where the test's load has ended by now. Over the
        bound, the calm p99 is measured again after the load: the machine's noise on both
        sides of it (another worker's test may have started meanwhile). A slowdown the load
        itself caused is not in the second measurement, so it still fails.

        ``shed_per_mille``: where the test itself makes the replica shed (a storm of
        connects past the in-flight bound), a busy machine may also fast-fail a few of
        the other tenant's selects. Those must be the shedder's ``SYSTEM_BUSY`` (the SDK
        answers it locally at once), at most this many per thousand; nothing else.
        """
        assert len(self.statuses) >= least, len(self.statuses)
        refused = [s for s in self.statuses if s != 200]
        shed = [e for s, e in zip(refused, self.errors, strict=True)
                if s == 503 and e == "SYSTEM_BUSY"]
        allowed = len(self.statuses) * shed_per_mille // 1000
        assert len(refused) == len(shed) <= allowed, (
            f"{len(refused)} of {len(self.statuses)} selects refused: "
            f"{list(zip(refused, self.errors, strict=True))[:5]}")
        bound = max(p99_s, CALM_FACTOR * calm_p99_s)
        calm_after = None
        if p99(self.latencies) >= bound and calm_again is not None:
            calm_after = calm_p99(calm_again)
            bound = max(bound, CALM_FACTOR * calm_after)
        assert p99(self.latencies) < bound, (
            f"p99 {p99(self.latencies) * 1000:.1f} ms over {len(self.latencies)} selects "
            f"(calm p99 {calm_p99_s * 1000:.1f} ms before the load"
            + (f", {calm_after * 1000:.1f} ms after it)" if calm_after is not None else ")"))


def calm_p99(url: str) -> float:
    """Namespace b's select p99 with nothing else going on: the machine's own noise."""
    with Selects(url, max_n=400, max_s=2) as calm:
        calm.wait(10)
    return p99(calm.latencies)


def _route(prefix: str, n: int) -> dict[str, object]:
    return {"brokers": [{"brokerName": f"{prefix}{i}", "writeQueueNums": 4} for i in range(n)]}


def _calm_tenant(http: httpx.Client) -> None:
    r = http.put("/routes/t", json=_route("calm-", 2), headers=auth("admin-b"))
    assert r.status_code == 200, r.text


def _busy_table(http: httpx.Client, brokers: int) -> None:
    """Namespace a: a route over ``brokers`` brokers, each reported, half of them avoided."""
    for start in range(0, brokers, 250):
        names = [f"broker-{i}" for i in range(start, min(brokers, start + 250))]
        r = http.put(f"/routes/busy-{start}", json={"brokers": [
            {"brokerName": b, "writeQueueNums": 4} for b in names]}, headers=auth("admin-a"))
        assert r.status_code == 200, r.text
        r = http.post("/report-latency:batch", headers=auth("prod-a"), json={"reports": [
            {"brokerName": b, "latencyMs": 3001 if i % 2 else 20, "isolation": bool(i % 2)}
            for i, b in enumerate(names)]})
        assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------ /metrics
def test_scrapes_need_a_token_stay_bounded_and_never_slow_selects(tokens_file: Path) -> None:
    env = {"DETOUR_TOKENS_FILE": str(tokens_file), "DETOUR_METRICS_MAX_BROKERS": "300",
           "DETOUR_METRICS_CACHE_S": "1"}  # (the default; the suite's is 0)
    with ServiceProcess(env=env) as svc, httpx.Client(base_url=svc.url, timeout=30) as http:
        ahead_of_the_machine(svc.proc.pid)
        _calm_tenant(http)
        _busy_table(http, 1000)
        # Who may scrape, and what each sees.
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers=auth("prod-a")).status_code == 403
        own = http.get("/metrics", headers=auth("scrape-b"))
        assert own.status_code == 200
        assert 'namespace="a"' not in own.text and 'namespace="b"' in own.text
        full = http.get("/metrics", headers=auth("scrape-all")).text
        # Per-broker series bounded: 300 names of their own on the counters (the rest
        # under _other), at most 300 brokers on the table's gauges; no per-broker histogram.
        brokers = {ln.split('broker="', 1)[1].split('"', 1)[0]
                   for ln in full.splitlines() if 'broker="' in ln}
        assert "_other" in brokers and len(brokers) <= 2 * 300 + 1
        gauges = [ln for ln in full.splitlines()
                  if ln.startswith("detour_broker_avoided{") and 'namespace="a"' in ln]
        assert len(gauges) == 300  # of namespace a's 1,000
        assert not any(ln.startswith("detour_reported_latency_seconds_bucket{broker=")
                       or ("reported_latency" in ln and "broker=" in ln)
                       for ln in full.splitlines())
        assert 'detour_fault_items{namespace="a"} 1000.0' in full  # totals stay complete

        # Two scrape loops as fast as they can go, beside namespace b's selects.
        bodies: list[bytes] = []
        stop = threading.Event()

        def scrape() -> None:
            with httpx.Client(base_url=svc.url, timeout=30,
                              headers=auth("scrape-all")) as c:
                for _ in range(200):
                    if stop.is_set():
                        return
                    r = c.get("/metrics")
                    assert r.status_code == 200
                    bodies.append(r.content)

        scrapers = [threading.Thread(target=scrape, daemon=True) for _ in range(2)]
        started = time.monotonic()
        calm = calm_p99(svc.url)
        with Selects(svc.url, max_n=1500, max_s=6) as selects:
            for t in scrapers:
                t.start()
            selects.wait(20)
        stop.set()
        for t in scrapers:
            t.join(30)
        elapsed = time.monotonic() - started
        selects.check(least=200, calm_p99_s=calm, calm_again=svc.url)
        # At most one rendering a second, however often it is asked for.
        assert len(bodies) >= 4
        assert len(set(bodies)) <= elapsed + 2, (len(set(bodies)), len(bodies), elapsed)


# ---------------------------------------------------------------------------- SSE streams
def _open_stream(port: int, token: str, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    s.sendall(b"GET /fault-items/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Authorization: Bearer " + token.encode() + b"\r\n\r\n")
    return s


def _status(s: socket.socket) -> tuple[int, bytes]:
    """The response's status and what came with the head (the stream's first bytes)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    return int(data.split(b" ", 2)[1]), data


def test_stream_caps_per_token_and_per_process(tokens_file: Path) -> None:
    env = {"DETOUR_TOKENS_FILE": str(tokens_file), "DETOUR_STREAM_MAX": "5",
           "DETOUR_STREAM_MAX_PER_TOKEN": "3"}
    with ServiceProcess(env=env) as svc:
        held = [_open_stream(svc.port, TOKENS["prod-a"][0]) for _ in range(3)]
        try:
            assert all(_status(s)[0] == 200 for s in held)
            with httpx.Client(base_url=svc.url, timeout=10) as http:
                r = http.get("/fault-items/stream", headers=auth("prod-a"))
                assert r.status_code == 429 and r.json()["error"] == "TOO_MANY_STREAMS"
                assert r.headers["retry-after"] == "1"
                held += [_open_stream(svc.port, TOKENS["prod-a2"][0]) for _ in range(2)]
                assert all(_status(s)[0] == 200 for s in held[3:])
                r = http.get("/fault-items/stream", headers=auth("prod-b"))
                assert r.status_code == 503 and r.json()["error"] == "SYSTEM_BUSY"
                # A closed stream frees its place.
                held.pop(0).close()

                def reopened() -> bool:
                    s = _open_stream(svc.port, TOKENS["prod-b"][0])
                    code = _status(s)[0]
                    if code == 200:
                        held.append(s)
                        return True
                    s.close()
                    return False

                wait_until(reopened, 10, "a stream after one closed", interval_s=0.1)
                assert metric(http, 'detour_push_streams_refused_total{reason="token"}') == 1
                assert metric(http, 'detour_push_streams_refused_total{reason="process"}') >= 1
        finally:
            for s in held:
                s.close()


def test_streams_never_take_more_than_half_the_connections(tokens_file: Path) -> None:
    """A stream is never idle (it cannot be closed to make room) and one that reads none of
    its few bytes a second fills no buffer for hours: streams alone must not take every
    connection. With 8 connections and the default stream cap, 4 streams are served, the
    5th is refused, and a producer still gets its select."""
    env = {"DETOUR_TOKENS_FILE": str(tokens_file), "DETOUR_MAX_CONNECTIONS": "8",
           "DETOUR_MAX_CONNECTIONS_PER_PEER": "8"}  # fmt: skip
    with ServiceProcess(env=env) as svc:
        held: list[socket.socket] = []
        try:
            for i in range(4):
                s = _open_stream(svc.port, TOKENS["prod-a" if i < 2 else "prod-a2"][0])
                held.append(s)
                assert _status(s)[0] == 200
            fifth = _open_stream(svc.port, TOKENS["prod-b"][0])
            held.append(fifth)
            assert _status(fifth)[0] == 503
            with httpx.Client(base_url=svc.url, timeout=10) as http:
                http.put("/routes/orders", headers=auth("admin-a"),
                         json=_route("o", 2)).raise_for_status()  # fmt: skip
                r = http.post("/select", headers=auth("prod-a"), json={"topic": "orders"})
                assert r.status_code == 200, r.text
        finally:
            for s in held:
                s.close()


@pytest.mark.timeout(300)
def test_clients_that_never_read_are_dropped_and_memory_stays_bounded(
        tokens_file: Path, tmp_path: Path) -> None:
    env = {"DETOUR_TOKENS_FILE": str(tokens_file), "DETOUR_STREAM_MAX": "1000",
           "DETOUR_STREAM_MAX_PER_TOKEN": "1000", "DETOUR_STREAM_SEND_TIMEOUT_S": "2",
           # 600 streams plus the other tenant's: above the edge's default of 512, and
           # all from 127.0.0.1, one peer (default cap 256).
           "DETOUR_MAX_CONNECTIONS": "2000", "DETOUR_MAX_CONNECTIONS_PER_PEER": "2000"}
    with ServiceProcess(env=env, log_path=tmp_path / "detour.log") as svc, \
            httpx.Client(base_url=svc.url, timeout=30) as http:
        ahead_of_the_machine(svc.proc.pid)
        _calm_tenant(http)
        _busy_table(http, 2500)  # a snapshot of ~350 KB: more than a socket takes (~150 KB)
        warm = _open_stream(svc.port, TOKENS["admin-a"][0])  # the shared snapshot, rendered
        assert _status(warm)[0] == 200
        warm.close()
        pid = svc.proc.pid
        before = peak = rss_kb(pid)
        after: list[int] = []
        dropped_before = 0.0
        calm = calm_p99(svc.url)
        with Selects(svc.url, max_n=5000, max_s=120) as selects:
            for _wave in range(2):
                clients: list[socket.socket] = []
                try:
                    # 200 connects a second (the repro: 600 in 9 s).
                    for _ in range(600):
                        clients.append(_open_stream(svc.port, TOKENS["prod-a"][0], rcvbuf=4096))
                        if len(clients) % 20 == 0:
                            peak = max(peak, rss_kb(pid))
                            time.sleep(0.1)

                    def refused() -> int:
                        """Connects the shedder refused (503 at once): they hold nothing."""
                        return sum(s.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 503"
                                   for s in clients)  # noqa: B023 - this wave's

                    def all_gone() -> bool:
                        nonlocal peak
                        peak = max(peak, rss_kb(pid))
                        dropped = metric(http, "detour_push_streams_dropped_total")
                        return dropped - dropped_before + refused() == 600  # noqa: B023

                    wait_until(all_gone, 60, "600 non-reading clients dropped", interval_s=0.5)
                    assert refused() < 300  # most were served, then dropped
                    dropped_before = metric(http, "detour_push_streams_dropped_total")
                finally:
                    for s in clients:
                        s.close()
                after.append(rss_kb(pid))
        # Here the replica has real work beside the selects: 1,200 snapshots of ~350 KB
        # to write, on a machine CI shares (its selects' p99 reached 75 ms with a CPU hog
        # and two other test workers). What must not happen is a select waiting behind a
        # client that does not read: that is the send timeout, 2 s.
        selects.check(least=100, calm_p99_s=calm, shed_per_mille=5, p99_s=STREAM_FLOOD_P99_S)
        # Bounded: while it lasted, each held its buffers (16 KiB in the process above a
        # fixed kernel buffer) and a slice of the shared snapshot, never its own copy
        # (600 copies of the snapshot alone would be 210 MB).
        assert (peak - before) < 64 * 1024, f"peak RSS +{(peak - before) // 1024} MB"
        # And nothing stays behind per client: a second wave leaves RSS where the first did.
        assert after[1] - after[0] < 8 * 1024, f"second wave +{(after[1] - after[0]) // 1024} MB"
        # The replica still serves streams.
        s = _open_stream(svc.port, TOKENS["prod-b"][0])
        try:
            assert _status(s)[0] == 200
        finally:
            s.close()


def test_a_reconnect_loop_costs_little_and_another_tenant_never_notices(
        tokens_file: Path) -> None:
    """A client that reconnects to the stream as fast as it can (each connect reads its
    snapshot of a 1,000-broker table) costs the replica little CPU per connect, and
    namespace b's selects beside it keep their calm p99."""
    with ServiceProcess(env={"DETOUR_TOKENS_FILE": str(tokens_file)}) as svc, \
            httpx.Client(base_url=svc.url, timeout=30) as http:
        ahead_of_the_machine(svc.proc.pid)
        _calm_tenant(http)
        _busy_table(http, 1000)
        connects = 0
        cpu_before = cpu_s(svc.proc.pid)
        calm = calm_p99(svc.url)
        with Selects(svc.url, max_n=3000, max_s=30) as selects:
            deadline = time.monotonic() + 8
            while connects < 400 and time.monotonic() < deadline:
                s = _open_stream(svc.port, TOKENS["prod-a"][0])
                try:
                    code, head = _status(s)
                    assert code == 200
                    # Read the whole snapshot event, as a client does, then hang up.
                    while b"\n\n" not in head.split(b"\r\n\r\n", 1)[1]:
                        chunk = s.recv(1 << 20)
                        assert chunk
                        head += chunk
                finally:
                    s.close()
                connects += 1
        cpu_per_connect = (cpu_s(svc.proc.pid) - cpu_before) / connects
        selects.check(least=100, calm_p99_s=calm, calm_again=svc.url)
        assert connects >= 50
        # The snapshot is rendered once per table change and shared by every connect,
        # not once per connect: 40-55 ms of CPU each before.
        assert cpu_per_connect < 0.015, f"{cpu_per_connect * 1000:.1f} ms of CPU per connect"
