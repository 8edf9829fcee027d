"""The mocker's simulated offload tiers (host memory, disk): offload on eviction, onboarding instead of
recomputing, tier-tagged events that keep a router's index equal to what the engine holds, the KVBM
counters, the flags; and end to end, a frontend routing by tier finding prefixes its workers evicted,
on the ZMQ and on the NATS (JetStream) event plane."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tandem.mocker.args import parse_args
from tandem.mocker.offload import KvbmMetrics, OffloadConfig, OffloadTiers
from tandem.mocker.scheduler import Scheduler, SchedulerConfig, SimRequest
from tandem.router.consolidator import KvEventConsolidator
from tandem.router.hashing import local_block_hashes, sequence_hashes
from tandem.router.indexer import KvIndexer
from tandem.router.protocols import KvCacheEvent, RouterEvent
from tests.mocker.test_mocker_core import RecordingPerf
from tests.support.deployment import MODEL, Deployment, metric_sum, wait_for_kv_events
from tests.support.processes import TandemProcess

BS = 4
BLOCK_BYTES = 1_000_000  # 1 MB blocks: 14 GB/s host → ~0.071 ms a block, 2 GB/s disk → 0.5 ms


class Engine:
    """A scheduler with a pool of `pool` blocks and offload tiers, its events consolidated into a
    router's indexer as a worker publishes them."""

    def __init__(self, pool: int = 8, host: int = 8, disk: int = 16) -> None:
        self.indexer = KvIndexer()
        self.next_id = 0
        consolidator = KvEventConsolidator(self._publish)
        self.registry = CollectorRegistry()
        self.tiers = OffloadTiers(OffloadConfig(host, disk, 14.0, 2.0, BLOCK_BYTES), BS,
                                  lambda data, tier: consolidator.apply("tiers", tier, data),
                                  KvbmMetrics(self.registry).of(0))
        self.perf = RecordingPerf()
        self.scheduler = Scheduler(SchedulerConfig(num_blocks=pool, block_size=BS), self.perf,
                                   lambda data: consolidator.apply("pool", "device", data), self.tiers)
        self.prefill_ms: list[float] = []

    def _publish(self, data: object, tier: str) -> None:
        event = RouterEvent(1, KvCacheEvent(self.next_id, data), tier)  # type: ignore[arg-type]
        assert self.indexer.apply_event(event) is None
        self.next_id += 1

    def run(self, rid: str, prompt: list[int]) -> int:
        """Serve one request to the end; its cached tokens."""
        self.scheduler.add(SimRequest(rid, prompt, 1, lambda i: 9000 + i))
        cached = None
        while self.scheduler.has_work:
            result = self.scheduler.step()
            self.prefill_ms.append(result.prefill_ms)
            for out in result.outputs:
                if out.cached_tokens is not None:
                    cached = out.cached_tokens
        assert cached is not None
        return cached

    def metric(self, name: str) -> float:
        return self.registry.get_sample_value(name, {"dp_rank": "0"}) or 0.0

    def held(self, prompt: list[int]) -> tuple[int, int, int]:
        """(device, host, disk) blocks of `prompt` the engine holds, continuing each other."""
        seq = sequence_hashes(local_block_hashes(prompt, BS))
        device = self.scheduler.kv.match_prefix(seq)
        onboard = self.tiers.lookup(seq[device:])
        return device, onboard.host, onboard.disk

    def router_view(self, prompt: list[int]) -> tuple[int, int, int]:
        local = local_block_hashes(prompt, BS)
        device = self.indexer.find_matches(local).scores
        tiers = self.indexer.lower.overlaps(sequence_hashes(local), device)
        worker = (1, 0)
        return device.get(worker, 0), tiers.host.get(worker, 0), tiers.disk.get(worker, 0)


def _prompt(n: int, blocks: int = 6) -> list[int]:
    return [1000 * n + i for i in range(blocks * BS + 1)]


