"""Dynamic LoRA adapters: manager, ids, the load/unload/list endpoints and the system-port routes."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tandem.runtime import DistributedRuntime, RuntimeConfig
from tandem.vllm import lora as lora_mod
from tandem.vllm.lora import LoRAManager, LoRAService, get_lora_manager, install_lora_routes, lora_name_to_id


@dataclass
class FakeRequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class FakeEngine:
    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.delay = delay

    async def add_lora(self, request: FakeRequest) -> bool:
        await asyncio.sleep(self.delay)
        self.calls.append(("add", request))
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(("remove", lora_id))
        return True

    @property
    def adds(self) -> list[FakeRequest]:
        return [arg for op, arg in self.calls if op == "add"]


def make_adapter(root: Path, name: str = "adapter") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    (folder / "adapter_model.safetensors").write_bytes(b"\0" * 64)
    return folder


async def first(stream: Any) -> dict[str, Any]:
    items = [item async for item in stream]
    assert len(items) == 1
    return items[0]


@pytest.fixture
def manager(tmp_path: Path) -> LoRAManager:
    return LoRAManager(cache_dir=str(tmp_path / "cache"), allowed_roots=[str(tmp_path)])


def service_for(manager: LoRAManager | None, engine: FakeEngine, **kw: Any) -> LoRAService:
    return LoRAService(engine, manager_factory=lambda: manager, request_class=FakeRequest, **kw)


def test_lora_name_to_id_matches_dynamo() -> None:
    # Dynamo's own test (lib/llm/src/utils: test_lora_id_stability_across_version)
    assert lora_name_to_id("test_lora") == 1983627077
    import blake3

    digest = blake3.blake3(b"my/adapter").digest()
    expected = int.from_bytes(digest[:8], "big") & 0x7FFFFFFF
    assert lora_name_to_id("my/adapter") == (expected or 1)
    assert lora_name_to_id("a") != lora_name_to_id("b")
    assert all(1 <= lora_name_to_id(n) <= 0x7FFFFFFF for n in ("", "x", "adapter-1"))


async def test_manager_copies_local_adapter_into_cache(manager: LoRAManager, tmp_path: Path) -> None:
    src = make_adapter(tmp_path / "loras")
    for uri in (str(src), f"file://{src}"):
        result = await manager.download_lora(uri)
        assert result["status"] == "success", result
        local = Path(result["local_path"])
        assert local.parent == manager.cache_root and local != src
        assert (local / "adapter_config.json").read_text() == (src / "adapter_config.json").read_text()
        assert (local / "adapter_model.safetensors").stat().st_size == 64
        assert manager.is_cached(uri)
    # reused while unchanged; refreshed when the source changes
    marker = Path(result["local_path"]) / "extra"
    marker.write_text("x")
    again = await manager.download_lora(f"file://{src}")
    assert again == result and marker.exists()
    (src / "adapter_model.safetensors").write_bytes(b"\1" * 128)
    refreshed = await manager.download_lora(f"file://{src}")
    assert refreshed == result and not marker.exists()
    assert (Path(refreshed["local_path"]) / "adapter_model.safetensors").stat().st_size == 128
    assert not [p for p in manager.cache_root.iterdir() if p.name.startswith(".")]  # no temp dirs left


REFUSED = "is not an adapter folder (one with adapter_config.json) under the allowed roots"


async def test_manager_rejections(tmp_path: Path) -> None:
    """Outside the roots, '..', missing, a file, no adapter_config.json, a symlink leading out of the roots
    (as the folder or inside it), a dangling one: every refusal says the same, so that it tells nothing
    about which paths exist."""
    allowed = tmp_path / "allowed"
    inside = make_adapter(allowed)
    outside = make_adapter(tmp_path / "elsewhere")
    manager = LoRAManager(cache_dir=str(tmp_path / "cache"), allowed_roots=[str(allowed)])
    assert (await manager.download_lora(str(inside)))["status"] == "success"

    (allowed / "not_peft").mkdir()
    (allowed / "a_file").write_text("x")
    (allowed / "sneaky").symlink_to(outside)
    (allowed / "dangling").symlink_to(tmp_path / "nowhere")
    dotdot = f"{allowed}/../elsewhere/adapter"
    refused = [dotdot, f"file://{dotdot}", f"file://{allowed}/%2E%2E/elsewhere/adapter", f"file://{outside}",
               str(outside), str(allowed / "missing"), str(tmp_path / "missing"), str(allowed / "not_peft"),
               str(allowed / "a_file"), str(allowed / "sneaky"), str(allowed / "dangling")]
    messages = set()
    for uri in refused:
        result = await manager.download_lora(uri)
        assert result["status"] == "error" and REFUSED in result["message"], (uri, result)
        messages.add(result["message"].replace(repr(uri), "URI"))
    assert len(messages) == 1, messages
    # a symlink inside the adapter that leads out of the roots: refused, and nothing is copied
    (inside / "weights.safetensors").symlink_to(outside / "adapter_model.safetensors")
    result = await manager.download_lora(str(inside) + "/")
    assert result["status"] == "error" and REFUSED in result["message"]
    result = await manager.download_lora("s3://bucket/adapter")
    assert result["status"] == "error" and "'s3'" in result["message"]


async def test_default_root_is_the_cache_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset DYN_LORA_ALLOWED_ROOTS: only adapters under DYN_LORA_PATH load; `/` restores the old behaviour."""
    monkeypatch.delenv("DYN_LORA_ALLOWED_ROOTS", raising=False)
    monkeypatch.setenv("DYN_LORA_PATH", str(tmp_path / "loras"))
    inside = make_adapter(tmp_path / "loras" / "mine")
    outside = make_adapter(tmp_path / "tmp")
    manager = LoRAManager()
    assert manager.allowed_roots == [(tmp_path / "loras").resolve()]
    assert (await manager.download_lora(f"file://{inside}"))["status"] == "success"
    assert REFUSED in (await manager.download_lora(str(outside)))["message"]
    monkeypatch.setenv("DYN_LORA_ALLOWED_ROOTS", "/")
    assert (await LoRAManager().download_lora(str(outside)))["status"] == "success"


