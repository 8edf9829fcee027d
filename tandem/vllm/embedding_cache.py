"""The multimodal embedding cache (`--multimodal-embedding-cache-capacity-gb`): an encoder-cache connector in
the `ec_both` role that keeps the encoder outputs of recent images in host memory, so an image seen again
after the engine's own encoder cache dropped it is loaded instead of encoded again.

vLLM asks a connector about an image only when its own (device) encoder cache misses. The scheduler side of
the connector keeps the LRU order and the bytes used, and tells the worker side what to load, save and drop in
each step's metadata; the worker side holds the tensors and only obeys. Images are keyed by vLLM's multimodal
identifier, which the tandem worker sets to the image's content digest, so equal images share one entry
whatever their URL. Hits, stores and evictions are counted on vLLM's Prometheus page."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from tandem.vllm.encoder_cache import CAPACITY_KEY

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

_COUNTS = ("hits", "stores", "evictions")


@dataclass
class EmbeddingCacheMetadata(ECConnectorMetadata):
    """One step's orders from the scheduler side to the worker side, by image identifier."""

    loads: list[str] = field(default_factory=list)
    saves: list[str] = field(default_factory=list)
    evicts: list[str] = field(default_factory=list)


@dataclass
class EmbeddingCacheStats(ECConnectorStats):
    """Counts since the last report, and the bytes held when it was taken."""

    def __post_init__(self) -> None:
        for name in _COUNTS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = {name: 0 for name in _COUNTS}

    def aggregate(self, other: ECConnectorStats) -> EmbeddingCacheStats:
        merged = {name: self.data.get(name, 0) + other.data.get(name, 0) for name in _COUNTS}
        merged["bytes"] = other.data.get("bytes", self.data.get("bytes", 0))
        return EmbeddingCacheStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in _COUNTS)


class EmbeddingCachePromMetrics(ECConnectorPromMetrics):
    def __init__(self, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        about = {"hits": "images whose encoder output the embedding cache supplied",
                 "stores": "encoder outputs the embedding cache took in",
                 "evictions": "encoder outputs the embedding cache dropped for room"}
        self._counters = {name: create_metric_per_engine(self._counter_cls(
            name=f"vllm:multimodal_embedding_cache_{name}", documentation=text, labelnames=labelnames),
            per_engine_labelvalues) for name, text in about.items()}
        self._bytes = create_metric_per_engine(self._gauge_cls(
            name="vllm:multimodal_embedding_cache_bytes", documentation="bytes of encoder output the cache holds",
            labelnames=labelnames, multiprocess_mode="mostrecent"), per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, counters in self._counters.items():
            if transfer_stats_data.get(name):
                counters[engine_idx].inc(transfer_stats_data[name])
        if "bytes" in transfer_stats_data:
            self._bytes[engine_idx].set(transfer_stats_data["bytes"])


class EmbeddingCacheConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config or {}  # type: ignore[union-attr]
        if CAPACITY_KEY not in extra:
            raise ValueError(f"EmbeddingCacheConnector needs {CAPACITY_KEY} in ec_connector_extra_config")
        self._capacity = int(float(extra[CAPACITY_KEY]) * 1024**3)
        model = vllm_config.model_config
        self._bytes_per_embed = model.get_inputs_embeds_size() * torch.tensor([], dtype=model.dtype).element_size()
        self._device = vllm_config.device_config.device
        # scheduler side: identifier -> bytes, least recently used first; this step's orders; counts
        self._order: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._step = EmbeddingCacheMetadata()
        self._stats = EmbeddingCacheStats()
        # worker side: identifier -> encoder output on the host
        self._store: dict[str, torch.Tensor] = {}

    # -- scheduler side ----------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        """Asked only after the engine's own encoder cache missed: a hit is loaded instead of encoded."""
        if identifier not in self._order:
            return False
        self._order.move_to_end(identifier)
        return True

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """The image got room in the engine's encoder cache: load it if held here, else keep it once encoded
        (making room by dropping the least recently used; an image larger than the whole cache is not kept)."""
        identifier = request.mm_features[index].identifier
        if identifier in self._order:
            self._order.move_to_end(identifier)
            self._step.loads.append(identifier)
            self._stats.data["hits"] += 1
            return
        size = request.get_num_encoder_embeds(index) * self._bytes_per_embed
        if size > self._capacity:
            return
        while self._used + size > self._capacity:
            dropped, dropped_size = self._order.popitem(last=False)
            self._used -= dropped_size
            self._step.evicts.append(dropped)
            self._stats.data["evictions"] += 1
        self._order[identifier] = size
        self._used += size
        self._step.saves.append(identifier)
        self._stats.data["stores"] += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        step, self._step = self._step, EmbeddingCacheMetadata()
        if step.evicts and step.saves:  # kept and dropped again within the step (a cache of a few images)
            dropped = set(step.evicts)
            step.saves = [identifier for identifier in step.saves if identifier not in dropped]
        return step

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, EmbeddingCacheStats()
        stats.data["bytes"] = self._used
        return stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECConnectorStats | None:
        return EmbeddingCacheStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> ECConnectorPromMetrics | None:
        return EmbeddingCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side -------------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        orders = self._get_connector_metadata()
        assert isinstance(orders, EmbeddingCacheMetadata)
        for identifier in orders.loads:  # before the drops: an image loaded may be dropped later in the step
            if identifier not in encoder_cache:
                encoder_cache[identifier] = self._store[identifier].to(self._device)
        for identifier in orders.evicts:
            self._store.pop(identifier, None)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        orders = self._get_connector_metadata()
        assert isinstance(orders, EmbeddingCacheMetadata)
        if mm_hash in orders.saves and mm_hash in encoder_cache:
            # A copy: the engine's own entry may be freed or reused once the request is done with it.
            self._store[mm_hash] = encoder_cache[mm_hash].to("cpu", copy=True)
