"""`tandem run`: a whole deployment (frontend + workers) on one machine from one command.

    tandem run [--model M] [--engine vllm|mocker] [--workers N | --prefill-workers P --decode-workers D]
               [--router-mode MODE] [--http-port PORT] [-f deploy.yaml] [-- extra worker flags]

Uses the embedded defaults (file discovery in a private directory, TCP request plane, ZMQ events), so no
external service is needed. Waits until the model is served, prints the URL, relays every process's log
with a label, and stops everything on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import shutil
import signal
import sys
import tempfile
import time
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from tandem.launch.cores import format_cores
from tandem.launch.local_planner import run_planner
from tandem.launch.plan import ENGINES as WORKER_COMMANDS
from tandem.launch.plan import Plan
from tandem.launch.spec import ENGINES, RunSpec, SpecError, build_spec, load_file
from tandem.launch.supervisor import Child, LogMux, Supervisor, describe_exit
from tandem.models.prepare import PrepareError
from tandem.models.resolve import ModelNotFoundError, resolve_model
from tandem.planner.config import add_load_scaling_args
from tandem.planner.sla import SlaPlanner
from tandem.runtime.config import ConfigError, env_str
from tandem.runtime.options import ROUTER_MODES

LABEL = "run"  # the launcher's own lines
_POLL_INTERVAL = 0.25


class LaunchError(Exception):
    """The deployment did not come up; `child` is the process to blame, if one is."""

    def __init__(self, message: str, child: Child | None = None) -> None:
        super().__init__(message)
        self.child = child


def build_parser() -> argparse.ArgumentParser:
    # Defaults are SUPPRESSed so that only flags actually given override the deployment file.
    parser = argparse.ArgumentParser(
        prog="tandem run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
        epilog="Everything after `--` is passed to every worker. Explicit flags override the file's values.",
    )
    parser.add_argument("-f", "--file", metavar="YAML", help="deployment file (YAML), see docs/launch.md")
    what = parser.add_argument_group("Deployment")
    what.add_argument("--model", metavar="M", help="model name, folder or hub id [default smollm2]")
    what.add_argument("--model-name", metavar="NAME", help="name clients use [default: the model's name]")
    what.add_argument("--engine", choices=ENGINES, metavar="ENGINE", help="worker engine: vllm or mocker [default vllm]")
    what.add_argument("--workers", type=int, metavar="N", help="aggregated workers [default 1]")
    what.add_argument("--prefill-workers", type=int, metavar="P", help="prefill workers (disaggregated; needs --decode-workers)")
    what.add_argument("--decode-workers", type=int, metavar="D", help="decode workers (disaggregated; needs --prefill-workers)")
    what.add_argument("--encode-workers", type=int, metavar="E",
                      help="encoder workers running the vision encoder for the aggregated or prefill workers "
                      "(vLLM's encoder-cache connector; the mocker simulates it for aggregated workers)")
    what.add_argument("--router-mode", choices=ROUTER_MODES, metavar="MODE", help=f"the frontend's routing: {', '.join(ROUTER_MODES)} [round-robin]")
    what.add_argument("--http-port", type=int, metavar="PORT", help="frontend port; 0 = any free one [default 8000]")
    what.add_argument("--namespace", metavar="NS", help="discovery namespace [env DYN_NAMESPACE, default dynamo]")
    what.add_argument("--discovery-backend", choices=("file", "etcd"), metavar="B",
                      help="file (a private directory) or etcd (the server at ETCD_ENDPOINTS) [default file]")
    what.add_argument("--request-plane", choices=("tcp", "nats"), metavar="P",
                      help="tcp (direct connections) or nats (the server at NATS_SERVER) [default tcp]")
    what.add_argument("--event-plane", choices=("zmq", "nats"), metavar="P",
                      help="zmq (direct connections) or nats (the server at NATS_SERVER) [default zmq]")
    what.add_argument("--no-frontend", action="store_true",
                      help="start only the workers, which join a deployment whose frontend runs elsewhere (needs "
                      "shared discovery: --discovery-backend etcd)")
    what.add_argument("--frontend-args", metavar="FLAGS",
                      help='extra frontend flags as one string: --frontend-args="--migration-limit 2"')
    place = parser.add_argument_group("Cores and ports")
    place.add_argument("--cores-per-worker", type=int, metavar="K", help="cores given to each engine process [default 1]")
    place.add_argument("--worker-cores", metavar="LISTS", help='explicit cores, one list per worker: "0;1" or "0-1;2-3"')
    place.add_argument("--system-port-base", type=int, metavar="PORT",
                       help="worker i serves /health and /metrics on this port + i [default: none]")
    plan = parser.add_argument_group("Planner (docs/planner.md)")
    plan.add_argument("--planner", choices=("sla", "load"),
                      help="size the worker groups to meet --ttft and --itl: from profiles and predicted traffic (sla), "
                      "or from the engines' load (load)")
    plan.add_argument("--planner-config", metavar="FILE", help="planner settings (YAML or JSON); flags override them")
    plan.add_argument("--ttft", type=float, metavar="MS", help="time-to-first-token target [500]")
    plan.add_argument("--itl", type=float, metavar="MS", help="inter-token-latency target [50]")
    plan.add_argument("--adjustment-interval", type=float, metavar="S", help="seconds between decisions [180]")
    plan.add_argument("--profile-results-dir", metavar="DIR", help="the workers' profiles (Dynamo's layout)")
    plan.add_argument("--load-predictor", metavar="KIND",
                      help="constant, moving-average, arima, kalman or prophet [arima]")
    plan.add_argument("--max-gpu-budget", type=int, metavar="N", help="engines' GPUs (here: workers) at most [8]")
    plan.add_argument("--min-endpoint", type=int, metavar="N", help="workers each group keeps at least [1]")
    plan.add_argument("--max-replica-change", type=int, metavar="N", help="workers a group gains or loses per decision")
    add_load_scaling_args(plan, "with --planner sla: load-based scaling too, above the SLA planner's floor")
    plan.add_argument("--disable-throughput-scaling", action="store_true", default=None,
                      help="load-based scaling only (as --planner load)")
    plan.add_argument("--planner-metrics-port", type=int, metavar="PORT",
                      help="serve the planner's decisions as Prometheus metrics [env PLANNER_PROMETHEUS_PORT]")
    life = parser.add_argument_group("Lifecycle")
    life.add_argument("--restart", action="store_true", help="restart a worker that dies (with backoff)")
    life.add_argument("--ready-timeout", type=float, metavar="S", help="seconds to wait for the model to be served [600]")
    life.add_argument("--stop-timeout", type=float, metavar="S", help="seconds a process gets to stop before SIGKILL [30]")
    return parser


def frontend_url(announced: str) -> str:
    """The frontend's READY address, with a wildcard host replaced by one a client can connect to."""
    parts = urlsplit(announced)
    if parts.hostname in ("0.0.0.0", "::", None):
        return urlunsplit(parts._replace(netloc=f"127.0.0.1:{parts.port}"))
    return announced


