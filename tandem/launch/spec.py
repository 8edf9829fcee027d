"""What `tandem run` deploys: a `RunSpec` built from defaults, then a YAML file, then command-line
flags (each later source wins). Every value is checked on the way in and a bad one raises `SpecError`
naming the key or flag, which the CLI turns into exit code 2.

YAML keys are the flag names with underscores, plus `frontend: {args, env}` and
`workers: [{role, count, args, env, cores}]`; see docs/launch.md.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from tandem.launch.cores import available_cores as machine_cores
from tandem.launch.cores import parse_cores
from tandem.planner.config import PlannerConfig, PlannerMode, read_settings
from tandem.runtime.config import ConfigError, env_str
from tandem.runtime.options import ROUTER_MODES

ROLES = ("agg", "prefill", "decode", "encode")
ENGINES = ("vllm", "mocker")
DEFAULT_MODEL = "smollm2"
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_-]+$")  # it becomes a segment of `ns.component.endpoint`


class SpecError(ValueError):
    """An invalid deployment description; the message names the offending key or flag."""


@dataclass
class FrontendSpec:
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class WorkerGroup:
    """`count` workers of one role, started with the same extra flags and environment."""

    role: str = "agg"
    count: int = 1
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Explicit cores, one entry per worker (worker k takes entry k mod len); None = round-robin.
    cores: list[tuple[int, ...]] | None = None


@dataclass
class RunSpec:
    model: str = DEFAULT_MODEL
    model_name: str | None = None  # served name; None = derived from the model (see plan.served_name)
    engine: str = "vllm"
    namespace: str = field(default_factory=lambda: env_str("DYN_NAMESPACE", "dynamo") or "dynamo")
    discovery_backend: str = "file"  # file: a private directory; etcd: the server ETCD_ENDPOINTS names
    request_plane: str = "tcp"  # nats: the server NATS_SERVER names
    # Only the workers, joining a deployment whose frontend runs elsewhere (e.g. a second host on etcd)
    no_frontend: bool = False
    event_plane: str = "zmq"
    http_port: int = 8000
    router_mode: str | None = None  # None = the frontend's own default
    restart: bool = False
    cores_per_worker: int = 1
    system_port_base: int | None = None
    ready_timeout: float = 600.0
    stop_timeout: float = 30.0
    frontend: FrontendSpec = field(default_factory=FrontendSpec)
    workers: list[WorkerGroup] = field(default_factory=lambda: [WorkerGroup()])
    planner: PlannerConfig | None = None  # the SLA planner sizes the worker groups while the run serves
    planner_metrics_port: int | None = None

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode workers (encoders serve aggregated workers)."""
        return any(group.role in ("prefill", "decode") for group in self.workers)

    def group(self, role: str) -> WorkerGroup | None:
        return next((group for group in self.workers if group.role == role), None)

    def validate(self, available_cores: Sequence[int]) -> None:
        roles = [group.role for group in self.workers]
        if not roles:
            raise SpecError("the deployment has no workers")
        if "agg" in roles and self.disaggregated:
            raise SpecError("aggregated (agg) workers cannot be mixed with prefill/decode workers")
        if self.disaggregated and not ("prefill" in roles and "decode" in roles):
            raise SpecError("a disaggregated deployment needs both prefill and decode workers "
                            "(--prefill-workers P --decode-workers D, each at least 1)")
        if "encode" in roles and not ("agg" in roles or "prefill" in roles):
            raise SpecError("encode workers encode the images of the workers that compute prompts: add --workers N "
                            "(or --prefill-workers P --decode-workers D)")
        if self.no_frontend:
            if self.discovery_backend == "file" and not env_str("DYN_FILE_KV"):
                raise SpecError("--no-frontend: workers without a frontend join another deployment through its "
                                "discovery: use --discovery-backend etcd (or DYN_FILE_KV naming a shared directory)")
            given = [flag for flag, value in (("--router-mode", self.router_mode),
                                              ("--frontend-args", self.frontend.args or None)) if value]
            if given:
                raise SpecError(f"--no-frontend: {', '.join(given)} would configure a frontend this run does not start")
        if self.planner is not None:
            if "encode" in roles:
                raise SpecError("--planner with encode workers: the planner does not size encoders yet")
            self._validate_planner(self.planner)
        elif self.planner_metrics_port is not None:
            raise SpecError("--planner-metrics-port: no planner runs (add --planner sla)")
        allowed = set(available_cores)
        for group in self.workers:
            for cores in group.cores or []:
                if not set(cores) <= allowed:
                    raise SpecError(f"{group.role} worker cores {','.join(map(str, cores))}: this process may only "
                                    f"use cores {','.join(map(str, sorted(allowed)))}")


    def _validate_planner(self, planner: PlannerConfig) -> None:
        if self.no_frontend:
            raise SpecError("--planner: the planner observes this run's frontend, and --no-frontend starts none")
        if "--num-processes" in self.frontend.args or any(a.startswith("--num-processes=") for a in self.frontend.args):
            raise SpecError("--planner: the planner reads one frontend process's metrics; leave out --num-processes")
        if planner.enable_throughput_scaling and planner.profile_results_dir is None:
            raise SpecError("--planner: the SLA planner needs the workers' profiles: --profile-results-dir DIR "
                            "(docs/planner.md); --planner load scales on the engines' load alone")


