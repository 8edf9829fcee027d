"""Mocker simulation core: perf models, KV block pool and the vLLM-style scheduler, on hand-computed cases."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import msgspec
import numpy as np
import pytest

from tandem.mocker.engine import SyntheticTokens
from tandem.mocker.kv_manager import KvEvent, KvManager
from tandem.mocker.perf_model import InterpolatedPerfModel, PolynomialPerfModel, load_perf_model
from tandem.mocker.scheduler import Scheduler, SchedulerConfig, SimRequest, StepOutput, StepResult
from tandem.router.hashing import XXH3_SEED, local_block_hashes, request_seed, sequence_hashes
from tandem.router.protocols import KvBlock, KvCacheEventData, KvRemoved, KvStored

PROFILE = {
    "prefill_isl": [100, 200, 400],
    "prefill_ttft_ms": [10, 20, 30],
    "decode_active_kv_tokens": [0, 1000],
    "decode_context_length": [100, 200],
    "decode_itl": [[2, 4], [6, 8]],
}


class RecordingPerf:
    """prefill_ms = new tokens, decode_ms = 1; records the arguments."""

    def __init__(self) -> None:
        self.prefill: list[int] = []
        self.decode: list[tuple[int, int, float]] = []

    def prefill_ms(self, new_tokens: int) -> float:
        self.prefill.append(new_tokens)
        return float(new_tokens)

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int, context_length: float) -> float:
        self.decode.append((active_kv_tokens, total_kv_tokens, context_length))
        return 1.0


def make(**config: object) -> tuple[Scheduler, RecordingPerf, list[KvEvent]]:
    perf = RecordingPerf()
    events: list[KvEvent] = []
    return Scheduler(SchedulerConfig(**config), perf, events.append), perf, events  # type: ignore[arg-type]


def req(rid: str, prompt: list[int], max_tokens: int, base: int = 1000, **kw: object) -> SimRequest:
    return SimRequest(rid, prompt, max_tokens, lambda i: base + i, **kw)  # type: ignore[arg-type]


def hashes(tokens: list[int], block_size: int, seed: int = XXH3_SEED) -> tuple[list[int], list[int]]:
    """(sequence, local) hashes, the router's way."""
    local = local_block_hashes(tokens, block_size, seed)
    return sequence_hashes(local), local


def stored(parent: int | None, seq: list[int], local: list[int]) -> KvCacheEventData:
    return KvCacheEventData(
        stored=KvStored(
            parent, [KvBlock(block_hash=s, tokens_hash=t) for s, t in zip(seq, local, strict=True)]
        )
    )


def removed(*block_hashes: int) -> KvCacheEventData:
    return KvCacheEventData(removed=KvRemoved(list(block_hashes)))


def outputs(result: StepResult) -> list[tuple[str, int]]:
    return [(o.request_id, o.token_id) for o in result.outputs]


# -- perf models ---------------------------------------------------------------------------------
def test_polynomial_perf_model() -> None:
    model = load_perf_model(None)
    assert isinstance(model, PolynomialPerfModel)
    assert model.prefill_ms(0) == 0.0
    assert model.prefill_ms(100) == pytest.approx(18.023973989)  # 0.004209989 + 1.518344 + 16.50142
    assert model.prefill_ms(1000) == pytest.approx(32.1058589)
    assert model.decode_ms(0, 1000, 50) == pytest.approx(5.74)
    assert model.decode_ms(500, 1000, 50) == pytest.approx(26.31)  # -6.435 + 27.005 + 5.74
    assert model.decode_ms(1000, 1000, 50) == pytest.approx(34.01)  # -25.74 + 54.01 + 5.74


def check_profile(model: InterpolatedPerfModel) -> None:
    assert model.prefill_ms(0) == 0.0
    assert model.prefill_ms(150) == pytest.approx(15.0)
    assert model.prefill_ms(300) == pytest.approx(25.0)
    assert model.prefill_ms(50) == pytest.approx(5.0)  # first segment extended
    assert model.prefill_ms(600) == pytest.approx(40.0)  # last segment extended
    assert model.decode_ms(500, 0, 150) == pytest.approx(5.0)
    assert model.decode_ms(250, 0, 125) == pytest.approx(3.5)
    assert model.decode_ms(1000, 0, 200) == pytest.approx(8.0)
    assert model.decode_ms(2000, 0, 100) == pytest.approx(10.0)  # 2 + 2 * (6 - 2)
    assert model.decode_ms(0, 0, 0) == 1.0  # extrapolates to 0, clamped at 1 ms


