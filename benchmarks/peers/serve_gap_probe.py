"""Probe (issue 42): ``moeflow serve`` from source tree TREE with the one-call native decode step timed: per 400
calls, the median time in the native call and the median Python time between one call's end and the next's start
(the engine thread's own work plus any wait for the GIL). ``DEFER=1``: the token events the server posts are held
and handed to its waker right before the next native call (a model of reporting tokens where the engine releases
the GIL for milliseconds; the held events also go out after 30 ms idle). Not a test; an experiment's launcher:

    OMP_NUM_THREADS=1 python benchmarks/peers/serve_gap_probe.py TREE serve --model X.gguf --device cpu --threads 1
"""
# ruff: noqa
import sys, time, statistics, threading
sys.path[:0] = [sys.argv.pop(1)]
import os
import moeflow.engine.cpu_layers as C
HELD = []
if os.environ.get("DEFER"):
    import moeflow.serve.wake as W
    W.LoopWaker.post = lambda self, cb, item: HELD.append((self, cb, item))
def _tick():
    while True:
        time.sleep(0.05)
        if HELD and time.perf_counter() - (S["last"] or 0) > 0.03:
            flush()
threading.Thread(target=_tick, daemon=True).start()
def flush():
    while HELD:
        w, cb, item = HELD.pop(0)
        w._items.put((cb, item))
orig = C.layers_step
S0 = 0
S = {"last": None, "native": [], "gap": []}
def timed(*a, **k):
    t0 = time.perf_counter()
    if S["last"] is not None and t0 - S["last"] < 0.05:
        S["gap"].append(t0 - S["last"])
    flush()
    out = orig(*a, **k)
    t1 = time.perf_counter(); S["native"].append(t1 - t0); S["last"] = t1
    if len(S["native"]) % 400 == 0:
        g = S["gap"][-390:]; n = S["native"][-400:]
        print(f"native ms median {statistics.median(n)*1e3:.2f}  python between ms median {statistics.median(g)*1e3:.3f} mean {statistics.fmean(g)*1e3:.3f}", flush=True)
    return out
C.layers_step = timed
from moeflow.cli import main
sys.exit(main())
