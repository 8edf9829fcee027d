"""Run a rendered chart's pods on this machine, as a kubelet would, each pod in its own network namespace.

There is no Kubernetes cluster here. What a cluster does between the manifests and the processes is done
here by hand, from the manifests alone:
- a pod is a network namespace with its own address on a bridge (`tests.hosts.Hosts`); its containers run
  there, the image's program mapped to the same program on this machine (`Image`);
- env: literal values, `fieldRef` (status.podIP, metadata.name, metadata.namespace) and `secretKeyRef`
  from the release's Secrets or the ones the test creates; `$(VAR)` in command and args is expanded;
- volumes: emptyDir and secret volumes are folders of the pod, hostPath is the path itself; a mount path
  at the start of an argument or env value is replaced by its folder;
- cluster DNS: each pod's /etc/hosts (`ip netns exec` mounts /etc/netns/<pod>/hosts there) names every
  Service (short and full names) with the addresses of the pods it selects, and every StatefulSet pod as
  <pod>.<service>;
- restartPolicy Always: a container that exits is started again after a back-off;
- probes: HTTP GETs on the pod's address, the port resolved by name, as the kubelet sends them.
It does not run init containers (they would download models here); a pod that has some is refused.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.hosts import Hosts
from tests.k8s import Manifest, of_kind, port_of, selects, workloads

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Image:
    """An image, as the programs on this machine that stand in for its commands."""

    repository: str
    programs: dict[str, str]  # command[0] in the manifest -> the program here


@dataclass
class Container:
    pod: Pod
    spec: Manifest
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> None:
        self.starts += 1
        out = open(self.log, "ab")
        self.process = subprocess.Popen(["ip", "netns", "exec", self.pod.netns, *self.argv], env=self.env,
                                        cwd=self.pod.root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)

    def wait(self, deadline: float) -> bool:
        """Until the process exits; SIGKILL at `deadline` (the end of the grace period), as the kubelet does.
        True when it had to be killed."""
        if self.process is None:
            return False
        try:
            self.process.wait(max(deadline - time.monotonic(), 0))
            return False
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            return True

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


@dataclass
class Pod:
    name: str
    workload: Manifest
    netns: str
    ip: str
    root: Path
    containers: list[Container] = field(default_factory=list)

    @property
    def labels(self) -> dict[str, str]:
        return self.workload["spec"]["template"]["metadata"]["labels"]

    def probe(self, kind: str) -> bool:
        """Every container's `kind` probe passes (a container without one passes)."""
        for container in self.containers:
            probe = container.spec.get(kind)
            if probe is None:
                continue
            get = probe["httpGet"]
            port = port_number(container.spec, get["port"])
            scheme = get.get("scheme", "HTTP").lower()
            try:
                status = httpx.get(f"{scheme}://{self.ip}:{port}{get['path']}", timeout=probe.get("timeoutSeconds", 1),
                                   verify=False).status_code
            except httpx.HTTPError:
                return False
            if not 200 <= status < 400:
                return False
        return True


def port_number(container: Manifest, port: int | str) -> int:
    number = port_of(container, port)
    if number is None:
        raise LookupError(f"container {container['name']} has no port {port}")
    return number