def test_interpolated_perf_model_json(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    model = load_perf_model(str(path))
    assert isinstance(model, InterpolatedPerfModel)
    check_profile(model)


def test_interpolated_perf_model_npz(tmp_path: Path) -> None:
    path = tmp_path / "profile.npz"
    np.savez(path, **{k: np.asarray(v, dtype=np.float64) for k, v in PROFILE.items()})  # type: ignore[arg-type]
    model = load_perf_model(str(path))
    assert isinstance(model, InterpolatedPerfModel)
    check_profile(model)


def test_interpolated_prefill_clamped_at_zero() -> None:
    model = InterpolatedPerfModel.from_mapping(
        {**PROFILE, "prefill_isl": [100, 200], "prefill_ttft_ms": [5, 20]}
    )
    assert model.prefill_ms(50) == 0.0  # 5 - 50 * 0.15 < 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decode_itl": None}, "missing 'decode_itl'"),
        ({"decode_itl": [[1, 2, 3], [4, 5, 6]]}, r"shape .* \(2, 2\), got \(2, 3\)"),
        ({"prefill_ttft_ms": [1, 2]}, "prefill_ttft_ms has 2 values but prefill_isl has 3"),
        ({"prefill_isl": [100, 100, 400]}, "prefill_isl must be strictly increasing"),
        ({"decode_context_length": [100]}, "at least 2 points"),
        ({"decode_itl": [1, 2, 3, 4]}, "decode_itl must be a 2-D array"),
    ],
)
def test_bad_profile(tmp_path: Path, change: dict[str, object], message: str) -> None:
    data = {**PROFILE, **change}
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message):
        load_perf_model(str(path))


def test_bad_profile_files(tmp_path: Path) -> None:
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_perf_model(str(tmp_path / "list.json"))
    (tmp_path / "profile.csv").write_text("")
    with pytest.raises(ValueError, match="unsupported perf model file"):
        load_perf_model(str(tmp_path / "profile.csv"))


# -- scheduler -----------------------------------------------------------------------------------
def test_single_request_step_by_step() -> None:
    s, perf, events = make(num_blocks=100, block_size=4)
    prompt = list(range(1, 11))
    s.add(req("a", prompt, 3))

    r1 = s.step()
    assert r1.outputs == [StepOutput("a", 1000, False, cached_tokens=0)]
    assert (r1.num_prefill_tokens, r1.num_prefill_requests, r1.num_decode_requests) == (10, 1, 0)
    assert (r1.prefill_ms, r1.decode_ms) == (10.0, 0.0)  # the first token comes with its prefill
    r2 = s.step()
    assert r2.outputs == [StepOutput("a", 1001, False)]
    assert (r2.num_prefill_tokens, r2.num_decode_requests, r2.prefill_ms) == (0, 1, 0.0)
    r3 = s.step()
    assert r3.outputs == [StepOutput("a", 1002, True)]
    assert not s.has_work
    # 3 active blocks (10, 11, 12 tokens) out of 100 * 4; context = the length before sampling.
    assert perf.decode == [(12, 400, 11.0), (12, 400, 12.0)]
    assert perf.prefill == [10]
    # Blocks 0-1 are cached at prefill; block 2 once its last token (output 1001) is fed back in step 3.
    seq, local = hashes(prompt + [1000, 1001], 4)
    assert events == [stored(None, seq[:2], local[:2]), stored(seq[1], seq[2:], local[2:])]
    assert (s.kv.num_active, s.kv.num_inactive) == (0, 3)


def test_single_request_polynomial_timing() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4), PolynomialPerfModel())
    s.add(req("a", list(range(10)), 2))
    r1, r2 = s.step(), s.step()
    assert r1.prefill_ms == pytest.approx(16.65329649989)  # T = 10
    assert r1.decode_ms == 0.0  # the first token comes with its prefill
    assert (r2.prefill_ms, r2.decode_ms) == (0.0, pytest.approx(7.337134))


