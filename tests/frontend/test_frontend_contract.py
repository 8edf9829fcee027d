"""The frontend against its own contract and against fuzzed bytes, on a real frontend process with a test
engine:

- schemathesis generates requests from /openapi.json (valid ones and ones the schema calls invalid) and
  checks every answer: no 5xx, a documented status, the documented content type and schema, and every
  request the schema rejects refused with a 4xx;
- hypothesis throws arbitrary bodies (bytes, deep nesting, wrong types, huge numbers) at every route and
  asserts a documented 4xx (or a 200) in OpenAI's error shape, never a 5xx or a hang.

Both run derandomized with a fixed example budget, so a run is repeatable.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
import schemathesis.specs.openapi.schemas  # noqa: F401 (see below)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.deployment import MODEL, Deployment

# schemathesis loads its OpenAPI modules on first use, and pytest rewrites them as it imports them (it is a
# pytest plugin). Imported here, at collection, rather than in the first test: a parse in the middle of a
# session, with finalizers of earlier tests' processes running, can hit CPython 3.11's "AST constructor
# recursion depth mismatch" (a SystemError that failed every contract test of one run).
FUZZ = settings(derandomize=True, deadline=None, database=None, max_examples=60,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2):
    # A generation model and an embedding model: each route meets a model it serves and one it refuses.
    deployment = Deployment(tmp_path_factory.mktemp("contract"), smollm2,
                            engines=[[], ["--endpoint-types", "embedding", "--model-name", "embedder"]],
                            env={"DYN_HTTP_BODY_LIMIT_MB": "1"})
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def api_schema(deployment):
    return schemathesis.openapi.from_url(f"{deployment.url}/openapi.json")


GENERATE = [("/v1/chat/completions", "POST", 40), ("/v1/completions", "POST", 40), ("/v1/responses", "POST", 40),
            ("/v1/responses/input_tokens", "POST", 20), ("/v1/messages", "POST", 40),
            ("/v1/messages/count_tokens", "POST", 20), ("/tokenize", "POST", 30), ("/detokenize", "POST", 20),
            ("/inference/v1/generate", "POST", 40), ("/v1/embeddings", "POST", 40)]
READ = [("/v1/models/{model}", "GET", 10), ("/v1/models", "GET", 1), ("/health", "GET", 1), ("/live", "GET", 1),
        ("/metrics", "GET", 1), ("/v1/responses/{response_id}", "GET", 5), ("/v1/responses/{response_id}", "DELETE", 5)]
# Bodies can be made invalid; the read routes have nothing to invalidate (a string path parameter at most).
CASES = ([(*op, GenerationMode.POSITIVE) for op in GENERATE + READ]
         + [(*op, GenerationMode.NEGATIVE) for op in GENERATE])


@pytest.mark.parametrize(("path", "method", "examples", "mode"), CASES)
def test_openapi_contract(api_schema, deployment, path, method, examples, mode):
    operation = api_schema[path][method]

    @settings(FUZZ, max_examples=examples)
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=deployment.url, timeout=60, checks=[
            not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
            negative_data_rejection])

    check()


def test_the_contract_names_the_served_model(deployment):
    spec = httpx.get(f"{deployment.url}/openapi.json").json()
    request = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert request["properties"]["model"]["enum"] == sorted([MODEL, "embedder"])
    roles = [set(m["properties"]["role"].get("enum", [m["properties"]["role"].get("const")]))
             for m in request["properties"]["messages"]["items"]["anyOf"]]
    assert set.union(*roles) == {"system", "developer", "user", "assistant", "tool"}


# -- hypothesis over raw bodies ------------------------------------------------------------------------
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens",
           "temperature", "top_p", "top_k", "stop", "seed", "n", "logprobs", "top_logprobs", "response_format",
           "nvext", "tools", "tool_choice", "guided_json", "structured_outputs", "min_tokens", "echo",
           "input", "instructions", "max_output_tokens", "text", "reasoning", "previous_response_id", "include",
           "token_ids", "sampling_params", "output_mode", "request_id", "return_token_ids", "cache_salt", "priority",
           "kv_transfer_params", "encoding_format", "dimensions"]
# Inside /inference/v1/generate's sampling_params.
_SAMPLING_FIELDS = ["temperature", "top_k", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs",
                    "detokenize", "structured_outputs", "n", "logit_bias"]


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["fields", "bytes", "nested", "json"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "nested":
        depth = draw(st.sampled_from([1, 64, 900, 1200, 5000, 50_000]))
        return b'{"model": "' + MODEL.encode() + b'", "x": ' + b"[" * depth + b"]" * depth + b', "prompt": "a"}'
    if kind == "json":
        return json.dumps(draw(_JSON_VALUES)).encode()
    sampling: dict[str, object] = {"max_tokens": 8}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "[[say:ok]]"}], "prompt": "[[say:ok]]",
            "input": "[[say:ok]]", "max_tokens": 8, "token_ids": [1, 2, 3], "sampling_params": sampling}
    for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=4, unique=True)):
        body[name] = draw(_JSON_VALUES)
    for name in draw(st.lists(st.sampled_from(_SAMPLING_FIELDS), max_size=3, unique=True)):
        sampling[name] = draw(_JSON_VALUES)
    text = json.dumps(body, allow_nan=True)
    if draw(st.booleans()):  # raw bytes spliced into the JSON text: invalid UTF-8, control characters
        at = draw(st.integers(0, len(text)))
        return text[:at].encode() + draw(st.binary(min_size=1, max_size=4)) + text[at:].encode()
    return text.encode()


_MESSAGE = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "%s"}}], "prompt": "%s", "max_tokens": 2.0}}'


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                                  "/inference/v1/generate", "/v1/embeddings"])
@FUZZ
@given(body=_bodies())
@example(body=(_MESSAGE % ("a\\xff", "b")).encode().replace(b"\\xff", b"\xff"))  # invalid UTF-8 in a string
@example(body=(_MESSAGE % ("\\ud800", "\\udfff")).encode())  # lone surrogates, escaped
@example(body=b'{"model": "m", "x": ' + b"[" * 1200 + b"]" * 1200 + b', "prompt": "a", "max_tokens": 1.0}')
def test_fuzzed_bodies_never_get_a_server_error(deployment, path, body):
    r = httpx.post(f"{deployment.url}{path}", content=body, headers={"Content-Type": "application/json"},
                   timeout=30)  # a hang fails here
    assert r.status_code in (200, 400, 404, 413), r.text[:500]
    if r.status_code != 200:
        error = r.json()["error"]
        client_error = "BadRequestError" if path.startswith("/inference/") else "invalid_request_error"  # vLLM's type
        assert isinstance(error["message"], str) and error["type"] == client_error or r.status_code == 404
