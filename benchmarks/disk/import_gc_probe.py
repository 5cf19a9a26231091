"""Cold first token of the embedded model with the cyclic garbage collector's time beside it (issue 37).

Run in a fresh process from the repository root: ``PYTHONPATH=$PWD python benchmarks/disk/import_gc_probe.py``.
Prints the import and first-token wall times from the process's start and the seconds spent in gc passes
(``gc.callbacks``), with the number of passes per generation. Results: ``benchmarks/results/cold_start/imports-s16.md``.
"""

import gc
import time
from typing import Any

_gc = {"seconds": 0.0, "passes": [0, 0, 0], "start": 0.0}


def _time_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _gc["start"] = time.perf_counter()
    else:
        _gc["seconds"] += time.perf_counter() - _gc["start"]
        _gc["passes"][info["generation"]] += 1


gc.callbacks.append(_time_gc)
t0 = time.time()
from moeflow import MoEModel  # noqa: E402, I001  (timed first: it imports torch inside its gc pause)

import torch  # noqa: E402

t_import, gc_import = time.time() - t0, _gc["seconds"]
model = MoEModel.from_pretrained("moeflow/data/tiny-mixtral-awq", device="cpu")
model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=1)
print(f"import {t_import:.2f} s (gc {gc_import:.3f}); first token {time.time() - t0:.2f} s; "
      f"gc total {_gc['seconds']:.3f} s, passes {_gc['passes']}")
