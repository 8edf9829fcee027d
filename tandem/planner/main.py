"""`tandem planner`: the SLA planner beside a deployment it did not start, observing only.

    tandem planner --frontend-url URL --profile-results-dir DIR --no-operation [--mode agg|disagg]
                   [--ttft MS] [--itl MS] [--adjustment-interval S] [--config FILE] ...

Every interval it reads the frontends' metrics (traffic, and the workers they route to), predicts, and logs
and exports (`--planner-metrics-port`) the replicas each pool should have: a dry run of the planner on a live
deployment. Changing a deployment from a separate process needs a connector to it (a cluster's, or a
deployment's own control plane), which this release does not have, so `--no-operation` is required here;
`tandem run --planner sla` plans and scales its own workers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from prometheus_client import CollectorRegistry, start_http_server

from tandem.planner.config import PlannerConfig, PlannerMode, PredictorKind, read_settings
from tandem.planner.loop import PlannerLoop
from tandem.planner.observe import FrontendObserver
from tandem.planner.sla import Replicas, SlaPlanner
from tandem.runtime.config import ConfigError, env_number, env_str

log = logging.getLogger("tandem.planner")

# Flags that are planner settings (argparse dest = setting name); absent flags leave the file's value.
SETTING_FLAGS = ("mode", "ttft", "itl", "adjustment_interval", "profile_results_dir", "load_predictor",
                 "max_gpu_budget", "min_endpoint", "max_replica_change", "worker_startup_time", "no_correction")


class ObservedWorkers:
    """The connector of an observing planner: the workers are as the frontends report them; it changes
    nothing (the loop never asks it to, with `no_operation`)."""

    def __init__(self, observer: FrontendObserver, mode: PlannerMode) -> None:
        self.observer = observer
        self.mode = mode

    def replicas(self) -> Replicas:
        seen = self.observer.workers or Replicas()
        plans_prefill = self.mode in (PlannerMode.DISAGG, PlannerMode.PREFILL)
        return Replicas(seen.prefill if plans_prefill else 0, 0 if self.mode is PlannerMode.PREFILL else seen.decode)

    async def scale(self, target: Replicas) -> None:
        raise RuntimeError("an observing planner cannot change the deployment")

    def startup_seconds(self) -> float | None:
        return None  # not measurable from here: worker_startup_time, or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem planner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontend-url", action="append", required=True, metavar="URL",
                        help="a frontend's base URL (repeat for several frontends of the deployment)")
    parser.add_argument("--model", help="plan for this served model's traffic only [all of it]")
    parser.add_argument("--config", metavar="FILE", help="planner settings (YAML or JSON); flags override them")
    parser.add_argument("--no-operation", action="store_true",
                        help="observe, predict and report only (required: see above)")
    parser.add_argument("--mode", choices=[m.value for m in PlannerMode], help="the pools planned [disagg]")
    parser.add_argument("--ttft", type=float, metavar="MS", help="time-to-first-token target [500]")
    parser.add_argument("--itl", type=float, metavar="MS", help="inter-token-latency target [50]")
    parser.add_argument("--adjustment-interval", type=float, metavar="S", help="seconds between decisions [180]")
    parser.add_argument("--profile-results-dir", metavar="DIR", help="the workers' profile (`tandem profile`)")
    parser.add_argument("--load-predictor", choices=[k.value for k in PredictorKind], help="[arima]")
    parser.add_argument("--max-gpu-budget", type=int, metavar="N", help="GPUs all workers may use together [8]")
    parser.add_argument("--min-endpoint", type=int, metavar="N", help="workers each pool keeps [1]")
    parser.add_argument("--max-replica-change", type=int, metavar="N", help="workers a pool may gain or lose "
                        "per decision [no cap]")
    parser.add_argument("--worker-startup-time", type=float, metavar="S",
                        help="seconds a new worker takes to serve: how far ahead to plan [0]")
    parser.add_argument("--no-correction", action="store_true", default=None,
                        help="use the profiles as they are")
    parser.add_argument("--planner-metrics-port", type=int, metavar="PORT",
                        help="serve the decisions as Prometheus metrics [env PLANNER_PROMETHEUS_PORT]")
    return parser


def config_from(args: argparse.Namespace) -> PlannerConfig:
    """The file's settings, then the flags given; raises ConfigError naming the setting."""
    values = read_settings(args.config) if args.config else {}
    values.update({name: getattr(args, name) for name in SETTING_FLAGS if getattr(args, name) is not None})
    if not args.no_operation:
        raise ConfigError("tandem planner only observes in this release: give --no-operation (to plan and scale "
                          "workers, run them with `tandem run --planner sla`)")
    values["no_operation"] = True
    return PlannerConfig.from_mapping(values, where=args.config or "the flags")


async def serve(planner: SlaPlanner, urls: list[str], model: str | None, metrics_port: int | None) -> None:
    registry = CollectorRegistry()
    if metrics_port is not None:
        start_http_server(metrics_port, registry=registry)
        log.info("planner: metrics on http://0.0.0.0:%d/metrics", metrics_port)
    observer = FrontendObserver(urls, model)
    loop = PlannerLoop(planner, observer, ObservedWorkers(observer, planner.config.mode), registry)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    c = planner.config
    log.info("planner: SLA planner (%s, observing %s): TTFT %g ms, ITL %g ms, every %g s, %s predictor",
             c.mode.value, ", ".join(urls), c.ttft, c.itl, c.adjustment_interval, c.load_predictor.value)
    await loop.run(stop)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    try:
        config = config_from(args)
        planner = SlaPlanner.from_config(config)
        port = args.planner_metrics_port
        if port is None and env_str("PLANNER_PROMETHEUS_PORT") is not None:
            port = int(env_number("PLANNER_PROMETHEUS_PORT", 0, int))
    except (ConfigError, ValueError) as e:
        print(f"tandem planner: {e}", file=sys.stderr)
        return 2
    asyncio.run(serve(planner, args.frontend_url, args.model, port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
