"""A deployment across hosts (network namespaces on a bridge): etcd and NATS on one, the frontend on another, a
mocker worker on each of two more; on the TCP/ZMQ planes and on the NATS planes. Every process finds its own address to advertise (no DYN_TCP_RPC_HOST); requests
and KV events cross hosts; a worker whose link is cut has its streams migrated, leaves routing within its lease
TTL, and comes back when the link does."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.deployment import KV_EVENTS_APPLIED, MODEL, kv_events_emitted, metric_sum, streamed_outcome
from tests.support.hosts import Hosts
from tests.support.processes import TandemProcess
from tests.support.servers import EtcdServer, NatsServer

TTL = 3  # seconds: discovery leases, and how long a silent TCP peer is waited for
MOCKER = ["--block-size", "16", "--num-gpu-blocks-override", "2048"]


class Cluster:
    def __init__(self, root, smollm2: str, monkeypatch: pytest.MonkeyPatch, planes: str) -> None:  # type: ignore[no-untyped-def]
        self.hosts = Hosts(["srv", "fe", "w1", "w2"])
        self.processes: list[TandemProcess] = []
        self.servers: list[EtcdServer | NatsServer] = []
        try:
            where = {"host": self.hosts.address["srv"], "netns": self.hosts.netns["srv"]}
            self.etcd = EtcdServer(root / "etcd", **where)
            self.nats = NatsServer(root / "nats", jetstream=False, **where)
            for server in (self.etcd, self.nats):
                server.root.mkdir()
                server.start()
                self.servers.append(server)
            monkeypatch.setenv("ETCD_ENDPOINTS", self.etcd.url)  # for this process's own runtimes
            self.env = {"ETCD_ENDPOINTS": self.etcd.url, "DYN_DISCOVERY_BACKEND": "etcd", "DYN_NAMESPACE": "multihost",
                        "DYN_TCP_RPC_HOST": "", "DYN_DISCOVERY_TTL_SECS": str(TTL),
                        "DYN_TCP_PEER_TIMEOUT_SECS": str(TTL), "NATS_SERVER": self.nats.url}
            if planes == "nats":
                self.env.update(DYN_REQUEST_PLANE="nats", DYN_EVENT_PLANE="nats")
            self.planes = {"request_plane": "nats", "event_plane": "nats", "nats_server": self.nats.url} \
                if planes == "nats" else {}
            self.workers = {name: self._start("tandem.mocker", name, "--model", smollm2, *MOCKER, "--speedup-ratio",
                                               "0.5") for name in ("w1", "w2")}
            frontend = self._start("tandem.frontend", "fe", "--http-host", "0.0.0.0", "--http-port", "0",
                                   "--router-mode", "kv", "--router-predicted-ttl-secs", "0")
            self.url = f"http://{self.hosts.address['fe']}:{frontend.ready[0].rsplit(':', 1)[1]}"
            self.wait_instances(2, timeout=30)
        except BaseException:
            self.stop()
            raise

    def _start(self, module: str, host: str, *args: str) -> TandemProcess:
        process = TandemProcess(module, *args, env=self.env, netns=self.hosts.netns[host])
        self.processes.append(process)
        return process

    def instances(self) -> list[int]:
        return httpx.get(f"{self.url}/health", timeout=5).json().get("instances", [])

    def wait_instances(self, count: int, timeout: float) -> None:
        """Until /health lists `count` instances."""
        deadline = time.monotonic() + timeout
        while len(self.instances()) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"not {count} instances within {timeout} s: {self.instances()}")
            time.sleep(0.1)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()
        for server in self.servers:
            server.stop()
        self.hosts.remove()


@pytest.fixture(params=["tcp", "nats"])
def cluster(request, tmp_path, smollm2, monkeypatch) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    made = Cluster(tmp_path, smollm2, monkeypatch, request.param)
    yield made
    made.stop()


def test_requests_and_kv_events_cross_hosts_at_the_addresses_each_host_advertises(cluster: Cluster) -> None:
    import base64
    import json

    if not cluster.planes:  # TCP: each worker advertises its own host's address, never 127.0.0.1 or 0.0.0.0
        records = cluster.etcd.call("/v3/kv/range", {"key": base64.b64encode(b"v1/instances/").decode(),
                                                     "range_end": base64.b64encode(b"v1/instances0").decode()})
        hosts = {json.loads(base64.b64decode(kv["value"]))["transport"]["tcp"].rsplit(":", 1)[0]
                 for kv in records["kvs"]}
        assert {cluster.hosts.address["w1"], cluster.hosts.address["w2"]} <= hosts
    client = cluster.client()
    prompt = "a conversation across hosts: " + " ".join(f"word{i}" for i in range(120))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.completion_tokens == 2
    # The KV router learns the cached prefix from the worker's events alone (predicted blocks are off):
    # they crossed from the worker's host to the frontend's, through the address the worker advertised.
    emitted = kv_events_emitted("", "multihost", "backend", 2, discovery_backend="etcd", **cluster.planes)
    deadline = time.monotonic() + 20
    while metric_sum(httpx.get(f"{cluster.url}/metrics").text, KV_EVENTS_APPLIED) < emitted:
        assert time.monotonic() < deadline, "KV events did not reach the frontend"
        time.sleep(0.1)
    for turn in range(3):
        reply = client.completions.create(model=MODEL, prompt=f"{prompt} follow-up {turn}", max_tokens=2)
        assert reply.usage.prompt_tokens_details.cached_tokens > 0, turn  # sent where the prefix is cached


def test_a_cut_link_migrates_its_streams_and_the_worker_returns_with_the_link(cluster: Cluster) -> None:
    client = cluster.client()
    outcomes: list[str] = []
    underway = threading.Semaphore(0)

    def one(n: int) -> None:
        try:
            stream = client.chat.completions.create(model=MODEL, max_tokens=300, stream=True, messages=[
                {"role": "user", "content": f"stream {n} across hosts"}])
            outcomes.append(streamed_outcome(stream, underway))
        except openai.APIError as e:
            outcomes.append(f"error:{e}")

    threads = [threading.Thread(target=one, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for _ in threads:  # however slow the machine, every stream is running (on both workers) before the cut
        assert underway.acquire(timeout=60), "a stream never started"
    cluster.hosts.cut("w1")
    cluster.wait_instances(1, timeout=TTL * 5)  # out of routing once its lease ends
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a stream hung on the cut worker"
    assert outcomes.count("completed") == 4, outcomes
    migrations = metric_sum(httpx.get(f"{cluster.url}/metrics").text, "dynamo_frontend_model_migration_total")
    assert migrations >= 1  # the cut worker's streams moved to the other one
    reply = client.chat.completions.create(model=MODEL, max_tokens=3, messages=[
        {"role": "user", "content": "while a host is away"}])
    assert reply.usage.completion_tokens == 3
    cluster.hosts.restore("w1")
    cluster.wait_instances(2, timeout=30)  # its lease expired meanwhile: it registered again
    assert cluster.workers["w1"].proc.poll() is None
    for n in range(4):
        assert client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": f"after the link came back {n}"}]).usage.completion_tokens == 2
