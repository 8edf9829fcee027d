"""The Helm chart (deploy/helm/tandem) rendered by Helm's own template engine (the helm-python-sdk package binds
Helm's Go SDK), and the checks a cluster would make, or that only show once pods run:

- `render`: values files merged as `helm -f a -f b` merges them, then rendered;
- `schema_problems`: each object against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: an
  unknown field is an error), the ServiceMonitor against the fields of its CRD that the chart uses;
- `reference_problems`: what refers to what: selectors and labels, Service target ports and container
  ports, probes and the ports and paths the process really serves, container ports and the ports the
  process is told to listen on, flags and the parsers of the commands, env vars and the code that reads
  them, volumes and mounts, the ServiceMonitor and the Services, RBAC bindings.
"""

from __future__ import annotations

import ast
import copy
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from tests.support import REPO

CHART = REPO / "deploy" / "helm" / "tandem"
EXAMPLES = REPO / "deploy" / "helm" / "examples"
KUBERNETES_VERSIONS = ("1.27.0", "1.37.0")  # the chart's kubeVersion floor, and the newest schemas at hand

Manifest = dict[str, Any]


class RenderError(Exception):
    """Helm refused the values (schema) or a template stopped the render (`fail`)."""


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of values files: maps merge key by key, anything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def values_of(*files: str, values: dict[str, Any] | None = None) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for name in files:
        merged = merge(merged, yaml.safe_load((EXAMPLES / name).read_text()) or {})
    return merge(merged, values or {})


def render(*files: str, values: dict[str, Any] | None = None, release: str = "llm",
           namespace: str = "serving") -> list[Manifest]:
    """The objects `helm template -f examples/<file>... --set <values>` prints."""
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        try:
            rendered = chart.render(values_of(*files, values=values), name=release, namespace=namespace)
        except (helm.HelmRenderError, helm.HelmValuesError) as e:
            raise RenderError(str(e)) from None
    return [doc for name, text in sorted(rendered.items()) if not name.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def of_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [doc for doc in docs if doc["kind"] == kind]


def workloads(docs: list[Manifest]) -> list[Manifest]:
    return [doc for doc in docs if doc["kind"] in ("Deployment", "StatefulSet")]


# -- schemas ----------------------------------------------------------------------------------------------

# The fields of monitoring.coreos.com/v1 ServiceMonitor the chart sets (its CRD is not in the core schemas).
SERVICE_MONITOR_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "properties": {"matchLabels": {
                    "type": "object", "additionalProperties": {"type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"], "additionalProperties": False,
                    "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                   "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                                   "scheme": {"enum": ["http", "https"]},
                                   "tlsConfig": {"type": "object"}}}},
            },
        },
    },
}


def schema_problems(docs: list[Manifest]) -> list[str]:
    import jsonschema
    import kubernetes_validate

    problems = []
    for doc in docs:
        where = f"{doc['kind']} {doc['metadata']['name']}"
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            problems += [f"{where}: {e.message}"
                         for e in jsonschema.Draft7Validator(SERVICE_MONITOR_SCHEMA).iter_errors(doc)]
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{where} (Kubernetes {version}): {e.message} at {'.'.join(map(str, e.path))}")
    return problems


# -- what the processes read and serve ---------------------------------------------------------------------

def _string_constants(root: Path) -> set[str]:
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[A-Z][A-Z0-9_]+", node.value):
                names.add(node.value)
    return names


@functools.cache
def tandem_env_names() -> frozenset[str]:
    """Every upper-case string constant in the tandem package: the names its code can read."""
    return frozenset(_string_constants(REPO / "tandem"))


@functools.cache
def vllm_env_names() -> frozenset[str]:
    import vllm.envs

    return frozenset(vllm.envs.environment_variables)


@functools.cache
def hf_env_names() -> frozenset[str]:
    import huggingface_hub

    return frozenset(name for name in _string_constants(Path(huggingface_hub.__file__).parent) if name.startswith("HF_"))


@functools.cache
def frontend_paths() -> frozenset[str]:
    """The GET routes the frontend's HTTP server and its APIs declare (`web.get(path, ...)` in tandem/frontend/)."""
    paths = set()
    for source in (REPO / "tandem" / "frontend").rglob("*.py"):
        paths |= {node.args[0].value for node in ast.walk(ast.parse(source.read_text()))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and isinstance(node.func.value, ast.Name) and node.func.value.id == "web"
                  and node.args and isinstance(node.args[0], ast.Constant)}
    return frozenset(paths)


