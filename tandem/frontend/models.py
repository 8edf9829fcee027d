"""Model discovery for the frontend: watches model deployment cards and keeps, per served model
name, the admitted worker instances and the model's preprocessing pipeline.

The first card seen for a model reserves its configuration (mdcsum). Later instances with the same
mdcsum join; one that disagrees is rejected with an error log until every incumbent has left, then
the earliest waiting card takes over. A model leaves `/v1/models` with its last instance.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tandem.llm.model_card import (
    ModelDeploymentCard,
    ModelInput,
    ModelType,
    WorkerType,
    verify_files,
)
from tandem.runtime import Client, DistributedRuntime, keys
from tandem.runtime.discovery import Watch

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    name: str
    card: ModelDeploymentCard
    folder: str  # where this frontend reads the tokenizer and templates from
    created: int = field(default_factory=lambda: int(time.time()))
    instances: dict[int, str] = field(default_factory=dict)  # instance id -> endpoint path
    prefill_instances: dict[int, str] = field(default_factory=dict)
    dp_sizes: dict[int, int] = field(default_factory=dict)  # instance id -> data-parallel ranks, if > 1
    pipeline: Any = None  # built by the frontend's pipeline factory
    # What the model's serving instances answer (chat, completions, embedding): their cards' types, the
    # prefill workers' left out (they serve the decode workers, not the routes).
    types: ModelType = ModelType(0)

    @property
    def parent(self) -> str | None:
        return self.card.lora.base_model if self.card.lora else None


class ModelManager:
    def __init__(
        self,
        runtime: DistributedRuntime,
        *,
        namespace: str | None = None,
        model_path: str | None = None,
        build_pipeline: Callable[[ServedModel], Any] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.runtime = runtime
        self.prefix = keys.models_prefix(namespace)
        self.model_path = model_path
        self.models: dict[str, ServedModel] = {}
        self.clients: dict[str, Client] = {}
        self._build_pipeline = build_pipeline
        self._on_change = on_change
        self._cards: dict[str, tuple[str, ModelDeploymentCard]] = {}  # key -> (model name, card), in arrival order
        self._watch: Watch | None = None
        self._task: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()

    async def start(self) -> None:
        """Follows the model cards; returns once the cards already registered are applied, so a frontend
        (or a replica started again) does not answer 404 for models that are being served."""
        self._watch = await self.runtime.store.watch_prefix(self.prefix)
        caught_up = asyncio.Event()
        self._task = asyncio.create_task(self._follow(self._watch, caught_up), name="model-watcher")
        waiting = asyncio.ensure_future(caught_up.wait())
        await asyncio.wait({waiting, self._task}, return_when=asyncio.FIRST_COMPLETED)  # a failed watcher: no wait
        waiting.cancel()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        if self._task is not None:
            self._task.cancel()
        for client in self.clients.values():
            await client.close()

    def get(self, name: str) -> ServedModel | None:
        model = self.models.get(name)
        return model if model is not None and model.instances else None

    def served(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.instances]

    async def client(self, endpoint_path: str) -> Client:
        client = self.clients.get(endpoint_path)
        if client is None:
            client = await self.runtime.endpoint(endpoint_path).client()
            self.clients[endpoint_path] = client
        return client

    # -- events --------------------------------------------------------------------------------
    async def _follow(self, watch: Watch, caught_up: asyncio.Event) -> None:
        applied = 0
        if not watch.replayed:
            caught_up.set()
        async for event in watch:
            try:
                if event.kind == "put":
                    await self._on_put(event.key, event.value or b"")
                else:
                    await self._on_delete(event.key)
            except Exception:
                log.exception("error applying model card event for %s", event.key)
            self.changed.set()
            if self._on_change is not None:
                self._on_change()
            applied += 1
            if applied == watch.replayed:
                caught_up.set()

    async def _on_put(self, key: str, value: bytes) -> None:
        try:
            namespace, component, endpoint, instance_id, _ = keys.parse_model_key(key)
            card = ModelDeploymentCard.from_json(value)
        except (ValueError, msgspec.DecodeError) as e:
            log.error("ignoring malformed model card at %s: %s", key, e)
            return
        self._cards[key] = (card.display_name, card)
        await self._admit(key, card, f"{namespace}.{component}.{endpoint}", instance_id)

    async def _admit(self, key: str, card: ModelDeploymentCard, endpoint_path: str, instance_id: int) -> None:
        name = card.display_name
        model = self.models.get(name)
        if model is None or (not model.instances and not model.prefill_instances):
            folder = self._folder_for(card)
            if folder is None:
                return
            model = ServedModel(name=name, card=card, folder=folder)
            if self._build_pipeline is not None:
                try:
                    model.pipeline = await asyncio.to_thread(self._build_pipeline, model)
                except Exception as e:
                    log.error("cannot serve model %r from %s: %s", name, folder, e)
                    return
            self.models[name] = model
            log.info("model %r added (%s input, context %d, block size %d)", name, card.model_input,
                     card.context_length, card.kv_cache_block_size)
        elif card.mdcsum != model.card.mdcsum:
            log.error(
                "rejecting instance %x of %s for model %r: its card (mdcsum %s) disagrees with the model's "
                "configuration (mdcsum %s); it is admitted once the current instances are gone",
                instance_id, endpoint_path, name, card.mdcsum, model.card.mdcsum,
            )
            return
        await self.client(endpoint_path)
        is_prefill = card.worker_type == WorkerType.Prefill or bool(ModelType(card.model_type) & ModelType.Prefill)
        if not is_prefill and not model.instances:
            # The serving configuration (migration limit, KV blocks and batch size for the busy thresholds) is
            # the serving workers'; a prefill worker's card stands in only until the first of them arrives.
            model.card = card
        (model.prefill_instances if is_prefill else model.instances)[instance_id] = endpoint_path
        if not is_prefill:
            model.types |= card.types
        dp_size = card.runtime_config.data_parallel_size
        if dp_size > 1:
            model.dp_sizes[instance_id] = dp_size

    async def _on_delete(self, key: str) -> None:
        entry = self._cards.pop(key, None)
        if entry is None:
            return
        name = entry[0]
        try:
            _, _, _, instance_id, _ = keys.parse_model_key(key)
        except ValueError:
            return
        model = self.models.get(name)
        if model is None:
            return
        model.instances.pop(instance_id, None)
        model.prefill_instances.pop(instance_id, None)
        model.dp_sizes.pop(instance_id, None)
        if not model.instances and not model.prefill_instances:
            del self.models[name]
            log.info("model %r removed: its last instance left", name)
            # Cards rejected earlier for disagreeing may now take over, earliest first.
            for waiting_key, (waiting_name, card) in list(self._cards.items()):
                if waiting_name == name:
                    ns, comp, ep, waiting_id, _ = keys.parse_model_key(waiting_key)
                    await self._admit(waiting_key, card, f"{ns}.{comp}.{ep}", waiting_id)

    def _folder_for(self, card: ModelDeploymentCard) -> str | None:
        """A local folder whose files match the card: the worker's own, else --model-path.
        Text-input models need none: their engine tokenizes."""
        if card.model_input == ModelInput.Text:
            return card.source_path
        candidates = [card.source_path] + ([self.model_path] if self.model_path else [])
        for folder in candidates:
            if folder and not verify_files(folder, card.files) and card.files:
                return folder
        log.error(
            "cannot serve model %r: no local copy of its tokenizer files matches the card (looked in %s); "
            "give the frontend --model-path with the same model",
            card.display_name, ", ".join(c for c in candidates if c),
        )
        return None