# -- value checks, shared by the YAML file and the flags ----------------------------------------------------------

Check = Callable[[Any, str], Any]


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _integer(low: int, high: int | None = None) -> Check:
    def check(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            bounds = f"between {low} and {high}" if high is not None else f">= {low}"
            raise SpecError(f"{where}: expected an integer {bounds}, got {value!r}")
        return value
    return check


def _seconds(minimum: float, inclusive: bool) -> Check:
    def check(value: Any, where: str) -> float:
        ok = (not isinstance(value, bool) and isinstance(value, int | float)
              and (value >= minimum if inclusive else value > minimum))
        if not ok:
            raise SpecError(f"{where}: expected a number of seconds {'>=' if inclusive else '>'} {minimum}, "
                            f"got {value!r}")
        return float(value)
    return check


def _one_of(choices: Sequence[str]) -> Check:
    def check(value: Any, where: str) -> str:
        if value not in choices:
            raise SpecError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")
        return str(value)
    return check


def _boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise SpecError(f"{where}: expected true or false, got {value!r}")
    return value


def _namespace(value: Any, where: str) -> str:
    if not isinstance(value, str) or not _NAMESPACE_RE.match(value):
        raise SpecError(f"{where}: expected letters, digits, '-' or '_', got {value!r}")
    return value


# Top-level scalar settings: YAML key (= flag dest) -> check.
_SETTINGS: dict[str, Check] = {
    "model": _text,
    "model_name": _text,
    "engine": _one_of(ENGINES),
    "namespace": _namespace,
    "discovery_backend": _one_of(("file", "etcd")),
    "request_plane": _one_of(("tcp", "nats")),
    "event_plane": _one_of(("zmq", "nats")),
    "http_port": _integer(0, 65535),
    "router_mode": _one_of(ROUTER_MODES),
    "restart": _boolean,
    "no_frontend": _boolean,
    "cores_per_worker": _integer(1),
    "system_port_base": _integer(1, 65535),
    "ready_timeout": _seconds(0, inclusive=False),
    "stop_timeout": _seconds(0, inclusive=True),
    "planner_metrics_port": _integer(1, 65535),
}
_FILE_KEYS = (*_SETTINGS, "frontend", "workers", "planner")
# `tandem run` flags that set a planner setting (the rest come from --planner-config or the file's `planner:`).
PLANNER_FLAGS = ("ttft", "itl", "adjustment_interval", "profile_results_dir", "load_predictor", "max_gpu_budget",
                 "max_replica_change", "min_endpoint", "load_adjustment_interval", "load_scaling_down_sensitivity",
                 "load_min_observations")
# Dynamo's switches for the two scaling modes: the flag -> (setting, value).
PLANNER_SWITCHES = {"enable_loadbased_scaling": ("enable_load_scaling", True),
                    "disable_throughput_scaling": ("enable_throughput_scaling", False)}
_GROUP_KEYS = ("role", "count", "args", "env", "cores")


def _args(value: Any, where: str) -> list[str]:
    """A list of flags, or one string split like a shell would."""
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list) and all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in value):
        return [str(v) for v in value]
    raise SpecError(f"{where}: expected a list of strings or one string, got {value!r}")


