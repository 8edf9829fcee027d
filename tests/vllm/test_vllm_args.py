"""Command line of the vLLM worker: Dynamo flags, env fallbacks, validation and the engine defaults."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from typing import Any

import pytest
import vllm

from tandem.models import prepare_model
from tandem.vllm import envs
from tandem.vllm.args import (
    CPU_GPU_MEMORY_UTILIZATION,
    DEFAULT_MODEL,
    NOT_BUILT_FLAGS,
    Config,
    build_config,
    dump_config,
    parse_args,
)
from tandem.vllm.multimodal_roles import PROCESSOR_FLAGS

# Variables the worker reads or sets; each test starts without them and leaves the environment as it was.
_PREFIXES = ("DYN_", "VLLM_NIXL_SIDE_CHANNEL_", "VLLM_CPU_OMP_THREADS_BIND", "TANDEM_CPU_CORES", "VLLM_USE_AOT_COMPILE")


@pytest.fixture(scope="module", autouse=True)
def _import_vllm() -> None:
    """Pay vLLM's import and plugin loading once for the module."""
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
    from vllm.platforms import current_platform

    current_platform.is_cpu()


@pytest.fixture(autouse=True)
def clean_env():
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(_PREFIXES):
            del os.environ[name]
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(prepare_model())


def build(*argv: str, is_cpu: bool | None = True, apply_env: bool = False) -> Config:
    return build_config(list(argv), is_cpu=is_cpu, apply_env=apply_env)


def transfer_json(config: Config) -> dict | None:
    cfg = config.engine_args.kv_transfer_config
    if cfg is None:
        return None
    out: dict[str, Any] = {"kv_connector": cfg.kv_connector, "kv_role": cfg.kv_role}
    if cfg.kv_connector_module_path:
        out["kv_connector_module_path"] = cfg.kv_connector_module_path
    if cfg.kv_connector_extra_config:
        out["kv_connector_extra_config"] = cfg.kv_connector_extra_config
    return out


# -------------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--is-prefill-worker", "--is-decode-worker"], "Cannot set both --is-prefill-worker and --is-decode-worker"),
        (["--served-model-name", "a", "b"], "We do not support multiple model names"),
        (["--connector", "nixl", "foo"], "Invalid connector(s): foo"),
        (["--connector", "none", "nixl"], "'none' and 'null' cannot be combined with other connectors"),
        (["--connector", "kvbm", "null"], "'none' and 'null' cannot be combined with other connectors"),
        (["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'],
         "Cannot specify both --kv-transfer-config and --connector flags"),
        (["--connector", "lmcache", "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'],
         "Cannot specify both --kv-transfer-config and --connector flags"),
        (["--block-size", "16"], "--block-size 16 is not supported on CPU"),
        (["--migration-limit", "-1"], "--migration-limit must be >= 0"),
        (["--cpu-cores", "first"], "--cpu-cores 'first' is not a core list"),
        (["--endpoint-types", "chat,images"], "unknown model type 'images'"),
        (["--enable-sleep-mode"], "--enable-sleep-mode is not supported by vLLM's CPU backend"),
        (["--endpoint-types", "embedding"], "--endpoint-types embedding needs an embedding worker"),
        (["--embedding-worker", "--is-prefill-worker"], "--is-prefill-worker: an embedding worker"),
        (["--runner", "pooling", "--use-vllm-tokenizer"], "--use-vllm-tokenizer: an embedding worker"),
        (["--embedding-worker", "--dyn-reasoning-parser", "qwen3"], "--dyn-reasoning-parser: an embedding worker"),
        (["--embedding-worker", "--runner", "generate"], "it cannot go with --runner generate"),
        (["--runner", "pooling", "--is-decode-worker"], "--is-decode-worker: an embedding worker"),
        (["--embedding-worker", "--connector", "lmcache"], "an embedding worker moves no KV"),
        (["--embedding-worker", "--endpoint-types", "chat"], "an embedding worker serves embedding only"),
    ],
)
def test_validation_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        build(*argv)
    assert message in str(info.value)


