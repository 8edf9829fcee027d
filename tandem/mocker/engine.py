"""One simulated engine: the scheduler driven by an asyncio step loop in (scaled) real time, and the
synthetic tokens it emits."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from tandem.llm.protocols import RankedLogprob
from tandem.llm.tokenizer import Tokenizer
from tandem.mocker.scheduler import Scheduler, SchedulerLoad, SimRequest, StepOutput, StepResult
from tandem.router.hashing import tokens_to_bytes

log = logging.getLogger(__name__)

# One output's `log_probs` and `top_logprobs` (see tandem.llm.protocols).
SimLogprobs = tuple[list[float], list[list[RankedLogprob]]]
# Mixed into the request's seed for the logprob draws, a stream apart from the tokens'.
_LOGPROBS_STREAM = 0x6C6F6770726F6273

# Words the synthetic output is drawn from, so that streamed text reads as text.
_CATALOG_TEXT = (
    " the of and to in is was for on that with as by at from his her it an were are which this be or "
    "has had one their not but new first after also have other they two its who been more all when time "
    "there would into she may where world city work through under part most over during year made game "
    "state about later used known many called between people each three well then both while these some "
    "could river season around before team war company north found however since being music film "
    "station against government number series such high school early built club system because"
)


class SyntheticTokens:
    """Deterministic output tokens: words of the model's vocabulary, each picked by a hash of everything
    before it (the prompt and the tokens generated so far), seeded by the engine seed (or the request's
    own). So the same request gets the same sequence on any worker, and a request resumed elsewhere with
    its tokens so far appended to its prompt (a migration) goes on exactly as it would have, as a greedy
    LLM does."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0) -> None:
        excluded = set(tokenizer.eos_token_ids) | set(tokenizer.special_token_ids)
        ids = [i for i in tokenizer.encode(_CATALOG_TEXT) if i not in excluded]
        self.catalog: list[int] = list(dict.fromkeys(ids))
        if not self.catalog:
            raise ValueError("the tokenizer produced no usable tokens for synthetic output")
        self.seed = seed

    def _context(self, prompt: Sequence[int], seed: int | None) -> Any:
        """A running hash of the context, to be extended token by token."""
        from xxhash import xxh3_64

        context = xxh3_64(seed=(self.seed if seed is None else seed) & 0xFFFFFFFFFFFFFFFF)
        context.update(tokens_to_bytes(prompt))
        return context

    def for_request(self, prompt: Sequence[int], seed: int | None = None) -> Callable[[int], int]:
        """`token(i)`: the request's i-th generated token."""
        context, catalog = self._context(prompt, seed), self.catalog
        tokens: list[int] = []

        def token(i: int) -> int:
            while len(tokens) <= i:
                tokens.append(catalog[context.intdigest() % len(catalog)])
                context.update(tokens_to_bytes(tokens[-1:]))
            return tokens[i]

        return token

    def logprobs_for(self, prompt: Sequence[int], seed: int | None, top: int) -> Callable[[int], SimLogprobs]:
        """`logprobs(token_id)`: the `log_probs` and `top_logprobs` of the request's next generated token,
        in the vLLM worker's wire format. Called once per generated token, in order.

        Synthetic, deterministic per context like the tokens (drawn from a stream of their own, so asking
        for logprobs does not change the output; a resumed request gets the same values). As vLLM: the
        top list holds the `top` most likely tokens, ranks from 1, the generated token among them (here
        always the likeliest, rank 1); for `top` 0 it holds the generated token alone. Alternatives are
        distinct catalog words (distinct texts, so a completions `top_logprobs` map keeps them all), at
        most the catalog."""
        context, catalog = self._context(prompt, seed), self.catalog
        others = min(max(top, 1), len(catalog)) - 1

        def logprobs(token_id: int) -> SimLogprobs:
            rng = random.Random(context.intdigest() ^ _LOGPROBS_STREAM)
            context.update(tokens_to_bytes([token_id]))
            # A proper distribution: the generated token takes at least half of the mass, so it is the
            # likeliest; each runner-up a share of what is left, so all are > 0 (finite logs) and sum <= 1.
            chosen = rng.uniform(0.5, 0.99)
            rest, probs = 1.0 - chosen, []
            for _ in range(others):
                p = rest * rng.uniform(0.1, 0.6)
                probs.append(p)
                rest -= p
            probs.sort(reverse=True)
            alternatives = [t for t in rng.sample(catalog, others + 1) if t != token_id][:others]
            lp = math.log(chosen)
            entries = [RankedLogprob(1, token_id, None, lp)]
            entries += [RankedLogprob(rank, t, None, math.log(p))
                        for rank, (t, p) in enumerate(zip(alternatives, probs, strict=True), 2)]
            return [lp], [entries]

        return logprobs


