"""The flags of vLLM's encoder-cache connector roles (an encoder worker, or an aggregated worker in consumer
mode; see encoder.py), their checks, and the ECTransferConfig they build for the engine."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from tandem.runtime.options import Option

if TYPE_CHECKING:
    from tandem.vllm.args import Config

# vLLM's encoder-cache connector that keeps each image's encoder output in a file under a shared directory.
EC_EXAMPLE_CONNECTOR = "ECExampleConnector"
ENCODER_COMPONENT = "encoder"  # where encoder workers serve, and their consumers find them

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
           "an aggregated worker that has each request's images encoded by an encoder worker and loads their "
           "encoder output from the connector (it encodes them itself when no encoder can)", kind=bool),
)


def check_encoder_cache(config: Config) -> None:
    """The encoder-cache connector's roles: an encoder worker, or an aggregated worker in consumer mode."""
    role = ("--vllm-native-encoder-worker" if config.vllm_native_encoder_worker
            else "--ec-consumer-mode" if config.ec_consumer_mode else None)
    if config.vllm_native_encoder_worker and config.ec_consumer_mode:
        raise ValueError("--vllm-native-encoder-worker and --ec-consumer-mode: a worker is the encoder or "
                         "its consumer, not both")
    if role is None:
        return
    if not config.enable_multimodal:
        raise ValueError(f"Use --enable-multimodal with {role}")
    if config.embedding_worker or config.use_vllm_tokenizer:
        raise ValueError(f"{role}: images are encoded for a generation worker with token input")
    if config.engine_args.ec_transfer_config is not None:
        raise ValueError(f"Cannot specify both --ec-transfer-config and {role} (which builds it)")
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


def ec_transfer_config(config: Config) -> Any:
    """vLLM's ECTransferConfig for this worker's role (None: no encoder cache)."""
    if not (config.vllm_native_encoder_worker or config.ec_consumer_mode):
        return None
    from vllm.config import ECTransferConfig

    extra = json.loads(config.ec_extra_config) if config.ec_extra_config else {}
    if config.ec_storage_path:
        extra["shared_storage_path"] = config.ec_storage_path
    role: Literal["ec_producer", "ec_consumer"] = ("ec_producer" if config.vllm_native_encoder_worker
                                                   else "ec_consumer")
    return ECTransferConfig(ec_connector=config.ec_connector_backend, ec_role=role,
                            engine_id=f"{config.namespace}.{config.component}.{role}",
                            ec_connector_extra_config=extra)
