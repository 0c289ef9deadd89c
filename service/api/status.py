"""GET /: the status page, one self-contained HTML file (no CDN, no build step)."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter(tags=["health"])


@cache
def _page() -> str:
    return (resources.files("service") / "static" / "status.html").read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, summary="Status page for people")
async def status_page() -> HTMLResponse:
    """Brokers, their windows and the config, refreshed every second from `/fault-items`,
    `/routes` and `/config`."""
    return HTMLResponse(_page())
