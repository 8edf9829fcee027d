"""Flags of `tandem mocker` (Dynamo's `python -m dynamo.mocker`).

Engine flags carry vLLM's names and defaults where vLLM has them; `--extra-engine-args` takes a JSON
file of the same options (underscored names) for values not given on the command line.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

from tandem.llm.model_card import ModelType
from tandem.mocker.offload import OffloadConfig
from tandem.mocker.scheduler import SchedulerConfig
from tandem.models import default_served_name, resolve_model
from tandem.runtime import RuntimeConfig
from tandem.runtime.keys import parse_endpoint_path
from tandem.runtime.options import (
    MIGRATION_LIMIT,
    Option,
    add_options,
    add_runtime_args,
)
from tandem.worker.config import (
    BLOCK_SIZE,
    CONTEXT_LENGTH,
    DEFAULT_ENDPOINT_TYPES,
    DISAGGREGATION_MODE,
    DURABLE_KV_EVENTS,
    ENDPOINT_TYPES,
    IS_DECODE_WORKER,
    IS_PREFILL_WORKER,
    MODEL_PATH,
    PARSER_OPTIONS,
    ROUTE_TO_ENCODER,
    SERVED_MODEL_NAME,
    DisaggregationMode,
    check_durable_kv_events,
    consumer_role,
    encoder_role,
    parser_options,
)
from tandem.worker.encoders import ENCODER_COMPONENT, chosen_role
from tandem.worker.images import SimulatedImages, add_image_args, simulated_images

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1, "int8": 1}


@dataclass
class MockerConfig:
    model_path: str
    served_model_name: str
    namespace: str
    component: str
    endpoint: str
    num_workers: int = 1
    data_parallel_size: int = 1  # engines (dp ranks) behind each worker instance
    engine: SchedulerConfig = field(default_factory=SchedulerConfig)
    speedup_ratio: float = 1.0
    decode_speedup_ratio: float = 1.0
    startup_time: float = 0.0
    planner_profile_data: str | None = None
    disaggregation_mode: DisaggregationMode = DisaggregationMode.AGGREGATED
    kv_transfer_bandwidth: float = 64.0  # GB/s; 0 disables the simulated transfer delay
    kv_bytes_per_token: int = 0
    # Offload tiers (KVBM's G2 host memory and G3 disk), simulated: blocks, and onboarding bandwidth in GB/s
    num_g2_blocks: int = 0
    num_g3_blocks: int = 0
    bandwidth_g2_to_g1_gbps: float = 14.0
    bandwidth_g3_to_g1_gbps: float = 2.0
    enable_conditional_disagg: bool = False
    context_length: int = 8192
    seed: int = 0
    answer_tokens: int | None = None  # the simulated model ends each answer (EOS) after this many tokens
    migration_limit: int = 0
    # Test hook (env DYN_MOCKER_DROP_KV_EVENTS, 0 = off): every Nth KV event is not published, as if lost.
    drop_kv_events: int = 0
    durable_kv_events: bool = False
    model_type: ModelType = ModelType.Chat | ModelType.Completions  # or Embedding: a simulated embedding model
    dyn_tool_call_parser: str | None = None  # put in the card: the frontend parses the (synthetic) output with them
    dyn_reasoning_parser: str | None = None
    images: SimulatedImages | None = None
    encoder: bool = False  # --vllm-native-encoder-worker: encodes the images of consumers' requests
    ec_consumer: bool = False  # --ec-consumer-mode: has encoder workers encode its requests' images
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    @property
    def is_prefill(self) -> bool:
        return self.disaggregation_mode is DisaggregationMode.PREFILL

    @property
    def publishes_kv_events(self) -> bool:
        """Decode workers publish none (as Dynamo's), unless conditional disaggregation needs their caches."""
        return self.engine.enable_prefix_caching and (
            self.disaggregation_mode is not DisaggregationMode.DECODE or self.enable_conditional_disagg)

    def offload(self) -> OffloadConfig:
        return OffloadConfig(self.num_g2_blocks, self.num_g3_blocks, self.bandwidth_g2_to_g1_gbps,
                             self.bandwidth_g3_to_g1_gbps, self.kv_bytes_per_token * self.engine.block_size)

    def kv_transfer_seconds(self, num_tokens: int) -> float:
        """Simulated NIXL transfer of a prompt's KV from a prefill to a decode worker (the whole prompt),
        in simulated seconds."""
        if self.kv_transfer_bandwidth <= 0:
            return 0.0
        return num_tokens * self.kv_bytes_per_token / (self.kv_transfer_bandwidth * 1e9)


_DROP_KV_EVENTS = Option("drop_kv_events", (), ("DYN_MOCKER_DROP_KV_EVENTS",),
                         "test hook: every Nth KV event is not published (0 = off)", kind=int, minimum=0)
_ENDPOINT = Option("endpoint", ("--endpoint",), ("DYN_ENDPOINT",), "dyn://namespace.component.endpoint to serve",
                   kind=str)
# The worker flags the mocker shares with the other worker kinds, with the mocker's defaults.
_MODEL_OPTIONS = (MODEL_PATH, SERVED_MODEL_NAME, _ENDPOINT)
_SERVING_OPTIONS = (MIGRATION_LIMIT, ENDPOINT_TYPES, *PARSER_OPTIONS, DURABLE_KV_EVENTS, CONTEXT_LENGTH)
_DISAGG_OPTIONS = (DISAGGREGATION_MODE, IS_PREFILL_WORKER, IS_DECODE_WORKER)

# Options `--extra-engine-args` may set, with the defaults used when neither it nor a flag does.
ENGINE_DEFAULTS: dict[str, object] = {
    "num_gpu_blocks": 16384, "block_size": 64, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
    "enable_prefix_caching": True, "enable_chunked_prefill": True, "watermark": 0.01, "preemption_mode": "lifo",
    "scheduler_reserve_full_isl": True,
    "seed": 0, "speedup_ratio": 1.0, "decode_speedup_ratio": 1.0, "startup_time": 0.0,
    "planner_profile_data": None, "disaggregation_mode": "agg", "kv_transfer_bandwidth": 64.0,
    "kv_bytes_per_token": None, "data_parallel_size": 1,
    "num_g2_blocks": 0, "num_g3_blocks": 0, "bandwidth_g2_to_g1_gbps": 14.0, "bandwidth_g3_to_g1_gbps": 2.0,
}
# Every flag's default, shown in --help.
_DEFAULTS = SimpleNamespace(
    **ENGINE_DEFAULTS, model_path="smollm2", served_model_name=None, migration_limit=0,
    endpoint_types=DEFAULT_ENDPOINT_TYPES, dyn_tool_call_parser=None, dyn_reasoning_parser=None,
    durable_kv_events=False, context_length=None, is_prefill_worker=False, is_decode_worker=False,
    allow_private_media_urls=False,
    endpoint="dyn://<namespace>.backend.generate (prefill workers: .prefill.generate)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem mocker", description="A simulated vLLM worker: real registration, tokenizer, KV events "
        "and load metrics; simulated scheduling and timing. Defaults match Dynamo's mocker. With "
        "--endpoint-types embedding it is a simulated embedding model: each input costs its prefill, the "
        "vectors are synthetic.",
    )
    model = parser.add_argument_group("Model and serving")
    add_options(model, _MODEL_OPTIONS, _DEFAULTS)
    model.add_argument("--num-workers", type=int, default=1, help="simulated engines in this process, each its own "
                       "worker instance [default 1]")
    model.add_argument("--data-parallel-size", "--dp-size", dest="data_parallel_size", type=int, default=None,
                       help="data-parallel ranks per worker instance, each its own engine, KV cache and KV event "
                       "stream; requests name theirs in routing.dp_rank [default 1]")
    add_options(model, _SERVING_OPTIONS, _DEFAULTS)
    engine = parser.add_argument_group("Simulated engine")
    engine.add_argument("--num-gpu-blocks-override", dest="num_gpu_blocks", type=int, default=None,
                        help="KV cache blocks per engine [16384]")
    BLOCK_SIZE.add_to(engine, _DEFAULTS.block_size)
    engine.add_argument("--max-num-seqs", type=int, default=None, help="running requests per step [256]")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step [8192]")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="[on]")
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                        help="[on]")
    engine.add_argument("--watermark", type=float, default=None, help="fraction of blocks kept free at admission [0.01]")
    engine.add_argument("--preemption-mode", choices=["lifo", "fifo"], default=None, help="[lifo]")
    engine.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction, default=None,
                        help="admit a request only when its whole prompt fits the free KV blocks, not just its "
                        "first chunk (vLLM's option) [on]")
    engine.add_argument("--seed", type=int, default=None,
                        help="seed of the synthetic output tokens (a request's own seed wins) [0]")
    engine.add_argument("--answer-tokens", type=int, default=None, metavar="N",
                        help="end each answer with EOS after N tokens, as a model that has said what it had to "
                        "(agent clients go on after an answer cut by max_tokens); requests with ignore_eos "
                        "still run to max_tokens [off: every answer runs to max_tokens]")
    timing = parser.add_argument_group("Timing")
    timing.add_argument("--speedup-ratio", type=float, default=None, help="run the timing model this many times "
                        "faster than real time [1.0]")
    timing.add_argument("--decode-speedup-ratio", type=float, default=None,
                        help="extra speedup of decode steps only, e.g. speculative decoding [1.0]")
    timing.add_argument("--startup-time", type=float, default=None, help="simulated engine start-up, seconds [0]")
    timing.add_argument("--planner-profile-data", default=None,
                        help="measured timings to interpolate (.npz as Dynamo's profiler writes, or .json with "
                        "the same keys) instead of the polynomial default")
    tiers = parser.add_argument_group("KV offload tiers (simulated host memory and disk below the KV pool)")
    tiers.add_argument("--num-g2-blocks", type=int, default=None,
                       help="host-memory tier: blocks the pool evicts go there, and a request loads the blocks "
                       "continuing its prefix match from it instead of computing them [0: no tiers]")
    tiers.add_argument("--num-g3-blocks", type=int, default=None,
                       help="disk tier: blocks the host tier evicts go there (needs --num-g2-blocks) [0]")
    tiers.add_argument("--bandwidth-g2-to-g1-gbps", type=float, default=None,
                       help="host → device onboarding bandwidth, GB/s (KV bytes per block from --kv-bytes-per-token) "
                       "[14]")
    tiers.add_argument("--bandwidth-g3-to-g1-gbps", type=float, default=None,
                       help="disk → device onboarding bandwidth, GB/s [2]")
    disagg = parser.add_argument_group("Disaggregation")
    add_options(disagg, _DISAGG_OPTIONS, _DEFAULTS)
    disagg.add_argument("--enable-conditional-disagg", action="store_true",
                        help="decode workers: publish KV events, so that a frontend with --router-conditional-disagg "
                        "can keep mostly cached prompts on them")
    disagg.add_argument("--kv-transfer-bandwidth", type=float, default=None,
                        help="simulated KV transfer bandwidth, GB/s; 0 disables the delay [64]")
    disagg.add_argument("--kv-bytes-per-token", type=int, default=None,
                        help="KV bytes per token [from config.json: layers*2*kv_heads*head_dim*dtype bytes]")
    disagg.add_argument("--kv-cache-dtype", default="auto", help="dtype of the simulated KV cache [the model's]")
    add_image_args(parser, _DEFAULTS)
    roles = parser.add_argument_group("encoder workers (as vLLM's encoder-cache connector roles, simulated)")
    roles.add_argument("--vllm-native-encoder-worker", action="store_true",
                       help="serve as an encoder (component encoder, no model registered): encode the images of the "
                       "requests of workers in --ec-consumer-mode, one request at a time, in --image-encode-ms each")
    roles.add_argument("--ec-consumer-mode", action="store_true",
                       help="have an encoder worker encode each request's images (this engine then spends no "
                       "encode time on them; it does when no encoder answers)")
    ROUTE_TO_ENCODER.add_to(roles, False)
    parser.add_argument("--extra-engine-args", default=None,
                        help="JSON file of engine options (e.g. {\"speedup_ratio\": 10}) for those not given as flags")
    add_runtime_args(parser)
    return parser


