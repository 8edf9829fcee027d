"""Discovery backends: the same contract for mem, file and etcd (a real server), plus what is particular to
each: file lease emulation, etcd lease loss, watch resumption and an unreachable server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tandem.runtime.discovery import EtcdStore, FileStore, WatchEvent
from tandem.runtime.discovery.etcd import EtcdConfig, EtcdUnavailable
from tests.support import REPO


async def next_event(watch, timeout=5.0) -> WatchEvent:
    return await asyncio.wait_for(watch.__anext__(), timeout)


async def test_put_get_prefix_delete(make_store):
    store = await make_store()
    await store.put("v1/instances/ns/backend/generate/1", b"one")
    await store.put("v1/instances/ns/backend/generate/2", b"two")
    await store.put("v1/instances/ns/prefill/generate/3", b"three")
    await store.put("v1/mdc/ns/backend/generate/1", b"card")
    assert await store.get("v1/instances/ns/backend/generate/1") == b"one"
    assert await store.get("v1/instances/ns/backend/generate/9") is None
    assert await store.get_prefix("v1/instances/ns/backend/") == {
        "v1/instances/ns/backend/generate/1": b"one",
        "v1/instances/ns/backend/generate/2": b"two",
    }
    assert set(await store.get_prefix("v1/")) == {
        "v1/instances/ns/backend/generate/1", "v1/instances/ns/backend/generate/2",
        "v1/instances/ns/prefill/generate/3", "v1/mdc/ns/backend/generate/1",
    }
    await store.put("v1/instances/ns/backend/generate/1", b"uno")
    assert await store.get("v1/instances/ns/backend/generate/1") == b"uno"
    await store.delete("v1/instances/ns/backend/generate/1")
    await store.delete("v1/instances/ns/backend/generate/1")  # absent: no error
    assert await store.get("v1/instances/ns/backend/generate/1") is None
    await store.close()


async def test_create_only_if_absent(make_store):
    a, b = await make_store(), await make_store()
    assert await a.create("v1/locks/x", b"a")
    assert not await b.create("v1/locks/x", b"b")
    assert await b.get("v1/locks/x") == b"a"
    await a.close()
    await b.close()


async def test_watch_replays_then_streams_changes(make_store):
    writer, watcher = await make_store(), await make_store()
    await writer.put("v1/instances/ns/c/e/1", b"first")
    watch = await watcher.watch_prefix("v1/instances/ns/c/")
    assert await next_event(watch) == WatchEvent("put", "v1/instances/ns/c/e/1", b"first")
    await writer.put("v1/instances/ns/c/e/2", b"second")
    await writer.put("v1/instances/other/c/e/3", b"not watched")
    assert await next_event(watch) == WatchEvent("put", "v1/instances/ns/c/e/2", b"second")
    await writer.put("v1/instances/ns/c/e/2", b"second, updated")
    assert await next_event(watch) == WatchEvent("put", "v1/instances/ns/c/e/2", b"second, updated")
    await writer.delete("v1/instances/ns/c/e/1")
    assert await next_event(watch) == WatchEvent("delete", "v1/instances/ns/c/e/1")
    watch.close()
    with pytest.raises(StopAsyncIteration):
        await next_event(watch)
    await writer.close()
    await watcher.close()


async def test_closing_a_store_revokes_its_lease(make_store):
    owner, other = await make_store(), await make_store()
    await owner.put("v1/instances/ns/c/e/a", b"leased")
    await owner.put("v1/config/ns/settings", b"kept", leased=False)
    watch = await other.watch_prefix("v1/instances/")
    assert (await next_event(watch)).kind == "put"
    await owner.close()
    assert await next_event(watch) == WatchEvent("delete", "v1/instances/ns/c/e/a")
    assert await other.get("v1/config/ns/settings") == b"kept"
    await other.close()


async def test_file_values_are_never_partial(tmp_path):
    store = FileStore(str(tmp_path / "kv"))
    await store.start()
    await store.put("v1/instances/ns/c/e/1", b"x" * 1_000_000)
    names = os.listdir(tmp_path / "kv" / "v1" / "instances")
    assert names == ["ns%2Fc%2Fe%2F1"]  # no temp file left behind
    assert await store.get("v1/instances/ns/c/e/1") == b"x" * 1_000_000
    await store.close()


def _dead_peers_key(root: Path, ttl: float) -> Path:
    """A key of a peer that died just now: written with an expiry `ttl` from now, never touched again."""
    path = root / "v1" / "instances" / "ns%2Fc%2Fe%2Fdead"
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = root.parent / "dead-key"  # given its expiry before it appears: the reaper may run at any moment
    staged.write_bytes(b"dead")
    now = time.time()
    os.utime(staged, (now, now + ttl))
    os.replace(staged, path)
    return path


async def _until_gone(path: Path) -> None:
    async with asyncio.timeout(10):
        while path.exists():
            await asyncio.sleep(0.02)


async def test_file_keep_alive_keeps_keys_past_the_ttl(tmp_path):
    store = FileStore(str(tmp_path / "kv"), ttl=0.6)
    await store.start()
    await store.put("v1/instances/ns/c/e/1", b"alive")
    await _until_gone(_dead_peers_key(tmp_path / "kv", 0.6))  # reaped: the live key's first expiry has passed too
    assert await store.get("v1/instances/ns/c/e/1") == b"alive"
    await store.close()


async def test_file_stores_of_a_process_share_one_lease_thread(tmp_path):
    """Many workers in one process (the mocker's --num-workers): one thread keeps all their keys alive."""
    def keepers() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "tandem-file-kv")

    before = keepers()
    stores = [FileStore(str(tmp_path / "kv"), ttl=0.6) for _ in range(3)]
    for i, store in enumerate(stores):
        await store.start()
        await store.put(f"v1/instances/ns/c/e/{i}", b"alive")
    assert keepers() == before + 1
    await stores[0].close()
    await asyncio.sleep(1.2)  # two TTLs: the other stores' keys are still pushed forward
    assert await stores[1].get("v1/instances/ns/c/e/0") is None  # the closed store's key went with it
    assert [await stores[1].get(f"v1/instances/ns/c/e/{i}") for i in (1, 2)] == [b"alive", b"alive"]
    for store in stores[1:]:
        await store.close()
    assert keepers() == before  # the last one out stopped the thread


