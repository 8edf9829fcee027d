"""vLLM's token-in/token-out route, `POST /inference/v1/generate`, on tandem's frontend with the test engine:
vLLM 0.32's response, stream chunk and error shapes (every body and chunk validated by vLLM's own models), the
sampling params reaching the engine, the
same tokens as /v1/completions for the same ids, --api-key on /inference, and every field of vLLM's request
that tandem does not honour refused with a 400 naming it.

The test engine writes what the prompt scripts: `[[say:TEXT]]` (TEXT, then EOS), `[[echo]]` (the options
it received, as JSON), `[[fail]]` (an error mid-stream), otherwise a fixed sentence until max_tokens."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateResponse, GenerateStreamResponse
from vllm.entrypoints.serve.engine.protocol import ErrorResponse

from tandem.testing.engine import DEFAULT_TEXT
from tests.support.deployment import MODEL, Deployment
from tests.support.shapes import conforms, sse_events

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROUTE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2):
    deployment = Deployment(tmp_path_factory.mktemp("generate"), smollm2, engines=[[]],
                            frontend_args=["--api-key", KEY])
    yield deployment
    deployment.stop()


def post(deployment: Deployment, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{deployment.url}{ROUTE}", json=body, headers=AUTH if headers is None else headers, timeout=60)


def generate(deployment: Deployment, ids: list[int], **fields: Any) -> dict[str, Any]:
    """A unary answer (sampling_params default to none), valid as vLLM's GenerateResponse."""
    r = post(deployment, {"token_ids": ids, "sampling_params": {}} | fields)
    assert r.status_code == 200, r.text
    conforms(GenerateResponse, r.text)
    return r.json()


def stream(deployment: Deployment, ids: list[int], **fields: Any) -> list[Any]:
    """The stream's events: the JSON chunks (each valid as vLLM's GenerateStreamResponse, or its ErrorResponse),
    then "[DONE]"."""
    r = post(deployment, {"token_ids": ids, "sampling_params": {}, "stream": True} | fields)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream"), r.text
    events = sse_events(r.text)
    assert all(name is None for name, _ in events) and events[-1][1] == "[DONE]"
    for _, data in events[:-1]:
        conforms(ErrorResponse if "error" in json.loads(data) else GenerateStreamResponse, data)
    return [json.loads(data) for _, data in events[:-1]] + ["[DONE]"]


@pytest.fixture(scope="module")
def say(tok):
    """The prompt ids of `[[say:TEXT]]` and the ids the engine answers with (TEXT's, EOS last)."""
    eos = tok.eos_token_ids[0]

    def make(text: str) -> tuple[list[int], list[int]]:
        return tok.encode(f"[[say:{text}]]"), [*tok.encode(text), eos]

    return make


def test_unary_answer_in_vllms_shape(deployment, say):
    prompt, answer = say("Hello world")
    body = generate(deployment, prompt, request_id="req-1", model=MODEL)
    assert body["request_id"] == "req-1" and body["model"] == MODEL and body["output_mode"] == "tokens"
    assert body["created"] > 0 and "prompt_token_ids" not in body  # (asked for with return_token_ids)
    [choice] = body["choices"]
    assert (choice["index"], choice["finish_reason"], choice["stop_reason"], choice["token_ids"],
            choice["logprobs"]) == (0, "stop", None, answer, None)  # fmt: skip
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), len(answer))
    assert usage["total_tokens"] == len(prompt) + len(answer)


def test_model_may_be_left_out_and_the_request_id_is_made_up(deployment, say):
    prompt, answer = say("one model")
    body = generate(deployment, prompt)
    assert body["model"] == MODEL and body["choices"][0]["token_ids"] == answer
    assert body["request_id"].startswith("generate-tokens-")
    assert generate(deployment, prompt)["request_id"] != body["request_id"]


def test_streamed_chunks_in_vllms_shape(deployment, say):
    prompt, answer = say("Hello there world")
    events = stream(deployment, prompt, request_id="stream-1")
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == len(answer)  # one token per engine output here, the last with the finish reason
    for i, (chunk, token) in enumerate(zip(chunks, answer, strict=True)):
        last = i == len(answer) - 1
        assert (chunk["request_id"], chunk["usage"], chunk["output_mode"]) == ("stream-1", None, "tokens")
        [choice] = chunk["choices"]
        assert (choice["index"], choice["finish_reason"], choice["stop_reason"], choice["token_ids"],
                choice["logprobs"]) == (0, "stop" if last else None, None, [token], None)  # fmt: skip


