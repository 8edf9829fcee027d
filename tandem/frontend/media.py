"""The images of a request the KV router routes, hashed by content so that the router's block hashes are
the engine's.

The engine puts the same tokens in place of every image placeholder (the card's `ImagePrompt`) and hashes
the blocks that overlap an image's span with the image's content digest; its KV events carry those hashes.
The router hashes the prompt the same way: expanded, each image's digest on the blocks its span overlaps.
The digest needs the image's bytes: a data URL holds them; an http(s) URL is fetched here, within the same
limits and address checks as a worker's, and goes on to the worker as a data URL, so it is fetched once.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib

from tandem.frontend.protocol.errors import RequestError
from tandem.llm.images import ImageError, ImageLoader
from tandem.llm.model_card import ImagePrompt
from tandem.llm.protocols import MediaItem, MultiModalData, PreprocessedRequest
from tandem.router.hashing import MediaSpan, digest_hash, expand_placeholders

_OFF_LOOP_BYTES = 256 * 1024  # hash and encode larger images in a thread (~1 ms per MB each)


class RoutedImages:
    """Resolves requests' images for the KV router; one per frontend process (one HTTP session)."""

    def __init__(self, loader: ImageLoader) -> None:
        self.loader = loader

    async def expand(self, request: PreprocessedRequest, image_token_id: int,
                     prompt: ImagePrompt) -> tuple[list[int], list[MediaSpan]]:
        """The prompt as the engine will see it and where its images sit, with their content hashes. The
        request's fetched images are replaced by data URLs of the same bytes. An image that cannot be had
        is the client's error (400, or 413 over a size limit)."""
        assert request.multi_modal_data is not None
        items = request.multi_modal_data.image_url
        placed = request.token_ids.count(image_token_id)
        if placed != len(items):
            raise RequestError(f"the prompt holds {placed} image placeholders for {len(items)} images")
        try:
            blobs = await self.loader.read_all([item.url for item in items])
        except ImageError as e:
            raise RequestError(str(e), status=e.status) from None
        digests = await asyncio.gather(*(_digest(blob) for blob in blobs))
        if not all(item.url.startswith("data:") for item in items):
            sent = [item if item.url.startswith("data:") else MediaItem(await _data_url(blob))
                    for item, blob in zip(items, blobs, strict=True)]
            request.multi_modal_data = MultiModalData(image_url=sent, video_url=request.multi_modal_data.video_url)
        return expand_placeholders(request.token_ids, image_token_id, prompt, [digest_hash(d) for d in digests])


async def _digest(blob: bytes) -> str:
    if len(blob) > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(lambda: hashlib.sha256(blob).hexdigest())
    return hashlib.sha256(blob).hexdigest()


async def _data_url(blob: bytes) -> str:
    encoded = await asyncio.to_thread(base64.b64encode, blob) if len(blob) > _OFF_LOOP_BYTES else base64.b64encode(blob)
    return f"data:{_media_type(blob)};base64,{encoded.decode()}"


_SIGNATURES = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"GIF8", "image/gif"), (b"BM", "image/bmp"))


def _media_type(blob: bytes) -> str:
    """The image type its first bytes spell (the worker decodes by content; the type only has to be an image's)."""
    if blob[:4] == b"RIFF" and blob[8:12] == b"WEBP":
        return "image/webp"
    return next((kind for magic, kind in _SIGNATURES if blob.startswith(magic)), "image/unknown")
