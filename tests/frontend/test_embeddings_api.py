"""OpenAI's /v1/embeddings on tandem's frontend, through the official `openai` client, in front of the test
engine serving as an embedding model next to a generation model: inputs as texts or token ids, batches,
float and base64 vectors, matryoshka `dimensions`, routing across workers, the mocker as an embedding
model, and every bad request a 4xx naming its field (the model's kind included: no chat for an embedding
model, no embeddings from a generation model)."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import numpy as np
import openai
import pytest

from tandem.worker.synthetic import synthetic_embedding
from tests.support.deployment import MODEL, Deployment, metric_sum

EMBEDDER = "embedder"
SIZE = 576  # SmolLM2's hidden size: the test engine's vectors


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, smollm2):
    """Two embedding workers (test engine) and one generation worker on one frontend."""
    embedding = ["--endpoint-types", "embedding", "--model-name", EMBEDDER]
    deployment = Deployment(tmp_path_factory.mktemp("embeddings"), smollm2, engines=[embedding, embedding, []])
    yield deployment
    deployment.stop()


def post(deployment: Deployment, body: object, path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(f"{deployment.url}{path}", json=body, timeout=30)


def expected(tok, text: str, dimensions: int | None = None) -> list[float]:
    """What the test engine answers for `text`: a vector seeded by its token ids (special tokens added)."""
    return synthetic_embedding(tok.encode(text, add_special_tokens=True), SIZE, dimensions)


def test_texts_in_order_with_usage(deployment, tok):
    texts = ["The capital of France is Paris.", "hello world", "A third, longer input about embeddings."]
    reply = deployment.client().embeddings.create(model=EMBEDDER, input=texts)
    assert reply.object == "list" and reply.model == EMBEDDER
    assert [d.index for d in reply.data] == [0, 1, 2]
    for item, text in zip(reply.data, texts, strict=True):
        assert item.object == "embedding"
        assert np.allclose(item.embedding, expected(tok, text))
        assert math.isclose(sum(x * x for x in item.embedding), 1.0, rel_tol=1e-6)
    prompt_tokens = sum(len(tok.encode(t, add_special_tokens=True)) for t in texts)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == prompt_tokens


def test_one_text_and_token_id_inputs_agree(deployment, tok):
    text = "Embeddings of the same tokens are the same."
    ids = tok.encode(text, add_special_tokens=True)
    client = deployment.client()
    by_text = client.embeddings.create(model=EMBEDDER, input=text).data[0].embedding
    by_ids = client.embeddings.create(model=EMBEDDER, input=ids).data[0].embedding
    batch = client.embeddings.create(model=EMBEDDER, input=[ids, ids[:3]])
    assert by_text == by_ids == batch.data[0].embedding
    assert np.allclose(batch.data[1].embedding, synthetic_embedding(ids[:3], SIZE))
    assert batch.usage.prompt_tokens == len(ids) + 3


def test_base64_is_float32_as_the_client_decodes_it(deployment, tok):
    text = "base64 please"
    raw = post(deployment, {"model": EMBEDDER, "input": text, "encoding_format": "base64"}).json()
    encoded = raw["data"][0]["embedding"]
    assert isinstance(encoded, str)
    floats = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert floats.shape == (SIZE,) and np.allclose(floats, expected(tok, text), atol=1e-6)
    big = post(deployment, {"model": EMBEDDER, "input": text, "encoding_format": "base64", "endianness": "big"}).json()
    assert np.allclose(np.frombuffer(base64.b64decode(big["data"][0]["embedding"]), dtype=">f4"), floats)
    # The openai client asks for base64 by default when numpy is present and decodes it itself.
    assert np.allclose(deployment.client().embeddings.create(model=EMBEDDER, input=text).data[0].embedding, floats)
    packed = struct.pack(f"<{SIZE}f", *floats)
    assert base64.b64encode(packed).decode() == encoded


def test_dimensions_cut_a_matryoshka_model(deployment, tok):
    reply = deployment.client().embeddings.create(model=EMBEDDER, input=["short", "vectors"], dimensions=64)
    for item, text in zip(reply.data, ["short", "vectors"], strict=True):
        assert len(item.embedding) == 64
        assert np.allclose(item.embedding, expected(tok, text, 64))
    response = post(deployment, {"model": EMBEDDER, "input": "x", "dimensions": SIZE + 1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "dimensions"


def test_each_embedding_worker_answers_and_is_counted(deployment):
    """Requests pinned to each embedding worker (x-worker-instance-id) are answered the same; one pinned to
    the generation worker is a 404, it does not serve the embedding model; the frontend counts them."""
    count = lambda: metric_sum(httpx.get(f"{deployment.url}/metrics").text,  # noqa: E731
                               "dynamo_frontend_requests_total", endpoint="embeddings", status="success")
    before = count()
    generator = int(deployment.engines[2].ready[0], 16)
    vectors = []
    for engine in deployment.engines[:2]:
        pin = {"x-worker-instance-id": str(int(engine.ready[0], 16))}
        response = httpx.post(f"{deployment.url}/v1/embeddings", json={"model": EMBEDDER, "input": "pinned"},
                              headers=pin, timeout=30)
        assert response.status_code == 200
        vectors.append(response.json()["data"][0]["embedding"])
    assert vectors[0] == vectors[1]
    response = httpx.post(f"{deployment.url}/v1/embeddings", json={"model": EMBEDDER, "input": "pinned"},
                          headers={"x-worker-instance-id": str(generator)}, timeout=30)
    assert response.status_code == 404 and response.json()["error"]["param"] == "x-worker-instance-id"
    assert count() == before + 2


def test_the_model_kind_decides_the_route(deployment):
    client = deployment.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=EMBEDDER, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["param"] == "model" and "embedding model" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=EMBEDDER, prompt="hi")
    assert refused.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input="hi")
    assert refused.value.body["param"] == "model" and "not an embedding model" in refused.value.body["message"]
    for path, body in (("/v1/responses", {"model": EMBEDDER, "input": "hi"}),
                       ("/v1/messages", {"model": EMBEDDER, "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "hi"}]})):
        response = post(deployment, body, path)
        assert response.status_code == 400, path
    # The tokenizer routes serve an embedding model too.
    assert post(deployment, {"model": EMBEDDER, "prompt": "hi"}, "/tokenize").json()["count"] >= 1
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices[0].message.content


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": EMBEDDER}, 400, "input"),
    ({"model": EMBEDDER, "input": []}, 400, "input"),
    ({"model": EMBEDDER, "input": ""}, 400, "input"),
    ({"model": EMBEDDER, "input": ["a", ""]}, 400, "input[1]"),
    ({"model": EMBEDDER, "input": ["a", 3]}, 400, "input[1]"),
    ({"model": EMBEDDER, "input": [[1, 2], "a"]}, 400, "input[1]"),
    ({"model": EMBEDDER, "input": [1, -2]}, 400, "input[1]"),
    ({"model": EMBEDDER, "input": [[1], [2, 10**12]]}, 400, "input[1][1]"),
    ({"model": EMBEDDER, "input": [[1], [2, 10**8]]}, 400, "input[1][1]"),  # beyond the vocabulary
    ({"model": EMBEDDER, "input": [[]]}, 400, "input[0]"),
    ({"model": EMBEDDER, "input": 7}, 400, "input"),
    ({"model": EMBEDDER, "input": ["x"] * 2049}, 400, "input"),
    ({"model": EMBEDDER, "input": "word " * 9000}, 400, "input"),
    ({"model": EMBEDDER, "input": ["ok", "word " * 9000]}, 400, "input[1]"),
    ({"model": EMBEDDER, "input": [1] * 8193}, 400, "input"),
    ({"model": EMBEDDER, "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"model": EMBEDDER, "input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"model": EMBEDDER, "input": "x", "dimensions": "64"}, 400, "dimensions"),
    ({"model": EMBEDDER, "input": "x", "embed_dtype": "float16"}, 400, "embed_dtype"),
    ({"model": EMBEDDER, "input": "x", "truncate_prompt_tokens": 4}, 400, "truncate_prompt_tokens"),
    ({"model": EMBEDDER, "input": "x", "use_activation": False}, 400, "use_activation"),
    ({"model": EMBEDDER, "input": "x", "priority": 3}, 400, "priority"),
    ({"model": EMBEDDER, "messages": [{"role": "user", "content": "x"}]}, 400, "messages"),
    ({"model": "", "input": "x"}, 400, "model"),
    ({"model": "nope", "input": "x"}, 404, "model"),
    ({"input": "x"}, 400, "model"),
])
def test_bad_requests_name_the_field(deployment, body, status, param):
    response = post(deployment, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_a_generation_model_keeps_serving_through_bad_embedding_requests(deployment):
    for _ in range(3):
        assert post(deployment, {"model": EMBEDDER, "input": [[1], []]}).status_code == 400
    assert post(deployment, {"model": EMBEDDER, "input": "still fine"}).status_code == 200


def test_the_mocker_serves_as_an_embedding_model(tmp_path, smollm2, tok):
    """`tandem mocker --endpoint-types embedding`: a simulated embedding model for scale tests."""
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker",
                            engines=[["--endpoint-types", "embedding", "--model-name", "mock-embedder",
                                      "--speedup-ratio", "100"]])
    try:
        reply = deployment.client().embeddings.create(model="mock-embedder", input=["one", "two two"],
                                                      dimensions=32)
        assert [len(d.embedding) for d in reply.data] == [32, 32]
        assert np.allclose(reply.data[1].embedding, synthetic_embedding(tok.encode("two two", add_special_tokens=True),
                                                                        SIZE, 32))
        assert reply.usage.prompt_tokens == len(tok.encode("one", add_special_tokens=True)) + len(
            tok.encode("two two", add_special_tokens=True))
        with pytest.raises(openai.BadRequestError):
            deployment.client().chat.completions.create(model="mock-embedder",
                                                        messages=[{"role": "user", "content": "hi"}])
    finally:
        deployment.stop()