def test_usage_chunk_and_continuous_usage(deployment, say):
    prompt, answer = say("count me")
    events = stream(deployment, prompt, stream_options={"include_usage": True})
    *chunks, usage_chunk, done = events
    assert done == "[DONE]" and all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == [] and "prompt_token_ids" not in usage_chunk
    assert usage_chunk["request_id"] == chunks[0]["request_id"]
    usage = usage_chunk["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == \
        (len(prompt), len(answer), len(prompt) + len(answer))
    continuous = stream(deployment, prompt, stream_options={"include_usage": True, "continuous_usage_stats": True})
    counts = [c["usage"]["completion_tokens"] for c in continuous[:-2]]
    assert counts == list(range(1, len(answer) + 1))
    assert all(c["usage"]["prompt_tokens"] == len(prompt) for c in continuous[:-2])
    assert continuous[-2]["usage"]["completion_tokens"] == len(answer)
    # continuous_usage_stats alone asks for nothing, as in vLLM
    alone = stream(deployment, prompt, stream_options={"continuous_usage_stats": True})
    assert all(c["usage"] is None for c in alone[:-1]) and len(alone) == len(answer) + 1


def test_token_logprobs_pair_every_token_id(deployment, say):
    """EOS too: every token id has its entry, with integer ids and ranks (the test engine's candidates are
    the sampled token at rank 1, then the next ids)."""
    prompt, answer = say("Hi you")
    body = generate(deployment, prompt, sampling_params={"logprobs": 2})
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token_id"] for e in content] == answer
    for entry, token in zip(content, answer, strict=True):
        assert entry == {"token_id": token, "logprob": -0.25, "rank": 1, "top_logprobs": [
            {"token_id": token, "logprob": -0.25, "rank": 1}, {"token_id": token + 1, "logprob": -1.25, "rank": 2}]}
    streamed = [e for c in stream(deployment, prompt, sampling_params={"logprobs": 0})[:-1]
                for e in c["choices"][0]["logprobs"]["content"]]
    # logprobs 0: the sampled token alone among the candidates, as vLLM
    assert streamed == [{"token_id": t, "logprob": -0.25, "rank": 1,
                         "top_logprobs": [{"token_id": t, "logprob": -0.25, "rank": 1}]} for t in answer]


def test_stop_token_ids(deployment, tok, say):
    prompt, answer = say("Hello world again")
    world = answer[1]
    choice = generate(deployment, prompt, sampling_params={"stop_token_ids": [world]})["choices"][0]
    # as vLLM: the stop token is the last token id, and stop_reason names it
    assert (choice["token_ids"], choice["finish_reason"], choice["stop_reason"]) == (answer[:2], "stop", world)
    last = stream(deployment, prompt, sampling_params={"stop_token_ids": [world]})[-2]["choices"][0]
    assert (last["token_ids"], last["finish_reason"], last["stop_reason"]) == ([world], "stop", world)


def test_stop_strings(deployment, tok, say):
    prompt, answer = say("Hello world. Goodbye")
    params = {"stop": "."}
    choice = generate(deployment, prompt, sampling_params=params)["choices"][0]
    assert tok.decode(choice["token_ids"]) == "Hello world."  # up to the token that completes the stop string
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", ".")
    text = generate(deployment, prompt, sampling_params=params, output_mode="text")["choices"][0]
    assert text["text"] == "Hello world" and text["token_ids"] == choice["token_ids"]
    kept = generate(deployment, prompt, sampling_params=params | {"include_stop_str_in_output": True},
                    output_mode="text")
    assert kept["choices"][0]["text"] == "Hello world."


def test_max_tokens(deployment, tok):
    prompt = tok.encode("Tell me about foxes.")
    choice = generate(deployment, prompt, sampling_params={"max_tokens": 5})["choices"][0]
    assert choice["token_ids"] == tok.encode(DEFAULT_TEXT)[:5]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    chunks = stream(deployment, prompt, sampling_params={"max_tokens": 3})[:-1]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == tok.encode(DEFAULT_TEXT)[:3]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_output_mode_text(deployment, tok, say):
    prompt, answer = say("Héllo wörld")
    body = generate(deployment, prompt, output_mode="text", sampling_params={"logprobs": 1})
    choice = body["choices"][0]
    assert body["output_mode"] == "text" and choice["text"] == "Héllo wörld" and choice["token_ids"] == answer
    content = choice["logprobs"]["content"]  # OpenAI chat's logprobs, EOS's entry last
    assert len(content) == len(answer) and content[-1]["token"] == tok.decode(answer[-1:])
    assert bytes(b for e in content[:-1] for b in e["bytes"]).decode() == "Héllo wörld"
    assert content[0] == {"token": content[0]["token"], "logprob": -0.25, "bytes": content[0]["bytes"],
                          "top_logprobs": [{"token": content[0]["token"], "logprob": -0.25,
                                            "bytes": content[0]["bytes"]}]}
    plain = generate(deployment, say("Hello world")[0], output_mode="text", sampling_params={"logprobs": 0})
    assert [e["token"] for e in plain["choices"][0]["logprobs"]["content"]][:-1] == ["Hello", " world"]
    chunks = stream(deployment, prompt, output_mode="text")[:-1]
    assert all(c["output_mode"] == "text" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Héllo wörld"
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == answer


def test_return_token_ids(deployment, say):
    prompt, _ = say("echo the prompt")
    assert generate(deployment, prompt, return_token_ids=True)["prompt_token_ids"] == prompt
    chunks = stream(deployment, prompt, return_token_ids=True)[:-1]
    assert chunks[0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in c for c in chunks[1:])  # the first chunk only


def test_sampling_params_reach_the_engine(deployment, tok):
    """The test engine's `[[echo]]` writes the options it received: sampling_params map onto them."""
    params = {"temperature": 0.5, "top_p": 0.9, "top_k": 0, "min_p": 0.1, "presence_penalty": 0.5,
              "frequency_penalty": -0.5, "repetition_penalty": 1.1, "seed": 7, "stop_token_ids": [48000],
              "min_tokens": 1, "logprobs": 3, "skip_special_tokens": False,
              "structured_outputs": {"regex": "[a-z]+"}}
    body = generate(deployment, tok.encode("[[echo]]"), sampling_params=params, output_mode="text",
                    cache_salt="salty")
    echo = json.loads(body["choices"][0]["text"])
    sampling, stop = echo["sampling_options"], echo["stop_conditions"]
    assert {k: sampling[k] for k in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                     "repetition_penalty", "seed")} == \
        {k: params[k] for k in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                "repetition_penalty", "seed")}
    assert sampling["top_k"] == -1  # vLLM's 0: no top-k
    assert sampling["guided_decoding"] == {"regex": "[a-z]+"}
    assert stop["stop_token_ids"] == [48000] and stop["min_tokens"] == 1
    assert echo["output_options"] == {"logprobs": 3, "skip_special_tokens": False}
    assert echo["routing"]["cache_salt"] == "salty"


