// Open-loop load at a fixed arrival rate, for bench/overload.py (Node, standard library only).
//
// Why not wrk: wrk is closed-loop (a connection sends again only after its answer), so a
// slow server slows the load down and a fixed overload factor cannot be offered. Here
// requests arrive as a Poisson process at --rate per second, spread over --conns
// keep-alive connections; a connection carries one request at a time (as a producer's
// HTTP client does), and a request due while its connection is busy waits for it and is
// counted as "late". Latency is measured from when the request was due, so waiting for a
// busy connection is included (no coordinated omission).
//
// Prints one JSON line: counts and latency percentiles (ms) per outcome (ok = 2xx,
// busy = 503, other), the offered and achieved rates, and how many starts were late.
// With --timeline MS, also the counts and p99s of each MS-long bin of due times: whether
// a p99 comes from the start of an overload or from all of it.
"use strict";

const net = require("node:net");

function arg(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? process.argv[i + 1] : fallback;
}

const host = arg("host", "127.0.0.1");
const port = Number(arg("port", "8080"));
const path = arg("path", "/select");
const body = arg("body", "{}");
const rate = Number(arg("rate", "1000"));
const conns = Number(arg("conns", "256"));
const durationS = Number(arg("duration", "5"));
const warmupS = Number(arg("warmup", "1"));
const seed0 = Number(arg("seed", "1"));
const binMs = Number(arg("timeline", "0"));
const bins = new Map();
if (host !== "127.0.0.1") throw new Error("benchmarks only target 127.0.0.1");

const request = Buffer.from(
  `POST ${path} HTTP/1.1\r\nHost: ${host}:${port}\r\nContent-Type: application/json\r\n` +
    `Content-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`,
);

// Deterministic exponential gaps (mulberry32), so runs differ only by the server.
let seed = seed0 >>> 0;
function random() {
  seed = (seed + 0x6d2b79f5) >>> 0;
  let t = seed;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}

const nowMs = () => performance.now();
const lat = { ok: [], busy: [], other: [] };
// The same answers timed from when they went on the wire (what the server can influence).
const wire = { ok: [], busy: [], other: [] };
let late = 0;
let sent = 0;
let errors = 0;
let measuring = false;
let stopping = false;

class Conn {
  constructor() {
    this.queue = []; // due times of requests waiting for this connection
    this.inFlight = null; // due time of the request on the wire
    this.buf = Buffer.alloc(0);
    this.sock = net.connect({ host, port });
    this.sock.setNoDelay(true);
    this.sock.on("data", (d) => this.onData(d));
    this.sock.on("error", () => { errors++; });
  }

  due(t) {
    if (this.inFlight === null) this.send(t);
    else { this.queue.push(t); if (measuring) late++; }
  }

  send(t) {
    this.inFlight = t;
    this.sentAt = nowMs();
    if (measuring) sent++;
    this.sock.write(request);
  }

  onData(d) {
    this.buf = this.buf.length ? Buffer.concat([this.buf, d]) : d;
    for (;;) {
      const end = this.buf.indexOf("\r\n\r\n");
      if (end < 0) return;
      const head = this.buf.toString("latin1", 0, end);
      const m = /content-length:\s*(\d+)/i.exec(head);
      const total = end + 4 + (m ? Number(m[1]) : 0);
      if (this.buf.length < total) return;
      const status = Number(head.slice(9, 12));
      this.buf = this.buf.subarray(total);
      const t = this.inFlight;
      this.inFlight = null;
      if (measuring && t !== null && t >= measureFrom) {
        const now = nowMs();
        const kind = status >= 200 && status < 300 ? "ok" : status === 503 ? "busy" : "other";
        lat[kind].push(now - t);
        if (binMs > 0) {
          const b = Math.floor((t - measureFrom) / binMs);
          if (!bins.has(b)) bins.set(b, { ok: [], busy: [], other: [] });
          bins.get(b)[kind].push(now - t);
        }
        wire[kind].push(now - this.sentAt);
      }
      if (this.queue.length) this.send(this.queue.shift());
    }
  }
}

function pct(values, p) {
  if (!values.length) return null;
  const i = Math.min(values.length - 1, Math.ceil((p / 100) * values.length) - 1);
  return Math.round(values[Math.max(0, i)] * 1000) / 1000;
}

function summary(values) {
  values.sort((a, b) => a - b);
  return {
    count: values.length,
    p50_ms: pct(values, 50), p90_ms: pct(values, 90), p99_ms: pct(values, 99),
    p999_ms: pct(values, 99.9), max_ms: values.length ? pct(values, 100) : null,
  };
}

const pool = Array.from({ length: conns }, () => new Conn());
let measureFrom = Infinity;
let measureUntil = Infinity;

function start() {
  const t0 = nowMs();
  measureFrom = t0 + warmupS * 1000;
  measureUntil = measureFrom + durationS * 1000;
  let next = t0;
  let turn = 0;
  // Every millisecond, issue the arrivals that fell due (setTimeout alone drifts).
  const timer = setInterval(() => {
    const now = nowMs();
    if (!measuring && now >= measureFrom) measuring = true;
    while (next <= now && next < measureUntil) {
      pool[turn].due(next);
      turn = (turn + 1) % pool.length;
      next += (-Math.log(1 - random()) * 1000) / rate;
    }
    if (now >= measureUntil && !stopping) {
      stopping = true;
      clearInterval(timer);
      // Answers to requests due before the end still count; give them a bounded time.
      setTimeout(finish, 2000);
    }
  }, 1);
}

function finish() {
  measuring = false;
  const unanswered = pool.reduce((n, c) => n + c.queue.length + (c.inFlight === null ? 0 : 1), 0);
  const out = {
    offered_rps: rate,
    achieved_send_rps: sent / durationS,
    answered_rps: (lat.ok.length + lat.busy.length + lat.other.length) / durationS,
    conns, duration_s: durationS, late_starts: late, socket_errors: errors, unanswered,
    ok: summary(lat.ok), busy: summary(lat.busy), other: summary(lat.other),
    wire: { ok: summary(wire.ok), busy: summary(wire.busy), other: summary(wire.other) },
  };
  if (binMs > 0) {
    out.timeline = [...bins.keys()].sort((a, b) => a - b).map((b) => {
      const v = bins.get(b);
      return { from_ms: b * binMs, ok: v.ok.length, ok_p99: pct(v.ok.sort((x, y) => x - y), 99),
        busy: v.busy.length, busy_p99: pct(v.busy.sort((x, y) => x - y), 99) };
    });
  }
  process.stdout.write(`OVERLOAD_JSON ${JSON.stringify(out)}\n`);
  for (const c of pool) c.sock.destroy();
  process.exit(0);
}

let connected = 0;
for (const c of pool) {
  c.sock.on("connect", () => { if (++connected === pool.length) start(); });
}
setTimeout(() => { if (connected < pool.length) { console.error("connect timeout"); process.exit(2); } }, 10000);
