"""`--dtype auto` on vLLM's CPU backend: the dtype follows the model's and the CPU's instruction sets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tandem.models import prepare_model
from tandem.vllm import cpu_dtype
from tandem.vllm.args import Config, build_config
from tandem.vllm.cpu_dtype import choose_cpu_dtype, cpu_flags

AVX2 = {"fpu", "sse4_2", "avx", "avx2", "fma", "f16c"}  # this machine: F16C converts, it does not compute
AVX512_BF16 = AVX2 | {"avx512f", "avx512bw", "avx512_bf16"}
SAPPHIRE_RAPIDS = AVX512_BF16 | {"avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"}
NEOVERSE_N1 = {"fp", "asimd", "fphp", "asimdhp", "asimddp"}  # half-precision arithmetic, no bf16
NEOVERSE_V1 = NEOVERSE_N1 | {"sve", "svebf16", "bf16", "i8mm"}
GRAVITON2_WITH_SVE_ONLY = NEOVERSE_N1 | {"sve"}  # SVE without its BF16 extension computes no bf16


@pytest.mark.parametrize(("model", "flags", "arch", "picked"), [
    # A bfloat16 model keeps bfloat16 only where the CPU computes it.
    ("bfloat16", AVX2, "x86", "float32"),
    ("bfloat16", AVX512_BF16, "x86", "bfloat16"),
    ("bfloat16", {"amx_bf16"}, "x86", "bfloat16"),
    ("bfloat16", NEOVERSE_N1, "arm", "float32"),
    ("bfloat16", GRAVITON2_WITH_SVE_ONLY, "arm", "float32"),
    ("bfloat16", NEOVERSE_V1, "arm", "bfloat16"),
    # float16 likewise, with the float16 instructions; bf16 alone is no reason to keep float16.
    ("float16", AVX2, "x86", "float32"),
    ("float16", AVX512_BF16, "x86", "float32"),
    ("float16", SAPPHIRE_RAPIDS, "x86", "float16"),
    ("float16", NEOVERSE_N1, "arm", "float16"),
    ("half", AVX2, "x86", "float32"),
    # A float32 model: vLLM's own cast to bfloat16 where bf16 is native, float32 otherwise.
    ("float32", AVX2, "x86", "float32"),
    ("float32", SAPPHIRE_RAPIDS, "x86", "bfloat16"),
    ("torch.float32", NEOVERSE_V1, "arm", "bfloat16"),
    # No dtype in the model's config: float32 without native bf16, vLLM's choice with it.
    (None, AVX2, "x86", "float32"),
    (None, AVX512_BF16, "x86", None),
])
def test_dtype_follows_model_and_instruction_sets(model: str | None, flags: set[str], arch: str,
                                                  picked: str | None) -> None:
    choice = choose_cpu_dtype("auto", model, flags, arch)
    assert choice.dtype == picked
    assert choice.reason


def test_reason_names_the_instruction_sets() -> None:
    assert "avx512_bf16" in choose_cpu_dtype("auto", "bfloat16", AVX2, "x86").reason
    assert "amx_bf16" in choose_cpu_dtype("auto", "bfloat16", SAPPHIRE_RAPIDS, "x86").reason


@pytest.mark.parametrize("requested", ["bfloat16", "float16", "half", "float32", "float"])
def test_explicit_dtype_is_kept(requested: str) -> None:
    for flags in (AVX2, SAPPHIRE_RAPIDS):
        assert choose_cpu_dtype(requested, "bfloat16", flags, "x86").dtype is None


def test_left_to_vllm_when_unknown_or_quantized() -> None:
    assert choose_cpu_dtype("auto", "bfloat16", None, "x86").dtype is None  # no /proc/cpuinfo
    assert choose_cpu_dtype("auto", "bfloat16", {"vsx"}, "ppc64le").dtype is None
    assert choose_cpu_dtype("auto", "bfloat16", AVX2, "x86", quantized=True).dtype is None


def test_float32_only_when_its_weights_fit() -> None:
    choice = choose_cpu_dtype("auto", "bfloat16", AVX2, "x86", float32_fits=False)
    assert choice.dtype is None and "memory" in choice.reason


def test_cpu_flags_from_cpuinfo(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma f16c\n\n"
                   "processor\t: 1\nflags\t\t: fpu avx2 fma f16c\n")
    assert cpu_flags(str(x86)) == {"fpu", "avx2", "fma", "f16c"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd asimdhp sve svebf16 bf16\n")
    assert cpu_flags(str(arm)) == {"fp", "asimd", "asimdhp", "sve", "svebf16", "bf16"}
    assert cpu_flags(str(tmp_path / "missing")) is None
    (tmp_path / "empty").write_text("processor\t: 0\n")
    assert cpu_flags(str(tmp_path / "empty")) is None


# -------------------------------------------------------------------------------------------------
# Through the worker's command line


@pytest.fixture
def flags(monkeypatch: pytest.MonkeyPatch):
    """Sets the CPU the worker sees: `flags(AVX2)`."""
    monkeypatch.setattr(cpu_dtype, "cpu_arch", lambda: "x86")

    def use(value: set[str]) -> None:
        monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: frozenset(value))
    return use


def build(*argv: str, is_cpu: bool = True) -> Config:
    return build_config(list(argv), is_cpu=is_cpu, apply_env=False)


def _model_folder(tmp_path: Path, **fields: object) -> str:
    """A copy of the default model's config.json with `fields` changed (the weights are not needed)."""
    config = json.loads((prepare_model() / "config.json").read_text())
    config.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_worker_picks_float32_for_bf16_model_without_native_bf16(flags) -> None:
    flags(AVX2)
    config = build()  # the default model, SmolLM2, is bfloat16
    assert config.engine_args.dtype == "float32"
    assert config.dtype_note and "float32" in config.dtype_note and "avx512_bf16" in config.dtype_note


