"""vLLM's /tokenize and /detokenize on tandem's frontend: answers valid as vLLM's own TokenizeResponse and
DetokenizeResponse, the ids the model's workers get for the same prompt (the chat form through the model's
chat template), and bad bodies 4xx naming the field in OpenAI's error shape."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tokenizers
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeResponse, TokenizeResponse

from tests.support.deployment import MODEL, Deployment
from tests.support.shapes import OpenAIError, conforms

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: one, two, three."}]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2):
    deployment = Deployment(tmp_path_factory.mktemp("tokenize"), smollm2, engines=[[]])
    yield deployment
    deployment.stop()


def post(deployment: Deployment, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{deployment.url}{path}", json=body, timeout=30)


def tokenized(deployment: Deployment, body: object) -> TokenizeResponse:
    r = post(deployment, "/tokenize", body)
    assert r.status_code == 200, r.text
    return conforms(TokenizeResponse, r.text)


def detokenized(deployment: Deployment, body: object) -> DetokenizeResponse:
    r = post(deployment, "/detokenize", body)
    assert r.status_code == 200, r.text
    return conforms(DetokenizeResponse, r.text)


def test_chat_form_counts_what_the_worker_gets(deployment, tok):
    chat = tokenized(deployment, {"model": MODEL, "messages": MESSAGES})
    reply = deployment.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert chat.count == len(chat.tokens) == reply.usage.prompt_tokens
    assert chat.max_model_len == 8192 and chat.token_strs is None
    text = tok.decode(chat.tokens)
    assert text.endswith("<|im_start|>assistant\n") and "Count: one, two, three." in text
    # Without the generation prompt, and with the template's own variables.
    closed = tokenized(deployment, {"messages": MESSAGES, "add_generation_prompt": False})
    assert closed.tokens == chat.tokens[:closed.count] and closed.count < chat.count


def test_prompt_form_and_the_round_trip(deployment, smollm2):
    hf = tokenizers.Tokenizer.from_file(str(Path(smollm2) / "tokenizer.json"))  # the model's own tokenizer
    text = "Hello, wörld! 🙂"
    ids = tokenized(deployment, {"prompt": text, "return_token_strs": True})  # model optional
    assert ids.tokens == hf.encode(text, add_special_tokens=True).ids
    assert ids.token_strs == [hf.id_to_token(i) for i in ids.tokens]
    assert detokenized(deployment, {"model": MODEL, "tokens": ids.tokens}).prompt == text


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": 3}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("/tokenize", {"model": MODEL, "messages": MESSAGES, "chat_template": "{{ 7 * 7 }}"}, 400, "chat_template"),
    ("/tokenize", {"model": MODEL, "messages": MESSAGES, "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"model": MODEL, "prompt": "x " * 9000}, 400, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"model": MODEL, "tokens": [1, -2]}, 400, "tokens[1]"),
    ("/detokenize", {"model": MODEL, "tokens": [1, 10**9]}, 400, "tokens[1]"),
    ("/detokenize", {"model": MODEL, "tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"model": MODEL}, 400, "tokens"),
])
def test_bad_bodies_name_the_field(deployment, path, body, status, param):
    r = post(deployment, path, body)
    assert r.status_code == status and conforms(OpenAIError, r.text).error.param == param, r.text
    assert tokenized(deployment, {"prompt": "still serving"}).count > 0


def test_model_is_required_when_several_are_served(tmp_path, smollm2):
    deployment = Deployment(tmp_path, smollm2, engines=[["--model-name", "a"], ["--model-name", "b"]])
    try:
        r = post(deployment, "/tokenize", {"prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert post(deployment, "/tokenize", {"model": "b", "prompt": "x"}).status_code == 200
    finally:
        deployment.stop()
