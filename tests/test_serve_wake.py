"""LoopWaker: items posted from another thread reach the event loop in order, each once (moeflow/serve/wake.py)."""

from __future__ import annotations

import asyncio
import threading

from moeflow.serve.wake import LoopWaker


def test_waker_delivers_every_item_in_order_from_two_threads() -> None:
    async def run() -> tuple[list, list, set]:
        loop = asyncio.get_running_loop()
        waker = LoopWaker(loop)
        a: asyncio.Queue = asyncio.Queue()
        b: asyncio.Queue = asyncio.Queue()
        threads_seen: set = set()

        def put_a(item):
            threads_seen.add(threading.get_ident())
            a.put_nowait(item)

        def post(queue_put, tag: str) -> None:
            for k in range(500):
                waker.post(queue_put, (tag, k))

        workers = [threading.Thread(target=post, args=(put_a, "a")),
                   threading.Thread(target=post, args=(b.put_nowait, "b"))]
        for w in workers:
            w.start()
        got_a = [await asyncio.wait_for(a.get(), 10) for _ in range(500)]
        got_b = [await asyncio.wait_for(b.get(), 10) for _ in range(500)]
        for w in workers:
            w.join()
        waker.close()
        assert not waker._thread.is_alive()
        assert a.empty() and b.empty()
        return got_a, got_b, threads_seen

    got_a, got_b, threads_seen = asyncio.run(run())
    assert got_a == [("a", k) for k in range(500)]
    assert got_b == [("b", k) for k in range(500)]
    assert threads_seen == {threading.get_ident()}  # the callbacks ran on the event loop's thread