def test_same_tokens_as_completions_with_the_same_ids(deployment, tok, say):
    client = deployment.client(api_key=KEY)
    for prompt, max_tokens in ((say("Same answer, both routes")[0], None), (tok.encode("Go on:"), 9)):
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
        choice = generate(deployment, prompt, sampling_params={"max_tokens": max_tokens})["choices"][0]
        assert tok.decode(choice["token_ids"], skip_special_tokens=True) == completion.choices[0].text
        assert len(choice["token_ids"]) == completion.usage.completion_tokens
        assert choice["finish_reason"] == completion.choices[0].finish_reason


def test_mid_stream_failure(deployment, tok):
    prompt = tok.encode("[[fail]]")
    *chunks, error, done = stream(deployment, prompt)
    assert done == "[DONE]" and chunks and all(c["choices"][0]["token_ids"] for c in chunks)
    assert error["error"]["code"] == 500
    assert error["error"]["type"] == "InternalServerError" and error["error"]["param"] is None
    r = post(deployment, {"token_ids": prompt, "sampling_params": {}})
    assert r.status_code == 500 and r.json()["error"] == error["error"]


def test_api_key_guards_the_route(deployment, say):
    prompt, _ = say("x")
    body = {"token_ids": prompt, "sampling_params": {}}
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = post(deployment, body, headers)
        assert r.status_code == 401
        error = conforms(ErrorResponse, r.text).error
        assert (error.message, error.type, error.param, error.code) == \
            ("Incorrect or missing API key", "Unauthorized", None, 401)
    assert post(deployment, body, {"x-api-key": KEY}).status_code == 200
    # /tokenize stays open, as vLLM's
    assert httpx.post(f"{deployment.url}/tokenize", json={"prompt": "x"}).status_code == 200


def _refused(deployment: Deployment, body: dict[str, Any], status: int = 400) -> dict[str, Any]:
    r = post(deployment, body)
    assert r.status_code == status, r.text
    error = conforms(ErrorResponse, r.text).error
    assert error.code == status and error.message
    return r.json()["error"]


IDS = [1, 2, 3]
SP = {"token_ids": IDS, "sampling_params": {}}


def sp(**params: Any) -> dict[str, Any]:
    return {"token_ids": IDS, "sampling_params": params}


