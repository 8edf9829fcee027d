"""The frontend's routing modes and prefill-token busy thresholds through real processes: three mocker
workers, and one frontend per mode on the same discovery (a mode is a frontend's flag). Which worker served
a request is read from the workers' own metrics: `dynamo_component_requests_total` (finished requests) and
`dynamo_component_inflight_requests` (accepted, not finished) of each one's `generate` endpoint, on its own
system port.

The workers run three sequences at a time (`--max-num-seqs 3`) with slow decode steps (about 12 ms each), so
a long stream pinned to a worker (`x-worker-instance-id`) stays in flight until the test closes it, and with
three such streams on a worker a request sent there meanwhile waits for its prefill: what the prefill-token
thresholds count. A mode that sends a request to a worker it should avoid fails its test at once (the
worker has room to serve it).
Every statistical bound below fails with probability under 1e-6 for a correct implementation; each test's
docstring says how it was computed."""

from __future__ import annotations

import contextlib
import json
import math
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
import pytest

from tests.support.deployment import MODEL, Deployment
from tests.support.engines import wait_until
from tests.support.ports import free_port
from tests.support.processes import TandemProcess

SEQS = 3  # sequences a worker runs at once: the busiest one in the mode tests keeps a free slot
MOCKER = ["--block-size", "16", "--speedup-ratio", "100", "--decode-speedup-ratio", "0.005", "--max-num-seqs",
          str(SEQS), "--max-num-batched-tokens", "1000"]
THRESHOLD = 500  # prompt tokens; the frac frontend: 0.5 of the workers' max_num_batched_tokens (1000)
FRONTENDS = {
    "round-robin": ["--router-mode", "round-robin"],
    "random": ["--router-mode", "random"],
    "least-loaded": ["--router-mode", "least-loaded"],
    "power-of-two": ["--router-mode", "power-of-two"],
    "prefill-tokens": ["--active-prefill-tokens-threshold", str(THRESHOLD)],
    "prefill-tokens-frac": ["--active-prefill-tokens-threshold-frac", "0.5"],
}
HOLD_TOKENS = 6000  # a held stream: 6000 decode steps of ~12 ms, over a minute unless it is closed
FAILURE = 1e-6  # the chance a statistical assertion may fail when the mode does what it promises
HTTP = httpx.Client(timeout=60)  # one client: a new one per call builds an SSL context, ~0.2 s on a busy machine


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples `name{...}` on a /metrics page whose labels include `labels` (a line scan:
    parsing whole pages made polling them most of this module's time)."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in HTTP.get(f"{url}/metrics").text.splitlines()
               if line.startswith(f"{name}{{") and all(label in line for label in wanted))


@dataclass
class Worker:
    process: TandemProcess
    system_url: str

    @property
    def instance(self) -> int:
        return int(self.process.ready[0], 16)

    def metric(self, name: str) -> float:
        return _metric(self.system_url, name, dynamo_endpoint="generate")


@dataclass
class Frontend:
    url: str

    def metric(self, name: str) -> float:
        return _metric(self.url, name, model=MODEL)

    def tokens(self, prompt: str) -> int:
        return int(HTTP.post(f"{self.url}/tokenize", json={"model": MODEL, "prompt": prompt}).json()["count"])


@dataclass
class Cluster:
    workers: list[Worker]
    frontends: dict[str, Frontend] = field(default_factory=dict)

    def served(self) -> list[float]:
        return [w.metric("dynamo_component_requests_total") for w in self.workers]

    def inflight(self) -> list[float]:
        return [w.metric("dynamo_component_inflight_requests") for w in self.workers]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> Iterator[Cluster]:
    # The deployment's own frontend is the round-robin one (the default mode); the other frontends join its
    # discovery. Processes start in parallel: start-up is most of this module's time.
    deployment = Deployment(tmp_path_factory.mktemp("modes"), smollm2, engine_module="tandem.mocker", engines=[])
    processes: dict[str, TandemProcess] = {}
    try:
        ports = [free_port() for _ in range(3)]
        with ThreadPoolExecutor(len(FRONTENDS) + len(ports)) as pool:
            engines = [pool.submit(deployment.add_engine, *MOCKER, env={"DYN_SYSTEM_PORT": str(port)}) for port in ports]
            started = {name: pool.submit(TandemProcess, "tandem.frontend", "--http-host", "127.0.0.1", "--http-port",
                                         "0", "--discovery-backend", "file", *args, env=deployment.env)
                       for name, args in FRONTENDS.items() if name != "round-robin"}
        processes.update({name: future.result() for name, future in started.items() if not future.exception()})
        workers = [Worker(engine.result(), f"http://127.0.0.1:{port}") for engine, port in zip(engines, ports, strict=True)]
        for future in started.values():
            future.result()  # raises what stopped a frontend
        cluster = Cluster(workers, {"round-robin": Frontend(deployment.url)})
        cluster.frontends.update({name: Frontend(p.ready[0]) for name, p in processes.items()})
        for frontend in cluster.frontends.values():
            deployment.wait_for_instances(3, url=frontend.url)
        yield cluster
    finally:
        for process in processes.values():
            process.stop()
        deployment.stop()