def test_chunked_prefill() -> None:
    s, perf, _ = make(num_blocks=64, block_size=16, max_num_batched_tokens=32)
    s.add(req("a", list(range(100)), 2))
    results = [s.step()]
    assert s.load().active_prefill_tokens == 68
    results += [s.step() for _ in range(4)]
    assert not s.has_work
    assert [r.num_prefill_tokens for r in results] == [32, 32, 32, 4, 0]
    assert perf.prefill == [32, 32, 32, 4]
    assert [r.outputs for r in results] == [
        [],
        [],
        [],
        [StepOutput("a", 1000, False, cached_tokens=0)],
        [StepOutput("a", 1001, True)],
    ]
    assert [r.decode_ms for r in results] == [0.0, 0.0, 0.0, 0.0, 1.0]


def test_without_chunked_prefill() -> None:
    s, perf, _ = make(num_blocks=64, block_size=4, max_num_batched_tokens=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="exceeds max_num_batched_tokens"):
        s.add(req("long", list(range(33)), 1))
    s.add(req("a", list(range(20)), 2))
    s.add(req("b", list(range(100, 120)), 2, base=2000))
    r1 = s.step()  # b's 20 tokens do not fit the 12 left: it waits (no chunk)
    assert (outputs(r1), r1.num_prefill_tokens) == ([("a", 1000)], 20)
    assert (s.load().num_running, s.load().num_waiting) == (1, 1)
    r2 = s.step()  # a decodes 1 token, b's 20 fit the 31 left
    assert (outputs(r2), r2.num_prefill_tokens, r2.num_decode_requests) == ([("a", 1001), ("b", 2000)], 20, 1)
    assert perf.decode[-1][2] == 21.0  # only a decodes: b's first token comes with its prefill
    assert outputs(s.step()) == [("b", 2001)]


def test_prefix_cache_hit_and_stored_events() -> None:
    s, _, events = make(num_blocks=64, block_size=4)
    prompt = list(range(1, 11))
    seq, local = hashes(prompt, 4)
    s.add(req("a", prompt, 1))
    s.step()
    assert events == [stored(None, seq[:2], local[:2])]

    s.add(req("b", prompt, 1))
    r = s.step()
    assert r.outputs == [StepOutput("b", 1000, True, cached_tokens=8)]
    assert r.num_prefill_tokens == 2
    assert len(events) == 1  # reused blocks are not stored again
    assert s.load().prefix_cache_hit_rate == pytest.approx(8 / 20)

    # Another salt, other hashes: no hit, and its own stored event.
    seed = request_seed(cache_salt="salt")
    s.add(req("c", prompt, 1, hash_seed=seed))
    assert s.step().outputs[0].cached_tokens == 0
    salted_seq, salted_local = hashes(prompt, 4, seed)
    assert events[1:] == [stored(None, salted_seq[:2], salted_local[:2])]
    assert s.load().prefix_cache_hit_rate == pytest.approx(8 / 30)


def test_last_prompt_token_is_never_cached() -> None:
    s, _, events = make(num_blocks=64, block_size=4)
    prompt = list(range(1, 9))  # exactly 2 full blocks
    s.add(req("a", prompt, 1))
    s.step()
    s.add(req("b", prompt, 2))
    r = s.step()
    # Only block 0 can be served: block 1 holds the last prompt token, which must be computed.
    assert (r.outputs[0].cached_tokens, r.num_prefill_tokens) == (4, 4)
    # The recomputed block 1 stays b's own copy, as vLLM keeps it: no new event, and a's block 1
    # stays cached beside it (inactive).
    assert len(events) == 1
    assert (s.kv.num_active, s.kv.num_inactive) == (2, 1)


def test_preemption_lifo_recomputes_and_resumes() -> None:
    s, _, events = make(num_blocks=6, block_size=4, preemption_mode="lifo")
    a_prompt, b_prompt = list(range(1, 9)), list(range(11, 19))
    s.add(req("a", a_prompt, 8, base=1000))
    s.add(req("b", b_prompt, 8, base=2000))
    results = []
    while s.has_work:
        results.append(s.step())
    steps = [outputs(r) for r in results]
    assert steps[:5] == [[("a", 1000 + i), ("b", 2000 + i)] for i in range(5)]
    # Step 6: a needs its 4th block, the pool (6) is full: b, the newest, is preempted. b cannot be
    # readmitted (4 blocks) while a holds 4; a finishes in step 8, b recomputes 5 tokens in step 9.
    assert [r.preempted for r in results] == [[], [], [], [], [], ["b"], [], [], [], [], []]
    assert steps[5:] == [
        [("a", 1005)],
        [("a", 1006)],
        [("a", 1007)],
        [("b", 2005)],
        [("b", 2006)],
        [("b", 2007)],
    ]
    assert results[8].num_prefill_tokens == 5  # prompt + 5 outputs = 13 tokens, 8 cached
    assert results[8].outputs[0].cached_tokens is None  # not b's first token
    # b generates the same sequence it would have without preemption, each token once.
    b_tokens = [o.token_id for r in results for o in r.outputs if o.request_id == "b"]
    assert b_tokens == list(range(2000, 2008))

    a_seq, _ = hashes(a_prompt + [1000 + i for i in range(4)], 4)
    b_seq, b_local = hashes(b_prompt + [2000 + i for i in range(4)], 4)
    removals = [e for e in events if e != "cleared" and e.removed is not None]
    # Step 6 evicts b's leaf (block 2); step 9 evicts a's leaf to make room for b's recomputation,
    # which stores b's block 2 again.
    assert removals == [removed(b_seq[2]), removed(a_seq[2])]
    assert events[-1] == stored(b_seq[1], b_seq[2:3], b_local[2:3])


