"""The mocker's scheduler against vLLM's own v1 `Scheduler`, step by step on the same request trace.

vLLM's real `Scheduler` and `KVCacheManager` run in this process with no model and no engine (built from a
small `VllmConfig` and `KVCacheConfig`, as vLLM's own scheduler unit tests do); a fake model runner samples one
token per request that has computed all its tokens, the same token the mocker's request generates. Both get
the same arrivals per step (shared prompt prefixes, identical prompts at once, output lengths), a pool of KV
blocks small enough that requests are preempted, and a token budget small enough that prompts are prefilled
in chunks. Each step must agree on:

* which requests are scheduled, in which order, and with how many tokens (admission order, chunked prefill,
  `max_num_seqs`, the token budget);
* which requests are preempted;
* for each request admitted from the waiting queue (new, or resumed after a preemption), how many of its
  tokens the prefix cache gave it.

Left out, because the mocker differs on purpose (docs/mocker.md, "Differences from vLLM's scheduler"):

* vLLM's pool of N blocks keeps one as its null block: the vLLM side gets `NUM_BLOCKS + 1`;
* the mocker's default watermark is Dynamo's 0.01, vLLM's 0: both get the same value here;
* `--preemption-mode fifo` (a Dynamo option; vLLM has none), timings, KV events.

`test_a_wrong_preemption_victim_is_caught` runs the mocker with `preemption_mode="fifo"` (the oldest request
preempted instead of the newest) on the same trace and expects a divergence, so the trace does discriminate.
The comparison found two defects of the mocker, fixed with it: it admitted a request when its first chunk
fit, where vLLM (`scheduler_reserve_full_isl`, on by default) needs room for the whole prompt; and a request
computing a block already cached shared the cached block, where vLLM keeps the request's own copy.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.config import SchedulerConfig as VllmSchedulerConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tandem.mocker.perf_model import load_perf_model
from tandem.mocker.scheduler import Scheduler, SchedulerConfig, SimRequest

BLOCK_SIZE = 16
NUM_BLOCKS = 16
MAX_MODEL_LEN = 256
MAX_STEPS = 2000


@dataclass(frozen=True)
class Arrival:
    request_id: str
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Setup:
    max_num_batched_tokens: int = 48
    max_num_seqs: int = 4
    watermark: float = 0.0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduler_reserve_full_isl: bool = True


@dataclass
class Step:
    """What one scheduler step did, as both sides report it."""

    scheduled: list[tuple[str, int]]
    """(request id, tokens computed), in scheduling order."""
    admitted: dict[str, int]
    """Requests taken from the waiting queue -> tokens their prefix-cache hit covered."""
    preempted: set[str]


def output_token(request_id: str, i: int) -> int:
    """The i-th generated token of a request, on both sides (so recomputed outputs hit the cache alike)."""
    return 30000 + (random.Random(f"{request_id}/{i}").randrange(1000))


def make_trace(seed: int, num_requests: int = 20, span: int = 10) -> dict[int, list[Arrival]]:
    """Arrivals per step. Half the prompts are one or two of three shared prefixes (1, 2 or 2.5 blocks), so
    identical prompts run at once and block-aligned ones recompute their last block although it is cached;
    the others are mostly a shared prefix and a distinct suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 29000) for _ in range(rng.choice([16, 32, 40]))] for _ in range(3)]
    trace: dict[int, list[Arrival]] = {}
    for i in range(num_requests):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + (rng.choice(prefixes) if rng.random() < 0.3 else [])
        else:
            prefix = rng.choice(prefixes) if rng.random() < 0.6 else []
            prompt = prefix + [rng.randrange(1, 29000) for _ in range(rng.randrange(1, 60))]
        trace.setdefault(rng.randrange(span), []).append(Arrival(f"r{i}", prompt, rng.randrange(1, 80)))
    return trace


class VllmSide:
    """vLLM's v1 Scheduler with a fake model runner."""

    def __init__(self, model_folder: str, setup: Setup) -> None:
        scheduler_config = VllmSchedulerConfig(
            max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False,
            max_num_batched_tokens=setup.max_num_batched_tokens, max_num_seqs=setup.max_num_seqs,
            enable_chunked_prefill=setup.enable_chunked_prefill, watermark=setup.watermark,
            scheduler_reserve_full_isl=setup.scheduler_reserve_full_isl, async_scheduling=False,
        )
        cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=setup.enable_prefix_caching)
        num_blocks = NUM_BLOCKS + 1  # block 0 is vLLM's null block
        cache_config.num_gpu_blocks = num_blocks
        model_config = ModelConfig(model=model_folder, max_model_len=MAX_MODEL_LEN, dtype="float32",
                                   skip_tokenizer_init=True)
        vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                                 cache_config=cache_config)
        spec = FullAttentionSpec(BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
        kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        self.scheduler = VllmScheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                                       structured_output_manager=StructuredOutputManager(vllm_config),
                                       block_size=BLOCK_SIZE)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        self._requests: dict[str, Request] = {}

    def add(self, arrival: Arrival, step: int) -> None:
        request = Request(arrival.request_id, arrival.prompt,
                          SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True), None,
                          arrival_time=float(step), block_hasher=self._hasher)
        self._requests[arrival.request_id] = request
        self.scheduler.add_request(request)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.has_requests())

    def step(self) -> Step:
        out = self.scheduler.schedule()
        admitted = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        admitted |= {rid: n for rid, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
                     if rid in cached.resumed_req_ids}
        ids = list(out.num_scheduled_tokens)
        requests = self._requests
        # After schedule() a request's computed tokens include this step's: it samples if it has them all.
        sampled = [[output_token(rid, requests[rid].num_output_tokens)]
                   if requests[rid].num_computed_tokens >= requests[rid].num_tokens else [] for rid in ids]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled))
        return Step(list(out.num_scheduled_tokens.items()), admitted, set(out.preempted_req_ids or ()))


