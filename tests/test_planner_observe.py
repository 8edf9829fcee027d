"""The planner's view of traffic: interval means from the differences of the frontends' cumulative
metrics, added over frontends, with a restarted frontend's series counted from zero; and the same read
from a real frontend serving the test engine."""

from __future__ import annotations

import asyncio
import math

import pytest

from tandem.planner.observe import FrontendObserver, Page, Totals, parse_page
from tests.deployment import MODEL, Deployment

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
