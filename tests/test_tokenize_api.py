"""vLLM's /tokenize and /detokenize on tandem's frontend: the ids are the ones the model's workers get for
the same prompt (the chat form through the model's chat template), and bad bodies are 4xx naming the field."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tokenizers

from tests.deployment import MODEL, Deployment

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: one, two, three."}]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2):
    deployment = Deployment(tmp_path_factory.mktemp("tokenize"), smollm2, engines=[[]])
    yield deployment
    deployment.stop()


def post(deployment: Deployment, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{deployment.url}{path}", json=body, timeout=30)


def test_chat_form_counts_what_the_worker_gets(deployment, tok):
    tokenized = post(deployment, "/tokenize", {"model": MODEL, "messages": MESSAGES}).json()
    reply = deployment.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert tokenized["count"] == len(tokenized["tokens"]) == reply.usage.prompt_tokens
    assert tokenized["max_model_len"] == 8192 and tokenized["token_strs"] is None
    text = tok.decode(tokenized["tokens"])
    assert text.endswith("<|im_start|>assistant\n") and "Count: one, two, three." in text
    # Without the generation prompt, and with the template's own variables.
    closed = post(deployment, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert closed["tokens"] == tokenized["tokens"][:closed["count"]] and closed["count"] < tokenized["count"]


def test_prompt_form_and_the_round_trip(deployment, smollm2):
    hf = tokenizers.Tokenizer.from_file(str(Path(smollm2) / "tokenizer.json"))  # the model's own tokenizer
    text = "Hello, wörld! 🙂"
    tokenized = post(deployment, "/tokenize", {"prompt": text, "return_token_strs": True}).json()  # model optional
    assert tokenized["tokens"] == hf.encode(text, add_special_tokens=True).ids
    assert tokenized["token_strs"] == [hf.id_to_token(i) for i in tokenized["tokens"]]
    assert post(deployment, "/detokenize", {"model": MODEL, "tokens": tokenized["tokens"]}).json() == {"prompt": text}


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
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert post(deployment, "/tokenize", {"prompt": "still serving"}).status_code == 200


def test_model_is_required_when_several_are_served(tmp_path, smollm2):
    deployment = Deployment(tmp_path, smollm2, engines=[["--model-name", "a"], ["--model-name", "b"]])
    try:
        r = post(deployment, "/tokenize", {"prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert post(deployment, "/tokenize", {"model": "b", "prompt": "x"}).status_code == 200
    finally:
        deployment.stop()
