"""A frontend and test engines as real processes on file discovery, for end-to-end tests."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tandem.llm.model_card import ModelDeploymentCard
from tandem.runtime import DistributedRuntime, RuntimeConfig, keys
from tests.support.processes import TandemProcess

MODEL = "SmolLM2-135M-Instruct"
# Every real vLLM engine in the tests: no torch.compile (a cold compile takes ~5 min on one core, ~40 s
# start-up without) and float32 (on CPUs without native bf16 it prefills ~3x faster than bf16).
VLLM_TEST_ARGS = ("--enforce-eager", "--dtype", "float32")


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` on a /metrics page whose labels include `labels`."""
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


# Where a vLLM engine's prompt tokens got their KV (`vllm:prompt_tokens_by_source_total{source=...}`): computed
# by this engine, found in its prefix cache, or pulled from another worker (NIXL). A decode worker that computes
# none of a prompt and pulls some of it did not prefill it.
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def prompt_sources(text: str) -> dict[str, float]:
    """A vLLM worker's prompt tokens by source, from its /metrics page."""
    return {s: metric_sum(text, "vllm:prompt_tokens_by_source_total", source=s) for s in PROMPT_SOURCES}


def deltas(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Each counter's growth from `before` to `after`."""
    return {k: after[k] - before[k] for k in after}


def streamed_outcome(stream: openai.Stream, underway: threading.Semaphore, tokens: int = 300) -> str:
    """Read a chat completion stream of `tokens` tokens, releasing `underway` at its first one (so a test
    can act once its streams are running, however slow the machine): "completed", or "short:<count>"."""
    count = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            count += 1
            if count == 1:
                underway.release()
    return "completed" if count == tokens else f"short:{count}"


KV_EVENTS_APPLIED = "dynamo_component_kv_cache_events_applied_total"


def kv_events_emitted(file_kv: str, namespace: str, component: str = "backend", instances: int = 1,
                      **settings: object) -> int:
    """How many KV events the `instances` workers of `component` have emitted, every dp rank of each:
    what their `worker_kv_indexer_query` endpoints report as the id of their newest event. `settings`:
    RuntimeConfig settings of the deployment besides file discovery (another backend, its planes)."""
    config = RuntimeConfig(discovery_backend="file", file_kv_root=file_kv, tcp_host="127.0.0.1",
                           graceful_shutdown_grace_period=0).replace(**settings)

    async def go() -> int:
        runtime = await DistributedRuntime.create(config)
        try:
            client = await runtime.endpoint(f"{namespace}.{component}.worker_kv_indexer_query").client()
            await client.wait_for_instances(instances, timeout=30)
            total = 0
            for instance in client.instance_ids():
                for rank in range(64):
                    # a start beyond the newest event: no events in the answer, only the newest id
                    query = {"dp_rank": rank, "start_event_id": 2**62, "end_event_id": None}
                    [answer] = [a async for a in await client.direct(query, instance)]
                    if "error" in answer:  # no such rank
                        break
                    total += 0 if answer["last_event_id"] is None else answer["last_event_id"] + 1
            return total
        finally:
            await runtime.shutdown()

    return asyncio.run(go())


def wait_for_kv_events(url: str, count: int, timeout: float = 15) -> None:
    """Until the frontend at `url` has applied `count` KV events to its routers' indexes (its
    `dynamo_component_kv_cache_events_applied_total`): what it knows of the workers' caches is then
    what they reported."""
    deadline = time.monotonic() + timeout
    while (applied := metric_sum(httpx.get(f"{url}/metrics").text, KV_EVENTS_APPLIED)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the frontend applied {applied:g} KV events of the {count} the workers emitted")
        time.sleep(0.02)


class Deployment:
    def __init__(self, root: Path, model_path: str, *, engines: list[list[str]] | None = None,
                 frontend_args: list[str] | None = None, env: dict[str, str] | None = None,
                 engine_module: str = "tandem.testing.engine", verify: bool = True,
                 engine_timeout: float = 120, engine_env: dict[str, str] | None = None,
                 instances: int | None = None, discovery: str = "file") -> None:
        """`instances`: how many worker instances /health must list before use (default: one per engine);
        `discovery`: the backend every process uses (`etcd`: the one ETCD_ENDPOINTS names)."""
        self.discovery = discovery
        kv = root / f"kv-{uuid.uuid4().hex[:6]}"
        kv.mkdir(parents=True)
        self.namespace = f"test-{uuid.uuid4().hex[:8]}"
        self.model_path = model_path
        self.verify = verify
        self.engine_timeout = engine_timeout
        self.engine_env = engine_env or {}
        self.engine_module = engine_module
        self.env = {"DYN_FILE_KV": str(kv), "DYN_NAMESPACE": self.namespace, "DYN_DISCOVERY_TTL_SECS": "3",
                    **(env or {})}
        self.namespace = self.env["DYN_NAMESPACE"]  # `env` may name a namespace whose engines run already
        self.engines: list[TandemProcess] = []
        self.frontend: TandemProcess | None = None
        try:
            for extra in engines if engines is not None else [[]]:
                self.add_engine(*extra)
            self.frontend = TandemProcess("tandem.frontend", "--http-host", "127.0.0.1", "--http-port", "0",
                                          "--discovery-backend", discovery, *(frontend_args or []), env=self.env)
            self.url = self.frontend.ready[0]
            self.wait_for_instances(len(self.engines) if instances is None else instances)
        except BaseException:
            self.stop()
            raise

    def add_engine(self, *extra: str, env: dict[str, str] | None = None) -> TandemProcess:
        """Start one more engine; `env` adds to (and overrides) `engine_env` for this engine only."""
        defaults = VLLM_TEST_ARGS if self.engine_module == "tandem.vllm" else ()
        engine = TandemProcess(self.engine_module, "--model", self.model_path, "--discovery-backend", self.discovery,
                               *defaults, *extra, env={**self.env, **self.engine_env, **(env or {})},
                               timeout=self.engine_timeout)
        self.engines.append(engine)
        return engine

    def wait_for_instances(self, count: int, timeout: float = 30, kind: str = "instances",
                           url: str | None = None) -> None:
        """Until /health (of this frontend, or the one at `url`) lists `count` ids under `kind`
        (`instances`, or `prefill_instances`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = httpx.get(f"{url or self.url}/health", verify=self.verify)
            if len(r.json().get(kind, [])) == count:
                return
            time.sleep(0.05)
        raise TimeoutError(f"frontend did not see {count} {kind}: {r.text}")

    def client(self, **options: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=options.pop("api_key", "none"), max_retries=0,
                             **options)  # type: ignore[arg-type]

    @property
    def planes(self) -> dict[str, str]:
        """The request and event planes (and NATS server) the deployment's processes use, as RuntimeConfig
        settings."""
        names = {"DYN_REQUEST_PLANE": "request_plane", "DYN_EVENT_PLANE": "event_plane", "NATS_SERVER": "nats_server"}
        return {field: self.env[env] for env, field in names.items() if env in self.env}

    async def runtime(self) -> DistributedRuntime:
        """A runtime of this process on the deployment's discovery and planes (shut it down when done)."""
        return await DistributedRuntime.create(RuntimeConfig(
            discovery_backend=self.discovery, file_kv_root=self.env["DYN_FILE_KV"], tcp_host="127.0.0.1",
            graceful_shutdown_grace_period=0, **self.planes))  # type: ignore[arg-type]

    def cards(self) -> list[ModelDeploymentCard]:
        """The model cards the deployment's workers registered."""

        async def read() -> list[ModelDeploymentCard]:
            runtime = await self.runtime()
            try:
                values = (await runtime.store.get_prefix(keys.models_prefix(self.namespace))).values()
                return [ModelDeploymentCard.from_json(value) for value in values]
            finally:
                await runtime.shutdown()

        return asyncio.run(read())

    def call(self, path: str, request: object, instance: int | None = None) -> list:
        """Call a worker endpoint (`ns.component.endpoint` without the namespace) through the runtime: on
        `instance`, or on any one instance."""

        async def go() -> list:
            runtime = await self.runtime()
            try:
                client = await runtime.endpoint(f"{self.namespace}.{path}").client()
                await client.wait_for_instances(1, timeout=30)
                stream = await (client.round_robin(request) if instance is None else client.direct(request, instance))
                return [item async for item in stream]
            finally:
                await runtime.shutdown()

        return asyncio.run(go())

    def kv_events_emitted(self, component: str = "backend", instances: int | None = None) -> int:
        """KV events the workers of `component` (`instances` of them, default one per engine) emitted."""
        return kv_events_emitted(self.env["DYN_FILE_KV"], self.namespace, component,
                                 len(self.engines) if instances is None else instances, discovery_backend=self.discovery,
                                 **self.planes)

    def wait_for_kv_events(self, component: str = "backend", instances: int | None = None,
                           url: str | None = None) -> int:
        """Until the frontend (or the one at `url`) has applied every KV event the workers of `component`
        emitted; returns their number."""
        count = self.kv_events_emitted(component, instances)
        wait_for_kv_events(url or self.url, count)
        return count

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text

    def stop(self) -> None:
        if self.frontend is not None:
            self.frontend.stop()
        for engine in self.engines:
            engine.stop()