def test_worker_keeps_bf16_where_the_cpu_computes_it(flags) -> None:
    flags(AVX512_BF16)
    config = build()
    assert config.engine_args.dtype == "bfloat16"
    assert config.dtype_note and "bfloat16" in config.dtype_note


def test_worker_keeps_an_explicit_dtype(flags) -> None:
    flags(AVX2)
    config = build("--dtype", "bfloat16")
    assert config.engine_args.dtype == "bfloat16" and config.dtype_note is None
    flags(SAPPHIRE_RAPIDS)
    assert build("--dtype", "float32").engine_args.dtype == "float32"


def test_worker_on_gpu_is_unchanged(flags) -> None:
    flags(AVX2)
    config = build(is_cpu=False)
    assert config.engine_args.dtype == "auto" and config.dtype_note is None


def test_worker_float16_model(flags, tmp_path: Path) -> None:
    model = _model_folder(tmp_path, dtype="float16")
    flags(AVX2)
    assert build("--model", model).engine_args.dtype == "float32"
    flags(SAPPHIRE_RAPIDS)
    assert build("--model", model).engine_args.dtype == "float16"


def test_worker_reads_torch_dtype_of_older_configs(flags, tmp_path: Path) -> None:
    config = json.loads((prepare_model() / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    flags(SAPPHIRE_RAPIDS)
    assert build("--model", str(tmp_path)).engine_args.dtype == "float16"


def test_worker_leaves_quantized_models_to_vllm(flags, tmp_path: Path) -> None:
    model = _model_folder(tmp_path, quantization_config={"quant_method": "awq", "bits": 4})
    flags(AVX2)
    config = build("--model", model)
    assert config.engine_args.dtype == "auto"
    assert config.dtype_note and "quantized" in config.dtype_note


def test_worker_keeps_bf16_when_float32_weights_would_not_fit(flags, tmp_path: Path) -> None:
    model = _model_folder(tmp_path)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with open(tmp_path / "model.safetensors", "wb") as f:  # sparse: bf16 weights of 20% of the RAM
        f.truncate(ram // 5)
    flags(AVX2)
    # float32 doubles them to 40% of the RAM: too much for an engine given 30% of it (the CPU default) ...
    assert build("--model", model).engine_args.dtype == "auto"
    # ... and fine for one given 90%.
    assert build("--model", model, "--gpu-memory-utilization", "0.9").engine_args.dtype == "float32"
