#!/usr/bin/env bash
# A RocketMQ-style producer loop that asks Detour where to send and tells it how each send went.
#
# Run (bash, curl, sed, date; no jq):
#     bash examples/curl.sh http://127.0.0.1:8080
#     DETOUR_TOKEN=dtr_... bash examples/curl.sh https://detour.internal:8080
#
# DETOUR_TOKEN, when set and not empty, goes with every call as "Authorization: Bearer <token>".
# The script registers its route (PUT /routes), which needs an admin token; a Detour without
# tokens (loopback only) needs none. Without a valid token Detour answers 401 (403 for a
# producer token), the route is not registered and the script exits 2.
#
# The "brokers" are stand-ins in this script: curl-broker-a is down (every send fails),
# curl-broker-b succeeds. The loop is RocketMQ's sendDefaultImpl: up to 3 attempts per message;
# each attempt selects a queue passing the broker the previous attempt failed on, sends, times
# the send and reports the latency (isolation on failure).
# Exit code: 0 when every message was delivered, 1 when one was not, 2 when Detour refused the
# route.
#
# JSON without jq: requests are built as strings (broker names and topics match
# [A-Za-z0-9_.%|-], so they never need escaping); responses are read with json_field, a sed
# expression for one flat "name": value pair. Fine for Detour's flat answers, not a JSON parser.

set -u

DETOUR=${1:-http://127.0.0.1:8080}
DETOUR=${DETOUR%/}
TOPIC=example-curl
BROKER_A=curl-broker-a # down: every send fails
BROKER_B=curl-broker-b # healthy
TOKEN=${DETOUR_TOKEN:-} # empty or unset: no Authorization header
MESSAGES=6
TIMES_TOTAL=3 # RocketMQ: 1 + retryTimesWhenSendFailed (default 2)

# call METHOD PATH [JSON]: sets RESPONSE; fails on a transport error, a timeout or a non-2xx.
call() {
    local method=$1 path=$2 out status
    local args=(-sS --connect-timeout 3 --max-time 5 -X "$method"
                -H 'Content-Type: application/json' -w '\n%{http_code}')
    if [ $# -ge 3 ]; then args+=(--data "$3"); fi
    # The token goes to curl on stdin (-H @-), not in its arguments, where any user could
    # read it with ps.
    local header=
    if [ -n "$TOKEN" ]; then
        args+=(-H @-)
        header="Authorization: Bearer $TOKEN"
    fi
    # curl prints its own error (refused, timed out, ...) on stderr.
    if ! out=$(curl "${args[@]}" "$DETOUR$path" <<<"$header"); then
        RESPONSE="$method $path: curl failed"
        return 1
    fi
    status=${out##*$'\n'} # -w put the status code on the last line
    RESPONSE=${out%$'\n'*}
    case $status in
        2??) return 0 ;;
        *) RESPONSE="$method $path: HTTP $status $RESPONSE"; return 1 ;;
    esac
}

# json_field JSON NAME: the value of "NAME": a string's contents or a bare literal (number, ...).
json_field() {
    printf '%s\n' "$1" | sed -n 's/.*"'"$2"'" *: *"\{0,1\}\([^",}]*\).*/\1/p'
}

# json_array JSON NAME: the raw text of a flat array, e.g. ["curl-broker-a"].
json_array() {
    printf '%s\n' "$1" | sed -n 's/.*"'"$2"'" *: *\(\[[^]]*\]\).*/\1/p'
}

# now_ms: milliseconds from date +%s%N (GNU date; a date without %N, as on macOS, falls back
# to whole seconds). It is the wall clock, not a monotonic one: a clock step during a send skews
# that one measurement, so the difference is clamped at 0 below (Detour refuses negatives).
now_ms() {
    local ns
    ns=$(date +%s%N)
    case $ns in *[!0-9]*) ns=$(($(date +%s) * 1000000000)) ;; esac
    echo $((ns / 1000000))
}

# deliver BROKER QUEUE MESSAGE: the stand-in broker; a fails like a dead broker, b succeeds.
deliver() {
    [ "$1" != "$BROKER_A" ]
}

# report BROKER LATENCY ISOLATION: sets WINDOW to the window Detour opened (ms), "?" on failure.
report() {
    if call POST /report-latency \
        "{\"brokerName\":\"$1\",\"latencyMs\":$2,\"isolation\":$3}"; then
        WINDOW=$(json_field "$RESPONSE" notAvailableDurationMs)
    else
        # A lost report must not fail the send: log it and carry on.
        echo "  report for $1 failed: $RESPONSE"
        WINDOW='?'
    fi
}

# 1. Register the topic's route: two brokers, two write queues each.
if ! call PUT "/routes/$TOPIC" "{\"brokers\":[
        {\"brokerName\":\"$BROKER_A\",\"writeQueueNums\":2},
        {\"brokerName\":\"$BROKER_B\",\"writeQueueNums\":2}]}"; then
    echo "cannot register the route at $DETOUR: $RESPONSE"
    exit 2
fi
echo "route $TOPIC: $BROKER_A (down), $BROKER_B (up), 2 queues each, Detour $DETOUR"

# 2. Send the messages, each with RocketMQ's retry loop.
delivered=0 attempts=0 failures=0
for msg in $(seq 1 "$MESSAGES"); do
    last=null # the broker the previous attempt failed on, as a JSON value
    sent=false
    attempt=0
    while [ "$attempt" -lt "$TIMES_TOTAL" ] && [ "$sent" = false ]; do
        attempt=$((attempt + 1))
        attempts=$((attempts + 1))
        prefix="message $msg attempt $attempt: "

        # Ask Detour for a queue. If Detour itself is unreachable this attempt fails;
        # a real producer would fall back to plain round-robin over its own route.
        if ! call POST /select "{\"topic\":\"$TOPIC\",\"lastBrokerName\":$last}"; then
            failures=$((failures + 1))
            echo "${prefix}select failed: $RESPONSE"
            continue
        fi
        selected=$RESPONSE
        broker=$(json_field "$selected" brokerName)
        queue=$(json_field "$selected" queueId)

        # Send, timing only the send itself.
        start=$(now_ms)
        if deliver "$broker" "$queue" "hello $msg"; then sent=true; fi
        latency=$(($(now_ms) - start))
        if [ "$latency" -lt 0 ]; then latency=0; fi

        # Report it: a failure isolates the broker (600 s with the default tiers).
        if [ "$sent" = true ]; then isolation=false; else isolation=true; fi
        report "$broker" "$latency" "$isolation"
        if [ "$sent" = true ]; then outcome="ok in"; else outcome="FAILED (broker down) after"; fi
        echo "${prefix}broker=$broker queue=$queue" \
            "decision=$(json_field "$selected" decision)" \
            "avoided=$(json_array "$selected" avoidedBrokers)" \
            "-> $outcome $latency ms, Detour window $WINDOW ms"
        if [ "$sent" = false ]; then
            failures=$((failures + 1))
            last="\"$broker\""
        fi
    done
    if [ "$sent" = true ]; then
        delivered=$((delivered + 1))
    else
        echo "message $msg: NOT delivered after $TIMES_TOTAL attempts"
    fi
done

# 3. Summary and exit code.
echo "summary: $delivered/$MESSAGES messages delivered, $attempts attempts, $failures failed"
[ "$delivered" -eq "$MESSAGES" ]
