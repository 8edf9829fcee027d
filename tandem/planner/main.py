"""`tandem planner`: the planner beside a deployment it did not start.

    tandem planner [--config FILE] [--mode agg|disagg|prefill|decode] [--ttft MS] [--itl MS] ...
        traffic (throughput-based scaling):  every frontend process registered in the deployment's discovery
                                             | --frontend-url URL ... | --metric-pulling-prometheus-endpoint URL
        engines (load-based scaling):        --enable-loadbased-scaling [--disable-throughput-scaling]
                                             and the deployment's runtime flags (--namespace, discovery, event plane)
        acting:                              --environment kubernetes | virtual, or --no-operation

Throughput-based scaling (on unless `--disable-throughput-scaling`) reads the traffic every
`--adjustment-interval` from each frontend process's `/metrics` (found through the deployment's discovery, or
at the given addresses) or from a Prometheus server that scrapes them, and sizes
the pools from the workers' profiles (`--profile-results-dir`). Load-based scaling follows the engines'
forward-pass metrics on the deployment's event plane and moves each pool by one worker at a time. The decisions
go to the Kubernetes API (the chart's worker Deployments), to an external orchestrator through the discovery
store (`virtual`), or nowhere (`--no-operation`: logged and exported only). While it runs, its min and max
endpoints and GPU budgets can be changed at `/v1/min-endpoints` (`--control-api-port`, docs/planner.md).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server

from tandem.planner.config import (
    Environment,
    PlannerConfig,
    PlannerMode,
    PredictorKind,
    add_load_scaling_args,
    read_settings,
)
from tandem.planner.control import ControlServer, ControlSettings
from tandem.planner.engines import DEFAULT_COMPONENTS, GENERATE_ENDPOINT, EngineFollower
from tandem.planner.kubernetes import KubernetesConnector, add_kubernetes_args
from tandem.planner.limits import Replicas
from tandem.planner.load import LoadPlanner
from tandem.planner.loop import Connector, Observer, PlannerLoop
from tandem.planner.observe import DiscoveredFrontends, FrontendObserver
from tandem.planner.prometheus import ENDPOINT_ENV, PrometheusObserver
from tandem.planner.sla import SlaPlanner
from tandem.planner.virtual import DEFAULT_TIMEOUT, VirtualConnector
from tandem.runtime import DistributedRuntime, RuntimeConfig, add_runtime_args
from tandem.runtime.config import ConfigError, env_bool, env_number, env_str

log = logging.getLogger("tandem.planner")

# Flags that are planner settings (argparse dest = setting name); absent flags leave the file's value.
SETTING_FLAGS = ("mode", "ttft", "itl", "adjustment_interval", "profile_results_dir", "load_predictor",
                 "max_gpu_budget", "min_endpoint", "max_replica_change", "worker_startup_time", "no_correction",
                 "no_operation", "environment", "load_adjustment_interval", "load_scaling_down_sensitivity",
                 "load_min_observations")
SWITCHES = {"enable_loadbased_scaling": ("enable_load_scaling", True),
            "disable_throughput_scaling": ("enable_throughput_scaling", False)}


class ObservedWorkers:
    """The connector of an observing planner (`--no-operation`): the workers are as the deployment reports them
    (the frontends' gauges, or the engines reporting); it changes nothing, and the loop never asks it to."""

    def __init__(self, seen: Callable[[], Replicas | None], mode: PlannerMode) -> None:
        self.seen = seen
        self.mode = mode

    async def replicas(self) -> Replicas:
        seen = self.seen() or Replicas()
        plans_prefill = self.mode in (PlannerMode.DISAGG, PlannerMode.PREFILL)
        return Replicas(seen.prefill if plans_prefill else 0, 0 if self.mode is PlannerMode.PREFILL else seen.decode)

    async def scale(self, target: Replicas) -> None:
        raise RuntimeError("an observing planner cannot change the deployment")

    def startup_seconds(self) -> float | None:
        return None  # not measurable from here: worker_startup_time, or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem planner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="planner settings (YAML or JSON); flags override them")
    parser.add_argument("--environment", choices=[e.value for e in Environment],
                        help="where the decisions go: the chart's Deployments (kubernetes) or an orchestrator "
                        "through the discovery store (virtual) [kubernetes]")
    parser.add_argument("--no-operation", action="store_true", default=None,
                        help="observe, decide and report only; change nothing")
    parser.add_argument("--mode", choices=[m.value for m in PlannerMode], help="the pools planned [disagg]")
    parser.add_argument("--ttft", type=float, metavar="MS", help="time-to-first-token target [500]")
    parser.add_argument("--itl", type=float, metavar="MS", help="inter-token-latency target [50]")
    parser.add_argument("--max-gpu-budget", type=int, metavar="N", help="GPUs all workers may use together, -1 for "
                        "no limit [8]")
    parser.add_argument("--min-endpoint", type=int, metavar="N", help="workers each pool keeps [1]")
    parser.add_argument("--planner-metrics-port", type=int, metavar="PORT",
                        help="serve the decisions as Prometheus metrics [env PLANNER_PROMETHEUS_PORT]")

    sla = parser.add_argument_group("Throughput-based scaling (profiles and predicted traffic)")
    sla.add_argument("--frontend-url", action="append", metavar="URL",
                     help="a frontend process's base URL, its /metrics read every interval (repeat for each one); "
                     "an address several processes serve is refused [default: every frontend process registered "
                     "in the deployment's discovery: --namespace and the discovery settings]")
    sla.add_argument("--metric-pulling-prometheus-endpoint", metavar="URL",
                     help="read the frontends' metrics from this Prometheus server instead [env PROMETHEUS_ENDPOINT; "
                     "bearer token: PROMETHEUS_TOKEN]")
    sla.add_argument("--model", help="plan for this served model's traffic only [all of it]")
    sla.add_argument("--disable-throughput-scaling", action="store_true", default=None,
                     help="load-based scaling only")
    sla.add_argument("--adjustment-interval", type=float, metavar="S", help="seconds between decisions [180]")
    sla.add_argument("--profile-results-dir", metavar="DIR", help="the workers' profile (`tandem profile`)")
    sla.add_argument("--load-predictor", choices=[k.value for k in PredictorKind], help="[arima]")
    sla.add_argument("--max-replica-change", type=int, metavar="N", help="workers a pool may gain or lose per "
                     "decision [no cap]")
    sla.add_argument("--worker-startup-time", type=float, metavar="S",
                     help="seconds a new worker takes to serve: how far ahead to plan [0]")
    sla.add_argument("--no-correction", action="store_true", default=None, help="use the profiles as they are")

    load = parser.add_argument_group("Load-based scaling (the engines' forward-pass metrics)")
    add_load_scaling_args(load, "scale on the engines' load; with throughput-based scaling on too, above its "
                          "decision")
    load.add_argument("--prefill-component", default=DEFAULT_COMPONENTS["prefill"], metavar="NAME",
                      help="the prefill workers' component [%(default)s]")
    load.add_argument("--decode-component", default=DEFAULT_COMPONENTS["decode"], metavar="NAME",
                      help="the decode (or aggregated) workers' component [%(default)s]")

    virtual = parser.add_argument_group("Virtual connector (--environment virtual)")
    virtual.add_argument("--virtual-timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                         help="seconds to wait for the orchestrator's acknowledgement of a decision [%(default)g]")
    add_kubernetes_args(parser)

    control = parser.add_argument_group("Control API (/v1/min-endpoints)")
    control.add_argument("--control-api-host", default=env_str("PLANNER_CONTROL_API_HOST") or "127.0.0.1",
                         metavar="HOST", help="where it listens [env PLANNER_CONTROL_API_HOST, default 127.0.0.1]")
    control.add_argument("--control-api-port", type=int, metavar="PORT",
                         help="0 turns it off [env PLANNER_CONTROL_API_PORT, default 9086]")
    control.add_argument("--control-api-key", metavar="KEY", default=env_str("PLANNER_CONTROL_API_KEY"),
                         help="requests need Authorization: Bearer KEY [env PLANNER_CONTROL_API_KEY]")
    control.add_argument("--control-api-allow-unauthenticated", action="store_true",
                         default=env_bool("PLANNER_CONTROL_API_ALLOW_UNAUTHENTICATED", False),
                         help="serve it without a key on a non-loopback address")
    add_runtime_args(parser)
    return parser


def config_from(args: argparse.Namespace) -> PlannerConfig:
    """The file's settings, then the flags given; raises ConfigError naming the setting."""
    values = read_settings(args.config) if args.config else {}
    values.update({name: getattr(args, name) for name in SETTING_FLAGS if getattr(args, name) is not None})
    values.update(setting for flag, setting in SWITCHES.items() if getattr(args, flag))
    return PlannerConfig.from_mapping(values, where=args.config or "the flags")


def discovers_frontends(args: argparse.Namespace, config: PlannerConfig) -> bool:
    """Whether the traffic is read from the frontend processes registered in discovery (no address given)."""
    return config.enable_throughput_scaling and not (args.frontend_url or prometheus_endpoint(args))


def prometheus_endpoint(args: argparse.Namespace) -> str | None:
    return args.metric_pulling_prometheus_endpoint or env_str(ENDPOINT_ENV)


def control_settings(args: argparse.Namespace) -> ControlSettings:
    port = args.control_api_port
    if port is None:
        port = int(env_number("PLANNER_CONTROL_API_PORT", 9086, int))
    if not 0 <= port <= 65535:
        raise ConfigError(f"--control-api-port must be a port number (0 turns the API off), got {port}")
    return ControlSettings(args.control_api_host, port, args.control_api_key, args.control_api_allow_unauthenticated)


async def serve(args: argparse.Namespace, config: PlannerConfig, sla: SlaPlanner | None,
                runtime_config: RuntimeConfig | None) -> int:
    registry = CollectorRegistry()
    metrics_port = args.planner_metrics_port
    if metrics_port is None and env_str("PLANNER_PROMETHEUS_PORT") is not None:
        metrics_port = int(env_number("PLANNER_PROMETHEUS_PORT", 0, int))
    if metrics_port:
        start_http_server(metrics_port, registry=registry)
        log.info("planner: metrics on http://0.0.0.0:%d/metrics", metrics_port)
    closers: list[Callable[[], object]] = []
    try:
        runtime: DistributedRuntime | None = None
        if runtime_config is not None:
            runtime = await DistributedRuntime.create(runtime_config)
            closers.append(runtime.shutdown)
        observer: FrontendObserver | PrometheusObserver | None = None
        if sla is not None:
            endpoint = prometheus_endpoint(args)
            if endpoint:
                observer = PrometheusObserver(endpoint, args.model)
            elif args.frontend_url:
                observer = FrontendObserver(args.frontend_url, args.model)
                await observer.check()
            else:
                assert runtime is not None
                observer = FrontendObserver(DiscoveredFrontends(runtime.store, runtime.config.namespace), args.model)
        load: LoadPlanner | None = None
        if config.enable_load_scaling:
            assert runtime is not None
            load = LoadPlanner(config)
            follower = EngineFollower(runtime, runtime.config.namespace, load,
                                      {"prefill": args.prefill_component, "decode": args.decode_component})
            await follower.start()
            closers.insert(0, follower.close)
        connector = await make_connector(args, config, runtime, observer, load)
        settings = control_settings(args)
        if settings.port:
            control = ControlServer(config, settings)
            await control.start()
            closers.insert(0, control.close)
        loop = PlannerLoop(config, connector, sla=sla, observer=observer, load=load, registry=registry)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        log.info("planner: %s; %s", config.describe(), "observing only" if config.no_operation
                 else f"scaling through {config.environment.value}")
        await loop.run(stop)
        return 0
    finally:
        for close in closers:
            result = close()
            if asyncio.iscoroutine(result):
                await result


async def make_connector(args: argparse.Namespace, config: PlannerConfig, runtime: DistributedRuntime | None,
                         observer: Observer | None, load: LoadPlanner | None) -> Connector:
    if config.no_operation:
        def seen() -> Replicas | None:
            if isinstance(observer, FrontendObserver | PrometheusObserver) and observer.workers is not None:
                return observer.workers
            return load.engine_counts() if load is not None else None

        return ObservedWorkers(seen, config.mode)
    if config.environment is Environment.VIRTUAL:
        assert runtime is not None
        components = {"prefill": args.prefill_component, "decode": args.decode_component}
        virtual = VirtualConnector(runtime.store, runtime.config.namespace,
                                   await registered_workers(runtime, config, components), timeout=args.virtual_timeout)
        await virtual.load()
        return virtual
    kubernetes = KubernetesConnector.from_args(args, config.mode)
    await kubernetes.check()
    return kubernetes


async def registered_workers(runtime: DistributedRuntime, config: PlannerConfig, components: dict[str, str]) -> Replicas:
    """The workers each planned pool has in discovery now: where the virtual connector starts from, until the
    orchestrator acknowledges a decision."""
    counts = {"prefill": 0, "decode": 0}
    for pool in config.pools:
        client = await runtime.namespace(runtime.config.namespace).component(components[pool]).endpoint(
            GENERATE_ENDPOINT).client()
        counts[pool] = len(client.instance_ids())
        await client.close()
    return Replicas(counts["prefill"], counts["decode"])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    try:
        config = config_from(args)
        sla = SlaPlanner.from_config(config) if config.enable_throughput_scaling else None
        # The deployment's runtime: to follow its engines, to find its frontends, and to reach the orchestrator
        # through its discovery store.
        needs_runtime = (config.enable_load_scaling or discovers_frontends(args, config)
                         or (config.environment is Environment.VIRTUAL and not config.no_operation))
        runtime_config = RuntimeConfig.from_args(args) if needs_runtime else None
    except (ConfigError, ValueError) as e:
        print(f"tandem planner: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(args, config, sla, runtime_config))
    except ConfigError as e:  # found on the way up: a Deployment missing, the control port taken, ...
        print(f"tandem planner: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
