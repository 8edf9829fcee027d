"""KV router cost function, worker selection, config and active-sequence tracking."""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter

import pytest

from tandem.router.config import KvRouterConfig, add_router_args, config_from_args
from tandem.router.selector import CostTerms, legacy_cost, select_worker, worker_costs
from tandem.router.sequences import ActiveSequences

B = 16
W1, W2, W3 = (1, 0), (2, 0), (3, 0)


# --- cost function ---------------------------------------------------------------------------------


def test_documented_legacy_example() -> None:
    costs = {W1: legacy_cost(8, 10), W2: legacy_cost(5, 5), W3: legacy_cost(2, 9)}
    assert costs == {W1: 18, W2: 10, W3: 11}
    assert select_worker(costs, 0.0, random.Random(0)) == W2


def test_documented_example_through_worker_costs() -> None:
    # A 10-block prompt; overlaps 2/5/8 leave 8/5/2 blocks to prefill on an idle prefill queue.
    loads = [
        CostTerms(W1, overlap_blocks=2, active_prefill_tokens=0, decode_blocks=10),
        CostTerms(W2, overlap_blocks=5, active_prefill_tokens=0, decode_blocks=5),
        CostTerms(W3, overlap_blocks=8, active_prefill_tokens=0, decode_blocks=9),
    ]
    costs = worker_costs(loads, 10 * B, B, KvRouterConfig(overlap_score_weight=1.0))
    assert costs == {W1: 18, W2: 10, W3: 11}
    assert select_worker(costs, 0.0, random.Random(0)) == W2


def test_legacy_formula_weight_and_queued_prefill() -> None:
    load = CostTerms(W1, overlap_blocks=1, active_prefill_tokens=2 * B, decode_blocks=3)
    # prefill = (2 queued + 4 - 1 cached) = 5 blocks
    assert worker_costs([load], 4 * B, B, KvRouterConfig(overlap_score_weight=2.0)) == {W1: 2 * 5 + 3}
    # weight 0: overlap and prefill are ignored, only decode load counts
    assert worker_costs([load], 4 * B, B, KvRouterConfig(overlap_score_weight=0.0)) == {W1: 3}
    # overlap longer than the prompt never makes prefill negative
    big = CostTerms(W1, overlap_blocks=9, active_prefill_tokens=0, decode_blocks=3)
    assert worker_costs([big], 4 * B, B, KvRouterConfig(overlap_score_weight=1.0)) == {W1: 3}


def test_credit_formula_hand_computed() -> None:
    # 4-block prompt, 2 blocks queued, 2 cached: raw prefill (32 + 64) / 16 = 6, minus 2 credit = 4.
    load = CostTerms(W1, overlap_blocks=2, active_prefill_tokens=32, decode_blocks=5, active_requests=3)
    assert worker_costs([load], 64, B, KvRouterConfig()) == {W1: 4 + 5}
    assert worker_costs([load], 64, B, KvRouterConfig(prefill_load_scale=2.0)) == {W1: 2 * 4 + 5}
    assert worker_costs([load], 64, B, KvRouterConfig(decode_active_request_weight=0.5)) == {W1: 4 + 5 + 1.5}
    assert worker_costs([load], 64, B, KvRouterConfig(overlap_score_credit=0.5)) == {W1: 5 + 5}
    # Credit beyond the raw prefill clamps at zero.
    cached = CostTerms(W1, overlap_blocks=10, active_prefill_tokens=0, decode_blocks=5)
    assert worker_costs([cached], 64, B, KvRouterConfig()) == {W1: 5}
    # Queued prefill is ignored when prefill tracking is off.
    assert worker_costs([load], 64, B, KvRouterConfig(track_prefill_tokens=False)) == {W1: 2 + 5}


def test_credit_decay_relative_to_least_loaded_worker() -> None:
    busy = CostTerms(W1, overlap_blocks=2, active_prefill_tokens=32, decode_blocks=5)
    idle = CostTerms(W2, overlap_blocks=2, active_prefill_tokens=0, decode_blocks=5)
    costs = worker_costs([busy, idle], 64, B, KvRouterConfig(overlap_score_credit_decay=1.0))
    # busy: 2 excess blocks over a 4-block request -> credit 1 / (1 + 1 * 2/4) = 2/3
    assert costs[W1] == pytest.approx(6 - 2 * (2 / 3) + 5)
    # idle is the load floor and keeps full credit: 4 - 2 + 5
    assert costs[W2] == pytest.approx(7)
    # no decay without prefill tracking
    flat = worker_costs([busy, idle], 64, B, KvRouterConfig(overlap_score_credit_decay=1.0, track_prefill_tokens=False))
    assert flat == {W1: 7, W2: 7}