def test_kv_transfer_config_conflict_explains_connector_none() -> None:
    with pytest.raises(ValueError, match="pass --connector none to use your own --kv-transfer-config"):
        build("--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}')


def test_kv_transfer_config_with_connector_none_is_kept() -> None:
    user = '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_consumer"}'
    config = build("--connector", "none", "--kv-transfer-config", user)
    assert config.connector == []
    assert transfer_json(config) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_consumer"}


def test_missing_template_names_the_expanded_path(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TEMPLATE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        build("--custom-jinja-template", "$TEMPLATE_DIR/missing.jinja")
    assert str(tmp_path / "missing.jinja") in str(info.value)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope.jinja")):
        build("--custom-jinja-template", "~/nope.jinja")


def test_template_found_after_expansion(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    monkeypatch.setenv("TEMPLATE_DIR", str(tmp_path))
    config = build("--custom-jinja-template", "$TEMPLATE_DIR/t.jinja")
    assert config.custom_jinja_template == str(tmp_path / "t.jinja")


@pytest.mark.parametrize(("argv", "message"), [
    (["--is-prefill-worker", "--is-decode-worker"], "Cannot set both --is-prefill-worker and --is-decode-worker"),
    (["--custom-jinja-template", "/nonexistent/t.jinja"], "/nonexistent/t.jinja"),  # a missing file
])
def test_parse_args_reports_errors_like_argparse(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build("--no-such-flag")
    assert info.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------
# Env fallbacks and precedence


def test_defaults() -> None:
    config = build()
    assert (config.namespace, config.component, config.endpoint) == ("dynamo", "backend", "generate")
    assert config.connector == ["nixl"]
    assert config.migration_limit == 0
    assert config.enable_local_indexer is True
    assert config.endpoint_types == "chat,completions"
    assert config.sleep_mode_level == 1
    assert config.model == DEFAULT_MODEL and config.served_model_name == DEFAULT_MODEL
    assert config.runtime.namespace == "dynamo"


@pytest.mark.parametrize("value", ["true", "1", "yes", "on", "TRUE"])
def test_env_bool_true(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DYN_VLLM_IS_PREFILL_WORKER", value)
    config = build()
    assert config.is_prefill_worker and config.component == "prefill"


@pytest.mark.parametrize("value", ["false", "0", "no", "off"])
def test_env_bool_false(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DYN_VLLM_IS_PREFILL_WORKER", value)
    assert not build().is_prefill_worker


def test_the_worker_flags_are_the_shared_rows() -> None:
    """The flags the vLLM worker shares with the mocker and the test engine are the same `Option` rows."""
    from tandem.runtime.options import MIGRATION_LIMIT, RUNTIME_OPTIONS
    from tandem.vllm.args import build_dynamo_parser
    from tandem.worker import config as worker

    parser = build_dynamo_parser()
    for row in (worker.ENDPOINT_TYPES, worker.CUSTOM_JINJA_TEMPLATE, worker.IS_PREFILL_WORKER, worker.IS_DECODE_WORKER,
                worker.DURABLE_KV_EVENTS, *worker.PARSER_OPTIONS, MIGRATION_LIMIT, *RUNTIME_OPTIONS):
        for flag in row.flags:
            action = parser._option_string_actions[flag]
            assert action.dest == row.dest and all(env in action.help for env in row.envs), flag


def test_cli_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_VLLM_IS_PREFILL_WORKER", "true")
    monkeypatch.setenv("DYN_NAMESPACE", "from-env")
    monkeypatch.setenv("DYN_MIGRATION_LIMIT", "3")
    monkeypatch.setenv("DYN_CONNECTOR", "nixl")
    monkeypatch.setenv("DYN_ENDPOINT_TYPES", "chat")
    config = build("--no-is-prefill-worker", "--namespace", "from-cli", "--migration-limit", "5",
                   "--connector", "lmcache", "--dyn-endpoint-types", "completions")
    assert config.component == "backend" and not config.is_prefill_worker
    assert config.namespace == "from-cli" and config.runtime.namespace == "from-cli"
    assert config.migration_limit == 5
    assert config.connector == ["lmcache"]
    assert config.endpoint_types == "completions"


def test_env_values_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_NAMESPACE", "ns1")
    monkeypatch.setenv("DYN_MIGRATION_LIMIT", "3")
    monkeypatch.setenv("DYN_CONNECTOR", "lmcache")
    monkeypatch.setenv("DYN_VLLM_USE_TOKENIZER", "yes")
    monkeypatch.setenv("DYN_VLLM_SLEEP_MODE_LEVEL", "2")
    monkeypatch.setenv("DYN_LOCAL_INDEXER", "off")
    monkeypatch.setenv("DYN_REQUEST_PLANE", "tcp")
    config = build()
    assert config.namespace == "ns1"
    assert config.migration_limit == 3
    assert config.connector == ["lmcache"]
    assert config.use_vllm_tokenizer
    assert config.sleep_mode_level == 2
    assert not config.enable_local_indexer
    assert config.runtime.request_plane == "tcp"


def test_parsers_go_to_the_card_and_the_thinking_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_REASONING_PARSER", "deepseek_r1")
    config = build("--dyn-tool-call-parser", "hermes")
    assert (config.dyn_tool_call_parser, config.dyn_reasoning_parser) == ("hermes", "deepseek_r1")
    budget = config.engine_args.reasoning_config
    assert (budget.reasoning_start_str, budget.reasoning_end_str) == ("<think>", "</think>")
    harmony = build("--dyn-reasoning-parser", "gpt_oss").engine_args.reasoning_config
    assert harmony.reasoning_start_str == "<|channel|>analysis<|message|>"
    monkeypatch.delenv("DYN_REASONING_PARSER")
    assert build().engine_args.reasoning_config is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--dyn-tool-call-parser", "kimi_k3"], "--dyn-tool-call-parser (DYN_TOOL_CALL_PARSER): unknown tool-call "
     "parser 'kimi_k3'; known: hermes"),
    (["--dyn-reasoning-parser", "nope"], "--dyn-reasoning-parser (DYN_REASONING_PARSER): unknown reasoning parser "
     "'nope'; known: deepseek_r1"),
    (["--use-vllm-tokenizer", "--dyn-reasoning-parser", "qwen3"], "--dyn-tool-call-parser and "
     "--dyn-reasoning-parser need token input"),
])
def test_parser_names_not_built_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build(*argv)


def test_durable_kv_events_need_the_nats_event_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=re.escape("--durable-kv-events (DYN_DURABLE_KV_EVENTS): durable KV events "
                                                   "are kept in NATS JetStream; they need --event-plane nats")):
        build("--durable-kv-events")
    assert build("--durable-kv-events", "--event-plane", "nats").durable_kv_events is True
    monkeypatch.setenv("DYN_DURABLE_KV_EVENTS", "1")
    monkeypatch.setenv("DYN_EVENT_PLANE", "nats")
    assert build().durable_kv_events is True


def test_bad_env_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_MIGRATION_LIMIT", "many")
    with pytest.raises(ValueError, match="DYN_MIGRATION_LIMIT"):
        build()
    monkeypatch.setenv("DYN_MIGRATION_LIMIT", "0")
    monkeypatch.setenv("DYN_VLLM_SLEEP_MODE_LEVEL", "7")
    with pytest.raises(ValueError, match="--sleep-mode-level must be 1, 2 or 3"):
        build()


def test_local_indexer_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build("--no-enable-local-indexer").enable_local_indexer is False
    monkeypatch.setenv("DYN_LOCAL_INDEXER", "false")
    assert build().enable_local_indexer is False
    assert build("--enable-local-indexer").enable_local_indexer is True


def test_underscore_spelling_of_dynamo_flags() -> None:
    config = build("--is_prefill_worker", "--migration_limit=2", "--max_model_len", "256")
    assert config.is_prefill_worker and config.migration_limit == 2
    assert config.engine_args.max_model_len == 256


def test_enable_multimodal_is_taken_by_every_worker_role(monkeypatch: pytest.MonkeyPatch) -> None:
    config = build("--enable-multimodal")
    assert config.enable_multimodal and not config.allow_private_media_urls
    assert not build().enable_multimodal
    monkeypatch.setenv("DYN_VLLM_ENABLE_MULTIMODAL", "1")
    monkeypatch.setenv("TANDEM_ALLOW_PRIVATE_MEDIA_URLS", "1")
    config = build()
    assert config.enable_multimodal and config.allow_private_media_urls
    monkeypatch.delenv("DYN_VLLM_ENABLE_MULTIMODAL")
    for role in ("--is-prefill-worker", "--is-decode-worker"):  # a prompt with images, prefilled and decoded apart
        disaggregated = build("--enable-multimodal", role)
        assert disaggregated.enable_multimodal and disaggregated.engine_args.kv_transfer_config is not None


def test_the_encoder_cache_roles(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--vllm-native-encoder-worker (component encoder, no KV connector or events) and --ec-consumer-mode build
    vLLM's ECTransferConfig; what cannot work is refused, naming the flag."""
    store = str(tmp_path)
    encoder = build("--enable-multimodal", "--vllm-native-encoder-worker", "--ec-storage-path", store,
                    "--ec-extra-config", '{"extra": 1}')
    ec = encoder.engine_args.ec_transfer_config
    assert encoder.component == "encoder" and encoder.connector == [] and not encoder.use_kv_events
    assert (ec.ec_connector, ec.ec_role) == ("ECExampleConnector", "ec_producer")
    assert ec.ec_connector_extra_config == {"extra": 1, "shared_storage_path": store}
    monkeypatch.setenv("DYN_VLLM_EC_CONSUMER_MODE", "1")
    monkeypatch.setenv("DYN_VLLM_EC_STORAGE_PATH", store)
    consumer = build("--enable-multimodal")
    assert consumer.component == "backend" and consumer.engine_args.ec_transfer_config.ec_role == "ec_consumer"
    assert consumer.use_kv_events
    monkeypatch.delenv("DYN_VLLM_EC_CONSUMER_MODE")
    assert build("--enable-multimodal").engine_args.ec_transfer_config is None
    for argv, message in (
        (["--vllm-native-encoder-worker"], "^Use --enable-multimodal with --vllm-native-encoder-worker"),
        (["--enable-multimodal", "--vllm-native-encoder-worker", "--ec-consumer-mode"], "one encoder-cache connector"),
        (["--enable-multimodal", "--vllm-native-encoder-worker", "--ec-storage-path", ""], "needs --ec-storage-path"),
        (["--enable-multimodal", "--ec-consumer-mode", "--ec-extra-config", "[1]"], "a JSON object"),
        (["--enable-multimodal", "--ec-consumer-mode", "--ec-extra-config", "{"], "is not JSON"),
        (["--enable-multimodal", "--vllm-native-encoder-worker", "--connector", "lmcache"], "leave --connector out"),
        (["--enable-multimodal", "--ec-consumer-mode", "--is-decode-worker"], "make the prefill worker the encoders'"),
    ):
        with pytest.raises(ValueError, match=message):
            build(*argv)


def test_route_to_encoder_is_the_consumer_role(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--route-to-encoder (env DYN_VLLM_ROUTE_TO_ENCODER), Dynamo's newer name for the consumer, builds what
    --ec-consumer-mode builds, on an aggregated worker or a prefill worker (E+P+D, the prefill's KV cache still
    moving by NIXL); a worker that computes no prompt refuses it."""
    store = ["--ec-storage-path", str(tmp_path)]
    named = build("--enable-multimodal", "--route-to-encoder", *store)
    older = build("--enable-multimodal", "--ec-consumer-mode", *store)
    assert named.ec_consumer_mode and named.component == "backend"
    assert named.engine_args.ec_transfer_config == older.engine_args.ec_transfer_config
    assert named.engine_args.ec_transfer_config.ec_role == "ec_consumer"
    prefill = build("--enable-multimodal", "--route-to-encoder", "--disaggregation-mode", "prefill", *store)
    assert prefill.ec_consumer_mode and prefill.component == "prefill"
    assert prefill.engine_args.ec_transfer_config.ec_role == "ec_consumer"
    assert transfer_json(prefill)["kv_connector"] == "NixlConnector"  # type: ignore[index]
    monkeypatch.setenv("DYN_VLLM_ROUTE_TO_ENCODER", "true")
    assert build("--enable-multimodal", *store).ec_consumer_mode
    assert not build("--enable-multimodal", "--no-route-to-encoder", *store).ec_consumer_mode
    monkeypatch.delenv("DYN_VLLM_ROUTE_TO_ENCODER")
    for argv, message in (
        ([], "^Use --enable-multimodal with --route-to-encoder$"),
        (["--disaggregation-mode", "decode"], "--route-to-encoder with --disaggregation-mode decode: only a worker"),
        (["--disaggregation-mode", "encode"], "--route-to-encoder with --disaggregation-mode encode: only a worker"),
        (["--enable-multimodal", "--multimodal-embedding-cache-capacity-gb", "1"], "one encoder-cache connector"),
    ):
        with pytest.raises(ValueError, match=message):
            build(*argv, "--route-to-encoder", *store)


def test_embedding_transfer_mode_local(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--embedding-transfer-mode local (env DYN_VLLM_EMBEDDING_TRANSFER_MODE): a consumer takes encoder outputs as
    embeddings (nixl-read, nixl-write: by NIXL), so its engine gets vLLM's --enable-mm-embeds and no
    encoder-cache connector; the encoder keeps its producer connector (whose files it names or offers). Other
    connectors and a role without an encoder are refused, naming the flag."""
    consumer = build("--enable-multimodal", "--route-to-encoder", "--embedding-transfer-mode", "local")
    assert consumer.ec_consumer_mode and consumer.embedding_transfer_mode == "local"
    assert consumer.engine_args.enable_mm_embeds and consumer.engine_args.ec_transfer_config is None
    assert not build("--enable-multimodal", "--route-to-encoder", "--ec-storage-path",
                     str(tmp_path)).engine_args.enable_mm_embeds
    monkeypatch.setenv("DYN_VLLM_EMBEDDING_TRANSFER_MODE", "LOCAL")
    encoder = build("--enable-multimodal", "--disaggregation-mode", "encode", "--ec-storage-path", str(tmp_path))
    assert encoder.engine_args.ec_transfer_config.ec_role == "ec_producer" and not encoder.engine_args.enable_mm_embeds
    monkeypatch.delenv("DYN_VLLM_EMBEDDING_TRANSFER_MODE")
    for mode in ("nixl-read", "nixl-write"):
        by_nixl = build("--enable-multimodal", "--route-to-encoder", "--embedding-transfer-mode", mode)
        assert by_nixl.embedding_transfer_mode == mode and by_nixl.engine_args.enable_mm_embeds
        assert by_nixl.engine_args.ec_transfer_config is None
    consumer_args = ("--enable-multimodal", "--route-to-encoder")
    for argv, message in (
        ((*consumer_args, "--embedding-transfer-mode", "local", "--ec-storage-path", str(tmp_path)),
         "^--ec-storage-path with --embedding-transfer-mode: a consumer taking embeddings has no"),
        ((*consumer_args, "--embedding-transfer-mode", "local", "--ec-connector-backend", "Other"),
         "hands over what --ec-connector-backend ECExampleConnector stores in files, not Other's"),
        (("--enable-multimodal", "--embedding-transfer-mode", "local"), "for an encoder worker .* or its consumer"),
        (("--enable-multimodal", "--multimodal-embedding-cache-capacity-gb", "1", "--embedding-transfer-mode",
          "local"), "for an encoder worker .* or its consumer"),
    ):
        with pytest.raises(ValueError, match=message):
            build(*argv)


def test_disaggregation_mode_names_the_role(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--disaggregation-mode (env DYN_VLLM_DISAGGREGATION_MODE) names what --is-prefill-worker,
    --is-decode-worker and --vllm-native-encoder-worker do; the older flags agreeing with it are taken, a
    contradiction is refused."""
    prefill = build("--disaggregation-mode", "prefill")
    assert prefill.is_prefill_worker and not prefill.is_decode_worker and prefill.component == "prefill"
    assert transfer_json(prefill) == transfer_json(build("--is-prefill-worker"))
    decode = build("--disaggregation-mode", "decode")
    assert decode.is_decode_worker and decode.component == "backend" and not decode.use_kv_events
    agg = build("--disaggregation-mode", "agg")
    assert not (agg.is_prefill_worker or agg.is_decode_worker) and agg.use_kv_events
    assert build("--disaggregation-mode", "prefill", "--is-prefill-worker").is_prefill_worker
    encoder = build("--disaggregation-mode", "encode", "--enable-multimodal", "--ec-storage-path", str(tmp_path))
    assert encoder.vllm_native_encoder_worker and encoder.component == "encoder" and encoder.connector == []
    assert encoder.engine_args.ec_transfer_config.ec_role == "ec_producer"
    monkeypatch.setenv("DYN_VLLM_DISAGGREGATION_MODE", "decode")
    assert build().is_decode_worker
    monkeypatch.delenv("DYN_VLLM_DISAGGREGATION_MODE")
    for argv, message in (
        (["--disaggregation-mode", "agg", "--is-prefill-worker"], "--disaggregation-mode agg contradicts"),
        (["--disaggregation-mode", "decode", "--is-prefill-worker"], "contradicts --is-prefill-worker"),
        (["--disaggregation-mode", "encode"], "^Use --enable-multimodal with --disaggregation-mode encode"),
        (["--disaggregation-mode", "encode", "--enable-multimodal", "--ec-consumer-mode"], "one encoder-cache"),
    ):
        with pytest.raises(ValueError, match=message):
            build(*argv)


def test_the_embedding_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """--multimodal-embedding-cache-capacity-gb (or its variable) puts tandem's host-memory connector in the
    ec_both role; 0 is off; it takes the engine's one connector, so the encoder roles are refused with it."""
    cached = build("--enable-multimodal", "--multimodal-embedding-cache-capacity-gb", "0.5")
    ec = cached.engine_args.ec_transfer_config
    assert (ec.ec_connector, ec.ec_role, ec.ec_connector_module_path) == (
        "EmbeddingCacheConnector", "ec_both", "tandem.vllm.embedding_cache")
    assert ec.ec_connector_extra_config == {"multimodal_embedding_cache_capacity_gb": 0.5}
    monkeypatch.setenv("DYN_MULTIMODAL_EMBEDDING_CACHE_CAPACITY_GB", "2")
    assert build("--enable-multimodal").engine_args.ec_transfer_config.ec_connector_extra_config == {
        "multimodal_embedding_cache_capacity_gb": 2.0}
    monkeypatch.setenv("DYN_MULTIMODAL_EMBEDDING_CACHE_CAPACITY_GB", "0")
    assert build("--enable-multimodal").engine_args.ec_transfer_config is None
    monkeypatch.delenv("DYN_MULTIMODAL_EMBEDDING_CACHE_CAPACITY_GB")
    size = ("--multimodal-embedding-cache-capacity-gb", "1")
    for argv, message in (
        ([*size], "^Use --enable-multimodal with --multimodal-embedding-cache-capacity-gb"),
        (["--enable-multimodal", *size, "--ec-consumer-mode"], "one encoder-cache connector"),
        (["--enable-multimodal", *size, "--vllm-native-encoder-worker"], "one encoder-cache connector"),
        (["--enable-multimodal", *size, "--ec-storage-path", "/tmp"], "^--ec-storage-path: the embedding cache"),
        (["--enable-multimodal", *size, "--ec-connector-backend", "X"], "^--ec-connector-backend: the embedding"),
        (["--enable-multimodal", *size, "--ec-transfer-config", '{"ec_connector": "X", "ec_role": "ec_both"}'],
         "Cannot specify both --ec-transfer-config and --multimodal-embedding-cache-capacity-gb"),
    ):
        with pytest.raises(ValueError, match=message):
            build(*argv)
    with pytest.raises(ValueError, match="--multimodal-embedding-cache-capacity-gb must be >= 0"):
        build("--enable-multimodal", "--multimodal-embedding-cache-capacity-gb", "-1")


@pytest.mark.parametrize(("flag", "env", "takes_value"), NOT_BUILT_FLAGS)
def test_multimodal_flags_not_built_are_refused(monkeypatch: pytest.MonkeyPatch, flag: str, env: str,
                                                takes_value: bool) -> None:
    """Dynamo's multimodal flags tandem does not build are understood, and refused by name rather than accepted
    and ignored."""
    argv = [flag, "x"] if takes_value else [flag]
    with pytest.raises(ValueError, match=f"^{flag}: not built in tandem"):
        build(*argv)
    monkeypatch.setenv(env, "x" if takes_value else "1")  # the environment variable alike
    with pytest.raises(ValueError, match=f"^{flag}: not built"):
        build()


@pytest.mark.parametrize(("flag", "env", "takes_value"), PROCESSOR_FLAGS)
def test_the_processor_roles_are_refused_saying_what_does_their_work(monkeypatch: pytest.MonkeyPatch, flag: str,
                                                                     env: str, takes_value: bool) -> None:
    argv = [flag, "x"] if takes_value else [flag]
    with pytest.raises(ValueError, match=f"^{flag}: tandem has no processor role: its frontend tokenizes"):
        build("--enable-multimodal", *argv)
    monkeypatch.setenv(env, "x" if takes_value else "1")
    with pytest.raises(ValueError, match=f"^{flag}: tandem has no processor role"):
        build()


def test_dynamos_older_role_flags_start_the_roles_tandem_builds(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--multimodal-encode-worker is an encoder (its outputs in the host's temporary directory unless
    --ec-storage-path says where), --multimodal-worker a consumer taking them as embeddings by file (NIXL with
    TRANSFER_LOCAL=0; the connector's consumer with --ec-consumer-mode), --multimodal-decode-worker a decode
    worker and --multimodal-encode-prefill-worker a worker encoding its own images; each needs
    --enable-multimodal, and one worker has one role."""
    mm = "--enable-multimodal"
    encoder = build(mm, "--multimodal-encode-worker")
    assert encoder.vllm_native_encoder_worker and encoder.component == "encoder"
    assert encoder.ec_storage_path == os.path.join(tempfile.gettempdir(), "tandem-encoder-cache")
    assert encoder.embedding_transfer_mode is None
    assert build(mm, "--multimodal-encode-worker", "--ec-storage-path", str(tmp_path)).ec_storage_path == str(tmp_path)
    worker = build(mm, "--multimodal-worker")
    assert worker.ec_consumer_mode and worker.embedding_transfer_mode == "local" and worker.component == "backend"
    prefill = build(mm, "--multimodal-worker", "--is-prefill-worker")
    assert prefill.ec_consumer_mode and prefill.is_prefill_worker and prefill.component == "prefill"
    connector = build(mm, "--multimodal-worker", "--ec-consumer-mode", "--ec-storage-path", str(tmp_path))
    assert connector.embedding_transfer_mode is None
    assert connector.engine_args.ec_transfer_config.ec_role == "ec_consumer"
    decode = build(mm, "--multimodal-decode-worker")
    assert decode.is_decode_worker and decode.enable_multimodal and not decode.ec_consumer_mode
    own = build(mm, "--multimodal-encode-prefill-worker")
    assert own.enable_multimodal and not (own.ec_consumer_mode or own.vllm_native_encoder_worker)
    monkeypatch.setenv("TRANSFER_LOCAL", "0")
    assert build(mm, "--multimodal-worker").embedding_transfer_mode == "nixl-read"
    assert build(mm, "--multimodal-encode-worker").embedding_transfer_mode == "nixl-read"
    monkeypatch.delenv("TRANSFER_LOCAL")
    monkeypatch.setenv("DYN_VLLM_MULTIMODAL_WORKER", "1")
    assert build(mm).embedding_transfer_mode == "local"
    monkeypatch.delenv("DYN_VLLM_MULTIMODAL_WORKER")
    for argv, message in (
        (["--multimodal-worker"], "^Use --enable-multimodal with --multimodal-worker"),
        ([mm, "--multimodal-worker", "--multimodal-encode-worker"], "one multimodal role"),
        ([mm, "--multimodal-encode-worker", "--vllm-native-encoder-worker"], "one multimodal role"),
        ([mm, "--multimodal-decode-worker", "--is-prefill-worker"], "choose one"),
        ([mm, "--multimodal-encode-worker", "--disaggregation-mode", "agg"], "contradicts"),
    ):
        with pytest.raises(ValueError, match=message):
            build(*argv)


@pytest.mark.parametrize(
    ("argv", "component"),
    [
        ([], "backend"),
        (["--is-decode-worker"], "backend"),
        (["--is-prefill-worker"], "prefill"),
    ],
)
def test_component_names(argv: list[str], component: str) -> None:
    config = build(*argv)
    assert config.component == component and config.endpoint == "generate"


# -------------------------------------------------------------------------------------------------
# Engine defaults


NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
LMCACHE = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


@pytest.mark.parametrize(
    ("connectors", "expected"),
    [
        (["nixl"], NIXL),
        (["lmcache"], LMCACHE),
        (["NIXL"], NIXL),
        (["none"], None),
        (["null"], None),
        ([], None),
    ],
)
def test_kv_transfer_config(connectors: list[str], expected: dict | None) -> None:
    config = build("--connector", *connectors)
    assert transfer_json(config) == expected


@pytest.mark.parametrize("connectors", [["kvbm"], ["KVBM"], ["kvbm", "nixl"], ["nixl,kvbm"]])
def test_kvbm_is_refused_until_built(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                     connectors: list[str]) -> None:
    """Refused at parsing, flag or environment alike (the engine would fail at start on a missing module)."""
    with pytest.raises(SystemExit) as info:
        parse_args(["--connector", *connectors])
    assert info.value.code == 2
    assert "--connector kvbm: KV block-manager (KVBM) tiers are not built in tandem yet" in capsys.readouterr().err
    monkeypatch.setenv("DYN_CONNECTOR", " ".join(connectors))
    with pytest.raises(ValueError, match="^--connector kvbm: KV block-manager"):
        build()


@pytest.mark.parametrize("connectors", [["nixl", "lmcache"], ["lmcache,nixl"]])
def test_chained_connectors_are_refused_until_built(connectors: list[str]) -> None:
    """Two or more connectors make KVBM's PdConnector, which tandem does not have."""
    with pytest.raises(ValueError, match="^--connector .*: chaining connectors needs KVBM's PdConnector"):
        build("--connector", *connectors)


def test_mp_executor_for_nixl_tp1() -> None:
    assert build().engine_args.distributed_executor_backend == "mp"
    assert build("--connector", "lmcache").engine_args.distributed_executor_backend is None
    assert build("--connector", "none").engine_args.distributed_executor_backend is None
    explicit = build("--distributed-executor-backend", "uni")
    assert explicit.engine_args.distributed_executor_backend == "uni"
    assert build("--tensor-parallel-size", "2").engine_args.distributed_executor_backend is None


def test_nixl_progress_thread_extension_on_cpu_only() -> None:
    from tandem.vllm.engine_args import NIXL_CPU_EXTENSION

    assert build().engine_args.worker_extension_cls == NIXL_CPU_EXTENSION
    assert not build("--connector", "none").engine_args.worker_extension_cls
    assert not build(is_cpu=False).engine_args.worker_extension_cls
    own = build("--worker-extension-cls", "my.module.Extension").engine_args.worker_extension_cls
    assert own == "my.module.Extension"


def test_nixl_progress_thread_delay() -> None:
    """After importing the extension module, NIXL agents get a progress-thread poll timeout (nixl's
    Python API passes 0, a busy loop)."""
    import nixl._api  # noqa: F401  (NIXL is installed by scripts/install.sh: its absence is a failure)
    from vllm.distributed import nixl_utils

    from tandem.vllm.nixl_cpu import PROGRESS_DELAY_US, install_progress_delay

    assert install_progress_delay()
    bindings = __import__(nixl_utils.NixlWrapper.__module__, fromlist=["nixlBind"]).nixlBind
    config = bindings.nixlAgentConfig()
    config.useProgThread = True
    config.pthrDelay = 0
    assert bindings.nixlAgent("tandem-test-agent", config) is not None
    assert config.pthrDelay == PROGRESS_DELAY_US


def test_nixl_connector_leaves_the_model_thread_on_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's NIXL worker on CPU moves the creating thread (the model's OpenMP master) to the last core of
    the NUMA node; the extension puts it back on the cores it had."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    from tandem.vllm.nixl_cpu import keep_thread_affinity

    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))

    def moving_init(self: object, *args: object) -> None:  # what vLLM's __init__ does on CPU
        os.sched_setaffinity(0, {last})

    monkeypatch.setattr(NixlBaseConnectorWorker, "__init__", moving_init)
    assert keep_thread_affinity()
    seen: list[set[int]] = []

    def model_thread() -> None:  # its own thread: the test's affinity stays as it is
        os.sched_setaffinity(0, {first})
        NixlBaseConnectorWorker.__init__(object.__new__(NixlBaseConnectorWorker))
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    assert seen == [{first}]


def test_forced_engine_values() -> None:
    args = build("--enable-log-requests", "--disable-log-stats").engine_args
    assert args.enable_log_requests is False
    assert args.disable_log_stats is False
    assert args.skip_tokenizer_init is False
    assert args.enable_prefix_caching is True
    assert build("--no-enable-prefix-caching").engine_args.enable_prefix_caching is False


def test_kv_events_default() -> None:
    config = build()
    events = config.engine_args.kv_events_config
    assert events is not None
    assert events.enable_kv_cache_events and events.publisher == "zmq"
    assert events.endpoint == "tcp://*:20080"
    assert config.use_kv_events
    assert config.kv_events_port == 20080 and config.kv_events_endpoint == "tcp://127.0.0.1:20080"


def test_kv_events_port_env_and_dp_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_VLLM_KV_EVENT_PORT", "21000")
    config = build("--data-parallel-rank", "2")
    events = config.engine_args.kv_events_config
    assert events is not None and events.endpoint == "tcp://*:20998"
    assert config.engine_args.data_parallel_rank == 2
    # vLLM adds the rank back: the publisher binds the base port.
    assert config.kv_events_port == 21000


def test_no_kv_events_for_decode_or_without_prefix_caching() -> None:
    for argv in (["--is-decode-worker"], ["--no-enable-prefix-caching"]):
        config = build(*argv)
        assert config.engine_args.kv_events_config is None
        assert not config.use_kv_events and config.kv_events_port is None


def test_user_kv_events_config_is_kept() -> None:
    user = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:23000", "topic": "kv"}'
    config = build("--kv-events-config", user)
    events = config.engine_args.kv_events_config
    assert events is not None and events.topic == "kv"
    assert config.use_kv_events and config.kv_events_port == 23000
    disabled = build("--kv-events-config", '{"enable_kv_cache_events": false}')
    assert disabled.engine_args.kv_events_config is not None and not disabled.use_kv_events


@pytest.mark.parametrize(
    ("value", "message"),
    [("abc", "must be an integer port number"), ("80", "outside of the registered port range"),
     ("60000", "outside of the registered port range")],
)
def test_invalid_kv_event_port(monkeypatch: pytest.MonkeyPatch, value: str, message: str) -> None:
    monkeypatch.setenv("DYN_VLLM_KV_EVENT_PORT", value)
    assert envs.is_set("DYN_VLLM_KV_EVENT_PORT")
    with pytest.raises(ValueError, match=message):
        envs.DYN_VLLM_KV_EVENT_PORT  # noqa: B018
    with pytest.raises(ValueError, match=f"DYN_VLLM_KV_EVENT_PORT.*{message}"):
        build()
    # Decode workers never read it.
    assert build("--is-decode-worker").engine_args.kv_events_config is None


def test_envs_module() -> None:
    assert envs.DYN_VLLM_KV_EVENT_PORT == 20080
    assert not envs.is_set("DYN_VLLM_KV_EVENT_PORT")
    with pytest.raises(AttributeError):
        envs.NOT_A_VARIABLE  # noqa: B018


def test_nixl_side_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = build(), build()
    assert first.nixl_side_channel is not None and second.nixl_side_channel is not None
    host = first.env_updates["VLLM_NIXL_SIDE_CHANNEL_HOST"]
    assert host and first.nixl_side_channel[0] == host
    assert first.env_updates["VLLM_NIXL_SIDE_CHANNEL_PORT"] != second.env_updates["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    # vLLM listens on the port + data-parallel rank: the exported base compensates.
    ranked = build("--data-parallel-rank", "3")
    assert ranked.nixl_side_channel is not None
    assert int(ranked.env_updates["VLLM_NIXL_SIDE_CHANNEL_PORT"]) + 3 == ranked.nixl_side_channel[1]
    # CPU engines on different cores look from different ports (stable ports for workers started together).
    bound = build("--cpu-cores", "40-41").nixl_side_channel
    assert bound is not None and bound[1] >= 5600 + 40
    # Values already in the environment are the user's.
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "20097")
    kept = build()
    assert not any(name.startswith("VLLM_NIXL") for name in kept.env_updates)
    assert kept.nixl_side_channel == ("10.1.2.3", 20097)


def test_side_channel_port_comes_back_after_a_restart() -> None:
    """Ports are claimed per process (lock files) from a fixed start, so a restarted worker gets its port
    back: the port is part of vLLM's compile-cache key."""
    from tandem.vllm import engine_args

    first = engine_args._claim_port(43100)
    second = engine_args._claim_port(43100)
    assert second > first
    os.close(engine_args._claimed_ports.pop(first))  # the first worker exits
    assert engine_args._claim_port(43100) == first
    for port in (first, second):
        os.close(engine_args._claimed_ports.pop(port))


def test_nixl_side_channel_only_with_nixl() -> None:
    assert build("--connector", "lmcache").nixl_side_channel is None
    user = build("--connector", "none", "--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}')
    assert user.nixl_side_channel is not None


def test_apply_env_exports_updates() -> None:
    config = build_config(["--cpu-cores", "1"], is_cpu=True)
    for name, value in config.env_updates.items():
        assert os.environ[name] == value
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" in os.environ


# -------------------------------------------------------------------------------------------------
# CPU / GPU


def test_cpu_compiles_without_aot(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu 0.32 cannot load its AOT-compiled models back: CPU workers use the inductor cache."""
    assert build().env_updates["VLLM_USE_AOT_COMPILE"] == "0"
    assert "VLLM_USE_AOT_COMPILE" not in build(is_cpu=False).env_updates
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert "VLLM_USE_AOT_COMPILE" not in build().env_updates


def test_cpu_defaults() -> None:
    config = build()
    assert config.is_cpu
    assert config.engine_args.block_size == 32 and config.block_size == 32
    assert config.engine_args.gpu_memory_utilization == CPU_GPU_MEMORY_UTILIZATION == 0.3
    assert build("--gpu-memory-utilization", "0.5").engine_args.gpu_memory_utilization == 0.5
    assert build("--block-size", "64").engine_args.block_size == 64


def test_cpu_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build("--cpu-cores", "1").env_updates["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert build().env_updates.get("VLLM_CPU_OMP_THREADS_BIND") is None
    monkeypatch.setenv("TANDEM_CPU_CORES", "2-3")
    assert build().env_updates["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in build("--cpu-cores", "1").env_updates


def test_platform_detection_matches_vllm() -> None:
    from vllm.platforms import current_platform

    assert build_config([], apply_env=False).is_cpu == current_platform.is_cpu()


def test_gpu_has_no_cpu_specifics() -> None:
    from vllm.engine.arg_utils import EngineArgs

    config = build("--cpu-cores", "1", is_cpu=False)
    assert not config.is_cpu
    assert config.engine_args.block_size == 16
    assert config.engine_args.gpu_memory_utilization == EngineArgs.gpu_memory_utilization
    assert "VLLM_CPU_OMP_THREADS_BIND" not in config.env_updates
    assert build("--block-size", "16", is_cpu=False).engine_args.block_size == 16


# -------------------------------------------------------------------------------------------------
# Model and passthrough


def test_default_alias_resolves_to_prepared_folder(model_dir: str) -> None:
    config = build("--model", "smollm2")
    # any alias of tandem's default model is served under the model's real name
    assert config.model == "smollm2" and config.served_model_name == "SmolLM2-135M-Instruct"
    assert config.model_path == model_dir
    assert config.engine_args.model == model_dir
    assert config.engine_args.served_model_name == "SmolLM2-135M-Instruct"


def test_no_model_serves_tandem_default(model_dir: str) -> None:
    config = build()
    assert config.model == DEFAULT_MODEL and config.engine_args.model == model_dir


def test_local_path_and_served_name(model_dir: str) -> None:
    config = build("--model", model_dir, "--served-model-name", "tiny")
    assert config.model == model_dir and config.model_path == model_dir
    assert config.served_model_name == "tiny"
    assert config.engine_args.served_model_name == ["tiny"]


def test_hub_id_is_not_rewritten() -> None:
    config = build("--model", "someorg/some-model-that-is-not-cached")
    assert config.engine_args.model == "someorg/some-model-that-is-not-cached"
    assert config.model_path == "someorg/some-model-that-is-not-cached"
    assert config.served_model_name == "someorg/some-model-that-is-not-cached"


def test_missing_local_path() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        build("--model", "./no/such/folder")


def test_vllm_args_pass_through() -> None:
    args = build(
        "--max-model-len", "512", "--enable-lora", "--max-lora-rank", "8", "--enable-prompt-embeds",
        "--max-num-seqs", "4", "--enforce-eager", "--dtype", "bfloat16", "--seed", "7",
        "--max-loras", "2", "--data-parallel-rank", "1", "--tensor-parallel-size", "1",
    ).engine_args
    assert args.max_model_len == 512
    assert args.enable_lora is True and args.max_lora_rank == 8 and args.max_loras == 2
    assert args.enable_prompt_embeds is True
    assert args.max_num_seqs == 4 and args.enforce_eager is True
    assert args.dtype == "bfloat16" and args.seed == 7
    assert args.data_parallel_rank == 1


def test_dynamo_and_vllm_flags_interleave() -> None:
    config = build("--max-model-len", "256", "--is-prefill-worker", "--served-model-name", "x",
                   "--connector", "lmcache", "--seed", "3")
    assert config.is_prefill_worker and config.served_model_name == "x"
    assert config.connector == ["lmcache"]
    assert config.engine_args.max_model_len == 256 and config.engine_args.seed == 3


def test_dump_config(tmp_path) -> None:
    config = build("--max-model-len", "512", "--dump-config-to", str(tmp_path / "out" / "c.json"))
    assert config.dump_config_to is not None
    dump_config(config.dump_config_to, config)
    data = json.loads((tmp_path / "out" / "c.json").read_text())
    assert data["component"] == "backend" and data["connector"] == ["nixl"]
    assert data["engine_args"]["max_model_len"] == 512
    assert data["engine_args"]["kv_transfer_config"]["kv_connector"] == "NixlConnector"
    assert data["engine_args"]["kv_events_config"]["endpoint"] == "tcp://*:20080"
    assert data["runtime"]["namespace"] == "dynamo"


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})


def test_help_shows_dynamo_and_vllm_flags() -> None:
    result = _run("from tandem.vllm.args import parse_args; parse_args(['--help'])")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("Dynamo Runtime Options", "Dynamo vLLM Options", "vLLM Engine Options",
                 "--is-prefill-worker", "--connector", "--cpu-cores", "--max-model-len",
                 "--kv-transfer-config", "--enable-prefix-caching"):
        assert text in out, text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--version"])
    assert info.value.code == 0
    assert f"vLLM {vllm.__version__}" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--embedding-worker"], ["--runner", "pooling"],
                                  ["--embedding-worker", "--endpoint-types", "embedding"]])
def test_an_embedding_worker_runs_the_pooling_runner_alone(argv: list[str]) -> None:
    """No KV connector, no KV events (embeddings are routed by load) and the embedding endpoint type."""
    config = build(*argv)
    assert config.embedding_worker and config.engine_args.runner == "pooling"
    assert config.connector == [] and config.engine_args.kv_transfer_config is None
    assert config.engine_args.kv_events_config is None and not config.use_kv_events
    assert config.endpoint_types == "embedding"


@pytest.mark.parametrize("role", [[], ["--is-prefill-worker"], ["--is-decode-worker"]])
@pytest.mark.parametrize("runner", [[], ["--runner", "auto"], ["--runner", "generate"]])
def test_a_generation_worker_runs_the_generate_runner(role: list[str], runner: list[str]) -> None:
    """Forced, as Dynamo does: vLLM's `auto` would give an embedding model the pooling runner, which a worker
    registered for chat and completions cannot serve."""
    config = build(*role, *runner)
    assert not config.embedding_worker and config.engine_args.runner == "generate"


@pytest.mark.parametrize("role", [[], ["--is-prefill-worker"], ["--is-decode-worker"]])
def test_a_generation_worker_refuses_another_runner(role: list[str]) -> None:
    """vLLM's other runner (a speculative-decoding draft model's) is refused by name, not accepted and ignored."""
    with pytest.raises(ValueError, match="^--runner draft: a generation worker .* runs vLLM's generate runner"):
        build(*role, "--runner", "draft")
    with pytest.raises(ValueError, match="^--convert embed adapts the model to vLLM's pooling runner"):
        build(*role, "--convert", "embed")  # vLLM's `auto` runner would then pool
