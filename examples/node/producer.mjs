// A RocketMQ-style producer loop that asks Detour where to send and tells it how each send went.
//
// Run (Node 20, no packages: global fetch, performance.now):
//     node examples/node/producer.mjs http://127.0.0.1:8080
//     DETOUR_TOKEN=dtr_... node examples/node/producer.mjs https://detour.internal:8080
//
// DETOUR_TOKEN, when set and not empty, goes with every call as "Authorization: Bearer <token>".
// The program registers its route (PUT /routes), which needs an admin token; a Detour without
// tokens (loopback only) needs none. Without a valid token Detour answers 401 (403 for a
// producer token), the route is not registered and the program exits 2.
//
// The "brokers" are in-process stand-ins: node-broker-a is down (every send throws),
// node-broker-b answers in a few ms. The loop is RocketMQ's sendDefaultImpl: up to 3 attempts
// per message; each attempt selects a queue passing the broker the previous attempt failed on,
// sends, measures the send with a monotonic clock and reports the latency (isolation on failure).
// Exit code: 0 when every message was delivered, 1 when one was not, 2 when Detour refused the
// route.

const DETOUR = (process.argv[2] ?? "http://127.0.0.1:8080").replace(/\/+$/, "");
const TOPIC = "example-node";
const BROKER_A = "node-broker-a"; // down: every send fails
const BROKER_B = "node-broker-b"; // healthy
const MESSAGES = 6;
const TIMES_TOTAL = 3; // RocketMQ: 1 + retryTimesWhenSendFailed (default 2)
const HTTP_TIMEOUT_MS = 5000; // every Detour call is bounded
const TOKEN = process.env.DETOUR_TOKEN || ""; // empty or unset: no Authorization header
const HEADERS = {
  "content-type": "application/json",
  ...(TOKEN ? { authorization: `Bearer ${TOKEN}` } : {}),
};

/** One JSON call with a timeout; a non-2xx status throws with Detour's error body. */
async function call(method, path, body) {
  let response;
  try {
    response = await fetch(DETOUR + path, {
      method,
      headers: HEADERS,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal: AbortSignal.timeout(HTTP_TIMEOUT_MS),
    });
  } catch (err) {
    // fetch hides the reason (ECONNREFUSED, ...) in err.cause.
    throw new Error(`${method} ${path}: ${err.cause?.code ?? err.cause?.message ?? err.message}`);
  }
  const text = await response.text();
  if (!response.ok) throw new Error(`${method} ${path}: HTTP ${response.status} ${text}`);
  return JSON.parse(text);
}

/** The stand-in broker: a fails like a dead broker, b takes a couple of ms. */
async function deliver(broker, queueId, message) {
  if (broker === BROKER_A) throw new Error("connection refused");
  await new Promise((resolve) => setTimeout(resolve, 2));
}

/** POST /report-latency; returns the window Detour opened (ms), or "?" if the report failed. */
async function report(brokerName, latencyMs, isolation) {
  try {
    const answer = await call("POST", "/report-latency", { brokerName, latencyMs, isolation });
    return answer.notAvailableDurationMs;
  } catch (err) {
    // A lost report must not fail the send: log it and carry on.
    console.log(`  report for ${brokerName} failed: ${err.message}`);
    return "?";
  }
}

// 1. Register the topic's route: two brokers, two write queues each.
try {
  await call("PUT", `/routes/${TOPIC}`, {
    brokers: [
      { brokerName: BROKER_A, writeQueueNums: 2 },
      { brokerName: BROKER_B, writeQueueNums: 2 },
    ],
  });
} catch (err) {
  console.log(`cannot register the route at ${DETOUR}: ${err.message}`);
  process.exit(2);
}
console.log(`route ${TOPIC}: ${BROKER_A} (down), ${BROKER_B} (up), 2 queues each, at ${DETOUR}`);

// 2. Send the messages, each with RocketMQ's retry loop.
let delivered = 0;
let attempts = 0;
let failures = 0;
for (let msg = 1; msg <= MESSAGES; msg++) {
  let lastBrokerName = null; // the broker the previous attempt failed on
  let sent = false;
  for (let attempt = 1; attempt <= TIMES_TOTAL && !sent; attempt++) {
    attempts++;
    const prefix = `message ${msg} attempt ${attempt}: `;

    // Ask Detour for a queue. If Detour itself is unreachable this attempt fails;
    // a real producer would fall back to plain round-robin over its own route.
    let selected;
    try {
      selected = await call("POST", "/select", { topic: TOPIC, lastBrokerName });
    } catch (err) {
      failures++;
      console.log(`${prefix}select failed: ${err.message}`);
      continue;
    }
    const { brokerName, queueId, decision, avoidedBrokers } = selected;

    // Send, timing only the send itself. performance.now() is monotonic; Detour truncates
    // the fraction to whole ms.
    const start = performance.now();
    let error = null;
    try {
      await deliver(brokerName, queueId, `hello ${msg}`);
      sent = true;
    } catch (err) {
      error = err.message;
    }
    const latencyMs = performance.now() - start;

    // Report it: a failure isolates the broker (600 s with the default tiers).
    const window = await report(brokerName, latencyMs, !sent);
    const outcome = sent ? "ok in" : `FAILED (${error}) after`;
    console.log(
      `${prefix}broker=${brokerName} queue=${queueId} decision=${decision} ` +
        `avoided=${JSON.stringify(avoidedBrokers)} -> ${outcome} ${Math.trunc(latencyMs)} ms, ` +
        `Detour window ${window} ms`,
    );
    if (!sent) {
      failures++;
      lastBrokerName = brokerName;
    }
  }
  if (sent) delivered++;
  else console.log(`message ${msg}: NOT delivered after ${TIMES_TOTAL} attempts`);
}

// 3. Summary and exit code (exitCode, not exit(), so stdout is flushed first).
console.log(
  `summary: ${delivered}/${MESSAGES} messages delivered, ${attempts} attempts, ${failures} failed`,
);
process.exitCode = delivered === MESSAGES ? 0 : 1;
