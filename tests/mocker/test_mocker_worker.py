"""The mocker as a worker: real processes (frontend + `python -m tandem.mocker`), the official
openai client, the runtime's event plane."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.router.hashing import XXH3_SEED, local_block_hashes, sequence_hashes
from tests.support.deployment import MODEL, Deployment, metric_sum
from tests.support.ports import free_port

BLOCK = 16
MOCKER = ["--block-size", str(BLOCK), "--speedup-ratio", "50", "--num-gpu-blocks-override", "4096"]


@pytest.fixture(scope="module")
def mocker(tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path_factory.mktemp("mocker"), smollm2, engine_module="tandem.mocker",
                            engines=[MOCKER], engine_env={"DYN_SYSTEM_PORT": str(free_port())})
    deployment.system_url = f"http://127.0.0.1:{deployment.engine_env['DYN_SYSTEM_PORT']}"  # type: ignore[attr-defined]
    yield deployment
    deployment.stop()


def _prompt(n_words: int, tag: str) -> str:
    return f"{tag} " + " ".join(f"word{i}" for i in range(n_words))


def test_output_is_deterministic_and_has_max_tokens(mocker: Deployment) -> None:
    client = mocker.client()
    first = client.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=12)
    second = client.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=12)
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].text.strip()
    assert first.usage.completion_tokens == 12
    assert first.choices[0].finish_reason == "length"
    other_seed = client.completions.create(model=MODEL, prompt="Tell me a story", max_tokens=12, seed=7)
    assert other_seed.choices[0].text != first.choices[0].text


def test_stream_equals_non_stream(mocker: Deployment) -> None:
    client = mocker.client()
    messages = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in chunks:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].message.content
    assert usage is not None and usage.completion_tokens == 20


def test_prefix_cache_hits_are_reported_as_cached_tokens(mocker: Deployment) -> None:
    client = mocker.client()
    prompt = _prompt(120, "cache")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # vLLM's rule: the last prompt token is never a hit, so full blocks of the first n-1 tokens.
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK


def test_kv_events_carry_the_routers_block_hashes(mocker: Deployment, tok) -> None:  # type: ignore[no-untyped-def]
    prompt = _prompt(90, "events")
    token_ids = tok.encode(prompt)

    async def complete(prompt: str | list[int]) -> None:
        await asyncio.to_thread(lambda: mocker.client().completions.create(model=MODEL, prompt=prompt, max_tokens=1))

    async def watch() -> list[dict]:
        runtime = await mocker.runtime()
        events: list[dict] = []
        try:
            subscriber = await runtime.namespace(mocker.namespace).component("backend").subscribe("kv-events")
            # PUB/SUB loses what is published before the subscription reaches the worker: fresh prompts
            # (each stores blocks, so the worker publishes an event) until one of their events arrives.
            async with asyncio.timeout(15):
                for probe in itertools.count():
                    await complete(_prompt(20, f"probe{probe}"))
                    try:
                        async with asyncio.timeout(0.2):
                            await subscriber.__anext__()
                        break
                    except TimeoutError:
                        continue
            first_id = await asyncio.to_thread(mocker.kv_events_emitted)  # the prompt's events come from here
            await complete(token_ids)
            async with asyncio.timeout(15):
                while sum(len(e["event"]["data"]["stored"]["blocks"]) for e in events) < len(token_ids) // BLOCK:
                    event = await subscriber.__anext__()
                    if event["event"]["event_id"] < first_id:
                        continue  # a probe's
                    assert isinstance(event["event"]["data"], dict) and "stored" in event["event"]["data"], event
                    events.append(event)
            return events
        finally:
            await runtime.shutdown()

    events = asyncio.run(watch())
    stored = [b for e in events for b in e["event"]["data"]["stored"]["blocks"]]
    local = local_block_hashes(token_ids, BLOCK, XXH3_SEED)
    assert [b["tokens_hash"] for b in stored] == local[: len(stored)]
    assert [b["block_hash"] for b in stored] == sequence_hashes(local)[: len(stored)]
    assert events[0]["event"]["data"]["stored"]["parent_hash"] is None


def test_clear_kv_blocks_empties_the_prefix_cache(mocker: Deployment) -> None:
    client = mocker.client()
    prompt = _prompt(80, "clear")
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert mocker.call("backend.clear_kv_blocks", {})[0]["status"] == "success"
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def _kv_usage(system_url: str) -> float:
    """The KV cache usage the worker whose system server is at `system_url` reports."""
    text = httpx.get(f"{system_url}/metrics").text
    line = next(line for line in text.splitlines()
                if line.startswith("dynamo_component_kvstats_gpu_cache_usage_percent{"))
    return float(line.rsplit(" ", 1)[1])


def test_cancelled_stream_frees_the_engine(mocker: Deployment) -> None:
    """A worker at a tenth of real time: the stream's 5,000 tokens would take it some five minutes, so only
    the abort of the closed stream can free its blocks before the deadline."""
    port = free_port()
    slow = mocker.add_engine("--block-size", str(BLOCK), "--speedup-ratio", "0.1", "--num-gpu-blocks-override", "4096",
                             "--model-name", "slow", "--endpoint", f"dyn://{mocker.namespace}.slow.generate",
                             env={"DYN_SYSTEM_PORT": str(port)})
    system_url = f"http://127.0.0.1:{port}"
    try:
        mocker.wait_for_instances(2)
        client = mocker.client()
        stream = client.completions.create(model="slow", prompt=_prompt(200, "forever"), max_tokens=5000, stream=True)
        next(iter(stream))
        assert _kv_usage(system_url) > 0
        stream.close()
        deadline = time.monotonic() + 10
        while _kv_usage(system_url) > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _kv_usage(system_url) == 0  # the request was aborted in the engine, its blocks released
        reply = client.completions.create(model="slow", prompt="after the cancel", max_tokens=3)
        assert reply.usage.completion_tokens == 3
    finally:
        slow.stop()
        mocker.engines.remove(slow)


def _requests_served(system_url: str) -> float:
    text = httpx.get(f"{system_url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dynamo_component_requests_total{") and 'endpoint="generate"' in line)


def test_prefill_and_decode_workers(tmp_path: Path, smollm2: str) -> None:
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker",
                            engines=[[*MOCKER, "--disaggregation-mode", "decode"]])
    try:
        port = free_port()
        deployment.engine_env = {"DYN_SYSTEM_PORT": str(port)}
        deployment.add_engine(*MOCKER, "--disaggregation-mode", "prefill", "--kv-transfer-bandwidth", "0")
        prefill_url = f"http://127.0.0.1:{port}"
        # The worker endpoints directly: one token and the KV hand-off, then decode from it.
        request = {"model": MODEL, "token_ids": list(range(100, 180)), "stop_conditions": {"max_tokens": 8}}
        prefill = deployment.call("prefill.generate", request)
        assert len(prefill) == 1 and len(prefill[0]["token_ids"]) == 1
        params = prefill[0]["disaggregated_params"]["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["num_prompt_tokens"] == 80
        decoded = deployment.call("backend.generate", {**request, "prefill_result": {
            "disaggregated_params": prefill[0]["disaggregated_params"],
            "prompt_tokens_details": {"cached_tokens": 0}}})
        assert sum(len(item["token_ids"]) for item in decoded) == 8
        assert decoded[-1]["finish_reason"] == "length"
        # It waited for the simulated KV transfer (80 tokens at 64 GB/s, 50x faster) and says how long.
        assert decoded[0]["kv_transfer_ms"] == pytest.approx(80 * _SMOLLM2_KV_BYTES / 64e9 / 50 * 1000)
        assert all("kv_transfer_ms" not in item for item in decoded[1:])
        assert decoded[-1]["completion_usage"]["prompt_tokens"] == 80
        # Through the frontend: once it knows the prefill worker, every request prefills there first.
        before = _requests_served(prefill_url)
        client = deployment.client()
        deadline = time.monotonic() + 10
        while _requests_served(prefill_url) == before and time.monotonic() < deadline:
            reply = client.completions.create(model=MODEL, prompt=_prompt(60, "disagg"), max_tokens=5)
            assert reply.usage.completion_tokens == 5
        served = _requests_served(prefill_url)
        assert served > before
        client.completions.create(model=MODEL, prompt=_prompt(60, "disagg again"), max_tokens=5)
        assert _requests_served(prefill_url) == served + 1
    finally:
        deployment.stop()


# SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 64 dims x 2 bytes (bfloat16)
_SMOLLM2_KV_BYTES = 30 * 2 * 3 * 64 * 2


def test_roles_and_kv_events(smollm2: str) -> None:
    """Prefill and aggregated workers publish KV events (routers choose them by cached prefix); decode
    workers do not, unless conditional disaggregation needs their caches."""
    from tandem.mocker.args import parse_args

    def config(*flags: str):  # type: ignore[no-untyped-def]
        return parse_args(["--model-path", smollm2, *flags])

    assert config().publishes_kv_events and config("--is-prefill-worker").publishes_kv_events
    assert not config("--is-decode-worker").publishes_kv_events
    assert config("--disaggregation-mode", "decode", "--enable-conditional-disagg").publishes_kv_events
    assert not config("--no-enable-prefix-caching").publishes_kv_events
    assert config().kv_bytes_per_token == _SMOLLM2_KV_BYTES
    assert (config("--is-prefill-worker").component, config("--is-decode-worker").component) == ("prefill", "backend")


def test_num_workers_are_separate_instances(tmp_path: Path, smollm2: str) -> None:
    """Three workers in one process; the first one's system port reports the lag of all three engines
    (they share the process's event loop)."""
    system_port = free_port()
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker",
                            engines=[[*MOCKER, "--num-workers", "3"]], instances=3,
                            engine_env={"DYN_SYSTEM_PORT": str(system_port)})
    try:
        instances = set(httpx.get(f"{deployment.url}/health").json()["instances"])
        assert len(instances) == 3
        client = deployment.client()
        replies = [client.completions.create(model=MODEL, prompt=f"hi {i}", max_tokens=2) for i in range(6)]
        assert all(r.usage.completion_tokens == 2 for r in replies)
        page = httpx.get(f"http://127.0.0.1:{system_port}/metrics").text
        for instance in instances:
            worker = f"{instance:x}"
            assert metric_sum(page, "tandem_mocker_simulated_seconds_total", worker=worker) > 0  # each served two
            assert metric_sum(page, "tandem_mocker_busy_seconds_total", worker=worker) > 0
    finally:
        deployment.stop()


