"""Encoder workers and their consumers, for every engine kind. An encoder worker serves the component
`encoder` and registers no model: it runs the vision encoder of the images of the requests a consumer sends it
and answers once they are done (where the outputs go is the engine's business: vLLM's encoder-cache connector,
or nowhere in a simulation). A consumer (an aggregated or prefill worker in --ec-consumer-mode) sends each request with
images to an encoder first and never depends on one: with none reachable, or one that fails or stalls, it
encodes the images itself.

An encoder's answer ends with `EncodedImages`: where each image's encoder output is, so that a consumer taking
embeddings (--embedding-transfer-mode) gives its engine those instead of the image."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from tandem.llm.protocols import LLMEngineOutput, PreprocessedRequest
from tandem.runtime import Context
from tandem.runtime.errors import NoInstancesError

log = logging.getLogger(__name__)

ENCODER_COMPONENT = "encoder"  # where encoder workers serve, and their consumers find them
# An encoder slower than this is left to finish alone; the consumer encodes the images itself.
ENCODE_TIMEOUT_S = 60.0


def chosen_role(roles: Sequence[tuple[str, bool]], multimodal: bool, why: str) -> str | None:
    """The one role flag given among `roles` ((flag, given) pairs), None for none; ValueError for two (`why`
    says why not) or for one without --enable-multimodal."""
    given = [flag for flag, on in roles if on]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: {why}")
    if given and not multimodal:
        raise ValueError(f"Use --enable-multimodal with {given[0]}")
    return given[0] if given else None


# What a consumer adds to the annotations of the request it sends an encoder to have the encoder outputs
# offered by NIXL (`NixlTensor`), for it to read or to ask the encoder to write; without either an encoder names
# their files.
NIXL_READ_ANNOTATION = "embedding_transfer:nixl-read"
NIXL_WRITE_ANNOTATION = "embedding_transfer:nixl-write"


class NixlTensor(msgspec.Struct):
    """A tensor in another process's memory, registered with its NIXL agent: for others to READ, or to have
    the holder WRITE it into their memory (`WriteRequest`)."""

    agent: str  # the holder's agent name
    metadata: bytes  # the holder agent's metadata, for a reader that has not met it yet
    descs: bytes  # the serialized descriptors of the tensor's memory
    shape: list[int]
    dtype: str  # torch's name of the element type, e.g. "float32"
    done: bytes  # the offer's key: the notification a reader sends once done, so the holder lets the tensor go


class EncodedImage(msgspec.Struct):
    """One image's encoder output (the embeddings the model puts in place of the image's tokens)."""

    digest: str  # the image's content digest: its identity in the engines' prefix caches
    path: str | None = None  # a safetensors file holding one (tokens x hidden) tensor; None: not in a file
    nixl: NixlTensor | None = None  # the same tensor offered by NIXL, when the consumer asked for it


class EncodedImages(msgspec.Struct, tag="encoded_images"):
    """An encoder's last answer: its request's images, in the prompt's order."""

    images: list[EncodedImage]


def _affinity(key: bytes, instance_id: int) -> bytes:
    return hashlib.blake2b(key + instance_id.to_bytes(8, "little", signed=False), digest_size=8).digest()


class Encoders:
    """A consumer's way to its encoder workers (found in discovery under `component`). A request goes to the
    encoder its first image picks (rendezvous hashing of the image's URL over the live encoders), so an image
    seen again goes where its encoder output already is (the encoder's caches, its files); when that encoder
    goes, only its images move."""

    def __init__(self, runtime: Any, namespace: str, component: str = ENCODER_COMPONENT) -> None:
        self._endpoint = runtime.namespace(namespace).component(component).endpoint("generate")
        self._client: Any = None
        self.encoded = self.fell_back = 0  # requests an encoder encoded, requests the engine encoded itself

    async def encode(self, request: PreprocessedRequest) -> bool:
        """Have an encoder encode the request's images: True once it has; on any failure, log it and return
        False (the engine then encodes them itself)."""
        return await self._ask(request) is not None

    async def embed(self, request: PreprocessedRequest) -> list[EncodedImage] | None:
        """Have an encoder encode the request's images and say where their outputs are (one per image, in
        order); None, logged, when it could not (the engine then encodes them itself)."""
        last = await self._ask(request)
        try:
            answer = msgspec.convert(last, EncodedImages) if last is not None else None
        except msgspec.ValidationError as e:
            log.warning("the encoder's answer names no encoder outputs (%s): this worker encodes the images", e)
            answer = None
        media = request.multi_modal_data
        wanted = len(media.image_url) if media is not None else 0
        if answer is None or len(answer.images) != wanted:
            if answer is not None:
                log.warning("the encoder answered %d encoder outputs for %d images: this worker encodes them",
                            len(answer.images), wanted)
            return None
        return answer.images

    async def _ask(self, request: PreprocessedRequest) -> Any:
        """The encoder's last answer for the request; None, logged and counted, when it failed."""
        if self._client is None:
            self._client = await self._endpoint.client()
        last: Any = None
        try:
            async with asyncio.timeout(ENCODE_TIMEOUT_S):
                stream = await self._client.direct(request, self._encoder_of(request), Context())
                async for item in stream:
                    if isinstance(item, dict) and item.get("finish_reason") == "error":
                        raise RuntimeError(item.get("error") or "the encoder failed")
                    last = item
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the engine can still encode
            self.fell_back += 1
            log.warning("images not encoded by an encoder worker (%s: %s): this worker encodes them",
                        type(e).__name__, e)
            return None
        self.encoded += 1
        return last if last is not None else {}

    def _encoder_of(self, request: PreprocessedRequest) -> int:
        """The live encoder the request's first image picks (one skipped after a failure only when others are up)."""
        client = self._client
        usable = [i for i in client.instance_ids() if client.is_usable(i)] or client.instance_ids()
        if not usable:
            raise NoInstancesError(f"no encoder of {self._endpoint.path} is live")
        media = request.multi_modal_data
        url = media.image_url[0].url.encode() if media is not None and media.image_url else b""
        key = hashlib.blake2b(url, digest_size=16).digest()  # once: a data URL can be megabytes
        return max(usable, key=lambda instance_id: _affinity(key, instance_id))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


async def serve_encoder(component: Any, endpoint: str,
                        generate: Callable[[PreprocessedRequest, Context], AsyncIterator[LLMEngineOutput]],
                        model_name: str) -> None:
    """Serve an encoder worker's endpoint, registering no model (clients reach it through the consumers, which
    find it in discovery under its component), and say READY."""
    served = await component.endpoint(endpoint).start_serving(
        generate, request_type=PreprocessedRequest, metrics_labels={"model": model_name})
    component.runtime.set_ready()
    log.info("encoding images of %s as dyn://%s", model_name, served.path)
    print(f"READY {component.runtime.instance_id:x} {served.path}", flush=True)  # for launchers and tests