def test_preemption_fifo_picks_the_oldest() -> None:
    s, _, _ = make(num_blocks=6, block_size=4, preemption_mode="fifo")
    s.add(req("a", list(range(1, 9)), 8, base=1000))
    s.add(req("b", list(range(11, 19)), 8, base=2000))
    results = []
    while s.has_work:
        results.append(s.step())
    assert [p for r in results for p in r.preempted] == ["a"]
    assert results[5].preempted == ["a"] and outputs(results[5]) == [("b", 2005)]
    a_tokens = [o.token_id for r in results for o in r.outputs if o.request_id == "a"]
    assert a_tokens == list(range(1000, 1008))


def test_eviction_leaves_first_with_removed_events() -> None:
    events: list[KvEvent] = []
    kv = KvManager(4, 1, on_event=events.append)
    x_seq, x_local = hashes([1, 2, 3], 1)
    y_seq, y_local = hashes([1, 9], 1)
    assert kv.allocate("x", 3)
    kv.register("x", 3, x_seq, x_local)
    assert kv.match_prefix(y_seq) == 1
    assert kv.allocate("y", 2, y_seq[:1])  # shares x's first block
    kv.register("y", 2, y_seq, y_local)
    assert events == [stored(None, x_seq, x_local), stored(x_seq[0], y_seq[1:], y_local[1:])]
    assert (kv.num_active, kv.num_free) == (4, 0)

    kv.free("y")
    kv.free("x")
    assert (kv.num_active, kv.num_inactive, kv.num_free) == (0, 4, 4)
    assert kv.allocate("z", 1)  # the least recently released leaf: y's block
    assert kv.allocate("z", 3)  # then x's leaf, then its parent, which has become a leaf
    assert events[2:] == [removed(y_seq[1]), removed(x_seq[2], x_seq[1])]
    assert kv.match_prefix(x_seq) == 1  # the root, parent of the evicted ones, is kept
    assert not kv.allocate("w", 2)  # all or nothing
    assert (kv.num_active, kv.num_inactive, kv.num_blocks_of("w")) == (3, 1, 0)


def test_abort_frees_blocks() -> None:
    s, _, _ = make(num_blocks=64, block_size=4)
    s.add(req("a", list(range(10)), 5))
    s.step()
    assert s.kv.num_active == 3
    s.abort("a")
    assert (s.kv.num_active, s.kv.num_inactive, s.has_work) == (0, 2, False)
    s.abort("unknown")
    s.add(req("b", list(range(10)), 5))
    s.abort("b")  # from the waiting queue
    assert not s.has_work
    s.add(req("a", list(range(10)), 1))  # the id is free again


def test_max_num_seqs() -> None:
    s, _, _ = make(num_blocks=64, block_size=4, max_num_seqs=2)
    for rid, base in (("a", 1000), ("b", 2000), ("c", 3000)):
        s.add(req(rid, list(range(base, base + 5)), 2, base=base))
    assert outputs(s.step()) == [("a", 1000), ("b", 2000)]
    assert (s.load().num_running, s.load().num_waiting) == (2, 1)
    assert outputs(s.step()) == [("a", 1001), ("b", 2001)]  # c still waits: both slots were taken
    assert outputs(s.step()) == [("c", 3000)]