def _env(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: expected a mapping of variable names to values, got {value!r}")
    env = {}
    for name, item in value.items():
        if not isinstance(name, str) or not name or isinstance(item, Mapping | list) or item is None:
            raise SpecError(f"{where}.{name}: expected a string, number or boolean value, got {item!r}")
        env[name] = str(item).lower() if isinstance(item, bool) else str(item)
    return env


def _core_lists(value: Any, where: str) -> list[tuple[int, ...]]:
    """`"0;1;2-3"` or `["0", 1, "2-3"]`: one core list per worker."""
    items = value.split(";") if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise SpecError(f"{where}: expected one core list per worker, e.g. \"0;1\" or [\"0\", \"2-3\"], got {value!r}")
    try:
        return [parse_cores(str(item)) for item in items]
    except ValueError as e:
        raise SpecError(f"{where}: {e}") from None


def _unknown(mapping: Mapping[Any, Any], known: Sequence[str], where: str) -> None:
    for key in mapping:
        if key not in known:
            raise SpecError(f"{where}: unknown key {key!r} (known keys: {', '.join(known)})")


# -- building ------------------------------------------------------------------------------------------------------


def load_file(path: str) -> dict[str, Any]:
    """Read a deployment file; its top level must be a mapping."""
    try:
        with open(path) as f:
            document = yaml.safe_load(f)
    except OSError as e:
        raise SpecError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML: {e}") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise SpecError(f"{path}: expected a mapping of settings at the top level")
    return document


def _apply_document(spec: RunSpec, document: Mapping[str, Any], source: str) -> None:
    _unknown(document, _FILE_KEYS, source)
    for key, check in _SETTINGS.items():
        if document.get(key) is not None:  # `key: null` means "not set"
            setattr(spec, key, check(document[key], f"{source}: {key}"))
    frontend = document.get("frontend")
    if frontend is not None:
        where = f"{source}: frontend"
        if not isinstance(frontend, Mapping):
            raise SpecError(f"{where}: expected a mapping with args and env")
        _unknown(frontend, ("args", "env"), where)
        spec.frontend = FrontendSpec(args=_args(frontend.get("args", []), f"{where}.args"),
                                     env=_env(frontend.get("env", {}), f"{where}.env"))
    workers = document.get("workers")
    if workers is not None:
        if not isinstance(workers, list) or not workers:
            raise SpecError(f"{source}: workers: expected a non-empty list of worker groups")
        spec.workers = [_group(item, f"{source}: workers[{n}]") for n, item in enumerate(workers)]
        roles = [group.role for group in spec.workers]
        for n, role in enumerate(roles):
            if role in roles[:n]:
                raise SpecError(f"{source}: workers[{n}].role: a second group of role {role!r}; "
                                "give one group per role")


def _group(item: Any, where: str) -> WorkerGroup:
    if not isinstance(item, Mapping):
        raise SpecError(f"{where}: expected a mapping with role, count, args, env, cores")
    _unknown(item, _GROUP_KEYS, where)
    cores = item.get("cores")
    return WorkerGroup(
        role=_one_of(ROLES)(item.get("role", "agg"), f"{where}.role"),
        count=_integer(1)(item.get("count", 1), f"{where}.count"),
        args=_args(item.get("args", []), f"{where}.args"),
        env=_env(item.get("env", {}), f"{where}.env"),
        cores=_core_lists(cores, f"{where}.cores") if cores is not None else None,
    )


def _apply_counts(spec: RunSpec, counts: Mapping[str, int]) -> None:
    """Worker counts from flags. They choose the shape (aggregated or disaggregated); a group the file
    describes for a kept role keeps its args, env and cores."""
    shape = ("agg",) if "agg" in counts or (spec.group("agg") and not {"prefill", "decode"} & counts.keys()) \
        else ("prefill", "decode")
    roles = (*shape, "encode")
    groups = []
    for role in roles:
        group = spec.group(role)
        if role in counts:
            groups.append(replace(group or WorkerGroup(role=role), count=counts[role]))
        elif group is not None:
            groups.append(group)
    spec.workers = groups


def _split_cores(spec: RunSpec, text: str) -> None:
    """`--worker-cores "0;1;2-3"`: one entry per worker, in group order."""
    lists = _core_lists(text, "--worker-cores")
    total = sum(group.count for group in spec.workers)
    if len(lists) != total:
        raise SpecError(f"--worker-cores: {len(lists)} core lists for {total} workers; give one per worker")
    for group in spec.workers:
        group.cores, lists = lists[: group.count], lists[group.count :]


def _apply_planner(spec: RunSpec, flags: Mapping[str, Any], document: Mapping[str, Any] | None,
                   source: str) -> None:
    """The planner's settings: the file's `planner:` mapping, then --planner-config, then the flags; its mode
    follows the workers (aggregated or disaggregated)."""
    in_file = (document or {}).get("planner")
    given = [name for name in PLANNER_FLAGS if name in flags]
    switched = [name for name in PLANNER_SWITCHES if flags.get(name)]
    if in_file is None and "planner" not in flags and "planner_config" not in flags:
        if given or switched:
            raise SpecError(f"--{(given + switched)[0].replace('_', '-')} is a planner setting: add --planner sla "
                            "(or load)")
        return
    values: dict[str, Any] = {}
    where = source
    if in_file is not None:
        if not isinstance(in_file, Mapping):
            raise SpecError(f"{source}: planner: expected a mapping of planner settings")
        values.update(in_file)
        where = f"{source}: planner"
    try:
        if "planner_config" in flags:
            values.update(read_settings(flags["planner_config"]))
            where = flags["planner_config"]
        values.update({name: flags[name] for name in given})
        if flags.get("planner") == "load":  # load-based scaling alone: no profiles needed
            values.update(enable_load_scaling=True, enable_throughput_scaling=False)
        values.update(PLANNER_SWITCHES[name] for name in switched)
        mode = PlannerMode.DISAGG if spec.disaggregated else PlannerMode.AGG
        if values.get("mode", mode.value) != mode.value:
            raise SpecError(f"{where}: planner mode {values['mode']} does not fit the workers ({mode.value})")
        values["mode"] = mode.value
        if "environment" in values:  # where `tandem planner`'s decisions go; here they go to the run's own workers
            raise SpecError(f"{where}: planner setting environment is for `tandem planner`; `tandem run` scales "
                            "its own workers")
        spec.planner = PlannerConfig.from_mapping(values, where=where)
    except ConfigError as e:
        raise SpecError(str(e)) from None


def build_spec(flags: Mapping[str, Any], document: Mapping[str, Any] | None = None, *,
               source: str = "deployment file", worker_args: Sequence[str] = (),
               available_cores: Sequence[int] | None = None) -> RunSpec:
    """Defaults, then the file's `document`, then the flags that were given (argparse dests; absent = not given).

    `worker_args` (what followed `--`) go to every worker after the file's own args. Explicit cores must be
    among `available_cores` (default: this process's affinity)."""
    spec = RunSpec()
    if document is not None:
        _apply_document(spec, document, source)
    for key, check in _SETTINGS.items():
        if key in flags:
            setattr(spec, key, check(flags[key], "--" + key.replace("_", "-")))
    if "workers" in flags and ("prefill_workers" in flags or "decode_workers" in flags):
        raise SpecError("--workers cannot be combined with --prefill-workers/--decode-workers")
    counts = {role: flags[dest] for role, dest in (("agg", "workers"), ("prefill", "prefill_workers"),
                                                   ("decode", "decode_workers"), ("encode", "encode_workers"))
              if dest in flags}
    for role, count in counts.items():
        flag = "--workers" if role == "agg" else f"--{role}-workers"
        _integer(1)(count, flag)
    if counts:
        _apply_counts(spec, counts)
    if "worker_cores" in flags:
        _split_cores(spec, flags["worker_cores"])
    if "frontend_args" in flags:
        spec.frontend.args = [*spec.frontend.args, *shlex.split(flags["frontend_args"])]
    _apply_planner(spec, flags, document, source)
    for group in spec.workers:
        group.args = [*group.args, *worker_args]
    spec.validate(machine_cores() if available_cores is None else available_cores)
    return spec


__all__ = ["DEFAULT_MODEL", "ENGINES", "ROLES", "RunSpec", "FrontendSpec", "SpecError",
           "WorkerGroup", "build_spec", "load_file"]