def curl_example(url: str, model: str, *, embeddings: bool = False) -> str:
    """A first request to try: a chat completion, or an embedding for an embedding model."""
    if embeddings:
        route, body = "embeddings", {"model": model, "input": ["What is the capital of France?"]}
    else:
        route = "chat/completions"
        body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    return f"curl -s {url}/v1/{route} -H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"


async def _probe(http: aiohttp.ClientSession, url: str, model: str, instances: set[int]) -> str | None:
    """What the frontend still lacks (None: it lists the model and routes to every worker)."""
    try:
        async with http.get(f"{url}/v1/models", ssl=False) as response:
            # 401: the frontend requires an API key; /health below still tells whether the workers are in.
            if response.status != 401:
                listed = [entry.get("id") for entry in (await response.json()).get("data", [])]
                if model not in listed:
                    return f"the frontend to list model {model!r}"
        async with http.get(f"{url}/health", ssl=False) as response:
            health = await response.json()
            seen = set(health.get("instances", [])) | set(health.get("prefill_instances", []))
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return f"the frontend to answer ({e.__class__.__name__})"
    missing = instances - seen
    if missing:
        return f"the frontend to see {len(missing)} more worker(s) of {len(instances)}"
    return None


async def wait_until_serving(supervisor: Supervisor, model: str, timeout: float) -> str | None:
    """The frontend's URL, once every process printed READY and the frontend serves `model` through every
    worker (None without a frontend: once every worker is ready). Raises LaunchError when a process ends for
    good first, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            for child in supervisor.children:
                if child.done.is_set():
                    raise LaunchError(f"{child.label} {describe_exit(child.returncode or 0)} before the deployment "
                                      "was ready", child)
            pending = next((child for child in supervisor.children if child.ready is None), None)
            if pending is None and supervisor.frontend is None:
                return None
            if pending is None:
                assert supervisor.frontend is not None and supervisor.frontend.ready
                url = frontend_url(supervisor.frontend.ready[0])
                waiting = await _probe(http, url, model, supervisor.expected_instances())
                if waiting is None:
                    return url
                culprit = supervisor.frontend
            else:
                waiting, culprit = f"{pending.label} to print READY", pending
            if time.monotonic() >= deadline:
                raise LaunchError(f"not serving after {timeout:g} s: still waiting for {waiting}", culprit)
            await asyncio.sleep(_POLL_INTERVAL)


def _discovery_of(spec: RunSpec) -> str:
    if spec.discovery_backend == "etcd":
        return f"etcd at {env_str('ETCD_ENDPOINTS') or 'localhost:2379'} (ETCD_ENDPOINTS)"
    return f"the directory {env_str('DYN_FILE_KV')} (DYN_FILE_KV)"


def _describe(spec: RunSpec) -> str:
    groups = ", ".join(f"{group.count} {'' if group.role == 'agg' else group.role + ' '}"
                       f"worker{'s' if group.count > 1 else ''}" for group in spec.workers)
    return f"{groups} ({spec.engine})"


async def run_deployment(spec: RunSpec, model_path: str, mux: LogMux | None = None) -> int:
    """Start the deployment, serve until a signal or the frontend dies, stop everything. Returns the exit code."""
    mux = mux or LogMux()
    mux.add_label(LABEL)

    def say(text: str) -> None:
        mux.line(LABEL, text)

    discovery_dir = env_str("DYN_FILE_KV")
    own_dir = discovery_dir is None
    if discovery_dir is None:
        discovery_dir = tempfile.mkdtemp(prefix="tandem-run-")
    # Encoders and their consumers share a directory of encoder outputs (this host's; on several hosts, give
    # every worker --ec-storage-path of a shared one).
    ec_storage = (tempfile.mkdtemp(prefix="tandem-encoder-cache-")
                  if spec.group("encode") and WORKER_COMMANDS[spec.engine].encoder_storage else "")
    plan = Plan(spec, model_path, discovery_dir, ec_storage=ec_storage, warn=say)
    supervisor = Supervisor(plan, mux)
    stop = asyncio.Event()
    sla: SlaPlanner | None = None
    if spec.planner is not None and spec.planner.enable_throughput_scaling:
        try:
            sla = SlaPlanner.from_config(spec.planner)
        except ConfigError as e:
            print(f"tandem run: {e}", file=sys.stderr)
            return 2

    def on_signal(signum: int) -> None:
        if stop.is_set():
            say(f"{signal.Signals(signum).name} again: killing everything now")
            supervisor.kill()
        else:
            say(f"{signal.Signals(signum).name}: stopping (again to kill at once)")
            stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    say(f"{plan.served_name} from {model_path}: {'' if spec.no_frontend else 'frontend + '}{_describe(spec)}")
    where = discovery_dir if spec.discovery_backend == "file" else _discovery_of(spec)
    say(f"discovery: {where} (namespace {spec.namespace}); cores available: {format_cores(plan.cores)}")
    if "nats" in (spec.request_plane, spec.event_plane):
        say(f"request plane {spec.request_plane}, event plane {spec.event_plane}: NATS at "
            f"{env_str('NATS_SERVER') or 'nats://localhost:4222'} (NATS_SERVER)")
    try:
        supervisor.start()
        return await _serve(supervisor, plan, stop, mux, sla)
    except BaseException:
        supervisor.kill()  # whatever went wrong in the launcher, leave no process behind
        raise
    finally:
        await supervisor.stop(spec.stop_timeout)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if own_dir:
            shutil.rmtree(discovery_dir, ignore_errors=True)
        if ec_storage:
            shutil.rmtree(ec_storage, ignore_errors=True)
        say("stopped")


async def _serve(supervisor: Supervisor, plan: Plan, stop: asyncio.Event, mux: LogMux,
                 sla: SlaPlanner | None = None) -> int:
    stopped = asyncio.create_task(stop.wait())
    ready = asyncio.create_task(wait_until_serving(supervisor, plan.served_name, plan.spec.ready_timeout))
    frontend = supervisor.frontend
    frontend_gone = asyncio.create_task(frontend.done.wait() if frontend is not None else asyncio.Event().wait())
    planning: asyncio.Task[None] | None = None
    try:
        await asyncio.wait({stopped, ready}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            return 0
        try:
            url = ready.result()
        except LaunchError as e:
            _report_failure(str(e), e.child)
            return 1
        if url is None:
            mux.plain(f"\n==> {len(supervisor.children)} worker(s) of {plan.served_name} ready and registered in "
                      f"{_discovery_of(plan.spec)} (namespace {plan.spec.namespace}), for a frontend elsewhere; "
                      "Ctrl-C stops them\n")
        else:
            mux.plain(f"\n==> serving {plan.served_name} at {url} (OpenAI API under /v1); Ctrl-C stops everything\n"
                      f"    {curl_example(url, plan.served_name, embeddings=plan.serves_embeddings)}\n")
            if plan.spec.planner is not None:
                mux.add_label("planner")
                port = env_str("PLANNER_PROMETHEUS_PORT")
                metrics_port = plan.spec.planner_metrics_port or (int(port) if port else None)
                planning = asyncio.create_task(run_planner(plan.spec.planner, sla, supervisor, url, stop,
                                                           lambda text: mux.line("planner", text), metrics_port))
        await asyncio.wait({stopped, frontend_gone}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            return 0
        assert frontend is not None
        _report_failure(f"the frontend {describe_exit(frontend.returncode or 0)}; stopping everything", frontend)
        return 1
    finally:
        for task in (stopped, ready, frontend_gone):
            task.cancel()
        if planning is not None:
            stop.set()  # the planner ends its interval; a scaling change in progress finishes first
            await asyncio.gather(planning, return_exceptions=True)


def _report_failure(reason: str, child: Child | None) -> None:
    print(f"tandem run: {reason}", file=sys.stderr)
    if child is not None and child.tail:
        print(f"tandem run: last lines of {child.label}:", *("    " + line for line in child.tail),
              sep="\n", file=sys.stderr)
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    own, worker_args = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
    parser = build_parser()
    flags = vars(parser.parse_args(own))
    path = flags.pop("file", None)
    try:
        spec = build_spec(flags, load_file(path) if path else None, source=path or "", worker_args=worker_args)
    except SpecError as e:
        parser.error(str(e))
    try:
        model_path = resolve_model(spec.model)  # once here: every process then loads the same folder
    except ModelNotFoundError as e:
        print(f"tandem run: {e}", file=sys.stderr)
        return 2
    except PrepareError as e:
        print(f"tandem run: cannot prepare {spec.model}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return asyncio.run(run_deployment(spec, model_path))


if __name__ == "__main__":
    sys.exit(main())
