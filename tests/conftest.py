"""The suite's fixtures and pytest hooks; the helpers they use live in tests/support/."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.runtime import DistributedRuntime
from tests.support.launcher import Run
from tests.support.plugins import UNITS_ENV, EngineOrder, SkipGuard, unit_scheduler
from tests.support.processes import WorkerProcess
from tests.support.runtimes import runtime_config
from tests.support.servers import EtcdServer, NatsServer, for_session


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The real SmolLM2-135M-Instruct folder (prepared once, then cached)."""
    from tandem.models import prepare_model

    return str(prepare_model())


@pytest.fixture(scope="session")
def vlm_folder(tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> str:
    """The tiny vision-language model's text side (no weights): what a frontend, the mocker and the test engine
    read of it (tests/support/vision_model.py)."""
    from tests.support.vision_model import build_text_side

    folder = tmp_path_factory.mktemp("vlm-text")
    build_text_side(folder, Path(smollm2))
    return str(folder)


@pytest.fixture(scope="module")
def images() -> Iterator[str]:
    """A loopback HTTP server of one-colour PNGs, /<colour>.png (tests/support/images.py); its base URL."""
    from tests.support.images import png_server

    with png_server() as url:
        yield url


@pytest.fixture(scope="session")
def tok(smollm2: str):  # type: ignore[no-untyped-def]
    from tandem.llm.tokenizer import Tokenizer

    return Tokenizer.from_folder(smollm2)


@pytest.fixture
async def runtimes():
    """Factory of started runtimes, all shut down at the end of the test."""
    made: list[DistributedRuntime] = []

    async def make(**overrides: object) -> DistributedRuntime:
        runtime = await DistributedRuntime.create(runtime_config(**overrides))
        made.append(runtime)
        return runtime

    yield make
    for runtime in made:
        await runtime.shutdown()


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def file_kv(tmp_path: Path) -> str:
    root = tmp_path / "kv"
    root.mkdir()
    return str(root)


@pytest.fixture
def workers(file_kv: str, namespace: str) -> Iterator:
    started: list[WorkerProcess] = []

    def start(*extra: str, env: dict[str, str] | None = None) -> WorkerProcess:
        worker = WorkerProcess(file_kv, namespace, *extra, env=env)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture
def launch(smollm2: str) -> Iterator:
    """`tandem run` with mocker workers, 100x faster than the timing model's real time."""
    started: list[Run] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Run:
        worker_args = ["--speedup-ratio", "100"]
        if "--" in args:
            split = args.index("--")
            args, worker_args = args[:split], worker_args + list(args[split + 1:])
        run = Run("--model", smollm2, "--engine", "mocker", *args, "--", *worker_args, env=env)
        started.append(run)
        return run

    yield start
    for run in started:
        run.kill()


# -- real vLLM engines shared by the session (tests/support/engines.py), the suite's own plugins
# (tests/support/plugins.py)
def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(EngineOrder(), EngineOrder.NAME)
    config.pluginmanager.register(SkipGuard(), SkipGuard.NAME)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):  # xdist's controller
        import tempfile

        os.environ[UNITS_ENV] = os.path.join(tempfile.mkdtemp(prefix="tandem-test-units-"), "units.json")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and UNITS_ENV in os.environ:
        import shutil

        shutil.rmtree(os.path.dirname(os.environ.pop(UNITS_ENV)), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return unit_scheduler(config, log)


@pytest.fixture(scope="session")
def engine_pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> Iterator:
    from tests.support.engines import EnginePool

    pool = EnginePool(tmp_path_factory.mktemp, smollm2, tmp_path_factory.mktemp("loras"))
    order = request.config.pluginmanager.get_plugin(EngineOrder.NAME)
    order.pool = pool
    yield pool
    order.pool = None
    pool.stop()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    yield from for_session(NatsServer(tmp_path_factory.mktemp("nats")))


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    yield from for_session(EtcdServer(tmp_path_factory.mktemp("etcd")))


@pytest.fixture
def nats(nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> NatsServer:
    """The session's NATS server, running (a test may have stopped it); NATS_SERVER points at it."""
    if not nats_server.running:
        nats_server.start()
    monkeypatch.setenv("NATS_SERVER", nats_server.url)
    return nats_server


@pytest.fixture
def etcd(etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> EtcdServer:
    """The session's etcd, running and empty; ETCD_ENDPOINTS points at it."""
    if not etcd_server.running:
        etcd_server.start()
    etcd_server.wipe()
    monkeypatch.setenv("ETCD_ENDPOINTS", etcd_server.url)
    return etcd_server


@pytest.fixture(params=["mem", "file", "etcd"])
async def make_store(request, tmp_path):
    """Stores of one discovery backend (mem, file, etcd): each call is another process's store."""
    from tandem.runtime.discovery import EtcdStore, FileStore, MemoryStore
    from tandem.runtime.discovery.etcd import EtcdConfig
    from tandem.runtime.discovery.mem import _Table

    stores = []
    table = _Table()
    etcd = request.getfixturevalue("etcd") if request.param == "etcd" else None

    async def make(**options):
        if request.param == "mem":
            store = MemoryStore(table)
        elif etcd is not None:
            store = EtcdStore(EtcdConfig([etcd.url]), **options)
        else:
            store = FileStore(str(tmp_path / "kv"), poll_interval=0.02, **options)
        await store.start()
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()
