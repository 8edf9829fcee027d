"""The suite's own machinery: engine ordering, the skip guard, and the memory each test engine asks for."""

from __future__ import annotations

import pytest

from tests.support import REPO
from tests.support.engines import GPU_MEMORY_BUDGET, KV_CACHE_BYTES, MAX_ENGINES_AT_ONCE, engine_memory_args
from tests.support.plugins import POOL_UNIT, engine_order, work_units

pytest_plugins = ["pytester"]


def test_users_of_a_group_run_together_and_killers_last() -> None:
    a, b = {"agg"}, {"disagg"}
    tests = [(set(), False), (a, True), (b, False), (set(), False), (a, False), (b, True), (b, False), (a, False)]
    # agg's users move up to its first user (index 1), its killer after them; then disagg's, the same way.
    assert engine_order(tests) == [0, 4, 7, 1, 2, 6, 5, 3]


def test_pool_modules_are_one_unit_first_then_slow_modules() -> None:
    tests = [("a.py", False, False), ("b.py", True, False), ("b.py", False, False), ("c.py", False, True),
             ("a.py", False, False), ("d.py", True, True), ("c.py", False, False)]
    units, order = work_units(tests)
    # b's test without the pool stays with its module's: b's module fixtures start once, on the pool's worker.
    assert units == ["a.py", POOL_UNIT, POOL_UNIT, "c.py", "a.py", POOL_UNIT, "c.py"]
    assert order == [1, 2, 5, 3, 6, 0, 4]


def test_order_keeps_tests_without_engines_in_place() -> None:
    assert engine_order([(set(), False)] * 4) == [0, 1, 2, 3]
    assert engine_order([(set(), True), (set(), False)]) == [0, 1]  # a killer without a group stays put


@pytest.mark.parametrize("engines", [1, 2, 3, MAX_ENGINES_AT_ONCE, 8])
def test_gpu_engines_on_one_device_fit_together(engines: int) -> None:
    flag, value = engine_memory_args(False, engines)
    assert flag == "--gpu-memory-utilization"
    assert engines * float(value) <= GPU_MEMORY_BUDGET < 0.9  # vLLM's own default would not fit twice
    assert float(value) >= GPU_MEMORY_BUDGET / engines - 0.001


def test_cpu_engines_get_a_fixed_kv_cache() -> None:
    # A fraction (--gpu-memory-utilization) would reserve that share of the whole host per engine on CPU.
    assert engine_memory_args(True) == ("--kv-cache-memory-bytes", str(KV_CACHE_BYTES))
    assert MAX_ENGINES_AT_ONCE * KV_CACHE_BYTES <= 4 << 30


def test_memory_args_need_an_engine() -> None:
    with pytest.raises(ValueError):
        engine_memory_args(False, 0)


SUITE = """
import pytest

def test_runs():
    pass

def test_skipped():
    pytest.skip("no such hardware")
"""
CONFTEST = """
from tests.support.plugins import SkipGuard

def pytest_configure(config):
    config.pluginmanager.register(SkipGuard(), SkipGuard.NAME)
"""


def test_a_skip_fails_the_run_unless_allowed(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(SUITE)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.delenv("TANDEM_ALLOW_SKIPS", raising=False)
    refused = pytester.runpytest_subprocess("-rs")
    assert refused.ret == pytest.ExitCode.TESTS_FAILED
    refused.stdout.fnmatch_lines(["*1 test(s) skipped, which fails the run*", "*no such hardware*"])
    monkeypatch.setenv("TANDEM_ALLOW_SKIPS", "1")
    assert pytester.runpytest_subprocess("-rs").ret == pytest.ExitCode.OK
