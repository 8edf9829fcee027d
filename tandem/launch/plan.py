"""From a `RunSpec` to concrete processes: the command line, environment, cores and ports of each."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tandem.launch.cores import available_cores, format_cores, round_robin
from tandem.launch.spec import RunSpec, WorkerGroup
from tandem.models.prepare import MODEL_NAME, is_default_model

DEFAULT_KV_EVENT_PORT = 20080
# Variables naming a port one process binds: inherited by every child they would collide, so they are
# dropped (the launcher gives each worker its own KV event port and, if asked, system port).
_PER_PROCESS_ENV = ("DYN_SYSTEM_PORT", "DYN_TCP_RPC_PORT", "DYN_VLLM_KV_EVENT_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT")


@dataclass(frozen=True)
class WorkerCommand:
    """How to start one kind of worker."""

    module: str  # run as `python -m MODULE`
    model_flag: str  # given the resolved model folder
    name_flag: str  # given the served model name
    role_flags: Mapping[str, tuple[str, ...]]
    cpu_cores_flag: bool = False  # vLLM pins its OpenMP threads itself and must be told the cores
    agg_defaults: tuple[str, ...] = ()  # flag and value(s) for aggregated workers, unless the user gives the flag
    encoder_storage: bool = False  # encoders and their consumers share a directory of encoder outputs


_ROLE_SWITCHES = {"agg": (), "prefill": ("--is-prefill-worker",), "decode": ("--is-decode-worker",),
                  "encode": ("--enable-multimodal", "--vllm-native-encoder-worker")}
# With encode workers, the workers that compute prompts (aggregated or prefill) take images and have the encoders
# encode them; decode workers take the images too (the prompt they continue holds them) and compute none of it.
_CONSUMER_FLAGS = ("--enable-multimodal", "--ec-consumer-mode")
_DECODE_IMAGE_FLAGS = ("--enable-multimodal",)
EC_STORAGE_FLAG = "--ec-storage-path"
EMBEDDING_TRANSFER_FLAG = "--embedding-transfer-mode"
ENGINES: dict[str, WorkerCommand] = {
    # An aggregated vLLM worker moves no KV cache: without `--connector none` it would still set up NIXL.
    "vllm": WorkerCommand("tandem.vllm", "--model", "--served-model-name", _ROLE_SWITCHES, cpu_cores_flag=True,
                          agg_defaults=("--connector", "none"), encoder_storage=True),
    "mocker": WorkerCommand("tandem.mocker", "--model-path", "--model-name",
                            {"agg": (), "prefill": ("--disaggregation-mode", "prefill"),
                             "decode": ("--disaggregation-mode", "decode"), "encode": _ROLE_SWITCHES["encode"]}),
}


def served_name(model: str, model_path: str, explicit: str | None = None) -> str:
    """The name clients use: the explicit one; the default model's real name whichever alias chose it; a local
    folder's name; else the hub id as typed (as vLLM serves it)."""
    if explicit:
        return explicit
    if is_default_model(model):
        return MODEL_NAME
    if os.path.isdir(os.path.expanduser(model)):
        return os.path.basename(model_path.rstrip("/"))
    return model


def worker_label(role: str, index: int) -> str:
    return f"{'worker' if role == 'agg' else role}-{index}"


