"""Tokens, roles and namespaces: who may call what, on which table.

A token is a random secret a producer or operator sends as ``Authorization: Bearer``.
The service keeps only SHA-256 digests (a leaked tokens file does not leak tokens;
tokens are 256-bit random, so a fast hash is enough and no salt or KDF is needed)
and compares digests with ``hmac.compare_digest`` against every entry, so neither
the comparison nor the number of entries checked depends on how much of a guess
was right.

Each token carries a role and one namespace. ``producer`` may select, report and
follow the push stream (the SDK's cached mode); ``metrics`` may only scrape
``/metrics``; ``admin`` may do everything. The namespace picks the table: every
Redis key of it is under ``{prefix}:{namespace}``, so a token can neither read nor
change another namespace, and a scrape with it shows only that namespace's series
(and the process-wide ones). A ``metrics`` token may name the namespace ``*``: its
scrapes show every namespace (one Prometheus job for the whole replica). Probes,
the status page's HTML and the API documents stay open.

``python -m service.auth new --name NAME --role ROLE --namespace NS`` makes a token
and prints the entry for the tokens file; docs/security.md has the details.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import re
import secrets
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from service.settings import Settings

NAMESPACE_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
#: Paths anyone may call: probes, the status page's HTML, the API documents.
OPEN_PATHS = frozenset({"/", "/healthz", "/readyz", "/openapi.json", "/docs", "/redoc"})
#: What a ``metrics`` token may do: scrape.
METRICS_CALLS = frozenset({("GET", "/metrics")})
#: The namespace of a ``metrics`` token that may see every namespace's series.
ALL_NAMESPACES = "*"
#: What a producer may do; anything else that is not open needs ``admin``. Besides
#: selecting and reporting, a producer reads what it needs to decide on its own when
#: Detour is unreachable (the SDK's fail-open table): the push stream, the config and
#: the routes of its namespace.
PRODUCER_CALLS = frozenset(
    {
        ("POST", "/select"),
        ("POST", "/report-latency"),
        ("POST", "/report-latency:batch"),
        ("GET", "/fault-items/stream"),
        ("GET", "/config"),
        ("GET", "/routes"),
    }
)
_ROUTE_PREFIX = "/routes/"
_LOOPBACK = re.compile(r"^(127\.\d{1,3}\.\d{1,3}\.\d{1,3}|::1|localhost)$")


class Role(StrEnum):
    PRODUCER = "producer"
    METRICS = "metrics"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request comes from, once its token matched."""

    name: str
    role: Role
    namespace: str

    def may(self, method: str, path: str) -> bool:
        if self.role is Role.ADMIN:
            return True
        if self.role is Role.METRICS:
            return (method, path) in METRICS_CALLS
        if (method, path) in PRODUCER_CALLS:
            return True
        return method == "GET" and path.startswith(_ROUTE_PREFIX) and "/" not in path[8:]

    def scrape_namespaces(self) -> frozenset[str] | None:
        """The namespaces whose series this principal's scrape shows; None: all."""
        if self.role is Role.METRICS and self.namespace == ALL_NAMESPACES:
            return None
        return frozenset((self.namespace,))


