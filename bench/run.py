"""``python -m bench.run`` (``make bench``): every benchmark in one invocation, results as files.

One invocation on purpose: the floor, Detour and the propagation test see the
same machine state, and the tables in docs/BENCHMARKS.md are pasted from one
``results.md``. Writes ``results.json`` (every run, raw) and ``results.md``
(the tables) under ``--out`` and prints the tables. Every process started is
stopped on the way out, on an error, Ctrl-C or SIGTERM as well.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import fastapi
import uvicorn

from bench import propagation, throughput
from bench.loadgen import process_tree, wait_for_quiet, wrk_version
from tests.procs import ROOT


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Detour vs the floor (wrk), replica-to-replica propagation, py-spy profile.",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per measurement (default 3)")
    p.add_argument("--duration", type=int, default=5, help="seconds per wrk run (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="seconds of discarded warm-up runs")
    p.add_argument(
        "--quiet-wait", type=float, default=30.0,
        help="before each run, wait up to this many seconds for the machine to be idle "
        "(< 0.2 cores busy over 0.5 s); 0 disables (default 30)",
    )
    p.add_argument(
        "--noise-limit", type=float, default=0.25,
        help="a run during which other processes used more cores than this is measured "
        "again (default 0.25)",
    )
    p.add_argument("--noisy-retries", type=int, default=2, help="at most this many times (2)")
    p.add_argument("--workers", type=_ints, default=[1, 2], help="worker counts (default 1,2)")
    p.add_argument("--connections", type=_ints, default=[8, 64], help="default 8,64")
    p.add_argument("--threads", type=int, default=1, help="wrk threads, -t (default 1)")
    p.add_argument("--iterations", type=int, default=200, help="propagation rounds (200)")
    p.add_argument("--profile-seconds", type=int, default=10, help="py-spy recording length")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy profile")
    p.add_argument(
        "--only", choices=("all", "throughput", "propagation", "profile"), default="all"
    )
    p.add_argument("--quick", action="store_true",
                   help="smoke run (~30 s): 1 repeat of 1 s, no warm-up, 50 rounds, no profile")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="output directory")
    # --quick changes the defaults only; explicit flags still win.
    if p.parse_known_args(argv)[0].quick:
        p.set_defaults(repeats=1, duration=1, warmup=0, iterations=50, quiet_wait=0.0,
                       noisy_retries=0, no_profile=True)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.duration < 1 or args.iterations < 1:
        p.error("--repeats, --duration and --iterations must be >= 1")
    return args


def machine() -> dict[str, Any]:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                      if ln.startswith("Model name")), "")
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "fastapi": fastapi.__version__,
        "uvicorn": uvicorn.__version__,
        "wrk": wrk_version(),
        "root": str(ROOT),
        "service_sha1": service_fingerprint(),
    }


def service_fingerprint(root: Path = ROOT) -> str:
    """SHA-1 over service/'s source files: which code was measured (the tree may be dirty)."""
    h = hashlib.sha1()
    for path in sorted((root / "service").rglob("*")):
        if path.suffix in (".py", ".lua") and "__pycache__" not in path.parts:
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so every ``finally`` and ExitStack runs.
    raise KeyboardInterrupt(f"signal {signum}")


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait (bounded) for a child to exit, on its pidfd; reap it. True if it is gone."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout_s))
    finally:
        os.close(fd)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return bool(ready)