def test_clear() -> None:
    s, _, events = make(num_blocks=64, block_size=4)
    prompt = list(range(1, 11))
    s.add(req("a", prompt, 1))
    s.add(req("b", list(range(50, 60)), 5, base=2000))
    s.step()
    assert (s.kv.num_active, s.kv.num_inactive) == (3, 2)
    s.kv.clear()
    assert events[-1] == "cleared"
    assert (s.kv.num_active, s.kv.num_inactive) == (3, 0)
    assert s.kv.match_prefix(hashes(prompt, 4)[0]) == 0
    s.add(req("a2", prompt, 1))
    assert s.step().outputs[-1].cached_tokens == 0
    seq, local = hashes(prompt, 4)
    assert events[-1] == stored(None, seq[:2], local[:2])  # stored again


def test_load() -> None:
    s, _, _ = make(num_blocks=10, block_size=4, max_num_batched_tokens=8, watermark=0.0)
    s.add(req("a", list(range(12)), 2))
    s.add(req("b", list(range(100, 106)), 2))
    assert s.load().active_prefill_tokens == 18
    s.step()  # a's first 8 tokens; the budget is spent, b waits
    load = s.load()
    assert (load.num_running, load.num_waiting, load.kv_used_blocks, load.kv_total_blocks) == (1, 1, 2, 10)
    assert (load.active_decode_blocks, load.active_prefill_tokens) == (2, 4 + 6)
    assert (load.gpu_cache_usage, load.prefix_cache_hit_rate) == (0.2, 0.0)


def test_watermark_applies_when_others_run() -> None:
    s, _, _ = make(num_blocks=10, block_size=1, watermark=0.2)  # keep 2 blocks free
    s.add(req("a", list(range(7)), 3))
    s.add(req("b", [100, 101], 1, base=2000))
    assert outputs(s.step()) == [("a", 1000)]  # b would leave 1 free block
    assert outputs(s.step()) == [("a", 1001)]
    assert outputs(s.step()) == [("a", 1002)]  # a finishes, its blocks become cache
    assert outputs(s.step()) == [("b", 2000)]


def test_prefilled_request() -> None:
    s, perf, events = make(num_blocks=64, block_size=4)
    prompt = list(range(1, 11))
    s.add(req("d", prompt, 2, prefilled=True))
    r1 = s.step()
    # The transferred prompt's blocks are stored at once; no prefill compute; token 0 in the same step.
    assert r1.outputs == [StepOutput("d", 1000, False, cached_tokens=0)]
    assert (r1.num_prefill_tokens, r1.prefill_ms, r1.num_decode_requests) == (0, 0.0, 1)
    assert perf.decode == [(12, 256, 10.0)]
    seq, local = hashes(prompt, 4)
    assert events == [stored(None, seq[:2], local[:2])]
    assert s.step().outputs == [StepOutput("d", 1001, True)]
    # A second transfer of the same prompt finds its full blocks in the cache.
    s.add(req("e", prompt, 1, prefilled=True))
    assert s.step().outputs == [StepOutput("e", 1000, True, cached_tokens=8)]
    assert len(events) == 1


def test_prefix_caching_disabled() -> None:
    s, _, events = make(num_blocks=64, block_size=4, enable_prefix_caching=False)
    prompt = list(range(1, 11))
    s.add(req("a", prompt, 1))
    s.step()
    s.add(req("b", prompt, 1))
    r = s.step()
    assert (r.outputs[0].cached_tokens, r.num_prefill_tokens) == (0, 10)
    assert events == []
    assert (s.kv.num_active, s.kv.num_inactive) == (0, 0)


