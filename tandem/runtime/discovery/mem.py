"""In-process discovery: every MemoryStore in the process shares one table (tests, single-process)."""

from __future__ import annotations

import threading

from tandem.runtime.discovery.base import KeyValueStore, Watch, WatchEvent, new_lease_id


class _Table:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, bytes] = {}
        self.owners: dict[str, int] = {}  # key -> lease id, for leased keys
        self.watches: list[Watch] = []

    def notify(self, event: WatchEvent) -> None:
        for watch in list(self.watches):
            if event.key.startswith(watch.prefix):
                watch._push(event)


_TABLE = _Table()


class MemoryStore(KeyValueStore):
    """Leases never expire on their own: a process's keys go when its store is closed."""

    def __init__(self, table: _Table | None = None) -> None:
        self._table = table or _TABLE
        self.lease_id = new_lease_id()
        self.ttl = float("inf")
        self._watches: list[Watch] = []

    async def start(self) -> None:
        return None

    def _write(self, key: str, value: bytes, leased: bool) -> None:
        table = self._table
        table.values[key] = value
        if leased:
            table.owners[key] = self.lease_id
        else:
            table.owners.pop(key, None)
        table.notify(WatchEvent("put", key, value))

    async def put(self, key: str, value: bytes, *, leased: bool = True) -> None:
        with self._table.lock:
            self._write(key, value, leased)

    async def create(self, key: str, value: bytes, *, leased: bool = True) -> bool:
        with self._table.lock:
            if key in self._table.values:
                return False
            self._write(key, value, leased)
            return True

    async def get(self, key: str) -> bytes | None:
        return self._table.values.get(key)

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        with self._table.lock:
            return {k: v for k, v in self._table.values.items() if k.startswith(prefix)}

    async def delete(self, key: str) -> None:
        with self._table.lock:
            if self._table.values.pop(key, None) is not None:
                self._table.owners.pop(key, None)
                self._table.notify(WatchEvent("delete", key))

    async def watch_prefix(self, prefix: str) -> Watch:
        watch = Watch(prefix, on_close=self._forget)
        with self._table.lock:
            for key, value in self._table.values.items():
                if key.startswith(prefix):
                    watch._replay(key, value)
            self._table.watches.append(watch)
        self._watches.append(watch)
        return watch

    def _forget(self, watch: Watch) -> None:
        with self._table.lock:
            if watch in self._table.watches:
                self._table.watches.remove(watch)
        if watch in self._watches:
            self._watches.remove(watch)

    async def close(self) -> None:
        for watch in list(self._watches):
            watch.close()
        with self._table.lock:
            owned = [k for k, owner in self._table.owners.items() if owner == self.lease_id]
            for key in owned:
                del self._table.values[key]
                del self._table.owners[key]
                self._table.notify(WatchEvent("delete", key))
