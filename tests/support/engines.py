"""Real vLLM engines shared by the whole test session, keyed by configuration.

An engine takes tens of seconds to start on a CPU core, so engines are started once per configuration
(`GROUPS`) and kept until the last test that asks for them has run. Each group lives on its own namespace
of file discovery; a test module starts its own frontend on it (`EngineGroup.deployment`), which is cheap.

A module names the groups it uses with `pytest.mark.engines(...)`; the users of a group run together and
the group stops after the last one (tests/conftest.py), so few engines are alive at once. Tests that kill
an engine carry the `kills_engine` marker and run after the other users of their group; when a group is
asked for again after an engine of it died, the missing engine is started again, so no test depends on
which ran before it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from tests.support import REPO
from tests.support.deployment import MODEL, VLLM_TEST_ARGS, Deployment, metric_sum
from tests.support.launcher import children
from tests.support.ports import free_port
from tests.support.processes import TandemProcess

KV_CACHE_BYTES = 512 << 20  # ~11k tokens of SmolLM2 in float32: plenty, and a fixed share of a shared host
GPU_MEMORY_BUDGET = 0.85  # of one device, split between the engines that may share it
# The most one test process keeps alive at once (the disaggregated group grown to three), times the processes
# pytest-xdist runs side by side.
MAX_ENGINES_AT_ONCE = 3 * int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
ENGINE_TIMEOUT = 600.0  # seconds for one engine to start (bounded here, not by a test's own timeout)


def engine_memory_args(on_cpu: bool, engines_per_device: int = MAX_ENGINES_AT_ONCE) -> tuple[str, ...]:
    """Memory flags for one test engine.

    On CPU the KV cache gets a fixed size: `--gpu-memory-utilization` would reserve a fraction of the
    whole host per engine there, and a third engine would not fit. On a GPU every engine on the device
    takes an equal share of `GPU_MEMORY_BUDGET`, so all the engines the suite runs at once fit together.
    """
    if engines_per_device < 1:
        raise ValueError("engines_per_device must be at least 1")
    if on_cpu:
        return ("--kv-cache-memory-bytes", str(KV_CACHE_BYTES))
    share = int(GPU_MEMORY_BUDGET / engines_per_device * 1000) / 1000  # rounded down: the shares fit together
    return ("--gpu-memory-utilization", f"{share:.3f}")


def on_cpu() -> bool:
    from tandem.vllm.args import platform_is_cpu

    return platform_is_cpu()


@dataclass(frozen=True)
class EngineSpec:
    """One engine of a group: its role flags, the core it is pinned to, extra flags and environment."""

    role_args: tuple[str, ...]
    core: int
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    @property
    def role(self) -> str:
        return next((a.removeprefix("--is-").removesuffix("-worker") for a in self.role_args
                     if a.startswith("--is-")), "aggregated")


@dataclass
class Engine:
    """A running `tandem vllm` worker of a group."""

    spec: EngineSpec
    process: TandemProcess
    system_port: int

    @property
    def instance_id(self) -> int:
        return int(self.process.ready[0], 16)

    @property
    def system_url(self) -> str:
        return f"http://127.0.0.1:{self.system_port}"

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    def alive(self) -> bool:
        return self.process.proc.poll() is None

    def metrics(self) -> str:
        return httpx.get(f"{self.system_url}/metrics", timeout=30).text

    def engine_processes(self) -> list[int]:
        """The worker's child processes (vLLM's engine core and, with the `mp` executor, its workers)."""
        return children(self.pid)

    @contextlib.contextmanager
    def engine_frozen(self) -> Iterator[None]:
        """SIGSTOP the engine processes (the worker itself keeps serving), SIGCONT on leaving: while frozen a
        request the worker accepted can make no progress in the engine, on any hardware."""
        children = self.engine_processes()
        assert children, "the worker has no engine process"
        for pid in children:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in children:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the worker process only, as the OOM killer would (its engine must die with it)."""
        os.kill(self.pid, signal.SIGKILL)
        self.process.proc.wait()


