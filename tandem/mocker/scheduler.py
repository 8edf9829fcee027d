"""vLLM v1-style scheduler of the mocker: synchronous and deterministic (no clocks, no asyncio).

A request's tokens are its prompt followed by the tokens it has generated; `num_computed` of them
have their KV computed. Every `step()` is one engine iteration:

1. One budget of `max_num_batched_tokens`. Running requests first, in admission order: each
   computes `min(uncomputed tokens, budget)` (1 when decoding). A request that needs a block the
   pool cannot give (after evicting cached blocks) preempts a victim (`lifo`: the newest running
   request, `fifo`: the oldest; maybe itself): its blocks are released, its computed tokens reset
   to 0 and it goes to the front of the waiting queue. When readmitted it recomputes its prompt and
   the tokens it generated (hitting the prefix cache if they are still there), then continues.
2. Then, if nobody was preempted in this step (as vLLM), waiting requests in FIFO order while
   fewer than `max_num_seqs` run: prefix-cache lookup (at most `len(tokens) - 1` tokens, whole
   blocks, so at least one token is computed), blocks for the tokens of this step, keeping
   `int(watermark * num_blocks)` blocks free (unless nothing runs: then the watermark protects
   nobody, and waiting for it could block the queue forever); with `scheduler_reserve_full_isl` (the
   default, as vLLM's) its whole sequence, not only this step's chunk, must fit the free blocks
   beyond the watermark. The first request that does not fit stops admission.
   Without chunked prefill a request is admitted only if all its remaining tokens fit the budget.
3. Every request whose tokens are now all computed samples one token (the first one in the step
   that completes its prefill); a request that reached `max_tokens` finishes and releases its blocks.

KV blocks follow vLLM: blocks are allocated for the tokens computed in the step, and full blocks
are registered in the prefix cache (stored events) when scheduled, so the block completed by a
sampled token is registered in the next step, when that token is fed back; a request's last token
is never fed back and needs no slot.

Timing (Dynamo 1.6): `prefill_ms(uncached tokens computed in the step, recomputation included)` plus,
if any request decodes (samples a token without computing prompt tokens in this step),
`decode_ms(active blocks * block_size, num_blocks * block_size, mean length of the decoding
requests)`. A first token comes at the end of its prefill step, at the prefill's cost alone.

Disaggregated decode (`SimRequest.prefilled`): on its first admission the prompt's blocks are
allocated and registered at once (stored events for those not already cached, as vLLM does after
receiving them), at no prefill cost and no token budget; the request samples its first token
(`output_token(0)`) in that same step. If preempted later it recomputes like any other request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.mocker.kv_manager import KvEvent, KvManager
from tandem.mocker.offload import OffloadTiers
from tandem.mocker.perf_model import PerfModel
from tandem.router.hashing import (
    XXH3_SEED,
    MediaSpan,
    local_block_hashes,
    media_block_hashes,
    sequence_hashes,
)


@dataclass
class SchedulerConfig:
    num_blocks: int = 16384
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    watermark: float = 0.01
    """Keep this fraction of blocks free when admitting new requests."""
    preemption_mode: str = "lifo"
    """lifo: preempt the most recently admitted running request; fifo: the oldest."""
    scheduler_reserve_full_isl: bool = True
    """Admit a waiting request only if its whole sequence fits the free blocks (and the watermark),
    not just the tokens of its first chunk (vLLM's option of the same name, on by default)."""

    def __post_init__(self) -> None:
        if self.preemption_mode not in ("lifo", "fifo"):
            raise ValueError(f"preemption_mode must be 'lifo' or 'fifo', got {self.preemption_mode!r}")
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


@dataclass
class SimRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    """Tokens to generate (the mocker never stops on EOS)."""
    output_token: Callable[[int], int]
    """`output_token(i)` = the i-th generated token id."""
    hash_seed: int = XXH3_SEED
    """Block-hash seed: `tandem.router.hashing.request_seed(lora_name, cache_salt)`."""
    prefilled: bool = False
    """Disaggregated decode: the prompt's KV arrived from a prefill worker."""
    media: list[MediaSpan] = field(default_factory=list)
    """Where the prompt's images sit, with their content hashes (on the blocks they overlap)."""
    encode_ms: float = 0.0
    """Simulated encoder time per image, paid on admission for each image the prefix cache does not hold."""


@dataclass(slots=True)
class StepOutput:
    request_id: str
    token_id: int
    finished: bool
    """True on the request's last token (max_tokens reached)."""
    cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache; set on the request's first token only."""


@dataclass
class StepResult:
    prefill_ms: float
    """`prefill_ms(num_prefill_tokens)`, 0 if none, plus the encoder time of the images admitted."""
    decode_ms: float
    """`decode_ms(...)` over the requests that decoded (sampled without prefill work), 0 if none."""
    outputs: list[StepOutput]
    num_prefill_tokens: int
    """Uncached tokens computed by requests in (chunked) prefill or recomputation."""
    num_decode_requests: int
    """Requests that computed only their last sampled token (or nothing, for a prefilled request)."""
    preempted: list[str]
    num_prefill_requests: int = 0
    """Requests that computed prefill tokens in this step."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """Request id -> tokens computed in this step, in scheduling order (vLLM's `SchedulerOutput` field)."""
    admitted: dict[str, int] = field(default_factory=dict)
    """Requests admitted from the waiting queue in this step (new or resumed after a preemption) -> the
    tokens they did not compute: their prefix-cache hit (a disaggregated decode: its whole prompt)."""


@dataclass
class SchedulerLoad:
    num_running: int
    num_waiting: int
    kv_used_blocks: int
    """Active blocks."""
    kv_total_blocks: int
    active_decode_blocks: int
    """Active blocks too, as Dynamo's mocker reports them."""
    active_prefill_tokens: int
    """Tokens still to compute by requests not yet decoding; waiting ones count in full (no cache lookup)."""
    gpu_cache_usage: float
    prefix_cache_hit_rate: float
    """Cumulative tokens found in the prefix cache / tokens looked up, over admissions."""


@dataclass(eq=False, slots=True)  # compared by identity
class _Seq:
    id: str
    req: SimRequest
    tokens: list[int]
    num_computed: int = 0
    num_output: int = 0
    kv_transferred: bool = False  # prefilled and not admitted yet
    cached_tokens: int | None = None
    local_hashes: list[int] = field(default_factory=list)
    seq_hashes: list[int] = field(default_factory=list)
    # Tokens the blocks it holds have room for, and its full blocks handed to the prefix cache: a
    # decoding request needs a new block (and registers one) only every block_size tokens.
    capacity: int = 0
    num_registered: int = 0

    @property
    def in_prefill(self) -> bool:
        """Has tokens to compute besides its last sampled one."""
        return self.num_output == 0 or len(self.tokens) - self.num_computed > 1

    def ensure_hashes(self, num_blocks: int, block_size: int) -> None:
        """Compute the (local, sequence) hashes of the first `num_blocks` blocks, as tokens come."""
        have = len(self.local_hashes)
        if num_blocks > have:
            media = self.req.media
            local = local_block_hashes(
                self.tokens[have * block_size : num_blocks * block_size], block_size, self.req.hash_seed,
                mm_hashes=media_block_hashes(media, num_blocks, block_size)[have:] if media else None,
            )
            # sequence_hashes chains from its first element: prepend our last hash to continue the chain.
            self.seq_hashes += (
                sequence_hashes(self.seq_hashes[-1:] + local)[1:] if have else sequence_hashes(local)
            )
            self.local_hashes += local


@dataclass
class _Batch:
    """What one step has scheduled so far."""

    budget: int
    tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens computed
    prefill: set[str] = field(default_factory=set)  # ids of requests computing prefill tokens
    admitted: dict[str, int] = field(default_factory=dict)  # request id -> prefix-cache hit, in tokens
    encode_ms: float = 0.0  # the images of the requests admitted, encoded in this step
    onboard_ms: float = 0.0  # the blocks they load from the offload tiers

    def add(self, seq: _Seq, n: int, prefill: bool) -> None:
        self.tokens[seq.id] = n
        self.budget -= n
        if prefill:
            self.prefill.add(seq.id)

    def undo(self, seq: _Seq) -> None:
        n = self.tokens.pop(seq.id, None)
        if n is not None:
            self.budget += n
            self.prefill.discard(seq.id)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.tokens[i] for i in self.prefill)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        perf_model: PerfModel,
        kv_events: Callable[[KvEvent], None] | None = None,
        offload: OffloadTiers | None = None,
    ) -> None:
        self.config = config
        self.perf_model = perf_model
        self.offload = offload if config.enable_prefix_caching else None
        self.kv = KvManager(
            config.num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            on_event=kv_events,
            on_evict=self.offload.offload if self.offload is not None else None,
        )
        self._watermark_blocks = int(config.watermark * config.num_blocks)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # admission order
        self._requests: dict[str, _Seq] = {}  # waiting and running, by id
        self._hit_tokens = 0
        self._queried_tokens = 0

    def add(self, request: SimRequest) -> None:
        """Queue a request; ValueError if it could never run."""
        cfg = self.config
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already scheduled")
        if not request.prompt:
            raise ValueError(f"request {rid!r} has an empty prompt")
        if request.max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be at least 1, got {request.max_tokens}")
        # The last generated token is never fed back, so it needs no KV slot.
        needed = -(-(len(request.prompt) + request.max_tokens - 1) // cfg.block_size)
        if needed > cfg.num_blocks:
            raise ValueError(
                f"request {rid!r} needs {needed} KV blocks ({len(request.prompt)} prompt + {request.max_tokens} "
                f"output tokens) but the pool has {cfg.num_blocks}"
            )
        if (
            not cfg.enable_chunked_prefill
            and not request.prefilled
            and len(request.prompt) > cfg.max_num_batched_tokens
        ):
            raise ValueError(
                f"request {rid!r}: prompt of {len(request.prompt)} tokens exceeds max_num_batched_tokens "
                f"({cfg.max_num_batched_tokens}) and chunked prefill is disabled"
            )
        seq = _Seq(rid, request, list(request.prompt), kv_transferred=request.prefilled)
        self._requests[rid] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Drop a waiting or running request and free its blocks; unknown id: no-op."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return
        (self._running if seq in self._running else self._waiting).remove(seq)
        self.kv.free(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self) -> StepResult:
        """One engine iteration (see the module docstring)."""
        batch = _Batch(self.config.max_num_batched_tokens)
        preempted = self._schedule_running(batch)
        if not preempted:
            self._schedule_waiting(batch)

        sampling = [s for s in self._running if s.num_computed == len(s.tokens)]
        decoding = [s for s in sampling if s.id not in batch.prefill]
        cfg = self.config
        num_prefill_tokens = batch.num_prefill_tokens
        prefill_ms = self.perf_model.prefill_ms(num_prefill_tokens) if num_prefill_tokens else 0.0
        prefill_ms += batch.encode_ms + batch.onboard_ms
        decode_ms = 0.0
        if decoding:
            decode_ms = self.perf_model.decode_ms(
                self.kv.num_active * cfg.block_size,
                cfg.num_blocks * cfg.block_size,
                sum(len(s.tokens) for s in decoding) / len(decoding),
            )
        outputs = [self._sample(s) for s in sampling]
        return StepResult(
            prefill_ms=prefill_ms,
            decode_ms=decode_ms,
            outputs=outputs,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_requests=len(decoding),
            preempted=preempted,
            num_prefill_requests=len(batch.prefill),
            num_scheduled_tokens=batch.tokens,
            admitted=batch.admitted,
        )

    def load(self) -> SchedulerLoad:
        prefill_tokens = sum(len(s.tokens) - s.num_computed for s in self._running if s.in_prefill)
        prefill_tokens += sum(len(s.tokens) for s in self._waiting if not s.kv_transferred)
        return SchedulerLoad(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_used_blocks=self.kv.num_active,
            kv_total_blocks=self.config.num_blocks,
            active_decode_blocks=self.kv.num_active,
            active_prefill_tokens=prefill_tokens,
            gpu_cache_usage=self.kv.usage,
            prefix_cache_hit_rate=self._hit_tokens / self._queried_tokens if self._queried_tokens else 0.0,
        )

    # -- step phases -----------------------------------------------------------------------------
    def _schedule_running(self, batch: _Batch) -> list[str]:
        """Schedule running requests; returns the ids of those preempted."""
        preempted: list[str] = []
        for seq in list(self._running):
            if batch.budget == 0:
                break
            if seq.id in preempted:  # the victim of an earlier request
                continue
            n = min(len(seq.tokens) - seq.num_computed, batch.budget)
            prefill = seq.in_prefill
            if self._allocate_or_preempt(seq, n, batch, preempted):
                self._advance(seq, n)
                batch.add(seq, n, prefill)
        return preempted

    def _allocate_or_preempt(self, seq: _Seq, n: int, batch: _Batch, preempted: list[str]) -> bool:
        """Blocks for `n` more tokens of running `seq`, preempting victims until they fit; False if
        `seq` itself was preempted."""
        needed = seq.num_computed + n
        if needed <= seq.capacity:
            return True
        while not self.kv.allocate(seq.id, needed):
            victim = self._running[-1] if self.config.preemption_mode == "lifo" else self._running[0]
            self._preempt(victim, batch)
            preempted.append(victim.id)
            if victim is seq:
                return False
        seq.capacity = self.kv.num_blocks_of(seq.id) * self.config.block_size
        return True

    def _schedule_waiting(self, batch: _Batch) -> None:
        cfg = self.config
        bs = cfg.block_size
        while self._waiting and len(self._running) < cfg.max_num_seqs:
            seq = self._waiting[0]
            onboard = None  # the blocks after its device match that it loads from the offload tiers
            if seq.kv_transferred:
                # The whole prompt's KV is here: reuse what is cached, nothing to compute.
                cached_blocks = self._match(seq, len(seq.tokens) // bs)
                cached, n = len(seq.tokens), 0
            else:
                # vLLM never serves the last token from the cache: it must be computed to sample.
                max_blocks = (len(seq.tokens) - 1) // bs
                cached_blocks = self._match(seq, max_blocks)
                if self.offload is not None and cached_blocks < max_blocks:
                    onboard = self.offload.lookup(seq.seq_hashes[cached_blocks:max_blocks])
                cached = (cached_blocks + (onboard.blocks if onboard else 0)) * bs
                remaining = len(seq.tokens) - cached
                # Without chunked prefill a request runs whole, unless it can never fit in a step (a
                # recomputation after preemption; vLLM's config makes that impossible).
                whole = not cfg.enable_chunked_prefill and remaining <= cfg.max_num_batched_tokens
                n = min(remaining, batch.budget)
                if n == 0 or (whole and n < remaining):
                    break
            # The watermark keeps room for running requests to grow; alone, a request may use it all.
            reserve = self._watermark_blocks if self._running else 0
            prefix = seq.seq_hashes[:cached_blocks]
            if cfg.scheduler_reserve_full_isl and not self.kv.fits(seq.id, len(seq.tokens), prefix, reserve=reserve):
                break
            if not self.kv.allocate(seq.id, cached + n, prefix, reserve=reserve):
                break
            seq.capacity = self.kv.num_blocks_of(seq.id) * bs
            seq.num_registered = cached_blocks
            self._waiting.popleft()
            self._running.append(seq)
            if not seq.kv_transferred:
                self._hit_tokens += cached_blocks * bs
                self._queried_tokens += len(seq.tokens)
            if onboard is not None and self.offload is not None:
                self.offload.load(seq.seq_hashes[cached_blocks:max_blocks], onboard)
                batch.onboard_ms += onboard.ms
            if seq.num_output == 0:  # (as vLLM counts them: with the tokens loaded from the tiers)
                seq.cached_tokens = cached if not seq.kv_transferred else cached_blocks * bs
            batch.admitted[seq.id] = cached
            if seq.req.media and not seq.kv_transferred:
                # The images whose blocks the prefix cache does not hold all through are encoded first.
                uncached = sum(1 for span in seq.req.media if span.offset + span.length > cached)
                batch.encode_ms += uncached * seq.req.encode_ms
            seq.kv_transferred = False
            seq.num_computed = cached
            prefill = n > 0 and seq.in_prefill
            self._advance(seq, n)
            batch.add(seq, n, prefill)

    def _match(self, seq: _Seq, max_blocks: int) -> int:
        """How many of the first `max_blocks` blocks of `seq` are in the prefix cache."""
        if not self.config.enable_prefix_caching:
            return 0
        seq.ensure_hashes(max_blocks, self.config.block_size)
        return self.kv.match_prefix(seq.seq_hashes[:max_blocks])

    def _advance(self, seq: _Seq, n: int) -> None:
        """`n` more tokens of `seq` are computed in this step: cache the blocks they complete."""
        seq.num_computed += n
        if self.config.enable_prefix_caching:
            num_full = seq.num_computed // self.config.block_size
            if num_full > seq.num_registered:
                seq.ensure_hashes(num_full, self.config.block_size)
                self.kv.register(seq.id, num_full, seq.seq_hashes, seq.local_hashes)
                seq.num_registered = num_full

    def _preempt(self, seq: _Seq, batch: _Batch) -> None:
        self._running.remove(seq)
        self.kv.free(seq.id)
        batch.undo(seq)
        seq.num_computed = seq.capacity = seq.num_registered = 0
        self._waiting.appendleft(seq)

    def _sample(self, seq: _Seq) -> StepOutput:
        token = seq.req.output_token(seq.num_output)
        first = seq.num_output == 0
        seq.tokens.append(token)
        seq.num_output += 1
        finished = seq.num_output >= seq.req.max_tokens
        if finished:
            self._running.remove(seq)
            del self._requests[seq.id]
            self.kv.free(seq.id)
        return StepOutput(seq.id, token, finished, seq.cached_tokens if first else None)
