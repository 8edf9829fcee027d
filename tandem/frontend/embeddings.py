"""OpenAI's embeddings route, `POST /v1/embeddings`: the body checked into an `EmbeddingsRequest`, and the
workers' vectors written as OpenAI's (and vLLM's) `list` of `embedding` objects, as floats or base64."""

from __future__ import annotations

import array
import base64
import sys
import time
from typing import Any, Literal

import msgspec

from tandem.frontend import openai
from tandem.llm.model_card import ModelRuntimeConfig

MAX_INPUTS = 2048  # OpenAI's bound on the inputs of one request

EncodingFormat = Literal["float", "base64"]
Endianness = Literal["native", "little", "big"]

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


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """A checked embeddings request: its inputs as texts or token-id lists, one kind per request."""

    model: str
    texts: list[str] | None
    token_ids: list[list[int]] | None
    encoding_format: EncodingFormat
    dimensions: int | None
    add_special_tokens: bool
    endianness: Endianness
    single: bool  # the body's input was one text or one token list, not a list of them

    def param(self, index: int) -> str:
        return _input_param(self.single, index)


_decoder = msgspec.json.Decoder(_EmbeddingsBody)


def parse_request(body: bytes) -> EmbeddingsRequest:
    """Decode and check a /v1/embeddings body; raises RequestError naming the field."""
    raw: _EmbeddingsBody = openai.decode_body(_decoder, body)
    openai.refuse_given(raw, _UNSERVED)
    if not raw.model:
        raise openai.fail("model", "'model' must be a non-empty string.")
    if raw.dimensions is not None and raw.dimensions < 1:
        raise openai.fail("dimensions", f"'dimensions' must be at least 1 (got {raw.dimensions}).")
    texts, ids, single = _inputs(raw.input)
    return EmbeddingsRequest(model=raw.model, texts=texts, token_ids=ids, encoding_format=raw.encoding_format,
                             dimensions=raw.dimensions, add_special_tokens=raw.add_special_tokens,
                             endianness=raw.endianness, single=single)


def _inputs(value: Any) -> tuple[list[str] | None, list[list[int]] | None, bool]:
    """(texts, token-id lists, whether the body gave a single input) of an `input` field."""
    if value is None:
        raise openai.fail("input", "Missing required parameter: 'input'.")
    single = isinstance(value, str) or (isinstance(value, list) and bool(value) and _is_id(value[0]))
    items = [value] if single else value
    if not isinstance(items, list) or not items:
        raise openai.fail("input", "'input' must be a non-empty string, list of strings, list of token ids or "
                                   "list of token-id lists.")
    if len(items) > MAX_INPUTS:
        raise openai.fail("input", f"at most {MAX_INPUTS} inputs may be embedded at once (got {len(items)}).")
    texts = isinstance(items[0], str)
    for i, item in enumerate(items):
        param = _input_param(single, i)
        if texts:
            if not isinstance(item, str):
                raise openai.fail(param, f"'{param}' must be a string, as the first input is.")
        elif not isinstance(item, list):
            raise openai.fail(param, f"'{param}' must be a list of token ids, as the first input is.")
        else:
            for j, token in enumerate(item):
                if not _is_id(token) or not 0 <= token < 2**32:
                    raise openai.fail(f"{param}[{j}]", f"'{param}[{j}]' must be a token id (an integer >= 0).")
        if not item:
            raise openai.fail(param, f"'{param}' must not be empty.")
    return (items, None, single) if texts else (None, items, single)


def _input_param(single: bool, index: int) -> str:
    """How errors name an input: `input` for a single one, `input[i]` in a list."""
    return "input" if single else f"input[{index}]"


def _is_id(value: Any) -> bool:
    return type(value) is int


def check_dimensions(dimensions: int | None, model: str, config: ModelRuntimeConfig) -> None:
    """`dimensions` only for a matryoshka model, and one its vectors can be cut to (vLLM's rule)."""
    if dimensions is None:
        return
    if not config.matryoshka:
        raise openai.fail("dimensions", f"model {model!r} does not support matryoshka representation: its "
                                        "vectors cannot be shortened; leave 'dimensions' out.")
    size = config.embedding_size
    if size is not None and not 1 <= dimensions <= size:
        raise openai.fail("dimensions", f"model {model!r} supports 'dimensions' from 1 to {size} "
                                        f"(got {dimensions}).")
    listed = config.matryoshka_dimensions
    if listed and dimensions not in listed:
        raise openai.fail("dimensions", f"model {model!r} supports 'dimensions' of {listed} only "
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