class TokenEntry(BaseModel):
    """One line of the tokens file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.:@-]{1,64}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    role: Role
    namespace: str = Field(pattern=NAMESPACE_PATTERN + "|^[*]$")

    @model_validator(mode="after")
    def _all_for_metrics_only(self) -> TokenEntry:
        if self.namespace == ALL_NAMESPACES and self.role is not Role.METRICS:
            raise ValueError(f"namespace {ALL_NAMESPACES!r} is for role 'metrics' only")
        return self


class TokensFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: list[TokenEntry] = Field(min_length=1, max_length=10_000)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def requires_token(path: str) -> bool:
    return path not in OPEN_PATHS


def is_loopback(host: str) -> bool:
    return bool(_LOOPBACK.match(host))


class TokenTable:
    """The configured tokens; ``lookup`` turns a presented token into a Principal."""

    def __init__(self, entries: Sequence[TokenEntry], serves_namespaces: bool = True) -> None:
        """``serves_namespaces``: these tokens also say which namespaces the process serves,
        so at least one must name one; False for tokens that only scrape (the metrics
        listener's, service/api/metrics_listener.py), where ``*`` alone is the usual."""
        names = [e.name for e in entries]
        digests = [e.sha256 for e in entries]
        if len(set(names)) != len(names):
            raise ValueError("tokens: every name must be unique (it is the reporter identity)")
        if len(set(digests)) != len(digests):
            raise ValueError("tokens: the same token is listed twice")
        if serves_namespaces and entries and all(e.namespace == ALL_NAMESPACES for e in entries):
            raise ValueError("tokens: at least one token must name a namespace (not '*')")
        self._entries = tuple(
            (bytes.fromhex(e.sha256), Principal(e.name, e.role, e.namespace)) for e in entries
        )

    def __bool__(self) -> bool:
        return bool(self._entries)

    @property
    def namespaces(self) -> list[str]:
        return sorted({p.namespace for _, p in self._entries} - {ALL_NAMESPACES})

    def lookup(self, token: str) -> Principal | None:
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for known, principal in self._entries:
            if hmac.compare_digest(digest, known):
                found = principal
        return found


def parse_tokens(text: str, source: str, serves_namespaces: bool = True) -> TokenTable:
    """Read YAML or JSON: ``{"tokens": [...]}``, the bare list, or one entry as
    ``service.auth new`` prints it. Raises ValueError."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: not YAML or JSON: {exc}") from None
    if isinstance(data, list):
        data = {"tokens": data}
    elif isinstance(data, dict) and "sha256" in data:
        data = {"tokens": [data]}
    try:
        parsed = TokensFile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{source}: {where}: {first['msg']}") from None
    return TokenTable(parsed.tokens, serves_namespaces)


def load_tokens(settings: Settings) -> TokenTable:
    """The tokens from ``tokens_file`` or ``tokens``; an empty table when neither is set."""
    if settings.tokens_file and settings.tokens:
        raise ValueError("set DETOUR_TOKENS_FILE or DETOUR_TOKENS, not both")
    if settings.tokens_file:
        path = Path(settings.tokens_file)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror}") from None
        return parse_tokens(text, str(path))
    if settings.tokens:
        return parse_tokens(settings.tokens, "DETOUR_TOKENS")
    return TokenTable(())


def check_exposure(settings: Settings, tokens: TokenTable) -> str | None:
    """Why this process must not start as configured, or None when it may."""
    if tokens or settings.allow_open or is_loopback(settings.host):
        return None
    return (
        f"refusing to listen on {settings.host} with no tokens: anyone who can reach it could "
        "steer every producer. Configure tokens (DETOUR_TOKENS_FILE), bind 127.0.0.1, or "
        "pass --allow-open (DETOUR_ALLOW_OPEN=true) to run open on purpose."
    )


def new_token() -> str:
    return "dtr_" + secrets.token_urlsafe(32)


def _write_secret(path: Path, token: str) -> None:
    """The token alone, without a newline (a Secret made from the file holds exactly the
    token), readable by its owner only from its creation. An existing file is replaced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(token)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.auth", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="make a token; print it and its tokens-file entry")
    new.add_argument("--name", required=True)
    new.add_argument("--role", choices=[r.value for r in Role], required=True)
    new.add_argument("--namespace", default="default")
    new.add_argument(
        "--token-file",
        type=Path,
        help="write the token alone to this file (mode 0600; e.g. the file a Prometheus "
        "scrape config reads) instead of printing it",
    )
    sub.add_parser("hash", help="read a token on stdin, print its sha256 for the tokens file")
    args = p.parse_args(argv)
    if args.command == "hash":
        print(hash_token(sys.stdin.readline().strip()))
        return 0
    token = new_token()
    entry = TokenEntry(
        name=args.name, sha256=hash_token(token), role=args.role, namespace=args.namespace
    )
    if args.token_file is not None:
        _write_secret(args.token_file, token)
        print(f"token written to {args.token_file} (it is not stored elsewhere)", file=sys.stderr)
    else:
        print(f"token (give it to the client, it is not stored): {token}", file=sys.stderr)
    print(json.dumps(entry.model_dump(mode="json")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