def stop_leftovers(timeout_s: float = 10.0) -> list[int]:
    """Stop any child of this process still running (only this run started them).

    The benchmarks stop their own processes; this is the net for an interrupt
    that lands while a helper is still starting (before it can be registered
    for cleanup). Children are signalled by pid; their own workers follow them.
    """
    me = os.getpid()
    kids = [p for p in process_tree(me) if p != me and _parent(p) == me]
    for pid in kids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for pid in kids:
        if not _wait_exit(pid, deadline - time.monotonic()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_exit(pid, 5)
    return kids


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    # Ctrl-C raises even when the shell started this with SIGINT ignored (a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    started = time.monotonic()
    results: dict[str, Any] = {
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "machine": machine(),
    }

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", flush=True)

    def quiet() -> None:
        if args.quiet_wait > 0:
            waited, busy = wait_for_quiet(args.quiet_wait)
            log(f"  waited {waited:.1f} s for an idle machine ({busy:.2f} cores busy)")

    try:
        if args.only in ("all", "throughput"):
            log(f"throughput: workers {args.workers}, connections {args.connections}, "
                f"{args.repeats} x {args.duration} s, wrk -t{args.threads}")
            results["throughput"] = throughput.run_throughput(
                workers=args.workers, connections=args.connections, repeats=args.repeats,
                duration_s=args.duration, threads=args.threads, warmup_s=args.warmup,
                quiet_wait_s=args.quiet_wait, noise_limit=args.noise_limit,
                noisy_retries=args.noisy_retries, log_dir=logs, progress=log,
            )  # fmt: skip
        if args.only in ("all", "propagation"):
            log(f"propagation: {args.iterations} rounds")
            quiet()
            results["propagation"] = propagation.run_propagation(
                iterations=args.iterations, log_dir=logs, progress=log
            )
        if args.only == "profile" or (args.only == "all" and not args.no_profile):
            log(f"profile: py-spy {args.profile_seconds} s on /select")
            quiet()
            results["profile"] = throughput.profile_select(
                out, seconds=args.profile_seconds, threads=args.threads, log_dir=logs
            )
    except KeyboardInterrupt:
        log("interrupted: processes stopped, writing what was measured")
        results["interrupted"] = True
    finally:
        leftovers = stop_leftovers()
        if leftovers:
            log(f"stopped leftover child processes {leftovers}")
        results["elapsed_s"] = round(time.monotonic() - started, 1)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        md = render(results)
        (out / "results.md").write_text(md)
    print()
    print(md)
    return 130 if results.get("interrupted") else 0


def quiet_note(t: dict[str, Any]) -> str:
    runs = t["runs"]
    kept = [r for r in runs if not r["discarded"]]
    if not runs:
        return "no runs"
    gate = (
        f"each run first waited up to {t['quiet_wait_s']:g} s for an idle machine "
        f"({sum(r['quiet_waited_s'] for r in runs):.0f} s waited in all)"
        if t["quiet_wait_s"] > 0
        else "no idle-machine gate"
    )
    noisy = sum(1 for r in kept if r["other_cores"] > t["noise_limit_cores"])
    return (
        f"{gate}; {len(runs) - len(kept)} runs discarded and measured again because other "
        f"processes used > {t['noise_limit_cores']:g} cores meanwhile (at most "
        f"{t['noisy_retries']} retries); {noisy} of the {len(kept)} runs kept still had such load"
    )


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    parts = [
        "# Detour benchmark results",
        "",
        f"Run {results['started_at']}, {results.get('elapsed_s', '?')} s, "
        f"`python -m bench.run {' '.join(results['argv'])}`".rstrip() + ".",
        f"Machine: {m['nproc']} CPUs ({m['cpu_model']}), Linux {m['kernel']}, "
        f"Python {m['python']}, FastAPI {m['fastapi']}, uvicorn {m['uvicorn']}, {m['wrk']}.",
        f"Code measured: `{m['root']}`, service/ fingerprint {m['service_sha1']} "
        "(SHA-1 of its .py and .lua files).",
    ]
    if results.get("interrupted"):
        parts += ["", "**Interrupted: partial results.**"]
    if "throughput" in results:
        t = results["throughput"]
        parts += [
            "",
            "## Throughput and latency (medians)",
            "",
            f"wrk -t{t['threads']}, {t['duration_s']} s per run, {t['repeats']} runs per cell "
            f"(median), floor and Detour interleaved; {t['warmup_s']} s warm-up per endpoint; "
            f"{quiet_note(t)}.",
            "",
            throughput.to_markdown(t),
            "",
            "CPU during the runs (cores = CPU seconds per second of run; 2 available):",
            "",
            throughput.cpu_markdown(t),
            "",
            *[f"- {line}" for line in throughput.verdict(t)],
        ]
    if "propagation" in results:
        parts += ["", "## Propagation between replicas", "",
                  propagation.to_markdown(results["propagation"])]
    if "profile" in results:
        parts += ["", "## Profile of /select", "",
                  throughput.profile_markdown(results["profile"])]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
