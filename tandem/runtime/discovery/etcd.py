"""Discovery in etcd (Dynamo's `etcd` backend, its default outside Kubernetes), through etcd's own v3 JSON
API (the gRPC gateway every etcd >= 3.4 serves on its client port) with aiohttp, which tandem already
uses. A gRPC client would add grpcio, whose version vLLM and its dependencies also pin.

- One lease per process, granted with this store's `lease_id` and the TTL, kept alive every TTL/3.
  If etcd answers that the lease is gone (it expired while etcd or the network was away), the lease is
  granted again and every leased key this process wrote is written again.
- A watch first reads the prefix, then follows changes from the next revision. When its stream breaks
  it resumes from the revision after the last one it saw, so nothing is missed or repeated; if etcd has
  compacted that revision away, the watch reads the prefix again and reports the difference.
- Several endpoints (`ETCD_ENDPOINTS`, comma separated) are tried in turn. TLS (`https://` endpoints,
  `ETCD_AUTH_CA`, `ETCD_AUTH_CLIENT_CERT`, `ETCD_AUTH_CLIENT_KEY`) and user/password authentication
  (`ETCD_AUTH_USERNAME`, `ETCD_AUTH_PASSWORD`) are Dynamo's settings.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tandem.runtime.discovery.base import KeyValueStore, Watch, WatchEvent, new_lease_id

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "http://localhost:2379"
_RETRY = 0.5  # seconds between attempts while etcd is unreachable


class EtcdUnavailable(ConnectionError):
    """No etcd endpoint answered (the message names them)."""


@dataclass
class EtcdConfig:
    endpoints: list[str] = field(default_factory=lambda: [DEFAULT_ENDPOINT])
    username: str | None = None
    password: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    connect_timeout: float = 5.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> EtcdConfig:
        endpoints = [e.strip() for e in (environ.get("ETCD_ENDPOINTS") or DEFAULT_ENDPOINT).split(",") if e.strip()]
        return cls(
            endpoints=[e if "://" in e else f"http://{e}" for e in endpoints],
            username=environ.get("ETCD_AUTH_USERNAME") or None,
            password=environ.get("ETCD_AUTH_PASSWORD") or None,
            ca_file=environ.get("ETCD_AUTH_CA") or None,
            cert_file=environ.get("ETCD_AUTH_CLIENT_CERT") or None,
            key_file=environ.get("ETCD_AUTH_CLIENT_KEY") or None,
            connect_timeout=float(environ.get("ETCD_CONNECT_TIMEOUT") or 5.0),
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        if not (self.ca_file or self.cert_file):
            return None
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    """The first key after every key that starts with `prefix` (etcd's range end for a prefix)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return base64.b64encode(b"\0").decode()  # every key
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


def _kv(item: dict[str, Any]) -> tuple[str, bytes]:
    return base64.b64decode(item["key"]).decode(), base64.b64decode(item.get("value", ""))


class EtcdStore(KeyValueStore):
    def __init__(self, config: EtcdConfig, *, ttl: float = 10.0) -> None:
        self.config = config
        self.ttl = ttl
        self.lease_id = new_lease_id()
        self._session: aiohttp.ClientSession | None = None
        self._token: str | None = None
        self._endpoint = 0  # the endpoint that answered last
        self._owned: dict[str, bytes] = {}  # leased keys this process wrote, to write again after a lease loss
        self._keeper: asyncio.Task[None] | None = None
        self._watches: dict[Watch, asyncio.Task[None]] = {}
        self._closed = False

    # -- transport ---------------------------------------------------------------------------------
    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST one request to the first endpoint that answers; raises EtcdUnavailable if none does. A
        connection that etcd dropped (a restart) is retried once on a new connection."""
        assert self._session is not None, "start() first"
        errors = []
        count = len(self.config.endpoints)
        for k in range(count * 2):
            index = (self._endpoint + k // 2) % count
            url = self.config.endpoints[index].rstrip("/") + path
            try:
                async with self._session.post(url, json=body, headers=self._headers()) as response:
                    data = await response.json(content_type=None)
                    if response.status == 401 and self.config.username and path != "/v3/auth/authenticate":
                        await self._authenticate()
                        return await self._call(path, body)
                    if response.status >= 400:
                        raise EtcdError(f"etcd {path}: {data.get('message') or data.get('error') or data}")
                    self._endpoint = index
                    return data
            except aiohttp.ServerDisconnectedError as e:
                errors.append(f"{self.config.endpoints[index]}: {e}")
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                errors.append(f"{self.config.endpoints[index]}: {e or type(e).__name__}")
                if k % 2 == 0:
                    continue  # a refused connection is not stale: the next endpoint
        raise EtcdUnavailable(f"no etcd endpoint answered ({'; '.join(dict.fromkeys(errors))})")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._token} if self._token else {}

    async def _authenticate(self) -> None:
        self._token = None
        data = await self._call("/v3/auth/authenticate", {"name": self.config.username,
                                                          "password": self.config.password or ""})
        self._token = data.get("token")

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.config.connect_timeout,
                                        sock_connect=self.config.connect_timeout)
        # https endpoints are verified: against ETCD_AUTH_CA when given, else the system's authorities.
        connector = aiohttp.TCPConnector(ssl=self.config.ssl_context() or True)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        try:
            async with asyncio.timeout(self.config.connect_timeout + 1):
                if self.config.username:
                    await self._authenticate()
                await self._grant()
        except (EtcdUnavailable, TimeoutError) as e:
            await self._session.close()
            endpoints = ", ".join(self.config.endpoints)
            raise EtcdUnavailable(f"cannot reach etcd at {endpoints} (ETCD_ENDPOINTS) within "
                                  f"{self.config.connect_timeout:g} s: {e}") from None
        self._keeper = asyncio.create_task(self._keep_alive(), name="etcd-lease-keepalive")

    async def _grant(self) -> None:
        await self._call("/v3/lease/grant", {"TTL": max(int(round(self.ttl)), 1), "ID": self.lease_id})

    async def _keep_alive(self) -> None:
        interval = max(self.ttl / 3, 0.2)
        while not self._closed:
            await asyncio.sleep(interval)
            try:
                data = await self._call("/v3/lease/keepalive", {"ID": self.lease_id})
                if int((data.get("result") or {}).get("TTL") or 0) <= 0:
                    await self._restore_lease()
            except EtcdError as e:
                log.warning("etcd lease keep-alive refused (%s); granting the lease again", e)
                await self._restore(self._restore_lease)
            except EtcdUnavailable as e:
                log.warning("etcd unreachable for the lease keep-alive: %s", e)
                interval = _RETRY
                continue
            except asyncio.CancelledError:
                raise
            except Exception:  # the lease must not be left to expire because of one bad answer
                log.exception("etcd lease keep-alive failed; trying again")
                interval = _RETRY
                continue
            interval = max(self.ttl / 3, 0.2)

    async def _restore(self, what: Any) -> None:
        try:
            await what()
        except (EtcdError, EtcdUnavailable) as e:
            log.warning("etcd: %s", e)

    async def _restore_lease(self) -> None:
        """The lease expired (etcd or the network was away longer than the TTL): grant it again and write
        this process's keys again, so peers see it come back."""
        log.warning("etcd lease %x was lost; registering %d keys again", self.lease_id, len(self._owned))
        await self._grant()
        for key, value in list(self._owned.items()):
            await self._put(key, value, leased=True)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._keeper is not None:
            self._keeper.cancel()
        for watch in list(self._watches):
            watch.close()
        try:
            await self._call("/v3/lease/revoke", {"ID": self.lease_id})  # deletes this process's keys
        except (EtcdError, EtcdUnavailable) as e:
            log.warning("etcd: could not revoke the lease (its keys expire within %g s): %s", self.ttl, e)
        if self._session is not None:
            await self._session.close()

    # -- keys --------------------------------------------------------------------------------------
    async def _put(self, key: str, value: bytes, *, leased: bool) -> None:
        body: dict[str, Any] = {"key": _b64(key), "value": base64.b64encode(value).decode()}
        if leased:
            body["lease"] = self.lease_id
        await self._call("/v3/kv/put", body)

    async def put(self, key: str, value: bytes, *, leased: bool = True) -> None:
        await self._put(key, value, leased=leased)
        if leased:
            self._owned[key] = value

    async def create(self, key: str, value: bytes, *, leased: bool = True) -> bool:
        put: dict[str, Any] = {"key": _b64(key), "value": base64.b64encode(value).decode()}
        if leased:
            put["lease"] = self.lease_id
        data = await self._call("/v3/kv/txn", {
            "compare": [{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": put}],
        })
        created = bool(data.get("succeeded"))
        if created and leased:
            self._owned[key] = value
        return created

    async def get(self, key: str) -> bytes | None:
        data = await self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = data.get("kvs") or []
        return _kv(kvs[0])[1] if kvs else None

    async def _range(self, prefix: str) -> tuple[dict[str, bytes], int]:
        data = await self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return dict(_kv(item) for item in data.get("kvs") or []), int(data["header"]["revision"])

    async def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return (await self._range(prefix))[0]

    async def delete(self, key: str) -> None:
        self._owned.pop(key, None)
        await self._call("/v3/kv/deleterange", {"key": _b64(key)})

    # -- watches -----------------------------------------------------------------------------------
    async def watch_prefix(self, prefix: str) -> Watch:
        watch = Watch(prefix, on_close=self._forget)
        known, revision = await self._range(prefix)
        for key, value in known.items():
            watch._replay(key, value)
        seen = _Seen(known, revision)
        self._watches[watch] = asyncio.create_task(self._follow(watch, seen), name=f"etcd-watch {prefix}")
        return watch

    def _forget(self, watch: Watch) -> None:
        task = self._watches.pop(watch, None)
        if task is not None:
            task.cancel()

    async def _follow(self, watch: Watch, seen: _Seen) -> None:
        """Streams the prefix's changes after the last revision seen; after a broken stream, resumes from
        there (or reads the prefix again if etcd compacted it away)."""
        while not self._closed:
            try:
                await self._stream(watch, seen)
            except (TimeoutError, aiohttp.ClientError, OSError, EtcdUnavailable) as e:
                log.warning("etcd watch on %r broken (%s); resuming after revision %d", watch.prefix, e,
                            seen.revision)
                await asyncio.sleep(_RETRY)
            except _Compacted:
                try:
                    await self._resync(watch, seen)
                except (EtcdUnavailable, EtcdError) as e:
                    log.warning("etcd watch on %r: %s", watch.prefix, e)
                    await asyncio.sleep(_RETRY)
            except asyncio.CancelledError:
                raise
            except Exception:  # a defect or an answer it cannot read: the watch must not stop for good
                log.exception("etcd watch on %r failed; resuming after revision %d", watch.prefix, seen.revision)
                await asyncio.sleep(_RETRY)

    async def _stream(self, watch: Watch, seen: _Seen) -> None:
        assert self._session is not None
        body = {"create_request": {"key": _b64(watch.prefix), "range_end": _prefix_end(watch.prefix),
                                   "start_revision": seen.revision + 1}}
        url = self.config.endpoints[self._endpoint].rstrip("/") + "/v3/watch"
        async with self._session.post(url, json=body, headers=self._headers()) as response:
            if response.status >= 400:
                raise EtcdUnavailable(f"etcd watch answered {response.status}")
            async for line in response.content:
                if not line.strip():
                    continue
                result = json.loads(line).get("result") or {}
                if int(result.get("compact_revision") or 0) > 0:
                    raise _Compacted
                for event in result.get("events") or []:
                    seen.apply(watch, event)
        raise EtcdUnavailable("etcd closed the watch stream")

    async def _resync(self, watch: Watch, seen: _Seen) -> None:
        """Read the prefix again and report what changed since what the watch had seen."""
        current, seen.revision = await self._range(watch.prefix)
        for key in [k for k in seen.known if k not in current]:
            del seen.known[key]
            watch._push(WatchEvent("delete", key))
        for key, value in current.items():
            if seen.known.get(key) != value:
                seen.known[key] = value
                watch._push(WatchEvent("put", key, value))


@dataclass
class _Seen:
    """What a watch has reported: the keys with their values, and the last revision."""

    known: dict[str, bytes]
    revision: int

    def apply(self, watch: Watch, event: dict[str, Any]) -> None:
        key, value = _kv(event["kv"])
        self.revision = max(self.revision, int(event["kv"].get("mod_revision") or self.revision))
        if event.get("type") == "DELETE":
            if self.known.pop(key, None) is not None:
                watch._push(WatchEvent("delete", key))
        else:
            self.known[key] = value
            watch._push(WatchEvent("put", key, value))


class EtcdError(RuntimeError):
    """etcd refused a request (the message is etcd's)."""


class _Compacted(Exception):
    """The watch's resume revision was compacted away."""
