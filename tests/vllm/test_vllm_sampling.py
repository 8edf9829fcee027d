"""An OpenAI request's sampling options reach vLLM's `SamplingParams`: parsed by the frontend, carried as a
`PreprocessedRequest` over the wire (msgpack), mapped by the worker (`build_sampling_params`)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import msgspec
import pytest
from vllm.sampling_params import RequestOutputKind

from tandem.frontend.api.openai.protocol import parse_completion_request
from tandem.frontend.preprocess import output_options, sampling_options, stop_conditions
from tandem.llm.protocols import PreprocessedRequest
from tandem.runtime import Context
from tandem.runtime.errors import InvalidRequestError
from tandem.vllm.handlers import DecodeWorkerHandler, build_sampling_params

PROMPT_IDS = [1, 2, 3, 4]
EOS = [2, 0]


def _through_the_wire(body: dict, eos_hidden: list[int] | None = EOS) -> PreprocessedRequest:
    request = parse_completion_request(json.dumps(body).encode())
    stop = stop_conditions(request)
    stop.stop_token_ids_hidden = eos_hidden
    preprocessed = PreprocessedRequest(model="m", token_ids=PROMPT_IDS, stop_conditions=stop,
                                       sampling_options=sampling_options(request),
                                       output_options=output_options(request))
    return msgspec.msgpack.decode(msgspec.msgpack.encode(preprocessed), type=PreprocessedRequest)


def test_every_sampling_option_reaches_the_engine() -> None:
    body = {"model": "m", "prompt": "x", "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05,
            "seed": 1234, "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
            "max_tokens": 33, "min_tokens": 3, "stop": ["END"], "stop_token_ids": [99], "logprobs": 2,
            "ignore_eos": False, "n": 1}
    params = build_sampling_params(_through_the_wire(body), {}, model_max_len=2048)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (0.7, 0.9, 40, 0.05, 1234)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, 0.25, 1.1)
    assert (params.max_tokens, params.min_tokens, params.logprobs, params.ignore_eos) == (33, 3, 2, False)
    # Stop strings stay with the frontend (it holds text back across chunks); stop ids join the hidden EOS ids.
    assert not params.stop
    assert set(params.stop_token_ids) == {99, *EOS}
    # The frontend detokenizes: the engine returns token deltas only.
    assert params.detokenize is False and params.output_kind == RequestOutputKind.DELTA


def test_defaults_and_the_dynamic_max_tokens() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.95}  # the model's generation config
    params = build_sampling_params(_through_the_wire({"model": "m", "prompt": "x", "top_p": 0.5}), defaults,
                                   model_max_len=64)
    assert params.temperature == 0.6 and params.top_p == 0.5  # the request wins over the model's defaults
    assert params.max_tokens == 64 - len(PROMPT_IDS)  # no max_tokens: what is left of the context


def test_guided_json_becomes_structured_outputs() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = {"model": "m", "prompt": "x", "response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "c", "schema": schema}}}
    params = build_sampling_params(_through_the_wire(body), {}, model_max_len=2048)
    assert params.structured_outputs is not None and params.structured_outputs.json == schema


def test_ignore_eos_keeps_eos_out_of_the_stop_ids() -> None:
    params = build_sampling_params(_through_the_wire({"model": "m", "prompt": "x", "ignore_eos": True},
                                                     eos_hidden=None), {}, model_max_len=2048)
    assert params.ignore_eos is True and not set(params.stop_token_ids or []) & set(EOS)


def test_images_without_enable_multimodal_are_a_400() -> None:
    """As Dynamo's worker: multimodal data is refused, naming the flag, unless the worker was started with it;
    the engine is never called."""
    handler = DecodeWorkerHandler(None, None, SimpleNamespace(served_model_name="m", enable_multimodal=False),
                                  default_sampling_params={}, model_max_len=2048, shutdown_event=asyncio.Event())
    request = msgspec.convert({"token_ids": [1, 2], "multi_modal_data": {"image_url": [{"Url": "data:image/png;base64,"}]}},
                              PreprocessedRequest)

    async def run() -> list:
        return [item async for item in handler.generate(request, Context("r1"))]

    with pytest.raises(InvalidRequestError, match="multimodal processing is not enabled: start the worker with "
                                                  "--enable-multimodal") as caught:
        asyncio.run(run())
    assert caught.value.code == 400
