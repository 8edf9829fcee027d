"""vLLM's encoder-cache connector roles. An encoder worker (`--vllm-native-encoder-worker`, component `encoder`)
runs the vision encoder of a request's images, and its engine's connector stores each image's encoder output
under the image's content digest. A worker in `--ec-consumer-mode` first has an encoder do that, then runs the
request: its engine's connector finds the stored outputs by the same digests and loads them instead of running
its own vision encoder; an image whose output is stored already goes to no encoder again. The consumer never
depends on an encoder: with none reachable, or one that fails or stalls, its engine encodes the images itself
(the connector finds nothing to load), so the answer is the same.

A consumer with --embedding-transfer-mode takes the encoder outputs themselves: the encoder answers with each
image's file (ECExampleConnector's; `local`: on a filesystem both workers see) or, asked for it, with the file's
tensor offered by NIXL (the consumer reads it, `nixl-read`, or has the encoder write it into its memory,
`nixl-write`; see embedding_transfer.py), and the consumer gives its engine those tensors as the images'
embeddings. It then never reads, decodes or preprocesses the images; its engine needs a
model whose vLLM processor takes image embeddings (checked at start)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from vllm.sampling_params import SamplingParams

from tandem.llm.images import ImageError, ImageLimits, data_url_bytes
from tandem.llm.protocols import PreprocessedRequest
from tandem.runtime import Context
from tandem.runtime.errors import InvalidRequestError
from tandem.vllm.abort import abort_monitor
from tandem.vllm.embedding_transfer import NixlOffers, NixlReader, NixlWriteReceiver, load_stored
from tandem.vllm.handlers import BaseWorkerHandler
from tandem.worker.encoders import (
    NIXL_READ_ANNOTATION,
    NIXL_WRITE_ANNOTATION,
    EncodedImage,
    EncodedImages,
    Encoders,
)

log = logging.getLogger(__name__)

STORED_FILE = "encoder_cache.safetensors"  # ECExampleConnector's file of one image, under its digest's folder
KEPT_FILES = 4096  # files named by encoders that a consumer taking embeddings by file remembers


class EncoderWorkerHandler(BaseWorkerHandler):
    """The encoder worker: each request's images through the engine's vision encoder, stored by the engine's
    connector (the producer's engine answers without generating); one answer says where each output is."""

    # The connector's directory when its files can be named (ECExampleConnector), set by main
    storage: str | None = None
    # With --embedding-transfer-mode nixl-read or nixl-write: the outputs offered by NIXL, set by main
    offers: NixlOffers | None = None

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[EncodedImages]:
        media = request.multi_modal_data
        if media is None:
            raise InvalidRequestError("multi_modal_data: an encoder worker takes requests with images")
        prompt, _ = await self._multimodal_prompt(request, media)
        request_id = context.id()
        async with abort_monitor(self.engine_client, context, request_id, self.shutdown_event) as monitor:
            async for _ in monitor.stream(self.engine_client.generate(prompt, SamplingParams(max_tokens=1),
                                                                      request_id)):
                pass
        storage = self.storage
        images = [EncodedImage(digest, os.path.join(storage, digest, STORED_FILE) if storage else None)
                  for digest in prompt["multi_modal_uuids"]["image"]]
        to_write = NIXL_WRITE_ANNOTATION in request.annotations
        if to_write or NIXL_READ_ANNOTATION in request.annotations:
            yield EncodedImages(await self._offered(images, to_write))
            return
        yield EncodedImages(images)

    async def _offered(self, images: list[EncodedImage], to_write: bool) -> list[EncodedImage]:
        """The images with their outputs offered by NIXL (read from the connector's files here), `to_write`: for
        the consumer to ask for them to be written."""
        offers = self.offers
        if offers is None:
            raise InvalidRequestError("this encoder offers nothing by NIXL: start it with --embedding-transfer-mode "
                                      "nixl-read or nixl-write")
        for image in images:
            if image.path is None:
                raise InvalidRequestError("this encoder's connector keeps no file to offer (not ECExampleConnector)")
            image.nixl = offers.offer(await asyncio.to_thread(load_stored, image.path), to_write)
        return images


class StoredEncoderOutputs:
    """A consumer's encoder outputs in the connector's storage: a request whose images all have their output
    stored already (ECExampleConnector: `<storage>/<digest>/encoder_cache.safetensors`, named by the image's
    content digest) is not sent to an encoder again; the engine loads them. Other connectors: always sent."""

    def __init__(self, encoders: Encoders, storage: str | None) -> None:
        self.encoders = encoders
        self.storage = storage  # None: the connector's storage cannot be looked into
        self.reused = 0  # requests whose images were all stored

    async def encode(self, request: PreprocessedRequest, digests: list[str]) -> bool:
        if self.storage is not None and all(
                os.path.isfile(os.path.join(self.storage, digest, STORED_FILE)) for digest in digests):
            self.reused += 1
            return True
        return await self.encoders.encode(request)


class EncoderEmbeddings:
    """A consumer's images as their encoder outputs (--embedding-transfer-mode): an encoder encodes them and
    hands over each output, by its file (local) or by NIXL (`receiver`: reading it, or having the encoder write
    it). None, logged, when the encoder
    could not or an output cannot be had: the worker then gives its engine the images. By file, the files the
    encoders named are remembered: data URL images seen before need no encoder."""

    def __init__(self, encoders: Encoders, dtype: Any,
                 receiver: NixlReader | NixlWriteReceiver | None = None) -> None:
        self.encoders = encoders
        self.dtype = dtype
        self.receiver = receiver
        self.limits = ImageLimits()  # for data URLs: only their size limits apply
        self.loaded = 0  # requests whose images came as encoder outputs
        self.reused = 0  # ... of which no encoder was asked: their files were named before
        # By file: the files encoders named, by image digest (least recently used dropped past KEPT_FILES)
        self._files: OrderedDict[str, str] = OrderedDict()

    async def embed(self, request: PreprocessedRequest) -> tuple[list[Any], list[str]] | None:
        """(one tokens x hidden tensor per image, their digests), or None."""
        if self.receiver is not None:
            request = msgspec.structs.replace(request, annotations=[*request.annotations, self.receiver.annotation])
        start = time.perf_counter()
        images = self._named_before(request)
        if images is not None:
            self.reused += 1
        else:
            images = await self.encoders.embed(request)
            if images is None:
                return None
            self._remember(images)
        encoded = time.perf_counter()
        try:
            tensors = [(await self._read(image)).to(self.dtype) for image in images]
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("the encoder's outputs cannot be had here (%s): this worker encodes the images", e)
            return None
        self.loaded += 1
        log.debug("encoder outputs of %d image(s) named in %.1f ms, handed over in %.1f ms", len(images),
                  (encoded - start) * 1000, (time.perf_counter() - encoded) * 1000)
        return tensors, [image.digest for image in images]

    def _named_before(self, request: PreprocessedRequest) -> list[EncodedImage] | None:
        """By file: the encoder outputs of a request whose images are all data URLs (their bytes, so their digests,
        are in the request) whose files an encoder named before and which are still there; None otherwise (an
        image by http URL could have changed since: an encoder reads it again)."""
        media = request.multi_modal_data
        if self.receiver is not None or media is None:
            return None
        images = []
        for item in media.image_url:
            if not item.url.startswith("data:"):
                return None
            try:
                digest = hashlib.sha256(data_url_bytes(item.url, self.limits)).hexdigest()
            except ImageError:
                return None  # the encoder (or this worker) says what is wrong with it
            path = self._files.get(digest)
            if path is None or not os.path.isfile(path):
                return None
            self._files.move_to_end(digest)
            images.append(EncodedImage(digest, path))
        return images

    def _remember(self, images: list[EncodedImage]) -> None:
        if self.receiver is not None:
            return
        for image in images:
            if image.path is not None:
                self._files[image.digest] = image.path
                self._files.move_to_end(image.digest)
        while len(self._files) > KEPT_FILES:
            self._files.popitem(last=False)

    async def _read(self, image: EncodedImage) -> Any:
        if self.receiver is not None:
            if image.nixl is None:
                raise ValueError("the encoder offered nothing by NIXL (start it with --embedding-transfer-mode "
                                 "nixl-read or nixl-write)")
            return await self.receiver.receive(image.nixl)
        if image.path is None:
            raise ValueError("the encoder stored its outputs where no file names them (not ECExampleConnector)")
        return await asyncio.to_thread(load_stored, image.path)