class MockerSide:
    def __init__(self, setup: Setup, preemption_mode: str = "lifo") -> None:
        config = SchedulerConfig(
            num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=setup.max_num_seqs,
            max_num_batched_tokens=setup.max_num_batched_tokens, enable_prefix_caching=setup.enable_prefix_caching,
            enable_chunked_prefill=setup.enable_chunked_prefill, watermark=setup.watermark,
            preemption_mode=preemption_mode, scheduler_reserve_full_isl=setup.scheduler_reserve_full_isl,
        )
        self.scheduler = Scheduler(config, load_perf_model(None))

    def add(self, arrival: Arrival, step: int) -> None:
        rid = arrival.request_id
        self.scheduler.add(SimRequest(rid, arrival.prompt, arrival.max_tokens, lambda i: output_token(rid, i)))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> Step:
        result = self.scheduler.step()
        return Step(list(result.num_scheduled_tokens.items()), result.admitted, set(result.preempted))


@dataclass
class Coverage:
    """What the trace made vLLM do, so that a passing comparison means something."""

    preemptions: int = 0
    resumed: int = 0
    prefix_hits: int = 0
    resumed_prefix_hits: int = 0
    chunks: int = 0
    """Prefill chunks that left part of the prompt for a later step."""


def run_both(trace: dict[int, list[Arrival]], vllm: VllmSide, mocker: MockerSide) -> tuple[int | None, Coverage]:
    """Drive both on `trace`; returns (the first step at which they disagree or None, what vLLM did)."""
    coverage = Coverage()
    seen: set[str] = set()
    prompt_len = {a.request_id: len(a.prompt) for arrivals in trace.values() for a in arrivals}
    last_arrival = max(trace)
    for step in itertools.count():
        for arrival in trace.get(step, []):
            vllm.add(arrival, step)
            mocker.add(arrival, step)
        if step > last_arrival and not vllm.has_work and not mocker.has_work:
            return None, coverage
        assert step < MAX_STEPS, "the trace does not finish"
        expected, got = vllm.step(), mocker.step()
        if expected != got:
            print(f"step {step}:\n  vLLM   {expected}\n  mocker {got}")
            return step, coverage
        coverage.preemptions += len(expected.preempted)
        for rid, hit in expected.admitted.items():
            resumed = rid in seen
            seen.add(rid)
            coverage.resumed += resumed
            coverage.prefix_hits += hit > 0
            coverage.resumed_prefix_hits += resumed and hit > 0
            coverage.chunks += hit + dict(expected.scheduled)[rid] < prompt_len[rid]
    raise AssertionError("unreachable")


SETUPS = {
    "default": Setup(),
    "watermark": Setup(watermark=0.15),
    "first-chunk-admission": Setup(scheduler_reserve_full_isl=False),
    "no-chunked-prefill": Setup(enable_chunked_prefill=False, max_num_batched_tokens=MAX_MODEL_LEN),
    "no-prefix-caching": Setup(enable_prefix_caching=False),
}
SEEDS = (0, 1, 2)


@pytest.mark.parametrize("name", list(SETUPS))
def test_mocker_schedules_as_vllm(name: str, smollm2: str) -> None:
    setup = SETUPS[name]
    total = Coverage()
    for seed in SEEDS:
        diverged, coverage = run_both(make_trace(seed), VllmSide(smollm2, setup), MockerSide(setup))
        assert diverged is None, f"seed {seed}: the mocker diverged from vLLM at step {diverged} (printed above)"
        for key, value in vars(coverage).items():
            setattr(total, key, getattr(total, key) + value)
    # The traces exercised what is compared.
    assert total.preemptions > 0 and total.resumed > 0, total
    if setup.enable_prefix_caching:
        assert total.prefix_hits > 0 and total.resumed_prefix_hits > 0, total
    if setup.enable_chunked_prefill:
        assert total.chunks > 0, total


def test_a_block_computed_again_is_the_requests_own(smollm2: str) -> None:
    """b computes block 1 of a's prompt again (the last prompt token is never a cache hit) while a holds it:
    vLLM gives b its own block, so c, which needs all but a's 3 and b's 2 blocks and one more, waits until a
    and b are done (the mocker used to share the block and admit c at once)."""
    prompt = list(range(1, 2 * BLOCK_SIZE + 1))
    trace = {0: [Arrival("a", prompt, 10)], 1: [Arrival("b", prompt, 10)],
             2: [Arrival("c", list(range(100, 100 + (NUM_BLOCKS - 4) * BLOCK_SIZE)), 1)]}
    setup = SETUPS["default"]
    diverged, coverage = run_both(trace, VllmSide(smollm2, setup), MockerSide(setup))
    assert diverged is None and coverage.prefix_hits == 1


def test_a_wrong_preemption_victim_is_caught(smollm2: str) -> None:
    setup = SETUPS["default"]
    diverged, _ = run_both(make_trace(0), VllmSide(smollm2, setup), MockerSide(setup, preemption_mode="fifo"))
    assert diverged is not None



def test_whole_prompt_admission_is_a_flag(smollm2: str, tmp_path: Path) -> None:
    from tandem.mocker.args import parse_args

    def engine(*flags: str) -> SchedulerConfig:
        return parse_args(["--model-path", smollm2, *flags]).engine

    extra = tmp_path / "engine.json"
    extra.write_text('{"scheduler_reserve_full_isl": false}')
    assert engine().scheduler_reserve_full_isl  # vLLM's default
    assert not engine("--no-scheduler-reserve-full-isl").scheduler_reserve_full_isl
    assert not engine("--extra-engine-args", str(extra)).scheduler_reserve_full_isl
