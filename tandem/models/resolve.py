"""Map the model name a user typed to what an engine should load: a local folder or a hub id."""

from __future__ import annotations

import os

from tandem.models.prepare import MODEL_NAME, is_default_model, is_prepared, model_dir, prepare_model


class ModelNotFoundError(ValueError):
    """The name points at something that is not there (a missing path, an unprepared default model)."""


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..")


def _from_hub_cache(repo_id: str, revision: str | None = None, *, cache_dir: str | None = None,
                    partial: bool = False) -> str | None:
    """The snapshot folder of `repo_id` at `revision` in the local HF cache (`cache_dir`, else the default),
    without touching the network. A snapshot known to lack some of the repo's files counts only if `partial`."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        # Ignoring every file skips huggingface_hub's completeness check, as vLLM's own offline lookup does.
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                 ignore_patterns="*" if partial else None)
    except (LocalEntryNotFoundError, HFValidationError):
        return None


def loaded_model_folder(model: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """Where the files of a model an engine has loaded are on this machine: `model` itself when it is a
    folder; for a hub id, its snapshot at `revision` in the HF cache (`cache_dir`, else the default),
    which the engine filled if it downloaded the model. Partial snapshots count: an engine fetches its
    weights, config and tokenizer, not every file of the repo. The hub id unchanged when no snapshot is
    there (the engine loaded it from elsewhere)."""
    if os.path.isdir(model):
        return model
    return _from_hub_cache(model, revision, cache_dir=cache_dir, partial=True) or model


def default_served_name(name: str, model_path: str) -> str:
    """The name a worker serves `name` under when none is given: the hub id for a model found in the HF
    cache (its folder there is a revision hash), else the folder's own name."""
    if os.path.basename(os.path.dirname(model_path.rstrip("/"))) == "snapshots":
        return name
    return os.path.basename(model_path.rstrip("/"))


def resolve_model(name: str, *, prepare: bool = True, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Resolve `name` to a local folder when one exists, else return the hub id for the engine to fetch.

    - the default model (`smollm2`, `SmolLM2-135M-Instruct`, `HuggingFaceTB/SmolLM2-135M-Instruct`):
      its prepared folder, converted first if `prepare` (else ModelNotFoundError when not prepared yet);
    - an existing local path (`~` expanded): its absolute path;
    - a hub id: its snapshot in the local HF cache if present, else the id unchanged.
    `cache_dir` overrides where prepared models live ($TANDEM_MODEL_CACHE, else ~/.cache/tandem/models).
    Raises ModelNotFoundError for a missing path, PrepareError when the default model cannot be converted.
    """
    if _looks_like_path(name):
        path = os.path.abspath(os.path.expanduser(name))
        if not os.path.exists(path):
            raise ModelNotFoundError(f"model path {name!r} does not exist")
        return path
    if is_default_model(name):
        if prepare:
            return str(prepare_model(cache_dir))
        folder = model_dir(cache_dir)
        if not is_prepared(folder):
            raise ModelNotFoundError(
                f"{MODEL_NAME} is not prepared in {folder}; run `tandem model prepare` first"
            )
        return str(folder)
    # A relative folder such as `models/foo` wins over the hub id of the same spelling, as in transformers.
    if os.path.exists(name):
        return os.path.abspath(name)
    return _from_hub_cache(name) or name
