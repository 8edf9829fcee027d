"""Dynamo's request extensions the frontend honours or refuses by name, end to end: `nvext.annotations`
(SSE events ahead of a streamed answer), `nvext.extra_fields` (the answer's own `nvext`: the workers that
served it), the workers a disaggregated request names for its prefill and
decode legs (`nvext.prefill_worker_id` / `decode_worker_id`, `x-prefill-instance-id`), and the request
priority header (carried to the engine; the mocker, first come first served, refuses it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest

from tandem.runtime.errors import RemoteError
from tests.support.deployment import MODEL, Deployment, metric_sum
from tests.support.engines import wait_until
from tests.support.ports import free_port

MOCKER = ["--block-size", "16", "--speedup-ratio", "100"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> Iterator[Deployment]:
    """A frontend and one test engine (scripted tokens)."""
    deployment = Deployment(tmp_path_factory.mktemp("nvext"), smollm2)
    yield deployment
    deployment.stop()


def _post(deployment: Deployment, path: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{deployment.url}{path}", json={"model": MODEL, **body}, headers=headers, timeout=30)


def _events(response: httpx.Response) -> list[tuple[str | None, str]]:
    """A streamed answer's SSE events as (event name or None, its data or comment line)."""
    events = []
    for frame in response.text.split("\n\n"):
        if frame:
            lines = dict(line.split(": ", 1) if not line.startswith(": ") else ("comment", line[2:])
                         for line in frame.split("\n"))
            events.append((lines.get("event"), lines.get("data", lines.get("comment", ""))))
    return events


# -- annotations --------------------------------------------------------------------------------------------


def test_annotations_open_a_streamed_chat_answer(engine: Deployment, tok: Any) -> None:
    """`formatted_prompt` and `token_ids` come first, as Dynamo writes them (the value a JSON string in a
    comment line), then the answer as always."""
    messages = [{"role": "user", "content": "[[say:annotated]]"}]
    r = _post(engine, "/v1/chat/completions", {"messages": messages, "stream": True,
                                               "nvext": {"annotations": ["formatted_prompt", "token_ids"]}})
    assert r.status_code == 200, r.text
    events = _events(r)
    assert [name for name, _ in events[:2]] == ["formatted_prompt", "token_ids"]
    prompt, ids = json.loads(events[0][1]), json.loads(json.loads(events[1][1]))
    assert prompt.endswith("<|im_start|>assistant\n") and "[[say:annotated]]" in prompt  # the templated prompt
    tokenized = httpx.post(f"{engine.url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert ids == tokenized["tokens"] == tok.encode(prompt)  # the ids the worker got
    chunks = [json.loads(data) for name, data in events[2:] if name is None and data != "[DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "annotated"


def test_annotations_of_a_completion(engine: Deployment, tok: Any) -> None:
    r = _post(engine, "/v1/completions", {"prompt": "[[say:done]] now", "stream": True,
                                          "nvext": {"annotations": ["token_ids", "formatted_prompt"]}})
    events = _events(r)
    assert events[:2] == [("token_ids", json.dumps(json.dumps(tok.encode("[[say:done]] now"), separators=(",", ":")))),
                          ("formatted_prompt", json.dumps("[[say:done]] now"))]
    # A token prompt has its ids, and no formatted prompt.
    r = _post(engine, "/v1/completions", {"prompt": [1, 2, 3], "stream": True, "max_tokens": 2,
                                          "nvext": {"annotations": ["token_ids"]}})
    assert _events(r)[0] == ("token_ids", json.dumps("[1,2,3]"))


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"stream": True, "nvext": {"annotations": ["query_instance_id"]}}),
    ("/v1/chat/completions", {"stream": True, "nvext": {"annotations": ["token_ids", "llm_metrics"]}}),
    ("/v1/chat/completions", {"nvext": {"annotations": ["formatted_prompt"]}}),  # unary: no events to carry them
    ("/v1/completions", {"prompt": [1, 2], "stream": True, "nvext": {"annotations": ["formatted_prompt"]}}),
])
def test_annotations_not_honoured_are_refused(engine: Deployment, path: str, body: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], **body} if "chat" in path else body
    r = _post(engine, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "nvext.annotations", r.text


# -- extra_fields ---------------------------------------------------------------------------------------------


def test_an_answer_names_its_worker_when_asked(engine: Deployment) -> None:
    """`nvext.extra_fields: ["worker_id"]`: the unary body and the stream's finish chunk carry
    `nvext.worker_id.decode_worker_id`, the instance /health lists; `routing` is empty off the KV router."""
    [worker] = httpx.get(f"{engine.url}/health").json()["instances"]
    ask = {"prompt": "[[say:named]]", "max_tokens": 3, "nvext": {"extra_fields": ["worker_id", "routing"]}}
    r = _post(engine, "/v1/completions", ask)
    assert r.status_code == 200, r.text
    assert r.json()["nvext"] == {"worker_id": {"decode_worker_id": worker}, "routing": {}}
    r = _post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "[[say:named]]"}],
                                               "stream": True, "nvext": {"extra_fields": ["worker_id"]}})
    chunks = [json.loads(data) for name, data in _events(r) if name is None and data.startswith("{")]
    assert [c["nvext"] for c in chunks if "nvext" in c] == [{"worker_id": {"decode_worker_id": worker}}]
    assert chunks[[i for i, c in enumerate(chunks) if "nvext" in c][0]]["choices"][0]["finish_reason"] is not None
    assert "nvext" not in _post(engine, "/v1/completions", {"prompt": "[[say:x]]", "max_tokens": 2}).json()


