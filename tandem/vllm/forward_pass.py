"""The vLLM worker's forward-pass metrics (`forward_pass_metrics`, read by the load-based planner).

vLLM reports each engine step to the stat loggers with its scheduler details when
`enable_logging_iteration_details` is on: the prompt tokens the step computed and how long it took. The KV
tokens held come from the step's `kv_cache_usage` and the cache's size; the prompt tokens queued are counted by
the worker's handler (requests admitted without a first token yet), since the scheduler's stats give the
number of waiting requests, not their tokens. vLLM logs each such step at INFO from its own logging stat
logger; that line is filtered out here (it is what the metrics carry).
"""

from __future__ import annotations

import logging
from typing import Any

from tandem.llm.forward_pass import EngineState
from tandem.router.publisher import SupportsPublish
from tandem.vllm.publisher import NullStatLogger
from tandem.worker.forward_pass import ForwardPassRecorder, PendingPrompts

log = logging.getLogger(__name__)

VLLM_LOGGER = "vllm.v1.metrics.loggers"


class _NoIterationLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Iteration(" not in str(record.msg)


def enable_iteration_details(engine_args: Any) -> bool:
    """Turn vLLM's per-step details on (False: this vLLM has none; the metrics then carry queues only)."""
    if not hasattr(engine_args, "enable_logging_iteration_details"):
        log.warning("this vLLM reports no per-step details: forward-pass metrics carry the queue only, and the "
                    "load-based planner cannot fit step times on this worker")
        return False
    engine_args.enable_logging_iteration_details = True
    logging.getLogger(VLLM_LOGGER).addFilter(_NoIterationLines())
    return True


class ForwardPasses:
    """One engine's steps and queue, fed by `ForwardPassStatLogger` and the handler (`pending`); publishing starts
    with `start` once the worker has its id and event plane and knows its cache (the engine, and so this, may
    exist before the worker's runtime)."""

    def __init__(self, dp_rank: int) -> None:
        self.dp_rank = dp_rank
        self.pending = PendingPrompts()
        self.kv_usage = 0.0
        self.kv_capacity = 0  # tokens: blocks * block size
        self.max_num_batched_tokens = 0
        self.recorder: ForwardPassRecorder | None = None

    def start(self, worker_id: int, publisher: SupportsPublish, num_blocks: int, block_size: int,
              max_num_batched_tokens: int) -> None:
        self.kv_capacity = num_blocks * block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.recorder = ForwardPassRecorder(worker_id=worker_id, dp_rank=self.dp_rank, publisher=publisher,
                                            state=self.state)
        self.recorder.start()

    async def stop(self) -> None:
        if self.recorder is not None:
            await self.recorder.stop()

    def state(self) -> EngineState:
        return EngineState(self.pending.tokens, int(self.kv_usage * self.kv_capacity), self.max_num_batched_tokens)

    def step(self, prefill_tokens: int, seconds: float) -> None:
        if self.recorder is not None:
            self.recorder.record(prefill_tokens, int(self.kv_usage * self.kv_capacity), seconds)


class ForwardPassStatLogger(NullStatLogger):
    """A vLLM stat logger (`StatLoggerBase`'s interface) feeding one engine's `ForwardPasses`."""

    def __init__(self, vllm_config: Any, engine_index: int, passes: ForwardPasses | None) -> None:
        super().__init__(vllm_config, engine_index)
        self.passes = passes  # None: another data-parallel rank's engine, reported by its own worker

    def record(self, scheduler_stats: Any, iteration_stats: Any = None, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is None or self.passes is None:
            return
        self.passes.kv_usage = float(getattr(scheduler_stats, "kv_cache_usage", 0.0) or 0.0)
        details = getattr(scheduler_stats, "iteration_details", None)
        if details is not None and not details.is_dummy:
            self.passes.step(details.num_ctx_tokens, details.elapsed_ms / 1000)


class ForwardPassLoggerFactory:
    """Pass in `AsyncLLM.from_vllm_config(..., stat_loggers=[...])`; the engine of `passes.dp_rank` feeds it."""

    def __init__(self, passes: ForwardPasses) -> None:
        self.passes = passes

    def __call__(self, vllm_config: Any, engine_index: int = 0) -> ForwardPassStatLogger:
        try:
            from vllm.v1.metrics.loggers import StatLoggerBase

            StatLoggerBase.register(ForwardPassStatLogger)
        except ImportError:
            pass
        return ForwardPassStatLogger(vllm_config, engine_index,
                                     self.passes if engine_index == self.passes.dp_rank else None)
