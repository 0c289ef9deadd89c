// A RocketMQ-style producer loop that asks Detour where to send and tells it how each send went.
//
// Run (Java 17+, standard library only, no build step):
//     java examples/java/DetourProducer.java http://127.0.0.1:8080
//     DETOUR_TOKEN=dtr_... java examples/java/DetourProducer.java https://detour.internal:8080
//
// DETOUR_TOKEN, when set and not empty, goes with every call as "Authorization: Bearer <token>".
// The program registers its route (PUT /routes), which needs an admin token; a Detour without
// tokens (loopback only) needs none. Without a valid token Detour answers 401 (403 for a
// producer token), the route is not registered and the program exits 2.
//
// The "brokers" are in-process stand-ins: java-broker-a is down (every send throws),
// java-broker-b answers in a few ms. The loop is RocketMQ's sendDefaultImpl: up to 3 attempts
// per message; each attempt selects a queue passing the broker the previous attempt failed on,
// sends, measures the send with a monotonic clock and reports the latency (isolation on failure).
// Exit code: 0 when every message was delivered, 1 when one was not, 2 when Detour refused the
// route.
//
// JSON: no library, on purpose. Requests are built as strings (broker names and topics match
// [A-Za-z0-9_.%|-], so they never need escaping). Responses are read with field(), a regex
// that returns the first top-level-looking "name": value pair. It does not unescape strings or
// understand nesting: good enough for Detour's flat responses, not a general JSON parser. Use
// a real one (Jackson, Gson) in production code.

