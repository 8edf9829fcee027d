"""Discovery in a shared directory, for processes on one machine (Dynamo's `file` backend).

A bucket (the first two key segments, `v1/instances`) is a directory; a key is a file named by the
URL-quoted rest of the key. Writes go to a temp file then rename, so readers never see half a value.
Leases are emulated with mtimes: a leased file's mtime is its expiry time. A thread pushes this
process's expiries to now + TTL every TTL/3, and every process deletes files whose expiry has
passed, so a crashed peer's keys vanish within its TTL, whatever TTL the other processes use.
Watches poll the bucket directories (inode changes reveal overwrites).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from urllib.parse import quote, unquote

from tandem.runtime.discovery.base import KeyValueStore, Watch, WatchEvent, new_lease_id

log = logging.getLogger(__name__)

_TMP = ".tmp_"
_TMP_MAX_AGE = 60.0  # a temp file is renamed within microseconds; older ones were left by a crash
_KEEP = "@keep"  # suffix of keys written with leased=False; "@" never appears in a quoted name


def _split(key: str) -> tuple[str, str]:
    parts = key.split("/")
    cut = 2 if len(parts) > 2 else 1
    bucket, rest = "/".join(parts[:cut]), "/".join(parts[cut:])
    if not bucket or not rest:
        raise ValueError(f"discovery key {key!r} needs a bucket and a name (e.g. 'v1/instances/...')")
    return bucket, rest


class FileStore(KeyValueStore):
    def __init__(self, root: str, *, ttl: float = 10.0, poll_interval: float = 0.1) -> None:
        self.root = os.path.abspath(root)
        self.ttl = ttl
        self.lease_id = new_lease_id()
        self._poll_interval = poll_interval
        self._owned: dict[str, tuple[bytes, bool]] = {}  # key -> (value, leased)
        self._owned_lock = threading.Lock()
        self._watches: list[Watch] = []
        self._watch_state: dict[int, dict[str, tuple[int, int]]] = {}  # id(watch) -> key -> (inode, size)
        self._poller: asyncio.Task[None] | None = None

    # -- paths -------------------------------------------------------------------------------
    def _path(self, key: str, leased: bool = True) -> str:
        bucket, rest = _split(key)
        return os.path.join(self.root, bucket, quote(rest, safe="") + ("" if leased else _KEEP))

    def _paths(self, key: str) -> tuple[str, str]:
        return self._path(key, True), self._path(key, False)

    def _buckets_for(self, prefix: str) -> list[str]:
        """Bucket directories (relative, `/`-joined) that can hold keys under `prefix`."""
        if prefix.count("/") >= 2:  # the bucket is fully named
            return ["/".join(prefix.split("/")[:2])]
        found = []
        for dirpath, dirnames, _ in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            if rel == ".":
                continue
            if rel.count("/") >= 1:
                dirnames.clear()  # buckets are at most two levels deep
            bucket = rel + "/"
            if bucket.startswith(prefix) or prefix.startswith(bucket):
                found.append(rel)
        return found

    def _scan(self, bucket: str) -> dict[str, tuple[int, int, str]]:
        """key -> (inode, size, path) for the live files of a bucket."""
        out: dict[str, tuple[int, int, str]] = {}
        try:
            entries = list(os.scandir(os.path.join(self.root, bucket)))
        except FileNotFoundError:
            return out
        for entry in entries:
            name = entry.name
            if name.startswith(_TMP) or not entry.is_file(follow_symlinks=False):
                continue
            try:
                size = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            if name.endswith(_KEEP):
                name = name[: -len(_KEEP)]
            out[f"{bucket}/{unquote(name)}"] = (entry.inode(), size, entry.path)
        return out

    # -- writes ------------------------------------------------------------------------------
    def _write_file(self, path: str, value: bytes, *, exclusive: bool) -> bool:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f"{_TMP}{secrets.token_hex(8)}")
        with open(tmp, "wb") as f:
            f.write(value)
        if not path.endswith(_KEEP):
            now = time.time()
            os.utime(tmp, (now, now + self.ttl))
        try:
            if exclusive:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    return False
                return True
            os.replace(tmp, path)
            return True
        finally:
            if exclusive or os.path.exists(tmp):
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    async def put(self, key: str, value: bytes, *, leased: bool = True) -> None:
        leased_path, keep_path = self._paths(key)
        self._write_file(leased_path if leased else keep_path, value, exclusive=False)
        stale = keep_path if leased else leased_path
        if os.path.exists(stale):
            os.unlink(stale)
        with self._owned_lock:
            self._owned[key] = (value, leased)

    async def create(self, key: str, value: bytes, *, leased: bool = True) -> bool:
        leased_path, keep_path = self._paths(key)
        if os.path.exists(keep_path if leased else leased_path):
            return False
        if not self._write_file(leased_path if leased else keep_path, value, exclusive=True):
            return False
        with self._owned_lock:
            self._owned[key] = (value, leased)
        return True

    async def get(self, key: str) -> bytes | None:
        for path in self._paths(key):
            try:
                with open(path, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                continue
        return None

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for bucket in self._buckets_for(prefix):
            for key, (_, _, path) in self._scan(bucket).items():
                if key.startswith(prefix):
                    value = _read(path)
                    if value is not None:
                        out[key] = value
        return out

    async def delete(self, key: str) -> None:
        with self._owned_lock:
            self._owned.pop(key, None)
        for path in self._paths(key):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # -- lease emulation (a thread, so a busy event loop does not let our keys expire) --------
    async def start(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        _Keeper.join(self)

    def _touch_owned(self) -> None:
        with self._owned_lock:
            owned = [(k, v) for k, (v, leased) in self._owned.items() if leased]
        for key, value in owned:
            path = self._path(key)
            now = time.time()
            try:
                os.utime(path, (now, now + self.ttl))
            except FileNotFoundError:
                # Reaped while we were stalled longer than the TTL: we are alive, so re-register.
                log.warning("discovery key %s expired while this process was alive; re-creating it", key)
                try:
                    self._write_file(path, value, exclusive=False)
                except OSError as e:
                    log.error("cannot re-create discovery key %s: %s", key, e)

    # -- watches -----------------------------------------------------------------------------
    async def watch_prefix(self, prefix: str) -> Watch:
        watch = Watch(prefix, on_close=self._forget)
        state: dict[str, tuple[int, int]] = {}
        for bucket in self._buckets_for(prefix):
            for key, (inode, size, path) in self._scan(bucket).items():
                if key.startswith(prefix):
                    value = _read(path)
                    if value is not None:
                        state[key] = (inode, size)
                        watch._replay(key, value)
        self._watch_state[id(watch)] = state
        self._watches.append(watch)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll(), name="tandem-file-kv-watch")
        return watch

    def _forget(self, watch: Watch) -> None:
        if watch in self._watches:
            self._watches.remove(watch)
        self._watch_state.pop(id(watch), None)

    async def _poll(self) -> None:
        while self._watches:
            await asyncio.sleep(self._poll_interval)
            scans: dict[str, dict[str, tuple[int, int, str]]] = {}
            for watch in list(self._watches):
                current: dict[str, tuple[int, int, str]] = {}
                for bucket in self._buckets_for(watch.prefix):
                    if bucket not in scans:
                        scans[bucket] = self._scan(bucket)
                    current.update((k, v) for k, v in scans[bucket].items() if k.startswith(watch.prefix))
                previous = self._watch_state.get(id(watch))
                if previous is None:
                    continue
                for key in [k for k in previous if k not in current]:
                    del previous[key]
                    watch._push(WatchEvent("delete", key))
                for key, (inode, size, path) in current.items():
                    if previous.get(key) != (inode, size):
                        value = _read(path)
                        if value is None:
                            continue
                        previous[key] = (inode, size)
                        watch._push(WatchEvent("put", key, value))

    async def close(self) -> None:
        keeper = _Keeper.leave(self)
        for watch in list(self._watches):
            watch.close()
        if self._poller is not None:
            self._poller.cancel()
        with self._owned_lock:
            owned = [k for k, (_, leased) in self._owned.items() if leased]
        for key in owned:
            await self.delete(key)
        if keeper is not None:
            keeper.join(timeout=2)


class _Keeper:
    """The lease thread of one discovery directory, shared by every store of this process on it: it
    pushes each store's expiries every TTL/3 and deletes expired files. A process holding many workers
    (the mocker's --num-workers) would otherwise run a thread per worker, each walking the whole
    directory twice a second (32 workers: 16% of a core, idle)."""

    _by_root: dict[str, _Keeper] = {}
    _lock = threading.Lock()

    def __init__(self, root: str) -> None:
        self.root = root
        self.pid = os.getpid()  # a forked child inherits the registry, not the thread
        self.stores: dict[FileStore, float] = {}  # store -> when its keys are due for a touch
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tandem-file-kv", daemon=True)

    @classmethod
    def join(cls, store: FileStore) -> None:
        with cls._lock:
            keeper = cls._by_root.get(store.root)
            if keeper is None or keeper.pid != os.getpid():
                keeper = cls._by_root[store.root] = _Keeper(store.root)
                keeper.thread.start()
            keeper.stores[store] = 0.0

    @classmethod
    def leave(cls, store: FileStore) -> threading.Thread | None:
        """Stop keeping `store`'s keys; returns the thread to wait for when it was the last store."""
        with cls._lock:
            keeper = cls._by_root.get(store.root)
            if keeper is None or keeper.stores.pop(store, None) is None or keeper.stores:
                return None
            del cls._by_root[store.root]
            keeper.stop.set()
            return keeper.thread

    def _run(self) -> None:
        reap_every = 0.0  # the first pass at once
        while not self.stop.wait(reap_every):
            with self._lock:
                due = list(self.stores.items())
            now = time.time()
            for store, next_touch in due:
                if now >= next_touch:
                    store._touch_owned()
                    with self._lock:
                        if store in self.stores:
                            self.stores[store] = now + max(store.ttl / 3, 0.05)
            self._reap(now)
            reap_every = max(min(min((s.ttl for s, _ in due), default=10.0) / 10, 0.5), 0.05)

    def _reap(self, now: float) -> None:
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                if name.endswith(_KEEP):
                    continue
                path = os.path.join(dirpath, name)
                expiry = now - _TMP_MAX_AGE if name.startswith(_TMP) else now
                try:
                    if os.stat(path).st_mtime < expiry:
                        os.unlink(path)
                        log.debug("reaped expired discovery file %s", path)
                except FileNotFoundError:
                    pass


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
