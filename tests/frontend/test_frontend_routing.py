"""Router modes and load-based rejection, without processes (through a real frontend and mocker workers:
test_routing_modes.py)."""

from __future__ import annotations

from collections import Counter

from tandem.frontend.routing import LoadMonitor, LoadThresholds, make_selector


def test_round_robin_cycles():
    selector = make_selector("round-robin", {})
    picks = [selector.select([1, 2, 3], None) for _ in range(6)]
    assert sorted(Counter(picks).values()) == [2, 2, 2] and picks[:3] != picks[1:4]


def test_least_loaded_picks_the_idle_worker():
    inflight = {1: 5, 2: 0, 3: 2}
    selector = make_selector("least-loaded", inflight)
    assert {selector.select([1, 2, 3], None) for _ in range(20)} == {2}


def test_power_of_two_never_picks_the_busiest_of_a_pair():
    inflight = {1: 9, 2: 0}
    selector = make_selector("power-of-two", inflight)
    assert {selector.select([1, 2], None) for _ in range(20)} == {2}


def test_random_uses_every_worker():
    selector = make_selector("random", {})
    assert {selector.select([1, 2, 3], None) for _ in range(200)} == {1, 2, 3}


def test_load_monitor_thresholds():
    monitor = LoadMonitor(LoadThresholds(decode_blocks=0.5, prefill_tokens=100))
    monitor.apply({"worker_id": 1, "kv_used_blocks": 60})
    monitor.apply({"worker_id": 2, "kv_used_blocks": 10})
    monitor.apply({"worker_id": 3, "active_decode_blocks": 51})  # a worker that reports no kv_used_blocks
    monitor.apply({"garbage": True})
    sent = monitor.prefill(2, 101)
    assert {w for w in (1, 2, 3, 4) if monitor.is_busy(w, total_blocks=100, max_batched_tokens=None)} == {1, 2, 3}
    sent.done()
    sent.done()  # at the first token and again at the end: counted off once
    assert not monitor.is_busy(2, total_blocks=100, max_batched_tokens=None)
    assert not monitor.is_busy(1, total_blocks=None, max_batched_tokens=None)  # no block count: no ratio
    assert not LoadMonitor(LoadThresholds()).is_busy(1, 100, 100)


def test_prompt_tokens_awaiting_their_first_token_are_summed_per_worker():
    monitor = LoadMonitor(LoadThresholds(prefill_tokens=500))
    under = monitor.prefill(1, 300)
    assert not monitor.is_busy(1, None, None)  # at or under the threshold: free
    over = monitor.prefill(1, 300)
    assert monitor.is_busy(1, None, None) and not monitor.is_busy(2, None, None)
    under.done()
    assert not monitor.is_busy(1, None, None)
    over.done()
    assert monitor.prefill_tokens == {}
    frac = LoadMonitor(LoadThresholds(prefill_tokens_frac=0.5))
    frac.prefill(1, 600)
    assert frac.is_busy(1, total_blocks=None, max_batched_tokens=1000)
    assert not frac.is_busy(1, total_blocks=None, max_batched_tokens=2000)
    assert not frac.is_busy(1, total_blocks=None, max_batched_tokens=None)  # the card does not say: never busy


def test_a_data_parallel_worker_is_busy_only_when_every_rank_is():
    monitor = LoadMonitor(LoadThresholds(decode_blocks=0.5))
    monitor.apply({"worker_id": 1, "dp_rank": 0, "kv_used_blocks": 90})
    monitor.apply({"worker_id": 1, "dp_rank": 1, "kv_used_blocks": 10})
    assert not monitor.is_busy(1, total_blocks=100, max_batched_tokens=None, dp_size=2)  # rank 1 has room
    monitor.apply({"worker_id": 1, "dp_rank": 1, "kv_used_blocks": 60})
    monitor.apply({"worker_id": 1, "dp_rank": 0, "kv_used_blocks": 20})  # the latest report is not the worker
    assert not monitor.is_busy(1, total_blocks=100, max_batched_tokens=None, dp_size=2)
    monitor.apply({"worker_id": 1, "dp_rank": 0, "kv_used_blocks": 70})
    assert monitor.is_busy(1, total_blocks=100, max_batched_tokens=None, dp_size=2)
    monitor.apply({"worker_id": 2, "dp_rank": 0, "kv_used_blocks": 90})  # its rank 1 has not reported: free
    assert not monitor.is_busy(2, total_blocks=100, max_batched_tokens=None, dp_size=2)
