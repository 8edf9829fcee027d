"""Prompt embeddings (`prompt_embeds`, base64 of a torch.save'd tensor) on /v1/completions: the frontend
checks the tensor against the model (400s naming `prompt_embeds`, before any worker sees it) and sends it
to a worker that takes embeddings; the test engine answers "embeds N" for a tensor of N embeddings. In the
pipeline, such a request is neither hashed for KV routing nor sent to a prefill worker, and is not migrated.
Real vLLM: tests/vllm/test_vllm_worker.py."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from tandem.frontend.pipeline import Attempt, StreamLost
from tandem.llm.protocols import PreprocessedRequest, StopConditions
from tandem.runtime import Context, EngineShutdown
from tandem.runtime.errors import InvalidRequestError
from tests.frontend.test_disagg_frontend import Workers, _pipeline
from tests.support.deployment import Deployment

EMBEDS = "embeds"  # served with --enable-prompt-embeds and a context of CONTEXT tokens
PLAIN = "plain"  # served without it
CONTEXT = 64
HIDDEN = 576  # SmolLM2-135M's hidden size


def encode(value: Any) -> str:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def embeddings(rows: int, hidden: int = HIDDEN, dtype: torch.dtype = torch.float32) -> str:
    return encode(torch.randn(rows, hidden).to(dtype))


def _with_nan() -> str:
    tensor = torch.zeros(3, HIDDEN)
    tensor[1, 2] = float("nan")
    return encode(tensor)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2):
    deployment = Deployment(tmp_path_factory.mktemp("embeds"), smollm2, frontend_args=["--router-mode", "kv"],
                            env={"DYN_HTTP_BODY_LIMIT_MB": "1"},
                            engines=[["--model-name", EMBEDS, "--enable-prompt-embeds", "--context-length", str(CONTEXT)],
                                     ["--model-name", PLAIN]])
    yield deployment
    deployment.stop()


def complete(deployment: Deployment, **body: Any) -> httpx.Response:
    return httpx.post(f"{deployment.url}/v1/completions", json={"model": EMBEDS, **body}, timeout=30)


@pytest.mark.parametrize("value", [
    embeddings(5),
    encode(torch.randn(1, 5, HIDDEN)),  # a batch of one
    [embeddings(5)],  # a one-item list, like a one-item prompt list
    embeddings(5, dtype=torch.float16),
    embeddings(5, dtype=torch.bfloat16),
])
def test_the_embeddings_reach_the_worker(deployment, value):
    r = complete(deployment, prompt_embeds=value, max_tokens=16)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["choices"][0]["text"] == "embeds 5" and reply["choices"][0]["finish_reason"] == "stop"
    usage = reply["usage"]
    assert usage["prompt_tokens"] == 5 and usage["total_tokens"] == 5 + usage["completion_tokens"]


def test_the_openai_sdk_unary_and_streamed(deployment):
    client = deployment.client()
    reply = client.completions.create(model=EMBEDS, prompt=None, max_tokens=16,
                                      extra_body={"prompt_embeds": embeddings(7)})
    assert reply.choices[0].text == "embeds 7" and reply.usage.prompt_tokens == 7
    stream = client.completions.create(model=EMBEDS, prompt=None, max_tokens=16, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"prompt_embeds": embeddings(9)})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "embeds 9"
    assert chunks[-1].usage.prompt_tokens == 9 and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_max_tokens_counts_the_embeddings(deployment):
    """The context's room for generated tokens is what the embeddings leave."""
    assert complete(deployment, prompt_embeds=embeddings(10), max_tokens=CONTEXT - 10).status_code == 200
    r = complete(deployment, prompt_embeds=embeddings(10), max_tokens=CONTEXT - 9)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "the prompt has 10 tokens" in r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "says"), [
    ({"prompt_embeds": "not base64!"}, "not valid base64"),
    ({"prompt_embeds": base64.b64encode(b"no tensor here").decode()}, "could not be read"),
    ({"prompt_embeds": encode({"weights": torch.zeros(3, HIDDEN)})}, "must hold a torch.Tensor"),
    ({"prompt_embeds": encode(torch.zeros(3, HIDDEN).to_sparse())}, "dense"),
    ({"prompt_embeds": encode(torch.ones(3, HIDDEN, dtype=torch.int64))}, "float32, float16, bfloat16"),
    ({"prompt_embeds": encode(torch.zeros(HIDDEN))}, "shape [seq_len, hidden_size]"),
    ({"prompt_embeds": encode(torch.zeros(2, 3, HIDDEN))}, "got [2, 3, 576]"),
    ({"prompt_embeds": embeddings(3, hidden=100)}, "hidden size 100; this model's is 576"),
    ({"prompt_embeds": encode(torch.zeros(0, HIDDEN))}, "at least one embedding"),
    ({"prompt_embeds": embeddings(CONTEXT, dtype=torch.float16)}, f"at most {CONTEXT - 1} fit"),
    ({"prompt_embeds": embeddings(200)}, "too large"),  # refused before torch reads it
    ({"prompt_embeds": _with_nan()}, "not finite"),
    ({"prompt_embeds": ""}, "must not be empty"),
    ({"prompt_embeds": embeddings(3), "prompt": "Hello"}, "either 'prompt' or 'prompt_embeds'"),
    ({"prompt_embeds": [embeddings(3), embeddings(3)]}, "batch"),
    ({"prompt_embeds": embeddings(3), "model": PLAIN}, "--enable-prompt-embeds"),
])
def test_bad_embeddings_are_400s_naming_the_field(deployment, body, says):
    r = complete(deployment, max_tokens=4, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_embeds" and says in error["message"], error
    assert complete(deployment, prompt_embeds=embeddings(2), max_tokens=16).json()["choices"][0]["text"] == "embeds 2"


def test_a_body_over_the_limit_is_413(deployment):
    r = complete(deployment, prompt_embeds="A" * (2 << 20))
    assert r.status_code == 413


def test_the_frontend_starts_without_torch():
    """torch is imported when a request carries prompt embeddings, not when the frontend starts."""
    code = "import sys, tandem.frontend.main, tandem.frontend.server; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the pipeline ---------------------------------------------------------------------------------------


def _embeds_request() -> PreprocessedRequest:
    return PreprocessedRequest(model="m", prompt_embeds=embeddings(4), stop_conditions=StopConditions(max_tokens=2))


class EmbedsWorkers(Workers):
    """Scripted workers whose decode worker takes prompt embeddings (no token ids)."""

    async def decode(self, request: dict[str, Any], context: Any) -> Any:
        self.decode_requests.append(request)
        yield {"token_ids": [1]}
        yield {"token_ids": [2], "finish_reason": "length"}


async def test_no_kv_hashing_and_no_remote_prefill(runtimes: Any, namespace: str, smollm2: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With KV routers and a prefill worker, a prompt-embeddings request goes straight to the decode worker,
    chosen without the KV router: an empty token prompt would tell it nothing."""
    workers = EmbedsWorkers()
    pipeline, metrics = await _pipeline(runtimes, namespace, smollm2, workers)
    assert pipeline.kv_router is not None
    monkeypatch.setattr(pipeline.kv_router, "select", lambda *a, **k: pytest.fail("the KV router was asked"))
    monkeypatch.setattr(pipeline.kv_router, "hashes", lambda *a, **k: pytest.fail("the prompt was hashed"))
    request = _embeds_request()
    outputs = [o async for o in pipeline.generate(request, Context(), Attempt())]
    assert [o.token_ids for o in outputs] == [[1], [2]]
    assert workers.prefill_requests == []
    (decode,) = workers.decode_requests
    assert decode["prompt_embeds"] == request.prompt_embeds and "prefill_result" not in decode
    assert not metrics.remote_prefills.children


class CutOff(EmbedsWorkers):
    """A decode worker whose stream is cut off after one token (its engine going away)."""

    async def decode(self, request: dict[str, Any], context: Any) -> Any:
        self.decode_requests.append(request)
        yield {"token_ids": [1]}
        raise EngineShutdown()


async def test_a_cut_off_stream_is_not_migrated(runtimes: Any, namespace: str, smollm2: str) -> None:
    workers = CutOff()
    pipeline, _ = await _pipeline(runtimes, namespace, smollm2, workers, prefill=False, migration_limit=3)
    outputs = []
    with pytest.raises(StreamLost) as lost:
        async for output in pipeline.generate(_embeds_request(), Context(), Attempt()):
            outputs.append(output)
    assert "prompt-embedding requests cannot be migrated" in lost.value.public
    assert [o.token_ids for o in outputs] == [[1]] and len(workers.decode_requests) == 1


# -- the vLLM worker --------------------------------------------------------------------------------------


async def test_the_vllm_worker_checks_the_tensor_too() -> None:
    """The vLLM worker's second line of defence: a tensor the frontend would have refused is an
    InvalidRequestError (the client's 400), never a crash; a good one reaches the engine as embeddings of the
    engine's dtype, its rows counted as prompt tokens."""
    from tandem.vllm.handlers import DecodeWorkerHandler
    from tests.vllm.test_disagg_vllm import FakeEngine, _handler

    class Engine(FakeEngine):
        def __init__(self, enabled: bool = True) -> None:
            super().__init__([7])
            self.model_config = SimpleNamespace(enable_prompt_embeds=enabled, max_model_len=CONTEXT,
                                                dtype=torch.bfloat16, get_hidden_size=lambda: HIDDEN)
            self.prompts: list[Any] = []

        async def generate(self, prompt: Any, sampling: Any, request_id: str, **options: Any) -> Any:
            self.prompts.append(prompt)
            async for output in super().generate(prompt, sampling, request_id, **options):
                yield output

    async def answer(engine: Engine, encoded: str) -> list[Any]:
        handler = _handler(DecodeWorkerHandler, engine)
        request = PreprocessedRequest(prompt_embeds=encoded, stop_conditions=StopConditions(max_tokens=1))
        return [output async for output in handler.generate(request, Context())]

    engine = Engine()
    outputs = await answer(engine, encode(torch.randn(1, 5, HIDDEN)))
    assert outputs[-1].completion_usage.prompt_tokens == 5
    (prompt,) = engine.prompts
    assert tuple(prompt["prompt_embeds"].shape) == (5, HIDDEN) and prompt["prompt_embeds"].dtype == torch.bfloat16
    for bad in (embeddings(3, hidden=100), encode(torch.zeros(HIDDEN)), encode(torch.ones(3, HIDDEN, dtype=torch.int32)),
                embeddings(CONTEXT), "not base64!"):
        with pytest.raises(InvalidRequestError, match="'prompt_embeds'"):
            await answer(engine, bad)
    with pytest.raises(InvalidRequestError, match="--enable-prompt-embeds"):
        await answer(Engine(enabled=False), embeddings(3))
    assert len(engine.prompts) == 1  # nothing bad reached the engine