def test_evicted_blocks_are_onboarded_from_host_memory_instead_of_recomputed() -> None:
    engine = Engine()
    a, b = _prompt(1), _prompt(2)
    assert engine.run("a1", a) == 0
    assert engine.run("b1", b) == 0  # evicts a's blocks: to host memory
    assert engine.metric("kvbm_offload_blocks_d2h_total") > 0
    assert engine.held(a)[1] > 0
    engine.perf.prefill.clear()
    engine.prefill_ms.clear()
    cached = engine.run("a2", a)
    assert cached == 6 * BS  # every full block, loaded from host memory (as vLLM counts external hits)
    assert engine.perf.prefill == [1]  # only the last token computed
    onboarded = engine.metric("kvbm_onboard_blocks_h2d_total")
    assert onboarded >= 1 and engine.metric("kvbm_matched_tokens_total") == onboarded * BS
    # the load's time is in the step: prefill_ms = 1 token + blocks * 1 MB / 14 GB/s
    assert engine.prefill_ms[0] == pytest.approx(1 + onboarded * BLOCK_BYTES / 14e6)
    assert 0 < engine.metric("kvbm_host_cache_hit_rate") <= 1


def test_blocks_the_host_tier_evicts_go_to_disk_and_load_from_there() -> None:
    engine = Engine(pool=8, host=8, disk=32)
    first = _prompt(1)
    engine.run("first", first)
    for n in range(2, 6):  # enough traffic to push `first` out of host memory
        engine.run(f"fill{n}", _prompt(n))
    assert engine.metric("kvbm_offload_blocks_h2d_total") > 0
    device, host, disk = engine.held(first)
    assert device == 0 and disk > 0
    assert engine.run("again", first) == 6 * BS
    assert engine.metric("kvbm_onboard_blocks_d2d_total") == disk
    assert engine.metric("kvbm_disk_cache_hit_rate") > 0


def test_a_full_tier_keeps_the_first_blocks_of_a_chain() -> None:
    """A chain is looked up from its first block: a full host tier sends a chain's last blocks to disk first,
    so what it keeps is still a prefix (host, then disk, finds the whole chain)."""
    tiers = OffloadTiers(OffloadConfig(host_blocks=4, disk_blocks=16, block_bytes=1), BS)
    tiers.offload([(13, 3, 12), (12, 2, 11), (11, 1, None)])  # the pool evicts leaves first: a3, a2, a1
    tiers.offload([(23, 3, 22), (22, 2, 21), (21, 1, None)])  # then b3, b2, b1
    found = tiers.lookup([11, 12, 13])
    assert (found.host, found.disk) == (1, 2)
    assert sorted(tiers.host.blocks) == [11, 21, 22, 23]


def test_the_routers_index_follows_every_tier_of_the_engine() -> None:
    """After a random mix of requests the router's view (device match, then host, then disk) of every prompt
    equals what the engine holds: the tier events, their order (a tier's store before the pool's removal)
    and the consolidator keep them equal."""
    import random

    rng = random.Random(7)
    engine = Engine(pool=10, host=12, disk=20)
    prompts = [_prompt(n, blocks=rng.randint(2, 7)) for n in range(8)]
    for i in range(60):
        prompt = rng.choice(prompts)
        engine.run(f"r{i}", prompt[: rng.randint(BS + 1, len(prompt))])
        for p in prompts:
            assert engine.router_view(p) == engine.held(p), (i, p[0])
    assert engine.indexer.lower.blocks_dropped == 0


def test_tier_flags(capsys: pytest.CaptureFixture[str]) -> None:
    config = parse_args(["--num-g2-blocks", "64", "--num-g3-blocks", "128", "--bandwidth-g3-to-g1-gbps", "4",
                         "--kv-bytes-per-token", "1000", "--block-size", "16"])
    assert config.offload() == OffloadConfig(64, 128, 14.0, 4.0, 16_000)
    assert not parse_args([]).offload().enabled
    for bad, message in ((["--num-g3-blocks", "8"], "set --num-g2-blocks too"),
                         (["--num-g2-blocks", "-1"], "--num-g2-blocks must not be negative"),
                         (["--num-g2-blocks", "4", "--bandwidth-g2-to-g1-gbps", "0"], "--bandwidth-g2-to-g1-gbps must be positive")):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert message in capsys.readouterr().err


# --- end to end ----------------------------------------------------------------------------------------

BLOCK = 16
# 3 dp ranks of one mocker worker, each a pool of 24 blocks: a conversation's first turn (10-13 blocks) and
# a filler (20 blocks) do not fit together, two fillers push the whole turn to host memory (48 blocks), five
# push it on to disk (96 blocks).
MOCKER = ["--block-size", str(BLOCK), "--speedup-ratio", "100", "--data-parallel-size", "3",
          "--num-gpu-blocks-override", "24", "--num-g2-blocks", "48", "--num-g3-blocks", "96"]
