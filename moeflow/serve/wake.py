"""Hands the engine thread's token events to the server's event loop without making the engine wait for it.

``loop.call_soon_threadsafe`` wakes the loop by writing to its self-pipe, and Python releases the GIL around that
write: the woken event loop takes the GIL and runs the token's work (the detokenized delta, the SSE chunk, the
socket write: ~0.5 ms) while the engine thread, back from the write, waits for the GIL to start its next pass.
Measured on the CPU server: ~0.9 ms per token in ``call_soon_threadsafe``, the whole of what a streamed token
cost beyond the engine (issue 42).

:class:`LoopWaker` puts events into a ``queue.SimpleQueue`` instead, whose ``put`` wakes a waiting thread with
the GIL held. Its own thread takes the events and wakes the loop once per batch of them; it gets the GIL when
the engine thread next lets it go: in the decode pass's native call (ctypes releases the GIL) or, sooner, in any
torch op before it (those release it too, so the event loop can still delay the engine there). Events keep their
order.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

_STOP = object()


class LoopWaker:
    """Calls ``callback(item)`` on ``loop`` for each :meth:`post`-ed item, in order; :meth:`post` from any thread
    returns at once. :meth:`close` ends the waker's thread (items posted after it may never be delivered)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="moeflow-serve-waker", daemon=True)
        self._thread.start()

    def post(self, callback: Callable[[Any], None], item: Any) -> None:
        """Queue ``callback(item)`` for the event loop (any thread; does not release the GIL)."""
        self._items.put((callback, item))

    def close(self) -> None:
        self._items.put(_STOP)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            batch = [self._items.get()]
            while True:  # everything queued by now: one wake-up of the loop
                try:
                    batch.append(self._items.get_nowait())
                except queue.Empty:
                    break
            stop = any(entry is _STOP for entry in batch)
            batch = [entry for entry in batch if entry is not _STOP]
            if batch:
                try:
                    self.loop.call_soon_threadsafe(_deliver, batch)
                except RuntimeError:  # the event loop is closed (server shutting down)
                    return
            if stop:
                return


def _deliver(batch: list[tuple[Callable[[Any], None], Any]]) -> None:
    for callback, item in batch:
        callback(item)
