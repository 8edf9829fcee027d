"""A deterministic worker that speaks the vLLM worker's protocol: it registers a model card for a
real model folder (real tokenizer) and answers `generate` with scripted tokens.

What it generates, decided from the prompt text:
  `[[say:TEXT]]`  the tokens of TEXT, then EOS (the last such directive in the prompt: in a conversation,
                  a tool result can carry the next one)
  `[[echo]]`      the request's options as JSON (to check what reached the engine), then EOS
  `[[prompt]]`    the prompt text it received, its EOS tokens left out (to check templating), then EOS
                  (an image is its one placeholder token there)
  `[[fail]]`      two tokens, then the handler raises (a worker error mid-stream)
  `[[images]]`    "images:" and each image's content digest (the first 8 hex digits of its bytes' sha256), in
                  the prompt's order, then EOS (to check which images reached the engine)
  otherwise       the tokens of a fixed sentence, repeated until max_tokens
A request with `prompt_embeds` (served with --enable-prompt-embeds) is answered "embeds N", N the tensor's
sequence length (its prompt tokens in usage), then EOS: tests see the tensor reach the engine.
A request whose prompt already ends with the first k scripted tokens continues from token k, so a
migrated request (prompt + tokens generated so far) resumes the same sequence.

With --enable-multimodal (a model folder whose config.json names its image token) it takes images as the
mocker does: each placeholder becomes --image-tokens tokens (in usage.prompt_tokens), the images are read,
never decoded, their content hashes key the prefix-cache stand-in (the same image is cached, another is
not), and each image not cached costs --image-encode-ms before the first token.

With `--endpoint-types embedding` it is an embedding model instead: each input's vector is a pseudo-random
unit vector of the model's hidden size, seeded by the input's token ids (the same input, the same vector),
cut to `dimensions` and normalized again when asked (it declares itself matryoshka).

Knobs for failure tests: --delay-ms between tokens, --die-after N (SIGKILL itself after emitting N
tokens in total), --report FILE (appends "killed"/"done" per request), --total-kv-blocks (load
metrics on `kv_metrics` for overload tests).

    python -m tandem.testing.engine --model smollm2 [--model-name NAME] [--delay-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import msgspec
from tokenizers import Tokenizer

from tandem.llm.model_card import ModelInput, ModelRuntimeConfig, ModelType, hidden_size_of
from tandem.llm.protocols import (
    CompletionUsage,
    EmbeddingOutput,
    EmbeddingRequest,
    FinishReason,
    LLMEngineOutput,
    PreprocessedRequest,
    RankedLogprob,
    TextRequest,
    text_chunk,
)
from tandem.models import default_served_name, resolve_model
from tandem.router.hashing import MediaSpan
from tandem.router.protocols import KV_METRICS_TOPIC, ActiveLoad
from tandem.runtime import (
    Context,
    DistributedRuntime,
    RuntimeConfig,
    add_runtime_args,
    configure_logging,
    run,
)
from tandem.runtime.options import MIGRATION_LIMIT, add_options, apply_options
from tandem.worker.config import (
    BLOCK_SIZE,
    CONTEXT_LENGTH,
    CUSTOM_JINJA_TEMPLATE,
    DEFAULT_ENDPOINT_TYPES,
    ENDPOINT_TYPES,
    MODEL_PATH,
    PARSER_OPTIONS,
    SERVED_MODEL_NAME,
    DisaggregationMode,
    check_parser_options,
    custom_template_path,
)
from tandem.worker.harness import WorkerSpec, serve_worker
from tandem.worker.images import ImagePrompts, SimulatedImages, add_image_args, simulated_images
from tandem.worker.synthetic import synthetic_embedding

DEFAULT_TEXT = " The quick brown fox jumps over the lazy dog."
_SAY = re.compile(r"\[\[say:(.*?)\]\]", re.S)


def _said(text: str) -> str | None:
    """The TEXT of the prompt's last `[[say:TEXT]]`, if any."""
    match = _SAY.match(text, text.rfind("[[say:")) if "[[say:" in text else None
    return match.group(1) if match else None