def test_add_validation() -> None:
    s, _, _ = make(num_blocks=4, block_size=4)
    s.add(req("fits", list(range(10)), 7))  # 10 + 7 - 1 = 16 tokens need a KV slot: 4 blocks
    with pytest.raises(ValueError, match="needs 5 KV blocks"):
        s.add(req("big", list(range(10)), 8))
    with pytest.raises(ValueError, match="already scheduled"):
        s.add(req("fits", [1], 1))
    with pytest.raises(ValueError, match="empty prompt"):
        s.add(req("empty", [], 1))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add(req("none", [1], 0))
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="random")
    # The request that fills the whole pool runs to the end.
    results = []
    while s.has_work:
        results.append(s.step())
    assert [o.token_id for r in results for o in r.outputs] == list(range(1000, 1007))


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_are_consistent(seed: int) -> None:
    """Every request emits exactly its tokens, in order, whatever the preemptions; the KV events
    replayed the router's way rebuild exactly the pool's cached blocks."""
    rng = random.Random(seed)
    config = SchedulerConfig(
        num_blocks=rng.randint(8, 40),
        block_size=rng.choice([1, 2, 4]),
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(4, 40),
        enable_chunked_prefill=rng.random() < 0.7,
        watermark=rng.choice([0.0, 0.1]),
        preemption_mode=rng.choice(["lifo", "fifo"]),
    )
    events: list[KvEvent] = []
    s = Scheduler(config, PolynomialPerfModel(), events.append)
    prefixes = [[rng.randrange(5) for _ in range(rng.randint(0, 12))] for _ in range(3)]
    expected: dict[str, list[int]] = {}
    for i in range(rng.randint(1, 15)):
        prompt = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randint(1, 10))]
        max_tokens = rng.randint(1, 12)
        try:
            s.add(req(f"r{i}", prompt, max_tokens, base=100 * i, prefilled=rng.random() < 0.2))
        except ValueError:
            continue  # could never fit this pool
        expected[f"r{i}"] = [100 * i + k for k in range(max_tokens)]
    got: dict[str, list[int]] = {rid: [] for rid in expected}
    for _ in range(5000):
        if not s.has_work:
            break
        for o in s.step().outputs:
            got[o.request_id].append(o.token_id)
            assert o.finished == (len(got[o.request_id]) == len(expected[o.request_id]))
    assert not s.has_work and got == expected
    assert (s.kv.num_active, s.kv.num_free) == (0, config.num_blocks)

    cached: set[int] = set()
    for event in events:
        assert event != "cleared"
        if event.stored is not None:
            assert event.stored.parent_hash is None or event.stored.parent_hash in cached
            for block in event.stored.blocks:
                assert block.block_hash not in cached
                cached.add(block.block_hash)
        else:
            assert event.removed is not None
            for h in event.removed.block_hashes:
                cached.remove(h)
    assert len(cached) == s.kv.num_inactive
    assert all(s.kv.match_prefix([h]) == 1 for h in cached)


def test_simulated_logprobs(tok) -> None:  # type: ignore[no-untyped-def]
    tokens = SyntheticTokens(tok, seed=0)
    prompt = [100, 200, 300]
    token = tokens.for_request(prompt)
    generated = [token(i) for i in range(50)]
    simulate = tokens.logprobs_for(prompt, None, 5)
    steps = [simulate(t) for t in generated]
    for t, (values, tops) in zip(generated, steps, strict=True):
        (value,), (top,) = values, tops
        assert [e.rank for e in top] == [1, 2, 3, 4, 5]
        assert (top[0].token_id, top[0].logprob) == (t, value)  # the generated token, the likeliest
        ids, logprobs = [e.token_id for e in top], [e.logprob for e in top]
        assert len(set(ids)) == 5 and set(ids) <= set(tokens.catalog)
        assert logprobs == sorted(logprobs, reverse=True)
        assert all(math.isfinite(v) and v <= 0 for v in logprobs)
        assert sum(math.exp(v) for v in logprobs) <= 1.0
    again = tokens.logprobs_for(prompt, None, 5)
    assert [again(t) for t in generated] == steps
    other = tokens.logprobs_for(prompt, 7, 5)
    assert [other(t) for t in generated] != steps
    alone = tokens.logprobs_for(prompt, None, 0)
    values, tops = alone(generated[0])
    assert msgspec.to_builtins(tops) == [[{"rank": 1, "token_id": generated[0], "token": None, "logprob": values[0]}]]


def test_synthetic_tokens_resume_like_a_greedy_model(tok) -> None:  # type: ignore[no-untyped-def]
    """A request resumed with its first k tokens appended to its prompt (a migration) generates exactly the
    rest of the sequence, logprobs included; another prompt or seed gives another sequence."""
    tokens = SyntheticTokens(tok, seed=0)
    prompt = [100, 200, 300]
    whole = [tokens.for_request(prompt)(i) for i in range(40)]
    simulate = tokens.logprobs_for(prompt, None, 3)
    whole_logprobs = [simulate(t) for t in whole]
    for k in (1, 17, 39):
        resumed = tokens.for_request(prompt + whole[:k])
        assert [resumed(i) for i in range(40 - k)] == whole[k:]
        simulate = tokens.logprobs_for(prompt + whole[:k], None, 3)
        assert [simulate(t) for t in whole[k:]] == whole_logprobs[k:]
    assert [tokens.for_request(prompt + [1])(i) for i in range(40)] != whole
    assert [tokens.for_request(prompt, 5)(i) for i in range(40)] != whole