async def test_file_key_reaped_while_alive_is_recreated(tmp_path):
    store = FileStore(str(tmp_path / "kv"), ttl=0.6)
    await store.start()
    await store.put("v1/instances/ns/c/e/1", b"alive")
    os.unlink(tmp_path / "kv" / "v1" / "instances" / "ns%2Fc%2Fe%2F1")
    for _ in range(100):
        if await store.get("v1/instances/ns/c/e/1") == b"alive":
            break
        await asyncio.sleep(0.05)
    assert await store.get("v1/instances/ns/c/e/1") == b"alive"
    await store.close()


CRASHING_PEER = """
import asyncio, sys
from tandem.runtime.discovery import FileStore
async def main():
    store = FileStore(sys.argv[1], ttl=float(sys.argv[2]))
    await store.start()
    await store.put("v1/instances/ns/c/e/dead", b"soon gone")
    print("UP", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_file_crashed_peer_disappears_within_ttl(tmp_path):
    root = str(tmp_path / "kv")
    ttl = 2.0
    peer = subprocess.Popen([sys.executable, "-c", CRASHING_PEER, root, str(ttl)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert peer.stdout.readline().strip() == "UP"
        observer = FileStore(root, ttl=ttl, poll_interval=0.02)
        await observer.start()
        watch = await observer.watch_prefix("v1/instances/")
        assert (await next_event(watch)).kind == "put"
        await asyncio.sleep(ttl)  # the peer's keep-alive holds the key while it lives
        assert await observer.get("v1/instances/ns/c/e/dead") == b"soon gone"
        peer.kill()
        peer.wait()
        killed_at = time.monotonic()
        event = await next_event(watch, timeout=ttl * 3)
        gone_after = time.monotonic() - killed_at
        assert event == WatchEvent("delete", "v1/instances/ns/c/e/dead")
        # Reported for the record; the contract checked is "gone", bounded by the wait above.
        print(f"crashed peer left discovery {gone_after:.2f}s after kill -9 (ttl {ttl}s)")
        await observer.close()
    finally:
        peer.kill()


def test_unknown_backend_is_a_clear_error():
    from tandem.runtime.discovery import make_store

    with pytest.raises(ValueError, match="unknown discovery backend 'zookeeper'"):
        make_store("zookeeper")


# -- etcd ------------------------------------------------------------------------------------------


async def test_etcd_lost_lease_registers_again(etcd):
    """A lease that etcd no longer has (it expired while the process could not reach etcd) is granted again
    and the process's keys are written again: peers see it leave and come back."""
    owner, other = EtcdStore(EtcdConfig([etcd.url]), ttl=1), EtcdStore(EtcdConfig([etcd.url]), ttl=1)
    await owner.start()
    await other.start()
    try:
        await owner.put("v1/instances/ns/c/e/1", b"worker")
        watch = await other.watch_prefix("v1/instances/")
        assert (await next_event(watch)).kind == "put"
        etcd.call("/v3/lease/revoke", {"ID": owner.lease_id})  # as if it had expired
        assert await next_event(watch) == WatchEvent("delete", "v1/instances/ns/c/e/1")
        assert await next_event(watch) == WatchEvent("put", "v1/instances/ns/c/e/1", b"worker")
    finally:
        await owner.close()
        await other.close()