class TestEngine:
    def __init__(self, args: argparse.Namespace, model_path: str, worker_id: int,
                 images: SimulatedImages | None = None) -> None:
        self.args = args
        self.images = ImagePrompts(images, "the test engine")
        self.tokenizer = Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
        self.eos = _eos_token_id(model_path)
        self.default_tokens = self.tokenizer.encode(DEFAULT_TEXT, add_special_tokens=False).ids
        self.block_size = args.block_size
        self.seen_blocks: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        self.emitted_total = 0
        self.worker_id = worker_id
        self.active: dict[str, int] = {}  # request id -> tokens held (prompt + generated)
        self.load_publisher: Any = None
        self.hidden_size = hidden_size_of(model_path)

    def script(self, prompt_text: str, request: PreprocessedRequest,
               media: list[MediaSpan]) -> tuple[list[int], bool]:
        """Tokens to produce and whether EOS follows them."""
        if "[[images]]" in prompt_text:
            digests = "".join(f" {span.hash:016x}"[:9] for span in media)
            return self.tokenizer.encode(f"images:{digests}", add_special_tokens=False).ids, True
        if "[[fail]]" in prompt_text:
            return self.tokenizer.encode(" partial output", add_special_tokens=False).ids, False
        if "[[prompt]]" in prompt_text:
            ids = self.tokenizer.encode(prompt_text.replace("[[prompt]]", ""), add_special_tokens=False).ids
            return [t for t in ids if t != self.eos], True
        if "[[echo]]" in prompt_text:
            wire = msgspec.to_builtins(request)  # as the frontend sent it: absent options stay absent
            options = {k: wire.get(k) for k in ("stop_conditions", "sampling_options", "output_options",
                                                "eos_token_ids", "annotations", "routing", "mdc_sum")}
            return self.tokenizer.encode(json.dumps(options, sort_keys=True), add_special_tokens=False).ids, True
        said = _said(prompt_text)
        if said is not None:
            return self.tokenizer.encode(said, add_special_tokens=False).ids, True
        max_tokens = request.max_tokens or 16
        reps = max_tokens // max(len(self.default_tokens), 1) + 1
        return (self.default_tokens * reps)[:max_tokens], False

    async def embed(self, request: EmbeddingRequest, context: Context) -> AsyncIterator[EmbeddingOutput]:
        """The embedding engine: one vector per input (see the module docstring)."""
        if self.args.delay_ms:
            await asyncio.sleep(self.args.delay_ms / 1000)
        vectors = [synthetic_embedding(ids, self.hidden_size, request.dimensions) for ids in request.token_ids]
        tokens = sum(map(len, request.token_ids))
        yield EmbeddingOutput(vectors, tokens, tokens)

    def cached_tokens(self, token_ids: list[int], media: list[MediaSpan]) -> int:
        """Leading full blocks seen in earlier prompts (a stand-in for prefix caching); a block's key is the
        prompt up to its end and the content hashes of the images that start before it."""
        keys = [(tuple(token_ids[:end]), tuple(span.hash for span in media if span.offset < end))
                for end in range(self.block_size, len(token_ids) + 1, self.block_size)]
        cached = next((n for n, key in enumerate(keys) if key not in self.seen_blocks), len(keys)) * self.block_size
        self.seen_blocks.update(keys)
        return cached

    def publish_load(self) -> None:
        if self.load_publisher is not None:
            used = sum(-(-held // self.block_size) for held in self.active.values())
            self.load_publisher.publish(ActiveLoad(self.worker_id, kv_used_blocks=used, active_decode_blocks=used,
                                                   active_prefill_tokens=0))

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        args = self.args
        token_ids, media = await self.images.expand(request)
        stop = request.stop_conditions
        if request.prompt_embeds is not None:
            prompt_len = _embeds_rows(request.prompt_embeds)
            target, with_eos = self.tokenizer.encode(f"embeds {prompt_len}", add_special_tokens=False).ids, True
            prompt_text = ""
        else:
            prompt_len = len(token_ids)
            prompt_text = self.tokenizer.decode(request.token_ids, skip_special_tokens=False)
            target, with_eos = self.script(prompt_text, request, media)
        resume = next((k for k in range(min(len(target), len(token_ids)), 0, -1)
                       if token_ids[-k:] == target[:k]), 0)
        target = target[resume:] + ([self.eos] if with_eos else [])
        stop_ids = set(stop.stop_token_ids or []) | set(stop.stop_token_ids_hidden or [])
        if stop.ignore_eos:
            stop_ids.discard(self.eos)
        cached = self.cached_tokens(token_ids, media)
        encoded = sum(span.offset + span.length > cached for span in media)  # images the cache does not hold
        top_logprobs = request.output_options.logprobs
        self.active[context.id()] = prompt_len
        self.publish_load()
        finished = False
        n = 0
        try:
            if encoded and self.images.images is not None and self.images.images.encode_ms:
                await asyncio.sleep(encoded * self.images.images.encode_ms / 1000)
            for n, token in enumerate(target, 1):
                if context.is_stopped():
                    n -= 1
                    break
                if args.delay_ms:
                    await asyncio.sleep(args.delay_ms / 1000)
                item = LLMEngineOutput([token])
                if top_logprobs is not None:
                    item.log_probs = [-0.25]
                    item.top_logprobs = [[RankedLogprob(r + 1, token + r, self.tokenizer.id_to_token(token + r),
                                                        -0.25 - r) for r in range(max(top_logprobs, 1))]]
                self.active[context.id()] = prompt_len + n
                if token in stop_ids or token == self.eos:
                    item.finish_reason = FinishReason.STOP
                    if token in stop_ids and token != self.eos:
                        item.stop_reason = token
                    finished = True
                elif (stop.max_tokens is not None and n >= stop.max_tokens) or n == len(target):
                    item.finish_reason = FinishReason.LENGTH
                    finished = True
                if finished:
                    item.completion_usage = CompletionUsage.of(prompt_len, n, cached)
                self.emitted_total += 1
                if "[[fail]]" in prompt_text and n == 2:
                    raise RuntimeError("the test engine failed as asked ([[fail]])")
                if args.die_after and self.emitted_total > args.die_after:
                    os.kill(os.getpid(), signal.SIGKILL)  # a crash, not a shutdown
                yield item
                if finished:
                    break
            if not finished:  # stopped by the caller
                yield LLMEngineOutput.cancelled(CompletionUsage.of(prompt_len, n, cached))
            _report(args.report, "done")
        except asyncio.CancelledError:
            _report(args.report, "killed" if context.is_killed() else "cancelled")
            raise
        finally:
            self.active.pop(context.id(), None)
            self.publish_load()

    async def generate_text(self, request: TextRequest, context: Context) -> AsyncIterator[dict[str, Any]]:
        """Text-input mode: an OpenAI chat request in, OpenAI chat chunks out (like --use-vllm-tokenizer)."""
        messages = request.messages or []
        text = str(messages[-1].get("content", "")) if messages else ""
        said = _said(text)
        words = (DEFAULT_TEXT if said is None else said).split(" ")
        for n, word in enumerate(words):
            if context.is_stopped():
                break
            if self.args.delay_ms:
                await asyncio.sleep(self.args.delay_ms / 1000)
            last = n == len(words) - 1
            prompt_words = len(text.split())
            yield text_chunk(context.id(), word if n == 0 else " " + word, FinishReason.STOP if last else None,
                             CompletionUsage.of(prompt_words, len(words)) if last else None)


class EmbeddingTestEngine(TestEngine):
    """The test engine as an embedding model: `generate` takes an `EmbeddingRequest`."""

    generate = TestEngine.embed  # type: ignore[assignment]


class TextTestEngine(TestEngine):
    """The test engine with text input: `generate` takes the client's OpenAI request."""

    generate = TestEngine.generate_text  # type: ignore[assignment]


def _model_config(model: str) -> dict[str, object]:
    with open(os.path.join(resolve_model(model), "config.json")) as f:
        config: dict[str, object] = json.load(f)
    return config


def _eos_token_id(folder: str) -> int:
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(folder, name)) as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(eos, list) and eos:
            return int(eos[0])
        if isinstance(eos, int):
            return eos
    raise ValueError(f"no eos_token_id in {folder}")


def _embeds_rows(encoded: str) -> int:
    """The sequence length of a prompt_embeds tensor, [seq_len, hidden] or [1, seq_len, hidden] (the frontend
    checked it)."""
    import torch

    tensor = torch.load(io.BytesIO(base64.b64decode(encoded)), weights_only=True, map_location="cpu")
    return int(tensor.shape[-2])


def _report(path: str | None, what: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(what + "\n")


# The worker flags the test engine shares with the other worker kinds, and its defaults.
_WORKER_OPTIONS = (MODEL_PATH, SERVED_MODEL_NAME, ENDPOINT_TYPES, CUSTOM_JINJA_TEMPLATE, CONTEXT_LENGTH, BLOCK_SIZE,
                   MIGRATION_LIMIT, *PARSER_OPTIONS)
_DEFAULTS = SimpleNamespace(model_path="smollm2", served_model_name=None, endpoint_types=DEFAULT_ENDPOINT_TYPES,
                            custom_jinja_template=None, context_length=None, block_size=16, migration_limit=0,
                            dyn_tool_call_parser=None, dyn_reasoning_parser=None, allow_private_media_urls=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tandem.testing.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, _WORKER_OPTIONS, _DEFAULTS)
    parser.add_argument("--component", default="backend")
    parser.add_argument("--model-input", choices=["Tokens", "Text"], default="Tokens")
    parser.add_argument("--total-kv-blocks", type=int, default=1024)
    parser.add_argument("--enable-prompt-embeds", action="store_true", help="take prompt_embeds, as vLLM's flag")
    parser.add_argument("--lora", action="append", default=[], help="also serve a LoRA adapter of this name")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--report", default=None)
    add_image_args(parser, _DEFAULTS)
    add_runtime_args(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, SimpleNamespace]:
    """The flags, and the shared worker settings (each from its flag, else its env var, else `_DEFAULTS`;
    `images`: the --enable-multimodal settings), checked; a bad one exits 2 naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        worker = apply_options(SimpleNamespace(**vars(_DEFAULTS)), _WORKER_OPTIONS, args)
        worker.custom_jinja_template = custom_template_path(worker.custom_jinja_template)
        check_parser_options(worker.dyn_tool_call_parser, worker.dyn_reasoning_parser)
        if args.enable_multimodal and (args.model_input == ModelInput.Text
                                       or ModelType.parse(worker.endpoint_types) & ModelType.Embedding):
            raise ValueError("--enable-multimodal: images are taken by a generation model with token input only")
        worker.images = simulated_images(args, _model_config(worker.model_path) if args.enable_multimodal else {})
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    args.block_size = worker.block_size  # the engine's
    return args, worker


async def main(argv: list[str] | None = None) -> int:
    args, worker = parse_args(argv)
    configure_logging()
    model_path = resolve_model(worker.model_path)
    runtime = await DistributedRuntime.create(RuntimeConfig.from_args(args))
    runtime.install_signal_handlers()
    component = runtime.namespace().component(args.component)
    model_type = ModelType.parse(worker.endpoint_types)
    embedding = bool(model_type & ModelType.Embedding)
    kind = TextTestEngine if args.model_input == ModelInput.Text else EmbeddingTestEngine if embedding else TestEngine
    engine = kind(args, model_path, runtime.instance_id, worker.images)
    runtime.add_shutdown_hook(engine.images.close)  # the image fetcher's connections
    engine.load_publisher = await component.event_publisher(KV_METRICS_TOPIC)
    spec = WorkerSpec(
        model_path, worker.served_model_name or default_served_name(worker.model_path, model_path),
        DisaggregationMode.AGGREGATED, worker.block_size, worker.migration_limit, model_type=model_type,
        model_input=ModelInput(args.model_input), context_length=worker.context_length,
        custom_template_path=worker.custom_jinja_template, loras=args.lora,
        runtime_config=ModelRuntimeConfig(total_kv_blocks=args.total_kv_blocks, max_num_seqs=256,
                                          max_num_batched_tokens=8192, tool_call_parser=worker.dyn_tool_call_parser,
                                          reasoning_parser=worker.dyn_reasoning_parser,
                                          enable_prompt_embeds=args.enable_prompt_embeds,
                                          embedding_size=engine.hidden_size if embedding else None,
                                          matryoshka=embedding,
                                          **(worker.images.card_fields() if worker.images else {})),
    )
    await serve_worker(component, engine, spec, summary="test engine")
    await runtime.wait_closed()
    return 0


if __name__ == "__main__":
    sys.exit(run(lambda: main()))
