"""`tandem run` with real vLLM workers, as `make run` starts it: it serves (text mode; xPyD), a worker whose
engine dies exits 1, and no worker or engine process outlives the launcher, whatever kills it.

The workers use the `mp` executor, so the whole chain is there: launcher -> worker -> VLLM::EngineCore ->
VLLM::Worker. Each test tags the processes it starts with a unique environment variable and follows their
sessions in /proc, so processes of other test runs on the machine are not counted. (A worker SIGKILLed on
its own takes its engine with it too: test_vllm_migration.py checks that.)
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.deployment import VLLM_TEST_ARGS, metric_sum
from tests.support.engines import engine_memory_args, on_cpu
from tests.support.launcher import Run, children

pytestmark = pytest.mark.slow

TAG = "TANDEM_ORPHAN_TEST"
ENGINE_NAMES = ("VLLM::EngineCore", "VLLM::Worker")
GONE_WITHIN = 10.0  # seconds: the bound
# Small engine, one core, few GB; `mp` starts a separate VLLM::Worker process even with one rank.
ENGINE_ARGS = (*VLLM_TEST_ARGS, *engine_memory_args(on_cpu()), "--distributed-executor-backend", "mp",
               "--max-model-len", "512", "--max-num-seqs", "4")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SLOW_DRAIN = {"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "60"}  # a worker stays in its drain for a minute


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (session id, command line) of every live process (zombies are gone: they hold nothing)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, _, session = f.read().rsplit(")", 1)[1].split()[:4]
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if state != "Z":
            found[int(entry)] = (int(session), cmdline)
    return found


class Tagged:
    """The processes of one test: started with `env` (a unique tag), remembered by session. Each process the
    launcher or the test starts leads its own session, and vLLM's engine processes stay in their worker's
    session; their own environment cannot be read (setproctitle reuses its memory for the process title)."""

    def __init__(self) -> None:
        self.env = {TAG: uuid.uuid4().hex}
        self.sessions: set[int] = set()

    def find_chain(self) -> None:
        """Remember the sessions of the tagged processes, and check that they run a whole engine (so that an
        empty scan later means something)."""
        marker = "=".join(*self.env.items()).encode()
        for pid, (session, _) in _processes().items():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        self.sessions.add(session)
            except OSError:
                continue
        names = {cmdline.split()[0] for cmdline in self.members().values() if cmdline.startswith(ENGINE_NAMES)}
        assert "VLLM::EngineCore" in names and any(name.startswith("VLLM::Worker") for name in names), names

    def members(self) -> dict[int, str]:
        """pid -> command line of the live processes in the sessions."""
        return {pid: cmdline for pid, (session, cmdline) in _processes().items() if session in self.sessions}

    def assert_all_gone(self) -> None:
        """Within GONE_WITHIN seconds, no process (launcher, frontend, worker or engine) is left."""
        deadline = time.monotonic() + GONE_WITHIN
        while (left := self.members()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"still running {GONE_WITHIN:g} s later: {left}"


@pytest.fixture
def tagged() -> Iterator[Tagged]:
    """Whatever is left in the test's sessions at the end is killed (the orphans of a failed run)."""
    processes = Tagged()
    yield processes
    for pid in processes.members():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(tagged: Tagged, *args: str, worker_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
           ) -> tuple[Run, openai.OpenAI]:
    """`tandem run --model smollm2` with the default engine (vLLM), as `make run` starts it."""
    run = Run("--model", "smollm2", "--ready-timeout", "300", *args, "--", *ENGINE_ARGS, *worker_args,
              env={**tagged.env, **(env or {})})
    url = run.wait_for(r"==> serving \S+ at (\S+)", timeout=300).group(1)
    tagged.find_chain()
    return run, run.client(url)


def _answer(client: openai.OpenAI, **options: object) -> str:
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=12,
                                           **options)  # type: ignore[call-overload]
    if options.get("stream"):
        return "".join(chunk.choices[0].delta.content or "" for chunk in reply if chunk.choices)
    return reply.choices[0].message.content or ""


