"""Images for the engines without a model (the mocker, the test engine): `--enable-multimodal` and its
options, and a request's images read (never decoded) and put in its prompt the way a vision-language engine
would, so that their token counts, block hashes and KV events are a real engine's."""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass
from typing import Any

from tandem.llm.images import ImageError, ImageLimits, ImageLoader
from tandem.llm.model_card import ImagePrompt
from tandem.llm.protocols import PreprocessedRequest
from tandem.router.hashing import MediaSpan, digest_hash, expand_placeholders
from tandem.runtime.errors import InvalidRequestError
from tandem.runtime.options import ALLOW_PRIVATE_MEDIA_URLS, add_options

DEFAULT_IMAGE_TOKENS = 64


@dataclass(frozen=True)
class SimulatedImages:
    """The simulated model takes images (--enable-multimodal): each placeholder `token_id` in a prompt becomes
    `tokens` image tokens, encoded in `encode_ms` (simulated) unless the prefix cache holds the image's blocks."""

    token_id: int
    tokens: int = DEFAULT_IMAGE_TOKENS
    encode_ms: float = 0.0
    allow_private_urls: bool = False

    @property
    def prompt(self) -> ImagePrompt:
        """What one placeholder becomes: `tokens` image tokens, all of them the image's span."""
        return ImagePrompt([self.token_id] * self.tokens, 0, self.tokens)

    def card_fields(self) -> dict[str, Any]:
        """The model card's runtime-config fields that tell the frontend (and its router) about the images."""
        return {"image_token_id": self.token_id, "image_prompt": self.prompt}


def add_image_args(parser: argparse.ArgumentParser, defaults: object) -> None:
    """--enable-multimodal, --image-tokens, --image-encode-ms and --allow-private-media-urls, in their own group."""
    images = parser.add_argument_group("Images")
    images.add_argument("--enable-multimodal", action="store_true",
                        help="take images with the token prompt (a model whose config.json names its image token, "
                        "aggregated); their bytes are read for their content hash, never decoded")
    images.add_argument("--image-tokens", type=int, default=None, metavar="N",
                        help=f"tokens each image takes in the prompt [{DEFAULT_IMAGE_TOKENS}]")
    images.add_argument("--image-encode-ms", type=float, default=None, metavar="MS",
                        help="simulated encoder time per image, paid on the step that prefills it unless the "
                        "prefix cache holds it [0]")
    add_options(images, (ALLOW_PRIVATE_MEDIA_URLS,), defaults)


def simulated_images(args: argparse.Namespace, model_config: dict[str, object]) -> SimulatedImages | None:
    """The flags of `add_image_args`, checked against the model (ValueError naming the flag)."""
    if not args.enable_multimodal:
        for flag, value in (("--image-tokens", args.image_tokens), ("--image-encode-ms", args.image_encode_ms)):
            if value is not None:
                raise ValueError(f"{flag} needs --enable-multimodal")
        return None
    token_id = model_config.get("image_token_id", model_config.get("image_token_index"))
    if not isinstance(token_id, int):
        raise ValueError("--enable-multimodal: the model's config.json names no image token (image_token_id): "
                         "it is not a vision-language model")
    tokens = DEFAULT_IMAGE_TOKENS if args.image_tokens is None else args.image_tokens
    encode_ms = 0.0 if args.image_encode_ms is None else args.image_encode_ms
    if tokens < 1:
        raise ValueError(f"--image-tokens must be at least 1, got {tokens}")
    if encode_ms < 0:
        raise ValueError(f"--image-encode-ms must not be negative, got {encode_ms}")
    return SimulatedImages(token_id, tokens, encode_ms, bool(ALLOW_PRIVATE_MEDIA_URLS.value(args, False)))


class ImagePrompts:
    """A worker's reader of requests' images: `expand` gives the prompt with each image's tokens in place of its
    placeholder and where each image sits, with its content hash (the bytes' sha256, as vLLM names items)."""

    def __init__(self, images: SimulatedImages | None, engine: str) -> None:
        self.images = images  # None: the worker was started without --enable-multimodal
        self.engine = engine  # "the mocker", "the test engine": named in the refusal
        self._loader: ImageLoader | None = None  # made on the first request with images

    async def expand(self, request: PreprocessedRequest) -> tuple[list[int], list[MediaSpan]]:
        """The request's prompt and image spans; InvalidRequestError (the client's 4xx) for images this worker
        cannot take: without --enable-multimodal, video, a count that does not match the placeholders, an image
        that cannot be read (a broken image is not noticed: no encoder looks at it)."""
        media = request.multi_modal_data
        if media is None:
            return request.token_ids, []
        images = self.images
        if images is None:
            raise InvalidRequestError("Received multimodal data but multimodal processing is not enabled: start "
                                      f"{self.engine} with --enable-multimodal")
        if media.video_url:
            raise InvalidRequestError("multi_modal_data.video_url: video input is not supported yet")
        placed = request.token_ids.count(images.token_id)
        if placed != len(media.image_url):
            raise InvalidRequestError(f"multi_modal_data: {len(media.image_url)} images for {placed} image "
                                      "placeholders in the prompt")
        if self._loader is None:
            self._loader = ImageLoader(ImageLimits(allow_private=images.allow_private_urls))
        try:
            blobs = await self._loader.read_all([item.url for item in media.image_url])
        except ImageError as e:
            raise InvalidRequestError(f"multi_modal_data.image_url: {e}", e.status) from None
        hashes = [digest_hash(hashlib.sha256(blob).hexdigest()) for blob in blobs]
        return expand_placeholders(request.token_ids, images.token_id, images.prompt, hashes)

    async def close(self) -> None:
        if self._loader is not None:
            await self._loader.close()
