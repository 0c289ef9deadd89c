from pathlib import Path
from bench.floor import FloorServer
from bench.loadgen import write_script, run_wrk, process_tree, tree_cpu_s
f = FloorServer(workers=2)
try:
    s = write_script(Path("/tmp/sel.lua"), "/select", [{"topic": "orders", "lastBrokerName": None}])
    pids = process_tree(f.proc.pid); print(pids)
    c0 = tree_cpu_s(pids)
    r = run_wrk(f.url, s, connections=8, duration_s=2)
    print(r, (tree_cpu_s(pids)-c0)/r.requests*1e6)
finally:
    f.stop()