@pytest.mark.parametrize(("body", "param"), [
    # vLLM's fields that tandem does not honour
    (SP | {"features": {"mm_hashes": {}, "mm_placeholders": {}}}, "features"),
    (SP | {"content_parts": [{"type": "image_url", "url": "http://x"}]}, "content_parts"),
    (SP | {"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    (SP | {"ec_transfer_params": {}}, "ec_transfer_params"),
    (SP | {"reasoning_ended": True}, "reasoning_ended"),
    (SP | {"reasoning_parser_kwargs": {"chat_template_kwargs": {}}}, "reasoning_parser_kwargs"),
    (SP | {"priority": 1}, "priority"),
    (sp(prompt_logprobs=1), "sampling_params.prompt_logprobs"),
    (sp(logit_bias={"1": 5.0}), "sampling_params.logit_bias"),
    (sp(allowed_token_ids=[1, 2]), "sampling_params.allowed_token_ids"),
    (sp(bad_words=["x"]), "sampling_params.bad_words"),
    (sp(spaces_between_special_tokens=False), "sampling_params.spaces_between_special_tokens"),
    (sp(no_such_param=1), "sampling_params.no_such_param"),
    (sp(structured_outputs={"json_object": True}), "sampling_params.structured_outputs.json_object"),
    (sp(n=2), "sampling_params.n"),
    (sp(logprobs=-1), "sampling_params.logprobs"),
    # ranges, named under sampling_params
    (sp(logprobs=21), "sampling_params.logprobs"),
    (sp(temperature=3), "sampling_params.temperature"),
    (sp(top_p=0), "sampling_params.top_p"),
    (sp(top_k=-2), "sampling_params.top_k"),
    (sp(min_p=2), "sampling_params.min_p"),
    (sp(presence_penalty=3), "sampling_params.presence_penalty"),
    (sp(repetition_penalty=0), "sampling_params.repetition_penalty"),
    (sp(seed=2**64), "sampling_params.seed"),
    (sp(max_tokens=0), "sampling_params.max_tokens"),
    (sp(max_tokens=10**9), "sampling_params.max_tokens"),  # beyond the context
    (sp(min_tokens=5, max_tokens=2), "sampling_params.min_tokens"),
    (sp(stop=["x"] * 17), "sampling_params.stop"),
    (sp(stop_token_ids=[-1]), "sampling_params.stop_token_ids[0]"),
    (sp(stop="x", detokenize=False), "sampling_params.stop"),
    (sp(temperature="hot"), "sampling_params.temperature"),
    (sp(structured_outputs={"regex": "a", "choice": ["b"]}), "sampling_params.structured_outputs"),
    (sp(structured_outputs={}), "sampling_params.structured_outputs"),
    (sp(structured_outputs={"json": "{not json"}), "sampling_params.structured_outputs.json"),
    (sp(structured_outputs={"choice": []}), "sampling_params.structured_outputs.choice"),
    # the body
    ({"token_ids": IDS}, "sampling_params"),
    ({"sampling_params": {}}, "token_ids"),
    ({"token_ids": [], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [1, -1], "sampling_params": {}}, "token_ids[1]"),
    ({"token_ids": [1, 2**32], "sampling_params": {}}, "token_ids[1]"),
    ({"token_ids": [1, 10**6], "sampling_params": {}}, "token_ids"),  # outside the vocabulary
    ({"token_ids": [1] * 9000, "sampling_params": {}}, "token_ids"),  # longer than the context
    (SP | {"output_mode": "html"}, "output_mode"),
    ({"token_ids": IDS, "sampling_params": {"detokenize": False}, "output_mode": "text"}, "output_mode"),
    (SP | {"cache_salt": ""}, "cache_salt"),
    (SP | {"cache_salt": "a/b"}, "cache_salt"),
    (SP | {"cache_salt": "s" * 129}, "cache_salt"),
    (SP | {"model": ""}, "model"),
    (SP | {"request_id": 7}, "request_id"),
])
def test_refusals_name_the_field(deployment, body, param):
    error = _refused(deployment, body)
    assert error["param"] == param and error["type"] == "BadRequestError", error


def test_unknown_fields_at_the_top_are_ignored_but_nulls_of_unserved_ones_pass(deployment, say):
    prompt, answer = say("fine")
    body = generate(deployment, prompt, token_offsets=None, some_client_extra={"a": 1}, kv_transfer_params=None,
                    priority=0, sampling_params={"top_k": -1, "detokenize": True, "n": 1, "seed": None})
    assert body["choices"][0]["token_ids"] == answer


def test_unknown_model_is_404(deployment):
    error = _refused(deployment, SP | {"model": "nope"}, 404)
    assert error["param"] == "model" and error["type"] == "NotFoundError"


def test_model_required_when_several_and_the_models_it_cannot_serve(tmp_path, smollm2, say):
    deployment = Deployment(tmp_path, smollm2, engines=[["--model-name", "a"], ["--model-name", "emb", "--endpoint-types", "embedding"],
                                                        ["--model-name", "text", "--model-input", "Text"]])
    try:
        prompt, answer = say("picked")
        for model in (None, "emb", "text"):
            r = post(deployment, {"token_ids": prompt, "sampling_params": {}} | ({"model": model} if model else {}))
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        assert generate(deployment, prompt, model="a")["choices"][0]["token_ids"] == answer
    finally:
        deployment.stop()
