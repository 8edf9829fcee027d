"""Flags and env names as in Dynamo; CLI wins over env; DYN_LOG; the `tandem` command."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys

import pytest

from tandem.runtime import RuntimeConfig, add_runtime_args, configure_logging
from tandem.runtime.context import Context


def parse(argv):
    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    return RuntimeConfig.from_args(parser.parse_args(argv))


def test_defaults(monkeypatch):
    for name in ("DYN_NAMESPACE", "DYN_DISCOVERY_BACKEND", "DYN_STORE_KV", "DYN_REQUEST_PLANE", "DYN_EVENT_PLANE",
                 "DYN_SYSTEM_PORT"):
        monkeypatch.delenv(name, raising=False)
    config = parse([])
    assert (config.namespace, config.discovery_backend, config.request_plane, config.event_plane) == (
        "dynamo", "file", "tcp", "zmq"
    )
    assert config.system_port is None and config.discovery_ttl == 10.0
    assert config.graceful_shutdown_grace_period == 5.0


def test_env_then_cli(monkeypatch):
    monkeypatch.setenv("DYN_NAMESPACE", "from-env")
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "mem")
    monkeypatch.setenv("DYN_SYSTEM_PORT", "9090")
    monkeypatch.setenv("DYN_TCP_MAX_MESSAGE_SIZE", "4096")
    config = parse([])
    assert (config.namespace, config.discovery_backend, config.system_port, config.tcp_max_message_size) == (
        "from-env", "mem", 9090, 4096
    )
    config = parse(["--namespace", "from-cli", "--discovery-backend", "file"])
    assert (config.namespace, config.discovery_backend) == ("from-cli", "file")


def test_legacy_store_kv_names(monkeypatch):
    monkeypatch.delenv("DYN_DISCOVERY_BACKEND", raising=False)
    monkeypatch.setenv("DYN_STORE_KV", "mem")
    assert parse([]).discovery_backend == "mem"
    assert parse(["--store-kv", "file"]).discovery_backend == "file"


def test_bad_values_are_clear_errors(monkeypatch):
    monkeypatch.setenv("DYN_SYSTEM_PORT", "eighty")
    with pytest.raises(ValueError, match="DYN_SYSTEM_PORT='eighty' is not a port number"):
        RuntimeConfig.from_env()
    monkeypatch.delenv("DYN_SYSTEM_PORT")
    monkeypatch.setenv("DYN_TCP_REQUEST_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DYN_TCP_REQUEST_TIMEOUT"):
        RuntimeConfig.from_env()
    monkeypatch.delenv("DYN_TCP_REQUEST_TIMEOUT")
    monkeypatch.setenv("DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS", "generate")
    with pytest.raises(ValueError, match="JSON list"):
        RuntimeConfig.from_env()
    monkeypatch.delenv("DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS")
    with pytest.raises(SystemExit):
        parse(["--request-plane", "carrier-pigeon"])


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--discovery-backend", "kubernetes"], {}, "--discovery-backend kubernetes (DYN_DISCOVERY_BACKEND): the "
     "kubernetes discovery backend is not built yet in tandem; use file or mem or etcd"),
])
def test_settings_not_built_yet_exit_2_naming_them(monkeypatch, capsys, argv, env, message):
    """Dynamo's Kubernetes discovery is understood, and refused plainly: no traceback, exit 2."""
    from tandem.frontend.main import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["--http-host", "127.0.0.1", "--http-port", "0", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("module", "argv", "env"), [
    ("tandem.frontend.main", ["--router-mode", "kv", "--router-durable-kv-events"], {}),
    ("tandem.frontend.main", ["--router-durable-kv-events", "--event-plane", "zmq"], {"DYN_EVENT_PLANE": "nats"}),
    ("tandem.router.main", ["--block-size", "16"], {"DYN_ROUTER_DURABLE_KV_EVENTS": "1"}),
    ("tandem.mocker.main", ["--durable-kv-events"], {}),
    ("tandem.mocker.main", [], {"DYN_DURABLE_KV_EVENTS": "true", "DYN_EVENT_PLANE": "zmq"}),
])
def test_durable_kv_events_without_nats_exit_2_saying_what_they_need(monkeypatch, capsys, module, argv, env):
    import importlib

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(argv)
    assert exit_.value.code == 2
    assert "durable KV events are kept in NATS JetStream; they need --event-plane nats" in capsys.readouterr().err


