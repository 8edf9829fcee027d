"""Several "hosts" on one machine: network namespaces joined by a bridge, each with its own address, so that
a deployment's processes reach each other only through the addresses they advertise. The test process
reaches every host through the bridge's own address. Needs root and iproute2 (`ip`)."""

from __future__ import annotations

import os
import subprocess


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")


class Hosts:
    def __init__(self, names: list[str]) -> None:
        if os.geteuid() != 0:
            raise RuntimeError("the multi-host tests create network namespaces: they need root")
        tag = self.tag = os.getpid() % 10_000
        # A subnet of its own per pytest-xdist worker (gw0, gw1, ...), whatever the pids.
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
        self.subnet = f"10.{200 + worker % 50}.{tag % 250}"
        self.bridge = f"tb{tag}"
        self.gateway = f"{self.subnet}.254"  # the bridge's own address: this machine, as the hosts reach it
        self.netns: dict[str, str] = {}
        self.address: dict[str, str] = {}
        self._links: dict[str, str] = {}  # host -> its veth end on the bridge
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(names, start=1):
                self._add(name, i, tag)
        except BaseException:
            self.remove()
            raise

    def add(self, name: str) -> None:
        """One more host on the bridge (a pod started later)."""
        self._add(name, len(self.netns) + 1, self.tag)

    def _add(self, name: str, i: int, tag: int) -> None:
        netns, outside, inside = f"tandem-{tag}-{name}", f"tv{tag}h{i}", f"tv{tag}n{i}"
        _ip("netns", "add", netns)
        self.netns[name] = netns
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        self._links[name] = outside
        _ip("link", "set", inside, "netns", netns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        self.address[name] = f"{self.subnet}.{i}"
        _ip("addr", "add", f"{self.address[name]}/24", "dev", inside, netns=netns)
        _ip("link", "set", inside, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)

    def cut(self, name: str) -> None:
        """Unplug the host: nothing reaches it or leaves it, and nobody is told."""
        _ip("link", "set", self._links[name], "down")

    def restore(self, name: str) -> None:
        _ip("link", "set", self._links[name], "up")

    def remove(self) -> None:
        for outside in self._links.values():
            subprocess.run(["ip", "link", "del", outside], capture_output=True)
        for netns in self.netns.values():
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
