"""The planner's connectors to deployments it does not run itself.

- Kubernetes: the official `kubernetes` client against a fake API server (aiohttp on loopback) that serves the
  `scale` subresource of Deployments and records every PATCH. No live cluster is involved. `tandem planner
  --environment kubernetes` also runs as a process logged in as in a pod: `KUBERNETES_SERVICE_HOST` and
  `_PORT` name the fake server (HTTPS), and the ServiceAccount's token, CA and namespace files are where
  Kubernetes mounts them, in a mount namespace of the planner's own (needs root).
- Virtual: decisions and acknowledgements through the discovery store, file and etcd (a real server), between
  the planner's `VirtualConnector` and an orchestrator's `VirtualConnectorClient`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import sys
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from tandem.planner.kubernetes import (
    KubernetesConnector,
    KubernetesError,
    chart_deployments,
    chart_fullname,
    parse_kubernetes_args,
)
from tandem.planner.sla import Replicas
from tandem.planner.virtual import (
    PlannerDecision,
    VirtualConnector,
    VirtualConnectorClient,
    ack_key,
    decision_key,
)
from tandem.runtime.config import ConfigError

NAMESPACE = "serving"
SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"


# -- a fake Kubernetes API server ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: object
    authorization: str | None


@dataclass
class FakeApiServer:
    """The `scale` subresource of the Deployments in `replicas` (name -> spec.replicas) of namespace `serving`.
    `forbidden` holds (verb, name) pairs answered 403 as RBAC would; a dry-run PATCH changes nothing."""

    replicas: dict[str, int]
    forbidden: set[tuple[str, str]] = field(default_factory=set)
    failing: set[tuple[str, str]] = field(default_factory=set)  # answered 500
    requests: list[Request] = field(default_factory=list)
    url: str = ""
    tls: tuple[Path, Path] | None = None  # (certificate, key): serve HTTPS, as a real API server does
    token: str | None = None  # the bearer token it accepts; any other is answered 401, as a real server does

    @property
    def patches(self) -> list[Request]:
        """The PATCHes that changed something (not dry runs)."""
        return [r for r in self.requests if r.method == "PATCH" and r.query.get("dryRun") != "All"]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*self.tls)
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        self.port = self.runner.addresses[0][1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        await self.runner.cleanup()

    def scale(self, namespace: str, name: str) -> dict:
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": name, "namespace": namespace, "resourceVersion": "1"},
                "spec": {"replicas": self.replicas[name]},
                "status": {"replicas": self.replicas[name], "selector": f"app.kubernetes.io/name={name}"}}

    @staticmethod
    def status(code: int, reason: str, message: str) -> web.Response:
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                  "message": message, "reason": reason, "code": code}, status=code)

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        self.requests.append(Request(request.method, request.path, dict(request.query),
                                     request.headers.get("Content-Type", ""), body,
                                     request.headers.get("Authorization")))
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if self.token is not None and (scheme.lower(), token) != ("bearer", self.token):
            return self.status(401, "Unauthorized", "Unauthorized")
        parts = request.path.strip("/").split("/")
        # apis apps v1 namespaces {ns} deployments {name} scale
        if len(parts) != 8 or parts[:4] != ["apis", "apps", "v1", "namespaces"] or parts[5] != "deployments" \
                or parts[7] != "scale" or request.method not in ("GET", "PATCH"):
            return self.status(404, "NotFound", "the server could not find the requested resource")
        namespace, name = parts[4], parts[6]
        verb = request.method.lower()
        if (verb, name) in self.forbidden:
            return self.status(403, "Forbidden", f'deployments.apps "{name}" is forbidden: User '
                               f'"system:serviceaccount:{namespace}:llm-tandem-planner" cannot {verb} resource '
                               f'"deployments/scale" in API group "apps" in the namespace "{namespace}"')
        if (verb, name) in self.failing:
            return self.status(500, "InternalError", "etcdserver: request timed out")
        if namespace != NAMESPACE or name not in self.replicas:
            return self.status(404, "NotFound", f'deployments.apps "{name}" not found')
        if verb == "patch":
            if request.headers.get("Content-Type") != "application/merge-patch+json":
                return self.status(415, "UnsupportedMediaType", "this test server takes merge patches only")
            if request.query.get("dryRun") != "All":
                self.replicas[name] = int(body["spec"]["replicas"])
        return web.json_response(self.scale(namespace, name))


@pytest.fixture
async def api_server():
    servers: list[FakeApiServer] = []

    async def start(replicas: dict[str, int], **options: object) -> FakeApiServer:
        server = FakeApiServer(dict(replicas), **options)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


def client_for(server: FakeApiServer):
    from kubernetes import client

    configuration = client.Configuration(host=server.url)
    configuration.retries = False
    return client.ApiClient(configuration)


def write_kubeconfig(path: Path, server: FakeApiServer, namespace: str | None = NAMESPACE) -> Path:
    context = {"cluster": "fake", "user": "planner", **({"namespace": namespace} if namespace else {})}
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
        "users": [{"name": "planner", "user": {"token": "planner-token"}}],
        "contexts": [{"name": "fake", "context": context}]}))
    return path


@pytest.fixture(autouse=True)
def outside_a_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KUBERNETES_SERVICE_HOST", "KUBECONFIG", "POD_NAMESPACE", "TANDEM_HELM_RELEASE",
                 "TANDEM_PREFILL_DEPLOYMENT", "TANDEM_DECODE_DEPLOYMENT", "TANDEM_WORKER_DEPLOYMENT"):
        monkeypatch.delenv(name, raising=False)


def scale_path(name: str) -> str:
    return SCALE_PATH.format(ns=NAMESPACE, name=name)


# -- Kubernetes --------------------------------------------------------------------------------------------------

async def test_disaggregated_pools_are_read_and_patched_through_the_scale_subresource(api_server) -> None:
    server = await api_server({"llm-tandem-prefill": 1, "llm-tandem-decode": 2, "llm-tandem-frontend": 1})
    connector = KubernetesConnector(NAMESPACE, prefill="llm-tandem-prefill", decode="llm-tandem-decode",
                                    api_client=client_for(server))
    # The start-up check reads each scale and dry-runs a PATCH of it: nothing changes.
    assert await connector.check() == Replicas(1, 2)
    dry_runs = [r for r in server.requests if r.method == "PATCH"]
    assert {(r.path, r.query.get("dryRun"), json.dumps(r.body)) for r in dry_runs} == {
        (scale_path("llm-tandem-prefill"), "All", '{"spec": {"replicas": 1}}'),
        (scale_path("llm-tandem-decode"), "All", '{"spec": {"replicas": 2}}')}
    assert server.patches == []

    await connector.scale(Replicas(2, 3))
    assert sorted((r.method, r.path, r.content_type, json.dumps(r.body)) for r in server.patches) == [
        ("PATCH", scale_path("llm-tandem-decode"), "application/merge-patch+json", '{"spec": {"replicas": 3}}'),
        ("PATCH", scale_path("llm-tandem-prefill"), "application/merge-patch+json", '{"spec": {"replicas": 2}}')]
    assert await connector.replicas() == Replicas(2, 3)
    assert server.replicas == {"llm-tandem-prefill": 2, "llm-tandem-decode": 3, "llm-tandem-frontend": 1}
    assert connector.startup_seconds() is None
    connector.close()


async def test_aggregated_mode_scales_only_the_worker_deployment_named_from_the_release(api_server, tmp_path) -> None:
    """Configured as `tandem planner` would be: flags, and a kubeconfig (its token is sent; its context names the
    namespace)."""
    server = await api_server({"llm-tandem-worker": 1, "llm-tandem-frontend": 2})
    args = parse_kubernetes_args(["--helm-release", "llm", "--kubeconfig",
                                  str(write_kubeconfig(tmp_path / "config", server))])
    connector = KubernetesConnector.from_args(args, "agg")
    assert connector.namespace == NAMESPACE and connector.deployments == ["llm-tandem-worker"]
    assert await connector.replicas() == Replicas(0, 1)  # the workers of an aggregated deployment count as decode
    await connector.scale(Replicas(0, 3))
    assert [(r.path, json.dumps(r.body)) for r in server.patches] == [
        (scale_path("llm-tandem-worker"), '{"spec": {"replicas": 3}}')]
    assert await connector.replicas() == Replicas(0, 3)
    assert server.replicas["llm-tandem-frontend"] == 2
    assert {r.authorization for r in server.requests} == {"Bearer planner-token"}
    connector.close()


def test_deployment_names_follow_the_chart_and_the_flags(tmp_path, monkeypatch) -> None:
    assert chart_fullname("llm") == "llm-tandem" and chart_fullname("tandem-prod") == "tandem-prod"
    assert chart_deployments("llm", "disagg") == ("llm-tandem-prefill", "llm-tandem-decode")
    assert chart_deployments("llm", "decode") == (None, "llm-tandem-decode")
    assert chart_deployments("my-tandem", "agg") == (None, "my-tandem-worker")
    config = str(write_kubeconfig(tmp_path / "config", FakeApiServer({}, url="http://127.0.0.1:9"), namespace=None))
    connector = KubernetesConnector.from_args(parse_kubernetes_args(
        ["--prefill-deployment", "p", "--decode-deployment", "d", "--kubeconfig", config]), "disagg")
    assert (connector.deployments, connector.namespace) == (["p", "d"], "default")
    monkeypatch.setenv("POD_NAMESPACE", "elsewhere")
    monkeypatch.setenv("TANDEM_HELM_RELEASE", "llm")
    connector = KubernetesConnector.from_args(parse_kubernetes_args(["--kubeconfig", config]), "prefill")
    assert (connector.deployments, connector.namespace) == (["llm-tandem-prefill"], "elsewhere")
    for argv, mode, reason in ((["--kubeconfig", config], "disagg", "--prefill-deployment NAME and --decode-deployment"),
                               (["--decode-deployment", "d", "--kubeconfig", config], "agg", "give --worker-deployment"),
                               (["--helm-release", "llm", "--kubeconfig", str(tmp_path / "none")], "agg",
                                "no Kubernetes credentials from kubeconfig")):
        monkeypatch.delenv("TANDEM_HELM_RELEASE")
        with pytest.raises(ConfigError, match=reason):
            KubernetesConnector.from_args(parse_kubernetes_args(argv), mode)
        monkeypatch.setenv("TANDEM_HELM_RELEASE", "llm")


async def test_a_missing_deployment_is_a_config_error_naming_it(api_server) -> None:
    server = await api_server({"llm-tandem-prefill": 1})
    connector = KubernetesConnector(NAMESPACE, prefill="llm-tandem-prefill", decode="llm-tandem-decode",
                                    api_client=client_for(server))
    with pytest.raises(ConfigError) as refused:
        await connector.check()
    assert ("Deployment llm-tandem-decode (the decode workers) in namespace serving does not exist "
            '(deployments.apps "llm-tandem-decode" not found)') in str(refused.value)
    assert server.patches == []


@pytest.mark.parametrize("verb", ["get", "patch"])
async def test_a_forbidden_scale_is_a_config_error_naming_the_permission(api_server, verb: str) -> None:
    server = await api_server({"llm-tandem-worker": 1}, forbidden={(verb, "llm-tandem-worker")})
    connector = KubernetesConnector(NAMESPACE, decode="llm-tandem-worker", aggregated=True,
                                    api_client=client_for(server))
    with pytest.raises(ConfigError) as refused:
        await connector.replicas()  # checks first
    message = str(refused.value)
    assert f"the planner may not {verb} deployments/scale of Deployment llm-tandem-worker (the worker workers)" \
        in message
    assert "needs a Role with verbs get and patch on resource deployments/scale of API group apps" in message
    assert f'cannot {verb} resource "deployments/scale"' in message  # the API server's own words
    assert server.patches == []


async def test_an_api_error_while_scaling_is_raised_for_the_loop_to_log(api_server) -> None:
    server = await api_server({"llm-tandem-prefill": 1, "llm-tandem-decode": 1})
    connector = KubernetesConnector(NAMESPACE, prefill="llm-tandem-prefill", decode="llm-tandem-decode",
                                    api_client=client_for(server))
    await connector.check()
    server.failing.add(("patch", "llm-tandem-decode"))
    with pytest.raises(KubernetesError, match="patch deployments/scale of Deployment llm-tandem-decode .* failed: "
                                              "500 etcdserver: request timed out"):
        await connector.scale(Replicas(2, 2))
    server.failing.clear()
    await connector.scale(Replicas(2, 2))  # the next interval
    assert await connector.replicas() == Replicas(2, 2)
    await server.stop()
    with pytest.raises(KubernetesError, match="cannot reach the Kubernetes API server"):
        await connector.replicas()


# -- tandem planner --environment kubernetes, logged in as in a pod -----------------------------------------------

ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"  # where Kubernetes mounts a pod's ServiceAccount
TOKEN = "in-cluster-token"


def service_account(root: Path, token: str = TOKEN, ca: bool = True) -> tuple[Path, Path, Path]:
    """A ServiceAccount's files as Kubernetes mounts them (token, ca.crt, namespace), and the API server's
    certificate and key (for 127.0.0.1, its own authority): (account folder, certificate, key)."""
    from tests.runtime.test_discovery import _self_signed

    account = root / "serviceaccount"
    account.mkdir(parents=True)
    cert, key = _self_signed(root, "apiserver")
    (account / "token").write_text(token)
    (account / "namespace").write_text(NAMESPACE)
    if ca:
        (account / "ca.crt").write_bytes(cert.read_bytes())
    return account, cert, key


async def in_cluster_planner(server: FakeApiServer, account: Path, *args: str) -> asyncio.subprocess.Process:
    """`tandem planner --environment kubernetes ARGS` as in a pod: the API server named by
    KUBERNETES_SERVICE_HOST/PORT, the ServiceAccount's files at their place in a mount namespace of its own,
    and no kubeconfig or namespace given."""
    if os.geteuid() != 0:
        raise RuntimeError("the in-cluster planner runs in a mount namespace of its own: the test needs root")
    env = {name: value for name, value in os.environ.items() if name not in (
        "KUBECONFIG", "POD_NAMESPACE", "TANDEM_HELM_RELEASE", "TANDEM_WORKER_DEPLOYMENT")}
    env.update(KUBERNETES_SERVICE_HOST="127.0.0.1", KUBERNETES_SERVICE_PORT=str(server.port), HOME=str(account))
    place = f'mount -t tmpfs tmpfs /var/run && mkdir -p {ACCOUNT} && cp "$0"/* {ACCOUNT}/ && exec "$@"'
    return await asyncio.create_subprocess_exec(
        "unshare", "--mount", "--propagation", "private", "sh", "-c", place, str(account),
        sys.executable, "-m", "tandem.planner", "--environment", "kubernetes", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def wait_for_line(process: asyncio.subprocess.Process, text: str, timeout: float = 120) -> list[str]:
    """The process's output lines up to the first that contains `text` (fails if it exits first)."""
    assert process.stdout is not None
    lines: list[str] = []
    async with asyncio.timeout(timeout):
        while not lines or text not in lines[-1]:
            line = await process.stdout.readline()
            assert line, f"exited with {await process.wait()} before {text!r}: {''.join(lines)}"
            lines.append(line.decode())
    return lines


