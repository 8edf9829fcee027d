"""The flags of vLLM's encoder-cache connector roles (an encoder worker, or an aggregated worker in consumer
mode, see encoder.py; or a worker with the multimodal embedding cache, see embedding_cache.py), their checks,
and the ECTransferConfig they build for the engine."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from tandem.runtime.options import Option
from tandem.worker.encoders import chosen_role

CAPACITY_KEY = "multimodal_embedding_cache_capacity_gb"  # the embedding cache's size in its extra config

if TYPE_CHECKING:
    from tandem.vllm.args import Config

# vLLM's encoder-cache connector that keeps each image's encoder output in a file under a shared directory.
EC_EXAMPLE_CONNECTOR = "ECExampleConnector"
# How an encoder's outputs reach a consumer that takes them as embeddings: by file, or by NIXL, read from the
# encoder's memory or written by the encoder into the consumer's (embedding_transfer.py).
LOCAL_TRANSFER = "local"
NIXL_READ = "nixl-read"
NIXL_WRITE = "nixl-write"
TRANSFER_MODES = (LOCAL_TRANSFER, NIXL_WRITE, NIXL_READ)

ENCODER_OPTIONS = (
    Option("vllm_native_encoder_worker", ("--vllm-native-encoder-worker",), ("DYN_VLLM_NATIVE_ENCODER_WORKER",),
           "serve as an encoder (component encoder): run the vision encoder of each request's images and store "
           "its output with vLLM's encoder-cache connector, for workers in --ec-consumer-mode", kind=bool),
    Option("ec_connector_backend", ("--ec-connector-backend",), ("DYN_VLLM_EC_CONNECTOR_BACKEND",),
           "vLLM's encoder-cache connector class", kind=str, metavar="CLASS"),
    Option("ec_storage_path", ("--ec-storage-path",), ("DYN_VLLM_EC_STORAGE_PATH",),
           "the directory the encoder and its consumers share (ECExampleConnector)", kind=str, metavar="DIR"),
    Option("ec_extra_config", ("--ec-extra-config",), ("DYN_VLLM_EC_EXTRA_CONFIG",),
           "JSON object merged into the connector's extra config", kind=str, metavar="JSON"),
    Option("ec_consumer_mode", ("--ec-consumer-mode",), ("DYN_VLLM_EC_CONSUMER_MODE",),
           "an aggregated or prefill worker that has each request's images encoded by an encoder worker and "
           "loads their encoder output from the connector (it encodes them itself when no encoder can)", kind=bool),
    Option("embedding_transfer_mode", ("--embedding-transfer-mode",), ("DYN_VLLM_EMBEDDING_TRANSFER_MODE",),
           "a consumer takes its images' encoder outputs from the encoder as embeddings (never reading the "
           "images), local: from the files the encoder names, nixl-read: read from the encoder's memory by NIXL, "
           "nixl-write: written by the encoder into the consumer's memory by NIXL (unset: its engine loads them "
           "through the encoder-cache connector); on an encoder, nixl-read or nixl-write: offer outputs by NIXL "
           "(to consumers of either)", kind=str, choices=TRANSFER_MODES, casefold=True),
    Option("multimodal_embedding_cache_capacity_gb", ("--multimodal-embedding-cache-capacity-gb",),
           ("DYN_MULTIMODAL_EMBEDDING_CACHE_CAPACITY_GB",),
           "host memory (GB) that keeps the encoder outputs of recent images, least recently used dropped "
           "first, so an image seen again is not encoded again (0: off)", kind=float, minimum=0.0),
)


def check_encoder_cache(config: Config) -> None:
    """The encoder-cache connector's roles: an encoder worker, an aggregated or prefill worker in consumer
    mode, or a worker with the embedding cache (an engine has one connector)."""
    role = chosen_role((("--vllm-native-encoder-worker", config.vllm_native_encoder_worker),
                        ("--ec-consumer-mode", config.ec_consumer_mode),
                        ("--multimodal-embedding-cache-capacity-gb", config.multimodal_embedding_cache_capacity_gb > 0)),
                       config.enable_multimodal, "each uses the engine's one encoder-cache connector; choose one")
    if config.embedding_transfer_mode is not None and role not in ("--vllm-native-encoder-worker",
                                                                   "--ec-consumer-mode"):
        raise ValueError("--embedding-transfer-mode: for an encoder worker (--disaggregation-mode encode) or its "
                         "consumer (--route-to-encoder)")
    if role is None:
        return
    if config.embedding_worker or config.use_vllm_tokenizer:
        raise ValueError(f"{role}: images are encoded for a generation worker with token input")
    if config.engine_args.ec_transfer_config is not None:
        raise ValueError(f"Cannot specify both --ec-transfer-config and {role} (which builds it)")
    if config.multimodal_embedding_cache_capacity_gb > 0:
        given = [flag for flag, value in (
            ("--ec-connector-backend", config.ec_connector_backend != EC_EXAMPLE_CONNECTOR),
            ("--ec-storage-path", config.ec_storage_path), ("--ec-extra-config", config.ec_extra_config)) if value]
        if given:
            raise ValueError(f"{', '.join(given)}: the embedding cache is its own connector, in host memory; these "
                             "configure the encoder worker's connector")
        return
    if config.embedding_transfer_mode is not None:
        _check_embedding_transfer(config, role)
        if config.ec_consumer_mode:
            return  # no connector of its own: it reads the files the encoder names
    if config.ec_connector_backend == EC_EXAMPLE_CONNECTOR and not config.ec_storage_path:
        raise ValueError(f"{role} with --ec-connector-backend {EC_EXAMPLE_CONNECTOR} needs --ec-storage-path "
                         "(a directory the encoder and its consumers share)")
    if config.ec_extra_config is not None:
        try:
            extra = json.loads(config.ec_extra_config)
        except ValueError as e:
            raise ValueError(f"--ec-extra-config is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--ec-extra-config must be a JSON object")


def _check_embedding_transfer(config: Config, role: str) -> None:
    mode = config.embedding_transfer_mode
    if config.ec_connector_backend != EC_EXAMPLE_CONNECTOR:
        raise ValueError(f"--embedding-transfer-mode {mode} hands over what --ec-connector-backend "
                         f"{EC_EXAMPLE_CONNECTOR} stores in files, not {config.ec_connector_backend}'s outputs")
    if config.ec_consumer_mode:
        given = [flag for flag, value in (("--ec-storage-path", config.ec_storage_path),
                                          ("--ec-extra-config", config.ec_extra_config)) if value]
        if given:
            raise ValueError(f"{', '.join(given)} with --embedding-transfer-mode: a consumer taking embeddings has "
                             "no encoder-cache connector; it reads the files its encoder names")


def ec_transfer_config(config: Config) -> Any:
    """vLLM's ECTransferConfig for this worker's role (None: no encoder cache)."""
    from vllm.config import ECTransferConfig

    capacity = config.multimodal_embedding_cache_capacity_gb
    if capacity > 0:
        return ECTransferConfig(ec_connector="EmbeddingCacheConnector", ec_role="ec_both",
                                ec_connector_module_path="tandem.vllm.embedding_cache",
                                engine_id=f"{config.namespace}.{config.component}.embedding-cache",
                                ec_connector_extra_config={CAPACITY_KEY: capacity})
    if not (config.vllm_native_encoder_worker or config.ec_consumer_mode):
        return None
    if config.ec_consumer_mode and config.embedding_transfer_mode is not None:
        return None  # the encoder outputs come with the request, as embeddings

    extra = json.loads(config.ec_extra_config) if config.ec_extra_config else {}
    if config.ec_storage_path:
        extra["shared_storage_path"] = config.ec_storage_path
    role: Literal["ec_producer", "ec_consumer"] = ("ec_producer" if config.vllm_native_encoder_worker
                                                   else "ec_consumer")
    return ECTransferConfig(ec_connector=config.ec_connector_backend, ec_role=role,
                            engine_id=f"{config.namespace}.{config.component}.{role}",
                            ec_connector_extra_config=extra)
