"""What the producer SDK raises, kept apart so callers can catch by meaning.

Detour being down is not an error a producer should see: the client fails
open. What remains are programming mistakes (a 4xx answer), the one case the
client cannot decide alone (no route known while Detour is down), and a
message that could not be delivered in its attempts.

    DetourClientError           base of everything the SDK raises
    ├── DetourUnavailable       Detour did not answer and no local decision was possible
    │   ├── DetourRejected      401/403 or a 3xx: a token or URL to fix (fails open, loudly)
    │   ├── DetourBadAnswer     an answer that is not Detour's (wrong shape, too large, a
    │   │                       queue not in the route, a proxy's 4xx page)
    │   └── DetourLate          no answer by the decision deadline (the call goes on)
    ├── DetourRequestError      Detour answered 4xx: the request is wrong (status, code, field)
    │   └── TopicNotFound       404: the topic has no route
    └── SendError               every attempt of a send failed or the deadline passed

``DetourRejected``, ``DetourBadAnswer`` and ``DetourLate`` are how the client tells why a
call failed open (they are counted apart in ``stats()``); a producer sees them only as
the cause of a ``DetourUnavailable``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from detour.client.values import Attempt


class DetourClientError(Exception):
    """Base of every error the producer SDK raises."""


class DetourUnavailable(DetourClientError):
    """Detour did not answer (timeout, connection refused, 5xx, 503) and the client could not
    decide locally, e.g. a select for a topic whose route it has never seen."""


class DetourRejected(DetourUnavailable):
    """Detour, or a proxy in front of it, refused the call: 401 or 403 (a rotated or wrong
    token) or a 3xx (a redirect, which the client does not follow).

    Not a reason to stop producing, so the client fails open as for an outage, but
    unlike an outage it will not heal by itself: the client logs it at ERROR.
    ``status`` is the HTTP status.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DetourBadAnswer(DetourUnavailable):
    """A 2xx that is not the JSON Detour sends (a list, empty, an unknown decision, a bad
    queueId, HTML, too large, a queue the route does not have), or a 4xx without Detour's
    error body (a proxy's page).

    Whatever answered is not a Detour the client can follow, so it fails open.
    """


class DetourLate(DetourUnavailable):
    """Detour had not answered by the decision deadline (``decide_within``): the send
    decides locally, and the call goes on; its answer still teaches the client."""


class DetourRequestError(DetourClientError):
    """Detour answered 4xx: the request itself is wrong; retrying it will not help.

    ``status`` is the HTTP status, ``code`` the service's stable error code
    (``VALIDATION_ERROR``, ``NOT_FOUND``, ...), ``field`` the offending field or None.
    """

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.field = field


class TopicNotFound(DetourRequestError):
    """The topic has no route (404), on Detour or in the cached client's replica."""

    def __init__(self, topic: str, message: str | None = None) -> None:
        super().__init__(404, "NOT_FOUND", message or f"no route for topic {topic!r}", "topic")
        self.topic = topic


class SendError(DetourClientError):
    """A send failed: every attempt raised, or the deadline left no time for another.

    ``attempts`` lists every attempt made, each with its queue, latency (ms) and
    error; ``timed_out`` is True when the deadline stopped the loop before the
    retries ran out. ``__cause__`` is the last attempt's error.
    """

    def __init__(self, topic: str, attempts: Sequence[Attempt], timed_out: bool) -> None:
        causes = "; ".join(
            f"{a.queue.broker_name}/{a.queue.queue_id} after {a.latency_ms:.1f} ms: {a.error!r}"
            for a in attempts
        )
        why = "deadline passed" if timed_out else "no retries left"
        super().__init__(
            f"send to topic {topic!r} failed after {len(attempts)} attempt(s), {why}: {causes}"
        )
        self.topic = topic
        self.attempts = list(attempts)
        self.timed_out = timed_out

    @property
    def errors(self) -> list[BaseException]:
        """Every attempt's cause, in order."""
        return [a.error for a in self.attempts if a.error is not None]
