"""Images on the KV router's side (`tandem.frontend.media`): placeholders expanded as the engine expands them,
each image's content hash on the blocks its span overlaps, and the same hashes as a worker's relay makes of
the engine's KV events for those blocks; http images fetched once, within the limits, and sent on as data."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from tandem.frontend.media import RoutedImages
from tandem.frontend.protocol.errors import RequestError
from tandem.llm.images import ImageLimits, ImageLoader, data_url_bytes
from tandem.llm.model_card import ImagePrompt
from tandem.llm.protocols import MediaItem, MultiModalData, PreprocessedRequest
from tandem.router.hashing import (
    MediaSpan,
    digest_hash,
    expand_placeholders,
    local_block_hashes,
    media_block_hashes,
    request_seed,
)
from tandem.vllm.publisher import KvEventRelay
from tests.support.images import png as sample_png
from tests.support.ports import free_port
from tests.vllm.test_vllm_publisher import FakePublisher, stored_map

IMAGE = 900  # the placeholder token
PROMPT = ImagePrompt(tokens=[901, 902, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, 903], offset=1, length=6)


def png(color: str) -> bytes:
    return sample_png(color, (8, 8))


def test_placeholders_expand_in_order_with_each_images_span():
    tokens, spans = expand_placeholders([1, 2, IMAGE, 3, IMAGE], IMAGE, PROMPT, [11, 22])
    assert tokens == [1, 2, *PROMPT.tokens, 3, *PROMPT.tokens]
    assert spans == [MediaSpan(3, 6, 11), MediaSpan(12, 6, 22)]
    assert tokens[spans[1].offset - 1] == 901 and tokens[spans[1].offset + spans[1].length] == 903


def test_an_image_is_on_every_block_its_span_overlaps():
    spans = [MediaSpan(3, 6, 11), MediaSpan(9, 2, 22)]
    assert media_block_hashes(spans, 4, 4) == [[11], [11], [11, 22], None]
    assert media_block_hashes([MediaSpan(14, 6, 5)], 4, 4) == [None, None, None, [5]]  # past the last full block
    assert media_block_hashes([MediaSpan(0, 0, 5)], 2, 4) == [None, None]


def engine_extra_keys(spans: list[MediaSpan], digests: list[str], n_blocks: int, block_size: int) -> list:
    """The `extra_keys` of a BlockStored event as vLLM writes them: per block, `[identifier, offset]` of each
    item overlapping it (the offset relative to the block's start)."""
    keys = []
    for n in range(n_blocks):
        start, end = n * block_size, (n + 1) * block_size
        block = [[digest, span.offset - start] for span, digest in zip(spans, digests, strict=True)
                 if span.offset < end and span.offset + span.length > start]
        keys.append(block or None)
    return keys


@pytest.mark.parametrize("block_size", [4, 16])
def test_the_routers_hashes_are_the_workers_of_the_engines_events(block_size):
    digests = [hashlib.sha256(png(c)).hexdigest() for c in ("red", "blue")]
    text = list(range(40))
    prompt = [*text[:13], IMAGE, *text[13:20], IMAGE, *text[20:]]
    tokens, spans = expand_placeholders(prompt, IMAGE, PROMPT, [digest_hash(d) for d in digests])
    n_blocks = len(tokens) // block_size
    seed = request_seed(cache_salt="s")
    routed = local_block_hashes(tokens, block_size, seed, mm_hashes=media_block_hashes(spans, n_blocks, block_size))

    publisher = FakePublisher()
    relay = KvEventRelay(None, worker_id=1, kv_block_size=block_size, zmq_endpoint="tcp://127.0.0.1:1",
                         publisher=publisher)
    relay.handle_event(stored_map(list(range(1, n_blocks + 1)), None, tokens[: n_blocks * block_size],
                                  block_size=block_size, extra_keys=engine_extra_keys(spans, digests, n_blocks,
                                                                                      block_size)))
    # The relay's seed carries no cache salt (vLLM's events do not say it): compare under the same seed.
    relayed = [b["tokens_hash"] for b in publisher.sent[0]["event"]["data"]["stored"]["blocks"]]
    assert relayed == local_block_hashes(tokens, block_size, mm_hashes=media_block_hashes(spans, n_blocks,
                                                                                           block_size))
    assert len(routed) == len(relayed) == n_blocks
    # Another image changes the blocks it is on and every one after, and none before.
    other = expand_placeholders(prompt, IMAGE, PROMPT, [digest_hash(digests[0]), digest_hash("ff" * 32)])
    changed = local_block_hashes(other[0], block_size, seed,
                                 mm_hashes=media_block_hashes(other[1], n_blocks, block_size))
    first = spans[1].offset // block_size
    assert changed[:first] == routed[:first] and changed[first] != routed[first]


@pytest.fixture
async def image_server() -> AsyncIterator[str]:
    """A loopback server of PNGs: /<color>.png."""

    async def image(request: web.Request) -> web.Response:
        return web.Response(body=png(request.match_info["color"]), content_type="image/png")

    app = web.Application()
    app.router.add_get("/{color}.png", image)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


def request_with(*urls: str) -> PreprocessedRequest:
    return PreprocessedRequest(token_ids=[1, IMAGE, 2, IMAGE][: 2 * len(urls)],
                               multi_modal_data=MultiModalData(image_url=[MediaItem(u) for u in urls]))


async def test_fetched_images_go_on_as_data_and_are_hashed_by_content(image_server):
    routed = RoutedImages(ImageLoader(ImageLimits(allow_private=True)))
    inline = "data:image/png;base64," + base64.b64encode(png("red")).decode()
    request = request_with(f"{image_server}/red.png", inline)
    try:
        tokens, spans = await routed.expand(request, IMAGE, PROMPT)
    finally:
        await routed.loader.close()
    assert request.multi_modal_data is not None
    sent = [item.url for item in request.multi_modal_data.image_url]
    assert sent[0].startswith("data:image/png;base64,") and sent[1] == inline
    assert data_url_bytes(sent[0], ImageLimits()) == png("red")
    red = digest_hash(hashlib.sha256(png("red")).hexdigest())
    assert [span.hash for span in spans] == [red, red] and len(tokens) == 4 + 2 * (len(PROMPT.tokens) - 1)


async def test_an_image_the_frontend_cannot_have_is_the_clients_error(image_server):
    private = RoutedImages(ImageLoader(ImageLimits()))  # loopback refused
    small = RoutedImages(ImageLoader(ImageLimits(allow_private=True, max_bytes=10)))
    try:
        with pytest.raises(RequestError, match="image 0") as refused:
            await private.expand(request_with(f"{image_server}/red.png"), IMAGE, PROMPT)
        assert refused.value.status == 400
        with pytest.raises(RequestError, match="over the limit of 10 bytes") as large:
            await small.expand(request_with(f"{image_server}/red.png"), IMAGE, PROMPT)
        assert large.value.status == 413
        with pytest.raises(RequestError, match="invalid base64"):
            await private.expand(request_with("data:image/png;base64,@@"), IMAGE, PROMPT)
        two_placeholders = request_with("data:image/png;base64,AA==", "data:image/png;base64,AA==")
        two_placeholders.multi_modal_data.image_url.pop()  # type: ignore[union-attr]
        with pytest.raises(RequestError, match="2 image placeholders for 1 images"):
            await private.expand(two_placeholders, IMAGE, PROMPT)
    finally:
        await private.loader.close()
        await small.loader.close()
