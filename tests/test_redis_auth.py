"""Redis is the trust boundary: Detour authenticates from a password file, and stops clearly
when Redis refuses it.

The Redis here gets the very ACL users deploy/base/redis.yaml gives the bundled one (read
from the manifest): ``detour``, limited to Detour's keys and channels, without admin or
dangerous commands, and ``default``, which may only PING (the probes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from redis.connection import parse_url

from service.settings import Settings
from service.store import with_redis_password
from service.store.connect import (
    has_password,
    parse_redis_url,
    read_password_file,
    with_password,
)
from tests.procs import PATIENT_ENV, ROOT, RedisServer, ServiceProcess

PASSWORD = "s3cret:@/%+ with spaces"  # every character a URL would need escaped


def manifest_users() -> list[str]:
    """The ``--user`` options of the bundled Redis (deploy/base/redis.yaml), with the password
    the kubelet would expand into ``$(REDIS_PASSWORD)``."""
    docs = yaml.safe_load_all((ROOT / "deploy" / "base" / "redis.yaml").read_text())
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    out: list[str] = []
    taking = False
    for arg in container["args"]:
        if arg.startswith("--"):
            taking = arg == "--user"
        if taking:
            out.append(arg.replace("$(REDIS_PASSWORD)", PASSWORD))
    assert out.count("--user") == 2, out
    return out


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisServer]:
    # Plus a user to look around as. Its readiness PING is the default user's one command.
    server = RedisServer(extra=(*manifest_users(), "--user", "inspector", "on", ">look",
                                "~*", "&*", "+@all"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "redis-password"
    path.write_text(PASSWORD + "\n")  # as `echo` or an editor leaves it
    return path


# -- the pure parts -------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize(("url", "expected"), [
    ("redis://r:6379/0", "redis://:{pw}@r:6379/0"),
    ("redis://detour@r:6379/0", "redis://detour:{pw}@r:6379/0"),
    ("rediss://detour@r:6380/0?ssl_cert_reqs=required", "rediss://detour:{pw}@r:6380/0?ssl_cert_reqs=required"),  # noqa: E501
    ("unix:///run/redis.sock?db=2", "unix://:{pw}@/run/redis.sock?db=2"),
    ("redis+cluster://n1:6379,n2:6379", "redis+cluster://:{pw}@n1:6379,n2:6379"),
    ("redis+sentinel://detour@s1,s2/mymaster/0?sentinel_password=x",
     "redis+sentinel://detour:{pw}@s1,s2/mymaster/0?sentinel_password=x"),
])
def test_the_password_goes_into_any_url_form(url: str, expected: str) -> None:
    from urllib.parse import quote

    out = with_password(url, PASSWORD)
    assert out == expected.format(pw=quote(PASSWORD, safe=""))
    assert has_password(out) and not has_password(url)
    # Both readers of the URL get the password back exactly, escaped characters and all.
    if url.startswith(("redis://", "rediss://", "unix://")):
        assert parse_url(out)["password"] == PASSWORD
    else:
        assert parse_redis_url(out).password == PASSWORD
        assert parse_redis_url(out).hosts == parse_redis_url(url).hosts


@pytest.mark.unit
def test_one_place_for_the_password_and_a_clear_word_when_the_file_is_wrong(
    tmp_path: Path, password_file: Path
) -> None:
    with pytest.raises(ValueError, match="give the password in one place"):
        with_password("redis://detour:inline@r:6379/0", PASSWORD)
    assert read_password_file(str(password_file)) == PASSWORD  # one newline dropped
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_password_file(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="No such file"):
        read_password_file(str(tmp_path / "missing"))
    # Read once, at start: the copy has the password in its URL and no file left.
    settings = with_redis_password(Settings(redis_url="redis://detour@r:6379/0",
                                            redis_password_file=str(password_file)))
    assert settings.redis_password_file is None and has_password(settings.redis_url or "")
    assert with_redis_password(settings) == settings
    with pytest.raises(ValueError, match="DETOUR_REDIS_URL is not"):
        with_redis_password(Settings(redis_password_file=str(password_file)))


# -- a live redis-server that requires the password ----------------------------------------

def _start(acl_redis: RedisServer, *args: str,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m service`` against the ACL Redis; it must stop by itself."""
    return subprocess.run(
        [sys.executable, "-m", "service", "--port", "1",
         "--redis-url", f"redis://detour@127.0.0.1:{acl_redis.port}/0", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("DETOUR_")},
             **(env or {})},
    )


@pytest.mark.e2e
def test_detour_works_with_the_password_file(acl_redis: RedisServer,
                                             password_file: Path) -> None:
    url = f"redis://detour@127.0.0.1:{acl_redis.port}/0"
    with ServiceProcess(redis_url=url, env={"DETOUR_REDIS_PASSWORD_FILE": str(password_file),
                                            **PATIENT_ENV}) as svc, \
            httpx.Client(base_url=svc.url, timeout=5) as api:
        api.put("/routes/orders", json={"brokers": [
            {"brokerName": "broker-a", "writeQueueNums": 2},
            {"brokerName": "broker-b", "writeQueueNums": 2}]}).raise_for_status()
        api.post("/report-latency", json={"brokerName": "broker-a", "latencyMs": 3001,
                                          "isolation": True}).raise_for_status()
        picked = {api.post("/select", json={"topic": "orders"}).json()["brokerName"]
                  for _ in range(4)}
        assert picked == {"broker-b"}
        assert api.get("/readyz").json() == {"status": "ready", "store": "redis",
                                             "degraded": False}
        assert [e["reason"] for e in api.get("/events").json()["events"]] == ["isolation"]
    # The table is in Redis, under Detour's prefix only (the one pattern its user may touch).
    with redis.Redis(host="127.0.0.1", port=acl_redis.port, username="inspector",
                     password="look", decode_responses=True) as c:
        keys = c.keys("*")
        assert keys and all(k.startswith("detour:{default}:") for k in keys), keys
    # Without the password, Redis serves nobody anything but PING.
    with redis.Redis(host="127.0.0.1", port=acl_redis.port) as anonymous:
        assert anonymous.ping()
        with pytest.raises(redis.exceptions.NoPermissionError):
            anonymous.get("detour:{default}:config")


@pytest.mark.e2e
def test_detour_stops_clearly_without_the_password(acl_redis: RedisServer, tmp_path: Path,
                                                   password_file: Path) -> None:
    """Exit 2 at start, saying what to set, instead of retrying for ever unready."""
    missing = _start(acl_redis)
    assert missing.returncode == 2, missing.stderr
    assert "refused Detour with no password (set DETOUR_REDIS_PASSWORD_FILE" in missing.stderr
    assert PASSWORD not in missing.stderr

    wrong = tmp_path / "wrong"
    wrong.write_text("not-it")
    refused = _start(acl_redis, "--redis-password-file", str(wrong))
    assert refused.returncode == 2
    assert f"refused Detour with the password in {wrong}" in refused.stderr, refused.stderr

    unreadable = _start(acl_redis, env={"DETOUR_REDIS_PASSWORD_FILE": str(tmp_path / "nope")})
    assert unreadable.returncode == 2
    assert f"DETOUR_REDIS_PASSWORD_FILE {tmp_path / 'nope'}: No such file" in unreadable.stderr

    both = _start(acl_redis, "--redis-password-file", str(password_file), "--redis-url",
                  f"redis://detour:x@127.0.0.1:{acl_redis.port}/0")
    assert both.returncode == 2 and "give the password in one place" in both.stderr