class Outputs:
    """One request's outputs, in order, as the engine hands them out; None means the request is gone.
    A deque and one waiter: the engine puts one output per request per step, so this sits on the
    mocker's hottest path, where asyncio.Queue's bookkeeping (bounds, task counts) buys nothing."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[StepOutput | None] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: StepOutput | None) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> StepOutput | None:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class MockEngine:
    """Runs `scheduler.step()` back to back while there is work, sleeping each step's simulated
    duration divided by the speedup ratios, then hands each request its new token."""

    def __init__(self, scheduler: Scheduler, *, speedup_ratio: float = 1.0, decode_speedup_ratio: float = 1.0,
                 on_load: Callable[[SchedulerLoad], None] | None = None,
                 on_step: Callable[[StepResult, float], None] | None = None) -> None:
        self.scheduler = scheduler
        self.speedup_ratio = speedup_ratio
        self.decode_speedup_ratio = decode_speedup_ratio
        self.on_load = on_load
        self.on_step = on_step  # each step's result and simulated seconds (forward-pass metrics)
        self.steps = 0
        # Lag: wall time spent busy against the time the timing model says those steps take. Equal when the
        # mocker keeps up; busy > simulated when the host cannot run it at this speedup.
        self.simulated_seconds = 0.0
        self._busy_before = 0.0  # busy time of the finished busy periods
        self._busy_since: float | None = None  # start of the current busy period (time.monotonic)
        self._reported_blocks: int | None = None
        self._outputs: dict[str, Outputs] = {}
        self._work = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="mock-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def submit(self, request: SimRequest) -> Outputs:
        """Queue a request; its outputs arrive on the returned queue (None = the request is gone).
        Raises ValueError when it can never fit this engine."""
        if request.request_id in self._outputs:
            raise ValueError(f"request id {request.request_id} is already running")
        self.scheduler.add(request)
        queue = self._outputs[request.request_id] = Outputs()
        self._work.set()
        return queue

    def release(self, request_id: str) -> None:
        """Forget a request: aborted in the scheduler if it has not finished."""
        if self._outputs.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)
            self._report_load()  # the engine may go idle now: no later step would report the freed blocks

    def step_seconds(self, result: StepResult) -> float:
        return (result.prefill_ms / self.speedup_ratio
                + result.decode_ms / (self.speedup_ratio * self.decode_speedup_ratio)) / 1000.0

    @property
    def busy_seconds(self) -> float:
        """Wall time spent with work to do."""
        running = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy_before + running

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self.scheduler.has_work:
                if self._busy_since is not None:
                    self._busy_before += time.monotonic() - self._busy_since
                    self._busy_since = None
                self._work.clear()
                await self._work.wait()
                deadline = loop.time()
            if self._busy_since is None:
                self._busy_since = time.monotonic()
            result = self.scheduler.step()
            self.steps += 1
            # Steps end on a running deadline, so a late wake-up and the work between steps shorten
            # the next sleep instead of adding up; more than a step behind (overloaded), restart from now.
            seconds = self.step_seconds(result)
            self.simulated_seconds += seconds
            if self.on_step is not None:
                self.on_step(result, seconds)
            now = loop.time()
            deadline += seconds
            if deadline < now - seconds:
                deadline = now
            await asyncio.sleep(max(0.0, deadline - now))
            for output in result.outputs:
                queue = self._outputs.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
                    if output.finished:
                        del self._outputs[output.request_id]
            self._report_load()

    def _report_load(self) -> None:
        # Only when the used blocks changed: at high speedups steps are back to back, and a report
        # per step would cost more than the step.
        used = self.scheduler.kv.num_active
        if self.on_load is not None and used != self._reported_blocks:
            self._reported_blocks = used
            try:
                self.on_load(self.scheduler.load())
            except Exception:  # metrics must never stop the engine
                log.exception("publishing the mocker's load failed")