def _has_flag(args: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class ProcessSpec:
    """One process to run: the same spec is used again when it is restarted."""

    label: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cores: tuple[int, ...] | None = None  # CPU affinity; None = inherit


class Plan:
    """Builds the process specs of a deployment. Workers are numbered by `slot` (0, 1, ... over all groups),
    which picks their round-robin cores and their ports; a slot keeps its ports for the whole run."""

    def __init__(self, spec: RunSpec, model_path: str, discovery_dir: str, *, ec_storage: str = "",
                 environ: Mapping[str, str] = os.environ, cores: list[int] | None = None,
                 warn: Callable[[str], None] = lambda message: None) -> None:
        self.spec = spec
        self.model_path = model_path
        self.engine = ENGINES[spec.engine]
        self.served_name = served_name(spec.model, model_path, spec.model_name)
        self.cores = cores if cores is not None else available_cores()
        # where encode workers store encoder outputs for the aggregated workers, unless their args name one
        self.ec_storage = ec_storage
        self.warn = warn
        self._kv_event_base = int(environ.get("DYN_VLLM_KV_EVENT_PORT") or DEFAULT_KV_EVENT_PORT)
        self._kv_event_ports: dict[int, int] = {}
        self.common_env = {name: value for name, value in environ.items() if name not in _PER_PROCESS_ENV}
        self.common_env.update({
            # No external service by default; etcd and NATS: the servers ETCD_ENDPOINTS and NATS_SERVER name.
            "DYN_DISCOVERY_BACKEND": spec.discovery_backend, "DYN_REQUEST_PLANE": spec.request_plane,
            "DYN_EVENT_PLANE": spec.event_plane,
            "DYN_FILE_KV": discovery_dir, "DYN_NAMESPACE": spec.namespace,
            "PYTHONUNBUFFERED": "1",  # logs reach the launcher as they are written
        })

    @property
    def serves_embeddings(self) -> bool:
        """The workers serve an embedding model (vLLM's `--embedding-worker` / `--runner pooling`, or a
        simulated one with `--endpoint-types embedding`)."""
        for group in self.spec.workers:
            args = list(group.args)
            pairs = {f"{a}={b}" for a, b in zip(args, args[1:], strict=False)} | set(args)
            if pairs & {"--embedding-worker", "--runner=pooling", "--endpoint-types=embedding"}:
                return True
        return False

    def frontend(self) -> ProcessSpec:
        argv = [sys.executable, "-m", "tandem.frontend", "--http-port", str(self.spec.http_port)]
        if self.spec.router_mode:
            argv += ["--router-mode", self.spec.router_mode]
        # The frontend's drain ends a little before the launcher's kill, so that streams still running get
        # a "shutting down" error rather than a dropped connection.
        drain = {"DYN_RUNTIME_GRACEFUL_SHUTDOWN_TIMEOUT_SECS": f"{max(self.spec.stop_timeout - 2, 0):g}"}
        return ProcessSpec("frontend", (*argv, *self.spec.frontend.args),
                           {**drain, **self.common_env, **self.spec.frontend.env})

    def worker(self, group: WorkerGroup, index: int, slot: int) -> ProcessSpec:
        """Worker `index` of `group`, in deployment-wide `slot`."""
        engine = self.engine
        label = worker_label(group.role, index)
        cores = self.worker_cores(group, index, slot, label)
        argv = [sys.executable, "-m", engine.module, engine.model_flag, self.model_path,
                engine.name_flag, self.served_name, *engine.role_flags[group.role]]
        if engine.cpu_cores_flag:
            argv += ["--cpu-cores", format_cores(cores)]
        if group.role == "agg" and engine.agg_defaults and not _has_flag(group.args, engine.agg_defaults[0]):
            argv += engine.agg_defaults
        if group.role in ("agg", "prefill") and self.spec.group("encode"):
            argv += _CONSUMER_FLAGS
        if group.role == "decode" and self.spec.group("encode"):
            argv += _DECODE_IMAGE_FLAGS
        # A consumer taking the encoder outputs as embeddings reads the files its encoder names: no directory.
        takes_embeddings = group.role != "encode" and _has_flag(group.args, EMBEDDING_TRANSFER_FLAG)
        if (group.role in ("agg", "prefill", "encode") and self.spec.group("encode") and engine.encoder_storage
                and not _has_flag(group.args, EC_STORAGE_FLAG) and not takes_embeddings):
            argv += [EC_STORAGE_FLAG, self.ec_storage]
        env = {**self.common_env, "DYN_VLLM_KV_EVENT_PORT": str(self.kv_event_port(slot))}
        if self.spec.system_port_base is not None:
            env["DYN_SYSTEM_PORT"] = str(self.spec.system_port_base + slot)
        return ProcessSpec(label, (*argv, *group.args), {**env, **group.env}, cores)

    def worker_cores(self, group: WorkerGroup, index: int, slot: int, label: str) -> tuple[int, ...]:
        if group.cores:
            if index >= len(group.cores):
                self.warn(f"{label}: {len(group.cores)} core lists for more {group.role} workers; reusing them")
            return group.cores[index % len(group.cores)]
        cores, wrapped = round_robin(slot, self.spec.cores_per_worker, self.cores)
        if wrapped:
            self.warn(f"{label} shares cores {format_cores(cores)} with another engine: more engine processes "
                      f"than the {len(self.cores)} cores available ({self.spec.cores_per_worker} each)")
        return cores

    def kv_event_port(self, slot: int) -> int:
        """The port the engine of `slot` publishes KV events on: base + slot, or the next free one."""
        if slot not in self._kv_event_ports:
            taken = set(self._kv_event_ports.values())
            port = self._kv_event_base + slot
            while port in taken or not _port_is_free(port):
                port += 1
            self._kv_event_ports[slot] = port
        return self._kv_event_ports[slot]
