"""Discovery: where processes find each other. See `base.KeyValueStore` for the interface."""

from __future__ import annotations

import os
import tempfile

from tandem.runtime.discovery.base import KeyValueStore, Watch, WatchEvent
from tandem.runtime.discovery.etcd import EtcdConfig, EtcdStore
from tandem.runtime.discovery.file import FileStore
from tandem.runtime.discovery.mem import MemoryStore

BACKENDS = ("file", "mem", "etcd")


def default_file_root() -> str:
    return os.environ.get("DYN_FILE_KV") or os.path.join(tempfile.gettempdir(), "dynamo_store_kv")


def make_store(backend: str, *, file_root: str | None = None, ttl: float = 10.0) -> KeyValueStore:
    """Build the discovery store named by `--discovery-backend`."""
    backend = backend.lower()
    if backend == "file":
        return FileStore(file_root or default_file_root(), ttl=ttl)
    if backend == "mem":
        return MemoryStore()
    if backend == "etcd":
        return EtcdStore(EtcdConfig.from_env(), ttl=ttl)
    raise ValueError(f"unknown discovery backend {backend!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["KeyValueStore", "Watch", "WatchEvent", "EtcdStore", "FileStore", "MemoryStore", "make_store",
           "default_file_root"]