async def test_etcd_watch_resumes_after_a_restart_without_gaps_or_repeats(etcd):
    writer, watcher = EtcdStore(EtcdConfig([etcd.url]), ttl=30), EtcdStore(EtcdConfig([etcd.url]), ttl=30)
    await writer.start()
    await watcher.start()
    try:
        await writer.put("v1/instances/ns/c/e/1", b"before")
        watch = await watcher.watch_prefix("v1/instances/")
        assert await next_event(watch) == WatchEvent("put", "v1/instances/ns/c/e/1", b"before")
        etcd.stop()
        etcd.start()
        # Written as soon as etcd is back, likely before the watch has reconnected: the watch resumes
        # from the revision after the last one it saw, so these come once each, in order.
        for n in range(2, 5):
            await writer.put(f"v1/instances/ns/c/e/{n}", b"after")
        await writer.delete("v1/instances/ns/c/e/1")
        got = [await next_event(watch, timeout=15) for _ in range(4)]
        assert got == [WatchEvent("put", f"v1/instances/ns/c/e/{n}", b"after") for n in range(2, 5)] + \
            [WatchEvent("delete", "v1/instances/ns/c/e/1")]
        await writer.put("v1/instances/ns/c/e/last", b"marker")  # nothing repeated: a repeat would come first
        assert await next_event(watch, timeout=15) == WatchEvent("put", "v1/instances/ns/c/e/last", b"marker")
        assert set(await watcher.get_prefix("v1/instances/")) == {f"v1/instances/ns/c/e/{n}" for n in (2, 3, 4, "last")}
    finally:
        await writer.close()
        await watcher.close()


async def test_etcd_unreachable_is_a_clear_error_within_the_timeout():
    from tests.support.ports import free_port

    store = EtcdStore(EtcdConfig([f"http://127.0.0.1:{free_port()}"], connect_timeout=1.0))
    with pytest.raises(EtcdUnavailable, match=r"cannot reach etcd at http://127\.0\.0\.1:\d+ \(ETCD_ENDPOINTS\) within 1 s"):
        await store.start()


