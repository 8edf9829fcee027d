"""Model deployment cards (MDC): what a worker publishes in discovery so frontends can serve its
model. Key: `v1/mdc/{ns}/{component}/{endpoint}/{instance:x}[/{lora}]`.

A card names the model, says where its tokenizer, chat template and generation config come from
(a folder plus content checksums, so a frontend can check that its copy is the same), and carries
the serving configuration (context length, KV block size, model type and input, runtime config).
`mdcsum` hashes the fields that must agree for two workers to serve the same model (not their role:
prefill, decode and aggregated workers of one model share it).
"""

from __future__ import annotations

import hashlib
import json
import os
from enum import IntFlag, StrEnum
from typing import Any

import msgspec

from tandem.runtime import keys


class ModelType(IntFlag):
    Chat = 1
    Completions = 2
    Embedding = 4
    TensorBased = 8
    Prefill = 16

    @classmethod
    def parse(cls, text: str) -> ModelType:
        """`"chat,completions"` -> Chat|Completions (Dynamo's --endpoint-types spelling)."""
        value = cls(0)
        for name in filter(None, (part.strip().lower() for part in text.split(","))):
            matches = [member for member in cls if member.name and member.name.lower() == name]
            if not matches:
                raise ValueError(f"unknown model type {name!r}; use chat, completions, embedding or prefill")
            value |= matches[0]
        return value


class ModelInput(StrEnum):
    """Who tokenizes: the frontend (`Tokens`: the worker gets token ids) or the engine (`Text`)."""

    Tokens = "Tokens"
    Text = "Text"


class WorkerType(StrEnum):
    """The worker's part in serving: whole requests, or one side of disaggregated serving."""

    Aggregated = "Aggregated"
    Prefill = "Prefill"
    Decode = "Decode"


class ImagePrompt(msgspec.Struct, frozen=True):
    """What the engine puts in the prompt in place of one image placeholder, the same whatever the image:
    `tokens`, of which the `length` from `offset` on are the image's span (the KV blocks overlapping it are
    the image's, hashed with its content)."""

    tokens: list[int]
    offset: int
    length: int


class ModelRuntimeConfig(msgspec.Struct, omit_defaults=True):
    """What the worker's engine turned out to be, for the frontend's router and limits."""

    total_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    context_length: int | None = None
    enable_local_indexer: bool = False  # serves worker_kv_indexer_query (its KV events can be re-fetched)
    data_parallel_size: int = 1
    tool_call_parser: str | None = None  # how the frontend finds tool calls in this model's output
    reasoning_parser: str | None = None  # ... and its thinking
    enable_prompt_embeds: bool = False  # the engine takes prompt embeddings instead of token ids
    image_token_id: int | None = None  # the engine takes images (started with --enable-multimodal): their placeholder
    max_images: int | None = None  # ... at most this many per request (vLLM's --limit-mm-per-prompt)
    image_prompt: ImagePrompt | None = None  # ... each placeholder's expansion, when it does not vary by image
    embedding_size: int | None = None  # an embedding model's vector size
    # An embedding model trained to be cut short (matryoshka): requests may ask for fewer `dimensions`, any
    # from 1 to embedding_size, or only those listed in matryoshka_dimensions when it lists some.
    matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None


# Files of a model folder the frontend reads; their checksums go into the card.
MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json",
               "chat_template.jinja", "special_tokens_map.json")


class LoraInfo(msgspec.Struct, omit_defaults=True):
    name: str
    base_model: str | None = None
    max_gpu_lora_count: int | None = None


