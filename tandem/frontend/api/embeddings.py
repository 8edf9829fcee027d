"""OpenAI's embeddings route, `POST /v1/embeddings`: the body checked into an `EmbeddingsRequest`, and the
workers' vectors written as OpenAI's (and vLLM's) `list` of `embedding` objects, as floats or base64."""

from __future__ import annotations

import array
import base64
import sys
import time
from typing import Any, Literal

import msgspec
from aiohttp import web

from tandem.frontend.hints import PRIORITY_HEADER, routing_hints
from tandem.frontend.protocol.errors import RequestError, fail, refuse_given
from tandem.frontend.protocol.validation import decode_body
from tandem.frontend.requests import (
    EmbeddingsRequest,
    EncodingFormat,
    Endianness,
    input_param,
)
from tandem.frontend.serving import Mount, Serving
from tandem.llm.model_card import ModelRuntimeConfig, ModelType
from tandem.llm.protocols import EmbeddingOutput, EmbeddingRequest
from tandem.runtime import RemoteError, StreamIncompleteError

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request


_NO_TRUNCATION = "an input longer than the context is refused, never cut"
# vLLM's extras that tandem does not honour: refused when given, never ignored.
_UNSERVED = (("truncate_prompt_tokens", _NO_TRUNCATION), ("truncation_side", _NO_TRUNCATION),
             ("padding", "inputs are embedded as they are"),
             ("use_activation", "the model's pooler decides the normalization"),
             ("messages", "embeddings of chat conversations are not served; send their text as 'input'"),
             ("chat_template", "embeddings of chat conversations are not served"),
             ("chat_template_kwargs", "embeddings of chat conversations are not served"),
             ("mm_processor_kwargs", "multimodal inputs are not served"))


class _EmbeddingsBody(msgspec.Struct, kw_only=True):
    model: str
    input: Any = None  # a text, a list of texts, a token-id list or a list of them: checked by hand
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's: special tokens (BOS) added to text inputs
    embed_dtype: Literal["float32"] = "float32"  # vLLM's dtype of base64 vectors
    endianness: Endianness = "native"
    priority: Literal[0] = 0
    # vLLM's extras that tandem does not honour, kept only to refuse them when given
    truncate_prompt_tokens: Any = None
    padding: Any = None
    truncation_side: Any = None
    use_activation: Any = None
    messages: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    mm_processor_kwargs: Any = None




_decoder = msgspec.json.Decoder(_EmbeddingsBody)


def parse_request(body: bytes) -> EmbeddingsRequest:
    """Decode and check a /v1/embeddings body; raises RequestError naming the field."""
    raw: _EmbeddingsBody = decode_body(_decoder, body)
    refuse_given(raw, _UNSERVED)
    if not raw.model:
        raise fail("model", "'model' must be a non-empty string.")
    if raw.dimensions is not None and raw.dimensions < 1:
        raise fail("dimensions", f"'dimensions' must be at least 1 (got {raw.dimensions}).")
    texts, ids, single = _inputs(raw.input)
    return EmbeddingsRequest(model=raw.model, texts=texts, token_ids=ids, encoding_format=raw.encoding_format,
                             dimensions=raw.dimensions, add_special_tokens=raw.add_special_tokens,
                             endianness=raw.endianness, single=single)


def _inputs(value: Any) -> tuple[list[str] | None, list[list[int]] | None, bool]:
    """(texts, token-id lists, whether the body gave a single input) of an `input` field."""
    if value is None:
        raise fail("input", "Missing required parameter: 'input'.")
    single = isinstance(value, str) or (isinstance(value, list) and bool(value) and _is_id(value[0]))
    items = [value] if single else value
    if not isinstance(items, list) or not items:
        raise fail("input", "'input' must be a non-empty string, list of strings, list of token ids or "
                                   "list of token-id lists.")
    if len(items) > MAX_INPUTS:
        raise fail("input", f"at most {MAX_INPUTS} inputs may be embedded at once (got {len(items)}).")
    texts = isinstance(items[0], str)
    for i, item in enumerate(items):
        param = input_param(single, i)
        if texts:
            if not isinstance(item, str):
                raise fail(param, f"'{param}' must be a string, as the first input is.")
        elif not isinstance(item, list):
            raise fail(param, f"'{param}' must be a list of token ids, as the first input is.")
        else:
            for j, token in enumerate(item):
                if not _is_id(token) or not 0 <= token < 2**32:
                    raise fail(f"{param}[{j}]", f"'{param}[{j}]' must be a token id (an integer >= 0).")
        if not item:
            raise fail(param, f"'{param}' must not be empty.")
    return (items, None, single) if texts else (None, items, single)




