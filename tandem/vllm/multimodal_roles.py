"""Dynamo's older multimodal role flags, each taken as the role tandem builds for that job, so scripts written
for them start the same graph. Their encoder hands its outputs to the worker as embeddings, by file unless
TRANSFER_LOCAL=0 (then by NIXL: tandem's nixl-read). The processor roles (`--multimodal-processor`,
`--ec-processor`) are not among them: tandem's frontend tokenizes and applies the chat template, and a consumer
sends its images to encoders itself, so there is no processor to start (refused, saying so)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import TYPE_CHECKING, NamedTuple

from tandem.runtime.config import env_bool
from tandem.runtime.options import Option, add_options
from tandem.worker.config import DisaggregationMode
from tandem.worker.encoders import chosen_role

if TYPE_CHECKING:
    from tandem.vllm.args import Config

ENCODE = Option("multimodal_encode_worker", ("--multimodal-encode-worker",), ("DYN_VLLM_MULTIMODAL_ENCODE_WORKER",),
                "Dynamo's older encoder role: as --disaggregation-mode encode, its outputs handed to workers as "
                "embeddings (with TRANSFER_LOCAL=0 offered for NIXL reads)", kind=bool)
WORKER = Option("multimodal_worker", ("--multimodal-worker",), ("DYN_VLLM_MULTIMODAL_WORKER",),
                "Dynamo's older worker role: as --route-to-encoder --embedding-transfer-mode local (TRANSFER_LOCAL=0: "
                "nixl-read), aggregated or with --is-prefill-worker a prefill worker", kind=bool)
DECODE = Option("multimodal_decode_worker", ("--multimodal-decode-worker",), ("DYN_VLLM_MULTIMODAL_DECODE_WORKER",),
                "Dynamo's older decode role: as --disaggregation-mode decode with images", kind=bool)
ENCODE_PREFILL = Option("multimodal_encode_prefill_worker", ("--multimodal-encode-prefill-worker",),
                        ("DYN_VLLM_MULTIMODAL_ENCODE_PREFILL_WORKER",),
                        "Dynamo's older role of a worker that encodes its own images: what --enable-multimodal "
                        "alone does (aggregated, or with --is-prefill-worker a prefill worker)", kind=bool)
OLDER_ROLES = (ENCODE, WORKER, DECODE, ENCODE_PREFILL)
# Not built, each refused by name with the reason (flag, env var, takes a value).
PROCESSOR_FLAGS: tuple[tuple[str, str, bool], ...] = (
    ("--multimodal-processor", "DYN_VLLM_MULTIMODAL_PROCESSOR", False),
    ("--ec-processor", "DYN_VLLM_EC_PROCESSOR", False),
    ("--mm-prompt-template", "DYN_VLLM_MM_PROMPT_TEMPLATE", True),
)
TRANSFER_LOCAL_ENV = "TRANSFER_LOCAL"  # Dynamo's older switch: 1 (default) files, 0 NIXL


def add_role_flags(group: argparse._ActionsContainer) -> None:
    add_options(group, OLDER_ROLES, SimpleNamespace(**{role.field: False for role in OLDER_ROLES}))


class OlderRole(NamedTuple):
    """What an older role flag stands for: the role's --disaggregation-mode (None: as given otherwise), its
    --embedding-transfer-mode, and whether it is an encoder's consumer."""

    mode: str | None = None
    transfer: str | None = None
    consumer: bool = False


def older_role(dyn: argparse.Namespace, config: Config) -> OlderRole | None:
    """The older role given (None: none); ValueError for two roles (--vllm-native-encoder-worker counted), for
    one without --enable-multimodal, or for a processor role. `--multimodal-worker --ec-consumer-mode` is
    the encoder-cache connector's consumer, taking no embeddings."""
    refused = [flag for flag, _, _ in PROCESSOR_FLAGS if getattr(dyn, flag[2:].replace("-", "_"))]
    if refused:
        raise ValueError(f"{', '.join(refused)}: tandem has no processor role: its frontend tokenizes and applies "
                         "the chat template, and a worker with --route-to-encoder sends its images to encoder "
                         "workers itself; start the frontend and the workers")
    given = [(role.flags[0], bool(role.value(dyn))) for role in OLDER_ROLES]
    role = chosen_role((*given, ("--vllm-native-encoder-worker", config.vllm_native_encoder_worker)),
                       config.enable_multimodal, "a worker has one multimodal role")
    if role is None or role == "--vllm-native-encoder-worker":
        return None
    nixl = not env_bool(TRANSFER_LOCAL_ENV, True)
    if role == ENCODE.flags[0]:
        return OlderRole(DisaggregationMode.ENCODE.value, "nixl-read" if nixl else None)
    if role == WORKER.flags[0]:
        transfer = None if config.ec_consumer_mode else "nixl-read" if nixl else "local"
        return OlderRole(None, transfer, consumer=True)
    if role == DECODE.flags[0]:
        if config.is_prefill_worker:
            raise ValueError("--multimodal-decode-worker with --is-prefill-worker: choose one")
        return OlderRole(DisaggregationMode.DECODE.value)
    return OlderRole()  # encode + prefill: the engine encodes its own images
