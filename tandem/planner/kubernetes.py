"""The Kubernetes connector: the planner scales the worker Deployments of a Helm release (deploy/helm/tandem).

Each pool is one Deployment, scaled through its `scale` subresource, which is all the chart's planner Role
allows (`get` and `patch` on `deployments/scale` in the release's namespace):

    GET   /apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale
    PATCH /apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale   {"spec": {"replicas": N}}
          (Content-Type: application/merge-patch+json)

Kubernetes then starts or stops pods; a pod being stopped gets SIGTERM and drains its streams within its
termination grace period. `replicas()` is the Deployments' desired replicas (spec, not yet-ready pods), so pods
still starting count as they will be.

Which Deployments: the chart names them `<fullname>-prefill` and `<fullname>-decode` (disagg), or
`<fullname>-worker` (agg), `<fullname>` being the release name, with `-tandem` appended unless it contains
"tandem". `--helm-release` derives the names that way; `--prefill-deployment`, `--decode-deployment` and
`--worker-deployment` name them outright (the chart's planner Deployment passes them). Aggregated mode scales the
one worker Deployment (its replicas are `decode`); `prefill` and `decode` modes scale only their pool.

Credentials: in a pod, its ServiceAccount (in-cluster config); elsewhere a kubeconfig (`--kubeconfig`, else
`KUBECONFIG`, else ~/.kube/config). The namespace: `--kube-namespace` (env `POD_NAMESPACE`), else the pod's own
(its ServiceAccount's namespace file), else the kubeconfig context's, else `default`.

The official client is synchronous; each call runs in a thread (`asyncio.to_thread`). `check()`, before the
planning loop, reads each Deployment's scale and asks the API server to dry-run a PATCH of it: a missing
Deployment or a missing permission is a ConfigError that names them. During the loop an API error in `scale()`
is raised as a `KubernetesError` (the loop logs it and decides again at the next interval).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.planner.sla import Replicas
from tandem.runtime.config import ConfigError, env_str

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)

# Environment variables (each the default of its flag).
NAMESPACE_ENV = "POD_NAMESPACE"
RELEASE_ENV = "TANDEM_HELM_RELEASE"
PREFILL_ENV = "TANDEM_PREFILL_DEPLOYMENT"
DECODE_ENV = "TANDEM_DECODE_DEPLOYMENT"
WORKER_ENV = "TANDEM_WORKER_DEPLOYMENT"

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT = (5.0, 30.0)  # seconds to connect, to read an answer


class KubernetesError(RuntimeError):
    """An API call failed (the message names the Deployment, the verb and the API server's answer)."""


def chart_fullname(release: str) -> str:
    """The chart's `tandem.fullname` of a release (deploy/helm/tandem/templates/_helpers.tpl)."""
    name = release if "tandem" in release else f"{release}-tandem"
    return name[:50].removesuffix("-")


def chart_deployments(release: str, mode: str) -> tuple[str | None, str | None]:
    """(prefill, decode) Deployment names the chart gives a release's workers in `mode` (None: not scaled)."""
    fullname = chart_fullname(release)
    if mode == "agg":
        return None, f"{fullname}-worker"
    return (f"{fullname}-prefill" if mode in ("disagg", "prefill") else None,
            f"{fullname}-decode" if mode in ("disagg", "decode") else None)


@dataclass(frozen=True)
class _Pool:
    name: str  # the pool: prefill, decode, or worker (aggregated)
    deployment: str


class KubernetesConnector:
    """Scales the prefill and decode Deployments (either may be None: that pool is not planned, its replicas 0).
    An aggregated deployment's one worker Deployment is `decode`.

    `api_client`: a `kubernetes.client.ApiClient` already configured (tests point one at a fake API server);
    None: in-cluster config in a pod, else the kubeconfig (`kubeconfig`, `context`)."""

    def __init__(self, namespace: str, *, prefill: str | None = None, decode: str | None = None,
                 api_client: ApiClient | None = None, kubeconfig: str | None = None,
                 context: str | None = None, aggregated: bool = False) -> None:
        if prefill is None and decode is None:
            raise ConfigError("the Kubernetes connector needs a worker Deployment to scale")
        from kubernetes import client

        self.namespace = namespace
        self.prefill = _Pool("prefill", prefill) if prefill else None
        self.decode = _Pool("worker" if aggregated else "decode", decode) if decode else None
        self.api_client = api_client if api_client is not None else ApiClientFactory(kubeconfig, context).create()
        self.apps = client.AppsV1Api(self.api_client)
        self._checked = False

    @classmethod
    def from_args(cls, args: argparse.Namespace, mode: Any) -> KubernetesConnector:
        """From the flags `add_kubernetes_args` adds; `mode` is the planner's mode (a PlannerMode or its value:
        agg, disagg, prefill or decode). Raises ConfigError naming the flag."""
        mode = str(getattr(mode, "value", mode))
        if mode not in ("agg", "disagg", "prefill", "decode"):
            raise ConfigError(f"the Kubernetes connector cannot plan mode {mode!r}")
        prefill, decode = _deployment_names(args, mode)
        factory = ApiClientFactory(args.kubeconfig, args.kube_context)
        namespace = args.kube_namespace or factory.namespace()
        return cls(namespace, prefill=prefill, decode=decode, api_client=factory.create(), aggregated=mode == "agg")

    @property
    def deployments(self) -> list[str]:
        return [pool.deployment for pool in self._pools()]

    def _pools(self) -> list[_Pool]:
        return [pool for pool in (self.prefill, self.decode) if pool is not None]

    # -- the Connector protocol ----------------------------------------------------------------------------
    async def check(self) -> Replicas:
        """Before planning: every Deployment exists and the planner may read and patch its scale (a dry-run
        PATCH, which changes nothing). Raises ConfigError naming the Deployment and the permission."""
        counts: dict[str, int] = {}
        for pool in self._pools():
            counts[pool.name] = await self._call(pool, "get", self._read, pool.deployment, startup=True)
            await self._call(pool, "patch", self._patch, pool.deployment, counts[pool.name], True, startup=True)
        self._checked = True
        replicas = self._replicas(counts)
        log.info("planner: scaling Deployments %s in namespace %s (now %s)", ", ".join(self.deployments),
                 self.namespace, self._describe(replicas))
        return replicas

    async def replicas(self) -> Replicas:
        """The Deployments' desired replicas (their spec: pods still starting included)."""
        if not self._checked:
            return await self.check()
        counts = {}
        for pool in self._pools():
            counts[pool.name] = await self._call(pool, "get", self._read, pool.deployment)
        return self._replicas(counts)

    async def scale(self, target: Replicas) -> None:
        """PATCH each Deployment's scale to its pool of `target` (both at once)."""
        wanted = [(pool, target.prefill if pool is self.prefill else target.decode) for pool in self._pools()]
        for pool, count in wanted:
            if count < 0:
                raise ValueError(f"replicas cannot be negative: {pool.name} {count}")
        await asyncio.gather(*(self._call(pool, "patch", self._patch, pool.deployment, count, False)
                               for pool, count in wanted))
        log.info("planner: Deployments scaled to %s", ", ".join(f"{pool.deployment} {count}" for pool, count in wanted))

    def startup_seconds(self) -> float | None:
        return None  # how long a pod takes to turn ready is not measured here: worker_startup_time, or 0

    # -- the API calls (synchronous, in a thread) -----------------------------------------------------------
    def _read(self, name: str) -> int:
        scale = self.apps.read_namespaced_deployment_scale(name, self.namespace, _request_timeout=REQUEST_TIMEOUT)
        return int(scale.spec.replicas or 0) if scale.spec is not None else 0

    def _patch(self, name: str, replicas: int, dry_run: bool) -> int:
        scale = self.apps.patch_namespaced_deployment_scale(
            name, self.namespace, {"spec": {"replicas": replicas}}, dry_run="All" if dry_run else None,
            _content_type=MERGE_PATCH, _request_timeout=REQUEST_TIMEOUT)
        return int(scale.spec.replicas or 0) if scale.spec is not None else replicas

    async def _call(self, pool: _Pool, verb: str, call: Any, *args: Any, startup: bool = False) -> int:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return int(await asyncio.to_thread(call, *args))
        except ApiException as e:
            raise self._explain(pool, verb, e, startup) from None
        except (HTTPError, OSError) as e:  # connection refused, DNS, TLS, timeouts
            error: Exception = (ConfigError if startup else KubernetesError)(
                f"cannot reach the Kubernetes API server at {self.api_client.configuration.host} to {verb} "
                f"Deployment {pool.deployment}/scale: {e}")
            raise error from None

    def _explain(self, pool: _Pool, verb: str, e: Any, startup: bool) -> Exception:
        where = f"Deployment {pool.deployment} (the {pool.name} workers) in namespace {self.namespace}"
        message = _api_message(e)
        if e.status == 404:
            text = (f"{where} does not exist ({message}): name the chart's worker Deployments with --helm-release "
                    f"or --{'worker' if pool.name == 'worker' else pool.name}-deployment, and the namespace with "
                    f"--kube-namespace")
        elif e.status in (401, 403):
            text = (f"the planner may not {verb} deployments/scale of {where} ({e.status} {message}): its "
                    f"ServiceAccount needs a Role with verbs get and patch on resource deployments/scale of API "
                    f"group apps (the chart's planner.rbac.create)")
        else:
            text = f"{verb} deployments/scale of {where} failed: {e.status} {message}"
        return ConfigError(text) if startup else KubernetesError(text)

    def _replicas(self, counts: dict[str, int]) -> Replicas:
        return Replicas(counts.get("prefill", 0), counts.get("decode", counts.get("worker", 0)))

    def _describe(self, replicas: Replicas) -> str:
        if self.decode is not None and self.decode.name == "worker":
            return f"{replicas.decode} workers"
        return f"prefill {replicas.prefill}, decode {replicas.decode}"

    def close(self) -> None:
        self.api_client.close()


def _api_message(e: Any) -> str:
    """The API server's own message (a Status object's `message`), else the reason."""
    import json

    try:
        body = json.loads(e.body)
        if isinstance(body, dict) and body.get("message"):
            return str(body["message"])
    except (TypeError, ValueError):
        pass
    return str(e.reason or "").strip() or "no message"


class ApiClientFactory:
    """The client configuration: an explicit kubeconfig, else in-cluster in a pod, else the default kubeconfig."""

    def __init__(self, kubeconfig: str | None = None, context: str | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.context = context

    def in_cluster(self) -> bool:
        return self.kubeconfig is None and self.context is None and bool(env_str("KUBERNETES_SERVICE_HOST"))

    def create(self) -> ApiClient:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException

        configuration = client.Configuration()
        try:
            if self.in_cluster():
                config.load_incluster_config(client_configuration=configuration)
            else:
                config.load_kube_config(config_file=self.kubeconfig, context=self.context,
                                        client_configuration=configuration, persist_config=False)
        except (ConfigException, OSError) as e:
            where = "this pod's ServiceAccount" if self.in_cluster() else \
                f"kubeconfig {self.kubeconfig or env_str('KUBECONFIG') or '~/.kube/config'}"
            raise ConfigError(f"no Kubernetes credentials from {where}: {e} (in a pod the planner uses its "
                              f"ServiceAccount; elsewhere give --kubeconfig or KUBECONFIG)") from None
        return client.ApiClient(configuration)

    def namespace(self) -> str:
        """The pod's namespace, else the kubeconfig context's, else `default`."""
        if self.in_cluster():
            try:
                with open(SERVICE_ACCOUNT_NAMESPACE) as f:
                    found = f.read().strip()
                if found:
                    return found
            except OSError:
                pass
        else:
            from kubernetes import config
            from kubernetes.config.config_exception import ConfigException

            try:
                contexts, active = config.list_kube_config_contexts(config_file=self.kubeconfig)
                chosen = next((c for c in contexts if c["name"] == self.context), active) if self.context else active
                found = (chosen or {}).get("context", {}).get("namespace")
                if found:
                    return str(found)
            except (ConfigException, OSError):
                pass
        return "default"


def _deployment_names(args: argparse.Namespace, mode: str) -> tuple[str | None, str | None]:
    release = args.helm_release
    derived = chart_deployments(release, mode) if release else (None, None)
    if mode == "agg":
        if args.prefill_deployment or args.decode_deployment:
            raise ConfigError("mode agg scales one worker Deployment: give --worker-deployment (or --helm-release), "
                              "not --prefill-deployment or --decode-deployment")
        decode = args.worker_deployment or derived[1]
        if not decode:
            raise ConfigError("name the worker Deployment to scale: --worker-deployment NAME, or --helm-release "
                              "RELEASE (the chart's <release>-tandem-worker)")
        return None, decode
    if args.worker_deployment:
        raise ConfigError(f"mode {mode} scales the prefill and decode Deployments: give --prefill-deployment and "
                          "--decode-deployment (or --helm-release), not --worker-deployment")
    prefill = (args.prefill_deployment or derived[0]) if mode in ("disagg", "prefill") else None
    decode = (args.decode_deployment or derived[1]) if mode in ("disagg", "decode") else None
    missing = [flag for flag, pool, needed in (("--prefill-deployment", prefill, mode in ("disagg", "prefill")),
                                               ("--decode-deployment", decode, mode in ("disagg", "decode")))
               if needed and not pool]
    if missing:
        raise ConfigError(f"name the worker Deployments to scale: {' and '.join(f'{m} NAME' for m in missing)}, or "
                          "--helm-release RELEASE (the chart's <release>-tandem-prefill and -decode)")
    return prefill, decode


def add_kubernetes_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The Kubernetes connector's flags (`--environment kubernetes`); each defaults to its env var."""
    group = parser.add_argument_group("Kubernetes connector (--environment kubernetes)")
    group.add_argument("--kube-namespace", metavar="NS", default=env_str(NAMESPACE_ENV),
                       help=f"the Kubernetes namespace of the worker Deployments [env {NAMESPACE_ENV}; default: the "
                       "pod's own, else the kubeconfig context's, else default]")
    group.add_argument("--helm-release", metavar="RELEASE", default=env_str(RELEASE_ENV),
                       help="the Helm release of deploy/helm/tandem whose worker Deployments to scale, named as the "
                       f"chart names them (<release>-tandem-prefill, -decode, -worker) [env {RELEASE_ENV}]")
    group.add_argument("--prefill-deployment", metavar="NAME", default=env_str(PREFILL_ENV),
                       help=f"the prefill workers' Deployment (disagg, prefill modes) [env {PREFILL_ENV}]")
    group.add_argument("--decode-deployment", metavar="NAME", default=env_str(DECODE_ENV),
                       help=f"the decode workers' Deployment (disagg, decode modes) [env {DECODE_ENV}]")
    group.add_argument("--worker-deployment", metavar="NAME", default=env_str(WORKER_ENV),
                       help=f"the aggregated workers' Deployment (agg mode) [env {WORKER_ENV}]")
    group.add_argument("--kubeconfig", metavar="FILE", default=None,
                       help="credentials outside a pod [default: KUBECONFIG, else ~/.kube/config; in a pod: its "
                       "ServiceAccount]")
    group.add_argument("--kube-context", metavar="NAME", default=None,
                       help="the kubeconfig context to use [its current context]")
    return group


def parse_kubernetes_args(argv: Sequence[str]) -> argparse.Namespace:
    """Only the connector's flags (for tools and tests)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_kubernetes_args(parser)
    return parser.parse_args(list(argv))


__all__ = ["KubernetesConnector", "KubernetesError", "add_kubernetes_args", "chart_deployments", "chart_fullname"]
