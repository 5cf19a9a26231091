"""Load time and peak RSS of from_pretrained(device="cpu") with MOEFLOW_HUGEPAGES 1 (the default: written on small
pages, collapsed in the background), fault (huge pages faulted in at load) and 0 (off), alternating fresh processes
(issue 42's huge pages), with the kernel's THP fault and compaction counters (/proc/vmstat) over each.
Prints one JSON line per run: ``python benchmarks/peers/hugepages_load.py MODEL...`` (PYTHONPATH: the tree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CHILD = r'''
import json, resource, sys, time
t0 = time.perf_counter(); c0 = time.process_time()
import torch
from moeflow import MoEModel
t1 = time.perf_counter(); c1 = time.process_time()
m = MoEModel.from_pretrained(sys.argv[1], device="cpu")
t2 = time.perf_counter(); c2 = time.process_time()
ids = torch.tensor([[1, 2, 3, 4]])
with torch.inference_mode():
    m.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=[])
t3 = time.perf_counter()
try:  # (session 18's trees: the background collapse onto huge pages)
    from moeflow.kernels.cpu import hugepages, thp_collapse
    hugepages.wait_collapsed(120)
    collapse = {"collapse_done_s": time.perf_counter() - t2, **vars(thp_collapse.COLLAPSER.stats)}
except (ImportError, AttributeError):
    collapse = {}
print(json.dumps({**collapse, "load_s": t2 - t1, "load_cpu_s": c2 - c1, "first_token_s": t3 - t2,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''
def vmstat() -> dict[str, int]:
    keys = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "allocstall_movable")
    rows = dict(line.split() for line in open("/proc/vmstat"))
    return {k: int(rows.get(k, 0)) for k in keys}


for path in sys.argv[1:]:
    for rep in range(2):
        for switch in ("1", "fault", "0"):  # deferred collapse (the default since session 18), fault at load, off
            env = {**os.environ, "MOEFLOW_HUGEPAGES": switch}
            v0 = vmstat()
            out = subprocess.run([sys.executable, "-c", CHILD, path], env=env, capture_output=True, text=True)
            line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]
            v1 = vmstat()
            print(json.dumps({"model": path, "hugepages": switch, "rep": rep,
                              **{k: v1[k] - v0[k] for k in v0}}), line, flush=True)