def test_text_mode_run_then_engine_death_exits_1_then_sigkill_of_the_launcher(tagged: Tagged) -> None:
    """`--use-vllm-tokenizer`: the engine templates and detokenizes; the frontend passes text through."""
    run, client = launch(tagged, "--workers", "1", worker_args=("--use-vllm-tokenizer",))
    text = _answer(client)
    assert text and _answer(client, stream=True) == text
    worker = run.children_running("tandem.vllm")
    assert len(worker) == 1
    engine = children(worker[0])
    assert engine, "the worker has no engine process"
    for pid in engine:
        os.kill(pid, signal.SIGKILL)
    run.wait_for(r"worker-0 +\| exited with code 1", timeout=120)  # the engine monitor's documented status
    run.proc.kill()
    run.proc.wait()
    tagged.assert_all_gone()


def test_xpyd_run_serves_disaggregated_then_sigterm_then_sigkill_mid_drain(tagged: Tagged) -> None:
    run, client = launch(tagged, "--prefill-workers", "1", "--decode-workers", "1", env=SLOW_DRAIN)
    assert _answer(client)
    metrics = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    assert metric_sum(metrics, "dynamo_frontend_remote_prefills_total", outcome="ok") == 1  # it was disaggregated
    run.proc.send_signal(signal.SIGTERM)
    run.wait_for(r"(prefill|decode)-\d +\|.*SIGTERM received: shutting down gracefully")  # the worker is draining
    run.proc.kill()  # as a process supervisor does when its stop timeout runs out
    run.proc.wait()
    tagged.assert_all_gone()


def test_an_encode_prefill_decode_run_serves_images_and_removes_their_folder(tagged: Tagged, engine_pool) -> None:  # type: ignore[no-untyped-def]
    """`tandem run --prefill-workers 1 --decode-workers 1 --encode-workers 1` (E+P+D) with the tiny vision-language
    model: the encoder worker stores each image's encoder output in the folder the launcher made for it and the
    prefill worker, the prefill worker computes the prompt from it, the decode worker pulls its KV cache and
    answers (differently for another image), and the folder is gone once the launcher has stopped. (The aggregated
    consumer is tested in test_vllm_vision.py.)"""
    import hashlib

    import httpx

    from tests.support.deployment import metric_sum
    from tests.support.images import data_url, png

    images = [png("teal"), png("red")]
    run = Run("--model", engine_pool.vision_model(), "--ready-timeout", "300", "--prefill-workers", "1",
              "--decode-workers", "1", "--encode-workers", "1", "--", *VLLM_TEST_ARGS, *engine_memory_args(on_cpu()),
              "--max-model-len", "1024", env=tagged.env)
    url = run.wait_for(r"==> serving \S+ at (\S+)", timeout=300).group(1)
    client = run.client(url)
    tagged.find_chain()

    def storage_of(role: str) -> str:
        [pid] = run.children_running(role)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        return argv[argv.index("--ec-storage-path") + 1]

    store = storage_of("--vllm-native-encoder-worker")
    assert storage_of("--ec-consumer-mode") == store  # the prefill worker's, the decode worker has no folder
    assert run.children_running("--ec-consumer-mode") == run.children_running("--is-prefill-worker")
    answers = []
    for image in images:
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=4, temperature=0, logprobs=True,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What colour is this?"},
                                                   {"type": "image_url", "image_url": {"url": data_url(image)}}]}])
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        assert os.path.isfile(os.path.join(store, hashlib.sha256(image).hexdigest(), "encoder_cache.safetensors"))
        answers.append([token.logprob for token in reply.choices[0].logprobs.content])
    assert answers[0] != answers[1]  # the answer depends on the image
    assert metric_sum(httpx.get(f"{url}/metrics").text, "dynamo_frontend_remote_prefills_total", outcome="ok") == 2
    assert run.stop(signal.SIGINT, timeout=120) == 0
    assert not os.path.exists(store)
    tagged.assert_all_gone()
