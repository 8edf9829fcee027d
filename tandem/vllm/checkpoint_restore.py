"""Checkpoint/restore ("chrek") lifecycle of the vLLM worker.

A Kubernetes DaemonSet CRIU-checkpoints a fully loaded worker and later restores it elsewhere.
Checkpoint mode is on when `DYN_READY_FOR_CHECKPOINT_FILE` is set:

* `DYN_CHECKPOINT_LOCATION`: full checkpoint path; its presence makes this process the checkpoint
  job. Otherwise `DYN_CHECKPOINT_PATH` + `DYN_CHECKPOINT_HASH` give `path/hash` (a regular worker).
  A variable set to an empty string counts as unset.
* `DYN_CHECKPOINT_STORAGE_TYPE`: `pvc` (default), `s3` or `oci`; only a `pvc` checkpoint can be seen
  locally (its directory exists), the others never "exist" from here.

Worker flow when `get_checkpoint_config()` returns a config: create the engine before the runtime
(no open connections at checkpoint time), then `await cfg.run_lifecycle(engine)`: sleep the engine,
write "ready" to the ready file (the readiness probe triggers the checkpoint), wait for SIGUSR1
(checkpoint done -> False: exit), SIGCONT (restored -> wake the engine -> True: go on starting up)
or SIGUSR2 (failure -> RuntimeError).

CPU: vLLM's CPU platform has no sleep mode (`enable_sleep_mode=True` is refused at engine creation,
so do not set it there -- see `platform_supports_sleep_mode()`); `run_lifecycle` then skips the sleep
and logs that memory is not released before the checkpoint. `wake_up()` is still called on restore
(vLLM accepts and ignores it without sleep mode).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

READY_FILE_ENV = "DYN_READY_FOR_CHECKPOINT_FILE"
LOCATION_ENV = "DYN_CHECKPOINT_LOCATION"
PATH_ENV = "DYN_CHECKPOINT_PATH"
HASH_ENV = "DYN_CHECKPOINT_HASH"
STORAGE_TYPE_ENV = "DYN_CHECKPOINT_STORAGE_TYPE"
STORAGE_TYPES = ("pvc", "s3", "oci")

_SIGNALS: dict[signal.Signals, str] = {
    signal.SIGUSR1: "checkpoint",
    signal.SIGCONT: "restore",
    signal.SIGUSR2: "failed",
}


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def platform_supports_sleep_mode() -> bool:
    """Whether vLLM's current platform has a sleep mode (False on CPU). Imports vLLM."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_sleep_mode_available())
    except Exception:
        log.debug("could not ask vLLM whether sleep mode is available", exc_info=True)
        return False


def engine_sleep_mode_enabled(engine: Any) -> bool:
    """Whether `engine` (an AsyncLLM) was created with sleep mode; asks the platform if unknown."""
    model_config = getattr(engine, "model_config", None)
    if model_config is None:
        model_config = getattr(getattr(engine, "vllm_config", None), "model_config", None)
    enabled = getattr(model_config, "enable_sleep_mode", None)
    if isinstance(enabled, bool):
        return enabled
    return platform_supports_sleep_mode()


