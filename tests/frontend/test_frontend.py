"""The frontend end to end: real processes (frontend + deterministic test engines with the real
SmolLM2 tokenizer) and the official `openai` client."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.deployment import MODEL, Deployment, metric_sum
from tests.support.engines import wait_until


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2):
    deployment = Deployment(tmp_path_factory.mktemp("frontend"), smollm2, engines=[[], []],
                            env={"DYN_HTTP_BODY_LIMIT_MB": "1"})
    yield deployment
    deployment.stop()


def say(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"[[say:{text}]]"}]


def stream_text(stream) -> tuple[str, list]:  # type: ignore[no-untyped-def]
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# -- surface ---------------------------------------------------------------------------------------
def test_models_health_live_openapi(deployment):
    client = deployment.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(f"{deployment.url}/health").json()
    assert health["status"] == "healthy" and len(health["instances"]) == 2
    assert httpx.get(f"{deployment.url}/live").json()["status"] == "live"
    spec = httpx.get(f"{deployment.url}/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]


def test_chat_non_streaming(deployment):
    reply = deployment.client().chat.completions.create(model=MODEL, messages=say("Hello there, world!"))
    assert reply.choices[0].message.content == "Hello there, world!"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_streaming_chunk_shapes_and_usage(deployment):
    stream = deployment.client().chat.completions.create(
        model=MODEL, messages=say("One two three"), stream=True, stream_options={"include_usage": True})
    text, chunks = stream_text(stream)
    assert text == "One two three"
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_text_and_token_prompts(deployment):
    client = deployment.client()
    reply = client.completions.create(model=MODEL, prompt="[[say:plain completion]]", max_tokens=50)
    assert reply.choices[0].text == "plain completion" and reply.choices[0].finish_reason == "stop"
    tokens = client.completions.create(model=MODEL, prompt="[[say:x]]", max_tokens=5).usage.prompt_tokens
    assert tokens > 0
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(f"{deployment.model_path}/tokenizer.json").encode("[[say:from ids]]").ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=20)
    assert by_ids.choices[0].text == "from ids"
    stream = client.completions.create(model=MODEL, prompt="[[say:streamed text]]", stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == "streamed text"


def test_max_tokens_gives_length(deployment):
    reply = deployment.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=7)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 7


def test_utf8_split_across_tokens(deployment):
    text = "héllo 🌍 世界 — ok ✨🎉"
    client = deployment.client()
    assert client.chat.completions.create(model=MODEL, messages=say(text)).choices[0].message.content == text
    streamed, chunks = stream_text(client.chat.completions.create(model=MODEL, messages=say(text), stream=True))
    assert streamed == text
    assert not any("\ufffd" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_stop_strings_across_token_boundaries(deployment):
    client = deployment.client()
    messages = say("The answer is 42. STOP right here please")
    reply = client.chat.completions.create(model=MODEL, messages=messages, stop=["STOP"])
    assert reply.choices[0].message.content == "The answer is 42. "
    assert reply.choices[0].finish_reason == "stop"
    streamed, _ = stream_text(client.chat.completions.create(model=MODEL, messages=messages, stop=["ST", "STOP"],
                                                             stream=True))
    assert streamed == "The answer is 42. "
    kept = client.chat.completions.create(model=MODEL, messages=messages, stop="right",
                                          extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "The answer is 42. STOP right"
    # a partial match that never completes is released at the end
    tail = client.chat.completions.create(model=MODEL, messages=say("ends with STO"), stop=["STOP"])
    assert tail.choices[0].message.content == "ends with STO"


def test_parameters_reach_the_engine(deployment):
    reply = deployment.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "[[echo]]"}], temperature=0.5, top_p=0.9, seed=7,
        presence_penalty=0.5, frequency_penalty=0.25, max_tokens=4000, stop=["\u2603"],
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 2,
                    "guided_regex": "[a-z]+"},
    )
    seen = json.loads(reply.choices[0].message.content)
    sampling, stop = seen["sampling_options"], seen["stop_conditions"]
    assert (sampling["temperature"], sampling["top_p"], sampling["top_k"], sampling["min_p"]) == (0.5, 0.9, 5, 0.1)
    assert (sampling["seed"], sampling["presence_penalty"], sampling["frequency_penalty"]) == (7, 0.5, 0.25)
    assert sampling["repetition_penalty"] == 1.1
    assert sampling["guided_decoding"] == {"regex": "[a-z]+"}
    assert stop["max_tokens"] == 4000 and stop["min_tokens"] == 2 and stop["stop"] == ["\u2603"]
    assert stop["stop_token_ids_hidden"] == seen["eos_token_ids"] and seen["eos_token_ids"]
    assert seen["mdc_sum"]


def test_json_schema_and_ignore_eos_reach_the_engine(deployment):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    reply = deployment.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "[[echo]]"}], max_tokens=4000,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        extra_body={"ignore_eos": True},
    )
    # ignore_eos: generation runs past EOS, so the echoed JSON is followed by more text
    seen, _ = json.JSONDecoder().raw_decode(reply.choices[0].message.content)
    assert seen["sampling_options"]["guided_decoding"] == {"json": schema}
    assert "stop_token_ids_hidden" not in seen["stop_conditions"] and seen["stop_conditions"]["ignore_eos"]


def test_logprobs_shapes(deployment):
    client = deployment.client()
    reply = client.chat.completions.create(model=MODEL, messages=say("a b"), logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == "a b"
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    completion = client.completions.create(model=MODEL, prompt="[[say:c d]]", logprobs=2)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == "c d" and len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)


def test_cached_tokens_reported(deployment):
    client = deployment.client()
    messages = [{"role": "system", "content": "x " * 200}, *say("cached?")]
    for _ in range(3):  # two workers, round robin: the third request repeats on a worker
        reply = client.chat.completions.create(model=MODEL, messages=messages)
    assert reply.usage.prompt_tokens_details.cached_tokens > 0


# -- errors ----------------------------------------------------------------------------------------
def post(deployment, path: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:  # type: ignore[no-untyped-def]
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{deployment.url}{path}", content=data,
                      headers={"Content-Type": "application/json", **(headers or {})})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100_000}, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x " * 9000}]}, "messages"),
    ],
)
def test_client_mistakes_are_400_naming_the_parameter(deployment, body, param):
    r = post(deployment, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_malformed_json_unknown_model_and_too_large(deployment):
    r = post(deployment, "/v1/chat/completions", b"{not json")
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = post(deployment, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 2_000_000}]}
    assert post(deployment, "/v1/chat/completions", huge).status_code == 413
    with pytest.raises(openai.NotFoundError):
        deployment.client().chat.completions.create(model="nope", messages=say("x"))
    # the server is fine afterwards
    assert deployment.client().chat.completions.create(model=MODEL, messages=say("still here")).choices[0] \
        .message.content == "still here"


def test_worker_error_mid_stream_is_an_error_event(deployment):
    client = deployment.client()
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[[fail]]"}],
                                            stream=True)
    with pytest.raises(openai.APIError):
        list(stream)
    r = post(deployment, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "[[fail]]"}]})
    assert r.status_code >= 500 and "failed as asked" in r.json()["error"]["message"]


def _settled_metrics(deployment: Deployment) -> str:
    """/metrics once no request is in flight (a stream's client may see its end before the frontend
    counts it)."""
    deadline = time.monotonic() + 10
    while metric_sum(text := deployment.metrics(), "dynamo_frontend_inflight_requests") and time.monotonic() < deadline:
        time.sleep(0.02)
    return text


def test_metrics(deployment):
    """The request metrics count what was served, by value: one request each (by endpoint, type and
    status), the tokens of each reply's usage, one latency sample each."""
    before = _settled_metrics(deployment)
    client = deployment.client()
    usages = [client.chat.completions.create(model=MODEL, messages=say(f"count me {n}")).usage for n in range(2)]
    usages.append(client.completions.create(model=MODEL, prompt="count me too", max_tokens=5).usage)
    chunks = list(client.chat.completions.create(model=MODEL, messages=say("count me streaming"), stream=True,
                                                 stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)
    served = _settled_metrics(deployment)
    with pytest.raises(openai.APIError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "[[fail]]"}])
    after = _settled_metrics(deployment)

    def grew(name: str, text: str = after, **labels: str) -> float:
        return metric_sum(text, name, model=MODEL, **labels) - metric_sum(before, name, model=MODEL, **labels)

    requests = "dynamo_frontend_requests_total"
    assert grew(requests) == 5
    assert grew(requests, endpoint="chat_completions", request_type="unary", status="success") == 2
    assert grew(requests, endpoint="completions", request_type="unary", status="success") == 1
    assert grew(requests, endpoint="chat_completions", request_type="stream", status="success") == 1
    assert grew(requests, endpoint="chat_completions", request_type="unary", status="error") == 1
    for name in ("input_sequence_tokens", "output_sequence_tokens", "time_to_first_token_seconds",
                 "request_duration_seconds"):
        assert grew(f"dynamo_frontend_{name}_count") == 5, name  # the failed request too
    assert all(usage is not None for usage in usages)
    # the four served requests: their usage, token for token
    assert grew("dynamo_frontend_input_sequence_tokens_sum", served) == sum(u.prompt_tokens for u in usages)
    assert grew("dynamo_frontend_output_sequence_tokens_sum", served) == sum(u.completion_tokens for u in usages)
    # one gap sample per output after the first, which carries one token or more
    assert 0 < grew("dynamo_frontend_inter_token_latency_seconds_count", served) \
        <= sum(u.completion_tokens - 1 for u in usages)
    assert metric_sum(after, "dynamo_frontend_model_workers", model=MODEL) == 2
    config = json.loads((Path(deployment.model_path) / "config.json").read_text())
    assert metric_sum(after, "dynamo_frontend_model_context_length", model=MODEL) == config["max_position_embeddings"]
    assert metric_sum(after, "dynamo_frontend_queued_requests", model=MODEL) == 0  # all answered
    assert metric_sum(after, "dynamo_frontend_inflight_requests", model=MODEL) == 0