def test_invalid_flags_exit_2(smollm2: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tandem.mocker", "--model-path", smollm2, "--block-size", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--block-size must be positive" in proc.stderr
    from tandem.mocker.args import parse_args

    with pytest.raises(SystemExit) as refused:
        parse_args(["--model-path", smollm2, "--answer-tokens", "0"])
    assert refused.value.code == 2
    assert parse_args(["--model-path", smollm2, "--answer-tokens", "5"]).answer_tokens == 5


def _check_logprobs(tokens: list[str], values: list[float], tops: list[int], text: str, top: int,
                    completion_tokens: int) -> None:
    assert len(tokens) == len(values) == len(tops) == completion_tokens  # every generated token
    assert "".join(tokens) == text
    assert all(math.isfinite(v) and v <= 0 for v in values)
    assert tops == [top] * completion_tokens


def test_logprobs_are_simulated(mocker: Deployment) -> None:
    client = mocker.client()
    messages = [{"role": "user", "content": "Rate this"}]
    asking = {"model": MODEL, "messages": messages, "max_tokens": 10, "logprobs": True, "top_logprobs": 3}
    chat = client.chat.completions.create(**asking)
    content = chat.choices[0].logprobs.content
    for t in content:
        alternatives = [a.logprob for a in t.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        assert all(math.isfinite(a) and a <= 0 for a in alternatives)
        assert len({a.token for a in t.top_logprobs}) == 3 and t.token in {a.token for a in t.top_logprobs}
    _check_logprobs([t.token for t in content], [t.logprob for t in content],
                    [len(t.top_logprobs) for t in content], chat.choices[0].message.content, 3,
                    chat.usage.completion_tokens)
    again = client.chat.completions.create(**asking)
    assert again.choices[0].logprobs == chat.choices[0].logprobs  # deterministic

    stream = client.chat.completions.create(**asking, stream=True)
    streamed, text = [], ""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            streamed += chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []
    assert streamed == content and text == chat.choices[0].message.content

    completion = client.completions.create(model=MODEL, prompt="Rate this", max_tokens=10, logprobs=2)
    lp = completion.choices[0].logprobs
    _check_logprobs(lp.tokens, lp.token_logprobs, [len(t) for t in lp.top_logprobs],
                    completion.choices[0].text, 2, completion.usage.completion_tokens)
    assert all(max(t.values()) == v for t, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    stream = client.completions.create(model=MODEL, prompt="Rate this", max_tokens=10, logprobs=2,
                                       stream=True)
    tokens, values, tops, text = [], [], [], ""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs:
                tokens += chunk.choices[0].logprobs.tokens
                values += chunk.choices[0].logprobs.token_logprobs
                tops += chunk.choices[0].logprobs.top_logprobs
    assert (tokens, values, tops) == (lp.tokens, lp.token_logprobs, lp.top_logprobs)
    assert text == completion.choices[0].text

    plain = client.completions.create(model=MODEL, prompt="Rate this", max_tokens=10)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == completion.choices[0].text
    plain_chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)
    assert plain_chat.choices[0].logprobs is None


def test_parsers_go_through_the_card(tmp_path: Path, smollm2: str) -> None:
    """The mocker takes the parser flags like the other workers: with deepseek_r1 (thinking forced), its
    synthetic answer is all thinking."""
    from tandem.mocker.args import parse_args

    with pytest.raises(SystemExit) as refused:
        parse_args(["--model-path", smollm2, "--dyn-tool-call-parser", "phi5"])
    assert refused.value.code == 2
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker",
                            engines=[[*MOCKER, "--dyn-reasoning-parser", "deepseek_r1"]])
    try:
        reply = deployment.client().chat.completions.create(model=MODEL, max_tokens=8,
                                                            messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.reasoning_content and not reply.choices[0].message.content
        assert reply.usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens == 8
    finally:
        deployment.stop()


def test_lag_against_the_timing_model_is_reported(mocker: Deployment) -> None:
    """The system port shows the time the timing model gave the steps run and the wall time spent busy:
    a benchmark discards runs where the second outgrows the first (the host could not keep up)."""
    def read() -> tuple[float, float]:
        text = httpx.get(f"{mocker.system_url}/metrics").text  # type: ignore[attr-defined]
        return (metric_sum(text, "tandem_mocker_simulated_seconds_total"),
                metric_sum(text, "tandem_mocker_busy_seconds_total"))

    before = read()
    mocker.client().completions.create(model=MODEL, prompt=_prompt(300, "lag"), max_tokens=32)
    simulated, busy = read()
    assert simulated > before[0] and busy > before[1]  # both grew with the steps of this request
