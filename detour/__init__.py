"""Detour's pure fault-strategy core and its Python producer SDK (``detour.client``).

The core (``model``, ``strategy``, ``policy``, ``decide``, ``view``, ``selector``) does no
I/O and reads no clock of its own: the server (``service``, which imports this package,
never the other way) and the SDK decide with the same code. The SDK's names are exported
here too, imported on first use so that the core alone never loads httpx:
``from detour import DetourClient``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detour.client import (
        AsyncDetourClient,
        Attempt,
        ClientStats,
        Decision,
        DetourClient,
        DetourClientError,
        DetourRequestError,
        DetourUnavailable,
        Mode,
        Report,
        SelectedQueue,
        SendError,
        SendResult,
        TopicNotFound,
    )

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


def __getattr__(name: str) -> Any:
    if name in __all__:
        from detour import client

        return getattr(client, name)
    raise AttributeError(f"module 'detour' has no attribute {name!r}")
