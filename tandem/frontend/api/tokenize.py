"""vLLM's tokenizer routes: `POST /tokenize` (a prompt, or chat messages through the model's chat
template, as the model's workers would get them) and `POST /detokenize`. Bodies are checked here; the
model's `Preprocessor` does the work."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from tandem.frontend.protocol.errors import fail
from tandem.frontend.protocol.validation import decode_body
from tandem.frontend.requests import TokenizeRequest, chat_request, check_messages, check_tools
from tandem.frontend.serving import Mount, Serving
from tandem.llm.model_card import ModelType

_ANY_MODEL = ModelType.Chat | ModelType.Completions | ModelType.Embedding  # the tokenizer routes serve every model


class _TokenizeBody(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None




class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


_tokenize_decoder = msgspec.json.Decoder(_TokenizeBody)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def parse_tokenize(body: bytes) -> TokenizeRequest:
    """Decode and check a /tokenize body (vLLM's completion or chat form); raises RequestError."""
    raw: _TokenizeBody = decode_body(_tokenize_decoder, body)
    if (raw.prompt is None) == (raw.messages is None):
        raise fail("prompt", "give either 'prompt' or 'messages'.")
    if raw.chat_template is not None:
        raise fail("chat_template", "a chat template in the request is not accepted (it is code the server "
                                           "would run): serve the model with --custom-jinja-template instead.")
    if raw.continue_final_message:
        raise fail("continue_final_message", "continue_final_message is not supported.")
    chat = None
    if raw.messages is None and raw.tools is not None:
        raise fail("tools", "tools belong to the chat form: send them with 'messages'.")
    if raw.messages is not None:
        if raw.tools:
            check_tools(raw.tools)
        chat = chat_request(model=raw.model or "-", messages=check_messages(raw.messages), stream=False,
                            max_tokens=None, tools=raw.tools,
                            chat_template_kwargs={"add_generation_prompt": raw.add_generation_prompt,
                                                  **(raw.chat_template_kwargs or {})})
    # vLLM's defaults: special tokens added to a plain prompt, not on top of a chat template's.
    special = raw.add_special_tokens if raw.add_special_tokens is not None else raw.messages is None
    return TokenizeRequest(model=raw.model, prompt=raw.prompt, chat=chat, add_special_tokens=special,
                           return_token_strs=bool(raw.return_token_strs))


def parse_detokenize(body: bytes) -> DetokenizeRequest:
    raw: DetokenizeRequest = decode_body(_detokenize_decoder, body)
    for i, token in enumerate(raw.tokens):
        if token < 0:
            raise fail(f"tokens[{i}]", f"'tokens[{i}]' must be a token id (an integer >= 0).")
    return raw


def tokenize_response(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}


def routes(serving: Serving) -> Mount:
    async def tokenize(request: web.Request) -> web.Response:
        body = await serving.body(request)
        parsed = parse_tokenize(body)
        model = serving.model(serving.named_or_only(parsed.model), _ANY_MODEL, "/tokenize")
        preprocessor = serving.token_input(model, "/tokenize")
        ids = await preprocessor.tokenize(parsed, len(body))
        strs = preprocessor.tokenizer.token_strs(ids) if parsed.return_token_strs else None
        return web.json_response(tokenize_response(ids, preprocessor.max_model_len, strs))

    async def detokenize(request: web.Request) -> web.Response:
        parsed = parse_detokenize(await serving.body(request))
        model = serving.model(serving.named_or_only(parsed.model), _ANY_MODEL, "/detokenize")
        return web.json_response({"prompt": serving.token_input(model, "/detokenize").detokenize(parsed.tokens)})

    return Mount([web.post("/tokenize", tokenize), web.post("/detokenize", detokenize)])
