"""The planner's traffic from a real Prometheus server (Debian's binary, which scripts/install.sh puts in the
venv) scraping the frontend of a real `tandem run` of mocker workers: the interval's requests, lengths and
latencies and the workers, as the frontend's own metrics give them; nothing for a model that is not served;
and no traffic, without an exception, when Prometheus cannot answer."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tandem.planner.observe import FrontendObserver
from tandem.planner.prometheus import PrometheusObserver, selector
from tandem.planner.sla import Replicas
from tests.support.deployment import MODEL
from tests.support.ports import free_port
from tests.support.servers import ServerProcess

SCRAPE_INTERVAL = 1.0  # seconds
# The interval observed, at least: long enough next to the scrape interval for increase()'s extrapolation to
# stay under one request (see the test).
WINDOW = 14.0
WARM_UP, SENT, MAX_TOKENS = 10, 5, 6
PROMPT = "Tell me about " + " ".join(f"topic{i}" for i in range(40))


class PrometheusServer(ServerProcess):
    """A real Prometheus scraping `target` (host:port of a /metrics page) every SCRAPE_INTERVAL, at `url`."""

    NAME = "prometheus"
    INSTALLED_BY = "scripts/install.sh puts Debian's prometheus binary in the venv"

    def __init__(self, root: Path, target: str) -> None:
        super().__init__(root)
        self.target = target
        self.url = f"http://{self.host}:{free_port()}"

    def start(self) -> None:
        config = self.root / "prometheus.yml"
        every = f"{SCRAPE_INTERVAL:g}s"
        config.write_text(f"global:\n  scrape_interval: {every}\n  scrape_timeout: {every}\n"
                          f"  evaluation_interval: {every}\nscrape_configs:\n  - job_name: tandem-frontend\n"
                          f"    static_configs:\n      - targets: ['{self.target}']\n")
        self._run([f"--config.file={config}", f"--storage.tsdb.path={self.root / 'data'}",
                   f"--web.listen-address={urlsplit(self.url).netloc}"])

    def _up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def value(self, query: str) -> float | None:
        """The single value of an instant query now (None: no series)."""
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": query}, timeout=5).json()
        assert answer["status"] == "success", answer
        result = answer["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, query: str, until: float | None = None, newer_than: float | None = None,
                 timeout: float = 20) -> None:
        """Until `query` gives `until`, and (with `newer_than`) Prometheus has a scrape of the frontend taken
        after that time (the newest sample of its requests counter)."""
        deadline = time.monotonic() + timeout
        while not ((until is None or self.value(query) == until) and (newer_than is None or (
                self.value(f"max(timestamp({selector('dynamo_frontend_requests_total', MODEL)}))") or 0) > newer_than)):
            assert time.monotonic() < deadline, f"Prometheus: {query} = {self.value(query)}, not {until}"
            time.sleep(0.1)


@pytest.fixture
def frontend(launch) -> Iterator[str]:
    """The frontend URL of a `tandem run` of 2 mocker workers (aggregated)."""
    run = launch("--workers", "2")
    try:
        yield run.serving()
    finally:
        run.stop()


@pytest.fixture
def prometheus(frontend: str, tmp_path: Path) -> Iterator[PrometheusServer]:
    try:
        server = PrometheusServer(tmp_path, urlsplit(frontend).netloc)
    except RuntimeError as e:  # no binary
        pytest.skip(str(e))
    server.start()
    yield server
    server.stop()


def chat(url: str) -> dict[str, int]:
    """One request of the test's shape; its usage."""
    response = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": MAX_TOKENS, "messages": [{"role": "user", "content": PROMPT}]})
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_an_interval_of_traffic_is_read_from_prometheus(frontend: str, prometheus: PrometheusServer,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    requests = selector("dynamo_frontend_requests_total", MODEL)
    # The frontend creates its series with the first request, and Prometheus counts a new series' increase
    # from its first sample: requests before that are not in any increase. Warm up, then start the interval.
    for _ in range(WARM_UP):
        chat(frontend)
    prometheus.wait_for(f"sum({requests})", until=WARM_UP)
    # The window is rounded up to whole seconds: wait a second, so that it starts after the warm-up's scrape.
    time.sleep(1)
    direct = FrontendObserver([frontend], MODEL)
    asyncio.run(direct.sample(0))
    start = time.time()
    prometheus.wait_for(f"sum({requests})", newer_than=start)  # a scrape in the window before the traffic
    usage = [chat(frontend) for _ in range(SENT)]
    # Two scrapes after the traffic (one that has all of it, then one more), and the whole WINDOW scraped.
    prometheus.wait_for(f"sum({requests})", until=WARM_UP + SENT)
    prometheus.wait_for(f"sum({requests})", newer_than=max(time.time(), start + WINDOW), timeout=WINDOW + 10)

    seconds = time.time() - start
    observer = PrometheusObserver(prometheus.url, MODEL)
    seen = asyncio.run(observer.sample(seconds))
    frontend_seen = asyncio.run(direct.sample(seconds))

    # increase() extrapolates the delta between the first and last samples in the window to the window's
    # edges (by at most the gap to each edge), which estimates steady traffic well; a burst in mid-window, as
    # here, comes out too high: the counter is flat at both ends, so the result is the SENT requests times
    # window / sampled span, the samples spanning at least the window less one scrape interval at each end.
    # With WINDOW > 2 * SCRAPE_INTERVAL * (SENT + 1), that bound is under SENT + 1.
    def arrived(count: float) -> bool:
        window = math.ceil(seconds)
        return SENT <= count <= SENT * window / (window - 2 * SCRAPE_INTERVAL) < SENT + 1

    assert frontend_seen.requests == SENT
    assert arrived(seen.requests), seen
    # A mean is two increases over the same samples, extrapolated alike: exact. (increase() also stops its
    # extrapolation back where a counter would reach 0: with a first sample small next to the increase,
    # a histogram's sum and count could then be extrapolated differently. The warm-up, twice the traffic,
    # puts that point well before the window.)
    [prompt] = {u["prompt_tokens"] for u in usage}
    assert seen.isl == pytest.approx(frontend_seen.isl) == prompt
    assert {u["completion_tokens"] for u in usage} == {MAX_TOKENS}
    assert seen.osl == pytest.approx(frontend_seen.osl) == MAX_TOKENS
    for name in ("ttft_ms", "itl_ms", "request_duration_s"):
        assert getattr(seen, name) == pytest.approx(getattr(frontend_seen, name), rel=1e-6), name
    assert seen.has_traffic() and seen.interval_s == seconds
    assert observer.workers == direct.workers == Replicas(prefill=0, decode=2)

    # Every model's traffic without a model; none for a model not served (a name PromQL must get escaped).
    everything = PrometheusObserver(prometheus.url)
    assert arrived(asyncio.run(everything.sample(seconds)).requests)
    assert everything.workers == Replicas(prefill=0, decode=2)
    for name in ("no-such-model", 'a "quoted" \\ name\n'):
        other = PrometheusObserver(prometheus.url, name)
        nothing = asyncio.run(other.sample(seconds))
        assert nothing.requests == 0 and not nothing.has_traffic() and math.isnan(nothing.isl)
        assert other.workers == Replicas(0, 0)  # an answer (a query error would leave None)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    # The planning loop's starting point: no traffic yet, the workers already known.
    first = PrometheusObserver(prometheus.url, MODEL)
    assert asyncio.run(first.sample(0)).requests == 0 and first.workers == Replicas(0, 2)

    # Not Prometheus' API (the frontend answers 404): no traffic, a warning, nothing raised.
    wrong = PrometheusObserver(frontend)
    assert not asyncio.run(wrong.sample(seconds)).has_traffic() and wrong.workers is None
    assert "did not answer (HTTP 404" in caplog.text


def test_an_unreachable_prometheus_gives_no_traffic(caplog: pytest.LogCaptureFixture) -> None:
    observer = PrometheusObserver("http://127.0.0.1:9/", MODEL, timeout=2)
    observer.workers = Replicas(1, 1)
    metrics = asyncio.run(observer.sample(30))
    assert metrics.requests == 0 and not metrics.has_traffic() and metrics.interval_s == 30
    assert observer.workers is None
    assert "Prometheus at http://127.0.0.1:9/api/v1/query did not answer" in caplog.text


def test_the_planner_reads_the_traffic_from_prometheus(frontend: str, prometheus: PrometheusServer,
                                                       tmp_path: Path) -> None:
    """`tandem planner --metric-pulling-prometheus-endpoint`: the SLA planner decides from what Prometheus
    scraped (here: observing only, so that it changes nothing)."""
    import subprocess
    import sys

    from tests.planner.test_planner_run import write_profiles
    from tests.support.load import Load

    write_profiles(tmp_path)
    planner = subprocess.Popen(
        [sys.executable, "-m", "tandem.planner", "--metric-pulling-prometheus-endpoint", prometheus.url,
         "--no-operation", "--mode", "agg", "--profile-results-dir", str(tmp_path), "--adjustment-interval", "3",
         "--load-predictor", "constant", "--no-correction", "--max-gpu-budget", "3", "--control-api-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert planner.stdout is not None
    heavy = Load(frontend, clients=6, pause=0)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not any("decode 2 -> 3 (observe_only)" in line for line in lines):
            assert time.monotonic() < deadline and planner.poll() is None, "".join(lines)
            lines.append(planner.stdout.readline())
    finally:
        heavy.stop()
        planner.terminate()
        planner.wait(10)
    assert heavy.failures == []
