"""vLLM's encoder-cache connector roles. An encoder worker (`--vllm-native-encoder-worker`, component `encoder`)
runs the vision encoder of a request's images, and its engine's connector stores each image's encoder output
under the image's content digest. A worker in `--ec-consumer-mode` first has an encoder do that, then runs the
request: its engine's connector finds the stored outputs by the same digests and loads them instead of running
its own vision encoder; an image whose output is stored already goes to no encoder again. The consumer never
depends on an encoder: with none reachable, or one that fails or stalls, its engine encodes the images itself
(the connector finds nothing to load), so the answer is the same."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from vllm.sampling_params import SamplingParams

from tandem.llm.protocols import CompletionUsage, FinishReason, LLMEngineOutput, PreprocessedRequest
from tandem.runtime import Context
from tandem.runtime.errors import InvalidRequestError
from tandem.vllm.abort import abort_monitor
from tandem.vllm.handlers import BaseWorkerHandler
from tandem.worker.encoders import Encoders


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
                os.path.isfile(os.path.join(self.storage, digest, "encoder_cache.safetensors")) for digest in digests):
            self.reused += 1
            return True
        return await self.encoders.encode(request)