PLANNER_ARGS = ("--helm-release", "llm", "--mode", "agg", "--frontend-url", "http://127.0.0.1:9",
                "--control-api-port", "0", "--profile-results-dir")


async def test_in_a_pod_the_planner_logs_in_with_its_service_account(api_server, tmp_path: Path) -> None:
    """No kubeconfig and no namespace given: the planner reaches the API server at KUBERNETES_SERVICE_HOST over
    HTTPS verified with the account's CA, sends the account's token, and works in the account's namespace."""
    from tests.planner.test_planner_run import write_profiles

    write_profiles(tmp_path)
    account, cert, key = service_account(tmp_path / "pod")
    server = await api_server({"llm-tandem-worker": 2}, tls=(cert, key), token=TOKEN)
    planner = await in_cluster_planner(server, account, *PLANNER_ARGS, str(tmp_path))
    try:
        lines = await wait_for_line(planner, "; scaling through kubernetes")  # planning, and stops on SIGTERM
    finally:
        planner.terminate()
        _, errors = await planner.communicate()
    assert planner.returncode == 0, errors.decode()
    assert any("planner: scaling Deployments llm-tandem-worker in namespace serving (now 2 workers)" in line
               for line in lines)
    # Its start-up check: the scale read and a dry-run PATCH, with the account's token.
    assert {(r.method, r.path, r.query.get("dryRun"), str(r.authorization).lower()) for r in server.requests} == {
        ("GET", scale_path("llm-tandem-worker"), None, f"bearer {TOKEN}"),
        ("PATCH", scale_path("llm-tandem-worker"), "All", f"bearer {TOKEN}")}
    assert server.patches == []