class ModelDeploymentCard(msgspec.Struct, omit_defaults=True):
    display_name: str
    source_path: str  # the worker's model folder (or hub id)
    model_type: int = int(ModelType.Chat | ModelType.Completions)
    model_input: ModelInput = ModelInput.Tokens
    worker_type: WorkerType = WorkerType.Aggregated
    files: dict[str, str] = msgspec.field(default_factory=dict)  # file name -> sha256 hex
    chat_template: str | None = None  # custom template text; wins over the model's
    context_length: int = 0
    kv_cache_block_size: int = 16
    migration_limit: int = 0
    runtime_config: ModelRuntimeConfig = msgspec.field(default_factory=ModelRuntimeConfig)
    lora: LoraInfo | None = None
    user_data: dict[str, Any] | None = None
    mdcsum: str = ""

    @property
    def types(self) -> ModelType:
        return ModelType(self.model_type)

    def compute_mdcsum(self) -> str:
        identity = {
            "display_name": self.display_name,
            "files": sorted(self.files.items()),
            "chat_template": self.chat_template,
            "context_length": self.context_length,
            "kv_cache_block_size": self.kv_cache_block_size,
            "model_input": self.model_input,
        }
        # Workers that parse the model's output differently, take other inputs or answer with embeddings
        # instead of text do not serve the same model.
        for parser in ("tool_call_parser", "reasoning_parser"):
            if getattr(self.runtime_config, parser) is not None:
                identity[parser] = getattr(self.runtime_config, parser)
        if self.runtime_config.enable_prompt_embeds:
            identity["enable_prompt_embeds"] = True
        if self.types & ModelType.Embedding:
            identity["model_type"] = self.model_type
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]

    def for_lora(self, name: str, user_data: dict[str, Any] | None = None) -> ModelDeploymentCard:
        """The card of LoRA adapter `name` served on top of this (base) model."""
        card = msgspec.structs.replace(self, display_name=name, lora=LoraInfo(name=name, base_model=self.display_name),
                                       user_data=user_data if user_data is not None else self.user_data)
        card.mdcsum = card.compute_mdcsum()
        return card

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> ModelDeploymentCard:
        return msgspec.json.decode(data, type=cls)


def file_checksums(folder: str) -> dict[str, str]:
    sums = {}
    for name in MODEL_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                sums[name] = hashlib.sha256(f.read()).hexdigest()
    return sums


def verify_files(folder: str, expected: dict[str, str]) -> list[str]:
    """Names of card files that are missing or differ in `folder` (empty = all match)."""
    actual = file_checksums(folder)
    return [name for name, digest in expected.items() if actual.get(name) != digest]


def context_length_of(folder: str) -> int:
    """The model's context length from config.json (0 when unknown)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return 0
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return 0


def hidden_size_of(folder: str) -> int:
    """The width of the model's input embeddings from config.json (a multimodal model's text config's;
    0 when unknown)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return 0
    for section in (config, config.get("text_config") or {}):
        for key in ("hidden_size", "n_embd", "d_model"):
            if isinstance(section.get(key), int):
                return int(section[key])
    return 0


def build_card(
    model_path: str,
    display_name: str,
    *,
    model_type: ModelType = ModelType.Chat | ModelType.Completions,
    model_input: ModelInput = ModelInput.Tokens,
    worker_type: WorkerType = WorkerType.Aggregated,
    context_length: int | None = None,
    kv_cache_block_size: int = 16,
    migration_limit: int = 0,
    runtime_config: ModelRuntimeConfig | None = None,
    custom_template_path: str | None = None,
    lora: LoraInfo | None = None,
    user_data: dict[str, Any] | None = None,
) -> ModelDeploymentCard:
    """A card for the model in `model_path` (a local HF folder)."""
    chat_template = None
    if custom_template_path:
        path = os.path.expandvars(os.path.expanduser(custom_template_path))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"custom chat template {custom_template_path!r} not found")
        with open(path) as f:
            chat_template = f.read()
    card = ModelDeploymentCard(
        display_name=display_name,
        source_path=os.path.abspath(model_path) if os.path.isdir(model_path) else model_path,
        model_type=int(model_type),
        model_input=ModelInput(model_input),
        worker_type=WorkerType(worker_type),
        files=file_checksums(model_path) if os.path.isdir(model_path) else {},
        chat_template=chat_template,
        context_length=context_length or context_length_of(model_path),
        kv_cache_block_size=kv_cache_block_size,
        migration_limit=migration_limit,
        runtime_config=runtime_config or ModelRuntimeConfig(),
        lora=lora,
        user_data=user_data,
    )
    card.mdcsum = card.compute_mdcsum()
    return card


async def register_model(endpoint: Any, card: ModelDeploymentCard) -> str:
    """Publish `card` for this process's instance of `endpoint` (removed first at shutdown)."""
    runtime = endpoint.runtime
    suffix = card.lora.name if card.lora else None
    key = keys.model_key(endpoint.namespace, endpoint.component, endpoint.name, runtime.instance_id, suffix)
    await runtime.register_key(key, card.to_json())
    return key
