"""Run a rendered chart's pods on this machine, as a kubelet would, each pod in its own network namespace.

There is no Kubernetes cluster here. What a cluster does between the manifests and the processes is done
here by hand, from the manifests alone:
- a pod is a network namespace with its own address on a bridge (`tests.support.hosts.Hosts`); its containers run
  there, the image's program mapped to the same program on this machine (`Image`);
- env: literal values, `fieldRef` (status.podIP, metadata.name, metadata.namespace) and `secretKeyRef`
  from the release's Secrets or the ones the test creates; `$(VAR)` in command and args is expanded;
- volumes: emptyDir and secret volumes are folders of the pod, hostPath is the path itself; a mount path
  at the start of an argument or env value is replaced by its folder;
- cluster DNS: each pod's /etc/hosts (`ip netns exec` mounts /etc/netns/<pod>/hosts there) names every
  Service (short and full names) with the addresses of the pods it selects, and every StatefulSet pod as
  <pod>.<service>;
- restartPolicy Always: a container that exits is started again after a back-off;
- probes: HTTP GETs on the pod's address, the port resolved by name, as the kubelet sends them;
- the Kubernetes API (`ApiServer`), as much of it as the release's own processes call: the `scale` subresource
  of its Deployments, over HTTPS at the bridge's address (KUBERNETES_SERVICE_HOST and _PORT in every pod),
  each request authenticated by a ServiceAccount's token and authorized by the release's Roles and
  RoleBindings. A pod that names a `serviceAccountName` gets that account's token, the API server's CA and the
  namespace at /var/run/secrets/kubernetes.io/serviceaccount (a mount namespace of its own);
- the Deployment controller: when a Deployment's replicas change (a PATCH of its scale), pods of its template
  are started, or the newest ones deleted (SIGTERM, SIGKILL after the grace period), and the cluster DNS
  follows.
It does not run init containers (they would download models here); a pod that has some is refused.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from secrets import token_hex
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

from tests.support import REPO
from tests.support.hosts import Hosts
from tests.support.k8s import Manifest, of_kind, port_of, selects, workloads

ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"  # where Kubernetes mounts a pod's ServiceAccount
# The pod's own mount namespace, with the account's files where Kubernetes puts them ($0: the pod's folder of them).
MOUNT_ACCOUNT = f'mount -t tmpfs tmpfs /var/run && mkdir -p {ACCOUNT} && cp "$0"/* {ACCOUNT}/ && exec "$@"'


@dataclass(frozen=True)
class Image:
    """An image, as the programs on this machine that stand in for its commands."""

    repository: str
    programs: dict[str, str]  # command[0] in the manifest -> the program here


@dataclass(eq=False)  # each is itself (a pod and its containers refer to each other)
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


@dataclass(eq=False)
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
    """The pods of `docs` running here; `stop()` ends them and removes their namespaces. `api`: the Kubernetes
    API server the pods reach; `replicas`: each Deployment's desired replicas (what its scale says)."""

    def __init__(self, docs: list[Manifest], root: Path, images: list[Image], namespace: str,
                 secrets: dict[str, dict[str, str]] | None = None, source: Path = REPO) -> None:
        """`source`: the tandem checkout the processes import (a git worktree, for a benchmark's baseline)."""
        self.docs = docs
        self.source = source
        self.root = root
        self.namespace = namespace
        self.images = {image.repository: image for image in images}
        self.secrets = {s["metadata"]["name"]: _secret_data(s) for s in of_kind(docs, "Secret")} | (secrets or {})
        for workload in workloads(docs):
            if workload["spec"]["template"]["spec"].get("initContainers"):
                raise ValueError(f"{workload['kind']} {workload['metadata']['name']} has init containers, which "
                                 "this kubelet does not run")
        self.replicas = {d["metadata"]["name"]: int(d["spec"]["replicas"]) for d in of_kind(docs, "Deployment")}
        self.pods: list[Pod] = []
        self._numbered: dict[str, int] = {}  # workload -> pods of it made so far (the next pod's number)
        self._deleted: list[tuple[Pod, threading.Thread]] = []
        self._killed: list[str] = []
        self._stopping = threading.Event()
        self.hosts = Hosts([])
        try:
            self.api = ApiServer(self, root / "apiserver")
            self._start([self._new_pod(w) for w in workloads(docs) for _ in range(w["spec"]["replicas"])])
            self._controller = threading.Thread(target=self._run, daemon=True)
            self._controller.start()
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

    def _new_pod(self, workload: Manifest) -> Pod:
        """A pod of `workload`'s template on a host of its own (its containers not made yet)."""
        kind = workload["metadata"]["name"]
        number = self._numbered.get(kind, 0)
        self._numbered[kind] = number + 1
        name, host = f"{kind}-{number}", f"p{len(self.hosts.netns)}"
        self.hosts.add(host)
        pod_root = self.root / name
        pod_root.mkdir(parents=True)
        return Pod(name, workload, self.hosts.netns[host], self.hosts.address[host], pod_root)

    def _start(self, pods: list[Pod]) -> None:
        """Every pod's containers, once the cluster DNS names them."""
        self.pods = [*self.pods, *pods]
        self._write_dns()
        for pod in pods:
            pod.containers = [self._container(pod, spec) for spec in pod.workload["spec"]["template"]["spec"]["containers"]]
        for pod in pods:
            for container in pod.containers:
                container.start()

    def _delete(self, pods: list[Pod]) -> None:
        """As deleting pods does: out of the Services' DNS, SIGTERM, SIGKILL after the grace period."""
        self.pods = [p for p in self.pods if p not in pods]
        self._write_dns()
        for pod in pods:
            for container in pod.containers:
                container.terminate()
            ending = threading.Thread(target=self._wait_ended, args=(pod, time.monotonic()), daemon=True)
            ending.start()
            self._deleted.append((pod, ending))

    def _wait_ended(self, pod: Pod, terminated: float) -> None:
        """Until the pod's containers exit after their SIGTERM at `terminated` (SIGKILL at the end of the grace
        period: those go to `_killed`)."""
        grace = pod.workload["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        self._killed += [f"{pod.name}/{c.spec['name']}" for c in pod.containers if c.wait(terminated + grace)]
        shutil.rmtree(Path("/etc/netns") / pod.netns, ignore_errors=True)

    def scale(self, deployment: str, replicas: int) -> None:
        """A Deployment's new desired replicas (its scale PATCHed): the controller starts or deletes pods."""
        self.replicas[deployment] = replicas

    def _container(self, pod: Pod, spec: Manifest) -> Container:
        template = pod.workload["spec"]["template"]["spec"]
        mounts = self._mounts(pod, template, spec)
        env = {"PATH": os.environ["PATH"], "HOME": str(pod.root), "LANG": "C.UTF-8", "PYTHONPATH": str(self.source),
               "KUBERNETES_SERVICE_HOST": self.api.host, "KUBERNETES_SERVICE_PORT": str(self.api.port)}
        for variable in spec.get("env", []):
            env[variable["name"]] = _mounted(self._env_value(pod, variable), mounts)
        image = self.images[spec["image"].rsplit(":", 1)[0]]
        command = spec.get("command") or []
        program = image.programs[command[0]]
        argv = [program, *(_mounted(_expand(arg, env), mounts) for arg in [*command[1:], *spec.get("args", [])])]
        account = template.get("serviceAccountName")
        if account and template.get("automountServiceAccountToken", True):
            folder = self.api.account_files(pod.root / "serviceaccount", account)
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", MOUNT_ACCOUNT, str(folder), *argv]
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

    def _run(self) -> None:
        """The Deployment controller and the kubelet's restarts, every 0.2 s."""
        backoff: dict[int, float] = {}
        while not self._stopping.wait(0.2):
            for deployment in of_kind(self.docs, "Deployment"):
                name = deployment["metadata"]["name"]
                running = self.pods_of(name)
                if len(running) < self.replicas[name]:
                    self._start([self._new_pod(deployment) for _ in range(self.replicas[name] - len(running))])
                elif len(running) > self.replicas[name]:
                    self._delete(running[self.replicas[name]:])  # the newest
            for pod in self.pods:
                for container in pod.containers:
                    if container.process is not None and container.process.poll() is not None:
                        due = backoff.setdefault(id(container), time.monotonic() + min(2 ** container.starts, 10))
                        if time.monotonic() >= due and not self._stopping.is_set():
                            backoff.pop(id(container))
                            container.start()

    # -- what a test asks ----------------------------------------------------------------------------------
    def workload(self, workload_name: str) -> Manifest:
        return next(w for w in workloads(self.docs) if w["metadata"]["name"] == workload_name)

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
        Returns the containers that had to be killed, pods deleted earlier included (none, when every process
        shuts down as it should)."""
        self._stopping.set()
        if hasattr(self, "_controller"):
            self._controller.join()  # no pod starts from here on
        pods = self.pods
        for pod in pods:
            for container in pod.containers:
                container.terminate()
        start = time.monotonic()
        for pod in pods:
            self._wait_ended(pod, start)
        for _, ending in self._deleted:
            ending.join()
        self.pods, self._deleted = [], []
        if hasattr(self, "api"):
            self.api.close()
        self.hosts.remove()
        killed, self._killed = self._killed, []
        return killed


@dataclass(frozen=True)
class ApiRequest:
    """A request the API server answered."""

    user: str | None  # system:serviceaccount:<namespace>:<name>; None: no token it knows
    verb: str  # Kubernetes' verb: get, patch, ...
    path: str
    dry_run: bool
    body: Any
    status: int


class ApiServer:
    """The Kubernetes API as the release's processes use it: GET and PATCH (a merge patch of `spec.replicas`,
    or a dry run of one) of its Deployments' `scale` subresource, over HTTPS at the bridge's address. A request
    needs the bearer token of a ServiceAccount (401 otherwise), and a rule of a Role that a RoleBinding of the
    release grants that account (403 otherwise, in the API server's words). `requests`: every answered one."""

    def __init__(self, cluster: LocalCluster, folder: Path) -> None:
        self.cluster = cluster
        self.host = cluster.hosts.gateway
        self.tokens: dict[str, str] = {}  # token -> ServiceAccount
        self.requests: list[ApiRequest] = []
        folder.mkdir(parents=True)
        self.ca, key = folder / "ca.crt", folder / "apiserver.key"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(self.ca), "-days", "1", "-subj", "/CN=kubernetes",
                        "-addext", f"subjectAltName=IP:{self.host}"], check=True, capture_output=True)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.ca, key)
        self._server = ThreadingHTTPServer((self.host, 0), _ApiHandler)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._server.api = self  # type: ignore[attr-defined]
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def account_files(self, folder: Path, account: str) -> Path:
        """The files Kubernetes mounts in a pod of `account`: its token, the API server's CA, the namespace."""
        folder.mkdir(exist_ok=True)
        token = next((t for t, name in self.tokens.items() if name == account), None) or token_hex(16)
        self.tokens[token] = account
        (folder / "token").write_text(token)
        (folder / "ca.crt").write_bytes(self.ca.read_bytes())
        (folder / "namespace").write_text(self.cluster.namespace)
        return folder

    def allows(self, account: str, verb: str, group: str, resource: str, namespace: str, name: str) -> bool:
        """RBAC: a RoleBinding in `namespace` grants `account` a Role with a rule for this request."""
        docs = self.cluster.docs
        if namespace != self.cluster.namespace:
            return False
        roles = {r["metadata"]["name"]: r for r in of_kind(docs, "Role")}
        for binding in of_kind(docs, "RoleBinding"):
            if not any(s["kind"] == "ServiceAccount" and s["name"] == account and s.get("namespace", namespace) ==
                       namespace for s in binding["subjects"]):
                continue
            role = roles.get(binding["roleRef"]["name"]) if binding["roleRef"]["kind"] == "Role" else None
            for rule in (role or {}).get("rules", []):
                if all(wanted in rule.get(key, []) or "*" in rule.get(key, []) for key, wanted in
                       (("apiGroups", group), ("resources", resource), ("verbs", verb))) \
                        and name in rule.get("resourceNames", [name]):
                    return True
        return False

    def answer(self, verb: str, target: str, authorization: str, content_type: str,
               body: Any) -> tuple[int, Manifest]:
        url = urlsplit(target)
        dry_run = parse_qs(url.query).get("dryRun") == ["All"]
        scheme, _, token = authorization.partition(" ")
        account = self.tokens.get(token) if scheme.lower() == "bearer" else None
        user = f"system:serviceaccount:{self.cluster.namespace}:{account}" if account else None
        status, answer = self._answer(account, user, verb, url.path, content_type, body, dry_run)
        self.requests.append(ApiRequest(user, verb, url.path, dry_run, body, status))
        return status, answer

    def _answer(self, account: str | None, user: str | None, verb: str, path: str, content_type: str, body: Any,
                dry_run: bool) -> tuple[int, Manifest]:
        if account is None:
            return _status(401, "Unauthorized", "Unauthorized")
        parts = path.strip("/").split("/")
        # apis apps v1 namespaces {namespace} deployments {name} scale
        if len(parts) != 8 or parts[:4] != ["apis", "apps", "v1", "namespaces"] or parts[5] != "deployments" \
                or parts[7] != "scale":
            return _status(404, "NotFound", "the server could not find the requested resource")
        namespace, name = parts[4], parts[6]
        if not self.allows(account, verb, "apps", "deployments/scale", namespace, name):
            return _status(403, "Forbidden", f'deployments.apps "{name}" is forbidden: User "{user}" cannot {verb} '
                           f'resource "deployments/scale" in API group "apps" in the namespace "{namespace}"')
        if namespace != self.cluster.namespace or name not in self.cluster.replicas:
            return _status(404, "NotFound", f'deployments.apps "{name}" not found')
        if verb == "patch":
            if content_type not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                return _status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: "
                               f"{content_type}")
            replicas = (body or {}).get("spec", {}).get("replicas") if isinstance(body, dict) else None
            if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
                return _status(422, "Invalid", f'Scale.autoscaling "{name}" is invalid: spec.replicas: must be a '
                               "non-negative integer")
            if not dry_run:
                self.cluster.scale(name, replicas)
            answer = replicas
        elif verb == "get":
            answer = self.cluster.replicas[name]
        else:
            return _status(405, "MethodNotAllowed", f"{verb} is not supported on deployments/scale here")
        labels = self.cluster.workload(name)["spec"]["selector"]["matchLabels"]
        return 200, {"kind": "Scale", "apiVersion": "autoscaling/v1",
                     "metadata": {"name": name, "namespace": namespace},
                     "spec": {"replicas": answer},
                     "status": {"replicas": len(self.cluster.pods_of(name)),
                                "selector": ",".join(f"{k}={v}" for k, v in labels.items())}}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _ApiHandler(BaseHTTPRequestHandler):
    server: ThreadingHTTPServer

    def do_GET(self) -> None:
        self._answer("get")

    def do_PATCH(self) -> None:
        self._answer("patch")

    def do_PUT(self) -> None:
        self._answer("update")

    def _answer(self, verb: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        api: ApiServer = self.server.api  # type: ignore[attr-defined]
        status, answer = api.answer(verb, self.path, self.headers.get("Authorization", ""),
                                    self.headers.get("Content-Type", ""), body)
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # `requests` records them


def _status(code: int, reason: str, message: str) -> tuple[int, Manifest]:
    return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
                  "reason": reason, "code": code}


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

