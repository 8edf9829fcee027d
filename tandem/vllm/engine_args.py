"""The values Dynamo forces on vLLM's engine args, and tandem's CPU defaults: prefix caching, the block size,
the KV connector and KV event configs, NIXL's side channel (host and a claimed port), the thinking budget,
the dtype of `--dtype auto` on CPU (`cpu_dtype.py`).

`apply_engine_defaults` runs once `build_config` has parsed and validated the command line.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from typing import TYPE_CHECKING, Any

from tandem.vllm.cpu_dtype import apply_cpu_dtype

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from tandem.vllm.args import Config

log = logging.getLogger(__name__)

# Dynamo forces 16 tokens per KV block. vLLM's CPU attention backend only accepts multiples of 32
# ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])"), so CPU workers default to 32.
GPU_BLOCK_SIZE = 16
CPU_BLOCK_SIZE = 32
NIXL_CPU_EXTENSION = "tandem.vllm.nixl_cpu.NixlOnCpu"
NIXL_SIDE_CHANNEL_FIRST_PORT = 5600  # vLLM's default VLLM_NIXL_SIDE_CHANNEL_PORT

# --connector name -> the kv_transfer_config Dynamo builds for it.
_CONNECTOR_CONFIGS: dict[str, dict[str, Any]] = {
    "nixl": {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
    "lmcache": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
}


def _thinking_budget(config: Config) -> None:
    """With --dyn-reasoning-parser, tell vLLM where thinking starts and ends, so that a request's
    `max_thinking_tokens` (vLLM's thinking_token_budget) can force its end; a --reasoning-config or
    vLLM --reasoning-parser given by the user wins."""
    args = config.engine_args
    if config.dyn_reasoning_parser is None or args.reasoning_config is not None or args.reasoning_parser:
        return
    from vllm.config.reasoning import ReasoningConfig

    from tandem.llm.parsers import thinking_markers

    start, end = thinking_markers(config.dyn_reasoning_parser)
    args.reasoning_config = ReasoningConfig(reasoning_start_str=start, reasoning_end_str=end)


def apply_engine_defaults(config: Config) -> None:
    """The values Dynamo forces on vLLM's engine args and tandem's CPU defaults."""
    _thinking_budget(config)
    args = config.engine_args
    if args.enable_prefix_caching is None:
        args.enable_prefix_caching = True
    if args.block_size is None:
        args.block_size = CPU_BLOCK_SIZE if config.is_cpu else GPU_BLOCK_SIZE
    if ("nixl" in config.connector and (args.tensor_parallel_size or 1) == 1
            and args.distributed_executor_backend is None):
        # UniProcExecutor's GIL-bound busy loop starves NIXL's add_remote_agent (vLLM issue 29369).
        args.distributed_executor_backend = "mp"
    args.enable_log_requests = False
    args.disable_log_stats = False
    args.skip_tokenizer_init = False

    transfer = create_kv_transfer_config(config.connector)
    if transfer is not None:
        args.kv_transfer_config = transfer

    events = create_kv_events_config(config)
    args.kv_events_config = events
    config.use_kv_events = events is not None and bool(events.enable_kv_cache_events)
    if config.use_kv_events and events is not None:
        config.kv_events_port, config.kv_events_endpoint = _kv_events_address(events.endpoint,
                                                                              config.data_parallel_rank)

    if _uses_nixl(config):
        config.nixl_side_channel = _nixl_side_channel(config)
        if config.is_cpu:
            _load_nixl_cpu_extension(args)

    if config.is_cpu and config.cpu_cores:
        current = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if current:
            if current != config.cpu_cores:
                log.warning("--cpu-cores %s ignored: VLLM_CPU_OMP_THREADS_BIND=%s is already set",
                            config.cpu_cores, current)
        else:
            config.env_updates["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_cores
    elif config.cpu_cores and not config.is_cpu:
        log.warning("--cpu-cores %s ignored: vLLM is not running on its CPU backend", config.cpu_cores)
    if config.is_cpu:
        apply_cpu_dtype(config)
    if config.is_cpu and "VLLM_USE_AOT_COMPILE" not in os.environ:
        # vllm-cpu 0.32 saves its AOT-compiled model but cannot load it back ("'function' object has no
        # attribute 'finalize_loading'"), so every start compiled again (2-4 min on a 2-core host). Without
        # AOT compilation vLLM reuses its inductor cache: a restart warmed up in ~70 s instead of ~260 s.
        config.env_updates["VLLM_USE_AOT_COMPILE"] = "0"


def create_kv_transfer_config(connectors: list[str]) -> Any:
    """The KVTransferConfig Dynamo builds from a normalized connector list (one connector at most, see
    `_normalize_connectors`); None when the list is empty."""
    if not connectors:
        return None
    from vllm.config import KVTransferConfig

    [name] = connectors
    return KVTransferConfig(**_CONNECTOR_CONFIGS[name])


def create_kv_events_config(config: Config) -> Any:
    """Dynamo's `create_kv_events_config` (first match wins): decode workers and workers without prefix
    caching publish nothing; a user --kv-events-config is kept; otherwise ZMQ on DYN_VLLM_KV_EVENT_PORT."""
    args = config.engine_args
    # embeddings are routed by load, not by KV; an encoder's engine caches encoder outputs, not prompts
    if config.is_decode_worker or config.embedding_worker or config.vllm_native_encoder_worker:
        return None
    if not args.enable_prefix_caching:
        return None
    if args.kv_events_config is not None:
        if not args.kv_events_config.enable_kv_cache_events:
            log.warning("--kv-events-config has enable_kv_cache_events false: this worker publishes no KV "
                        "events and KV-aware routing will not see its cache")
        return args.kv_events_config
    from vllm.config import KVEventsConfig

    from tandem.vllm import envs

    # vLLM adds the data-parallel rank to the port itself; subtract it so the base port is honoured.
    port = envs.DYN_VLLM_KV_EVENT_PORT - config.data_parallel_rank
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}")


def _kv_events_address(endpoint: str | None, dp_rank: int) -> tuple[int | None, str | None]:
    """(port the publisher binds, address a local subscriber connects to), mirroring vLLM's
    `ZmqEventPublisher.offset_endpoint_port`. Non-TCP endpoints and port 0 give (None, endpoint)."""
    if not endpoint or not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        return None, endpoint
    host, _, port_text = endpoint[6:].rpartition(":")
    port = int(port_text)
    if port == 0:
        return None, None
    port += dp_rank
    if host in ("*", "0.0.0.0", "", "[::]", "::"):
        host = "127.0.0.1"
    return port, f"tcp://{host}:{port}"


def _uses_nixl(config: Config) -> bool:
    if "nixl" in config.connector:
        return True
    transfer = config.engine_args.kv_transfer_config
    if transfer is None:
        return False
    if transfer.kv_connector == "NixlConnector":
        return True
    nested = (transfer.kv_connector_extra_config or {}).get("connectors") or []
    return any(isinstance(c, dict) and c.get("kv_connector") == "NixlConnector" for c in nested)


def _load_nixl_cpu_extension(args: AsyncEngineArgs) -> None:
    """On CPU, load `tandem.vllm.nixl_cpu` into vLLM's model process (as its worker extension) so that the
    model stays on the engine's cores and NIXL's progress thread stops spinning there; see that module."""
    if args.worker_extension_cls:
        log.warning("--worker-extension-cls %s given: vLLM's NIXL connector may move the model off the engine's "
                    "cores and NIXL's progress thread will busy-poll them (add `import tandem.vllm.nixl_cpu` to "
                    "that module to avoid it)", args.worker_extension_cls)
        return
    args.worker_extension_cls = NIXL_CPU_EXTENSION


def _nixl_side_channel(config: Config) -> tuple[str, int]:
    """Host and port of NIXL's handshake listener. Dynamo sets the host only; tandem also claims a port
    (`_claim_port`), so that several workers on one host never collide on vLLM's fixed default (5600)."""
    host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST") or ""
    if not host:
        host = config.runtime.advertised_host()
        config.env_updates["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    dp_rank = config.data_parallel_rank
    port_text = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or ""
    if port_text:
        return host, int(port_text) + dp_rank
    # vLLM listens on VLLM_NIXL_SIDE_CHANNEL_PORT + data-parallel rank. CPU engines on different cores start
    # the search at different ports, so workers started together keep their ports from one start to the next.
    port = _claim_port(NIXL_SIDE_CHANNEL_FIRST_PORT + dp_rank + _first_core(config))
    config.env_updates["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port - dp_rank)
    return host, port


def _first_core(config: Config) -> int:
    """The lowest core a CPU engine binds to (--cpu-cores or VLLM_CPU_OMP_THREADS_BIND); 0 otherwise."""
    binding = (config.cpu_cores or os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "") if config.is_cpu else ""
    cores = [int(n) for n in re.findall(r"\d+", binding)]
    return min(cores, default=0)


# Locks on the side-channel ports this process claimed, held until it exits.
_claimed_ports: dict[int, int] = {}


def _claim_port(first: int) -> int:
    """The first port from `first` on that no other live tandem process on this host has claimed and that
    is free now; claimed until this process exits (a lock file per port).

    A restarted worker gets the same port back. That matters: the port (VLLM_NIXL_SIDE_CHANNEL_PORT) is
    one of the environment variables in the key of vLLM's torch.compile cache, so a new port per start
    would recompile the model every time (minutes on CPU)."""
    import fcntl
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), "tandem-nixl-side-channel")
    os.makedirs(folder, exist_ok=True)
    for port in range(first, min(first + 1000, 65536)):
        try:
            fd = os.open(os.path.join(folder, str(port)), os.O_CREAT | os.O_RDWR, 0o666)
        except OSError:  # another user's claim
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        if _port_free(port):
            _claimed_ports[port] = fd
            return port
        os.close(fd)  # releases the lock
    raise RuntimeError(f"no free TCP port for NIXL's side channel from {first}")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's ZMQ listener binds
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True
