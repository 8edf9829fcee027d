"""`tandem run`: the deployment spec (flags, YAML, validation), core assignment, command lines, log prefixes,
and end to end through the real `tandem run` process with the deterministic test engine standing in for vLLM."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tandem.launch.cores import format_cores, parse_cores, round_robin
from tandem.launch.main import curl_example, frontend_url, main, wait_until_serving
from tandem.launch.plan import Plan, served_name
from tandem.launch.spec import RunSpec, SpecError, build_spec, load_file
from tandem.launch.supervisor import LogMux, Supervisor
from tests.support import REPO

MODEL = "SmolLM2-135M-Instruct"
CORES = [0, 1, 2, 3]


def spec_of(flags: dict | None = None, document: dict | None = None, worker_args: tuple[str, ...] = (),
            cores: list[int] = CORES) -> RunSpec:
    return build_spec(flags or {}, document, source="deploy.yaml", worker_args=worker_args, available_cores=cores)


# -- spec -------------------------------------------------------------------------------------------------------


def test_defaults_are_one_aggregated_vllm_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DYN_NAMESPACE", raising=False)
    spec = spec_of()
    assert (spec.model, spec.engine, spec.http_port, spec.namespace, spec.restart) == ("smollm2", "vllm", 8000,
                                                                                       "dynamo", False)
    assert [(g.role, g.count) for g in spec.workers] == [("agg", 1)]
    assert not spec.disaggregated


def test_flags_override_the_file_and_keep_group_settings() -> None:
    document = {"model": "smollm2", "engine": "mocker", "http_port": 9000, "restart": True, "namespace": "ns1",
                "frontend": {"args": "--migration-limit 2", "env": {"A": 1}},
                "workers": [{"role": "agg", "count": 2, "args": ["--speedup-ratio", 10], "env": {"B": True},
                             "cores": "0;1"}]}
    spec = spec_of({"http_port": 0, "workers": 3, "router_mode": "random", "frontend_args": "--api-key k"},
                   document, worker_args=("--seed", "1"))
    assert (spec.engine, spec.http_port, spec.restart, spec.namespace, spec.router_mode) == ("mocker", 0, True,
                                                                                             "ns1", "random")
    (group,) = spec.workers
    assert (group.role, group.count, group.env, group.cores) == ("agg", 3, {"B": "true"}, [(0,), (1,)])
    assert group.args == ["--speedup-ratio", "10", "--seed", "1"]
    assert spec.frontend.args == ["--migration-limit", "2", "--api-key", "k"]
    assert spec.frontend.env == {"A": "1"}


def test_disaggregated_from_flags_and_from_file() -> None:
    spec = spec_of({"prefill_workers": 1, "decode_workers": 2})
    assert [(g.role, g.count) for g in spec.workers] == [("prefill", 1), ("decode", 2)]
    assert spec.disaggregated
    document = {"workers": [{"role": "prefill", "args": ["--x"]}, {"role": "decode", "count": 1}]}
    spec = spec_of({"decode_workers": 3}, document)
    assert [(g.role, g.count, g.args) for g in spec.workers] == [("prefill", 1, ["--x"]), ("decode", 3, [])]
    # --workers turns a disaggregated file into an aggregated deployment
    assert [(g.role, g.count) for g in spec_of({"workers": 2}, document).workers] == [("agg", 2)]


@pytest.mark.parametrize(("flags", "document", "message"), [
    ({"workers": 2, "prefill_workers": 1}, None, "--workers cannot be combined"),
    ({"prefill_workers": 1}, None, "needs both prefill and decode"),
    ({"decode_workers": 0, "prefill_workers": 1}, None, "--decode-workers: expected an integer >= 1"),
    ({}, {"modle": "x"}, "deploy.yaml: unknown key 'modle'"),
    ({}, {"http_port": "80"}, "deploy.yaml: http_port: expected an integer"),
    ({}, {"restart": "yes please"}, "deploy.yaml: restart: expected true or false"),
    ({}, {"engine": "sglang"}, "deploy.yaml: engine: expected one of vllm, mocker"),
    ({}, {"namespace": "a.b"}, "deploy.yaml: namespace"),
    ({}, {"frontend": {"argz": []}}, "deploy.yaml: frontend: unknown key 'argz'"),
    ({}, {"workers": [{"role": "agg", "count": 0}]}, "workers[0].count: expected an integer >= 1"),
    ({}, {"workers": [{"role": "agg"}, {"role": "agg"}]}, "workers[1].role: a second group"),
    ({}, {"workers": [{"role": "mixed"}]}, "workers[0].role: expected one of agg, prefill, decode, encode"),
    ({}, {"workers": [{"role": "encode"}]}, "encode workers encode the images of the workers that compute prompts"),
    ({"encode_workers": 0}, None, "--encode-workers: expected an integer >= 1"),
    ({}, {"workers": [{"role": "agg"}, {"role": "decode"}]}, "cannot be mixed"),
    ({}, {"workers": [{"cores": "0;x"}]}, "workers[0].cores"),
    ({}, {"workers": [{"env": {"A": [1]}}]}, "workers[0].env.A"),
    ({"worker_cores": "0;9"}, {"workers": [{"count": 2}]}, "may only use cores 0,1,2,3"),
    ({"worker_cores": "0"}, {"workers": [{"count": 2}]}, "--worker-cores: 1 core lists for 2 workers"),
    ({"ready_timeout": 0}, None, "--ready-timeout"),
    ({"no_frontend": True}, None, "--no-frontend: workers without a frontend join another deployment through its "
     "discovery: use --discovery-backend etcd"),
    ({"no_frontend": True, "discovery_backend": "etcd", "router_mode": "kv"}, None,
     "--no-frontend: --router-mode would configure a frontend this run does not start"),
    ({}, {"no_frontend": "no"}, "deploy.yaml: no_frontend: expected true or false"),
])
def test_invalid_deployments_name_the_key(flags: dict, document: dict | None, message: str) -> None:
    with pytest.raises(SpecError, match=re.escape(message)):
        spec_of(flags, document)


def test_worker_cores_flag_is_split_over_the_groups() -> None:
    spec = spec_of({"prefill_workers": 1, "decode_workers": 2, "worker_cores": "3;0-1;2"})
    assert [g.cores for g in spec.workers] == [[(3,)], [(0, 1), (2,)]]


def test_cli_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--workers", "2", "--decode-workers", "1"])
    assert e.value.code == 2 and "--workers cannot be combined" in capsys.readouterr().err
    bad = tmp_path / "deploy.yaml"
    bad.write_text("model: smollm2\nworkers:\n  - role: agg\n    replicas: 2\n")
    with pytest.raises(SystemExit) as e:
        main(["-f", str(bad)])
    assert e.value.code == 2 and "workers[0]: unknown key 'replicas'" in capsys.readouterr().err
    bad.write_text("[1, 2]")
    with pytest.raises(SpecError, match="mapping"):
        load_file(str(bad))
    with pytest.raises(SystemExit) as e:
        main(["--engine", "sglang"])
    assert e.value.code == 2


# -- cores, command lines, environment ------------------------------------------------------------------------------


def test_core_lists() -> None:
    assert parse_cores("0,2-3, 5") == (0, 2, 3, 5)
    assert format_cores((5, 0, 1, 2)) == "0-2,5"
    for bad in ("", "a", "3-1", "1;2"):
        with pytest.raises(ValueError):
            parse_cores(bad)
    assert round_robin(0, 1, [4, 5]) == ((4,), False)
    assert round_robin(1, 2, [0, 1, 2, 3]) == ((2, 3), False)
    assert round_robin(2, 1, [0, 1]) == ((0,), True)  # a third engine on two cores wraps around
    assert round_robin(0, 3, [0, 1]) == ((0, 1), True)


def plan_of(spec: RunSpec, environ: dict[str, str] | None = None, warnings: list[str] | None = None) -> Plan:
    return Plan(spec, "/models/SmolLM2-135M-Instruct", "/tmp/kv", environ=environ or {}, cores=[0, 1],
                warn=(warnings if warnings is not None else []).append)


def test_vllm_worker_commands_cores_and_ports() -> None:
    warnings: list[str] = []
    spec = spec_of({"workers": 3, "system_port_base": 9100}, worker_args=("--enforce-eager",))
    plan = plan_of(spec, {"DYN_SYSTEM_PORT": "9000", "DYN_TCP_RPC_PORT": "7000", "KEEP": "1"}, warnings)
    workers = [plan.worker(spec.workers[0], n, n) for n in range(3)]
    assert workers[0].label == "worker-0"
    assert workers[0].argv[1:] == ("-m", "tandem.vllm", "--model", "/models/SmolLM2-135M-Instruct",
                                   "--served-model-name", MODEL, "--cpu-cores", "0", "--connector", "none",
                                   "--enforce-eager")
    assert workers[0].argv[0] == sys.executable
    assert [w.cores for w in workers] == [(0,), (1,), (0,)]
    assert len(warnings) == 1 and "worker-2 shares cores 0" in warnings[0]
    assert len({w.env["DYN_VLLM_KV_EVENT_PORT"] for w in workers}) == 3
    assert [w.env["DYN_SYSTEM_PORT"] for w in workers] == ["9100", "9101", "9102"]
    env = workers[0].env
    assert (env["DYN_DISCOVERY_BACKEND"], env["DYN_REQUEST_PLANE"], env["DYN_EVENT_PLANE"], env["DYN_FILE_KV"],
            env["DYN_NAMESPACE"], env["KEEP"]) == ("file", "tcp", "zmq", "/tmp/kv", spec.namespace, "1")
    assert "DYN_TCP_RPC_PORT" not in env
    assert plan.worker(spec.workers[0], 0, 0).env["DYN_VLLM_KV_EVENT_PORT"] == env["DYN_VLLM_KV_EVENT_PORT"]
    frontend = plan.frontend()
    assert frontend.argv[1:] == ("-m", "tandem.frontend", "--http-port", "8000")
    assert frontend.cores is None and "DYN_SYSTEM_PORT" not in frontend.env


def test_disaggregated_and_mocker_commands() -> None:
    document = {"workers": [{"role": "prefill", "env": {"X": "1"}},
                            {"role": "decode", "args": ["--connector", "nixl"], "cores": ["1"]}]}
    spec = spec_of({"router_mode": "kv", "model_name": "smol"}, document)
    plan = plan_of(spec)
    prefill, decode = plan.worker(spec.workers[0], 0, 0), plan.worker(spec.workers[1], 0, 1)
    assert (prefill.label, decode.label) == ("prefill-0", "decode-0")
    assert "--is-prefill-worker" in prefill.argv and "--connector" not in prefill.argv and prefill.env["X"] == "1"
    assert "--is-decode-worker" in decode.argv and decode.argv[-2:] == ("--connector", "nixl")
    assert decode.argv.count("--connector") == 1 and decode.cores == (1,) and "smol" in decode.argv
    assert plan.frontend().argv[-2:] == ("--router-mode", "kv")
    mocker = spec_of({"engine": "mocker", "prefill_workers": 1, "decode_workers": 1})
    argv = plan_of(mocker).worker(mocker.workers[1], 0, 1).argv
    assert argv[1:] == ("-m", "tandem.mocker", "--model-path", "/models/SmolLM2-135M-Instruct", "--model-name",
                        MODEL, "--disaggregation-mode", "decode")


def test_encode_workers_and_their_consumers() -> None:
    """--encode-workers: vLLM encoder workers beside the aggregated ones, which become their consumers; both share
    the run's encoder-cache directory unless their args name another; the launcher waits for the model's
    instances only."""
    spec = spec_of({"encode_workers": 2}, worker_args=("--max-model-len", "1024"))
    assert [(g.role, g.count) for g in spec.workers] == [("agg", 1), ("encode", 2)]
    plan = Plan(spec, "/models/vlm", "/tmp/kv", environ={}, cores=[0, 1], ec_storage="/tmp/ec")
    worker, encoder = plan.worker(spec.workers[0], 0, 0), plan.worker(spec.workers[1], 0, 1)
    assert (worker.label, encoder.label) == ("worker-0", "encode-0")
    assert worker.argv[-6:] == ("--enable-multimodal", "--ec-consumer-mode", "--ec-storage-path", "/tmp/ec",
                                "--max-model-len", "1024")
    for argv in (worker.argv, encoder.argv):
        assert argv[argv.index("--ec-storage-path") + 1] == "/tmp/ec" and argv.count("--ec-storage-path") == 1
    assert "--vllm-native-encoder-worker" in encoder.argv and "--ec-consumer-mode" not in encoder.argv
    shared = spec_of({"workers": 2, "encode_workers": 1}, worker_args=("--ec-storage-path", "/shared"))
    argv = Plan(shared, "/m", "/tmp/kv", environ={}, cores=[0, 1], ec_storage="/tmp/ec").worker(
        shared.workers[0], 0, 0).argv
    assert argv.count("--ec-storage-path") == 1 and argv[-1] == "/shared"
    plain = spec_of({"workers": 2})
    assert "--ec-consumer-mode" not in plan_of(plain).worker(plain.workers[0], 0, 0).argv
    # Consumers taking the encoder outputs as embeddings read the files the encoders name: no directory.
    embedded = spec_of({"encode_workers": 1}, worker_args=("--embedding-transfer-mode", "local"))
    plan = Plan(embedded, "/models/vlm", "/tmp/kv", environ={}, cores=[0, 1], ec_storage="/tmp/ec")
    worker, encoder = plan.worker(embedded.workers[0], 0, 0), plan.worker(embedded.workers[1], 0, 1)
    assert "--ec-consumer-mode" in worker.argv and "--ec-storage-path" not in worker.argv
    assert encoder.argv[encoder.argv.index("--ec-storage-path") + 1] == "/tmp/ec"
    # The mocker's encoders simulate the encoding: no directory to share.
    mocked = spec_of({"engine": "mocker", "encode_workers": 1})
    plan = Plan(mocked, "/m", "/tmp/kv", environ={}, cores=[0, 1], ec_storage="")
    worker, encoder = plan.worker(mocked.workers[0], 0, 0), plan.worker(mocked.workers[1], 0, 1)
    assert worker.argv[-2:] == ("--enable-multimodal", "--ec-consumer-mode")
    assert encoder.argv[-2:] == ("--enable-multimodal", "--vllm-native-encoder-worker")
    assert "--ec-storage-path" not in worker.argv + encoder.argv


def test_encode_workers_with_prefill_and_decode_workers() -> None:
    """E+P+D: the prefill workers are the encoders' consumers and share their directory; the decode workers take
    images (the prompt they continue holds them) and no encoder-cache role."""
    spec = spec_of({"prefill_workers": 1, "decode_workers": 1, "encode_workers": 1})
    assert [(g.role, g.count) for g in spec.workers] == [("prefill", 1), ("decode", 1), ("encode", 1)]
    plan = Plan(spec, "/models/vlm", "/tmp/kv", environ={}, cores=[0, 1], ec_storage="/tmp/ec")
    prefill, decode, encoder = (plan.worker(group, 0, slot) for slot, group in enumerate(spec.workers))
    assert prefill.argv[-4:] == ("--enable-multimodal", "--ec-consumer-mode", "--ec-storage-path", "/tmp/ec")
    assert "--is-prefill-worker" in prefill.argv
    assert decode.argv[-1] == "--enable-multimodal" and "--is-decode-worker" in decode.argv
    assert not {"--ec-consumer-mode", "--ec-storage-path"} & set(decode.argv)
    assert encoder.argv[encoder.argv.index("--ec-storage-path") + 1] == "/tmp/ec"
    # The mocker alike, its encoders simulating the encoding: no directory.
    mocked = spec_of({"engine": "mocker", "prefill_workers": 1, "decode_workers": 1, "encode_workers": 1})
    plan = Plan(mocked, "/models/vlm", "/tmp/kv", environ={}, cores=[0, 1], ec_storage="/tmp/ec")
    prefill, decode, _ = (plan.worker(group, 0, slot) for slot, group in enumerate(mocked.workers))
    assert prefill.argv[-2:] == ("--enable-multimodal", "--ec-consumer-mode") and decode.argv[-1] == "--enable-multimodal"
    assert "--ec-storage-path" not in prefill.argv + decode.argv


def test_served_name(tmp_path: Path) -> None:
    assert served_name("smollm2", "/cache/SmolLM2-135M-Instruct") == MODEL
    assert served_name(str(tmp_path), str(tmp_path)) == tmp_path.name
    assert served_name("org/model", "/hf/snapshots/abc") == "org/model"
    assert served_name("smollm2", "/x", "mine") == "mine"


def test_log_prefix_is_padded_and_coloured_only_when_asked() -> None:
    out = io.StringIO()
    mux = LogMux(out, color=False)
    for label in ("frontend", "worker-0", "prefill-10"):
        mux.add_label(label)
    mux.line("frontend", "READY http://0.0.0.0:8000")
    mux.line("prefill-10", "hello")
    assert out.getvalue().splitlines() == ["frontend   | READY http://0.0.0.0:8000", "prefill-10 | hello"]
    assert LogMux(io.StringIO()).color is False  # not a terminal
    coloured = LogMux(io.StringIO(), color=True).format("worker-0", "x")
    assert coloured.startswith("\x1b[") and coloured.endswith("\x1b[0m x")


def test_url_and_curl_example() -> None:
    assert frontend_url("http://0.0.0.0:8000") == "http://127.0.0.1:8000"
    assert frontend_url("https://10.0.0.5:443") == "https://10.0.0.5:443"
    example = curl_example("http://127.0.0.1:8000", MODEL)
    assert example.startswith("curl -s http://127.0.0.1:8000/v1/chat/completions") and f'"model": "{MODEL}"' in example
    assert curl_example("http://h:1", MODEL, embeddings=True).startswith("curl -s http://h:1/v1/embeddings")


@pytest.mark.parametrize(("worker_args", "embeddings"), [
    ((), False), (("--embedding-worker",), True), (("--runner", "pooling"), True), (("--runner=pooling",), True),
    (("--endpoint-types", "embedding"), True), (("--runner", "generate"), False),
])
def test_the_plan_knows_an_embedding_model(worker_args, embeddings) -> None:
    assert plan_of(spec_of(worker_args=worker_args)).serves_embeddings is embeddings


# -- end to end -----------------------------------------------------------------------------------------------------


def _text(client: openai.OpenAI, prompt: str, max_tokens: int = 8) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens)
    assert reply.usage is not None and reply.usage.completion_tokens == max_tokens
    return reply.choices[0].message.content or ""


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health").json()


# Discovery leases of five minutes: a dead worker's entries cannot expire during a test, so if the frontend
# stops listing it, the launcher removed them.
LONG_LEASES = {"DYN_DISCOVERY_TTL_SECS": "300"}


def _wait_instances(url: str, count: int, timeout: float = 15) -> set[int]:
    deadline = time.monotonic() + timeout
    while True:
        instances = set(_health(url)["instances"])
        if len(instances) == count:
            return instances
        assert time.monotonic() < deadline, f"the frontend sees {len(instances)} workers, not {count}"
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_two_workers_serve_and_sigint_stops_everything(launch) -> None:  # type: ignore[no-untyped-def]
    run = launch("--workers", "2", env=LONG_LEASES)
    url = run.serving()
    assert len(_health(url)["instances"]) == 2
    cores = [run.wait_for(rf"worker-{n} +\| starting on cores (\S+):").group(1) for n in (0, 1)]
    assert cores[0] != cores[1]
    assert run.wait_for(r"^    (curl -s .*)").group(1).startswith(f"curl -s {url}/v1/chat/completions")
    client = run.client(url)
    assert len({_text(client, "The same prompt, on either worker") for _ in range(4)}) == 1  # deterministic output
    discovery = run.wait_for(r"discovery: (\S+) ").group(1)
    assert len(run.sessions) == 3 and run.leftovers()
    # Without --restart a dead worker stays dead and the other one keeps serving.
    victim = run.children_running("tandem.mocker")[0]
    os.killpg(victim, signal.SIGKILL)
    run.wait_for(r"worker-\d +\| killed by SIGKILL")
    _wait_instances(url, 1)  # the launcher removed its entries: with LONG_LEASES they would stay for minutes
    assert _text(client, "still here")
    assert not any("restarting" in line for line in run.lines)
    assert run.stop(signal.SIGINT) == 0
    assert run.leftovers() == []
    assert not os.path.exists(discovery)
    assert run.lines[-1].endswith("| stopped")


@pytest.mark.timeout(60)
def test_restart_brings_a_killed_worker_back(launch) -> None:  # type: ignore[no-untyped-def]
    run = launch("--workers", "2", "--restart", env=LONG_LEASES)
    url = run.serving()
    os.killpg(run.children_running("tandem.mocker")[0], signal.SIGKILL)
    label = run.wait_for(r"(worker-\d) +\| killed by SIGKILL").group(1)
    old = int(run.wait_for(rf"{label} +\| READY (\w+)").group(1), 16)
    new = int(run.wait_for(rf"{label} +\| READY (\w+)", count=2).group(1), 16)
    instances = _wait_instances(url, 2)
    assert new in instances and old not in instances
    client = run.client(url)
    pinned = client.with_options(default_headers={"x-worker-instance-id": str(new)})
    assert _text(pinned, "served by the restarted worker")
    assert all(_text(client, f"back again {n}") for n in range(4))
    assert run.stop(signal.SIGTERM) == 0


@pytest.mark.timeout(120)
def test_four_mocker_workers_answer_200_concurrent_streams(launch) -> None:  # type: ignore[no-untyped-def]
    run = launch("--workers", "4")
    url = run.serving()
    assert len(_health(url)["instances"]) == 4

    async def stream(client: openai.AsyncOpenAI, n: int) -> tuple[int, str | None]:
        chunks = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {n}: " + "tell me more " * 20}],
            max_tokens=24, stream=True, stream_options={"include_usage": True})
        tokens, reason = 0, None
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return tokens, reason

    async def burst() -> list[tuple[int, str | None] | BaseException]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as client:
            return await asyncio.gather(*(stream(client, n) for n in range(200)), return_exceptions=True)

    results = asyncio.run(burst())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert results == [(24, "length")] * 200
    assert run.stop() == 0
    assert run.leftovers() == []


@pytest.mark.timeout(60)
def test_yaml_deployment_with_flag_override(launch, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("namespace: yamltest\nrestart: false\nfrontend:\n  args: [--migration-limit, '1']\n"
                      "workers:\n  - role: agg\n    count: 3\n    args: [--block-size, '32']\n")
    run = launch("-f", str(deploy), "--workers", "2")
    url = run.serving()
    health = _health(url)
    assert health["endpoints"] == ["yamltest.backend.generate"] and len(health["instances"]) == 2
    assert "--migration-limit 1" in run.wait_for(r"frontend \| starting: (.*)").group(1)
    assert _text(run.client(url), "from yaml")
    assert run.stop() == 0


@pytest.mark.timeout(60)
def test_frontend_death_stops_everything(launch) -> None:  # type: ignore[no-untyped-def]
    run = launch("--workers", "1")
    run.serving()
    (frontend,) = run.children_running("tandem.frontend")
    os.killpg(frontend, signal.SIGKILL)
    assert run.proc.wait(20) == 1
    assert "the frontend killed by SIGKILL; stopping everything" in run.proc.stderr.read()  # type: ignore[union-attr]
    assert run.leftovers() == []


@pytest.mark.timeout(60)
def test_slow_stop_is_cut_short(launch) -> None:  # type: ignore[no-untyped-def]
    """Workers that drain for 30 s: --stop-timeout kills them after 1 s, a second SIGINT at once."""
    slow = {"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "30"}
    run = launch("--workers", "1", "--stop-timeout", "1", env=slow)
    run.serving()
    assert run.stop() == 0  # within stop()'s 20 s wait, though the workers would drain for 30 s
    run.wait_for(r"worker-0 +\| still running after 1 s: killing it")
    assert run.leftovers() == []
    run = launch("--workers", "1", env=slow)
    run.serving()
    run.proc.send_signal(signal.SIGINT)
    run.wait_for(r"SIGINT: stopping")
    assert run.stop() == 0  # the second SIGINT: within stop()'s 20 s wait, not after the 30 s drain
    assert run.leftovers() == []


@pytest.mark.timeout(60)
def test_worker_that_cannot_start_fails_the_launch(launch) -> None:  # type: ignore[no-untyped-def]
    run = launch("--workers", "1", "--", "--no-such-flag")
    assert run.proc.wait(30) == 1
    err = run.proc.stderr.read()  # type: ignore[union-attr]
    assert run.sessions  # the frontend at least
    assert "worker-0 exited with code 2 before the deployment was ready" in err
    assert "unrecognized arguments: --no-such-flag" in err
    assert run.leftovers() == []


@pytest.mark.timeout(90)
def test_ready_timeout(launch) -> None:  # type: ignore[no-untyped-def]
    # 15 s: the worker itself must be up by then (a loaded 2-core machine takes seconds to import it)
    run = launch("--ready-timeout", "15", "--", "--model-name", "other")  # served under a name nobody waits for
    assert run.proc.wait(60) == 1
    err = run.proc.stderr.read()  # type: ignore[union-attr]
    assert f"not serving after 15 s: still waiting for the frontend to list model {MODEL!r}" in err
    assert "last lines of frontend" in err
    assert len(run.sessions) == 2 and run.leftovers() == []


@pytest.mark.timeout(60)
def test_mocker_engine(launch) -> None:  # type: ignore[no-untyped-def]
    run = launch("--engine", "mocker", "--prefill-workers", "1", "--decode-workers", "1", "--",
                 "--speedup-ratio", "100")
    url = run.serving()
    reply = run.client(url).chat.completions.create(model=MODEL, max_tokens=5,
                                                    messages=[{"role": "user", "content": "hi"}])
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert run.stop() == 0


@pytest.mark.timeout(60)
async def test_scale_adds_and_removes_workers(smollm2: str, tmp_path: Path) -> None:
    environ = {**os.environ, "PYTHONPATH": str(REPO),
               "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0"}
    spec = spec_of({"http_port": 0, "model": smollm2, "engine": "mocker"}, cores=[0, 1])
    out = io.StringIO()
    supervisor = Supervisor(Plan(spec, smollm2, str(tmp_path), environ=environ), LogMux(out))
    try:
        supervisor.start()
        url = await wait_until_serving(supervisor, MODEL, 30)
        await supervisor.scale("agg", 3)
        await wait_until_serving(supervisor, MODEL, 30)
        assert [child.label for child in supervisor.workers["agg"]] == ["worker-0", "worker-1", "worker-2"]
        assert len(supervisor.expected_instances()) == 3
        assert [child.spec.cores for child in supervisor.workers["agg"]] == [(0,), (1,), (0,)]
        await supervisor.scale("agg", 1)
        assert len(supervisor.children) == 2 and "worker-2 | exited with code 0" in out.getvalue()
        async with httpx.AsyncClient() as http:
            for _ in range(100):
                if len((await http.get(f"{url}/health")).json()["instances"]) == 1:
                    break
                await asyncio.sleep(0.1)
            assert (await http.get(f"{url}/health")).json()["instances"] == sorted(supervisor.expected_instances())
        with pytest.raises(ValueError):
            await supervisor.scale("decode", 1)
    finally:
        await supervisor.stop(5)
    assert all(child.done.is_set() for child in supervisor.children)


def _stream(url: str, n: int, max_tokens: int, started: threading.Barrier) -> str:
    """One streamed completion's raw SSE text; waits at `started` once its first chunk arrived."""
    body = {"model": MODEL, "prompt": f"stream {n}: tell me a long story", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    lines = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and not lines:
                started.wait(30)
            lines.append(line)
    return "\n".join(lines)


def _tokens_and_finish(raw: str) -> tuple[int, str | None]:
    tokens, finish = 0, None
    for line in raw.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
    return tokens, finish


@pytest.mark.timeout(120)
def test_stop_drains_streams_in_flight(launch) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM with 16 streams in flight: the frontend refuses new requests, finishes the 16, and only then
    do the workers stop."""
    run = launch("--workers", "2", "--", "--speedup-ratio", "1")
    url = run.serving()
    started = threading.Barrier(17)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        streams = [pool.submit(_stream, url, n, 150, started) for n in range(16)]
        started.wait(30)  # every stream has its first token
        run.proc.send_signal(signal.SIGTERM)
        run.wait_for(r"frontend +\| .*draining 16 in-flight requests")
        late = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 4}, timeout=10)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
        assert [_tokens_and_finish(s.result()) for s in streams] == [(150, "length")] * 16
    assert run.proc.wait(30) == 0
    assert run.leftovers() == []


@pytest.mark.timeout(60)
def test_streams_past_the_drain_bound_get_a_shutdown_error(launch) -> None:  # type: ignore[no-untyped-def]
    """A stream still running when the drain bound passes (--stop-timeout 3: the frontend drains 1 s) ends
    with an error that says the server is shutting down, not that a worker failed."""
    run = launch("--workers", "1", "--stop-timeout", "3", "--", "--speedup-ratio", "0.05")
    url = run.serving()
    started = threading.Barrier(2)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream, url, 0, 2000, started)
        started.wait(30)
        run.proc.send_signal(signal.SIGTERM)
        raw = stream.result()
    error = json.loads(next(line for line in raw.splitlines() if line.startswith('data: {"error"'))[6:])["error"]
    assert "the server is shutting down" in error["message"] and error["type"] == "service_unavailable"
    assert run.proc.wait(30) == 0
    assert run.leftovers() == []