async def test_custom_source(manager: LoRAManager, tmp_path: Path) -> None:
    class HubSource:
        def __init__(self) -> None:
            self.downloads: list[str] = []

        async def exists(self, uri: str) -> bool:
            return not uri.endswith("/missing")

        async def download(self, uri: str, dest: Path) -> None:
            self.downloads.append(uri)
            (dest / "adapter_config.json").write_text("{}")

    source = HubSource()
    manager.register_custom_source("hf", source)
    result = await manager.download_lora("hf://org/adapter")
    assert result["status"] == "success", result
    assert (Path(result["local_path"]) / "adapter_config.json").is_file()
    assert await manager.download_lora("hf://org/adapter") == result
    assert source.downloads == ["hf://org/adapter"]  # cached
    missing = await manager.download_lora("hf://org/missing")
    assert missing == {"status": "error", "message": "LoRA not found at hf://org/missing"}

    class Broken:
        async def exists(self, uri: str) -> bool:
            raise ConnectionError("hub unreachable")

        async def download(self, uri: str, dest: Path) -> None:  # pragma: no cover
            raise AssertionError

    via_ctor = LoRAManager(cache_dir=str(tmp_path / "c2"), sources={"s3": Broken()})
    assert await via_ctor.download_lora("s3://b/k") == {"status": "error", "message": "hub unreachable"}

    own = make_adapter(tmp_path / "own-cache")

    class OwnCache:
        async def exists(self, uri: str) -> bool:
            return True

        async def download(self, uri: str, dest: Path) -> Path:
            return own  # the source keeps adapters in a cache of its own

    manager.register_custom_source("OCI", OwnCache())
    assert await manager.download_lora("oci://reg/adapter") == {"status": "success", "local_path": str(own)}