ROUTER = ["--router-mode", "kv", "--router-predicted-ttl-secs", "0"]
DEVICE_ONLY = [*ROUTER, "--router-host-cache-hit-weight", "0", "--router-disk-cache-hit-weight", "0"]
TIER_HITS = "dynamo_router_tier_hit_blocks_total"


def _text(tag: str, words: int) -> str:
    return f"{tag}: " + " ".join(f"{tag}-{i}" for i in range(words))


@pytest.fixture(params=["zmq", "nats"])
def tiered(request: pytest.FixtureRequest, tmp_path: Path, smollm2: str) -> Iterator[Deployment]:
    """A tier-aware frontend (the deployment's) and a device-only one (`deployment.device_only`) over the
    mocker; `nats`: the NATS event plane, the workers' events durable in JetStream."""
    engine, env, frontend = list(MOCKER), {}, list(ROUTER)
    if request.param == "nats":
        nats = request.getfixturevalue("nats")
        env = {"DYN_EVENT_PLANE": "nats", "NATS_SERVER": nats.url}
        engine.append("--durable-kv-events")
        frontend.append("--router-durable-kv-events")
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[engine],
                            frontend_args=frontend, env=env)
    device_only = None
    try:
        device_only = TandemProcess("tandem.frontend", "--http-host", "127.0.0.1", "--http-port", "0",
                                    "--discovery-backend", "file", *DEVICE_ONLY, env=deployment.env)
        deployment.device_only = device_only.ready[0]  # type: ignore[attr-defined]
        deployment.wait_for_instances(1, url=deployment.device_only)  # type: ignore[attr-defined]
        yield deployment
    finally:
        if device_only is not None:
            device_only.stop()
        deployment.stop()


def _ask(url: str, prompt: str, rank: int | None = None) -> dict:
    """A completion (its routing decision in its `nvext`)."""
    headers = {"x-dynamo-session-id": "agent-1"}  # one session: equal costs go to one rank, the same each time
    if rank is not None:
        headers["x-dynamo-dp-rank"] = str(rank)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "nvext": {"extra_fields": ["worker_id", "routing"]}}
    reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tier_aware_routing_finds_the_prefixes_workers_evicted(tiered: Deployment) -> None:
    """A conversation's first turn on rank 1 or 2, then fillers there evict it to host memory (or on to
    disk). Its next turn, routed by a frontend crediting the tiers, goes back to that rank and
    loads the prefix; routed by one counting the device tier alone, it lands where the session's ties go (rank
    0) and recomputes it."""
    urls = {"tier-aware": tiered.url, "device-only": tiered.device_only}  # type: ignore[attr-defined]
    hits: dict[str, list[int]] = {name: [] for name in urls}
    for name, url in urls.items():
        for n, fillers in enumerate((2, 2, 5)):
            rank = 1 + n % 2
            first = _text(f"{name[0]}c{n}", 36)  # 173-209 tokens
            assert _cached(_ask(url, first, rank)) == 0
            for f in range(fillers):
                _ask(url, _text(f"{name[0]}f{n}x{f}", 46), rank)  # 317 tokens
            emitted = tiered.kv_events_emitted()
            for frontend in urls.values():
                wait_for_kv_events(frontend, emitted)
            reply = _ask(url, f"{first} and then")
            hits[name].append(_cached(reply))
            decode = reply["nvext"]["routing"]["decode"]
            assert reply["nvext"]["worker_id"]["decode_dp_rank"] == decode["dp_rank"]
            if name == "tier-aware":  # the rank holding it, for the blocks it holds in host memory or on disk
                lower = decode["cached_blocks"]["host_pinned"] + decode["cached_blocks"]["disk"]
                assert decode["dp_rank"] == rank and decode["cached_blocks"]["device"] == 0 and lower >= 8, decode
                assert decode["credit_blocks"] == {"device": 0, "host_pinned": 0.75 * decode["cached_blocks"]["host_pinned"],
                                                   "disk": 0.25 * decode["cached_blocks"]["disk"]}
            else:  # blind to them: the session's rank for equal costs
                assert decode["dp_rank"] == 0 and decode["credit_blocks"] == {"device": 0, "host_pinned": 0, "disk": 0}
    assert all(cached >= 8 * BLOCK for cached in hits["tier-aware"]), hits
    assert hits["device-only"] == [0, 0, 0], hits
    metrics = tiered.metrics()
    assert metric_sum(metrics, TIER_HITS, tier="host_pinned") > 0
    assert metric_sum(metrics, TIER_HITS, tier="disk") > 0