def _is_id(value: Any) -> bool:
    return type(value) is int


def check_dimensions(dimensions: int | None, model: str, config: ModelRuntimeConfig) -> None:
    """`dimensions` only for a matryoshka model, and one its vectors can be cut to (vLLM's rule)."""
    if dimensions is None:
        return
    if not config.matryoshka:
        raise fail("dimensions", f"model {model!r} does not support matryoshka representation: its "
                                        "vectors cannot be shortened; leave 'dimensions' out.")
    size = config.embedding_size
    if size is not None and not 1 <= dimensions <= size:
        raise fail("dimensions", f"model {model!r} supports 'dimensions' from 1 to {size} "
                                        f"(got {dimensions}).")
    listed = config.matryoshka_dimensions
    if listed and dimensions not in listed:
        raise fail("dimensions", f"model {model!r} supports 'dimensions' of {listed} only "
                                        f"(got {dimensions}).")


def _encoded(vector: list[float], endianness: Endianness) -> str:
    """A vector as base64 of its float32 values, as the OpenAI client decodes it."""
    floats = array.array("f", vector)
    if endianness != "native" and endianness != sys.byteorder:
        floats.byteswap()
    return base64.b64encode(floats.tobytes()).decode()


def response(request_id: str, model: str, request: EmbeddingsRequest, vectors: list[list[float]],
             prompt_tokens: int) -> dict[str, Any]:
    """The embeddings answer: one `embedding` object per input, in order."""
    data = [{"index": i, "object": "embedding",
             "embedding": _encoded(v, request.endianness) if request.encoding_format == "base64" else v}
            for i, v in enumerate(vectors)]
    return {"id": f"embd-{request_id}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def routes(serving: Serving) -> Mount:
    async def embeddings(request: web.Request) -> web.StreamResponse:
        body = await serving.body(request)
        parsed = parse_request(body)
        model = serving.model(parsed.model, ModelType.Embedding, "/v1/embeddings")
        check_dimensions(parsed.dimensions, model.name, model.card.runtime_config)
        pipeline = model.pipeline
        preprocessor = serving.token_input(model, "/v1/embeddings")
        token_ids = await preprocessor.embedding_inputs(parsed, len(body))
        work = EmbeddingRequest(token_ids, model=model.name, dimensions=parsed.dimensions, mdc_sum=preprocessor.mdcsum)
        hints = routing_hints(None, request.headers)
        if hints is not None and hints.priority is not None:  # pooling runs no scheduler policy of the client's
            raise RequestError(f"header {PRIORITY_HEADER} is not supported on /v1/embeddings", param=PRIORITY_HEADER)
        pinned = serving.pinned(hints, pipeline, request)
        async with serving.track(request, model.name, "embeddings", stream=False, generation=False) as t:
            t.prompt_tokens, t.inputs = sum(map(len, token_ids)), len(token_ids)
            outputs = t.outputs = pipeline.generate(work, t.context, t.attempt, pinned=pinned)
            try:
                output: EmbeddingOutput | None = await anext(outputs, None)
            except Exception as e:  # routing, the worker's error, or an answer not in the contract's shape
                return serving.failure(e, model.name, "embeddings")
            if output is None:
                return serving.failure(StreamIncompleteError("the worker answered with nothing"), model.name,
                                       "embeddings")
            if len(output.embeddings) != len(token_ids):
                return serving.failure(RemoteError(f"the worker returned {len(output.embeddings)} vectors for "
                                                   f"{len(token_ids)} inputs"), model.name, "embeddings")
            t.status = "success"
            answer = response(t.request_id, model.name, parsed, output.embeddings, t.prompt_tokens)
            return web.Response(body=msgspec.json.encode(answer), content_type="application/json")
        return t.gone()

    return Mount([web.post("/v1/embeddings", embeddings)])
