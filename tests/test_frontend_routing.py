"""Router modes and load-based rejection, without processes."""

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
    monitor.apply({"worker_id": 1, "kv_used_blocks": 60, "active_prefill_tokens": 0})
    monitor.apply({"worker_id": 2, "kv_used_blocks": 10, "active_prefill_tokens": 500})
    monitor.apply({"worker_id": 3, "kv_used_blocks": 10, "active_prefill_tokens": 10})
    monitor.apply({"garbage": True})
    busy = {w for w in (1, 2, 3, 4) if monitor.is_busy(w, total_blocks=100, max_batched_tokens=None)}
    assert busy == {1, 2}  # 4 never reported: not busy
    frac = LoadMonitor(LoadThresholds(prefill_tokens_frac=0.5))
    frac.apply({"worker_id": 1, "active_prefill_tokens": 600})
    assert frac.is_busy(1, total_blocks=None, max_batched_tokens=1000)
    assert not frac.is_busy(1, total_blocks=None, max_batched_tokens=2000)
    assert not LoadMonitor(LoadThresholds()).is_busy(1, 100, 100)
