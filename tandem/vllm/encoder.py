"""vLLM's encoder-cache connector roles. An encoder worker (`--vllm-native-encoder-worker`, component `encoder`)
runs the vision encoder of a request's images, and its engine's connector stores each image's encoder output
under the image's content digest. A worker in `--ec-consumer-mode` first has an encoder do that, then runs the
request: its engine's connector finds the stored outputs by the same digests and loads them instead of running
its own vision encoder. The consumer never depends on an encoder: with none reachable, or one that fails or
stalls, its engine encodes the images itself (the connector finds nothing to load), so the answer is the same."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from vllm.sampling_params import SamplingParams

from tandem.llm.protocols import CompletionUsage, FinishReason, LLMEngineOutput, PreprocessedRequest
from tandem.runtime import Context
from tandem.runtime.errors import InvalidRequestError
from tandem.vllm.abort import abort_monitor
from tandem.vllm.handlers import BaseWorkerHandler

log = logging.getLogger(__name__)

# An encoder slower than this is left to finish alone; the consumer encodes the images itself.
ENCODE_TIMEOUT_S = 60.0


class EncoderWorkerHandler(BaseWorkerHandler):
    """The encoder worker: each request's images through the engine's vision encoder, stored by the engine's
    connector (the producer's engine answers without generating); one output says it is done."""

    async def generate(self, request: PreprocessedRequest, context: Context) -> AsyncIterator[LLMEngineOutput]:
        media = request.multi_modal_data
        if media is None:
            raise InvalidRequestError("multi_modal_data: an encoder worker takes requests with images")
        prompt, prompt_len = await self._multimodal_prompt(request, media)
        request_id = context.id()
        async with abort_monitor(self.engine_client, context, request_id, self.shutdown_event) as monitor:
            async for _ in monitor.stream(self.engine_client.generate(prompt, SamplingParams(max_tokens=1),
                                                                      request_id)):
                pass
        yield LLMEngineOutput([], finish_reason=FinishReason.STOP, completion_usage=CompletionUsage.of(prompt_len, 0))


class Encoders:
    """A consumer's way to its encoder workers (found in discovery under `component`, taken in turn)."""

    def __init__(self, runtime: Any, namespace: str, component: str) -> None:
        self._endpoint = runtime.namespace(namespace).component(component).endpoint("generate")
        self._client: Any = None
        self.encoded = self.fell_back = 0  # requests an encoder encoded, requests the engine encoded itself

    async def encode(self, request: PreprocessedRequest) -> None:
        """Have an encoder store the request's images' encoder outputs; on any failure, log it and return
        (the engine then encodes them itself)."""
        if self._client is None:
            self._client = await self._endpoint.client()
        try:
            async with asyncio.timeout(ENCODE_TIMEOUT_S):
                stream = await self._client.round_robin(request, Context())
                async for item in stream:
                    if isinstance(item, dict) and item.get("finish_reason") == "error":
                        raise RuntimeError(item.get("error") or "the encoder failed")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the engine can still encode
            self.fell_back += 1
            log.warning("images not encoded by an encoder worker (%s: %s): this worker encodes them",
                        type(e).__name__, e)
            return
        self.encoded += 1

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
