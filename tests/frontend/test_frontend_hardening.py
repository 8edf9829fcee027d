"""Hostile and unlucky input against a real frontend process (test engines with the SmolLM2 tokenizer):
bounded memory and CPU before a refusal, 4xx in OpenAI's error shape for every client mistake, and the
server serving everyone else afterwards."""

from __future__ import annotations

import concurrent.futures
import json
import socket
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from tests.support.deployment import MODEL, Deployment

MB = 1024 * 1024


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2):
    deployment = Deployment(tmp_path_factory.mktemp("hardening"), smollm2, engines=[[], []],
                            frontend_args=["--api-key", "sesame", "--http-body-timeout", "1"])
    yield deployment
    deployment.stop()


AUTH = {"Authorization": "Bearer sesame"}


def post(deployment: Deployment, path: str, body: object, headers: dict[str, str] | None = None,
         **options: object) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{deployment.url}{path}", content=data, timeout=60,
                      headers={"Content-Type": "application/json", **AUTH, **(headers or {})}, **options)  # type: ignore[arg-type]


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["Content-Type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def still_serving(deployment: Deployment) -> None:
    reply = deployment.client(api_key="sesame").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "[[say:still here]]"}])
    assert reply.choices[0].message.content == "still here"


# -- 1. memory before a length check ----------------------------------------------------------
def _status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


@pytest.mark.parametrize("at_once", [1, 2])
def test_huge_unspaced_prompt_is_refused_in_bounded_memory_and_cpu(deployment, at_once):
    """An 8 MB prompt of digits (no spaces) used to take ~8 CPU-s and 1.5 GB of frontend memory before its
    400; now it is refused by its length in characters, before any tokenization: peak RSS grows by < 64 MB
    per request."""
    pid = deployment.frontend.proc.pid
    body = json.dumps({"model": MODEL, "prompt": "7" * 8_000_000, "max_tokens": 4}).encode()
    post(deployment, "/v1/completions", {"model": MODEL, "prompt": "warm up", "max_tokens": 1})
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    before = _status(pid)["VmRSS"]
    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        replies = list(pool.map(lambda _: post(deployment, "/v1/completions", body), range(at_once)))
    for r in replies:
        error = assert_error(r, 400, "prompt")
        # counted in characters (the tokenizer would have said "at least N tokens"): never tokenized
        assert "maximum context length is 8192 tokens, but the prompt has 8000000 characters" in error["message"]
    growth = _status(pid)["VmHWM"] - before
    assert growth < at_once * 64 * MB, f"peak RSS grew by {growth / MB:.0f} MB"
    still_serving(deployment)


def test_long_spaced_prompt_under_the_character_bound_stops_tokenizing_early(deployment):
    """~400k characters of words fit the character bound (8192 x the longest token) but not the context:
    tokenizing stops at the context, in bounded memory."""
    pid = deployment.frontend.proc.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = _status(pid)["VmRSS"]
    text = " ".join(f"w{i}" for i in range(60_000))
    error = assert_error(post(deployment, "/v1/completions", {"model": MODEL, "prompt": text}), 400, "prompt")
    counted = int(error["message"].split("at least ")[1].split()[0])
    assert 8191 < counted < 20_000  # the whole text has ~150k tokens: encoding stopped near the context
    assert _status(pid)["VmHWM"] - before < 64 * MB


def test_chat_prompt_is_bounded_too(deployment):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "9" * 2_000_000}]}
    error = assert_error(post(deployment, "/v1/chat/completions", body), 400, "messages")
    assert "characters" in error["message"]


# -- 2. bytes that are not JSON a decoder can take -------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/inference/v1/generate"])
def test_invalid_utf8_and_deep_nesting_are_400(deployment, path):
    invalid = (b'{"model": "' + MODEL.encode() + b'", "prompt": "a\xff\xfe", "messages": [{"role": "user", "content": "\xc3"}], '
               b'"token_ids": [1], "sampling_params": {}, "request_id": "\xc3"}')
    assert "UTF-8" in assert_error(post(deployment, path, invalid), 400)["message"]
    deep = b'{"model": "M", "ignored": ' + b"[" * 5000 + b"]" * 5000 + b', "prompt": "x"}'
    assert "nested" in assert_error(post(deployment, path, deep), 400)["message"]
    still_serving(deployment)