def test_worker_costs_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError):
        worker_costs([], 64, 0, KvRouterConfig())


# --- selection -------------------------------------------------------------------------------------


def test_zero_temperature_tie_break_is_uniform_and_only_among_minimum() -> None:
    costs = {W1: 3.0, W2: 3.0, W3: 3.0, (4, 0): 3.5, (4, 1): 10.0}
    rng = random.Random(1234)
    picks = Counter(select_worker(costs, 0.0, rng) for _ in range(6000))
    assert set(picks) == {W1, W2, W3}
    for worker in (W1, W2, W3):
        assert picks[worker] / 6000 == pytest.approx(1 / 3, abs=0.03)


def test_zero_temperature_single_minimum_is_deterministic() -> None:
    rng = random.Random(5)
    assert {select_worker({W1: 2.0, W2: 1.0, W3: 1.5}, 0.0, rng) for _ in range(200)} == {W2}


def test_softmax_distribution_matches_formula() -> None:
    costs = {W1: 0.0, W2: 1.0, W3: 2.0}
    temperature = 0.5
    lo, hi = 0.0, 2.0
    weights = {w: math.exp((lo - c) / ((hi - lo) * temperature)) for w, c in costs.items()}
    total = sum(weights.values())
    rng = random.Random(42)
    draws = 40000
    picks = Counter(select_worker(costs, temperature, rng) for _ in range(draws))
    for worker, weight in weights.items():
        assert picks[worker] / draws == pytest.approx(weight / total, abs=0.015)


def test_softmax_equal_costs_is_uniform() -> None:
    rng = random.Random(7)
    picks = Counter(select_worker({W1: 4.0, W2: 4.0}, 1.0, rng) for _ in range(4000))
    assert picks[W1] / 4000 == pytest.approx(0.5, abs=0.03)


def test_select_worker_errors() -> None:
    with pytest.raises(ValueError):
        select_worker({}, 0.0, random.Random())
    with pytest.raises(ValueError):
        select_worker({W1: 1.0}, -1.0, random.Random())


# --- per-request overrides -------------------------------------------------------------------------


def test_overrides() -> None:
    base = KvRouterConfig()
    assert base.with_overrides(None) is base
    assert base.with_overrides({}) is base
    cfg = base.with_overrides({"overlap_score_weight": 0, "overlap_score_credit": 0.5,
                               "router_temperature": 0.7, "prefill_load_scale": 2, "unknown": "x"})
    assert (cfg.overlap_score_weight, cfg.overlap_score_credit, cfg.temperature, cfg.prefill_load_scale) == (
        0.0, 0.5, 0.7, 2.0)
    assert base.with_overrides({"temperature": 1.5}).temperature == 1.5
    assert base.with_overrides({"router_temperature": None}) is base
    assert base.temperature == 0.0 and base.overlap_score_weight is None  # original untouched
    for bad in ({"router_temperature": -1}, {"overlap_score_credit": "high"}, {"prefill_load_scale": True},
                {"overlap_score_weight": float("nan")}):
        key = next(iter(bad))
        with pytest.raises(ValueError, match=key):
            base.with_overrides(bad)


# --- flags and env -----------------------------------------------------------------------------------

