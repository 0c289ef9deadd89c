"""``python -m service``: parse flags into DETOUR_* settings and run uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import glob
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence

import uvicorn

from service.api.metrics_listener import metrics_refusal
from service.auth import check_exposure, load_tokens
from service.settings import Settings
from service.store import with_redis_password
from service.store.connect import credentials_refused, describe_redis_url, has_password


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m service", description="Run the Detour service.")
    p.add_argument("--host", help="address to bind (default 127.0.0.1; env DETOUR_HOST)")
    p.add_argument("--port", type=int, help="port (default 8080; env DETOUR_PORT)")
    p.add_argument(
        "--redis-url", help="Redis URL; none = embedded memory store (env DETOUR_REDIS_URL)"
    )
    p.add_argument(
        "--workers", type=int, help="uvicorn worker processes (default 1; env DETOUR_WORKERS)"
    )
    p.add_argument("--log-level", help="log level (default info; env DETOUR_LOG_LEVEL)")
    p.add_argument(
        "--redis-password-file",
        help="file holding the Redis password (env DETOUR_REDIS_PASSWORD_FILE)",
    )
    p.add_argument(
        "--tokens-file", help="YAML/JSON tokens file (docs/security.md; env DETOUR_TOKENS_FILE)"
    )
    p.add_argument(
        "--metrics-host",
        help="also serve GET /metrics alone on this address, e.g. the pod IP "
        "(env DETOUR_METRICS_HOST; default: off)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="port of that listener (default 9188; env DETOUR_METRICS_PORT)",
    )
    p.add_argument(
        "--allow-open",
        action="store_const",
        const="true",
        help="serve a non-loopback --host with no tokens (env DETOUR_ALLOW_OPEN)",
    )
    return p.parse_args(argv)


def _share_metrics_between_workers() -> str | None:
    """prometheus-client's multiprocess mode: each worker writes its counters to files here.

    Must be set before any worker imports prometheus_client; stale files from an
    earlier run would be counted again, so the directory starts empty. Returns the
    directory when Detour made it (no ``PROMETHEUS_MULTIPROC_DIR`` given): it is
    Detour's to remove when the server stops, or every start would leave one behind.
    """
    made = None
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not path:
        path = made = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(
            prefix="detour-metrics-"
        )
    os.makedirs(path, exist_ok=True)
    for stale in glob.glob(os.path.join(path, "*.db")):
        os.remove(stale)
    return made


def _redis_refusal(settings: Settings) -> str | None:
    """Why Detour cannot use its Redis, said once at start, or None.

    A password file that cannot be read, or a Redis that refuses the credentials, is a
    configuration error: exit with it rather than start a replica that retries for ever
    and never becomes ready. An unreachable Redis is no reason to stop (the store waits
    for it).
    """
    try:
        resolved = with_redis_password(settings)
    except ValueError as exc:
        return str(exc)
    if not resolved.redis_url:
        return None
    refused = asyncio.run(credentials_refused(resolved.redis_url, settings.redis_timeout_s))
    if refused is None:
        return None
    if settings.redis_password_file:
        given = f"the password in {settings.redis_password_file}"
    elif settings.redis_url and has_password(settings.redis_url):
        given = "the password in DETOUR_REDIS_URL"
    else:
        given = "no password (set DETOUR_REDIS_PASSWORD_FILE to a file holding it)"
    return (
        f"Redis at {describe_redis_url(resolved.redis_url)} refused Detour with {given}: {refused}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Flags win over the environment. They are written back to the environment
    # because each uvicorn worker builds its own app through the factory.
    for name in (
        "host",
        "port",
        "redis_url",
        "redis_password_file",
        "workers",
        "log_level",
        "tokens_file",
        "allow_open",
        "metrics_host",
        "metrics_port",
    ):
        value = getattr(args, name)
        if value is not None:
            os.environ[f"DETOUR_{name.upper()}"] = str(value)
    settings = Settings()
    logging.basicConfig(
        level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        tokens = load_tokens(settings)
    except ValueError as exc:
        print(f"detour: {exc}", file=sys.stderr)
        return 2
    try:
        refusal = check_exposure(settings, tokens) or metrics_refusal(settings, tokens)
    except ValueError as exc:  # the metrics tokens file
        refusal = str(exc)
    if refusal:
        print(f"detour: {refusal}", file=sys.stderr)
        return 2
    refusal = _redis_refusal(settings)
    if refusal:
        print(f"detour: {refusal}", file=sys.stderr)
        return 2
    if settings.workers > 1 and not settings.redis_url:
        print(
            "detour: --workers > 1 needs --redis-url: the memory store lives in one process, "
            "so workers would not share a table",
            file=sys.stderr,
        )
        return 2
    made = _share_metrics_between_workers() if settings.workers > 1 else None
    try:
        _serve(settings)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    return 0


def _serve(settings: Settings) -> None:
    # uvicorn re-raises the stop signal after its graceful shutdown; with this
    # handler in place that ends here and the process exits 0 (a clean stop for
    # Kubernetes) instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(
        "service.app:create_app",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.workers,
        # uvicorn's httptools protocol with the edge's bounds (head size and count, read
        # deadlines, open connections, Host names) and the shedder's refusals
        # (service/edge/protocol.py, over service/edge/uvicorn_seam.py: pyproject pins
        # uvicorn's minor).
        http="service.edge.protocol:EdgeProtocol",
        # Detour serves no WebSocket: upgrades are refused at the head (service/edge/heads.py).
        ws="none",
        log_level=settings.log_level,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        # SIGTERM: stop accepting, let requests in flight finish, then run the
        # lifespan's shutdown (which hands the journal to Redis); bounded.
        timeout_graceful_shutdown=settings.shutdown_grace_s,
    )


if __name__ == "__main__":
    sys.exit(main())