@pytest.mark.parametrize(("module", "argv", "env", "message"), [
    ("tandem.frontend.main", ["--migration-limit", "-1"], {}, "--migration-limit must be >= 0, got -1"),
    ("tandem.frontend.main", [], {"DYN_MIGRATION_LIMIT": "-2"}, "DYN_MIGRATION_LIMIT must be >= 0, got -2"),
    ("tandem.mocker.main", [], {"DYN_MIGRATION_LIMIT": "many"},
     "DYN_MIGRATION_LIMIT='many' is not a valid int (for --migration-limit)"),
    ("tandem.mocker.main", ["--migration-limit", "-1"], {}, "--migration-limit must be >= 0, got -1"),
])
def test_shared_options_name_where_a_bad_value_came_from(monkeypatch, capsys, module, argv, env, message):
    """`--migration-limit` is one Option row for the frontend and the workers: a bad value exits 2 naming
    the flag or the env var it came from."""
    import importlib

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as info:
        importlib.import_module(module).main(argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_taken_system_port_exits_2_naming_it(monkeypatch, capsys, tmp_path):
    """A system port someone else holds is the user's setting to fix: exit 2 and the port, no traceback."""
    import socket

    from tandem.mocker.main import main

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("DYN_SYSTEM_PORT", str(port))
        monkeypatch.setenv("DYN_FILE_KV", str(tmp_path))
        assert main([]) == 2
    assert f"error: DYN_SYSTEM_PORT: cannot listen on 0.0.0.0:{port}: " in capsys.readouterr().err


def test_dyn_log_levels_and_directives():
    configure_logging("warn,tandem.runtime.tcp=debug")
    assert logging.getLogger().level == logging.WARNING
    assert logging.getLogger("tandem.runtime.tcp").level == logging.DEBUG
    configure_logging("info")
    assert logging.getLogger().level == logging.INFO
    with pytest.raises(ValueError, match="unknown level 'loud'"):
        configure_logging("loud")


def test_jsonl_logging(capfd):
    configure_logging("info", jsonl=True)
    logging.getLogger("tandem.test").info("hello %s", "world")
    err = capfd.readouterr().err.strip().splitlines()[-1]
    import json

    entry = json.loads(err)
    assert entry["message"] == "hello world" and entry["level"] == "INFO" and entry["target"] == "tandem.test"
    configure_logging("info")


def test_context_stop_kill_and_links():
    parent, child, grandchild = Context("p"), Context(), Context()
    parent.link_child(child)
    child.link_child(grandchild)
    seen = []
    child.on_signal(seen.append)
    parent.stop_generating()
    assert child.is_stopped() and not child.is_killed() and grandchild.is_stopped()
    parent.kill()
    assert grandchild.is_killed() and seen == [False, True]
    parent.kill()  # idempotent
    assert seen == [False, True]
    late = Context()
    parent.link_child(late)
    assert late.is_killed()
    assert parent.id() == "p"


def test_tandem_command():
    out = subprocess.run([sys.executable, "-m", "tandem", "--help"], capture_output=True, text=True, check=True)
    assert "model" in out.stdout and "discovery" in out.stdout
    out = subprocess.run([sys.executable, "-m", "tandem", "version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("tandem ")
    bad = subprocess.run([sys.executable, "-m", "tandem", "frobnicate"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command" in bad.stderr


def test_tandem_discovery_ls(tmp_path):
    import asyncio

    from tandem.runtime.discovery import FileStore

    async def register():
        store = FileStore(str(tmp_path))
        await store.start()
        await store.put("v1/instances/ns/backend/generate/abc", b'{"instance_id": 2748}', leased=False)
        await store.close()

    asyncio.run(register())
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "discovery", "ls", "--discovery-backend", "file"],
        capture_output=True, text=True, check=True, env={**__import__("os").environ, "DYN_FILE_KV": str(tmp_path)},
    )
    assert 'v1/instances/ns/backend/generate/abc  {"instance_id": 2748}' in out.stdout


def test_the_advertised_address_is_never_a_wildcard(monkeypatch):
    from tandem.runtime.config import WILDCARDS, RuntimeConfig

    assert RuntimeConfig(advertise_host="10.9.8.7", tcp_host="0.0.0.0").advertised_host() == "10.9.8.7"
    assert RuntimeConfig(tcp_host="10.1.2.3").advertised_host() == "10.1.2.3"  # Dynamo's: listen and advertise
    assert RuntimeConfig(tcp_host="0.0.0.0").advertised_host() not in WILDCARDS
    monkeypatch.setenv("ETCD_ENDPOINTS", "http://etcd-a:2379,10.0.0.9:2379")
    config = RuntimeConfig(discovery_backend="etcd", request_plane="nats", nats_server="nats://10.0.0.7:4222")
    assert config.peer_hosts() == ["etcd-a", "10.0.0.9", "10.0.0.7"]  # the way to them is the way peers come
    assert RuntimeConfig().peer_hosts() == []  # file discovery, TCP: nothing shared to route towards


def test_advertise_host_flag_over_env(monkeypatch):
    from tandem.runtime.config import RuntimeConfig

    monkeypatch.setenv("DYN_ADVERTISE_HOST", "10.0.0.1")
    assert RuntimeConfig.from_env().advertise_host == "10.0.0.1"
    assert RuntimeConfig.from_args(parse(["--advertise-host", "10.0.0.2"])).advertised_host() == "10.0.0.2"


def test_a_shared_worker_flag_is_one_row_in_every_worker_kind(monkeypatch):
    """The worker kinds add the same `Option` rows: the same flags (aliases too), env vars and destination in
    each; only the default is the kind's own (blocks of 64 tokens in the mocker, 16 in the test engine)."""
    from tandem.llm.model_card import ModelType
    from tandem.mocker.args import build_parser as mocker_parser
    from tandem.mocker.args import parse_args as mocker_args
    from tandem.runtime.options import MIGRATION_LIMIT, RUNTIME_OPTIONS
    from tandem.testing.engine import build_parser as engine_parser
    from tandem.testing.engine import parse_args as engine_args
    from tandem.worker.config import (
        BLOCK_SIZE,
        CONTEXT_LENGTH,
        ENDPOINT_TYPES,
        MODEL_PATH,
        PARSER_OPTIONS,
        SERVED_MODEL_NAME,
    )

    parsers = {"mocker": mocker_parser(), "test engine": engine_parser()}
    for row in (MODEL_PATH, SERVED_MODEL_NAME, ENDPOINT_TYPES, CONTEXT_LENGTH, BLOCK_SIZE, MIGRATION_LIMIT,
                *PARSER_OPTIONS, *RUNTIME_OPTIONS):
        for kind, parser in parsers.items():
            for flag in row.flags:
                action = parser._option_string_actions[flag]
                assert (action.dest, action.default) == (row.dest, None), (kind, flag)
                assert all(env in action.help for env in row.envs), (kind, flag)

    assert "default 64" in parsers["mocker"]._option_string_actions["--block-size"].help
    assert "default 16" in parsers["test engine"]._option_string_actions["--block-size"].help
    assert (mocker_args([]).engine.block_size, engine_args([])[1].block_size) == (64, 16)
    assert (mocker_args(["--block-size", "32"]).engine.block_size,
            engine_args(["--block-size", "32"])[1].block_size) == (32, 32)
    monkeypatch.setenv("DYN_ENDPOINT_TYPES", "completions")  # the vLLM worker's env var, now every kind's
    assert mocker_args([]).model_type == ModelType.Completions
    assert engine_args([])[1].endpoint_types == "completions"
    assert engine_args(["--dyn-endpoint-types", "chat"])[1].endpoint_types == "chat"  # the flag wins


@pytest.mark.parametrize("module", ["tandem.mocker.args", "tandem.testing.engine"])
def test_a_shared_worker_flag_names_its_bad_value(capsys, module):
    import importlib

    with pytest.raises(SystemExit) as info:
        importlib.import_module(module).parse_args(["--block-size", "0"])
    assert info.value.code == 2 and "--block-size must be" in capsys.readouterr().err