def test_an_extra_field_not_answered_is_refused(engine: Deployment) -> None:
    r = _post(engine, "/v1/completions", {"prompt": "x", "nvext": {"extra_fields": ["worker_id", "timing"]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "nvext.extra_fields", r.text
    assert "'timing'" in r.json()["error"]["message"]


# -- priority -----------------------------------------------------------------------------------------------


def test_priority_header_reaches_the_worker(engine: Deployment) -> None:
    r = _post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "[[echo]]"}]},
              **{"x-dynamo-request-priority": "-3"})
    assert json.loads(r.json()["choices"][0]["message"]["content"])["routing"] == {"priority": -3}
    for value in ("2147483648", "high"):  # vLLM's priority travels as an i32
        r = _post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                  **{"x-dynamo-request-priority": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-dynamo-request-priority", r.text


class _RecordingEngine:
    """vLLM's engine client as the handler calls it: answers one token, records the keyword arguments."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def generate(self, prompt: Any, sampling: Any, request_id: str, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        output = SimpleNamespace(token_ids=[5], finish_reason="length", stop_reason=None, logprobs=None)
        yield SimpleNamespace(outputs=[output], finished=True, num_cached_tokens=0, kv_transfer_params=None)

    async def abort(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize(("routing", "expected"), [({"priority": 7}, 7), ({"cache_salt": "s"}, 0), (None, 0)])
def test_the_vllm_worker_passes_the_priority_to_its_engine(routing: dict[str, Any] | None, expected: int) -> None:
    """The engine orders by it under vLLM's `--scheduling-policy priority`; 0 (vLLM's default) when none is given."""
    from tandem.llm.protocols import PreprocessedRequest
    from tandem.runtime import Context
    from tandem.vllm.handlers import DecodeWorkerHandler

    engine = _RecordingEngine()
    handler = DecodeWorkerHandler(None, engine, SimpleNamespace(served_model_name=MODEL), default_sampling_params={},
                                  model_max_len=2048, shutdown_event=asyncio.Event())
    request = msgspec.convert({"token_ids": [1, 2], "stop_conditions": {"max_tokens": 1}, "routing": routing},
                              PreprocessedRequest)

    async def run() -> list[Any]:
        return [item async for item in handler.generate(request, Context("r1"))]

    assert asyncio.run(run())[-1].finish_reason == "length"
    assert engine.calls[0]["priority"] == expected


# -- the workers of a disaggregated request's legs ----------------------------------------------------------


class Disaggregated:
    """A frontend (round robin) with two prefill and two decode mockers, each with its system port."""

    def __init__(self, root: Path, smollm2: str) -> None:
        self.deployment = Deployment(root, smollm2, engine_module="tandem.mocker", engines=[])
        self.urls: dict[int, str] = {}  # instance id -> system URL
        self.prefill: list[int] = []
        self.decode: list[int] = []
        try:
            for mode, ids in (("prefill", self.prefill), ("decode", self.decode), ("prefill", self.prefill),
                              ("decode", self.decode)):
                port = free_port()
                worker = self.deployment.add_engine(*MOCKER, "--disaggregation-mode", mode,
                                                    env={"DYN_SYSTEM_PORT": str(port)})
                ids.append(int(worker.ready[0], 16))
                self.urls[ids[-1]] = f"http://127.0.0.1:{port}"
            self.deployment.wait_for_instances(2)
            self.deployment.wait_for_instances(2, kind="prefill_instances")
        except BaseException:
            self.deployment.stop()
            raise

    def served(self, worker: int) -> float:
        """Requests the worker answered (its own metrics)."""
        page = httpx.get(f"{self.urls[worker]}/metrics").text
        return metric_sum(page, "dynamo_component_requests_total", dynamo_endpoint="generate")

    def ask(self, nvext: dict[str, int] | None = None, **headers: str) -> httpx.Response:
        body: dict[str, Any] = {"prompt": "a prompt of a few words", "max_tokens": 3}
        return _post(self.deployment, "/v1/completions", {**body, "nvext": nvext} if nvext else body, **headers)


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> Iterator[Disaggregated]:
    made = Disaggregated(tmp_path_factory.mktemp("legs"), smollm2)
    yield made
    made.deployment.stop()


def test_each_leg_runs_on_the_worker_it_names(disaggregated: Disaggregated) -> None:
    """Round robin would spread these over both workers of each role: the named ones serve every leg."""
    d = disaggregated
    (p0, p1), (d0, d1) = d.prefill, d.decode
    for _ in range(4):
        r = d.ask({"prefill_worker_id": p1, "decode_worker_id": d0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    for _ in range(2):  # the prefill leg named by the header, the decode leg by nvext
        r = d.ask({"decode_worker_id": d1}, **{"x-prefill-instance-id": str(p0)})
        assert r.status_code == 200, r.text
    r = d.ask({"prefill_worker_id": p0, "decode_worker_id": d1, "extra_fields": ["worker_id"]})  # type: ignore[dict-item]
    assert r.json()["nvext"]["worker_id"] == {"prefill_worker_id": p0, "decode_worker_id": d1}, r.text
    expected = {p1: 4, p0: 3, d0: 4, d1: 3}
    wait_until(lambda: {w: d.served(w) for w in expected} == expected, f"the workers served {expected}", timeout=20)
    page = d.deployment.metrics()
    assert metric_sum(page, "dynamo_frontend_remote_prefills_total", outcome="ok") == 7  # every one prefilled remotely


@pytest.mark.parametrize(("nvext", "headers", "status", "param"), [
    ({"prefill_worker_id": "decode0"}, {}, 404, "nvext.prefill_worker_id"),
    ({}, {"x-dynamo-prefill-instance-id": "12345"}, 404, "x-dynamo-prefill-instance-id"),
    ({"decode_worker_id": "prefill0"}, {}, 404, "nvext.decode_worker_id"),
    ({"backend_instance_id": "decode0", "prefill_worker_id": "prefill0"}, {}, 400, "nvext.prefill_worker_id"),
    ({"decode_worker_id": "decode1"}, {"x-worker-instance-id": "decode0"}, 400, "nvext.decode_worker_id"),
])
def test_a_leg_named_on_the_wrong_worker_is_refused(disaggregated: Disaggregated, nvext: dict[str, str],
                                                    headers: dict[str, str], status: int, param: str) -> None:
    d = disaggregated
    ids = {f"{role}{i}": str(w) for role, workers in (("prefill", d.prefill), ("decode", d.decode))
           for i, w in enumerate(workers)}
    r = d.ask({k: int(ids[v]) for k, v in nvext.items()}, **{k: ids.get(v, v) for k, v in headers.items()})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_the_mocker_refuses_a_priority(disaggregated: Disaggregated) -> None:
    """It schedules first come, first served: a priority is refused by name, not dropped."""
    r = disaggregated.ask(**{"x-dynamo-request-priority": "2"})
    assert r.status_code == 400 and "x-dynamo-request-priority" in r.json()["error"]["message"], r.text
    assert disaggregated.ask(**{"x-dynamo-request-priority": "0"}).status_code == 200  # vLLM's default: served


@pytest.mark.parametrize("component", ["backend", "prefill"])
def test_the_mocker_and_the_test_engine_refuse_images(disaggregated: Disaggregated, engine: Deployment,
                                                      component: str) -> None:
    """A mocker and a test engine without --enable-multimodal refuse images by name, not answered as text."""
    request = {"model": MODEL, "token_ids": [1, 2, 3], "stop_conditions": {"max_tokens": 2},
               "multi_modal_data": {"image_url": [{"Url": "data:image/png;base64,"}]}}
    for deployment, path in ((disaggregated.deployment, f"{component}.generate"), (engine, "backend.generate")):
        with pytest.raises(RemoteError, match="^Received multimodal data but multimodal processing is not enabled: "
                                              "start the (mocker|test engine) with --enable-multimodal") as caught:
            deployment.call(path, request)
        assert caught.value.code == 400


def test_a_model_that_takes_no_images_refuses_image_parts(engine: Deployment) -> None:
    """The test engine's card names no image token: an image part is the client's 400, naming the part."""
    content = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": "http://a/b.png"}}]
    r = _post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[1]"
    assert "does not take images" in r.json()["error"]["message"]


def test_an_embedding_request_refuses_a_priority(tmp_path: Path, smollm2: str) -> None:
    deployment = Deployment(tmp_path, smollm2, engines=[["--endpoint-types", "embedding"]])
    try:
        r = _post(deployment, "/v1/embeddings", {"input": "x"}, **{"x-dynamo-request-priority": "1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-dynamo-request-priority", r.text
        assert _post(deployment, "/v1/embeddings", {"input": "x"}).status_code == 200
    finally:
        deployment.stop()