def test_etcd_unreachable_worker_exits_nonzero(smollm2):
    from tests.support.ports import free_port

    done = subprocess.run([sys.executable, "-m", "tandem.mocker", "--model-path", smollm2, "--discovery-backend",
                           "etcd"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ETCD_ENDPOINTS": f"127.0.0.1:{free_port()}", "ETCD_CONNECT_TIMEOUT": "1"})
    assert done.returncode != 0
    assert "cannot reach etcd" in done.stderr and "Traceback" not in done.stderr


async def test_file_expiry_follows_the_owners_ttl_not_the_readers(tmp_path):
    root = str(tmp_path / "kv")
    slow = FileStore(root, ttl=3.0)  # refreshes every second
    eager = FileStore(root, ttl=0.3)  # reaps every 50 ms
    await slow.start()
    await eager.start()
    await slow.put("v1/instances/ns/c/e/slow", b"mine")
    await _until_gone(_dead_peers_key(Path(root), 0.3))  # reaped: past the eager store's own TTL
    assert await eager.get("v1/instances/ns/c/e/slow") == b"mine"
    await slow.close()
    await eager.close()


async def test_etcd_user_password(tmp_path):
    """An etcd with authentication on (a server of its own: the shared one stays open): the store logs in
    with ETCD_AUTH_USERNAME / ETCD_AUTH_PASSWORD; without them it is refused."""
    from tandem.runtime.discovery.etcd import EtcdError
    from tests.support.servers import EtcdServer

    server = EtcdServer(tmp_path)
    server.start()
    try:
        server.call("/v3/auth/user/add", {"name": "root", "password": "s3cret"})
        server.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        assert "header" in server.call("/v3/auth/enable", {})
        store = EtcdStore(EtcdConfig([server.url], username="root", password="s3cret"))
        await store.start()
        await store.put("v1/instances/ns/c/e/1", b"with a token")
        watch = await store.watch_prefix("v1/instances/")
        assert await next_event(watch) == WatchEvent("put", "v1/instances/ns/c/e/1", b"with a token")
        await store.close()
        anonymous = EtcdStore(EtcdConfig([server.url], connect_timeout=2))
        await anonymous.start()  # etcd grants leases without a login
        with pytest.raises(EtcdError, match="user name"):
            await anonymous.put("v1/instances/ns/c/e/2", b"anonymous")
        await anonymous.close()
    finally:
        server.stop()


async def test_etcd_watch_resyncs_after_a_compaction(etcd):
    """A watch whose resume revision etcd compacted away reads the prefix again and reports the difference."""
    from tandem.runtime.discovery.base import Watch
    from tandem.runtime.discovery.etcd import _Seen

    store = EtcdStore(EtcdConfig([etcd.url]))
    await store.start()
    try:
        await store.put("v1/instances/ns/c/e/kept", b"same")
        await store.put("v1/instances/ns/c/e/changed", b"new")
        revision = int(etcd.call("/v3/kv/range", {"key": "AA=="})["header"]["revision"])
        etcd.call("/v3/kv/compaction", {"revision": revision, "physical": True})
        watch = Watch("v1/instances/")
        # What a watch had seen before it lost its stream, at a revision that no longer exists.
        seen = _Seen({"v1/instances/ns/c/e/kept": b"same", "v1/instances/ns/c/e/changed": b"old",
                      "v1/instances/ns/c/e/gone": b"x"}, 1)
        follower = asyncio.create_task(store._follow(watch, seen))
        got = {await next_event(watch) for _ in range(2)}
        assert got == {WatchEvent("delete", "v1/instances/ns/c/e/gone"),
                       WatchEvent("put", "v1/instances/ns/c/e/changed", b"new")}
        await store.put("v1/instances/ns/c/e/later", b"streamed")
        assert await next_event(watch) == WatchEvent("put", "v1/instances/ns/c/e/later", b"streamed")
        follower.cancel()
    finally:
        await store.close()


def _self_signed(root, name: str):  # type: ignore[no-untyped-def]
    """A self-signed certificate for 127.0.0.1 (its own authority) and its key."""
    cert, key = root / f"{name}.pem", root / f"{name}-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def _signed(root, name: str, ca, ca_key, extensions: str):  # type: ignore[no-untyped-def]
    """A certificate for `name` signed by `ca`, with `extensions` (openssl extfile lines), and its key."""
    cert, key, request, ext = (root / f"{name}{suffix}" for suffix in (".pem", "-key.pem", ".csr", ".ext"))
    ext.write_text(extensions)
    for argv in (["req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(request), "-subj",
                  f"/CN={name}"],
                 ["x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
                  "-out", str(cert), "-days", "1", "-extfile", str(ext)]):
        subprocess.run(["openssl", *argv], check=True, capture_output=True)
    return cert, key


async def test_etcd_over_tls(tmp_path):
    """An https endpoint is verified: with ETCD_AUTH_CA naming the server's authority the store works;
    without it, a self-signed server is refused."""
    from tests.support.servers import EtcdServer

    cert, key = _self_signed(tmp_path, "server")
    server = EtcdServer(tmp_path, tls=(cert, key))
    server.start()
    try:
        store = EtcdStore(EtcdConfig([server.url], ca_file=str(cert)))
        await store.start()
        await store.put("v1/instances/ns/c/e/1", b"over tls")
        assert await store.get("v1/instances/ns/c/e/1") == b"over tls"
        await store.close()
        with pytest.raises(EtcdUnavailable, match="certificate"):
            await EtcdStore(EtcdConfig([server.url], connect_timeout=2)).start()
    finally:
        server.stop()


async def test_etcd_client_certificate(tmp_path):
    """A server that requires client certificates: ETCD_AUTH_CLIENT_CERT/KEY give one; without it the
    store is refused, clearly, within the timeout."""
    from tests.support.servers import EtcdServer

    ca, ca_key = _self_signed(tmp_path, "ca")
    cert, key = _signed(tmp_path, "server", ca, ca_key, "subjectAltName=IP:127.0.0.1\n"
                        "extendedKeyUsage=serverAuth,clientAuth\n")  # etcd's own gateway presents it too
    client_cert, client_key = _signed(tmp_path, "client", ca, ca_key, "extendedKeyUsage=clientAuth\n")
    server = EtcdServer(tmp_path, tls=(cert, key), client_ca=ca)
    server.start()
    try:
        store = EtcdStore(EtcdConfig.from_env({"ETCD_ENDPOINTS": server.url, "ETCD_AUTH_CA": str(ca),
                                               "ETCD_AUTH_CLIENT_CERT": str(client_cert),
                                               "ETCD_AUTH_CLIENT_KEY": str(client_key)}))
        await store.start()
        await store.put("v1/instances/ns/c/e/1", b"with a client certificate")
        assert await store.get("v1/instances/ns/c/e/1") == b"with a client certificate"
        await store.close()
        with pytest.raises(EtcdUnavailable, match="cannot reach etcd"):
            await EtcdStore(EtcdConfig([server.url], ca_file=str(ca), connect_timeout=2)).start()
    finally:
        server.stop()
