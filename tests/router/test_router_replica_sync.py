"""--router-replica-sync: two routers (two frontends' worth) share their active sequences over the
event plane, so each sees the load the other put on the workers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

from tandem.router.config import KvRouterConfig
from tandem.router.kv_router import KvRouter

BLOCK = 16


def _router(runtime, namespace: str, replica_sync: bool) -> tuple[KvRouter, list[int]]:  # type: ignore[no-untyped-def]
    router = KvRouter(runtime, "m", block_size=BLOCK, config=KvRouterConfig(use_kv_events=False,
                                                                           replica_sync=replica_sync))
    workers = {101: f"{namespace}.backend.generate", 102: f"{namespace}.backend.generate"}
    router.sync_workers(workers)
    return router, sorted(workers)


async def test_routers_share_active_sequences(runtimes, namespace) -> None:  # type: ignore[no-untyped-def]
    (a, workers), (b, _) = _router(await runtimes(), namespace, True), _router(await runtimes(), namespace, True)
    attempt = 0
    async with asyncio.timeout(15):  # PUB/SUB drops what precedes the subscription: retry until seen
        while True:
            request_id = f"r{attempt}"
            prompt = list(range(1000 * (attempt + 1), 1000 * (attempt + 1) + 10 * BLOCK))  # no overlap with earlier
            routed = a.select(request_id, prompt, workers)
            await asyncio.sleep(0.1)
            if request_id in b.sequences:
                break
            routed.free()
            attempt += 1
    worker = a.sequences.request_worker(request_id)
    assert worker is not None and b.sequences.request_worker(request_id) == worker
    assert b.sequences.active_prefill_tokens(worker) == len(prompt)
    # b's own decision for the same prompt avoids the worker a loaded.
    assert b.select("mine", prompt, workers).decision.worker_id != worker[0]
    routed.tokens_arrived()
    async with asyncio.timeout(5):
        while b.sequences.active_prefill_tokens(worker):
            await asyncio.sleep(0.02)
    routed.free()
    async with asyncio.timeout(5):
        while request_id in b.sequences:
            await asyncio.sleep(0.02)
    assert b.sequences.active_blocks(worker) == 0


async def test_without_sync_routers_stay_independent(runtimes, namespace) -> None:  # type: ignore[no-untyped-def]
    """a and b without sync, c and d with it, a and c in one runtime, b and d in another: once d has seen
    c's load, a's would have reached d, and c's b, had a published or b followed."""
    first, second = await runtimes(), await runtimes()
    (a, workers), (b, _) = _router(first, namespace, False), _router(second, namespace, False)
    (c, _), (d, _) = _router(first, namespace, True), _router(second, namespace, True)
    async with asyncio.timeout(15):  # PUB/SUB drops what precedes the subscription: again until d has one
        for attempt in itertools.count():
            prompt = list(range(1000 * (attempt + 1), 1000 * (attempt + 1) + 5 * BLOCK))
            a.select(f"a{attempt}", prompt, workers)
            c.select(f"c{attempt}", prompt, workers)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    while f"c{attempt}" not in d.sequences:
                        await asyncio.sleep(0.01)
                    break
    assert len(a.sequences) == len(c.sequences) == attempt + 1
    assert len(b.sequences) == 0  # it follows no one
    assert not any(f"a{n}" in d.sequences for n in range(attempt + 1))  # a published nothing
