"""Detour's benchmark harness: throughput against a do-nothing floor, and push propagation.

Run from the repository root with ``.venv/bin/python -m bench.run`` (``make bench``);
the modules import the process helpers from ``tests.procs``.
"""