ROUTER_ENVS = (
    "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY",
    "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "DYN_OVERLAP_SCORE_WEIGHT", "DYN_KV_OVERLAP_SCORE_WEIGHT",
    "DYN_ROUTER_PREFILL_LOAD_SCALE", "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT", "DYN_ROUTER_TEMPERATURE",
    "DYN_ROUTER_USE_KV_EVENTS", "DYN_KV_EVENTS", "DYN_ROUTER_TTL_SECS", "DYN_ROUTER_REPLICA_SYNC",
    "DYN_ROUTER_TRACK_ACTIVE_BLOCKS", "DYN_ROUTER_ASSUME_KV_REUSE", "DYN_ROUTER_TRACK_PREFILL_TOKENS",
    "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS", "DYN_ROUTER_EVENT_CATCH_UP_SECS",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ROUTER_ENVS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def parse(*argv: str) -> KvRouterConfig:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_defaults(clean_env: pytest.MonkeyPatch) -> None:
    assert parse() == KvRouterConfig()
    assert KvRouterConfig().max_tree_size == 2**20 and KvRouterConfig().active_request_expiry_secs == 300.0


def test_flags(clean_env: pytest.MonkeyPatch) -> None:
    cfg = parse("--router-kv-overlap-score-credit", "0.5", "--router-kv-overlap-score-credit-decay", "2",
                "--router-prefill-load-scale", "1.5", "--router-decode-active-request-weight", "0.25",
                "--router-temperature", "0.3", "--no-router-kv-events", "--router-ttl-secs", "30",
                "--router-replica-sync", "--no-router-track-active-blocks", "--no-router-assume-kv-reuse",
                "--no-router-track-prefill-tokens")
    assert cfg == KvRouterConfig(
        overlap_score_credit=0.5, overlap_score_credit_decay=2.0, prefill_load_scale=1.5,
        decode_active_request_weight=0.25, temperature=0.3, use_kv_events=False, ttl_secs=30.0,
        replica_sync=True, track_active_blocks=False, assume_kv_reuse=False, track_prefill_tokens=False)


def test_legacy_aliases(clean_env: pytest.MonkeyPatch) -> None:
    assert parse("--kv-overlap-score-weight", "0").overlap_score_weight == 0.0
    assert parse("--router-kv-overlap-score-weight", "2").overlap_score_weight == 2.0
    assert parse("--no-kv-events").use_kv_events is False
    assert parse("--router-kv-events").use_kv_events is True
    assert parse("--router-ttl", "5").ttl_secs == 5.0
    assert parse("--no-track-active-blocks").track_active_blocks is False


def test_env_fallbacks_and_cli_precedence(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("DYN_ROUTER_TEMPERATURE", "0.9")
    clean_env.setenv("DYN_ROUTER_USE_KV_EVENTS", "false")
    clean_env.setenv("DYN_OVERLAP_SCORE_WEIGHT", "3")
    clean_env.setenv("DYN_ROUTER_TTL_SECS", "60")
    clean_env.setenv("DYN_ROUTER_REPLICA_SYNC", "1")
    clean_env.setenv("DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS", "30")
    clean_env.setenv("DYN_ROUTER_EVENT_CATCH_UP_SECS", "0")
    cfg = parse()
    assert (cfg.temperature, cfg.use_kv_events, cfg.overlap_score_weight, cfg.ttl_secs, cfg.replica_sync,
            cfg.active_request_expiry_secs, cfg.event_catch_up_secs) == (0.9, False, 3.0, 60.0, True, 30.0, 0.0)
    cfg = parse("--router-temperature", "0", "--router-kv-events", "--no-router-replica-sync")
    assert (cfg.temperature, cfg.use_kv_events, cfg.replica_sync) == (0.0, True, False)
    # the current env name wins over the legacy one
    clean_env.setenv("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "1")
    assert parse().overlap_score_weight == 1.0


@pytest.mark.parametrize(("argv", "env", "named"), [
    (("--router-temperature", "-0.1"), {}, "--router-temperature"),
    (("--router-ttl-secs", "0"), {}, "--router-ttl-secs"),
    (("--router-kv-overlap-score-credit", "-1"), {}, "--router-kv-overlap-score-credit"),
    (("--router-prefill-load-scale", "inf"), {}, "--router-prefill-load-scale"),
    (("--kv-overlap-score-weight", "-2"), {}, "--router-kv-overlap-score-weight"),
    ((), {"DYN_ROUTER_TEMPERATURE": "-1"}, "DYN_ROUTER_TEMPERATURE"),
    ((), {"DYN_ROUTER_TTL_SECS": "soon"}, "DYN_ROUTER_TTL_SECS"),
    ((), {"DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS": "0"}, "DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS"),
    ((), {"DYN_ROUTER_EVENT_CATCH_UP_SECS": "-1"}, "DYN_ROUTER_EVENT_CATCH_UP_SECS"),
])
def test_validation_errors_name_the_setting(
    clean_env: pytest.MonkeyPatch, argv: tuple[str, ...], env: dict[str, str], named: str
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=named):
        parse(*argv)


def test_help_mentions_env(clean_env: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    text = parser.format_help()
    for flag in ("--router-temperature", "--no-router-kv-events", "--no-kv-events", "DYN_ROUTER_TTL_SECS"):
        assert flag in text


# --- active sequences --------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_shared_prefix_blocks_count_once() -> None:
    seqs = ActiveSequences(B)
    seqs.add_request("a", W1, [1, 2, 3], isl=3 * B, overlap_blocks=0)
    seqs.add_request("b", W1, [1, 2, 4, 5], isl=4 * B, overlap_blocks=2)
    assert seqs.active_blocks(W1) == 5
    assert seqs.active_requests(W1) == 2
    assert seqs.active_prefill_tokens(W1) == 3 * B + 2 * B
    seqs.free("a")
    assert seqs.active_blocks(W1) == 4  # 1 and 2 still held by b
    seqs.free("b")
    assert (seqs.active_blocks(W1), seqs.active_requests(W1), seqs.active_prefill_tokens(W1)) == (0, 0, 0)
    seqs.free("b")  # idempotent
    seqs.free("never-seen")


def test_workers_and_dp_ranks_are_separate() -> None:
    seqs = ActiveSequences(B)
    seqs.add_request("a", (1, 0), [1, 2], isl=2 * B, overlap_blocks=0)
    seqs.add_request("b", (1, 1), [1, 2], isl=2 * B, overlap_blocks=0)
    assert seqs.active_blocks((1, 0)) == seqs.active_blocks((1, 1)) == 2
    assert seqs.request_worker("b") == (1, 1)
    assert seqs.request_worker("zzz") is None


def test_prefill_marking_is_idempotent_and_free_after_it() -> None:
    seqs = ActiveSequences(B)
    seqs.add_request("a", W1, [1, 2], isl=40, overlap_blocks=1)  # 40 - 16 = 24 tokens to prefill
    seqs.add_request("b", W1, None, isl=10, overlap_blocks=3)  # overlap beyond the prompt: 0
    assert seqs.active_prefill_tokens(W1) == 24
    assert seqs.active_blocks(W1) == 2  # None = block tracking off
    seqs.mark_prefill_completed("a")
    seqs.mark_prefill_completed("a")
    seqs.mark_prefill_completed("unknown")
    assert seqs.active_prefill_tokens(W1) == 0
    assert seqs.active_blocks(W1) == 2
    seqs.free("a")
    assert seqs.active_prefill_tokens(W1) == 0 and seqs.active_blocks(W1) == 0


def test_new_blocks() -> None:
    seqs = ActiveSequences(B)
    assert seqs.new_blocks(W1, [1, 2, 3]) == 3
    seqs.add_request("a", W1, [1, 2], isl=2 * B, overlap_blocks=0)
    assert seqs.new_blocks(W1, [1, 2, 3, 4]) == 2
    assert seqs.new_blocks(W2, [1, 2]) == 2


def test_readding_a_request_replaces_it() -> None:
    seqs = ActiveSequences(B)
    seqs.add_request("a", W1, [1, 2], isl=2 * B, overlap_blocks=0)
    seqs.add_request("a", W2, [3], isl=B, overlap_blocks=0)
    assert (seqs.active_requests(W1), seqs.active_blocks(W1), seqs.active_prefill_tokens(W1)) == (0, 0, 0)
    assert (seqs.active_requests(W2), seqs.active_blocks(W2), seqs.request_worker("a")) == (1, 1, W2)


def test_remove_worker_drops_every_dp_rank() -> None:
    seqs = ActiveSequences(B)
    seqs.add_request("a", (1, 0), [1], isl=B, overlap_blocks=0)
    seqs.add_request("b", (1, 1), [2], isl=B, overlap_blocks=0)
    seqs.add_request("c", (2, 0), [1], isl=B, overlap_blocks=0)
    seqs.remove_worker(1)
    assert "a" not in seqs and "b" not in seqs and "c" in seqs
    assert seqs.active_blocks((1, 0)) == seqs.active_blocks((1, 1)) == 0
    assert seqs.active_blocks((2, 0)) == 1
    seqs.remove_worker(99)  # unknown: no-op


def test_sweep_frees_only_stale_requests() -> None:
    clock = FakeClock()
    seqs = ActiveSequences(B, clock=clock)
    seqs.add_request("old", W1, [1, 2], isl=2 * B, overlap_blocks=0)
    clock.now += 200
    seqs.add_request("mid", W1, [1, 3], isl=2 * B, overlap_blocks=0)
    clock.now += 100
    seqs.add_request("new", W2, [4], isl=B, overlap_blocks=0)
    clock.now += 50
    assert seqs.sweep(300.0) == ["old"]  # 350 s old; mid is 150 s
    assert seqs.active_blocks(W1) == 2 and seqs.active_prefill_tokens(W1) == 2 * B
    assert seqs.sweep(300.0) == []
    assert seqs.sweep(100.0) == ["mid"]
    assert len(seqs) == 1 and seqs.active_blocks(W1) == 0
