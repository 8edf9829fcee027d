"""The planner's view of traffic: interval means from the differences of the frontends' cumulative
metrics, added over frontends, with a restarted frontend's series counted from zero; the same read from a
real frontend serving the test engine; and a frontend of two processes on one port (`--num-processes 2`, as
the chart runs it): every process is found in discovery and the requests sent are counted exactly, while the
shared address itself is refused."""

from __future__ import annotations

import asyncio
import math
import sys
import time

import pytest

from tandem.planner.observe import (
    DiscoveredFrontends,
    FrontendObserver,
    Page,
    SharedAddressError,
    Totals,
    parse_page,
)
from tandem.runtime.discovery import make_store
from tests.frontend.test_frontend_replicas import openai_over, pinned
from tests.planner.test_planner_run import write_profiles
from tests.support.deployment import MODEL, Deployment

PAGE = """\
# TYPE dynamo_frontend_requests counter
dynamo_frontend_requests_total{{model="m",endpoint="chat_completions",request_type="stream",status="success"}} {requests}
dynamo_frontend_requests_total{{model="other",endpoint="completions",request_type="unary",status="success"}} 100
# TYPE dynamo_frontend_input_sequence_tokens histogram
dynamo_frontend_input_sequence_tokens_sum{{model="m"}} {isl_sum}
dynamo_frontend_input_sequence_tokens_count{{model="m"}} {requests}
# TYPE dynamo_frontend_time_to_first_token_seconds histogram
dynamo_frontend_time_to_first_token_seconds_sum{{model="m"}} {ttft_sum}
dynamo_frontend_time_to_first_token_seconds_count{{model="m"}} {requests}
"""


def page(requests: float, isl_sum: float, ttft_sum: float) -> str:
    return PAGE.format(requests=requests, isl_sum=isl_sum, ttft_sum=ttft_sum)


def test_interval_means_come_from_the_increases_of_sums_and_counts() -> None:
    before, after = parse_page(page(10, 5000, 2.0), "m").totals, parse_page(page(30, 25000, 8.0), "m").totals
    metrics = after.increase_since(before).interval(60)
    assert (metrics.requests, metrics.isl, metrics.ttft_ms) == (20, 1000, pytest.approx(300))
    assert math.isnan(metrics.osl)  # no output lengths on the page: unknown, never 0
    assert parse_page(page(10, 5000, 2.0)).totals.requests == 110  # every model when none is named


def test_a_restarted_frontend_counts_from_zero_and_frontends_add_up() -> None:
    restarted = parse_page(page(4, 2000, 1.0), "m").totals.increase_since(parse_page(page(30, 25000, 8.0), "m").totals)
    assert (restarted.requests, restarted.isl_sum) == (4, 2000)
    two = (restarted + Totals(requests=6, isl_sum=1000, isl_count=6)).interval(10)
    assert (two.requests, two.isl) == (10, 300)


async def test_requests_are_counted_as_they_arrive_those_in_flight_included() -> None:
    def at(requests: float, inflight: float) -> str:
        return page(requests, 500 * requests, 0.1 * requests) + (
            f'# TYPE dynamo_frontend_inflight_requests gauge\ndynamo_frontend_inflight_requests{{model="m"}} {inflight}\n')

    pages = iter([at(10, 2), at(14, 12), at(4, 1)])
    observer = FrontendObserver(["http://frontend"], "m")

    async def scrape(session: object, url: str) -> Page:
        return parse_page(next(pages), "m")

    observer._scrape = scrape  # type: ignore[method-assign]
    await observer.sample(0)
    # A backlog builds: 4 finished, and 10 more in flight than before, so 14 arrived.
    assert (await observer.sample(10)).requests == 14
    # The frontend restarted: its counter starts from zero, and what is in flight arrived since.
    assert (await observer.sample(10)).requests == 5


def test_a_real_frontend_is_observed_over_an_interval(tmp_path, smollm2) -> None:
    deployment = Deployment(tmp_path, smollm2)
    try:
        observer = FrontendObserver([deployment.url], model=MODEL)
        assert asyncio.run(observer.sample(1)).requests == 0  # the starting point
        client = deployment.client()
        for _ in range(3):
            client.chat.completions.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        metrics = asyncio.run(observer.sample(7.5))
        prompt = client.chat.completions.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": "hi"}]).usage.prompt_tokens
        assert metrics.requests == 3 and metrics.interval_s == 7.5
        assert metrics.isl == prompt and metrics.osl == 5
        assert metrics.ttft_ms > 0 and metrics.itl_ms > 0 and metrics.request_duration_s > 0
        assert asyncio.run(FrontendObserver(["http://127.0.0.1:9"]).sample(1)).requests == 0  # nobody there
    finally:
        deployment.stop()