@pytest.mark.parametrize(("case", "message"), [
    ("stale token", "the planner may not get deployments/scale of Deployment llm-tandem-worker (the worker workers) "
                    "in namespace serving (401 Unauthorized): its ServiceAccount needs a Role with verbs get and "
                    "patch on resource deployments/scale of API group apps"),
    ("no deployment", "Deployment llm-tandem-worker (the worker workers) in namespace serving does not exist "
                      '(deployments.apps "llm-tandem-worker" not found)'),
    ("no CA", "no Kubernetes credentials from this pod's ServiceAccount"),
])
async def test_in_a_pod_a_refused_login_or_a_missing_deployment_exits_2_naming_it(
        api_server, tmp_path: Path, case: str, message: str) -> None:
    from tests.planner.test_planner_run import write_profiles

    write_profiles(tmp_path)
    account, cert, key = service_account(tmp_path / "pod", token="stale" if case == "stale token" else TOKEN,
                                         ca=case != "no CA")
    server = await api_server({} if case == "no deployment" else {"llm-tandem-worker": 1}, tls=(cert, key),
                              token=TOKEN)
    planner = await in_cluster_planner(server, account, *PLANNER_ARGS, str(tmp_path))
    _, errors = await asyncio.wait_for(planner.communicate(), timeout=120)
    assert planner.returncode == 2, errors.decode()
    assert message in errors.decode()
    assert server.patches == []
    if case == "stale token":  # the file's token was sent, and refused
        assert {str(r.authorization).lower() for r in server.requests} == {"bearer stale"}


