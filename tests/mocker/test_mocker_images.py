"""The mocker as a vision-language model (--enable-multimodal): each image placeholder becomes --image-tokens
tokens, the image's content hash goes on the blocks it overlaps (as a real engine's KV events carry it), and
its simulated encode time is paid unless the prefix cache holds it. Through a KV-routing frontend: the router's
hashes of a prompt with an image are the worker's, so a fresh router sends an image to the worker holding it."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tandem.mocker.args import parse_args
from tandem.mocker.perf_model import PolynomialPerfModel
from tandem.mocker.scheduler import Scheduler, SchedulerConfig, SimRequest
from tandem.router.hashing import MediaSpan
from tests.support.deployment import MODEL, Deployment, metric_sum
from tests.support.images import data_url
from tests.support.images import png as sample_png
from tests.support.ports import free_port

BLOCK = 16
IMAGE_TOKENS = 32
MOCKER = ["--block-size", str(BLOCK), "--speedup-ratio", "50", "--num-gpu-blocks-override", "4096",
          "--served-model-name", MODEL, "--enable-multimodal", "--image-tokens", str(IMAGE_TOKENS),
          "--image-encode-ms", "100", "--allow-private-media-urls"]
KV_FRONTEND = ["--router-mode", "kv", "--allow-private-media-urls"]


def png(color: str) -> str:
    return data_url(sample_png(color, (16, 16)))


def test_flags_are_checked_against_the_model_and_role(smollm2: str, vlm_folder: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--model-path", smollm2, "--enable-multimodal"])  # SmolLM2 names no image token
    with pytest.raises(SystemExit):
        parse_args(["--model-path", vlm_folder, "--image-tokens", "8"])  # without --enable-multimodal
    with pytest.raises(SystemExit):  # a decode worker computes no prompt: no encoder works for it
        parse_args(["--model-path", vlm_folder, "--enable-multimodal", "--is-decode-worker", "--ec-consumer-mode"])
    assert parse_args(["--model-path", vlm_folder, "--enable-multimodal", "--is-prefill-worker",
                       "--ec-consumer-mode"]).ec_consumer
    config = parse_args(["--model-path", vlm_folder, "--enable-multimodal", "--image-encode-ms", "5"])
    assert config.images is not None and (config.images.tokens, config.images.encode_ms) == (64, 5.0)


def test_an_images_encode_time_is_paid_unless_its_blocks_are_cached() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=4), PolynomialPerfModel())
    prompt = list(range(1, 21))

    def prefill_ms(request_id: str, image_hash: int) -> float:
        scheduler.add(SimRequest(request_id, prompt, 1, lambda i: 7, media=[MediaSpan(4, 8, image_hash)],
                                 encode_ms=250.0))
        result = scheduler.step()
        assert [o.request_id for o in result.outputs] == [request_id]
        return result.prefill_ms - PolynomialPerfModel().prefill_ms(result.num_prefill_tokens)

    assert prefill_ms("a", 11) == pytest.approx(250.0)
    assert prefill_ms("b", 11) == pytest.approx(0.0)  # the image's blocks are cached
    assert prefill_ms("c", 22) == pytest.approx(250.0)  # another image on the same tokens is not


def served_counts(ports: list[int]) -> list[float]:
    def served(port: int) -> float:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("dynamo_component_requests_total{") and 'endpoint="generate"' in line)
    return [served(port) for port in ports]


def ask(deployment: Deployment, url: str, **options: object):  # type: ignore[no-untyped-def]
    return deployment.client().chat.completions.create(
        model=MODEL, max_tokens=2, **options, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": " what is it? Say it in a few words, please."}]}])


def test_a_fresh_kv_router_sends_each_image_to_the_worker_holding_it(tmp_path: Path, vlm_folder: str) -> None:
    ports = [free_port(), free_port()]
    first = Deployment(tmp_path, vlm_folder, engine_module="tandem.mocker", engines=[], frontend_args=KV_FRONTEND,
                       instances=0)
    second: Deployment | None = None
    workers = [first.add_engine(*MOCKER, env={"DYN_SYSTEM_PORT": str(port)}) for port in ports]
    first.engines = []  # they outlive the first frontend
    try:
        first.wait_for_instances(2)
        colors = ["red", "green", "blue", "yellow", "purple", "orange"]
        holder = {color: i % 2 for i, color in enumerate(colors)}  # each image served first by a chosen worker
        for color in colors:
            pin = {"x-worker-instance-id": str(int(workers[holder[color]].ready[0], 16))}
            reply = ask(first, png(color), extra_headers=pin)
        text_tokens = reply.usage.prompt_tokens - IMAGE_TOKENS
        assert reply.usage.prompt_tokens > IMAGE_TOKENS and text_tokens < 40
        first.stop()

        # A new frontend knows the workers' caches from their KV events only.
        second = Deployment(tmp_path, vlm_folder, engine_module="tandem.mocker", engines=[],
                            frontend_args=KV_FRONTEND, env=first.env, instances=2)
        deadline = time.monotonic() + 30
        while metric_sum(second.metrics(), "dynamo_component_kv_cache_events_applied_total") < len(colors):
            assert time.monotonic() < deadline, "the frontend learned nothing of the workers' caches"
            time.sleep(0.1)
        for color in colors:
            before = served_counts(ports)
            again = ask(second, png(color))
            after = served_counts(ports)
            assert after[holder[color]] == before[holder[color]] + 1, color
            assert again.usage.prompt_tokens_details.cached_tokens >= (again.usage.prompt_tokens // BLOCK - 1) * BLOCK
    finally:
        if second is not None:
            second.stop()
        first.stop()
        for worker in workers:
            worker.stop()


def test_images_to_a_mocker_without_enable_multimodal_are_refused(tmp_path: Path, vlm_folder: str) -> None:
    deployment = Deployment(tmp_path, vlm_folder, engine_module="tandem.mocker",
                            engines=[["--served-model-name", MODEL, "--speedup-ratio", "50"]])
    try:
        r = httpx.post(f"{deployment.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png("red")}}]}]})
        assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"], r.text
    finally:
        deployment.stop()


def test_disaggregation_mode_encode_is_the_encoder_role(vlm_folder: str) -> None:
    """--disaggregation-mode encode (or disaggregation_mode in --extra-engine-args) makes the encoder worker
    that --vllm-native-encoder-worker makes; it needs --enable-multimodal and cannot also be a consumer."""
    encoder = parse_args(["--model-path", vlm_folder, "--enable-multimodal", "--disaggregation-mode", "encode"])
    named = parse_args(["--model-path", vlm_folder, "--enable-multimodal", "--vllm-native-encoder-worker"])
    assert encoder == named and encoder.component == "encoder" and encoder.encoder
    for argv in (["--disaggregation-mode", "encode"],
                 ["--enable-multimodal", "--disaggregation-mode", "encode", "--ec-consumer-mode"],
                 ["--enable-multimodal", "--disaggregation-mode", "encode", "--is-prefill-worker"]):
        with pytest.raises(SystemExit):
            parse_args(["--model-path", vlm_folder, *argv])


def test_route_to_encoder_is_the_consumer_role(vlm_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """--route-to-encoder (env DYN_VLLM_ROUTE_TO_ENCODER) makes the consumer --ec-consumer-mode makes; not on a
    worker that gets no prompt, and not without --enable-multimodal."""
    model = ["--model-path", vlm_folder]
    named = parse_args([*model, "--enable-multimodal", "--route-to-encoder"])
    assert named == parse_args([*model, "--enable-multimodal", "--ec-consumer-mode"]) and named.ec_consumer
    monkeypatch.setenv("DYN_VLLM_ROUTE_TO_ENCODER", "1")
    assert parse_args([*model, "--enable-multimodal"]).ec_consumer
    monkeypatch.delenv("DYN_VLLM_ROUTE_TO_ENCODER")
    for argv in (["--route-to-encoder"], ["--enable-multimodal", "--route-to-encoder", "--disaggregation-mode", "decode"],
                 ["--enable-multimodal", "--route-to-encoder", "--disaggregation-mode", "encode"]):
        with pytest.raises(SystemExit):
            parse_args([*model, *argv])


def test_an_encoder_worker_encodes_a_consumers_images_until_it_dies(tmp_path: Path, vlm_folder: str) -> None:
    """--vllm-native-encoder-worker: a mocker that encodes the images of a --ec-consumer-mode mocker's requests;
    the consumer's engine then spends no encode time on them. With the encoder gone, the consumer encodes them
    itself (its timing model counts the encode time again) and the request is served all the same."""
    with pytest.raises(SystemExit):
        parse_args(["--model-path", vlm_folder, "--vllm-native-encoder-worker"])  # without --enable-multimodal
    with pytest.raises(SystemExit):
        parse_args(["--model-path", vlm_folder, "--enable-multimodal", "--vllm-native-encoder-worker",
                    "--ec-consumer-mode"])
    assert parse_args(["--model-path", vlm_folder, "--enable-multimodal", "--vllm-native-encoder-worker"]
                      ).component == "encoder"
    encode_ms = ["--image-encode-ms", "5000"]  # 100 ms at speedup 50: far above a request's other steps here
    consumer_port, encoder_port = free_port(), free_port()
    deployment = Deployment(tmp_path, vlm_folder, engine_module="tandem.mocker", engines=[], instances=0)
    try:
        deployment.add_engine(*MOCKER, *encode_ms, "--ec-consumer-mode", env={"DYN_SYSTEM_PORT": str(consumer_port)})
        encoder = deployment.add_engine(*MOCKER, *encode_ms, "--vllm-native-encoder-worker",
                                        env={"DYN_SYSTEM_PORT": str(encoder_port)})
        deployment.wait_for_instances(1)

        def simulated() -> float:
            return metric_sum(httpx.get(f"http://127.0.0.1:{consumer_port}/metrics").text,
                              "tandem_mocker_simulated_seconds_total")

        def consumer_seconds(color: str) -> float:
            before = simulated()
            assert ask(deployment, png(color)).usage.completion_tokens == 2
            return simulated() - before

        served = served_counts([encoder_port])[0]
        assert consumer_seconds("red") < 0.1
        assert served_counts([encoder_port])[0] == served + 1
        encoder.stop()
        assert consumer_seconds("green") >= 0.1
    finally:
        deployment.stop()


def test_images_on_prefill_and_decode_workers_are_encoded_where_the_prompt_is_computed(tmp_path: Path,
                                                                                      vlm_folder: str) -> None:
    """E+P+D on the mocker: the prefill worker (the encoders' consumer) computes the prompt with its image; the
    decode worker pulls the prompt's KV cache and encodes nothing. With the encoder up the prefill worker spends
    no encode time either; with it gone, the prefill worker pays it, never the decode worker."""
    encode_ms = ["--image-encode-ms", "5000"]  # 100 ms at speedup 50: far above a request's other steps here
    ports = {role: free_port() for role in ("prefill", "decode", "encoder")}
    deployment = Deployment(tmp_path, vlm_folder, engine_module="tandem.mocker", engines=[], instances=0)
    try:
        deployment.add_engine(*MOCKER, *encode_ms, "--disaggregation-mode", "prefill", "--route-to-encoder",
                              env={"DYN_SYSTEM_PORT": str(ports["prefill"])})
        deployment.add_engine(*MOCKER, *encode_ms, "--disaggregation-mode", "decode",
                              env={"DYN_SYSTEM_PORT": str(ports["decode"])})
        encoder = deployment.add_engine(*MOCKER, *encode_ms, "--disaggregation-mode", "encode",
                                        env={"DYN_SYSTEM_PORT": str(ports["encoder"])})
        deployment.wait_for_instances(1)
        deployment.wait_for_instances(1, kind="prefill_instances")

        def simulated(role: str) -> float:
            return metric_sum(httpx.get(f"http://127.0.0.1:{ports[role]}/metrics").text,
                              "tandem_mocker_simulated_seconds_total")

        def seconds(color: str) -> dict[str, float]:
            before = {role: simulated(role) for role in ("prefill", "decode")}
            answer = ask(deployment, png(color))
            assert answer.usage.completion_tokens == 2 and answer.usage.prompt_tokens > IMAGE_TOKENS
            return {role: simulated(role) - before[role] for role in before}

        encoded = served_counts([ports["encoder"]])[0]
        spent = seconds("red")
        assert spent["prefill"] < 0.1 and spent["decode"] < 0.1
        assert served_counts([ports["encoder"]])[0] == encoded + 1
        assert served_counts([ports["prefill"]])[0] >= 1  # the prompt was computed there, not on the decode worker
        encoder.stop()
        spent = seconds("green")
        assert spent["prefill"] >= 0.1 and spent["decode"] < 0.1
    finally:
        deployment.stop()


def test_an_image_goes_to_the_same_encoder_each_time(tmp_path: Path, vlm_folder: str) -> None:
    """A consumer sends a request to the encoder its first image picks: the same image always to the same one
    (where its encoder output is), different images to both; when that encoder goes, its images go to the other."""
    ports = [free_port(), free_port()]
    deployment = Deployment(tmp_path, vlm_folder, engine_module="tandem.mocker", engines=[], instances=0)
    try:
        deployment.add_engine(*MOCKER, "--ec-consumer-mode")
        encoders = [deployment.add_engine(*MOCKER, "--vllm-native-encoder-worker",
                                          env={"DYN_SYSTEM_PORT": str(port)}) for port in ports]
        deployment.wait_for_instances(1)
        for _ in range(3):
            ask(deployment, png("red"))
        after_red = served_counts(ports)
        assert sorted(after_red) == [0, 3]
        colors = ["green", "blue", "yellow", "purple", "orange", "pink", "brown", "gray", "navy", "teal", "olive",
                  "maroon", "lime", "aqua", "silver", "gold"]
        for color in colors:
            ask(deployment, png(color))
        assert all(n > c for n, c in zip(served_counts(ports), after_red, strict=True))  # both took some
        holder = after_red.index(3)
        encoders[holder].stop()
        other = 1 - holder
        deadline = time.monotonic() + 30
        while True:  # until the consumer's discovery has seen the encoder go (it encodes the image itself meanwhile)
            before = served_counts([ports[other]])[0]
            assert ask(deployment, png("red")).usage.completion_tokens == 2
            if served_counts([ports[other]])[0] == before + 1:
                break
            assert time.monotonic() < deadline, "the red image never went to the other encoder"
            time.sleep(0.2)
    finally:
        deployment.stop()
