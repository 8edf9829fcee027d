"""Images through the frontend to the deterministic test engine (`--enable-multimodal`): the chat, Anthropic and
Responses APIs put each image where its message has it, the engine receives them in the prompt's order (it
answers `[[images]]` with their content digests), counts their tokens in the usage and keys its prefix cache by
their content; bad images are the client's 400 and the engine keeps serving."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from tandem.testing.engine import parse_args
from tests.support.deployment import MODEL, Deployment
from tests.support.images import data_url, png

BLOCK = 16
IMAGE_TOKENS = 40
ENGINE = ["--served-model-name", MODEL, "--block-size", str(BLOCK), "--enable-multimodal", "--image-tokens",
          str(IMAGE_TOKENS), "--allow-private-media-urls"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory, vlm_folder: str) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path_factory.mktemp("vlm"), vlm_folder, engines=[ENGINE])
    yield deployment
    deployment.stop()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:8]


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(vlm: Deployment, *messages: dict, max_tokens: int = 32):  # type: ignore[no-untyped-def]
    return vlm.client().chat.completions.create(model=MODEL, messages=list(messages), max_tokens=max_tokens)


def test_images_reach_the_engine_in_order_and_count_their_tokens(vlm: Deployment, images: str) -> None:
    red, green, blue = png("red"), png("green"), png("blue")
    first = {"role": "user", "content": [{"type": "text", "text": "[[images]] Two pictures:"}, image(data_url(red)),
                                         image(f"{images}/green.png")]}
    reply = chat(vlm, first, {"role": "assistant", "content": "I see them."},
                 {"role": "user", "content": [image(data_url(blue)), {"type": "text", "text": "and this one?"}]})
    assert reply.choices[0].message.content == f"images: {digest(red)} {digest(green)} {digest(blue)}"
    fewer = chat(vlm, {"role": "user", "content": [{"type": "text", "text": "[[images]] Two pictures:"},
                                                   image(data_url(red))]})
    assert fewer.choices[0].message.content == f"images: {digest(red)}"
    one_image_more = chat(vlm, {"role": "user", "content": [{"type": "text", "text": "[[images]] Two pictures:"},
                                                            image(data_url(red)), image(data_url(green))]})
    assert one_image_more.usage.prompt_tokens - fewer.usage.prompt_tokens == IMAGE_TOKENS


def test_anthropic_and_responses_images_reach_the_engine(vlm: Deployment, images: str) -> None:
    red, orange = png("red"), png("orange")
    client = anthropic.Anthropic(base_url=vlm.url, api_key="none", max_retries=0)
    message = client.messages.create(model=MODEL, max_tokens=32, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": data_url(red).split(",", 1)[1]}},
        {"type": "image", "source": {"type": "url", "url": f"{images}/orange.png"}},
        {"type": "text", "text": "[[images]]"}]}])
    assert message.content[0].text == f"images: {digest(red)} {digest(orange)}"  # type: ignore[union-attr]
    response = vlm.client().responses.create(model=MODEL, max_output_tokens=32, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "[[images]]"}, {"type": "input_image", "image_url": data_url(orange)}]}])
    assert response.output_text == f"images: {digest(orange)}"


def test_the_prefix_cache_is_keyed_by_the_images_content(vlm: Deployment) -> None:
    lead = "A long lead-in so that whole blocks come before the picture: " + "one two three four five " * 6

    def ask(color: str):  # type: ignore[no-untyped-def]
        return chat(vlm, {"role": "user", "content": [{"type": "text", "text": lead}, image(data_url(png(color))),
                                                      {"type": "text", "text": " what colour is it?"}]}).usage

    first = ask("purple")
    again = ask("purple")
    other = ask("yellow")
    assert first.prompt_tokens == again.prompt_tokens == other.prompt_tokens
    assert again.prompt_tokens_details.cached_tokens == first.prompt_tokens // BLOCK * BLOCK
    # another image on the same tokens: only the blocks wholly before it are cached
    assert BLOCK <= other.prompt_tokens_details.cached_tokens < first.prompt_tokens - IMAGE_TOKENS


@pytest.mark.parametrize(("url", "message"), [
    ("data:image/png;base64,!!!", "base64"),
    ("/nothing.png", "404"),
])
def test_an_image_the_engine_cannot_read_is_a_400_and_it_keeps_serving(vlm: Deployment, images: str, url: str,
                                                                      message: str) -> None:
    full = f"{images}{url}" if url.startswith("/") else url
    r = httpx.post(f"{vlm.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [image(full)]}]})
    assert r.status_code == 400, r.text
    assert "image_url" in r.json()["error"]["message"] and message in r.json()["error"]["message"], r.text
    assert chat(vlm, {"role": "user", "content": "[[say:still here]]"}).choices[0].message.content == "still here"


def test_image_flags_are_checked(smollm2: str, vlm_folder: str) -> None:
    for argv in (["--model-path", vlm_folder, "--image-tokens", "8"],  # without --enable-multimodal
                 ["--model-path", smollm2, "--enable-multimodal"],  # SmolLM2's config names no image token
                 ["--model-path", vlm_folder, "--enable-multimodal", "--model-input", "Text"],
                 ["--model-path", vlm_folder, "--enable-multimodal", "--endpoint-types", "embedding"],
                 ["--model-path", vlm_folder, "--enable-multimodal", "--image-encode-ms", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    _, worker = parse_args(["--model-path", vlm_folder, "--enable-multimodal", "--image-encode-ms", "5"])
    assert (worker.images.tokens, worker.images.encode_ms) == (64, 5.0)
