"""Detour's Python producer SDK: select a queue, send, report, and keep going when Detour is down.

Why a client library and not just HTTP: the rules around the two calls are
where producers go wrong. This package implements them once:

* RocketMQ's send loop (``send``): up to ``1 + retries`` attempts within a
  deadline, each selecting with the previous attempt's broker, each reported
  with its monotonic latency, a failure as an isolation.
* Fail open: when Detour times out (a whole call, however slowly it trickles),
  refuses the connection, answers 5xx, sheds load, rejects the token (401/403),
  redirects, or answers something that is not Detour's answer, selects are
  decided locally with the same algorithm (``detour.strategy`` over a
  ``detour.view.TableView``), reports are queued (bounded) and replayed with
  their age once Detour answers, and a circuit breaker leaves Detour alone
  (0.5 s doubling to 5 s) so a dead sidecar costs one timeout, not one per send.
  Detour's own 4xx answers are raised: they are bugs.
* Cached mode: a replica of the table kept current by the event stream, so a
  select costs microseconds and no network; reports leave in batches.

Only httpx (with httpcore, its transport), the standard library and the pure core of
this package (``detour.model``, ``detour.strategy``, ``detour.policy``, ``detour.view``)
are imported: a producer does not need the server's web stack, and installs the SDK
alone as the ``detour-client`` distribution (``make lint``'s import contracts hold it).
"""

from detour.client.aio import AsyncDetourClient
from detour.client.errors import (
    DetourClientError,
    DetourRequestError,
    DetourUnavailable,
    SendError,
    TopicNotFound,
)
from detour.client.sync import DetourClient
from detour.client.values import (
    Attempt,
    ClientStats,
    Mode,
    Report,
    SelectedQueue,
    SendResult,
)
from detour.strategy import Decision

__all__ = [
    "AsyncDetourClient",
    "Attempt",
    "ClientStats",
    "Decision",
    "DetourClient",
    "DetourClientError",
    "DetourRequestError",
    "DetourUnavailable",
    "Mode",
    "Report",
    "SelectedQueue",
    "SendError",
    "SendResult",
    "TopicNotFound",
]