# -- 5. empty prompt --------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["", [""], []])
@pytest.mark.parametrize("stream", [False, True])
def test_empty_completions_prompt_is_400(deployment, prompt, stream):
    r = post(deployment, "/v1/completions", {"model": MODEL, "prompt": prompt, "stream": stream})
    assert_error(r, 400)
    assert r.json()["error"]["param"].startswith("prompt")


# -- 6. smaller ones --------------------------------------------------------------------------------
def test_405_names_the_allowed_methods(deployment):
    r = httpx.get(f"{deployment.url}/v1/chat/completions", headers=AUTH)
    assert_error(r, 405)
    assert r.headers["Allow"] == "POST"


def test_the_same_x_request_id_twice_at_once(tmp_path, smollm2):
    """A client's x-request-id is not the internal request id: requests sharing one all succeed on a worker
    that keys its requests by id (the mocker, like vLLM)."""
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[["--speedup-ratio", "5"]])
    try:
        body = {"model": MODEL, "prompt": "tell me", "max_tokens": 40, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: httpx.post(f"{deployment.url}/v1/completions", json=body, timeout=60,
                                                         headers={"x-request-id": "same"}), range(4)))
        for r in replies:
            assert r.status_code == 200 and '"finish_reason":"length"' in r.text and '"error"' not in r.text
    finally:
        deployment.stop()


def test_unknown_worker_instance_is_404(deployment):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    assert_error(post(deployment, "/v1/chat/completions", body, {"x-dynamo-worker-instance-id": "77"}), 404,
                 "x-dynamo-worker-instance-id")
    assert_error(post(deployment, "/v1/chat/completions", {**body, "nvext": {"backend_instance_id": 77}}), 404,
                 "nvext.backend_instance_id")


def test_stream_options_need_stream(deployment):
    body = {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}
    assert_error(post(deployment, "/v1/completions", body), 400, "stream_options")


def test_huge_max_tokens_names_the_context(deployment):
    r = post(deployment, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**12})
    assert "maximum context length" in assert_error(r, 400, "max_tokens")["message"]


def test_mid_stream_error_has_the_unary_error_shape(deployment):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "[[fail]]"}]}
    unary = post(deployment, "/v1/chat/completions", body).json()["error"]
    streamed = post(deployment, "/v1/chat/completions", {**body, "stream": True}).text
    event = next(json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {\"error\""))
    assert set(event["error"]) == set(unary) and event["error"]["type"] == unary["type"]
    assert event["error"]["code"] == unary["code"]


def test_model_by_id(deployment):
    r = httpx.get(f"{deployment.url}/v1/models/{MODEL}", headers=AUTH)
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["object"] == "model"
    assert deployment.client(api_key="sesame").models.retrieve(MODEL).id == MODEL
    assert_error(httpx.get(f"{deployment.url}/v1/models/nope", headers=AUTH), 404, "model")


# -- 7. frontend defaults ---------------------------------------------------------------------------
def test_api_key_scheme_is_case_insensitive(deployment):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "[[say:ok]]"}]}
    assert post(deployment, "/v1/chat/completions", body, {"Authorization": "bearer sesame"}).status_code == 200
    assert post(deployment, "/v1/chat/completions", body, {"Authorization": "BEARER sesame"}).status_code == 200
    for wrong in ("Bearer sesam", "Bearer sesame2", "Basic sesame", "sesame", ""):
        assert post(deployment, "/v1/chat/completions", body, {"Authorization": wrong}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        deployment.client(api_key="nope").models.list()


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_json_in_another_content_type_is_415(deployment, content_type):
    """What a web page can POST without a CORS preflight is refused."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "[[say:x]]"}]}
    assert_error(post(deployment, "/v1/chat/completions", body, {"Content-Type": content_type}), 415)


def test_json_content_types_and_none_are_accepted(deployment):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "[[say:ok]]"}]}).encode()
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        assert post(deployment, "/v1/chat/completions", body, {"Content-Type": content_type}).status_code == 200
    r = httpx.post(f"{deployment.url}/v1/chat/completions", content=body, headers=AUTH)  # no Content-Type
    assert r.status_code == 200


def test_a_body_that_never_arrives_is_cut_off(deployment):
    """A client that declares 500 bytes and sends 8 gets a 408 after --http-body-timeout (1 s here)."""
    url = urlsplit(deployment.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer sesame\r\nContent-Length: 500\r\n\r\n{\"model\"")
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    still_serving(deployment)