def test_direct_routing_by_header(deployment):
    instances = httpx.get(f"{deployment.url}/health").json()["instances"]
    client = deployment.client()
    for instance in instances:
        reply = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=say("pinned"), extra_headers={"x-worker-instance-id": str(instance)})
        assert reply.parse().choices[0].message.content == "pinned"
    r = post(deployment, "/v1/chat/completions", {"model": MODEL, "messages": say("x")},
             headers={"x-worker-instance-id": "12345"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "x-worker-instance-id"  # a client mistake, not retryable


# -- separate deployments --------------------------------------------------------------------------
def test_api_key(tmp_path: Path, smollm2):
    deployment = Deployment(tmp_path, smollm2, frontend_args=["--api-key", "sekrit"])
    try:
        with pytest.raises(openai.AuthenticationError):
            deployment.client(api_key="wrong").models.list()
        assert [m.id for m in deployment.client(api_key="sekrit").models.list().data] == [MODEL]
        assert httpx.get(f"{deployment.url}/health").status_code == 200  # infra routes need no key
    finally:
        deployment.stop()


def test_migration_after_the_worker_dies_mid_stream(tmp_path: Path, smollm2):
    deployment = Deployment(tmp_path, smollm2, engines=[["--die-after", "6", "--delay-ms", "10"]],
                            frontend_args=["--migration-limit", "3"])
    try:
        deployment.add_engine("--delay-ms", "10")
        deployment.wait_for_instances(2)
        text = "one two three four five six seven eight nine ten eleven twelve"
        client = deployment.client()
        for _ in range(3):  # round robin: one of these lands on the dying worker
            streamed, _ = stream_text(client.chat.completions.create(model=MODEL, messages=say(text), stream=True))
            assert streamed == text
        assert deployment.engines[0].proc.poll() is not None  # it really died
        assert 'migration_type="ongoing_request"' in deployment.metrics()
    finally:
        deployment.stop()


def test_client_disconnect_kills_the_request_on_the_worker(tmp_path: Path, smollm2):
    report = tmp_path / "report.txt"
    deployment = Deployment(tmp_path, smollm2, engines=[["--delay-ms", "50", "--report", str(report)]])
    try:
        stream = deployment.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go on"}], max_tokens=500, stream=True)
        next(iter(stream))
        stream.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not report.exists():
            time.sleep(0.05)
        assert report.read_text().split() == ["killed"]
    finally:
        deployment.stop()


def test_all_workers_busy_is_503(tmp_path: Path, smollm2):
    deployment = Deployment(tmp_path, smollm2, engines=[["--delay-ms", "100", "--total-kv-blocks", "4"]],
                            frontend_args=["--active-decode-blocks-threshold", "0.5"])
    try:
        client = deployment.client()
        long_prompt = [{"role": "user", "content": "word " * 100}]  # > 4 blocks of 16 tokens
        stream = client.chat.completions.create(model=MODEL, messages=long_prompt, max_tokens=100, stream=True)
        next(iter(stream))
        # Requests are let in until the worker's load event, its KV blocks now over half used, arrives.
        deadline = time.monotonic() + 10
        while True:
            try:
                client.chat.completions.create(model=MODEL, messages=say("x"))
            except openai.InternalServerError as refused:
                assert refused.status_code == 503 and "busy" in str(refused)
                break
            assert time.monotonic() < deadline, "no request was refused while the worker was busy"
        assert metric_sum(deployment.metrics(), "dynamo_frontend_model_rejection_total", model=MODEL) == 1
        stream.close()
    finally:
        deployment.stop()


def test_text_input_model_is_relayed(tmp_path: Path, smollm2):
    deployment = Deployment(tmp_path, smollm2, engines=[["--model-input", "Text"]])
    try:
        client = deployment.client()
        reply = client.chat.completions.create(model=MODEL, messages=say("relayed words here"))
        assert reply.choices[0].message.content == "relayed words here"
        streamed, _ = stream_text(client.chat.completions.create(model=MODEL, messages=say("a b c"), stream=True))
        assert streamed == "a b c"
        # What only the frontend's parsing or guided decoding could honour is refused, not ignored.
        tools = [{"type": "function", "function": {"name": "f"}}]
        for body, param in (({"tools": tools}, "tool_choice"), ({"guided_regex": "a+"}, "guided_regex"),
                            ({"nvext": {"max_thinking_tokens": 3}}, "nvext.max_thinking_tokens"),
                            ({"stream": True, "nvext": {"annotations": ["token_ids"]}}, "nvext.annotations"),
                            ({"nvext": {"greed_sampling": True}}, "nvext.greed_sampling"),
                            ({"headers": {"x-dynamo-request-priority": "1"}}, "x-dynamo-request-priority")):
            headers = body.pop("headers", None)
            r = httpx.post(f"{deployment.url}/v1/chat/completions", headers=headers,
                           json={"model": MODEL, "messages": say("x"), **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        reply = client.chat.completions.create(model=MODEL, messages=say("no tools"), tools=tools, tool_choice="none")
        assert reply.choices[0].message.content == "no tools"
        # Counted and logged as every request: 3 + 3 + 2 prompt words in, as many words out (the engine's usage).
        metrics = deployment.metrics()
        for request_type, count in (("unary", 2), ("stream", 1)):
            assert metric_sum(metrics, "dynamo_frontend_requests_total", model=MODEL, endpoint="chat_completions",
                              request_type=request_type, status="success") == count
        for name, value in (("input_sequence_tokens_sum", 8), ("output_sequence_tokens_sum", 8),
                            ("time_to_first_token_seconds_count", 3), ("request_duration_seconds_count", 3),
                            ("inflight_requests", 0), ("queued_requests", 0)):
            assert metric_sum(metrics, f"dynamo_frontend_{name}", model=MODEL) == value, name
        logged = re.compile(rf"request \w+ model={MODEL} worker=\w+ status=success prompt_tokens=[23] completion")
        wait_until(lambda: len(logged.findall(deployment.frontend.stderr())) == 3, "three log lines")
        # The body travels to the engine as it is: an integer msgpack cannot carry is the client's mistake.
        r = httpx.post(f"{deployment.url}/v1/chat/completions",
                       json={"model": MODEL, "messages": say("x"), "vendor_extension": {"n": 2**70}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "vendor_extension", r.text
        # The other APIs need the frontend's templating and parsing: refused by name, not relayed.
        for path, body in (("/v1/responses", {"input": "x"}), ("/v1/messages", {"max_tokens": 4, "messages": say("x")})):
            r = httpx.post(f"{deployment.url}{path}", json={"model": MODEL, **body})
            assert r.status_code == 400 and "text input" in r.text, r.text
    finally:
        deployment.stop()


def test_model_leaves_with_its_last_instance(tmp_path: Path, smollm2):
    deployment = Deployment(tmp_path, smollm2)
    try:
        client = deployment.client()
        assert [m.id for m in client.models.list().data] == [MODEL]
        deployment.engines[0].proc.terminate()  # graceful: unregisters at once
        deployment.wait_for_instances(0)
        assert client.models.list().data == []
        r = post(deployment, "/v1/chat/completions", {"model": MODEL, "messages": say("x")})
        assert r.status_code == 404
    finally:
        deployment.stop()


def test_lora_adapters_are_listed_and_served(tmp_path: Path, smollm2):
    deployment = Deployment(tmp_path, smollm2, engines=[["--lora", "my-adapter"]])
    try:
        client = deployment.client()
        deadline = time.monotonic() + 10  # the base model's and the adapter's cards arrive one after the other
        while len(models := {m.id: m for m in client.models.list().data}) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(models) == {MODEL, "my-adapter"}
        assert models["my-adapter"].model_extra["parent"] == MODEL
        reply = client.chat.completions.create(model="my-adapter", messages=say("adapted"))
        assert reply.choices[0].message.content == "adapted" and reply.model == "my-adapter"
    finally:
        deployment.stop()


def test_custom_chat_template_from_the_card_wins(tmp_path: Path, smollm2):
    template = tmp_path / "custom.jinja"
    template.write_text("{% for m in messages %}CUSTOM[{{ m['role'] }}]:{{ m['content'] }}\n{% endfor %}")
    deployment = Deployment(tmp_path, smollm2, engines=[["--custom-jinja-template", str(template)]])
    try:
        reply = deployment.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "[[prompt]]hello"}])
        assert reply.choices[0].message.content == "CUSTOM[user]:hello\n"
    finally:
        deployment.stop()


def test_a_card_that_disagrees_is_rejected_until_the_incumbents_leave(tmp_path: Path, smollm2):
    deployment = Deployment(tmp_path, smollm2)
    try:
        first = httpx.get(f"{deployment.url}/health").json()["instances"]
        deployment.add_engine("--context-length", "1024")
        deadline = time.monotonic() + 10
        while "rejecting instance" not in deployment.frontend.stderr() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "disagrees with the model's configuration" in deployment.frontend.stderr()
        assert httpx.get(f"{deployment.url}/health").json()["instances"] == first
        deployment.engines[0].proc.terminate()  # the incumbent leaves: the waiting card takes over
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            instances = httpx.get(f"{deployment.url}/health").json().get("instances", [])
            if instances and instances != first:
                break
            time.sleep(0.05)
        assert instances and instances != first
        reply = deployment.client().chat.completions.create(model=MODEL, messages=say("new config"))
        assert reply.choices[0].message.content == "new config"
    finally:
        deployment.stop()


def test_unreachable_worker_request_goes_elsewhere(tmp_path: Path, smollm2):
    deployment = Deployment(tmp_path, smollm2, engines=[[], []], frontend_args=["--migration-limit", "2"])
    try:
        deployment.engines[0].proc.kill()  # dead, but still listed in discovery for its TTL
        deployment.engines[0].proc.wait()
        client = deployment.client()
        for _ in range(2):  # round robin over two listed workers: one request picks the dead one
            assert client.chat.completions.create(model=MODEL, messages=say("rerouted")).choices[0] \
                .message.content == "rerouted"
        assert 'migration_type="new_request"' in deployment.metrics()
    finally:
        deployment.stop()


def test_guided_requests_are_not_migrated(tmp_path: Path, smollm2):
    deployment = Deployment(tmp_path, smollm2, engines=[["--die-after", "4", "--delay-ms", "5"], []],
                            frontend_args=["--migration-limit", "3"])
    try:
        client = deployment.client()
        errors = []
        for _ in range(2):  # round robin: one lands on the worker that dies
            try:
                client.chat.completions.create(model=MODEL, messages=say("one two three four five six seven"),
                                               extra_body={"guided_regex": "[a-z ]+"})
            except openai.APIError as e:
                errors.append(str(e))
        assert len(errors) == 1 and "cannot be migrated" in errors[0]
    finally:
        deployment.stop()


def test_tls(tmp_path: Path, smollm2):
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    deployment = Deployment(tmp_path, smollm2, frontend_args=["--tls-cert-path", str(cert), "--tls-key-path",
                                                                 str(key)], verify=False)
    try:
        assert deployment.url.startswith("https://")
        import ssl

        client = deployment.client(http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(cert))))
        assert client.chat.completions.create(model=MODEL, messages=say("secure")).choices[0] \
            .message.content == "secure"
    finally:
        deployment.stop()


def test_no_migration_past_max_seq_len(tmp_path: Path, smollm2):
    deployment = Deployment(tmp_path, smollm2, engines=[["--die-after", "4", "--delay-ms", "5"], []],
                            frontend_args=["--migration-limit", "3", "--migration-max-seq-len", "10"])
    try:
        client = deployment.client()
        failures = 0
        for _ in range(2):  # round robin: one lands on the worker that dies
            try:
                client.chat.completions.create(model=MODEL, messages=say("one two three four five six seven"))
            except openai.APIError:
                failures += 1
        assert failures == 1  # the prompt alone is longer than 10 tokens: not migrated
        assert f'dynamo_frontend_model_migration_max_seq_len_exceeded_total{{model="{MODEL}"}} 1.0' in deployment.metrics()
    finally:
        deployment.stop()