@dataclass
class EngineGroup:
    """Workers of one configuration on one namespace of file discovery."""

    name: str
    root: Path
    model_path: str
    specs: tuple[EngineSpec, ...]
    env: dict[str, str] = field(default_factory=dict)
    engines: list[Engine] = field(default_factory=list)

    def __post_init__(self) -> None:
        kv = self.root / "kv"
        kv.mkdir(parents=True, exist_ok=True)
        self.env = {"DYN_FILE_KV": str(kv), "DYN_NAMESPACE": f"test-{self.name}-{uuid.uuid4().hex[:6]}",
                    "DYN_DISCOVERY_TTL_SECS": "3", **self.env}

    @property
    def namespace(self) -> str:
        return self.env["DYN_NAMESPACE"]

    def alive(self, role: str | None = None) -> list[Engine]:
        return [e for e in self.engines if e.alive() and (role is None or e.spec.role == role)]

    def start(self, spec: EngineSpec) -> Engine:
        system_port = free_port()
        env = {**self.env, **dict(spec.env), "DYN_SYSTEM_PORT": str(system_port),
               "DYN_VLLM_KV_EVENT_PORT": str(free_port())}
        process = TandemProcess("tandem.vllm", "--model", self.model_path, "--discovery-backend", "file",
                                "--served-model-name", MODEL, "--cpu-cores", str(spec.core), *VLLM_TEST_ARGS,
                                # the model runs in the engine core: no third process to start per engine
                                "--distributed-executor-backend", "uni",
                                *engine_memory_args(on_cpu()), *spec.role_args, *spec.args, env=env,
                                timeout=ENGINE_TIMEOUT)
        engine = Engine(spec, process, system_port)
        self.engines.append(engine)
        return engine

    def ensure_started(self) -> None:
        """Start what is missing: each spec's role needs as many live engines as the specs name."""
        missing: list[EngineSpec] = []
        for spec in self.specs:
            wanted = sum(s.role == spec.role for s in self.specs)
            if len(self.alive(spec.role)) + sum(m.role == spec.role for m in missing) < wanted:
                missing.append(spec)
        with ThreadPoolExecutor(max(len(missing), 1)) as pool:  # each on its own core: start them together
            for job in [pool.submit(self.start, spec) for spec in missing]:
                job.result()

    def deployment(self, *frontend_args: str) -> Deployment:
        """A new frontend on this group (stopping it leaves the engines running)."""
        deployment = Deployment(self.root, self.model_path, engines=[], frontend_args=list(frontend_args),
                                env=self.env, instances=len(self.alive()) - len(self.alive("prefill")))
        if self.alive("prefill"):
            deployment.wait_for_instances(len(self.alive("prefill")), kind="prefill_instances")
        return deployment

    def stop(self) -> None:
        for engine in self.engines:
            engine.process.stop()
        self.engines.clear()


# qwen3's parser only sees thinking where the output (or the prompt) opens a <think> block, which SmolLM2 never
# does on its own: it gives the engines vLLM's thinking budget without changing the other tests' answers. hermes
# reads SmolLM2's tool calls (`<tool_call>[{"name": ..., "arguments": ...}]</tool_call>`); it only parses requests
# that send tools with tool_choice auto, so other answers are unchanged too.
_AGGREGATED = ("--max-model-len", "1024", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
               "--enable-prompt-embeds", "--connector", "none", "--dyn-reasoning-parser", "qwen3",
               "--dyn-tool-call-parser", "hermes")