def flag(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def plain_env(container: Manifest) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def container_kind(container: Manifest) -> str:
    """What runs in the container: `tandem frontend`, `tandem vllm`, `tandem mocker`, `tandem planner`, `etcd`,
    `nats-server`, or `model download` (python with huggingface_hub)."""
    command = container.get("command", [])
    if command[:1] == ["tandem"]:
        return f"tandem {command[1]}"
    if command[:1] == ["python3"] and "snapshot_download" in " ".join(command):
        return "model download"
    return command[0] if command else "(image default)"


def served(container: Manifest) -> dict[int, frozenset[str]]:
    """Port -> HTTP paths served there (empty: a non-HTTP listener), per the process's own flags and env."""
    kind, args, env = container_kind(container), container.get("args", []), plain_env(container)
    command = container.get("command", [])
    if kind == "tandem frontend":
        return {int(flag(args, "--http-port") or env.get("DYN_HTTP_PORT") or 8000): frontend_paths()}
    if kind in ("tandem vllm", "tandem mocker"):
        from tandem.runtime import RuntimeConfig

        defaults = RuntimeConfig()
        ports: dict[int, frozenset[str]] = {}
        if "DYN_SYSTEM_PORT" in env:
            ports[int(env["DYN_SYSTEM_PORT"])] = frozenset({
                env.get("DYN_SYSTEM_HEALTH_PATH", defaults.system_health_path),
                env.get("DYN_SYSTEM_LIVE_PATH", defaults.system_live_path), "/metrics"})
        if "DYN_TCP_RPC_PORT" in env:
            ports[int(env["DYN_TCP_RPC_PORT"])] = frozenset()
        if kind == "tandem vllm" and "VLLM_NIXL_SIDE_CHANNEL_PORT" in env:
            ports[int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])] = frozenset()
        return ports
    if kind == "tandem planner":
        port = flag(args, "--planner-metrics-port") or env.get("PLANNER_PROMETHEUS_PORT")
        return {int(port): frozenset({"/metrics"})} if port and int(port) else {}
    if kind == "etcd":
        client = urlsplit(flag(command, "--listen-client-urls") or "").port
        peer = urlsplit(flag(command, "--listen-peer-urls") or "").port
        return {**({client: frozenset({"/health", "/metrics", "/version"})} if client else {}),
                **({peer: frozenset()} if peer else {})}
    if kind == "nats-server":
        monitor = flag(command, "--http_port")
        return {int(flag(command, "--port") or 4222): frozenset(),
                **({int(monitor): frozenset({"/healthz", "/varz", "/connz", "/jsz"})} if monitor else {})}
    return {}


def env_readers(container: Manifest) -> frozenset[str] | None:
    """The env var names the container's program reads; None where that is not known."""
    kind = container_kind(container)
    if kind in ("tandem frontend", "tandem mocker", "tandem planner"):
        return tandem_env_names()
    if kind == "tandem vllm":
        return tandem_env_names() | vllm_env_names() | hf_env_names()
    if kind == "model download":
        return hf_env_names()
    if kind in ("etcd", "nats-server"):  # configured by flags; env only feeds $(VAR) in them
        text = " ".join(container.get("command", []) + container.get("args", []))
        return frozenset(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text))
    return None


def flag_problems(container: Manifest) -> list[str]:
    """The container's arguments as its command's own parser takes them."""
    import contextlib
    import io

    kind, args = container_kind(container), container.get("args", [])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if kind == "tandem frontend":
                from tandem.frontend.main import build_parser

                build_parser().parse_args(args)
            elif kind == "tandem mocker":
                from tandem.mocker.args import build_parser as build_mocker_parser

                build_mocker_parser().parse_args(args)
            elif kind == "tandem planner":
                from tandem.planner.main import build_parser as build_planner_parser

                build_planner_parser().parse_args(args)
            elif kind == "tandem vllm":
                from tandem.vllm.args import _normalize_dynamo_flags, build_dynamo_parser, build_vllm_parser

                parser = build_dynamo_parser()
                _, rest = parser.parse_known_args(_normalize_dynamo_flags(args, parser))
                build_vllm_parser().parse_args(rest)
    except SystemExit:
        return [f"{kind} refuses its arguments {args}: {err.getvalue().strip().splitlines()[-1]}"]
    return []


# -- references ---------------------------------------------------------------------------------------------

def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def port_of(container: Manifest, port: int | str) -> int | None:
    for declared in container.get("ports", []):
        if port in (declared["containerPort"], declared.get("name")):
            return int(declared["containerPort"])
    return None


