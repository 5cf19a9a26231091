"""Experts into the backend at the disk's speed: several threads, each reading an expert's byte ranges with
``preadv`` (through the checkpoint's :class:`~moeflow.io.expert_index.ExpertIndex`) into its own staging buffer
and converting it straight into the backend's storage (a host-store row, a pool slot).

Nothing here is proportional to the weights in Python: a read is a few ``preadv`` calls, the conversion a few
tensor ops and one native call per matrix (:mod:`moeflow.kernels.repack`), all of which release the GIL, so the
threads overlap reading one expert with converting others. ``ExpertBackend.load_expert`` is called for distinct
experts from several threads at once (its contract). The progress bar counts bytes (bytes/s).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm.auto import tqdm

from moeflow.config import load_workers
from moeflow.io.expert_index import ExpertIndex
from moeflow.offload.host_store import HostStore

Sink = Callable[[int, int, dict[str, torch.Tensor]], None]  # (moe layer, expert, tensors) -> None
PROGRESS_MIN_BYTES = 256 * 2**20  # show a loading progress bar above this much expert data


def show_progress(progress: bool | None, expert_bytes: int) -> bool:
    """The loading progress bar: as asked, else for more than ``PROGRESS_MIN_BYTES`` of experts."""
    return progress if progress is not None else expert_bytes >= PROGRESS_MIN_BYTES


def load_experts(index: ExpertIndex, sink: Sink, *, workers: int | None = None, progress: bool = False,
                 keys: Iterable[tuple[int, int]] | None = None, desc: str = "loading experts",
                 cancel: threading.Event | None = None) -> int:
    """Read every (layer, expert) of ``index`` (or ``keys``) and hand its tensors to ``sink``, in ``workers``
    threads; returns the bytes read. The first error (a vanished or truncated shard: a CheckpointError naming the
    file) stops the other threads and is raised. ``cancel``: once set, no further expert is started."""
    todo = list(keys) if keys is not None else [(l, e) for l in range(index.num_layers)  # noqa: E741
                                                  for e in range(index.num_experts)]
    total = sum(index.nbytes(l, e) for l, e in todo)  # noqa: E741
    n = min(load_workers(workers), max(len(todo), 1))
    lock = threading.Lock()
    state = {"next": 0, "failed": False}
    bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)

    def work() -> None:
        staging = index.new_staging()
        while True:
            with lock:
                if state["failed"] or state["next"] >= len(todo) or (cancel is not None and cancel.is_set()):
                    return
                layer, expert = todo[state["next"]]
                state["next"] += 1
            try:
                sink(layer, expert, index.read(layer, expert, staging))
            except BaseException:
                state["failed"] = True
                raise
            bar.update(index.nbytes(layer, expert))

    try:
        if n == 1:
            work()
        else:
            with ThreadPoolExecutor(n, thread_name_prefix="moeflow-load") as pool:
                for f in [pool.submit(work) for _ in range(n)]:
                    f.result()
    finally:
        bar.close()
    return total


class ExpertLoad:
    """:func:`load_experts` on a thread of its own, started before the rest of the model is built: the experts are
    read and converted while the calling thread loads and quantizes the non-expert weights (on the CPU those are
    mostly one thread's work, which left the other cores idle). :meth:`result` waits and raises the loader's
    error; :meth:`cancel` (the build failed) stops it after the experts in flight and waits."""

    def __init__(self, index: ExpertIndex, sink: Sink, store: HostStore | None = None, *, progress: bool = False,
                 workers: int | None = None) -> None:
        self.index, self.store = index, store  # (store: what ``sink`` writes into, for the caller to hand on)
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(sink, progress, workers), daemon=True,
                                        name="moeflow-load-experts")
        self._thread.start()

    def _run(self, sink: Sink, progress: bool, workers: int | None) -> None:
        try:
            load_experts(self.index, sink, workers=workers, progress=progress, cancel=self._cancel)
        except BaseException as exc:  # handed to result()
            self._error = exc

    def result(self) -> None:
        """Wait for every expert; the loader's first error (a CheckpointError naming the file) is raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Start no further expert and wait for the ones in flight (a no-op once finished)."""
        self._cancel.set()
        self._thread.join()
