"""The demo's model and policy timed in wall-clock and process CPU time (a loaded machine inflates the first).

    cd <tree> && OMP_NUM_THREADS=1 PYTHONPATH=$PWD python <this file> auto       # or: resident

Greedy, prompt "The import statements", 16 of 32 slots for an offloading policy; median of 3 runs of 1 and of
65 new tokens; decode rate = 64 / (t65 - t1). Runs on older trees too (only the public API).
"""

from __future__ import annotations

import sys
import time

import torch

from moeflow import MoEOffloadedMixtral, OffloadConfig
from moeflow.cli import embedded_model_path


def main() -> None:
    policy = sys.argv[1] if len(sys.argv) > 1 else "auto"
    torch.set_num_threads(1)
    slots = None if policy == "resident" else 16
    model = MoEOffloadedMixtral.from_pretrained(embedded_model_path(),
                                                offload=OffloadConfig(policy=policy, gpu_expert_slots=slots))
    ids = torch.tensor([model.tokenizer.encode("The import statements")])
    model.generate(ids, max_new_tokens=8, do_sample=False)

    def run(n: int) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        model.generate(ids, max_new_tokens=n, do_sample=False)
        return time.perf_counter() - wall, time.process_time() - cpu

    one = [run(1) for _ in range(3)]
    many = [run(65) for _ in range(3)]
    w1, c1 = (sorted(r[i] for r in one)[1] for i in (0, 1))
    wn, cn = (sorted(r[i] for r in many)[1] for i in (0, 1))
    print(f"{policy}: first token wall {w1 * 1e3:.1f} ms cpu {c1 * 1e3:.1f} ms | decode wall {64 / (wn - w1):.1f} "
          f"tok/s cpu {64 / (cn - c1):.1f} tok/s")


if __name__ == "__main__":
    main()