def _pod_templates(docs: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    for workload in workloads(docs):
        yield f"{workload['kind']} {workload['metadata']['name']}", workload["spec"]["template"]


def container_problems(where: str, container: Manifest) -> list[str]:
    problems = flag_problems(container)
    readers = env_readers(container)
    for env in container.get("env", []):
        if readers is None:
            problems.append(f"{where}: no known reader for env {env['name']} of {container_kind(container)}")
        elif env["name"] not in readers:
            problems.append(f"{where}: sets {env['name']}, which {container_kind(container)} never reads")
    listening = served(container)
    for declared in container.get("ports", []):
        if declared["containerPort"] not in listening:
            problems.append(f"{where}: declares port {declared.get('name')} {declared['containerPort']}, but the "
                            f"process listens on {sorted(listening)}")
    for probe_kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container.get(probe_kind)
        if probe is None:
            continue
        get = probe["httpGet"]
        port = port_of(container, get["port"])
        if port is None:
            problems.append(f"{where}: {probe_kind} port {get['port']} is none of the container's ports")
        elif get["path"] not in listening.get(port, frozenset()):
            problems.append(f"{where}: {probe_kind} GET {get['path']} on port {port}: the process serves "
                            f"{sorted(listening.get(port, []))} there")
    return problems


def reference_problems(docs: list[Manifest]) -> list[str]:
    problems: list[str] = []
    templates = list(_pod_templates(docs))
    for workload in workloads(docs):
        where = f"{workload['kind']} {workload['metadata']['name']}"
        pod = workload["spec"]["template"]
        if not selects(workload["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"]):
            problems.append(f"{where}: its selector does not match its own pod labels")
        spec = pod["spec"]
        volumes = {volume["name"] for volume in spec.get("volumes", [])}
        for container in spec.get("initContainers", []) + spec["containers"]:
            cwhere = f"{where} container {container['name']}"
            problems += container_problems(cwhere, container)
            problems += [f"{cwhere}: mounts volume {m['name']}, which the pod does not have"
                         for m in container.get("volumeMounts", []) if m["name"] not in volumes]
        if workload["kind"] == "StatefulSet":
            service = workload["spec"]["serviceName"]
            if not any(s["metadata"]["name"] == service and s["spec"].get("clusterIP") == "None"
                       for s in of_kind(docs, "Service")):
                problems.append(f"{where}: serviceName {service} is not a headless Service of the release")
    for service in of_kind(docs, "Service"):
        where = f"Service {service['metadata']['name']}"
        chosen = [(name, t) for name, t in templates if selects(service["spec"]["selector"], t["metadata"]["labels"])]
        if not chosen:
            problems.append(f"{where}: its selector matches no pod of the release")
        for port in service["spec"]["ports"]:
            for name, template in chosen:
                if not any(port_of(c, port.get("targetPort", port["port"])) for c in template["spec"]["containers"]):
                    problems.append(f"{where}: port {port['name']} targets {port.get('targetPort')}, which the pods "
                                    f"of {name} do not declare")
    for monitor in of_kind(docs, "ServiceMonitor"):
        where = f"ServiceMonitor {monitor['metadata']['name']}"
        services = [s for s in of_kind(docs, "Service") if selects(monitor["spec"]["selector"]["matchLabels"],
                                                                      s["metadata"]["labels"])]
        for endpoint in monitor["spec"]["endpoints"]:
            targets = [(s, p) for s in services for p in s["spec"]["ports"] if p["name"] == endpoint["port"]]
            if not targets:
                problems.append(f"{where}: endpoint port {endpoint['port']} is on none of the Services it selects")
            for service, port in targets:
                for name, template in templates:
                    if not selects(service["spec"]["selector"], template["metadata"]["labels"]):
                        continue
                    for container in template["spec"]["containers"]:
                        number = port_of(container, port["targetPort"])
                        if number is not None and endpoint.get("path", "/metrics") not in served(container).get(number, ()):
                            problems.append(f"{where}: {name} serves no {endpoint.get('path')} on port {number}")
    roles = {r["metadata"]["name"]: r for r in of_kind(docs, "Role")}
    accounts = {a["metadata"]["name"] for a in of_kind(docs, "ServiceAccount")}
    for binding in of_kind(docs, "RoleBinding"):
        where = f"RoleBinding {binding['metadata']['name']}"
        if binding["roleRef"]["name"] not in roles:
            problems.append(f"{where}: binds Role {binding['roleRef']['name']}, which the release does not have")
        problems += [f"{where}: binds ServiceAccount {s['name']}, which the release does not have"
                     for s in binding["subjects"] if s["kind"] == "ServiceAccount" and s["name"] not in accounts]
    return problems