def test_get_lora_manager_singleton(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lora_mod.reset_lora_manager()
    monkeypatch.setenv("DYN_LORA_PATH", str(tmp_path))
    monkeypatch.delenv("DYN_LORA_ENABLED", raising=False)
    assert get_lora_manager() is None
    for value in ("true", "1", "YES"):
        monkeypatch.setenv("DYN_LORA_ENABLED", value)
        assert get_lora_manager() is not None
    assert get_lora_manager() is get_lora_manager()
    monkeypatch.setenv("DYN_LORA_ENABLED", "no")
    assert get_lora_manager() is None
    lora_mod.reset_lora_manager()


async def test_load_list_select_unload(manager: LoRAManager, tmp_path: Path) -> None:
    engine = FakeEngine()
    registered: list[tuple[str, int]] = []
    unregistered: list[str] = []

    async def register(name: str, lora_id: int) -> None:
        registered.append((name, lora_id))

    async def unregister(name: str) -> None:
        unregistered.append(name)

    service = service_for(manager, engine, register=register, unregister=unregister)
    src = make_adapter(tmp_path / "loras")
    lora_id = lora_name_to_id("sql")
    reply = await first(service.load_lora({"lora_name": "sql", "source": {"uri": f"file://{src}"}}))
    assert reply == {"status": "success", "message": "LoRA adapter 'sql' loaded successfully",
                     "lora_name": "sql", "lora_id": lora_id}
    assert registered == [("sql", lora_id)]
    [added] = engine.adds
    assert added.lora_name == "sql" and added.lora_int_id == lora_id
    assert Path(added.lora_path).parent == manager.cache_root

    reply = await first(service.load_lora({"lora_name": "sql", "source": {"uri": "file:///elsewhere"}}))
    assert reply == {"status": "success", "message": "LoRA adapter 'sql' already loaded",
                     "lora_name": "sql", "lora_id": lora_id}
    assert len(engine.adds) == 1

    assert await first(service.list_loras()) == {"status": "success", "loras": {"sql": lora_id}, "count": 1}
    assert service.lora_request("sql") == FakeRequest("sql", lora_id, added.lora_path)
    assert service.lora_request("base-model") is None and service.lora_request(None) is None

    reply = await first(service.unload_lora({"lora_name": "sql"}))
    assert reply == {"status": "success", "message": "LoRA adapter 'sql' unloaded successfully",
                     "lora_name": "sql", "lora_id": lora_id}
    assert engine.calls[-1] == ("remove", lora_id) and unregistered == ["sql"]
    assert service.loaded == {} and service.lora_request("sql") is None
    assert await first(service.list_loras()) == {"status": "success", "loras": {}, "count": 0}
    assert service._locks == {}


async def test_concurrent_loads_add_once(manager: LoRAManager, tmp_path: Path) -> None:
    engine = FakeEngine(delay=0.05)
    service = service_for(manager, engine)
    src = make_adapter(tmp_path / "loras")
    request = {"lora_name": "a", "source": {"uri": str(src)}}
    replies = await asyncio.gather(*(first(service.load_lora(request)) for _ in range(5)))
    assert len(engine.adds) == 1
    messages = sorted(r["message"] for r in replies)
    assert messages == ["LoRA adapter 'a' already loaded"] * 4 + ["LoRA adapter 'a' loaded successfully"]
    assert {r["lora_id"] for r in replies} == {lora_name_to_id("a")}


async def test_load_validation(manager: LoRAManager) -> None:
    service = service_for(manager, FakeEngine())
    cases = [
        (None, "Request is required with 'lora_name' and 'source.uri'"),
        ({}, "'lora_name' is required in request"),
        ({"lora_name": ""}, "'lora_name' is required in request"),
        ({"lora_name": "x"}, "'source' object is required in request"),
        ({"lora_name": "x", "source": "file:///a"}, "'source' object is required in request"),
        ({"lora_name": "x", "source": {}}, "'source' object is required in request"),
        ({"lora_name": "x", "source": {"path": "/a"}}, "'source.uri' is required in request"),
    ]
    for request, message in cases:
        assert await first(service.load_lora(request)) == {"status": "error", "message": message}, request
    disabled = service_for(None, FakeEngine())
    reply = await first(disabled.load_lora({"lora_name": "x", "source": {"uri": "/a"}}))
    assert reply == {"status": "error", "message": "LoRAManager not initialized. Set DYN_LORA_ENABLED=true "
                     "to enable URI-based LoRA loading."}
    assert await first(service.unload_lora(None)) == {
        "status": "error", "message": "Request is required with 'lora_name' field"}
    assert await first(service.unload_lora({})) == {"status": "error", "message": "'lora_name' is required in request"}


async def test_load_download_errors(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    outside = make_adapter(tmp_path / "outside")
    manager = LoRAManager(cache_dir=str(tmp_path / "cache"), allowed_roots=[str(allowed)])
    engine = FakeEngine()
    service = service_for(manager, engine)
    for uri, part in ((f"file://{allowed}/../outside/adapter", REFUSED),
                      (f"file://{outside}", REFUSED),
                      ("gs://bucket/lora", "'gs'")):
        reply = await first(service.load_lora({"lora_name": "x", "source": {"uri": uri}}))
        assert reply["status"] == "error" and reply["message"].startswith("Failed to download LoRA: ")
        assert part in reply["message"], reply
    assert engine.calls == [] and service.loaded == {} and service._locks == {}


async def test_register_failure_rolls_back(manager: LoRAManager, tmp_path: Path) -> None:
    engine = FakeEngine()

    async def register(name: str, lora_id: int) -> None:
        raise RuntimeError("etcd down")

    service = service_for(manager, engine, register=register)
    src = make_adapter(tmp_path / "loras")
    reply = await first(service.load_lora({"lora_name": "r", "source": {"uri": str(src)}}))
    assert reply == {"status": "error", "lora_name": "r",
                     "message": "Failed to register LoRA 'r' in discovery registry: etcd down"}
    assert [op for op, _ in engine.calls] == ["add", "remove"]
    assert engine.calls[1][1] == lora_name_to_id("r")
    assert service.loaded == {} and service.paths == {} and service._locks == {}


async def test_unload_not_found_and_unregister_rollback(manager: LoRAManager, tmp_path: Path) -> None:
    engine = FakeEngine()
    fail = {"on": False}

    async def unregister(name: str) -> None:
        if fail["on"]:
            raise RuntimeError("etcd down")

    service = service_for(manager, engine, unregister=unregister)
    reply = await first(service.unload_lora({"lora_name": "ghost"}))
    assert reply == {"status": "error", "message": "LoRA adapter 'ghost' not found. Available LoRAs: []"}
    src = make_adapter(tmp_path / "loras")
    await first(service.load_lora({"lora_name": "u", "source": {"uri": str(src)}}))
    reply = await first(service.unload_lora({"lora_name": "ghost"}))
    assert reply["message"] == "LoRA adapter 'ghost' not found. Available LoRAs: ['u']"

    fail["on"] = True
    path = service.paths["u"]
    reply = await first(service.unload_lora({"lora_name": "u"}))
    assert reply == {"status": "error", "lora_name": "u",
                     "message": "Failed to unregister LoRA 'u' from discovery registry: etcd down"}
    lora_id = lora_name_to_id("u")
    assert engine.calls[-2:] == [("remove", lora_id), ("add", FakeRequest("u", lora_id, path))]
    assert service.loaded == {"u": lora_id} and service.paths == {"u": path}
    assert "u" in service._locks and "ghost" not in service._locks


async def test_engine_failure_is_reported(manager: LoRAManager, tmp_path: Path) -> None:
    class BadEngine(FakeEngine):
        async def add_lora(self, request: FakeRequest) -> bool:
            raise ValueError("LoRA rank 64 is greater than max_lora_rank 16")

    service = service_for(manager, BadEngine())
    src = make_adapter(tmp_path / "loras")
    reply = await first(service.load_lora({"lora_name": "big", "source": {"uri": str(src)}}))
    assert reply == {"status": "error", "message": "LoRA rank 64 is greater than max_lora_rank 16"}
    assert service.loaded == {} and service._locks == {}


async def test_system_routes(tmp_path: Path) -> None:
    config = RuntimeConfig(discovery_backend="mem", tcp_host="127.0.0.1", system_host="127.0.0.1", system_port=0,
                           graceful_shutdown_grace_period=0)
    runtime = await DistributedRuntime.create(config)
    try:
        manager = LoRAManager(cache_dir=str(tmp_path / "cache"), allowed_roots=[str(tmp_path)])
        engine = FakeEngine()
        service = service_for(manager, engine)
        assert not install_lora_routes(runtime, service, enabled=False)
        assert install_lora_routes(runtime, service, enabled=True)  # after the server started
        assert runtime.system_server is not None
        base = f"http://127.0.0.1:{runtime.system_server.port}"
        src = make_adapter(tmp_path / "loras")
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/v1/loras") as r:
                assert r.status == 200 and await r.json() == {"status": "success", "loras": {}, "count": 0}
            for name in ("plain", "org/adapter"):
                body = {"lora_name": name, "source": {"uri": f"file://{src}"}}
                async with http.post(f"{base}/v1/loras", json=body) as r:
                    assert r.status == 200
                    assert await r.json() == {"status": "success", "message": f"LoRA adapter '{name}' loaded successfully",
                                              "lora_name": name, "lora_id": lora_name_to_id(name)}
            async with http.post(f"{base}/v1/loras", json={"lora_name": "bad", "source": {"uri": "s3://x/y"}}) as r:
                reply = await r.json()
                assert r.status == 200 and reply["status"] == "error" and "'s3'" in reply["message"]
            async with http.post(f"{base}/v1/loras", json={"lora_name": "x"}) as r:
                assert r.status == 422 and (await r.json())["status"] == "error"
            async with http.post(f"{base}/v1/loras", data=b"{nope") as r:
                assert r.status == 400
            async with http.get(f"{base}/v1/loras") as r:
                assert await r.json() == {"status": "success", "count": 2, "loras": {
                    "plain": lora_name_to_id("plain"), "org/adapter": lora_name_to_id("org/adapter")}}
            async with http.delete(f"{base}/v1/loras/org/adapter") as r:
                assert r.status == 200
                assert await r.json() == {"status": "success", "message": "LoRA adapter 'org/adapter' unloaded successfully",
                                          "lora_name": "org/adapter", "lora_id": lora_name_to_id("org/adapter")}
            async with http.delete(f"{base}/v1/loras/org/adapter") as r:
                assert r.status == 200
                assert await r.json() == {"status": "error",
                                          "message": "LoRA adapter 'org/adapter' not found. Available LoRAs: ['plain']"}
            async with http.put(f"{base}/v1/loras") as r:
                assert r.status == 405
            async with http.get(f"{base}/v1/nothing") as r:
                assert r.status == 404
            async with http.post(f"{base}/health") as r:
                assert r.status == 405

            # an endpoint that breaks gives 500 with status "error"
            async def broken(request: Any = None, context: Any = None) -> Any:
                raise RuntimeError("engine dead")
                yield  # pragma: no cover

            service.list_loras = broken  # type: ignore[method-assign]
            async with http.get(f"{base}/v1/loras") as r:
                assert r.status == 500 and await r.json() == {"status": "error", "message": "engine dead"}
    finally:
        await runtime.shutdown()


async def test_routes_need_system_server(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = await DistributedRuntime.create(RuntimeConfig(discovery_backend="mem", tcp_host="127.0.0.1",
                                                            graceful_shutdown_grace_period=0))
    try:
        monkeypatch.setenv("DYN_LORA_ENABLED", "true")
        assert runtime.system_server is None
        assert not install_lora_routes(runtime, service_for(None, FakeEngine()))
        assert not runtime.register_system_route("GET", "/v1/x", None)  # type: ignore[arg-type]
    finally:
        await runtime.shutdown()


async def test_card_callbacks_publish_adapter_cards(runtimes: Any, namespace: str, tmp_path: Path) -> None:
    from tandem.llm.model_card import ModelDeploymentCard
    from tandem.runtime.keys import parse_model_key

    runtime = await runtimes()
    endpoint = runtime.namespace(namespace).component("backend").endpoint("generate")
    base = ModelDeploymentCard(display_name="base-model", source_path="/models/base", context_length=2048)
    register, unregister = lora_mod.card_callbacks(endpoint, base)
    await register("org/sql", 42)
    prefix = f"v1/mdc/{namespace}/"
    entries = dict(await runtime.store.get_prefix(prefix))
    [(key, value)] = entries.items()
    assert parse_model_key(key)[3:] == (runtime.instance_id, "org/sql")
    card = ModelDeploymentCard.from_json(value)
    assert card.display_name == "org/sql" and card.lora is not None and card.lora.base_model == "base-model"
    assert card.user_data == {"lora_adapter": True, "lora_id": 42} and card.context_length == 2048
    await unregister("org/sql")
    assert dict(await runtime.store.get_prefix(prefix)) == {}


async def test_default_request_class_is_vllms(manager: LoRAManager, tmp_path: Path) -> None:
    import vllm.lora.request as request_module
    engine = FakeEngine()
    service = LoRAService(engine, manager_factory=lambda: manager)
    src = make_adapter(tmp_path / "loras")
    reply = await first(service.load_lora({"lora_name": "v", "source": {"uri": str(src)}}))
    assert reply["status"] == "success"
    [added] = engine.adds
    selected = service.lora_request("v")
    assert isinstance(added, request_module.LoRARequest) and isinstance(selected, request_module.LoRARequest)
    assert (selected.lora_name, selected.lora_int_id, selected.lora_path) == ("v", lora_name_to_id("v"), added.lora_path)