import java.io.IOException;
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class DetourProducer {
    static final String TOPIC = "example-java";
    static final String BROKER_A = "java-broker-a"; // down: every send fails
    static final String BROKER_B = "java-broker-b"; // healthy
    static final int MESSAGES = 6;
    static final int TIMES_TOTAL = 3; // RocketMQ: 1 + retryTimesWhenSendFailed (default 2)
    static final Duration HTTP_TIMEOUT = Duration.ofSeconds(5); // every Detour call is bounded

    // HTTP/1.1: the default HTTP/2 client would first try an h2c upgrade, which Detour ignores.
    static final HttpClient HTTP = HttpClient.newBuilder()
            .version(HttpClient.Version.HTTP_1_1)
            .connectTimeout(HTTP_TIMEOUT)
            .build();
    static String detour;
    // Empty or unset: no Authorization header.
    static final String TOKEN = System.getenv().getOrDefault("DETOUR_TOKEN", "");

    public static void main(String[] args) throws InterruptedException {
        detour = (args.length > 0 ? args[0] : "http://127.0.0.1:8080").replaceAll("/+$", "");

        // 1. Register the topic's route: two brokers, two write queues each.
        try {
            call("PUT", "/routes/" + TOPIC, "{\"brokers\":["
                    + "{\"brokerName\":\"" + BROKER_A + "\",\"writeQueueNums\":2},"
                    + "{\"brokerName\":\"" + BROKER_B + "\",\"writeQueueNums\":2}]}");
        } catch (IOException e) {
            System.out.println("cannot register the route at " + detour + ": " + e.getMessage());
            System.exit(2);
        }
        System.out.println("route " + TOPIC + ": " + BROKER_A + " (down), " + BROKER_B
                + " (up), 2 queues each, Detour " + detour);

        // 2. Send the messages, each with RocketMQ's retry loop.
        int delivered = 0, attempts = 0, failures = 0;
        for (int msg = 1; msg <= MESSAGES; msg++) {
            String lastBrokerName = null; // the broker the previous attempt failed on
            boolean sent = false;
            for (int attempt = 1; attempt <= TIMES_TOTAL && !sent; attempt++) {
                attempts++;
                String prefix = "message " + msg + " attempt " + attempt + ": ";

                // Ask Detour for a queue. If Detour itself is unreachable this attempt fails;
                // a real producer would fall back to plain round-robin over its own route.
                String selected;
                try {
                    selected = call("POST", "/select", "{\"topic\":\"" + TOPIC
                            + "\",\"lastBrokerName\":" + jsonString(lastBrokerName) + "}");
                } catch (IOException e) {
                    failures++;
                    System.out.println(prefix + "select failed: " + e.getMessage());
                    continue;
                }
                String broker = field(selected, "brokerName");
                String queueId = field(selected, "queueId");

                // Send, timing only the send itself (RocketMQ's beginTimestampPrev..endTimestamp).
                long start = System.nanoTime();
                String error = null;
                try {
                    deliver(broker, Integer.parseInt(queueId), "hello " + msg);
                    sent = true;
                } catch (IOException e) {
                    error = e.getMessage();
                }
                long latencyMs = (System.nanoTime() - start) / 1_000_000;

                // Report it: a failure isolates the broker (600 s with the default tiers).
                String window = report(broker, latencyMs, !sent);
                System.out.println(prefix + "broker=" + broker + " queue=" + queueId
                        + " decision=" + field(selected, "decision")
                        + " avoided=" + arrayField(selected, "avoidedBrokers")
                        + (sent ? " -> ok in " : " -> FAILED (" + error + ") after ")
                        + latencyMs + " ms, Detour window " + window + " ms");
                if (!sent) {
                    failures++;
                    lastBrokerName = broker;
                }
            }
            if (sent) {
                delivered++;
            } else {
                System.out.println("message " + msg + ": NOT delivered after " + TIMES_TOTAL
                        + " attempts");
            }
        }

        // 3. Summary and exit code.
        System.out.println("summary: " + delivered + "/" + MESSAGES + " messages delivered, "
                + attempts + " attempts, " + failures + " failed");
        System.exit(delivered == MESSAGES ? 0 : 1);
    }

    /** The stand-in broker: a fails like a dead broker, b takes a couple of ms. */
    static void deliver(String broker, int queueId, String body) throws IOException {
        if (BROKER_A.equals(broker)) {
            throw new IOException("connection refused");
        }
        try {
            Thread.sleep(2);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new IOException("interrupted");
        }
    }

    /** POST /report-latency; returns the window Detour opened (ms), or "?" if the report failed. */
    static String report(String broker, long latencyMs, boolean isolation) {
        try {
            String answer = call("POST", "/report-latency", "{\"brokerName\":\"" + broker
                    + "\",\"latencyMs\":" + latencyMs + ",\"isolation\":" + isolation + "}");
            return field(answer, "notAvailableDurationMs");
        } catch (IOException e) {
            // A lost report must not fail the send: log it and carry on.
            System.out.println("  report for " + broker + " failed: " + e.getMessage());
            return "?";
        }
    }

    /** One HTTP call with a timeout; any non-2xx status becomes an IOException with the body. */
    static String call(String method, String path, String body) throws IOException {
        HttpRequest.Builder builder = HttpRequest.newBuilder(URI.create(detour + path))
                .timeout(HTTP_TIMEOUT)
                .header("Content-Type", "application/json")
                .method(method, HttpRequest.BodyPublishers.ofString(body));
        if (!TOKEN.isEmpty()) {
            builder.header("Authorization", "Bearer " + TOKEN);
        }
        HttpRequest request = builder.build();
        HttpResponse<String> response;
        try {
            response = HTTP.send(request, HttpResponse.BodyHandlers.ofString());
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new IOException("interrupted", e);
        } catch (IOException e) {
            // ConnectException and HttpTimeoutException often carry no message of their own.
            throw new IOException(method + " " + path + ": " + e, e);
        }
        if (response.statusCode() / 100 != 2) {
            throw new IOException(method + " " + path + ": HTTP " + response.statusCode() + " "
                    + response.body());
        }
        return response.body();
    }

    /** A JSON string literal, or null. Only for names that need no escaping (see the top). */
    static String jsonString(String s) {
        return s == null ? "null" : "\"" + s + "\"";
    }

    /** The first "name": value in a flat JSON object: string contents, or the raw literal. */
    static String field(String json, String name) {
        Matcher m = Pattern.compile("\"" + Pattern.quote(name)
                + "\"\\s*:\\s*(?:\"([^\"]*)\"|([^,}\\]\\s]+))").matcher(json);
        if (!m.find()) {
            throw new IllegalStateException("no field " + name + " in " + json);
        }
        return m.group(1) != null ? m.group(1) : m.group(2);
    }

    /** The raw text of a flat array field, e.g. ["java-broker-a"]. */
    static String arrayField(String json, String name) {
        Matcher m = Pattern.compile("\"" + Pattern.quote(name) + "\"\\s*:\\s*(\\[[^\\]]*\\])")
                .matcher(json);
        return m.find() ? m.group(1) : "?";
    }
}
