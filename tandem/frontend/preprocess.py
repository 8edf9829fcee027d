"""Preprocessing for token-input models: an OpenAI request in, a `PreprocessedRequest` (the prompt
templated and tokenized, the limits checked) and the `OutputProcessor` that turns the worker's tokens
back into text out. `Preprocessor.prepare` is the one entry point."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec

from tandem.frontend.protocol.errors import RequestError
from tandem.frontend.protocol.validation import MAX_TOKENS_LIMIT
from tandem.frontend.requests import (
    AnyRequest,
    ChatRequest,
    CompletionRequest,
    EmbeddingsRequest,
    ImagePart,
    Nvext,
    TokenizeRequest,
)
from tandem.llm import prompt_embeds
from tandem.llm.chat_template import ChatTemplate
from tandem.llm.model_card import hidden_size_of
from tandem.llm.parsers import (
    ChatParser,
    chat_parser,
    check_reasoning_parser,
    check_tool_parser,
    needs_special_tokens,
)
from tandem.llm.postprocess import OutputProcessor
from tandem.llm.protocols import (
    MediaItem,
    MultiModalData,
    OutputOptions,
    PreprocessedRequest,
    RoutingHints,
    SamplingOptions,
    StopConditions,
)
from tandem.llm.tokenizer import Tokenizer, TooManyTokens

if TYPE_CHECKING:
    from tandem.frontend.models import ServedModel

# Request bodies above this size are templated and tokenized in a thread: a 7k-token prompt costs tens of
# milliseconds, which on the event loop would stall every other stream.
OFF_LOOP_PROMPT_BYTES = 8192

# Prompt bound for a model whose card declares no context length.
UNKNOWN_CONTEXT_TOKENS = 1 << 20


@dataclass(frozen=True)
class ParserNames:
    """The tool-call and reasoning parsers of a model (its card's, unless the frontend overrides them)."""

    tool_call: str | None = None
    reasoning: str | None = None

    def checked(self) -> ParserNames:
        """Raises UnknownParserError for a name that is not built."""
        return ParserNames(check_tool_parser(self.tool_call) if self.tool_call else None,
                           check_reasoning_parser(self.reasoning) if self.reasoning else None)


@dataclass
class Prepared:
    """A client request made ready for a worker: what the worker gets, what turns its tokens into text,
    and what finds the thinking and tool calls in that text (None when there is nothing to find)."""

    request: PreprocessedRequest
    processor: OutputProcessor
    prompt_tokens: int  # the prompt's length: its token ids, or the rows of its prompt embeddings
    parser: ChatParser | None = None
    prompt_text: str = ""  # a chat request's templated prompt (nvext's `formatted_prompt` annotation)

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.token_ids


class Preprocessor:
    """Chat template + tokenizer of one model (token-input models): `prepare` is the one entry point.

    A prompt is refused before it is tokenized when it has more characters than could fit the context
    (context length x the longest token), and tokenizing stops once it has more tokens than fit: a huge
    body costs a bounded amount of memory and CPU before its 400."""

    def __init__(self, model: ServedModel, overrides: ParserNames | None = None) -> None:
        """`overrides`: the frontend's tool-call and reasoning parsers, instead of the card's."""
        self.model = model.name
        config = model.card.runtime_config
        overrides = overrides or ParserNames()
        self.parsers = ParserNames(overrides.tool_call or config.tool_call_parser,
                                   overrides.reasoning or config.reasoning_parser).checked()
        self.mdcsum = model.card.mdcsum
        self.tokenizer = Tokenizer.from_folder(model.folder)
        template = model.card.chat_template or self.tokenizer.chat_template
        self.template = (
            ChatTemplate(template, bos_token=self.tokenizer.bos_token, eos_token=self.tokenizer.eos_token)
            if template else None
        )
        self.context_length = model.card.context_length
        # Prompts may hold at most this many tokens: the context minus one generated token.
        self.max_prompt_tokens = (self.context_length or UNKNOWN_CONTEXT_TOKENS) - 1
        self.takes_prompt_embeds = config.enable_prompt_embeds
        self.image_token_id = config.image_token_id  # None: the model takes no images
        self.max_images = config.max_images
        self.hidden_size = hidden_size_of(model.folder) if self.takes_prompt_embeds else 0

    async def prepare(self, request: ChatRequest | CompletionRequest, body_size: int,
                      routing: RoutingHints | None) -> Prepared:
        """The prompt (templated and tokenized; off the event loop for a large body, the tokenizer drops
        the GIL; or a completion's prompt embeddings, checked), the worker request with its limits checked,
        and its output processor."""
        if isinstance(request, CompletionRequest) and request.prompt_embeds is not None:
            self._check_takes_prompt_embeds()
            # Off the event loop whatever the size: torch's first import alone takes seconds.
            prompt_ids, prompt = [], ""
            prompt_len = await asyncio.to_thread(self.prompt_embeds_length, request.prompt_embeds)
        else:
            render: Any = (partial(self.chat_prompt, request) if isinstance(request, ChatRequest)
                           else partial(self._completion, request))
            if isinstance(request, ChatRequest) and request.images:
                self._check_images(request.images)
            prompt_ids, prompt = await asyncio.to_thread(render) if body_size > OFF_LOOP_PROMPT_BYTES else render()
            prompt_len = len(prompt_ids)
        preprocessed = self.worker_request(request, prompt_ids, routing, prompt_len)
        if isinstance(request, ChatRequest) and request.images:
            preprocessed.multi_modal_data = self._images_of(request.images, prompt_ids)
        parser = self.chat_parser(request, prompt) if isinstance(request, ChatRequest) else None
        if parser is not None and preprocessed.output_options.skip_special_tokens is None and \
                needs_special_tokens(self.parsers.tool_call, self.parsers.reasoning):
            preprocessed.output_options.skip_special_tokens = False  # the family's markers are special tokens
        processor = OutputProcessor(self.tokenizer, prompt_ids, preprocessed.stop_conditions,
                                    preprocessed.sampling_options, preprocessed.output_options)
        return Prepared(preprocessed, processor, prompt_len, parser, prompt)

    def _check_images(self, images: list[ImagePart]) -> None:
        if self.image_token_id is None:
            raise RequestError(f"model {self.model!r} does not take images", param=images[0].param)
        if self.max_images is not None and len(images) > self.max_images:
            raise RequestError(f"at most {self.max_images} images per request (got {len(images)})",
                               param=images[self.max_images].param)

    def _images_of(self, images: list[ImagePart], prompt_ids: list[int]) -> MultiModalData:
        """The images for the worker, once the template has put one placeholder token where each goes (text
        that spells the placeholder itself would add one: refused, not passed on as an image that is not there)."""
        placed = prompt_ids.count(self.image_token_id)  # type: ignore[arg-type]
        if placed != len(images):
            raise RequestError(f"the prompt holds {placed} image placeholders for {len(images)} images: the "
                               "model's chat template must place each image part, and the text must not hold "
                               "the placeholder", param="messages")
        return MultiModalData(image_url=[MediaItem(image.url) for image in images])

    async def count_prompt_tokens(self, request: ChatRequest, body_size: int) -> int:
        """The tokens of the request's templated prompt (the token-counting routes)."""
        if request.images:  # their tokens are the engine's to count
            raise RequestError("counting the tokens of a prompt with images is not supported yet",
                               param=request.images[0].param)
        render = partial(self.chat_prompt, request)
        prompt_ids, _ = await asyncio.to_thread(render) if body_size > OFF_LOOP_PROMPT_BYTES else render()
        return len(prompt_ids)

    async def tokenize(self, request: TokenizeRequest, body_size: int) -> list[int]:
        """The token ids of a /tokenize request's prompt (its chat messages templated), bounded by the context."""
        if request.chat is not None:
            text, param = self.chat_text(request.chat), "messages"
        else:
            text, param = request.prompt or "", "prompt"
        encode = partial(self._encode, text, param, add_special_tokens=request.add_special_tokens)
        return await asyncio.to_thread(encode) if body_size > OFF_LOOP_PROMPT_BYTES else encode()

    async def embedding_inputs(self, request: EmbeddingsRequest, body_size: int) -> list[list[int]]:
        """The token ids of each input of an embeddings request (its texts tokenized), each within the
        context length."""
        encode = partial(self._embedding_inputs, request)
        return await asyncio.to_thread(encode) if body_size > OFF_LOOP_PROMPT_BYTES else encode()

    def _embedding_inputs(self, request: EmbeddingsRequest) -> list[list[int]]:
        if request.texts is not None:
            return [self._encode(text, request.param(i), add_special_tokens=request.add_special_tokens,
                                 limit=self.max_model_len) for i, text in enumerate(request.texts)]
        vocab = self.tokenizer.vocab_size
        for i, ids in enumerate(request.token_ids or ()):
            param = request.param(i)
            if len(ids) > self.max_model_len:
                raise self._too_long(f"{len(ids)} tokens", param)
            for j, token in enumerate(ids):
                if token >= vocab:
                    raise RequestError(f"'{param}[{j}]' is not in the vocabulary (its ids are below {vocab}).",
                                              param=f"{param}[{j}]")
        return list(request.token_ids or ())

    @property
    def max_model_len(self) -> int:
        return self.context_length or UNKNOWN_CONTEXT_TOKENS

    def detokenize(self, ids: list[int]) -> str:
        vocab = self.tokenizer.vocab_size
        for i, token in enumerate(ids):
            if token >= vocab:
                raise RequestError(f"'tokens[{i}]' is not in the vocabulary (its ids are below {vocab}).",
                                          param=f"tokens[{i}]")
        return self.tokenizer.decode(ids)

    def chat_parser(self, request: ChatRequest, prompt: str) -> ChatParser | None:
        """The request's output parser: the model's parsers, as the request's tools, tool_choice and
        thinking switch use them."""
        if request.ext.max_thinking_tokens is not None and self.parsers.reasoning is None:
            raise RequestError(f"nvext.max_thinking_tokens needs a reasoning parser, and model "
                                      f"{self.model!r} is served without one (--dyn-reasoning-parser)",
                                      param="nvext.max_thinking_tokens")
        return chat_parser(tool_parser=self.parsers.tool_call, reasoning_parser=self.parsers.reasoning,
                           tools=request.tools, tool_choice=request.tool_choice,
                           forced_function=request.forced_function, thinking=request.thinking, prompt=prompt,
                           parallel_tool_calls=request.parallel_tool_calls is not False)

    def chat_prompt(self, request: ChatRequest) -> tuple[list[int], str]:
        """The prompt's token ids and text."""
        text = self.chat_text(request)
        return self._encode(text, request.names.prompt), text

    def _completion(self, request: CompletionRequest) -> tuple[list[int], str]:
        return self.completion_prompt(request), ""

    def _check_takes_prompt_embeds(self) -> None:
        if not self.takes_prompt_embeds:
            raise RequestError(f"model {self.model!r}'s workers do not take prompt embeddings (they run "
                                      "without vLLM's --enable-prompt-embeds); send 'prompt'", param="prompt_embeds")

    def prompt_embeds_length(self, encoded: str) -> int:
        """The rows of a completion's `prompt_embeds` (`tandem.llm.prompt_embeds.load` checks it against this
        model: hidden size, context length)."""
        try:
            tensor = prompt_embeds.load(encoded, hidden_size=self.hidden_size or None, max_len=self.max_prompt_tokens)
        except prompt_embeds.PromptEmbedsError as e:
            raise RequestError(str(e), param="prompt_embeds") from None
        except ImportError:
            raise RequestError("this frontend cannot read 'prompt_embeds': torch is not installed here",
                                      status=501, param="prompt_embeds") from None
        return int(tensor.shape[0])

    def chat_text(self, request: ChatRequest) -> str:
        """The templated prompt (tools left out when tool_choice is none)."""
        if self.template is None:
            raise RequestError("this model has no chat template; use /v1/completions",
                                      param=request.names.prompt)
        use_raw = bool(request.ext.use_raw_prompt)
        if use_raw:
            text = "".join(_text_of(m.get("content")) for m in request.messages)
        else:
            tools = request.tools if request.tool_choice != "none" else None
            try:
                text = self.template.render(request.messages, tools=tools,
                                            chat_template_kwargs=request.template_kwargs())
            except ValueError as e:
                raise RequestError(f"cannot apply the chat template: {e}", param=request.names.prompt) from None
        return text

    def completion_prompt(self, request: CompletionRequest) -> list[int]:
        param = request.names.prompt
        if isinstance(request.prompt, str):
            return self._encode(request.prompt, param)
        if len(request.prompt) > self.max_prompt_tokens:
            raise self._too_long(f"{len(request.prompt)} tokens", param)
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt):
            raise RequestError(f"{param} token ids must be in [0, {vocab})", param=param)
        return list(request.prompt)

    def worker_request(self, request: ChatRequest | CompletionRequest, prompt_ids: list[int],
                       routing: RoutingHints | None, prompt_len: int | None = None) -> PreprocessedRequest:
        """The request a worker gets: `max_tokens` bounded by what the context leaves (the one place it is
        checked against the context), EOS as hidden stop ids unless `ignore_eos`. `prompt_len`: the
        prompt's length when it is not its ids (the rows of a completion's `prompt_embeds`)."""
        tokenizer = self.tokenizer
        stop = stop_conditions(request)
        names = request.names
        context_length = self.context_length
        prompt_len = len(prompt_ids) if prompt_len is None else prompt_len
        if context_length:
            if prompt_len >= context_length:
                raise RequestError(
                    f"this model's maximum context length is {context_length} tokens, but the prompt has "
                    f"{prompt_len} tokens", param=names.prompt,
                )
            room = context_length - prompt_len
            if stop.max_tokens is None:
                stop.max_tokens = room
            elif stop.max_tokens > room and isinstance(request, ChatRequest) and request.fit_max_tokens:
                stop.max_tokens = room
            elif stop.max_tokens > room:
                raise RequestError(
                    f"this model's maximum context length is {context_length} tokens; the prompt has "
                    f"{prompt_len} tokens and {names.max_tokens} is {stop.max_tokens}",
                    param=names.max_tokens,
                )
        elif stop.max_tokens is not None and stop.max_tokens >= MAX_TOKENS_LIMIT:
            raise RequestError(f"{names.max_tokens} must be less than {MAX_TOKENS_LIMIT} "
                                      f"(got {stop.max_tokens})", param=names.max_tokens)
        eos = list(tokenizer.eos_token_ids)
        if stop.ignore_eos:
            stop.stop = None
            stop.stop_token_ids = None
            stop.stop_token_ids_hidden = None
            eos_ids: list[int] = []
        else:
            stop.stop_token_ids_hidden = eos
            eos_ids = eos
        ext = request.ext
        return PreprocessedRequest(
            model=self.model,
            token_ids=prompt_ids,
            stop_conditions=stop,
            sampling_options=sampling_options(request),
            output_options=output_options(request),
            eos_token_ids=eos_ids,
            mdc_sum=self.mdcsum,
            annotations=list(ext.annotations),
            routing=routing,
            extra_args={"nvext": msgspec.to_builtins(ext)} if ext != Nvext() else None,
            prompt_embeds=request.prompt_embeds if isinstance(request, CompletionRequest) else None,
        )

    def _encode(self, text: str, param: str, *, add_special_tokens: bool = False, limit: int | None = None) -> list[int]:
        """`text`'s token ids, at most `limit` of them (a prompt's bound by default: the context minus the
        one token it generates)."""
        limit = self.max_prompt_tokens if limit is None else limit
        max_chars = (limit + 1) * self.tokenizer.longest_token_chars
        if len(text) > max_chars:
            raise self._too_long(f"{len(text)} characters (at most {max_chars} can fit)", param)
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens, limit=limit)
        except TooManyTokens as e:
            raise self._too_long(f"at least {e.at_least} tokens", param) from None

    def _too_long(self, size: str, param: str) -> RequestError:
        context = f"{self.context_length} tokens" if self.context_length else \
            f"{self.max_prompt_tokens + 1} tokens (the model declares none; this is the frontend's bound)"
        return RequestError(f"this model's maximum context length is {context}, but the prompt has {size}",
                                   param=param)


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


# -- the request in the worker contract's terms --------------------------------------------------

_SAMPLING = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
             "include_stop_str_in_output")  # fmt: skip


def sampling_options(req: AnyRequest) -> SamplingOptions:
    """Unset fields stay None (engine defaults); nvext.greed_sampling forces temperature 0."""
    temperature = 0.0 if req.ext.greed_sampling else req.temperature
    return SamplingOptions(temperature=temperature, guided_decoding=req.guided, **{k: getattr(req, k) for k in _SAMPLING})


def stop_conditions(req: AnyRequest) -> StopConditions:
    """The user's stop conditions; the preprocessor adds the model's hidden EOS ids (and applies ignore_eos)."""
    return StopConditions(max_tokens=req.max_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids or None,
                          min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                          max_thinking_tokens=req.ext.max_thinking_tokens)  # fmt: skip


def output_options(req: AnyRequest) -> OutputOptions:
    if isinstance(req, ChatRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    return OutputOptions(logprobs=logprobs, skip_special_tokens=req.skip_special_tokens)
