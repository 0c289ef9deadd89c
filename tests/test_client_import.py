"""The producer SDK works in a process that has none of the service's web stack.

A subprocess refuses ``fastapi``, ``uvicorn``, ``starlette``, ``redis`` and
``pydantic`` at import time, then imports ``detour.client`` and uses it, sync
and async, remote and cached, against a live service.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import httpx
import pytest

from tests.procs import ROOT, ServiceProcess

pytestmark = pytest.mark.e2e

SCRIPT = textwrap.dedent(
    """
    import sys

    REFUSED = {"fastapi", "uvicorn", "starlette", "redis", "pydantic"}

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in REFUSED:
                raise ImportError(f"{name} is refused in this process")
            return None

    sys.meta_path.insert(0, Refuse())

    import asyncio
    from detour.client import AsyncDetourClient, DetourClient

    url = sys.argv[1]
    with DetourClient(url, timeout=2.0) as c:  # not the 0.2 s a busy machine can miss
        r = c.send("imp", b"m", lambda q, p: q.broker_name)
        assert r.value == "imp-a" and not r.queue.local, r
    with DetourClient(url, mode="cached") as c:
        assert c.wait_ready(15)
        c.report("imp-a", 12)
        assert c.select("imp").local

    async def main():
        async with AsyncDetourClient(url, mode="cached") as c:
            assert await c.wait_ready(15)
            async def deliver(q, p):
                return q.queue_id
            assert (await c.send("imp", b"m", deliver)).value == 0

    asyncio.run(main())
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in REFUSED)
    assert not loaded, loaded
    print("ok")
    """
)


def test_the_sdk_needs_no_web_stack(service: ServiceProcess) -> None:
    httpx.put(f"{service.url}/routes/imp", json={"brokers": [
        {"brokerName": "imp-a", "writeQueueNums": 1}]}, timeout=5).raise_for_status()
    out = subprocess.run([sys.executable, "-c", SCRIPT, service.url], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.unit
def test_the_old_import_still_works_for_one_release_and_says_so() -> None:
    """``service.client`` (0.1.0's import) hands out detour.client's classes, warning once."""
    code = textwrap.dedent(
        """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from service.client import DetourClient
        import detour
        from detour.client import DetourClient as New
        assert DetourClient is New is detour.DetourClient
        (w,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert "detour.client" in str(w.message), w.message
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