# LoRA on both roles: an adapter request is prefilled on a prefill worker that loaded the adapter.
DISAGG_ARGS = ("--max-model-len", "2048", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")

# SmolLM2 as an embedding model (vLLM's pooling runner: its last token's hidden state, normalized), declared
# matryoshka so that `dimensions` can be tested on a real engine.
EMBEDDING_ARGS = ("--embedding-worker", "--max-model-len", "1024", "--hf-overrides", '{"is_matryoshka": true}')

# The tiny vision-language model (tests/support/vision_model.py) taking images; its tests fetch images from
# their own HTTP server on loopback.
VISION_ARGS = ("--enable-multimodal", "--allow-private-media-urls", "--max-model-len", "1024", "--connector", "none",
               "--limit-mm-per-prompt", '{"image": 4}')

# Keyed by name: the configurations real-vLLM tests share. "aggregated": two plain workers (one per core)
# with LoRA, prompt embeddings, prefix caching, KV events and two parsers; "disaggregated": a prefill
# and a decode worker with NIXL and LoRA; "embedding": one embedding worker.
GROUPS: dict[str, tuple[EngineSpec, ...]] = {
    "aggregated": (EngineSpec((), 0, _AGGREGATED), EngineSpec((), 1, _AGGREGATED)),
    "disaggregated": (EngineSpec(("--is-prefill-worker",), 0, DISAGG_ARGS),
                      EngineSpec(("--is-decode-worker",), 1, DISAGG_ARGS)),
    "embedding": (EngineSpec((), 0, EMBEDDING_ARGS),),
    "vision": (EngineSpec(("--multimodal-embedding-cache-capacity-gb", "0.01"), 0, VISION_ARGS),),
    # The tiny BLIP-2 (vision_model.build_blip2), whose engines its tests start themselves.
    "blip2": (),
}
GROUP_ENV: dict[str, Callable[[EnginePool], dict[str, str]]] = {
    # Adapters load from under DYN_LORA_PATH only; a fixed hash seed keeps vLLM's block hashes stable.
    "aggregated": lambda pool: {"DYN_LORA_ENABLED": "true", "DYN_LORA_PATH": str(pool.lora_root),
                                "PYTHONHASHSEED": "0"},
    "disaggregated": lambda pool: {"DYN_LORA_ENABLED": "true", "DYN_LORA_PATH": str(pool.lora_root)},
    "embedding": lambda pool: {},
    "vision": lambda pool: {},
    "blip2": lambda pool: {},
}


class EnginePool:
    """The session's engine groups, started on first use and stopped after their last user."""

    def __init__(self, root_factory: Callable[[str], Path], model_path: str, lora_root: Path) -> None:
        self._root = root_factory
        self.model_path = model_path
        self.lora_root = lora_root  # adapters load from under it only (DYN_LORA_PATH)
        self.groups: dict[str, EngineGroup] = {}
        self._models: dict[str, str] = {}  # the test models built, by their builder's flag

    def group(self, name: str) -> EngineGroup:
        group = self.groups.get(name)
        if group is None:
            model_path = (self.vision_model() if name == "vision" else self.vision_model("--blip2") if name == "blip2"
                          else self.model_path)
            group = self.groups[name] = EngineGroup(name, self._root(name), model_path, GROUPS[name],
                                                    GROUP_ENV[name](self))
        try:
            group.ensure_started()
        except BaseException:
            group.stop()
            raise
        return group

    def vision_model(self, *builder_args: str) -> str:
        """The tiny vision-language model's folder (or, with `--blip2`, the tiny BLIP-2's), built on first use
        (a few seconds, random weights)."""
        key = " ".join(builder_args)
        if key not in self._models:
            folder = self._root("vision-model")
            subprocess.run([sys.executable, "-m", "tests.support.vision_model", str(folder), self.model_path,
                            *builder_args], check=True, cwd=REPO, timeout=300)
            self._models[key] = str(folder)
        return self._models[key]

    def release(self, name: str) -> None:
        group = self.groups.pop(name, None)
        if group is not None:
            group.stop()

    def stop(self) -> None:
        for name in list(self.groups):
            self.release(name)


def wait_until(condition: Callable[[], object], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def _serving(engine: Engine) -> bool:
    return metric_sum(engine.metrics(), "dynamo_component_inflight_requests", dynamo_endpoint="generate") > 0


def migrate_mid_stream(client: openai.OpenAI, request: dict, candidates: list[Engine], after_chunks: int = 4) -> str:
    """Stream a completion `request`; after a few chunks, freeze every candidate engine (so the stream cannot
    end meanwhile, however fast the hardware), SIGKILL the worker serving the stream, check its engine died
    with it, let the others go on, and return the whole text the client received."""
    stream = iter(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    pieces = [choice.text for chunk in itertools.islice(stream, after_chunks) for choice in chunk.choices]
    with contextlib.ExitStack() as frozen:
        for engine in candidates:
            frozen.enter_context(engine.engine_frozen())
        serving = [engine for engine in candidates if _serving(engine)]
        assert len(serving) == 1, [e.instance_id for e in serving]
        victim, orphans = serving[0], serving[0].engine_processes()
        victim.kill()
    wait_until(lambda: not any(_running(pid) for pid in orphans),
               "the killed worker's engine processes are gone", timeout=10)
    usage = None
    for chunk in stream:
        pieces.extend(choice.text for choice in chunk.choices)
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == request["max_tokens"], usage
    return "".join(pieces)


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for its parent to reap it holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
