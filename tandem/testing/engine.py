"""A deterministic worker that speaks the vLLM worker's protocol: it registers a model card for a
real model folder (real tokenizer) and answers `generate` with scripted tokens.

What it generates, decided from the prompt text:
  `[[say:TEXT]]`  the tokens of TEXT, then EOS
  `[[echo]]`      the request's options as JSON (to check what reached the engine), then EOS
  `[[prompt]]`    the prompt text it received (to check templating), then EOS
  `[[fail]]`      two tokens, then the handler raises (a worker error mid-stream)
  otherwise       the tokens of a fixed sentence, repeated until max_tokens
A request whose prompt already ends with the first k scripted tokens continues from token k, so a
migrated request (prompt + tokens generated so far) resumes the same sequence.

Knobs for failure tests: --delay-ms between tokens, --die-after N (SIGKILL itself after emitting N
tokens in total), --report FILE (appends "killed"/"done" per request), --total-kv-blocks (load
metrics on `kv_metrics` for overload tests).

    python -m tandem.testing.engine --model smollm2 [--model-name NAME] [--delay-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
from typing import Any

from tokenizers import Tokenizer

from tandem.llm.model_card import ModelType, build_card, register_model
from tandem.models import resolve_model
from tandem.runtime import DistributedRuntime, RuntimeConfig, add_runtime_args, configure_logging, run

DEFAULT_TEXT = " The quick brown fox jumps over the lazy dog."
_SAY = re.compile(r"\[\[say:(.*?)\]\]", re.S)


class TestEngine:
    def __init__(self, args: argparse.Namespace, model_path: str, worker_id: int) -> None:
        self.args = args
        self.tokenizer = Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
        self.eos = _eos_token_id(model_path)
        self.default_tokens = self.tokenizer.encode(DEFAULT_TEXT, add_special_tokens=False).ids
        self.block_size = args.block_size
        self.seen_blocks: set[tuple[int, ...]] = set()
        self.emitted_total = 0
        self.worker_id = worker_id
        self.active: dict[str, int] = {}  # request id -> tokens held (prompt + generated)
        self.load_publisher: Any = None

    def script(self, prompt_text: str, request: dict[str, Any]) -> tuple[list[int], bool]:
        """Tokens to produce and whether EOS follows them."""
        if "[[fail]]" in prompt_text:
            return self.tokenizer.encode(" partial output", add_special_tokens=False).ids, False
        if "[[prompt]]" in prompt_text:
            return self.tokenizer.encode(prompt_text.replace("[[prompt]]", ""), add_special_tokens=False).ids, True
        if "[[echo]]" in prompt_text:
            options = {k: request.get(k) for k in ("stop_conditions", "sampling_options", "output_options",
                                                   "eos_token_ids", "annotations", "routing", "mdc_sum")}
            return self.tokenizer.encode(json.dumps(options, sort_keys=True), add_special_tokens=False).ids, True
        match = _SAY.search(prompt_text)
        if match:
            return self.tokenizer.encode(match.group(1), add_special_tokens=False).ids, True
        max_tokens = (request.get("stop_conditions") or {}).get("max_tokens") or 16
        reps = max_tokens // max(len(self.default_tokens), 1) + 1
        return (self.default_tokens * reps)[:max_tokens], False

    def cached_tokens(self, token_ids: list[int]) -> int:
        """Leading full blocks seen in earlier prompts (a stand-in for prefix caching)."""
        cached = 0
        blocks = [tuple(token_ids[i : i + self.block_size])
                  for i in range(0, len(token_ids) - self.block_size + 1, self.block_size)]
        for n, block in enumerate(blocks):
            key = tuple(token_ids[: (n + 1) * self.block_size])
            if key in self.seen_blocks:
                cached += len(block)
            else:
                break
        for n in range(len(blocks)):
            self.seen_blocks.add(tuple(token_ids[: (n + 1) * self.block_size]))
        return cached

    def publish_load(self) -> None:
        if self.load_publisher is not None:
            used = sum(-(-held // self.block_size) for held in self.active.values())
            self.load_publisher.publish({"worker_id": self.worker_id, "dp_rank": 0, "kv_used_blocks": used,
                                         "active_decode_blocks": used, "active_prefill_tokens": 0})

    async def generate(self, request: dict[str, Any], context: Any):  # type: ignore[no-untyped-def]
        args = self.args
        token_ids: list[int] = request["token_ids"]
        stop = request.get("stop_conditions") or {}
        output = request.get("output_options") or {}
        prompt_text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        target, with_eos = self.script(prompt_text, request)
        resume = next((k for k in range(min(len(target), len(token_ids)), 0, -1)
                       if token_ids[-k:] == target[:k]), 0)
        target = target[resume:] + ([self.eos] if with_eos else [])
        max_tokens = stop.get("max_tokens")
        stop_ids = set(stop.get("stop_token_ids") or []) | set(stop.get("stop_token_ids_hidden") or [])
        if stop.get("ignore_eos"):
            stop_ids.discard(self.eos)
        usage = {"prompt_tokens": len(token_ids), "completion_tokens": 0, "total_tokens": len(token_ids),
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens(token_ids)}}
        self.active[context.id()] = len(token_ids)
        self.publish_load()
        finished = False
        try:
            for n, token in enumerate(target, 1):
                if context.is_stopped():
                    break
                if args.delay_ms:
                    await asyncio.sleep(args.delay_ms / 1000)
                item: dict[str, Any] = {"token_ids": [token]}
                if output.get("logprobs") is not None:
                    top = max(int(output["logprobs"]), 1)
                    item["log_probs"] = [-0.25]
                    item["top_logprobs"] = [[
                        {"rank": r + 1, "token_id": token + r, "token": self.tokenizer.id_to_token(token + r),
                         "logprob": -0.25 - r} for r in range(top)
                    ]]
                usage["completion_tokens"] = n
                usage["total_tokens"] = len(token_ids) + n
                self.active[context.id()] = len(token_ids) + n
                if token in stop_ids or token == self.eos:
                    item.update(finish_reason="stop", completion_usage=usage)
                    if token in stop_ids and token != self.eos:
                        item["stop_reason"] = token
                    finished = True
                elif (max_tokens is not None and n >= max_tokens) or n == len(target):
                    item.update(finish_reason="length", completion_usage=usage)
                    finished = True
                self.emitted_total += 1
                if "[[fail]]" in prompt_text and n == 2:
                    raise RuntimeError("the test engine failed as asked ([[fail]])")
                if args.die_after and self.emitted_total > args.die_after:
                    os.kill(os.getpid(), signal.SIGKILL)  # a crash, not a shutdown
                yield item
                if finished:
                    break
            if not finished:  # stopped by the caller
                yield {"token_ids": [], "finish_reason": "cancelled", "completion_usage": usage}
            _report(args.report, "done")
        except asyncio.CancelledError:
            _report(args.report, "killed" if context.is_killed() else "cancelled")
            raise
        finally:
            self.active.pop(context.id(), None)
            self.publish_load()


    async def generate_text(self, request: dict[str, Any], context: Any):  # type: ignore[no-untyped-def]
        """Text-input mode: an OpenAI chat request in, OpenAI chat chunks out (like --use-vllm-tokenizer)."""
        messages = request.get("messages") or []
        text = str(messages[-1].get("content", "")) if messages else ""
        match = _SAY.search(text)
        words = (match.group(1) if match else DEFAULT_TEXT).split(" ")
        for n, word in enumerate(words):
            if context.is_stopped():
                break
            if self.args.delay_ms:
                await asyncio.sleep(self.args.delay_ms / 1000)
            last = n == len(words) - 1
            chunk: dict[str, Any] = {
                "id": context.id(), "created": 0, "object": "chat.completion.chunk", "model": "unknown",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": word if n == 0 else " " + word},
                             "finish_reason": "stop" if last else None}],
            }
            if last:
                chunk["usage"] = {"prompt_tokens": len(text.split()), "completion_tokens": len(words),
                                  "total_tokens": len(text.split()) + len(words)}
            yield chunk


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


def _report(path: str | None, what: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(what + "\n")


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.testing.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="model folder, hub id or smollm2")
    parser.add_argument("--model-name", default=None, help="served model name (default: the folder's name)")
    parser.add_argument("--component", default="backend")
    parser.add_argument("--endpoint-types", default="chat,completions")
    parser.add_argument("--model-input", choices=["Tokens", "Text"], default="Tokens")
    parser.add_argument("--custom-jinja-template", default=None)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--total-kv-blocks", type=int, default=1024)
    parser.add_argument("--migration-limit", type=int, default=0)
    parser.add_argument("--lora", action="append", default=[], help="also serve a LoRA adapter of this name")
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--report", default=None)
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    configure_logging()
    model_path = resolve_model(args.model)
    runtime = await DistributedRuntime.create(RuntimeConfig.from_args(args))
    runtime.install_signal_handlers()
    component = runtime.namespace().component(args.component)
    endpoint = component.endpoint("generate")
    engine = TestEngine(args, model_path, runtime.instance_id)
    engine.load_publisher = await component.event_publisher("kv_metrics")
    handler = engine.generate if args.model_input == "Tokens" else engine.generate_text
    served = await endpoint.start_serving(handler, graceful_shutdown=args.migration_limit <= 0)
    card = build_card(
        model_path, args.model_name or os.path.basename(model_path.rstrip("/")),
        model_type=ModelType.parse(args.endpoint_types), model_input=args.model_input,
        kv_cache_block_size=args.block_size,
        context_length=args.context_length, migration_limit=args.migration_limit,
        custom_template_path=args.custom_jinja_template,
        runtime_config={"total_kv_blocks": args.total_kv_blocks, "max_num_seqs": 256,
                        "max_num_batched_tokens": 8192},
    )
    await register_model(endpoint, card)
    for name in args.lora:
        await register_model(endpoint, card.for_lora(name))
    runtime.set_ready()
    print(f"READY {runtime.instance_id:x} {served.path}", flush=True)
    await runtime.wait_closed()
    return 0


if __name__ == "__main__":
    sys.exit(run(lambda: main()))
