"""A worker's KV cache load, as every worker kind reports it: `ActiveLoad` on the `kv_metrics` topic (the
frontend's busy thresholds and the KV router read it) and the `dynamo_component_kvstats_*` gauges."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Gauge

from tandem.router.protocols import ActiveLoad
from tandem.router.publisher import SupportsPublish

log = logging.getLogger(__name__)


class KvGauges:
    """`dynamo_component_kvstats_*{dp_rank}`, created once per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.total_blocks = _gauge(
            registry, "dynamo_component_kvstats_total_blocks", "Total number of KV cache blocks available on the worker"
        )
        self.gpu_cache_usage_percent = _gauge(
            registry, "dynamo_component_kvstats_gpu_cache_usage_percent",
            "Fraction of the worker's KV cache blocks in use (0.0-1.0)",
        )


def _gauge(registry: CollectorRegistry, name: str, documentation: str) -> Gauge:
    try:
        return Gauge(name, documentation, ["dp_rank"], registry=registry, multiprocess_mode="max")
    except ValueError:  # registered by someone else in this registry: reuse it
        existing = registry._names_to_collectors.get(name)  # noqa: SLF001
        if isinstance(existing, Gauge):
            return existing
        raise


_gauges: weakref.WeakKeyDictionary[CollectorRegistry, KvGauges] = weakref.WeakKeyDictionary()
_gauges_lock = threading.Lock()


def kv_gauges(registry: CollectorRegistry) -> KvGauges:
    with _gauges_lock:
        gauges = _gauges.get(registry)
        if gauges is None:
            gauges = _gauges[registry] = KvGauges(registry)
        return gauges


PublisherProvider = SupportsPublish | Callable[[], SupportsPublish | None] | None


class KvMetricsStatLogger:
    """A worker's KV load: publishes `ActiveLoad` on `kv_metrics` and keeps the `dynamo_component_kvstats_*`
    gauges. It has vLLM's per-engine stat logger interface (`StatLoggerBase`, as which the vLLM worker
    registers it); a simulated engine calls `record_usage` itself.

    The publisher may arrive after construction (`set_publisher`), since vLLM builds its loggers
    inside `AsyncLLM.from_vllm_config`, before the worker has finished its own setup; likewise the
    block count (`set_num_gpu_blocks`, else read from the config when the engine is initialized).
    Publishes only when the value changes, or every `republish_interval` seconds while recording.
    """

    def __init__(
        self,
        vllm_config: Any = None,
        engine_index: int = 0,
        *,
        worker_id: int,
        dp_rank: int = 0,
        registry: CollectorRegistry | None = None,
        publisher: PublisherProvider = None,
        republish_interval: float | None = 10.0,
    ) -> None:
        self.vllm_config = vllm_config
        self.engine_index = engine_index
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.num_gpu_blocks = 0
        self.republish_interval = republish_interval
        self._provider: PublisherProvider = publisher
        self._gauges = kv_gauges(registry) if registry is not None else None
        self._labels = {"dp_rank": str(dp_rank)}
        self.active_blocks: int | None = None
        self.kv_cache_usage = 0.0
        self._published: int | None = None
        self._published_at = 0.0

    # -- wiring ----------------------------------------------------------------------------------
    @property
    def publisher(self) -> SupportsPublish | None:
        provider = self._provider
        if provider is None or hasattr(provider, "publish"):
            return provider
        return provider()

    def set_publisher(self, publisher: PublisherProvider) -> None:
        """Set (or replace) the publisher; the current value, if any, is published at once."""
        self._provider = publisher
        if self.active_blocks is not None:
            self._maybe_publish(force=True)

    def bind(self, worker_id: int, registry: CollectorRegistry) -> None:
        """The worker's id and metrics registry, for a logger made before the worker had them (a vLLM engine
        created before the runtime, in checkpoint mode)."""
        self.worker_id = worker_id
        self._gauges = kv_gauges(registry)

    def set_num_gpu_blocks(self, num_gpu_blocks: int | None) -> None:
        self.num_gpu_blocks = int(num_gpu_blocks or 0)
        if self._gauges is not None:
            self._gauges.total_blocks.labels(**self._labels).set(self.num_gpu_blocks)

    def init_publish(self) -> None:
        """Publish 0 used blocks and zero the usage gauge (the total is the known block count, 0
        before `set_num_gpu_blocks`)."""
        self.active_blocks = 0
        self.kv_cache_usage = 0.0
        if self._gauges is not None:
            self._gauges.total_blocks.labels(**self._labels).set(self.num_gpu_blocks)
            self._gauges.gpu_cache_usage_percent.labels(**self._labels).set(0.0)
        self._maybe_publish(force=True)

    # -- vLLM StatLoggerBase ---------------------------------------------------------------------
    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any = None,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        self.record_usage(float(getattr(scheduler_stats, "kv_cache_usage", 0.0) or 0.0))

    def record_usage(self, usage: float) -> None:
        """The fraction of KV blocks in use (vLLM's `kv_cache_usage`, or a simulated engine's)."""
        self.kv_cache_usage = usage
        self.active_blocks = int(self.num_gpu_blocks * usage)
        if self._gauges is not None:
            self._gauges.total_blocks.labels(**self._labels).set(self.num_gpu_blocks)
            self._gauges.gpu_cache_usage_percent.labels(**self._labels).set(usage)
        self._maybe_publish()

    def log_engine_initialized(self) -> None:
        if not self.num_gpu_blocks:
            cache_config = getattr(self.vllm_config, "cache_config", None)
            blocks = getattr(cache_config, "num_gpu_blocks", None)
            if blocks:
                self.set_num_gpu_blocks(blocks)

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int = 0, level: int = 0) -> None:
        pass

    # -- publishing ------------------------------------------------------------------------------
    def _maybe_publish(self, force: bool = False) -> None:
        active = self.active_blocks
        if active is None:
            return
        now = time.monotonic()
        if not force and active == self._published and (
            self.republish_interval is None or now - self._published_at < self.republish_interval
        ):
            return
        try:
            publisher = self.publisher
        except Exception as e:
            log.debug("KV metrics publisher not available: %s", e)
            return
        if publisher is None:
            return
        load = ActiveLoad(
            worker_id=self.worker_id, dp_rank=self.dp_rank, kv_used_blocks=active, active_decode_blocks=active
        )
        try:
            sent = publisher.publish(msgspec.to_builtins(load))
        except Exception as e:  # a metrics hiccup must not disturb the engine's output loop
            log.warning("publishing KV metrics failed: %s", e)
            return
        if sent is not False:
            self._published = active
            self._published_at = now
