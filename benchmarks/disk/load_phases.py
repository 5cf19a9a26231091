"""Where ``from_pretrained`` spends its time (issue 37): wall and CPU seconds (user + system, every thread) of each
phase of one load, in this process, on the cold-start benchmark's checkpoint (``benchmarks.disk.cold_start``
writes it; page cache warm after its first read).

Each phase is a function of ``moeflow.engine.build`` (or of the objects it calls) timed where it is called; on the
CPU offloading path the experts load on their own threads beside the phases that follow their start (the
``ExpertLoad`` row is the wait for them at the end), so the phases' wall times need not add up to the total.

    python -m benchmarks.disk.load_phases /tmp/moeflow-synthetic-mixtral-8x7b-awq-L2 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import resource
import time
from pathlib import Path


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


PHASES = {  # (module, attribute) timed, in the order a load reaches them
    "expert format (CpuInt4Format layout)": ("moeflow.engine.build", "expert_storage_format"),
    "expert index (shard headers)": ("moeflow.engine.build", "open_expert_index"),
    "non-expert weights": ("moeflow.engine.loading", "load_non_expert_weights"),
    "int8 lm_head / attention, AWQ attention": ("moeflow.engine.build", "quantize_decoder_linears"),
    "fused CPU step": ("moeflow.engine.build", "fuse_cpu_step"),
    "memory plan": ("moeflow.engine.build", "plan_memory"),
    "expert backend": ("moeflow.engine.build", "make_expert_backend"),
    "experts (after the backend)": ("moeflow.engine.build", "load_experts"),
    "experts (ExpertLoad: the wait)": ("moeflow.engine.parallel_load", "ExpertLoad.result"),
    "finish_loading (warm slots)": ("moeflow.offload.backend", "OffloadedExperts.finish_loading"),
}


def instrument(record: list) -> None:
    """Wrap every phase's function so that each call appends (phase, wall s, CPU s) to ``record``."""
    import importlib

    for phase, (module_name, attr) in PHASES.items():
        owner = importlib.import_module(module_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, name):
            continue  # (an older tree: the phase does not exist there)
        real = getattr(owner, name)

        def timed(*args, _real=real, _phase=phase, **kwargs):
            t, c = time.perf_counter(), cpu_s()
            try:
                return _real(*args, **kwargs)
            finally:
                record.append((_phase, time.perf_counter() - t, cpu_s() - c))

        setattr(owner, name, functools.wraps(real)(timed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--repeats", type=int, default=1, help="loads in this process (the first includes imports' "
                                                           "first-call costs)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    from moeflow import MoEModel, OffloadConfig

    print(f"imports {time.perf_counter() - t0:.2f} s")
    record: list = []
    instrument(record)
    for i in range(args.repeats):
        record.clear()
        t, c = time.perf_counter(), cpu_s()
        model = MoEModel.from_pretrained(args.checkpoint, device="cpu", progress=False,
                                         offload=OffloadConfig(policy="lru", gpu_expert_slots=4))
        wall, cpu = time.perf_counter() - t, cpu_s() - c
        model.close()
        print(f"load {i + 1}: wall {wall:.2f} s, CPU {cpu:.2f} s")
        for phase, w, c in record:
            print(f"  {phase:42s} wall {w:6.2f} s  CPU {c:6.2f} s")


if __name__ == "__main__":
    main()