class Held:
    """A streamed completion whose answer is never read (its first token may never come: the worker queues
    it) and that stays in flight until `close()` (the frontend then cancels it on the worker)."""

    def __init__(self, frontend: Frontend, prompt: str, *, worker: Worker | None = None,
                 max_tokens: int = HOLD_TOKENS) -> None:
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
        pinned = f"x-worker-instance-id: {worker.instance}\r\n" if worker is not None else ""
        address = urlsplit(frontend.url)
        self.sock = socket.create_connection((address.hostname, address.port))
        self.sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json"
                          f"\r\nContent-Length: {len(body)}\r\n{pinned}\r\n".encode() + body)

    def close(self) -> None:
        if self.sock.fileno() != -1:
            with contextlib.suppress(OSError):  # the frontend may have closed it already
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()


@pytest.fixture
def held(cluster: Cluster) -> Iterator[Callable[..., Held]]:
    """Open held streams; at the end close them and wait until every frontend and worker has let them go (so
    the next test counts only its own requests)."""
    opened: list[Held] = []

    def hold(*args: object, **kwargs: object) -> Held:
        opened.append(Held(*args, **kwargs))  # type: ignore[arg-type]
        return opened[-1]

    yield hold
    for stream in opened:
        stream.close()
    wait_until(lambda: sum(cluster.inflight()) == 0
               and all(f.metric("dynamo_frontend_inflight_requests") == 0 for f in cluster.frontends.values()),
               "the held streams are gone from the frontends and the workers", timeout=60)


def _probe(frontend: Frontend) -> httpx.Response:
    return HTTP.post(f"{frontend.url}/v1/completions", json={"model": MODEL, "prompt": "probe", "max_tokens": 1})


def _served_by(cluster: Cluster, frontend: Frontend, count: int, concurrency: int = 1) -> list[int]:
    """Send `count` requests (`concurrency` at a time) and return how many each worker served, from the
    workers' own counters (a request is counted there once its stream has ended)."""
    before = cluster.served()
    with ThreadPoolExecutor(concurrency) as pool:
        statuses = list(pool.map(lambda _: _probe(frontend).status_code, range(count)))
    assert statuses == [200] * count
    after: list[float] = []

    def counted() -> bool:
        after[:] = cluster.served()
        return sum(after) - sum(before) == count

    wait_until(counted, f"the workers counted {count} requests", timeout=30)
    return [round(a - b) for a, b in zip(after, before, strict=True)]


def _sequence(cluster: Cluster, frontend: Frontend, count: int) -> list[int]:
    """Which worker (index) served each of `count` requests sent one after another."""
    order: list[int] = []
    served = cluster.served()
    for _ in range(count):
        assert _probe(frontend).status_code == 200
        deadline = time.monotonic() + 30
        while (now := cluster.served()) == served:  # polled closely: this is most of the module's requests
            assert time.monotonic() < deadline, "no worker counted the request"
            time.sleep(0.005)
        added = [round(n - s) for n, s in zip(now, served, strict=True)]
        assert sorted(added) == [0, 0, 1], added
        order.append(added.index(1))
        served = now
    return order


def _binomial_bounds(n: int, p: float, failure: float) -> tuple[int, int]:
    """The narrowest [lo, hi] with P(X < lo) + P(X > hi) <= `failure` for X ~ Binomial(n, p), each tail
    given half, from the exact probabilities."""
    pmf = [math.comb(n, k) * p**k * (1 - p) ** (n - k) for k in range(n + 1)]
    lo = next(k for k in range(n + 1) if sum(pmf[: k + 1]) > failure / 2)
    hi = next(k for k in range(n, -1, -1) if sum(pmf[k:]) > failure / 2)
    return lo, hi


# -- modes ------------------------------------------------------------------------------------------------
def test_round_robin_rotates_exactly(cluster: Cluster) -> None:
    order = _sequence(cluster, cluster.frontends["round-robin"], 9)
    assert sorted(order[:3]) == [0, 1, 2], order  # each worker once in every three
    assert order[3:] == order[:-3], order  # and always in the same order


def test_random_is_uniform_and_not_a_rotation(cluster: Cluster) -> None:
    """240 requests over 3 workers: each worker's count is Binomial(240, 1/3); `_binomial_bounds` gives the
    exact interval outside which a count falls with probability <= 1e-6 / 2 / 3, so that any of the three does
    with probability <= 1e-6 / 2 (union bound). Then 37 requests one after another: a fixed rotation never
    sends two in a row to the same worker; uniform random picks do so at each step with probability 1/3, so
    never in 36 steps with probability (2/3)^36 = 4.6e-7."""
    frontend = cluster.frontends["random"]
    n, k = 240, len(cluster.workers)
    lo, hi = _binomial_bounds(n, 1 / k, FAILURE / 2 / k)
    counts = _served_by(cluster, frontend, n, concurrency=6)
    assert all(lo <= c <= hi for c in counts), (counts, lo, hi)
    order = _sequence(cluster, frontend, 37)
    assert (2 / 3) ** 36 < FAILURE / 2
    assert any(a == b for a, b in zip(order[:-1], order[1:], strict=True)), order