# -- virtual ---------------------------------------------------------------------------------------------------

# Stores of one discovery backend (the conftest's fixture), file and etcd: each call is another process's.
BACKENDS = pytest.mark.parametrize("make_store", ["file", "etcd"], indirect=True)


async def orchestrate(client: VirtualConnectorClient, seen: list[PlannerDecision], before_complete=None) -> None:
    decision = await client.wait()
    seen.append(decision)
    if before_complete is not None:
        await before_complete()
    await client.complete(decision)


@BACKENDS
async def test_a_decision_waits_for_the_orchestrator_to_complete_it(make_store) -> None:
    planner_store, orchestrator_store = await make_store(ttl=5), await make_store(ttl=5)
    connector = VirtualConnector(planner_store, "ns", Replicas(1, 1), timeout=60)
    client = VirtualConnectorClient(orchestrator_store, "ns")
    assert await connector.replicas() == Replicas(1, 1)
    assert await client.get() is None

    seen: list[PlannerDecision] = []
    scaling = asyncio.create_task(connector.scale(Replicas(1, 3)))

    async def still_waiting() -> None:  # the decision is out, the acknowledgement not yet
        assert not scaling.done()
        assert await connector.replicas() == Replicas(1, 1)

    await asyncio.wait_for(orchestrate(client, seen, still_waiting), 30)
    await asyncio.wait_for(scaling, 30)
    assert seen == [PlannerDecision(num_prefill_workers=1, num_decode_workers=3, decision_id=1)]
    assert await connector.replicas() == Replicas(1, 3)

    # The next decision has the next id; the client only returns decisions newer than the one it completed.
    orchestrator = asyncio.create_task(orchestrate(client, seen))
    await asyncio.wait_for(connector.scale(Replicas(2, 2)), 30)
    await asyncio.wait_for(orchestrator, 30)
    assert seen[1] == PlannerDecision(2, 2, 2)
    assert await connector.replicas() == Replicas(2, 2)
    # On the wire: JSON records under the namespace.
    assert json.loads(await orchestrator_store.get(decision_key("ns"))) == {
        "num_prefill_workers": 2, "num_decode_workers": 2, "decision_id": 2}
    assert json.loads(await orchestrator_store.get(ack_key("ns"))) == {"scaled_decision_id": 2}