SCHEDULER_OPTIONS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                     "enable_chunked_prefill", "watermark", "preemption_mode", "scheduler_reserve_full_isl")
_ALIASES = {"num_gpu_blocks_override": "num_gpu_blocks", "dp_size": "data_parallel_size"}


def parse_args(argv: list[str] | None = None) -> MockerConfig:
    """Flags → MockerConfig; invalid input exits 2 with a message naming the option."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _config(args)
    except ValueError as e:
        parser.error(str(e))
        raise  # unreachable: parser.error exits


def _config(args: argparse.Namespace) -> MockerConfig:
    prefill, decode = (bool(option.value(args)) for option in (IS_PREFILL_WORKER, IS_DECODE_WORKER))
    mode = DISAGGREGATION_MODE.value(args)
    if mode is not None or prefill or decode:  # a role given as a flag wins over --extra-engine-args's
        args.disaggregation_mode = DisaggregationMode.of(mode, prefill, decode)
    options = dict(ENGINE_DEFAULTS)
    options.update(_extra_engine_args(args.extra_engine_args))
    options.update({k: getattr(args, k) for k in ENGINE_DEFAULTS if getattr(args, k) is not None})
    for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        if int(options[name]) <= 0:  # type: ignore[call-overload]
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {options[name]}")
    for name in ("speedup_ratio", "decode_speedup_ratio"):
        if float(options[name]) <= 0:  # type: ignore[arg-type]
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {options[name]}")
    if not 0 <= float(options["watermark"]) < 1:  # type: ignore[arg-type]
        raise ValueError(f"--watermark must be in [0, 1), got {options['watermark']}")
    for name in ("num_g2_blocks", "num_g3_blocks"):
        if int(options[name]) < 0:  # type: ignore[call-overload]
            raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {options[name]}")
    if int(options["num_g3_blocks"]) and not int(options["num_g2_blocks"]):  # type: ignore[call-overload]
        raise ValueError("--num-g3-blocks: the disk tier sits below a host tier; set --num-g2-blocks too")
    for name in ("bandwidth_g2_to_g1_gbps", "bandwidth_g3_to_g1_gbps"):
        if float(options[name]) <= 0:  # type: ignore[arg-type]
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {options[name]}")
    if int(options["data_parallel_size"]) < 1:  # type: ignore[call-overload]
        raise ValueError(f"--data-parallel-size must be at least 1, got {options['data_parallel_size']}")
    if args.num_workers < 1:
        raise ValueError(f"--num-workers must be at least 1, got {args.num_workers}")
    if args.answer_tokens is not None and args.answer_tokens < 1:
        raise ValueError(f"--answer-tokens must be at least 1, got {args.answer_tokens}")
    try:
        mode = DisaggregationMode(options["disaggregation_mode"])
    except ValueError:
        raise ValueError(f"disaggregation_mode must be one of {', '.join(DisaggregationMode)}, got "
                         f"{options['disaggregation_mode']!r}") from None
    args.ec_consumer_mode = consumer_role(mode, bool(ROUTE_TO_ENCODER.value(args)), args.ec_consumer_mode,
                                          args.enable_multimodal)
    if encoder_role(mode, args.enable_multimodal):  # the encoder role, whichever way it was named
        args.vllm_native_encoder_worker, mode = True, DisaggregationMode.AGGREGATED
    options["disaggregation_mode"] = mode
    if options["planner_profile_data"] and not os.path.isfile(str(options["planner_profile_data"])):
        raise ValueError(f"--planner-profile-data {options['planner_profile_data']}: no such file")

    drop_kv_events = _DROP_KV_EVENTS.value(args, 0)
    tool_call_parser, reasoning_parser = parser_options(args)
    model_type = ModelType.parse(ENDPOINT_TYPES.value(args, _DEFAULTS.endpoint_types))
    if model_type & ModelType.Embedding and (model_type != ModelType.Embedding or mode is not DisaggregationMode.AGGREGATED):
        raise ValueError("--endpoint-types embedding: an embedding model serves embeddings only, aggregated")

    model = MODEL_PATH.value(args, _DEFAULTS.model_path)
    model_path = resolve_model(model)
    model_config = _read_model_config(model_path)
    context_length = CONTEXT_LENGTH.value(args) or int(model_config.get("max_position_embeddings") or 8192)
    kv_bytes = options.pop("kv_bytes_per_token") or kv_bytes_per_token(model_config, args.kv_cache_dtype)
    images = _images(args, model_config, mode, model_type)
    engine = SchedulerConfig(num_blocks=int(options.pop("num_gpu_blocks")),  # type: ignore[call-overload]
                             **{name: options.pop(name) for name in SCHEDULER_OPTIONS})  # type: ignore[arg-type]

    runtime = RuntimeConfig.from_args(args)
    durable_kv_events = bool(DURABLE_KV_EVENTS.value(args, _DEFAULTS.durable_kv_events))
    check_durable_kv_events(durable_kv_events, runtime.event_plane)
    chosen_role((("--vllm-native-encoder-worker", args.vllm_native_encoder_worker),
                 ("--ec-consumer-mode", args.ec_consumer_mode)), images is not None,
                "a worker is the encoder or its consumer, not both")
    component = ENCODER_COMPONENT if args.vllm_native_encoder_worker else mode.default_component
    endpoint = _ENDPOINT.value(args) or f"dyn://{runtime.namespace}.{component}.generate"
    namespace, component, endpoint_name = parse_endpoint_path(endpoint)
    return MockerConfig(
        model_path=model_path,
        served_model_name=SERVED_MODEL_NAME.value(args) or default_served_name(model, model_path),
        namespace=namespace, component=component, endpoint=endpoint_name,
        num_workers=args.num_workers, migration_limit=MIGRATION_LIMIT.value(args, _DEFAULTS.migration_limit),
        context_length=context_length,
        enable_conditional_disagg=args.enable_conditional_disagg, drop_kv_events=drop_kv_events,
        durable_kv_events=durable_kv_events,
        kv_bytes_per_token=int(kv_bytes), runtime=runtime.replace(namespace=namespace), engine=engine,
        dyn_tool_call_parser=tool_call_parser, dyn_reasoning_parser=reasoning_parser, model_type=model_type,
        answer_tokens=args.answer_tokens, images=images, encoder=args.vllm_native_encoder_worker,
        ec_consumer=args.ec_consumer_mode, **options,  # type: ignore[arg-type]
    )


def _images(args: argparse.Namespace, model_config: dict[str, object], mode: DisaggregationMode,
            model_type: ModelType) -> SimulatedImages | None:
    """--enable-multimodal and its options, checked against the model and the worker's role (a prefill or
    decode worker takes images too: the prompt it computes or continues holds them)."""
    if args.enable_multimodal and model_type & ModelType.Embedding:
        raise ValueError("--enable-multimodal: images are taken by generation workers only")
    if args.ec_consumer_mode and mode is DisaggregationMode.DECODE:
        raise ValueError("--ec-consumer-mode with a decode worker: a decode worker gets the prompt's KV cache from "
                         "its prefill worker; make the prefill worker the encoders' consumer")
    return simulated_images(args, model_config)


def _extra_engine_args(path: str | None) -> dict[str, object]:
    if not path:
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--extra-engine-args {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--extra-engine-args {path}: expected a JSON object")
    options: dict[str, object] = {}
    for key, value in raw.items():
        name = _ALIASES.get(key, key)
        if name not in ENGINE_DEFAULTS:
            raise ValueError(f"--extra-engine-args {path}: unknown option {key!r}")
        options[name] = value
    return options


def _read_model_config(folder: str) -> dict[str, object]:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return {}


def kv_bytes_per_token(model_config: dict[str, object], kv_cache_dtype: str = "auto") -> int:
    """layers * 2 (K and V) * kv heads * head dim * bytes per element, as Dynamo computes it."""
    def number(key: str, default: int) -> int:
        value = model_config.get(key)
        return int(value) if isinstance(value, int | float) else default  # type: ignore[arg-type]

    layers = number("num_hidden_layers", 32)
    heads = number("num_attention_heads", 32)
    kv_heads = number("num_key_value_heads", heads)
    head_dim = number("head_dim", number("hidden_size", 4096) // max(heads, 1))
    dtype = str(model_config.get("torch_dtype") or model_config.get("dtype") or "bfloat16") \
        if kv_cache_dtype == "auto" else kv_cache_dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"--kv-cache-dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    return layers * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]