def process_page(process: str, uptime: float, requests: float) -> str:
    return page(requests, 500 * requests, 0.1 * requests) + (
        f'# TYPE tandem_frontend_instance_info gauge\ntandem_frontend_instance_info{{instance="{process}"}} 1.0\n'
        f'# TYPE dynamo_component_system_uptime_seconds gauge\ndynamo_component_system_uptime_seconds {uptime}\n')


def scripted(observer: FrontendObserver, pages: list[str]) -> None:
    """The observer reads `pages` one per scrape instead of asking a frontend."""
    queue = iter(pages)

    async def scrape(session: object, url: str) -> Page:
        return parse_page(next(queue), "m")

    observer._scrape = scrape  # type: ignore[method-assign]


async def test_a_process_started_since_the_last_read_counts_from_zero_whatever_its_counters() -> None:
    observer = FrontendObserver(["http://frontend"], "m")
    # A frontend (process a, up for a day), then its restart b (up 0 s) that has already served 30 requests:
    # more than a's 20, so no counter went down, and still b's are all new.
    scripted(observer, [process_page("a", 86400, 20), process_page("b", 0.0, 30)])
    await observer.sample(0)
    assert (await observer.sample(10)).requests == 30


async def test_another_process_that_ran_before_at_the_same_address_stops_the_planner() -> None:
    observer = FrontendObserver(["http://frontend"], "m")
    scripted(observer, [process_page("a", 86400, 20), process_page("b", 86400, 25)])
    await observer.sample(0)
    with pytest.raises(SharedAddressError, match="http://frontend is served by several processes \\(a, b\\)"):
        await observer.sample(10)


async def test_two_processes_on_one_port_are_each_counted_and_the_shared_address_is_refused(tmp_path, smollm2) -> None:
    """As the chart runs a frontend pod (`--num-processes 2`): 3 requests to one process and 4 to the other are
    7 requests, read from each process at the address it registered in discovery. The port both share is
    refused (by `tandem planner`: exit 2): a scrape there reaches one process, whose counters would be taken for
    the other's."""
    deployment = Deployment(tmp_path, smollm2, frontend_args=["--num-processes", "2"])
    store = make_store("file", file_root=deployment.env["DYN_FILE_KV"])
    await store.start()
    try:
        frontends = DiscoveredFrontends(store, deployment.namespace)
        deadline = time.monotonic() + 30
        while len(registered := await frontends.processes()) < 2:
            assert time.monotonic() < deadline, registered
            await asyncio.sleep(0.1)
        assert deployment.url.split("://")[1] not in "".join(registered.values())  # each its own address
        observer = FrontendObserver(frontends, model=MODEL)
        await observer.sample(0)
        first, second = (openai_over(connection) for connection in pinned(deployment.url).values())
        for client, count in ((first, 3), (second, 4)):
            for n in range(count):
                client.chat.completions.create(model=MODEL, max_tokens=5, messages=[
                    {"role": "user", "content": f"hi {n}"}])
        metrics = await observer.sample(10)
        assert (metrics.requests, metrics.osl, metrics.interval_s) == (7, 5, 10)
        assert observer.workers is not None and observer.workers.decode == 1

        shared = FrontendObserver([deployment.url], model=MODEL)
        with pytest.raises(SharedAddressError, match="is served by several processes"):
            await shared.check()  # scrapes on new connections: the kernel spreads them over both processes
            await shared.sample(0)
            for _ in range(20):  # each interval's scrape is a new connection too: one of them reaches the other
                first.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}])
                await shared.sample(10)
        profiles = tmp_path / "profiles"
        write_profiles(profiles)
        planner = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tandem.planner", "--no-operation", "--frontend-url", deployment.url, "--mode", "agg",
            "--profile-results-dir", str(profiles), "--control-api-port", "0", "--adjustment-interval", "1",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, errors = await asyncio.wait_for(planner.communicate(), timeout=120)
        assert planner.returncode == 2 and f"the frontend at {deployment.url} is served by several processes" in \
            errors.decode()
    finally:
        await store.close()
        deployment.stop()
