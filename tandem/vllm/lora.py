"""Dynamic LoRA adapters for the vLLM worker.

* `LoRAManager` fetches an adapter named by a URI into a local cache (`DYN_LORA_PATH`): local
  folders (`file://` or a plain path) are copied in; other schemes need a registered custom source.
* `lora_name_to_id` gives every adapter name the same engine id in every process (Dynamo's).
* `LoRAService` implements the worker's `load_lora` / `unload_lora` / `list_loras` endpoints on an
  engine client with vLLM's `add_lora` / `remove_lora` (AsyncLLM), plus discovery callbacks. Every
  generation worker has them, prefill workers included: a disaggregated adapter request is prefilled
  with the adapter, on a prefill worker that loaded it.
* `install_lora_routes` puts `GET/POST /v1/loras` and `DELETE /v1/loras/{name}` on the system port.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from tandem.llm.model_card import ModelDeploymentCard, register_model
from tandem.runtime import keys

log = logging.getLogger(__name__)

_blake3: Any
try:  # Dynamo hashes adapter names with blake3 (a dependency of vLLM)
    from blake3 import blake3 as _blake3
except ImportError:  # pragma: no cover - vLLM always brings blake3
    _blake3 = None

ADAPTER_CONFIG = "adapter_config.json"
_MANIFEST = ".tandem_lora_source.json"  # written into each cached copy: where it came from
_TRUTHY = ("true", "1", "yes")


def lora_enabled() -> bool:
    """`DYN_LORA_ENABLED` lower-cased is true, 1 or yes.

    (Dynamo's Rust system server only adds the /v1/loras routes for the exact value `true`; here the
    routes and the manager follow the same, more lenient, rule.)
    """
    return os.environ.get("DYN_LORA_ENABLED", "").strip().lower() in _TRUTHY


def lora_name_to_id(name: str) -> int:
    """Dynamo's deterministic engine id for an adapter name: blake3(name), the first 8 bytes as a
    big-endian u64, `& 0x7FFFFFFF`, 0 -> 1. (`lora_name_to_id("test_lora") == 1983627077`.)

    Without the `blake3` package this falls back to blake2b-256 with the same post-processing: ids
    stay deterministic but differ from Dynamo's.
    """
    data = name.encode()
    digest = _blake3(data).digest() if _blake3 is not None else hashlib.blake2b(data, digest_size=32).digest()
    lora_id = int.from_bytes(digest[:8], "big") & 0x7FFFFFFF
    return lora_id or 1


# -- downloading ------------------------------------------------------------------------------------
class LoRASource(Protocol):
    """A custom source for one URI scheme (`register_custom_source`)."""

    async def exists(self, uri: str) -> bool: ...

    async def download(self, uri: str, dest: Path) -> Any:
        """Fill the directory `dest` with the adapter. May return another local path to use instead."""
        ...


class LoRAError(Exception):
    pass


def default_cache_dir() -> Path:
    if os.environ.get("DYN_LORA_PATH"):
        return Path(os.environ["DYN_LORA_PATH"]).expanduser()
    home = os.environ.get("HOME") or os.environ.get("USERPROFILE") or "/tmp"
    return Path(home) / ".cache" / "dynamo_loras"


def uri_to_cache_key(uri: str) -> str:
    """Folder name of `uri` in the cache: a readable tail plus a hash of the whole URI."""
    tail = uri.rstrip("/").rsplit("/", 1)[-1]
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in tail).strip("._")[:48] or "lora"
    return f"{slug}-{hashlib.sha256(uri.encode()).hexdigest()[:16]}"


class LoRAManager:
    """Fetches adapters into a local cache; `download_lora` never raises (except on cancellation).

    Local adapters (`file:///abs/dir`, `file://localhost/abs/dir` or a plain path) must be folders
    with `adapter_config.json` under an allowed root: `allowed_roots`, else `DYN_LORA_ALLOWED_ROOTS`
    (colon-separated; `/` allows any path, the old behaviour), else the cache folder (`DYN_LORA_PATH`).
    No path with a `..` component is accepted; the folder is resolved (symlinks followed) before the
    check, and so is every symlink inside it. Every refusal gives the same message, so that a caller
    cannot learn which paths exist. The folder is copied to `cache_dir/<key>` (copy into a temporary
    folder, then rename) and the copy is reused while the source's files (names, sizes, mtimes) are
    unchanged.

    Any other scheme goes through a source registered with `register_custom_source(scheme, source)`;
    its result is cached the same way and reused without asking the source again.
    """

    def __init__(
        self,
        cache_dir: str | None = None,
        allowed_roots: list[str] | None = None,
        sources: dict[str, LoRASource] | None = None,
    ) -> None:
        self._cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        if allowed_roots is None:
            env = os.environ.get("DYN_LORA_ALLOWED_ROOTS", "")
            allowed_roots = [root for root in env.split(":") if root] or [str(self._cache_root)]
        self.allowed_roots: list[Path] = [Path(root).expanduser().resolve() for root in allowed_roots]
        self._sources: dict[str, LoRASource] = dict(sources or {})

    @property
    def cache_root(self) -> Path:
        return self._cache_root

    def register_custom_source(self, scheme: str, source: LoRASource) -> None:
        """Serve `scheme://...` URIs (scheme without `://`, e.g. "s3") from `source`."""
        self._sources[scheme.lower()] = source

    def cache_path(self, uri: str) -> Path:
        return self._cache_root / uri_to_cache_key(uri)

    def is_cached(self, uri: str) -> bool:
        return (self.cache_path(uri) / _MANIFEST).is_file()

    async def download_lora(self, uri: str) -> dict[str, Any]:
        """`{"status": "success", "local_path": ...}` or `{"status": "error", "message": ...}`."""
        try:
            if not isinstance(uri, str) or not uri:
                raise LoRAError("LoRA URI must be a non-empty string")
            scheme = uri.split("://", 1)[0].lower() if "://" in uri else None
            if scheme in self._sources:
                local_path = await self._download_custom(scheme, uri)
            elif scheme in (None, "file"):
                local_path = await asyncio.to_thread(self._copy_local, uri)
            else:
                known = ", ".join(["file", *sorted(self._sources)])
                raise LoRAError(
                    f"unsupported LoRA URI scheme {scheme!r} in {uri!r} (supported: {known}); "
                    "register a custom source for it with LoRAManager.register_custom_source"
                )
            return {"status": "success", "local_path": str(local_path)}
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a trust boundary: report, never raise
            log.warning("LoRA download of %s failed: %s", uri, e)
            return {"status": "error", "message": str(e)}

    # -- local folders ----------------------------------------------------------------------------
    def local_path_of(self, uri: str) -> Path:
        """The checked, resolved adapter folder a local URI names (raises LoRAError)."""
        if uri.lower().startswith("file://"):
            raw = urllib.parse.unquote(uri[len("file://"):])
            if raw.startswith("localhost/"):
                raw = raw[len("localhost"):]
        else:
            raw = uri
        if not raw:
            raise LoRAError(f"LoRA URI {uri!r} names no path")
        refused = _refused(uri)
        path = Path(raw).expanduser()
        if ".." in path.parts or ".." in raw.replace("\\", "/").split("/"):
            raise refused
        try:
            resolved = path.resolve(strict=True)
        except (OSError, RuntimeError):
            raise refused from None
        if not self._allowed(resolved) or not resolved.is_dir() or not (resolved / ADAPTER_CONFIG).is_file():
            raise refused
        return resolved

    def _allowed(self, resolved: Path) -> bool:
        return any(resolved == root or resolved.is_relative_to(root) for root in self.allowed_roots)

    def _fingerprint(self, folder: Path) -> list[list[Any]] | None:
        """(name, size, mtime) of every file; None when a symlink in it leads outside the roots or nowhere."""
        entries: list[list[Any]] = []
        for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                full = Path(dirpath) / name
                if full.is_symlink():
                    try:
                        if not self._allowed(full.resolve(strict=True)):
                            return None
                    except (OSError, RuntimeError):
                        return None
                if full.is_file():
                    stat = full.stat()
                    entries.append([str(full.relative_to(folder)), stat.st_size, stat.st_mtime_ns])
        return entries

    def _copy_local(self, uri: str) -> Path:
        source = self.local_path_of(uri)
        files = self._fingerprint(source)
        if files is None:
            raise _refused(uri)
        manifest = {"uri": uri, "source": str(source), "files": files}
        dest = self.cache_path(uri)
        if self._read_manifest(dest) == manifest:
            return dest

        def fill(tmp: Path) -> None:
            shutil.copytree(source, tmp, symlinks=False, dirs_exist_ok=True)

        return self._install(dest, fill, manifest)

    # -- custom sources ---------------------------------------------------------------------------
    async def _download_custom(self, scheme: str, uri: str) -> Path:
        source = self._sources[scheme]
        dest = self.cache_path(uri)
        if self._read_manifest(dest) is not None:
            return dest
        if not await source.exists(uri):
            raise LoRAError(f"LoRA not found at {uri}")
        self._cache_root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=self._cache_root))
        try:
            returned = await source.download(uri, tmp)
            if returned is not None and Path(returned).resolve() != tmp.resolve():
                # the source keeps the adapter somewhere of its own
                local = Path(returned)
                if not (local / ADAPTER_CONFIG).is_file():
                    raise LoRAError(f"the {scheme} source put no {ADAPTER_CONFIG} in {local}")
                return local
            return await asyncio.to_thread(self._install, dest, lambda t: _move_contents(tmp, t), {"uri": uri})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    # -- the cache --------------------------------------------------------------------------------
    @staticmethod
    def _read_manifest(dest: Path) -> dict[str, Any] | None:
        try:
            with open(dest / _MANIFEST) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            return None
        if not (dest / ADAPTER_CONFIG).is_file():
            return None
        return manifest if isinstance(manifest, dict) else None

    def _install(self, dest: Path, fill: Callable[[Path], None], manifest: dict[str, Any]) -> Path:
        """Fill a fresh temporary folder next to `dest`, then rename it to `dest` (replacing a stale
        copy). Concurrent installs of the same URI are safe: the last rename wins, both are complete."""
        self._cache_root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=self._cache_root))
        try:
            fill(tmp)
            if not (tmp / ADAPTER_CONFIG).is_file():
                raise LoRAError(f"the downloaded LoRA has no {ADAPTER_CONFIG}")
            with open(tmp / _MANIFEST, "w") as f:
                json.dump(manifest, f)
            old: Path | None = None
            if dest.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=self._cache_root))
                try:
                    os.replace(dest, old / "adapter")
                except FileNotFoundError:  # another install moved it away meanwhile
                    pass
            try:
                os.rename(tmp, dest)
            except OSError:
                # another install of the same URI renamed its copy in first: use that one if complete
                if self._read_manifest(dest) is None:
                    raise
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            return dest
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _refused(uri: str) -> LoRAError:
    """The one answer to every local path refused: it must not tell which paths exist."""
    return LoRAError(f"LoRA source {uri!r} is not an adapter folder (one with {ADAPTER_CONFIG}) under the allowed "
                     "roots (DYN_LORA_ALLOWED_ROOTS; by default the LoRA cache folder, DYN_LORA_PATH)")


def _move_contents(src: Path, dst: Path) -> None:
    for entry in src.iterdir():
        shutil.move(str(entry), str(dst / entry.name))


_manager: LoRAManager | None = None
_manager_lock = threading.Lock()


def get_lora_manager() -> LoRAManager | None:
    """The process's LoRAManager, created on first use when DYN_LORA_ENABLED is truthy (else None;
    a failed creation logs a warning, returns None and is retried next time)."""
    global _manager
    if not lora_enabled():
        return None
    with _manager_lock:
        if _manager is None:
            try:
                _manager = LoRAManager()
                log.info("LoRAManager initialized (cache %s)", _manager.cache_root)
            except Exception as e:
                log.warning("could not initialize the LoRAManager: %s", e)
                return None
        return _manager


def reset_lora_manager() -> None:
    """Forget the singleton (tests; or after changing DYN_LORA_* variables)."""
    global _manager
    with _manager_lock:
        _manager = None


# -- the endpoints ----------------------------------------------------------------------------------
def _vllm_lora_request(**kwargs: Any) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(**kwargs)


class LoRAService:
    """The worker's `load_lora` / `unload_lora` / `list_loras` endpoints.

    `engine_client` has vLLM AsyncLLM's `async add_lora(LoRARequest)` and `async remove_lora(id)`.
    `register(name, id)` publishes the adapter in discovery after the engine has it, `unregister(name)`
    removes it (either may be None: no discovery). Each endpoint method is an async generator that
    yields exactly one dict. `request_class` builds the LoRARequest (default: vLLM's, imported lazily).
    """

    def __init__(
        self,
        engine_client: Any,
        *,
        register: Callable[[str, int], Awaitable[None]] | None = None,
        unregister: Callable[[str], Awaitable[None]] | None = None,
        manager_factory: Callable[[], LoRAManager | None] = get_lora_manager,
        request_class: Callable[..., Any] | None = None,
    ) -> None:
        self.engine_client = engine_client
        self.register = register
        self.unregister = unregister
        self.manager_factory = manager_factory
        self.request_class = request_class or _vllm_lora_request
        self.loaded: dict[str, int] = {}  # adapter name -> engine id
        self.paths: dict[str, str] = {}  # adapter name -> local folder
        self._locks: dict[str, asyncio.Lock] = {}
        self._locks_guard = threading.Lock()

    def _make_request(self, name: str, lora_id: int, path: str) -> Any:
        return self.request_class(lora_name=name, lora_int_id=lora_id, lora_path=path)

    def lora_request(self, model_name: str | None) -> Any:
        """The LoRARequest selecting adapter `model_name` when it is loaded, else None."""
        if not model_name or model_name not in self.loaded:
            return None
        return self._make_request(model_name, self.loaded[model_name], self.paths.get(model_name, ""))

    def _lock(self, name: str) -> asyncio.Lock:
        with self._locks_guard:
            lock = self._locks.get(name)
            if lock is None:
                lock = self._locks[name] = asyncio.Lock()
            return lock

    def _drop_lock(self, name: str, lock: asyncio.Lock) -> None:
        with self._locks_guard:
            if name not in self.loaded and self._locks.get(name) is lock:
                del self._locks[name]

    async def load_lora(self, request: Any = None, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """`{"lora_name": str, "source": {"uri": str}}` -> download, add to the engine, register."""
        try:
            if request is None:
                yield _err("Request is required with 'lora_name' and 'source.uri'")
                return
            name = request.get("lora_name")
            if not name:
                yield _err("'lora_name' is required in request")
                return
            source = request.get("source")
            if not source or not isinstance(source, dict):
                yield _err("'source' object is required in request")
                return
            uri = source.get("uri")
            if not uri:
                yield _err("'source.uri' is required in request")
                return
            manager = self.manager_factory()
            if manager is None:
                yield _err("LoRAManager not initialized. Set DYN_LORA_ENABLED=true to enable URI-based LoRA loading.")
                return
            lock = self._lock(name)
            async with lock:
                try:
                    if name in self.loaded:
                        yield {"status": "success", "message": f"LoRA adapter '{name}' already loaded",
                               "lora_name": name, "lora_id": self.loaded[name]}
                        return
                    log.info("downloading LoRA adapter %s from %s", name, uri)
                    result = await manager.download_lora(uri)
                    if result.get("status") != "success":
                        yield _err(f"Failed to download LoRA: {result.get('message', 'Unknown error')}")
                        return
                    path = str(result["local_path"])
                    lora_id = lora_name_to_id(name)
                    await self.engine_client.add_lora(self._make_request(name, lora_id, path))
                    self.loaded[name] = lora_id
                    self.paths[name] = path
                    if self.register is not None:
                        try:
                            await self.register(name, lora_id)
                        except Exception as e:
                            log.exception("could not publish LoRA %s; removing it from the engine", name)
                            try:
                                await self.engine_client.remove_lora(lora_id)
                            except Exception:
                                log.exception("rollback of LoRA %s failed", name)
                            self.loaded.pop(name, None)
                            self.paths.pop(name, None)
                            yield {"status": "error",
                                   "message": f"Failed to register LoRA '{name}' in discovery registry: {e}",
                                   "lora_name": name}
                            return
                    log.info("loaded LoRA adapter %s (id %d) from %s", name, lora_id, path)
                    yield {"status": "success", "message": f"LoRA adapter '{name}' loaded successfully",
                           "lora_name": name, "lora_id": lora_id}
                finally:
                    self._drop_lock(name, lock)
        except Exception as e:
            log.exception("load_lora failed")
            yield _err(str(e))

    async def unload_lora(self, request: Any = None, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """`{"lora_name": str}` -> remove from the engine and from discovery."""
        try:
            if request is None:
                yield _err("Request is required with 'lora_name' field")
                return
            name = request.get("lora_name")
            if not name:
                yield _err("'lora_name' is required in request")
                return
            lock = self._lock(name)
            async with lock:
                try:
                    if name not in self.loaded:
                        yield _err(f"LoRA adapter '{name}' not found. Available LoRAs: {list(self.loaded)}")
                        return
                    lora_id = self.loaded[name]
                    path = self.paths.get(name)
                    await self.engine_client.remove_lora(lora_id)
                    del self.loaded[name]
                    self.paths.pop(name, None)
                    if self.unregister is not None:
                        try:
                            await self.unregister(name)
                        except Exception as e:
                            log.exception("could not unpublish LoRA %s; adding it back to the engine", name)
                            if path is None:
                                log.error("cannot roll back LoRA %s: its path is unknown", name)
                            else:
                                try:
                                    await self.engine_client.add_lora(self._make_request(name, lora_id, path))
                                    self.loaded[name] = lora_id
                                    self.paths[name] = path
                                except Exception:
                                    log.exception("rollback of LoRA %s failed", name)
                            yield {"status": "error",
                                   "message": f"Failed to unregister LoRA '{name}' from discovery registry: {e}",
                                   "lora_name": name}
                            return
                    log.info("unloaded LoRA adapter %s (id %d)", name, lora_id)
                    yield {"status": "success", "message": f"LoRA adapter '{name}' unloaded successfully",
                           "lora_name": name, "lora_id": lora_id}
                finally:
                    self._drop_lock(name, lock)
        except Exception as e:
            log.exception("unload_lora failed")
            yield _err(str(e))

    async def list_loras(self, request: Any = None, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        try:
            loras = dict(self.loaded)
            yield {"status": "success", "loras": loras, "count": len(loras)}
        except Exception as e:
            yield _err(str(e))


def _err(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}


# -- discovery --------------------------------------------------------------------------------------
def card_callbacks(
    endpoint: Any, base_card: ModelDeploymentCard
) -> tuple[Callable[[str, int], Awaitable[None]], Callable[[str], Awaitable[None]]]:
    """`(register, unregister)` for `LoRAService` that publish / remove an adapter's model card
    (`v1/mdc/{ns}/{component}/{endpoint}/{instance:x}/{name}`): the base model's card renamed to the
    adapter, with `lora=LoraInfo(name, base_model)` and `user_data={"lora_adapter": True, "lora_id": id}`,
    so the frontend lists the adapter and routes requests for it to this instance (a prefill worker's card
    keeps its prefill type: the frontend sends it the adapter's prefills)."""

    async def register(name: str, lora_id: int) -> None:
        card = base_card.for_lora(name, {**(base_card.user_data or {}), "lora_adapter": True, "lora_id": lora_id})
        await register_model(endpoint, card)

    async def unregister(name: str) -> None:
        runtime = endpoint.runtime
        key = keys.model_key(endpoint.namespace, endpoint.component, endpoint.name, runtime.instance_id, name)
        await runtime.unregister_key(key)

    return register, unregister


# -- system-port routes -----------------------------------------------------------------------------
_RESPONSE_FIELDS = ("status", "message", "lora_name", "lora_id", "loras", "count")


async def _first(stream: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    async for message in stream:
        return {k: message[k] for k in _RESPONSE_FIELDS if message.get(k) is not None}
    raise RuntimeError("the LoRA endpoint returned no response")


def install_lora_routes(runtime: Any, service: LoRAService, *, enabled: bool | None = None) -> bool:
    """Serve `GET /v1/loras`, `POST /v1/loras` and `DELETE /v1/loras/{name}` (the name may contain
    `/`) on the system port, calling `service` in-process. Only when `enabled` (default:
    `DYN_LORA_ENABLED` is truthy) and the system status server runs; returns whether installed.

    Responses are the endpoint's message with HTTP 200 (errors reported by the endpoint included);
    a failure to call it gives 500 with `status: "error"`. A POST body that is not
    `{"lora_name": str, "source": {"uri": str}}` gives 422, like Dynamo's typed extractor.
    """
    if not (lora_enabled() if enabled is None else enabled):
        return False
    if getattr(runtime, "system_server", None) is None:
        return False

    async def call(stream: AsyncIterator[dict[str, Any]], name: str | None = None) -> tuple[int, Any]:
        try:
            return 200, await _first(stream)
        except Exception as e:
            log.exception("LoRA route failed")
            body: dict[str, Any] = {"status": "error", "message": str(e)}
            if name is not None:
                body["lora_name"] = name
            return 500, body

    async def list_route(body: Any, params: dict[str, str]) -> tuple[int, Any]:
        return await call(service.list_loras({}))

    async def load_route(body: Any, params: dict[str, str]) -> tuple[int, Any]:
        source = body.get("source") if isinstance(body, dict) else None
        if (
            not isinstance(body, dict) or not isinstance(body.get("lora_name"), str)
            or not isinstance(source, dict) or not isinstance(source.get("uri"), str)
        ):
            return 422, {"status": "error",
                         "message": 'request body must be {"lora_name": str, "source": {"uri": str}}'}
        name = body["lora_name"]
        return await call(service.load_lora({"lora_name": name, "source": {"uri": source["uri"]}}), name)

    async def unload_route(body: Any, params: dict[str, str]) -> tuple[int, Any]:
        name = params["name"].lstrip("/")
        return await call(service.unload_lora({"lora_name": name}), name)

    runtime.register_system_route("GET", "/v1/loras", list_route)
    runtime.register_system_route("POST", "/v1/loras", load_route)
    runtime.register_system_route("DELETE", "/v1/loras/{name:.+}", unload_route)
    return True
