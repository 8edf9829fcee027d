"""Canary health-check payloads, the same for every worker kind.

The runtime sends the payload as an ordinary request to an idle endpoint when canary checks are
enabled (`serve_endpoint(..., health_check_payload=...)`). `DYN_HEALTH_CHECK_PAYLOAD` (a JSON object)
replaces the default entirely; the `_HEALTH_CHECK` probe marker is added in every case.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

log = logging.getLogger(__name__)

HEALTH_CHECK_KEY = "_HEALTH_CHECK"
PAYLOAD_ENV = "DYN_HEALTH_CHECK_PAYLOAD"
DEFAULT_BOS_TOKEN_ID = 1


def _stop_conditions() -> dict[str, Any]:
    return {
        "max_tokens": 1,
        "stop": None,
        "stop_token_ids": None,
        "include_stop_str_in_output": False,
        "ignore_eos": False,
    }


def default_payload(bos_token_id: int | None, *, text_mode: bool = False, embedding: bool = False) -> dict[str, Any]:
    """The built-in payload, without the env override or the probe marker."""
    if text_mode:
        return {"prompt": "Test", "temperature": 0.0, **_stop_conditions()}
    bos = DEFAULT_BOS_TOKEN_ID if bos_token_id is None else int(bos_token_id)
    if embedding:
        return {"token_ids": [[bos]]}
    return {
        "token_ids": [bos],
        "sampling_options": {"temperature": 0.0},
        "stop_conditions": _stop_conditions(),
    }


def payload_from_env() -> dict[str, Any] | None:
    """`DYN_HEALTH_CHECK_PAYLOAD` parsed as a JSON object, or None when unset/empty."""
    raw = os.environ.get(PAYLOAD_ENV)
    if raw is None or not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{PAYLOAD_ENV} is not valid JSON ({e.msg} at position {e.pos}): {raw!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{PAYLOAD_ENV} must be a JSON object, got {type(value).__name__}: {raw!r}")
    return value


def health_check_payload(bos_token_id: int | None, *, text_mode: bool = False,
                         embedding: bool = False) -> dict[str, Any]:
    """The canary request for this worker's `generate` endpoint.

    Token mode (aggregated, decode and prefill workers): one BOS token (fallback 1), greedy, one
    output token. Embedding workers: the embedding of that one token. Text mode
    (`--use-vllm-tokenizer`): the prompt "Test". `DYN_HEALTH_CHECK_PAYLOAD`
    replaces either (invalid JSON or a non-object -> ValueError). `"_HEALTH_CHECK": True` is always
    added so handlers and the runtime can tell a probe from real traffic.
    """
    payload = payload_from_env()
    if payload is None:
        payload = default_payload(bos_token_id, text_mode=text_mode, embedding=embedding)
    else:
        log.info("using the health-check payload from %s", PAYLOAD_ENV)
    payload = dict(payload)
    payload[HEALTH_CHECK_KEY] = True
    return payload
