"""The vLLM worker's part of its canary health check: the model's BOS token id, from the engine client
(the payload itself: `tandem.worker.health`)."""

from __future__ import annotations

import inspect
import logging
from typing import Any

log = logging.getLogger(__name__)

def _bos_of(tokenizer: Any) -> int | None:
    """vLLM >= 0.11 hands out the HF tokenizer itself; older ones a group wrapping it (`.tokenizer`)."""
    for candidate in (tokenizer, getattr(tokenizer, "tokenizer", None)):
        if candidate is None:
            continue
        bos = getattr(candidate, "bos_token_id", None)
        if bos is not None:
            return int(bos)
    return None


async def bos_token_id_of(engine_client: Any) -> int | None:
    """The model's BOS token id from a vLLM engine client, or None if it cannot be found.

    vLLM 0.32 `AsyncLLM`: `engine_client.tokenizer` is a (sync) property returning the tokenizer or
    None (`skip_tokenizer_init`); `engine_client.get_tokenizer()` is sync too and raises when there is
    no tokenizer. Older / other clients (AsyncOmni, the old `EngineClient`) have an async
    `get_tokenizer()`; both forms are handled. Never raises.
    """
    if engine_client is None:
        return None
    try:
        bos = _bos_of(getattr(engine_client, "tokenizer", None))
        if bos is not None:
            return bos
    except Exception:
        log.debug("no BOS token id from engine_client.tokenizer", exc_info=True)
    try:
        get_tokenizer = getattr(engine_client, "get_tokenizer", None)
        if get_tokenizer is not None:
            tokenizer = get_tokenizer()
            if inspect.isawaitable(tokenizer):
                tokenizer = await tokenizer
            return _bos_of(tokenizer)
    except Exception:
        log.debug("no BOS token id from engine_client.get_tokenizer()", exc_info=True)
    return None