class LocalCluster:
    """The pods of `docs` running here; `stop()` ends them and removes their namespaces."""

    def __init__(self, docs: list[Manifest], root: Path, images: list[Image], namespace: str,
                 secrets: dict[str, dict[str, str]] | None = None, source: Path = REPO) -> None:
        """`source`: the tandem checkout the processes import (a git worktree, for a benchmark's baseline)."""
        self.docs = docs
        self.source = source
        self.root = root
        self.namespace = namespace
        self.images = {image.repository: image for image in images}
        self.secrets = {s["metadata"]["name"]: _secret_data(s) for s in of_kind(docs, "Secret")} | (secrets or {})
        planned = [(f"{w['metadata']['name']}-{i}", w) for w in workloads(docs) for i in range(w["spec"]["replicas"])]
        for name, workload in planned:
            if workload["spec"]["template"]["spec"].get("initContainers"):
                raise ValueError(f"pod {name} has init containers, which this kubelet does not run")
        self.hosts = Hosts([f"p{i}" for i in range(len(planned))])
        self.pods: list[Pod] = []
        self._stopping = threading.Event()
        try:
            for i, (name, workload) in enumerate(planned):
                pod_root = root / name
                pod_root.mkdir(parents=True)
                self.pods.append(Pod(name, workload, self.hosts.netns[f"p{i}"], self.hosts.address[f"p{i}"], pod_root))
            self._write_dns()
            for pod in self.pods:
                for spec in pod.workload["spec"]["template"]["spec"]["containers"]:
                    pod.containers.append(self._container(pod, spec))
            for pod in self.pods:
                for container in pod.containers:
                    container.start()
            self._restarter = threading.Thread(target=self._restart_exited, daemon=True)
            self._restarter.start()
        except BaseException:
            self.stop()
            raise

    # -- what the cluster would do -------------------------------------------------------------------------
    def _write_dns(self) -> None:
        names: dict[str, list[str]] = {}
        for service in of_kind(self.docs, "Service"):
            name = service["metadata"]["name"]
            chosen = [p for p in self.pods if selects(service["spec"]["selector"], p.labels)]
            for alias in (name, f"{name}.{self.namespace}", f"{name}.{self.namespace}.svc",
                          f"{name}.{self.namespace}.svc.cluster.local"):
                names[alias] = [p.ip for p in chosen]
        for pod in self.pods:
            governing = pod.workload["spec"].get("serviceName")
            if governing:
                for alias in (f"{pod.name}.{governing}", f"{pod.name}.{governing}.{self.namespace}.svc.cluster.local"):
                    names[alias] = [pod.ip]
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        lines += [f"{ip} {alias}" for alias, ips in names.items() for ip in ips]
        for pod in self.pods:
            folder = Path("/etc/netns") / pod.netns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join([*lines, f"{pod.ip} {pod.name}"]) + "\n")

    def _container(self, pod: Pod, spec: Manifest) -> Container:
        template = pod.workload["spec"]["template"]["spec"]
        mounts = self._mounts(pod, template, spec)
        env = {"PATH": os.environ["PATH"], "HOME": str(pod.root), "LANG": "C.UTF-8", "PYTHONPATH": str(self.source)}
        for variable in spec.get("env", []):
            env[variable["name"]] = _mounted(self._env_value(pod, variable), mounts)
        image = self.images[spec["image"].rsplit(":", 1)[0]]
        command = spec.get("command") or []
        program = image.programs[command[0]]
        argv = [program, *(_mounted(_expand(arg, env), mounts) for arg in [*command[1:], *spec.get("args", [])])]
        return Container(pod, spec, argv, env, pod.root / f"{spec['name']}.log")

    def _env_value(self, pod: Pod, variable: Manifest) -> str:
        if "value" in variable:
            return str(variable["value"])
        source = variable["valueFrom"]
        if "fieldRef" in source:
            return {"status.podIP": pod.ip, "metadata.name": pod.name,
                    "metadata.namespace": self.namespace}[source["fieldRef"]["fieldPath"]]
        ref = source["secretKeyRef"]
        try:
            return self.secrets[ref["name"]][ref["key"]]
        except KeyError:
            raise LookupError(f"pod {pod.name}: Secret {ref['name']} has no key {ref['key']}") from None

    def _mounts(self, pod: Pod, template: Manifest, spec: Manifest) -> dict[str, str]:
        volumes = {v["name"]: v for v in template.get("volumes", [])}
        mounts: dict[str, str] = {}
        for mount in spec.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "hostPath" in volume:
                folder = Path(volume["hostPath"]["path"])
            else:
                folder = pod.root / "volumes" / mount["name"]
                folder.mkdir(parents=True, exist_ok=True)
                if "secret" in volume:
                    for key, value in self.secrets[volume["secret"]["secretName"]].items():
                        (folder / key).write_text(value)
                elif "emptyDir" not in volume:
                    raise ValueError(f"pod {pod.name}: volume {mount['name']} is of a kind this kubelet does not make")
            mounts[mount["mountPath"]] = str(folder)
        return mounts

    def _restart_exited(self) -> None:
        backoff: dict[int, float] = {}
        while not self._stopping.wait(0.2):
            for pod in self.pods:
                for container in pod.containers:
                    if container.process is not None and container.process.poll() is not None:
                        due = backoff.setdefault(id(container), time.monotonic() + min(2 ** container.starts, 10))
                        if time.monotonic() >= due and not self._stopping.is_set():
                            backoff.pop(id(container))
                            container.start()

    # -- what a test asks ----------------------------------------------------------------------------------
    def pods_of(self, workload_name: str) -> list[Pod]:
        return [p for p in self.pods if p.workload["metadata"]["name"] == workload_name]

    def wait_ready(self, timeout: float) -> None:
        """Until every pod passes its startup and readiness probes (and its liveness probe)."""
        deadline = time.monotonic() + timeout
        waiting = list(self.pods)
        while waiting:
            waiting = [p for p in waiting if not all(p.probe(kind) for kind in
                                                     ("startupProbe", "readinessProbe", "livenessProbe"))]
            if waiting and time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}/{c.spec['name']} (started {c.starts}x):\n{c.tail()}"
                                 for p in waiting for c in p.containers)
                raise TimeoutError(f"not ready within {timeout:g} s: {[p.name for p in waiting]}\n{logs}")
            time.sleep(0.25)

    def service_url(self, name: str, port_name: str, scheme: str = "http") -> str:
        """Where a client of the Service reaches it: a selected pod's address and the target port."""
        service = next(s for s in of_kind(self.docs, "Service") if s["metadata"]["name"] == name)
        port = next(p for p in service["spec"]["ports"] if p["name"] == port_name)
        pod = next(p for p in self.pods if selects(service["spec"]["selector"], p.labels))
        number = next(n for c in pod.containers if (n := port_of(c.spec, port["targetPort"])) is not None)
        return f"{scheme}://{pod.ip}:{number}"

    def restarts(self) -> dict[str, int]:
        return {f"{p.name}/{c.spec['name']}": c.starts - 1 for p in self.pods for c in p.containers}

    def stop(self) -> list[str]:
        """Every pod at once, as deleting the release does: SIGTERM, then SIGKILL after the pod's grace period.
        Returns the containers that had to be killed (none, when every process shuts down as it should)."""
        self._stopping.set()
        pods = getattr(self, "pods", [])
        for pod in pods:
            for container in pod.containers:
                container.terminate()
        start = time.monotonic()
        killed = []
        for pod in pods:
            grace = pod.workload["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
            killed += [f"{pod.name}/{c.spec['name']}" for c in pod.containers if c.wait(start + grace)]
            shutil.rmtree(Path("/etc/netns") / pod.netns, ignore_errors=True)
        self.pods = []
        if hasattr(self, "hosts"):
            self.hosts.remove()
        return killed


def _secret_data(secret: Manifest) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return data | (secret.get("stringData") or {})


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command and args ($$ escapes; an unknown name stays as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _mounted(text: str, mounts: dict[str, str]) -> str:
    for mount_path, folder in sorted(mounts.items(), key=lambda item: -len(item[0])):
        if text == mount_path or text.startswith(mount_path.rstrip("/") + "/"):
            return folder + text[len(mount_path):]
    return text


def venv_program(name: str) -> str:
    """A program of this venv (where scripts/install.sh puts the servers), else on PATH."""
    path = Path(sys.prefix) / "bin" / name
    return str(path) if path.exists() else (shutil.which(name) or name)

