"""The suite's own pytest plugins (registered in tests/conftest.py)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest


def engine_order(tests: list[tuple[set[str], bool]]) -> list[int]:
    """The order to run tests in, given each one's engine groups and whether it kills an engine.

    The users of a group run together where its first user is (so few engines are alive at once), those
    that kill an engine after the others; every other test keeps its place."""
    first: dict[str, int] = {}
    for index, (groups, _) in enumerate(tests):
        for name in sorted(groups):
            first.setdefault(name, index)

    def place(index: int) -> tuple[int, bool, int]:
        groups, kills = tests[index]
        return min((first[name] for name in groups), default=index), kills, index

    return sorted(range(len(tests)), key=place)


def _groups(item: pytest.Item) -> set[str]:
    return {name for marker in item.iter_markers("engines") for name in marker.args}


POOL_UNIT = "engine-pool"


def work_units(tests: list[tuple[str, bool, bool]]) -> tuple[list[str], list[int]]:
    """Given each test's module, whether it uses the session's engine pool and whether it is slow: the unit of
    work a pytest-xdist worker takes whole, and the order to hand the tests out in.

    Every module with a test on the engine pool is one unit, so that the pool's engines start once, on one
    worker; every other module is a unit of its own, so that its module fixtures start once. The pool's
    unit comes first, then the modules with slow tests, then the rest: the longest units start first and the
    short ones fill the gaps at the end. Within a rank the tests keep their order."""
    pooled = {module for module, pool, _ in tests if pool}
    slow = {module for module, _, is_slow in tests if is_slow}
    units = [POOL_UNIT if module in pooled else module for module, _, _ in tests]

    def rank(index: int) -> tuple[int, int]:
        module = tests[index][0]
        return (0 if module in pooled else 1 if module in slow else 2), index

    return units, sorted(range(len(tests)), key=rank)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def _uses_pool(item: pytest.Item) -> bool:
    return bool(_groups(item)) or "engine_pool" in getattr(item, "fixturenames", ())


UNITS_ENV = "TANDEM_TEST_UNITS"  # the file where xdist workers leave each test's unit for the controller


def _write_units(path: str, items: list[pytest.Item], units: list[str]) -> None:
    """Each test's unit, for the controller's scheduler (`unit_scheduler`); every worker collects the same
    tests, so any whole file will do."""
    temporary = f"{path}.{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(dict(zip((item.nodeid for item in items), units, strict=True)), f)
    os.replace(temporary, path)


def unit_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling (a scope goes whole to one worker, the next scope to the first idle worker)
    with the units the workers wrote as scopes."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        units: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.units is None:  # read once every worker finished collecting
                with open(os.environ[UNITS_ENV]) as f:
                    self.units = json.load(f)
            return self.units[nodeid]

    config.option.loadscopereorder = False  # the units go out in collection order (EngineOrder's), not by size
    return UnitScheduling(config, log)


class EngineOrder:
    """Orders the tests by `engine_order`, then by `work_units` (whose units an xdist worker writes for the
    controller, in UNITS_ENV), and stops each engine group right after its last user."""

    NAME = "tandem-engine-order"

    def __init__(self) -> None:
        self.pool: Any = None  # the session's EnginePool once a test asked for it
        self.last_users: dict[str, str] = {}  # node id -> the group it is the last user of

    @pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture parameters and after -k/-m
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        order = engine_order([(_groups(item), item.get_closest_marker("kills_engine") is not None)
                              for item in items])
        items[:] = [items[index] for index in order]
        units, order = work_units([(_module(item), _uses_pool(item), item.get_closest_marker("slow") is not None)
                                   for item in items])
        # An xdist worker tells the controller each test's unit (not a pytester run inside one).
        if os.environ.get(UNITS_ENV) and hasattr(config, "workerinput"):
            _write_units(os.environ[UNITS_ENV], items, units)
        items[:] = [items[index] for index in order]
        last = {name: item for item in items for name in _groups(item)}
        self.last_users = {item.nodeid: name for name, item in last.items()}

    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        name = self.last_users.get(item.nodeid)
        if name is not None and self.pool is not None:
            self.pool.release(name)


class SkipGuard:
    """A skipped test fails the run: a skip is how a broken vLLM or NIXL upgrade would hide. Set
    TANDEM_ALLOW_SKIPS=1 where skips are expected (the reasons print anyway: `-rs`)."""

    NAME = "tandem-skip-guard"

    def __init__(self) -> None:
        self.skipped: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped:
            self.skipped.append(report.nodeid)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.skipped and os.environ.get("TANDEM_ALLOW_SKIPS") != "1" and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            print(f"\n{len(self.skipped)} test(s) skipped, which fails the run (TANDEM_ALLOW_SKIPS=1 allows it): "
                  + ", ".join(self.skipped))