@BACKENDS
async def test_an_unacknowledged_decision_times_out_with_a_warning(make_store, caplog) -> None:
    store = await make_store(ttl=5)
    connector = VirtualConnector(store, "ns", Replicas(0, 1), timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="tandem.planner.virtual"):
        await asyncio.wait_for(connector.scale(Replicas(0, 4)), 30)
    assert "decision 1 (prefill 0, decode 4) not acknowledged within 0.5 s" in caplog.text
    assert await connector.replicas() == Replicas(0, 1)  # nothing was acknowledged
    assert await store.get(ack_key("ns")) is None
    # The decision stays for an orchestrator that comes late.
    assert msgspec.json.decode(await store.get(decision_key("ns")), type=PlannerDecision) == PlannerDecision(0, 4, 1)


@BACKENDS
async def test_a_restarted_planner_continues_the_decision_ids(make_store) -> None:
    first, orchestrator_store = await make_store(ttl=5), await make_store(ttl=5)
    client = VirtualConnectorClient(orchestrator_store, "ns")
    connector = VirtualConnector(first, "ns", Replicas(1, 1), timeout=60)
    seen: list[PlannerDecision] = []
    for target in (Replicas(1, 2), Replicas(2, 2)):
        orchestrator = asyncio.create_task(orchestrate(client, seen))
        await asyncio.wait_for(connector.scale(target), 30)
        await asyncio.wait_for(orchestrator, 30)
    await first.close()  # the planner's process ends: its lease goes, the decision and the acknowledgement stay

    restarted = VirtualConnector(await make_store(ttl=5), "ns", Replicas(1, 1), timeout=60)
    assert await restarted.replicas() == Replicas(2, 2)  # the last acknowledged decision
    orchestrator = asyncio.create_task(orchestrate(VirtualConnectorClient(await make_store(ttl=5), "ns"), seen))
    await asyncio.wait_for(restarted.scale(Replicas(3, 2)), 30)
    await asyncio.wait_for(orchestrator, 30)  # a new orchestrator too: it starts after the acknowledged decision 2
    assert [d.decision_id for d in seen] == [1, 2, 3]
    assert seen[-1] == PlannerDecision(3, 2, 3) and await restarted.replicas() == Replicas(3, 2)


@BACKENDS
async def test_a_new_decision_replaces_one_not_acknowledged(make_store) -> None:
    store = await make_store(ttl=5)
    connector = VirtualConnector(store, "ns", Replicas(1, 1), timeout=0.2)
    await connector.scale(Replicas(1, 2))  # times out
    await connector.scale(Replicas(1, 2))  # the same target: the same decision, not written again
    assert connector.last_decision_id == 1
    client = VirtualConnectorClient(await make_store(ttl=5), "ns")
    connector.timeout = 60
    scaling = asyncio.create_task(connector.scale(Replicas(1, 5)))
    async with asyncio.timeout(30):
        while connector.last_decision_id < 2:  # written (the orchestrator would otherwise see decision 1 first)
            await asyncio.sleep(0.01)
    decision = await asyncio.wait_for(client.wait(), 30)
    assert decision == PlannerDecision(1, 5, 2)
    await client.complete(decision)
    await asyncio.wait_for(scaling, 30)
    assert await connector.replicas() == Replicas(1, 5)
