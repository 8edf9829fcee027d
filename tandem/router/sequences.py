"""Active sequence tracking (the router's "slot manager").

The router's own view of each worker's in-flight load, updated as it routes: KV blocks held by active
requests (ref-counted per worker, so a prefix shared by several requests counts once), prompt tokens
still waiting for prefill, and the number of requests. Every update is O(blocks of the request).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

WorkerKey = tuple[int, int]  # (worker_id, dp_rank)


@dataclass
class _ActiveRequest:
    worker: WorkerKey
    blocks: tuple[int, ...]  # distinct sequence hashes this request holds a reference on
    prefill_tokens: int  # 0 once prefill completed
    started_at: float


class ActiveSequences:
    def __init__(self, block_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._clock = clock
        # Insertion order is start order (the clock is monotonic), which lets `sweep` stop early.
        self._requests: dict[str, _ActiveRequest] = {}
        self._block_refs: dict[WorkerKey, dict[int, int]] = {}
        self._prefill_tokens: dict[WorkerKey, int] = {}
        self._worker_requests: dict[WorkerKey, set[str]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def add_request(
        self,
        request_id: str,
        worker: WorkerKey,
        sequence_hashes: Sequence[int] | None,
        isl: int,
        overlap_blocks: int,
        expected_output_tokens: int | None = None,
    ) -> None:
        """Start tracking a routed request. `sequence_hashes` None means block tracking is off. A request
        id already tracked is replaced (a retry routed again). `expected_output_tokens` is accepted for
        parity with Dynamo's AddRequest; output-block tracking is not implemented, so it adds no load."""
        self.free(request_id)
        blocks = tuple(dict.fromkeys(sequence_hashes)) if sequence_hashes else ()
        refs = self._block_refs.setdefault(worker, {})
        for h in blocks:
            refs[h] = refs.get(h, 0) + 1
        prefill = max(isl - overlap_blocks * self.block_size, 0)
        self._prefill_tokens[worker] = self._prefill_tokens.get(worker, 0) + prefill
        self._worker_requests.setdefault(worker, set()).add(request_id)
        self._requests[request_id] = _ActiveRequest(worker, blocks, prefill, self._clock())

    def mark_prefill_completed(self, request_id: str) -> None:
        """The request produced its first token: its prompt no longer loads the worker's prefill."""
        request = self._requests.get(request_id)
        if request is None or request.prefill_tokens == 0:
            return
        self._release_prefill(request)

    def free(self, request_id: str) -> None:
        """The request finished, failed or was cancelled: release everything it holds."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        worker = request.worker
        self._release_prefill(request)
        refs = self._block_refs[worker]
        for h in request.blocks:
            count = refs[h] - 1
            if count:
                refs[h] = count
            else:
                del refs[h]
        ids = self._worker_requests[worker]
        ids.discard(request_id)
        if not ids:  # drop per-worker state so departed workers leave nothing behind
            del self._worker_requests[worker], self._block_refs[worker], self._prefill_tokens[worker]

    def active_blocks(self, worker: WorkerKey) -> int:
        return len(self._block_refs.get(worker, ()))

    def active_prefill_tokens(self, worker: WorkerKey) -> int:
        return self._prefill_tokens.get(worker, 0)

    def active_requests(self, worker: WorkerKey) -> int:
        return len(self._worker_requests.get(worker, ()))

    def new_blocks(self, worker: WorkerKey, sequence_hashes: Sequence[int]) -> int:
        """How many distinct blocks of a request would be new to the worker's active set."""
        refs = self._block_refs.get(worker)
        if not refs:
            return len(set(sequence_hashes))
        return sum(1 for h in set(sequence_hashes) if h not in refs)

    def remove_worker(self, worker_id: int) -> None:
        """The worker left: forget its requests on every dp rank."""
        for worker in [w for w in self._worker_requests if w[0] == worker_id]:
            for request_id in list(self._worker_requests.get(worker, ())):
                self.free(request_id)

    def sweep(self, max_age: float) -> list[str]:
        """Free requests started more than `max_age` seconds ago (a lost completion would otherwise
        leave their load on the worker forever); returns their ids."""
        deadline = self._clock() - max_age
        expired = []
        for request_id, request in self._requests.items():
            if request.started_at >= deadline:
                break
            expired.append(request_id)
        for request_id in expired:
            self.free(request_id)
        return expired

    def request_worker(self, request_id: str) -> WorkerKey | None:
        request = self._requests.get(request_id)
        return request.worker if request else None

    def _release_prefill(self, request: _ActiveRequest) -> None:
        self._prefill_tokens[request.worker] -= request.prefill_tokens
        request.prefill_tokens = 0