def test_least_loaded_avoids_the_busy_workers(cluster: Cluster, held: Callable[..., Held]) -> None:
    """One stream held on worker 0: 30 requests one after another split between the two idle workers (ties
    are broken at random: one of them gets none with probability 2 * 2^-30 = 1.9e-9) and none reaches worker 0.
    One stream held on worker 1 as well: every request goes to worker 2."""
    frontend = cluster.frontends["least-loaded"]
    a, b, _ = cluster.workers
    held(frontend, "busy a", worker=a)
    wait_until(lambda: frontend.metric("dynamo_frontend_inflight_requests") == 1, "the stream is in flight")
    counts = _served_by(cluster, frontend, 30)
    assert counts[0] == 0 and counts[1] > 0 and counts[2] > 0, counts
    held(frontend, "busy b", worker=b)
    wait_until(lambda: frontend.metric("dynamo_frontend_inflight_requests") == 2, "both streams are in flight")
    assert _served_by(cluster, frontend, 20) == [0, 0, 20]
    assert frontend.metric("dynamo_frontend_inflight_requests") == 2  # the held streams ran throughout


def test_power_of_two_never_picks_the_busier_of_its_pair(cluster: Cluster, held: Callable[..., Held]) -> None:
    """Two streams held on worker 0, one on worker 1, none on worker 2; requests one after another (so each
    sees those loads). Power of two draws one of the 3 pairs uniformly and takes its less loaded worker:
    {0,1} -> 1, {0,2} -> 2, {1,2} -> 2. So worker 0 gets exactly nothing, worker 1 a Binomial(60, 1/3) count
    (inside `_binomial_bounds` but with probability 1e-6, and never 0 there: least-loaded would give it none),
    worker 2 the rest."""
    frontend = cluster.frontends["power-of-two"]
    a, b, _ = cluster.workers
    for worker in (a, a, b):
        held(frontend, "busy", worker=worker)
    wait_until(lambda: frontend.metric("dynamo_frontend_inflight_requests") == 3, "the streams are in flight")
    n = 60
    lo, hi = _binomial_bounds(n, 1 / 3, FAILURE)
    assert lo > 0
    counts = _served_by(cluster, frontend, n)
    assert counts[0] == 0 and lo <= counts[1] <= hi, (counts, lo, hi)
    assert frontend.metric("dynamo_frontend_inflight_requests") == 3  # the held streams ran throughout


# -- busy thresholds --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["prefill-tokens", "prefill-tokens-frac"])
def test_prefill_token_thresholds(cluster: Cluster, held: Callable[..., Held], name: str) -> None:
    """The prompt tokens a frontend sent a worker that have not had their first token yet make it busy above
    the threshold: busy workers are skipped, all busy is a 503, and a worker back under it is used again.
    (Round robin among the free workers.)"""
    frontend = cluster.frontends[name]
    a, b, c = cluster.workers
    prompt = "pending " + " ".join(f"w{i}" for i in range(100))
    tokens = frontend.tokens(prompt)
    assert THRESHOLD / 2 < tokens < THRESHOLD - 10, tokens  # one is under the threshold, with probes; two over

    def waiting(count: int) -> None:  # requests of this frontend without a first token
        wait_until(lambda: frontend.metric("dynamo_frontend_queued_requests") == count, f"{count} requests wait",
                   timeout=30)

    blockers = {w.instance: [held(frontend, "block", worker=w) for _ in range(SEQS)] for w in (a, b, c)}
    wait_until(lambda: frontend.metric("dynamo_frontend_inflight_requests") == 3 * SEQS, "the blockers are in flight")
    waiting(0)  # each worker runs its blockers' decodes: whatever comes next waits for them
    for worker, pending in ((a, 1), (b, 2), (c, 2)):
        for _ in range(pending):
            held(frontend, prompt, worker=worker, max_tokens=1)
    waiting(5)  # awaiting prefill: a under the threshold, b and c over it
    for _ in range(3):
        held(frontend, "probe", max_tokens=1)
    waiting(8)
    wait_until(lambda: sum(cluster.inflight()) == 3 * SEQS + 8, "the workers hold every request")
    # every new request went to a, the one worker under the threshold
    assert cluster.inflight() == [SEQS + 4, SEQS + 2, SEQS + 2]

    held(frontend, prompt, worker=a, max_tokens=1)  # a over it too
    waiting(9)
    rejections = frontend.metric("dynamo_frontend_model_rejection_total")
    busy = _probe(frontend)
    assert busy.status_code == 503 and "busy" in busy.json()["error"]["message"], busy.text
    assert frontend.metric("dynamo_frontend_model_rejection_total") == rejections + 1

    for blocker in blockers[a.instance]:
        blocker.close()  # a prefills its queue: its requests have their first token
    waiting(4)
    wait_until(lambda: a.metric("dynamo_component_inflight_requests") == 0, "a has served its queue")
    assert _served_by(cluster, frontend, 2) == [2, 0, 0]  # under the threshold again, and the only one