@dataclass
class CheckpointConfig:
    """Parsed checkpoint settings (see `get_checkpoint_config`)."""

    ready_file: str
    location: str
    storage_type: str = "pvc"
    is_checkpoint_job: bool = False

    @classmethod
    def from_env(cls) -> CheckpointConfig:
        ready_file = _env(READY_FILE_ENV)
        if not ready_file:
            raise OSError(f"checkpoint mode needs {READY_FILE_ENV}")
        location = _env(LOCATION_ENV)
        is_job = bool(location)
        if not location:
            path, hash_ = _env(PATH_ENV).rstrip("/"), _env(HASH_ENV)
            if not path or not hash_:
                raise OSError(
                    f"checkpoint mode ({READY_FILE_ENV} is set) requires either {LOCATION_ENV} "
                    f"or both {PATH_ENV} and {HASH_ENV}"
                )
            location = f"{path}/{hash_}"
        storage_type = (_env(STORAGE_TYPE_ENV) or "pvc").lower()
        if storage_type not in STORAGE_TYPES:
            log.warning("unknown %s %r (expected one of %s); treating the checkpoint as remote",
                        STORAGE_TYPE_ENV, storage_type, ", ".join(STORAGE_TYPES))
        return cls(ready_file=ready_file, location=location, storage_type=storage_type, is_checkpoint_job=is_job)

    def checkpoint_exists(self) -> bool:
        """A completed checkpoint is its directory on the PVC; s3/oci checkpoints are never seen here."""
        if self.storage_type != "pvc":
            return False
        if os.path.isdir(self.location):
            log.info("existing checkpoint found at %s", self.location)
            return True
        log.info("no checkpoint at %s", self.location)
        return False

    async def run_lifecycle(self, engine: Any, sleep_level: int = 1) -> bool:
        """Sleep, signal readiness, wait for the watcher. True: restored (go on with the startup);
        False: checkpoint taken (exit). SIGUSR2 -> RuntimeError. The signal handlers are removed
        (and earlier ones put back) afterwards."""
        if engine_sleep_mode_enabled(engine):
            log.info("putting the engine to sleep (level=%d) for the checkpoint", sleep_level)
            await engine.sleep(level=sleep_level)
        else:
            log.warning(
                "vLLM sleep mode is not available (CPU platform or enable_sleep_mode off): the engine "
                "keeps its memory during the checkpoint"
            )
        loop = asyncio.get_running_loop()
        received: list[str] = []
        got_signal = asyncio.Event()

        def on_signal(name: str) -> None:
            if not received:
                received.append(name)
            got_signal.set()

        saved = _install_handlers(loop, {sig: (on_signal, name) for sig, name in _SIGNALS.items()})
        try:
            # Handlers first, then the ready file: the watcher may signal as soon as it sees it.
            _write_ready(self.ready_file)
            log.info(
                "ready for checkpoint (%s written); waiting for the watcher "
                "(SIGUSR1 = checkpoint done, SIGCONT = restored, SIGUSR2 = failed)", self.ready_file,
            )
            await got_signal.wait()
            event = received[0]
            if event == "restore":
                log.info("restore signal (SIGCONT): waking the engine up")
                await engine.wake_up()
                return True
            if event == "checkpoint":
                log.info("checkpoint completed (SIGUSR1)")
                return False
            raise RuntimeError("checkpoint failed (received SIGUSR2 from the watcher)")
        finally:
            _remove_handlers(loop, saved)


def _write_ready(path: str) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        f.write("ready")


_Saved = dict[signal.Signals, tuple[Any, Any]]


def _install_handlers(loop: asyncio.AbstractEventLoop, handlers: dict[signal.Signals, tuple[Any, str]]) -> _Saved:
    saved: _Saved = {}
    loop_handlers = getattr(loop, "_signal_handlers", None)
    try:
        for sig, (callback, arg) in handlers.items():
            previous_loop_handle = loop_handlers.get(sig) if isinstance(loop_handlers, dict) else None
            saved[sig] = (signal.getsignal(sig), previous_loop_handle)
            loop.add_signal_handler(sig, callback, arg)
    except BaseException:
        _remove_handlers(loop, saved)
        raise
    return saved


def _remove_handlers(loop: asyncio.AbstractEventLoop, saved: _Saved) -> None:
    for sig, (previous, previous_loop_handle) in saved.items():
        try:
            loop.remove_signal_handler(sig)
            if previous_loop_handle is not None:
                callback = getattr(previous_loop_handle, "_callback", None)
                if callback is not None:
                    loop.add_signal_handler(sig, callback, *getattr(previous_loop_handle, "_args", ()))
            elif previous is not None and previous != signal.getsignal(sig):
                signal.signal(sig, previous)
        except Exception:
            log.warning("could not restore the handler of %s", sig.name, exc_info=True)


def get_checkpoint_config() -> tuple[bool, CheckpointConfig | None]:
    """`(early_exit, config)` from the environment:

    * not in checkpoint mode (`DYN_READY_FOR_CHECKPOINT_FILE` unset) -> `(False, None)`;
    * checkpoint job whose checkpoint already exists -> `(True, None)`: exit at once (idempotent re-run);
    * regular worker and no checkpoint yet -> `(False, None)`: cold start;
    * otherwise -> `(False, config)`: run `config.run_lifecycle(engine)`.

    `EnvironmentError` (OSError) when the ready file is set but neither `DYN_CHECKPOINT_LOCATION`
    nor both `DYN_CHECKPOINT_PATH` and `DYN_CHECKPOINT_HASH` are.
    """
    if not _env(READY_FILE_ENV):
        return False, None
    cfg = CheckpointConfig.from_env()
    exists = cfg.checkpoint_exists()
    if cfg.is_checkpoint_job and exists:
        return True, None
    if not cfg.is_checkpoint_job and not exists:
        return False, None
    return False, cfg
