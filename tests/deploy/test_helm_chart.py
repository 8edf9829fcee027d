"""The Helm chart in deploy/helm/tandem: every variant (aggregated or disaggregated; etcd and NATS bundled,
external or absent; vLLM or mocker engines; the production extras; the planner) renders with Helm's own engine into
objects the Kubernetes schemas accept and whose references hold (tests/support/k8s.py); contradicting values stop
the render with the reason; and three releases run here, pod by pod, each pod in its own network namespace
(tests/support/kubelet.py): their probes pass, clients are served through their Services, the decode pod pulls the
prefill pod's KV cache, and the planner pod scales a worker Deployment whose new pod serves."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.deployment import MODEL, VLLM_TEST_ARGS, deltas, metric_sum, prompt_sources
from tests.support.engines import engine_memory_args, on_cpu, wait_until
from tests.support.images import data_url, png
from tests.support.k8s import (
    CHART,
    RenderError,
    flag,
    of_kind,
    reference_problems,
    render,
    schema_problems,
    values_of,
    workloads,
)
from tests.support.kubelet import Image, LocalCluster, venv_program
from tests.support.load import Load

MODES = ("agg.yaml", "disagg.yaml")
SERVICES = ((), ("nats.yaml",), ("external.yaml",), ("nats.yaml", "production.yaml"), ("external.yaml", "production.yaml"),
            ("planner.yaml",), ("external.yaml", "production.yaml", "planner.yaml"))
ENGINES = ((), ("mocker.yaml",))
VARIANTS = [(mode, *services, *engine) for mode in MODES for services in SERVICES for engine in ENGINES]


def names(docs: list[dict], kind: str) -> set[str]:
    return {doc["metadata"]["name"] for doc in of_kind(docs, kind)}


def container(docs: list[dict], workload: str) -> dict:
    found = next(w for w in workloads(docs) if w["metadata"]["name"] == workload)
    return found["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


@pytest.mark.parametrize("files", [("agg.yaml",), ("disagg.yaml", "external.yaml", "production.yaml"),
                                   ("disagg.yaml", "planner.yaml")])
def test_helm_lint_strict_finds_nothing_worse_than_advice(files: tuple[str, ...]) -> None:
    import helm_python as helm

    report = helm.lint(str(CHART), values_of(*files), strict=True, kube_version="v1.27.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] > 1] == []  # 1: INFO ("icon is recommended")


@pytest.mark.parametrize("files", VARIANTS, ids=["+".join(f.removesuffix(".yaml") for f in v) for v in VARIANTS])
def test_every_variant_renders_valid_objects_whose_references_hold(files: tuple[str, ...]) -> None:
    docs = render(*files)
    assert schema_problems(docs) == []
    assert reference_problems(docs) == []

    values = values_of(*files)
    disagg = values.get("mode") == "disagg"
    planner = "planner.yaml" in files
    assert {"llm-tandem-frontend", *(("llm-tandem-prefill", "llm-tandem-decode") if disagg else ("llm-tandem-worker",)),
            *(("llm-tandem-planner",) if planner else ())} == names(docs, "Deployment")
    bundled = {part for part in ("etcd", "nats") if values.get(part, {}).get("enabled", part == "etcd")}
    assert names(docs, "StatefulSet") == {f"llm-tandem-{part}" for part in bundled}
    production = "production.yaml" in files
    assert names(docs, "ServiceMonitor") == ({"llm-tandem"} if production else set())
    assert names(docs, "RoleBinding") == ({"llm-tandem-planner"} if production or planner else set())

    for workload in workloads(docs):
        c = workload["spec"]["template"]["spec"]["containers"][0]
        if c["command"][0] != "tandem":
            continue
        env = env_of(c)
        # Every tandem process advertises its pod's own address, and finds etcd and NATS where the values say.
        assert env["DYN_ADVERTISE_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["ETCD_ENDPOINTS"]["value"] == (values.get("etcd", {}).get("endpoints") or "http://llm-tandem-etcd:2379")
        uses_nats = "nats" in (values.get("requestPlane"), values.get("eventPlane"))
        assert ("NATS_SERVER" in env) == uses_nats
        if production and c["command"][1] == "frontend":
            assert env["DYN_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "tandem-api-key", "key": "api-key"}
            assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


def test_the_checks_find_what_a_cluster_would_not_forgive() -> None:
    """The checks above can fail: each broken reference is named."""
    docs = render("agg.yaml", "nats.yaml", "production.yaml")
    worker = container(docs, "llm-tandem-worker")
    worker["readinessProbe"]["httpGet"]["path"] = "/ready"
    worker["livenessProbe"]["httpGet"]["port"] = "http"
    worker["args"].append("--no-such-flag")
    worker["ports"].append({"name": "extra", "containerPort": 7000})
    worker["volumeMounts"].append({"name": "cache", "mountPath": "/cache"})
    worker["portz"] = []
    next(s for s in of_kind(docs, "Service") if s["metadata"]["name"] == "llm-tandem-frontend")["spec"]["selector"][
        "app.kubernetes.io/component"] = "frontnd"
    next(iter(of_kind(docs, "RoleBinding")))["roleRef"]["name"] = "someone-else"
    problems = "\n".join(schema_problems(docs) + reference_problems(docs))
    for expected in ("'portz' was unexpected", "unrecognized arguments: --no-such-flag",
                     "livenessProbe port http is none of the container's ports",
                     "readinessProbe GET /ready on port 9090", "declares port extra 7000",
                     "mounts volume cache", "Service llm-tandem-frontend: its selector matches no pod",
                     "binds Role someone-else"):
        assert expected in problems


def test_the_checks_cover_the_planner_container() -> None:
    docs = render("disagg.yaml", "planner.yaml", values={"planner": {
        "extraArgs": ["--no-such-planner-flag"], "extraEnv": [{"name": "DYN_PLANNER_NOPE", "value": "1"}]}})
    planner = container(docs, "llm-tandem-planner")
    planner["ports"].append({"name": "extra", "containerPort": 7000})
    problems = "\n".join(reference_problems(docs))
    for expected in ("tandem planner refuses its arguments", "unrecognized arguments: --no-such-planner-flag",
                     "sets DYN_PLANNER_NOPE, which tandem planner never reads", "declares port extra 7000"):
        assert expected in problems
    assert "metrics 9090" not in problems  # --planner-metrics-port 9090 is served


def test_a_variable_that_nothing_reads_fails_the_check() -> None:
    extra = {"extraEnv": [{"name": "DYN_HTTP_BODY_LIMIT_MB", "value": "64"}, {"name": "DYN_BODY_LIMIT", "value": "64"}]}
    docs = render("agg.yaml", values={"frontend": extra})
    assert reference_problems(docs) == [
        "Deployment llm-tandem-frontend container frontend: sets DYN_BODY_LIMIT, which tandem frontend never reads"]


@pytest.mark.parametrize(("values", "reason"), [
    ({"image": {"repository": ""}}, "image.repository is required"),
    ({"etcd": {"enabled": False}}, "tandem needs etcd for discovery"),
    ({"etcd": {"endpoints": "http://etcd:2379"}}, "set only one"),
    ({"etcd": {"authSecret": "creds"}}, "are for an external etcd"),
    ({"requestPlane": "nats"}, "set nats.enabled (bundled server) or nats.url"),
    ({"nats": {"enabled": True}}, "nothing would use it"),
    ({"eventPlane": "nats", "nats": {"enabled": True, "url": "nats://n:4222"}}, "set only one"),
    ({"durableKvEvents": True}, "it needs eventPlane nats"),
    ({"model": {"download": False}}, "nothing would put the model there"),
    ({"engine": "sglang"}, "at '/engine': value must be one of"),
    ({"frontend": {"numProcesses": 0}}, "at '/frontend/numProcesses'"),
    ({"workers": {"agg": {"replica": 3}}}, "additional properties 'replica' not allowed"),
    ({"frontnd": {}}, "additional properties 'frontnd' not allowed"),
    ({"planner": {"enabled": True}}, "planner.enabled needs a ServiceAccount that may get and patch deployments/scale"),
    ({"planner": {"enabled": True, "rbac": {"create": True}}}, "set planner.profile.volume"),
    ({"planner": {"enabled": True, "rbac": {"create": True}, "throughputScaling": False}},
     "the planner would have nothing to scale by"),
    ({"planner": {"enabled": True, "rbac": {"create": True}, "mode": "prefill", "throughputScaling": False,
                  "loadBasedScaling": True}}, "planner.mode prefill plans a pool of a disaggregated deployment"),
    ({"planner": {"prometheusEndpoint": "http://prometheus:9090"}}, "planner.enabled is false: nothing would use it"),
    ({"planner": {"mode": "both"}}, "at '/planner/mode'"),
    ({"workers": {"encode": {"replicas": 1}}}, "workers.encode with engine vllm: set workers.encode.storageVolume"),
    ({"workers": {"encode": {"replicas": 1, "storageVolume": {"emptyDir": {}}}}}, "an emptyDir is one pod's own"),
    ({"workers": {"encode": {"storageVolume": {"hostPath": {"path": "/ec"}}}}}, "no vLLM encoder runs"),
    ({"engine": "mocker", "workers": {"encode": {"replicas": 1, "storageVolume": {"hostPath": {"path": "/ec"}}}}},
     "no vLLM encoder runs"),
    ({"frontend": {"numProcesses": 2}, "planner": {"enabled": True, "rbac": {"create": True}, "profile": {
        "volume": {"configMap": {"name": "p"}}}, "prometheusEndpoint": "http://prometheus:9090"}},
     "Prometheus scrapes a frontend pod's port, which one of its processes answers each time"),
], ids=lambda v: v if isinstance(v, str) else json.dumps(v, separators=(",", ":")))
def test_contradicting_or_misspelled_values_stop_the_render_with_the_reason(values: dict, reason: str) -> None:
    with pytest.raises(RenderError, match=None) as refused:
        render("agg.yaml", values=values)
    assert reason in str(refused.value)


@pytest.mark.parametrize(("release", "mode", "planner_mode"), [
    ("llm", "agg", ""), ("llm", "disagg", ""), ("tandem-prod", "disagg", "decode"), ("llm", "disagg", "prefill")])
def test_the_planner_scales_the_deployments_the_chart_renders_with_the_rights_it_grants(
        release: str, mode: str, planner_mode: str, tmp_path: Path) -> None:
    """The planner's connector, built from the planner pod's own arguments, names exactly the release's worker
    Deployments of the pools it plans (as `--helm-release` would name them); its ServiceAccount is bound to a Role
    that may get and patch their scale; it finds the frontend processes in the release's discovery."""
    from tandem.planner.kubernetes import (
        KubernetesConnector,
        chart_deployments,
        chart_fullname,
        parse_kubernetes_args,
    )

    docs = render("agg.yaml", "planner.yaml", values={"mode": mode, "planner": {"mode": planner_mode}}, release=release)
    pod = next(w for w in workloads(docs) if w["metadata"]["name"].endswith("-planner"))["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    planned = planner_mode or mode
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}], "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    known = parse_kubernetes_args([*args[args.index("--kube-namespace"):], "--kubeconfig", str(kubeconfig)])
    connector = KubernetesConnector.from_args(known, planned)
    assert connector.namespace == "serving"
    expected = [name for name in chart_deployments(release, planned) if name]
    assert connector.deployments == expected
    assert set(expected) <= names(docs, "Deployment")
    assert flag(args, "--mode") == planned
    # No frontend address: the Service would spread its scrapes over the frontend processes. It finds each one
    # in the release's discovery, as the frontends do the workers.
    assert "--frontend-url" not in args
    frontend_env = {e["name"]: e.get("value") for e in container(docs, f"{chart_fullname(release)}-frontend")["env"]}
    planner_env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    for name in ("DYN_NAMESPACE", "DYN_DISCOVERY_BACKEND", "ETCD_ENDPOINTS"):
        assert planner_env[name] == frontend_env[name]
    # RBAC: the pod's ServiceAccount is bound to a Role that may get and patch deployments/scale.
    binding = next(iter(of_kind(docs, "RoleBinding")))
    assert pod["serviceAccountName"] in {s["name"] for s in binding["subjects"]}
    role = next(r for r in of_kind(docs, "Role") if r["metadata"]["name"] == binding["roleRef"]["name"])
    allowed = {verb for rule in role["rules"] if "apps" in rule["apiGroups"] and "deployments/scale" in rule["resources"]
               for verb in rule["verbs"]}
    assert {"get", "patch"} <= allowed
    # The profile is where --profile-results-dir says, from the volume the values name.
    assert flag(args, "--profile-results-dir") == "/profile"
    assert next(v for v in pod["volumes"] if v["name"] == "profile")["configMap"]["name"] == "tandem-profile"


def test_a_load_based_planner_needs_no_profile() -> None:
    docs = render("disagg.yaml", "planner.yaml", values={"planner": {
        "throughputScaling": False, "loadBasedScaling": True, "profile": {"volume": None},
        "prometheusEndpoint": "http://prometheus.monitoring:9090", "metricsPort": 0}})
    planner = container(docs, "llm-tandem-planner")
    assert {"--disable-throughput-scaling", "--enable-loadbased-scaling"} <= set(planner["args"])
    assert "--profile-results-dir" not in planner["args"] and "--planner-metrics-port" not in planner["args"]
    assert flag(planner["args"], "--metric-pulling-prometheus-endpoint") == "http://prometheus.monitoring:9090"
    assert "volumeMounts" not in planner and "ports" not in planner
    assert env_of(planner)["DYN_EVENT_PLANE"]["value"] == "zmq"  # it follows the workers' load on the event plane


def test_the_frontend_downloads_exactly_the_files_the_model_card_checks() -> None:
    from tandem.llm.model_card import MODEL_FILES

    docs = render("agg.yaml")
    frontend = next(w for w in workloads(docs) if w["metadata"]["name"] == "llm-tandem-frontend")
    download = frontend["spec"]["template"]["spec"]["initContainers"][0]
    assert download["args"][:3] == ["Qwen/Qwen3-0.6B", "main", "/models/Qwen/Qwen3-0.6B"]
    assert tuple(download["args"][3:]) == MODEL_FILES
    worker = next(w for w in workloads(docs) if w["metadata"]["name"] == "llm-tandem-worker")
    assert worker["spec"]["template"]["spec"]["initContainers"][0]["args"] == download["args"][:3]  # the whole snapshot


# -- releases running here, a network namespace per pod -------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="pods are network namespaces: needs root and iproute2")
MOCKER = ["--block-size", "16", "--num-gpu-blocks-override", "2048", "--speedup-ratio", "10"]
IMAGES = [Image("registry.example.com/tandem", {"tandem": venv_program("tandem")}),
          Image("quay.io/coreos/etcd", {"etcd": venv_program("etcd")}),
          Image("nats", {"nats-server": venv_program("nats-server")})]


@pytest.mark.parametrize("engine", ["vllm", "mocker"])
def test_an_encoder_group_encodes_the_aggregated_workers_images_through_a_shared_volume(engine: str) -> None:
    """workers.encode: an encoder Deployment (--disaggregation-mode encode) next to the aggregated workers, which take
    images and have them encoded (--ec-consumer-mode); with vLLM both mount the storage volume at the folder
    --ec-storage-path names. The planner, when on, scales the aggregated pool and leaves the encoders alone."""
    volume = {"persistentVolumeClaim": {"claimName": "encoder-cache"}}  # as examples/encode.yaml names it
    files = ("encode.yaml",) if engine == "vllm" else ("mocker.yaml",)
    docs = render("agg.yaml", *files, "planner.yaml", values={"workers": {"encode": {"replicas": 2}}})
    assert schema_problems(docs) == [] and reference_problems(docs) == []
    encoder = next(w for w in workloads(docs) if w["metadata"]["name"] == "llm-tandem-encoder")
    assert encoder["spec"]["replicas"] == 2
    cache = ["--ec-storage-path", "/encoder-cache"] if engine == "vllm" else []
    encoder_args, worker_args = container(docs, "llm-tandem-encoder")["args"], container(docs, "llm-tandem-worker")["args"]
    assert flag(encoder_args, "--disaggregation-mode") == "encode" and "--ec-consumer-mode" not in encoder_args
    assert "--ec-consumer-mode" in worker_args and flag(worker_args, "--disaggregation-mode") is None
    for name in ("llm-tandem-encoder", "llm-tandem-worker"):
        args = container(docs, name)["args"]
        assert "--enable-multimodal" in args and flag(args, "--ec-storage-path") == (cache[1] if cache else None)
        pod = next(w for w in workloads(docs) if w["metadata"]["name"] == name)["spec"]["template"]["spec"]
        mounted = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
        assert mounted.get("encoder-cache") == ("/encoder-cache" if cache else None)
        assert ({v["name"]: v for v in pod["volumes"]}.get("encoder-cache") ==
                ({"name": "encoder-cache", **volume} if cache else None))
    planner = " ".join(container(docs, "llm-tandem-planner")["args"])
    assert "encoder" not in planner
    # Without encoders nothing of theirs renders.
    plain = render("agg.yaml")
    assert "llm-tandem-encoder" not in {w["metadata"]["name"] for w in workloads(plain)}
    assert "--enable-multimodal" not in container(plain, "llm-tandem-worker")["args"]


def test_an_encoder_group_of_a_disaggregated_release_serves_the_prefill_pool() -> None:
    """E+P+D: with mode disagg the prefill pool is the encoders' consumer and shares their volume; the decode pool
    takes images and has no encoder-cache role or volume."""
    docs = render("disagg.yaml", "encode.yaml")
    assert schema_problems(docs) == [] and reference_problems(docs) == []
    prefill, decode = container(docs, "llm-tandem-prefill"), container(docs, "llm-tandem-decode")
    assert "--ec-consumer-mode" in prefill["args"] and flag(prefill["args"], "--ec-storage-path") == "/encoder-cache"
    assert "--enable-multimodal" in decode["args"] and "--ec-consumer-mode" not in decode["args"]
    assert flag(decode["args"], "--ec-storage-path") is None
    assert "encoder-cache" not in {m["name"] for m in decode["volumeMounts"]}
    assert flag(container(docs, "llm-tandem-encoder")["args"], "--disaggregation-mode") == "encode"
    mocked = render("disagg.yaml", "mocker.yaml", values={"workers": {"encode": {"replicas": 1}}})
    assert schema_problems(mocked) == [] and reference_problems(mocked) == []
    prefill, decode = container(mocked, "llm-tandem-prefill"), container(mocked, "llm-tandem-decode")
    assert "--ec-consumer-mode" in prefill["args"] and flag(prefill["args"], "--ec-storage-path") is None
    assert "--enable-multimodal" in decode["args"] and "--ec-consumer-mode" not in decode["args"]


def local_values(smollm2: str, **more: object) -> dict:
    """The mocker on the SmolLM2 folder of this machine, mounted as the model volume (a hostPath)."""
    folder = Path(smollm2)
    return {"engine": "mocker",
            "model": {"name": "HuggingFaceTB/SmolLM2-135M-Instruct", "servedModelName": MODEL, "download": False,
                      "volume": {"hostPath": {"path": str(folder.parent), "type": "Directory"}}, "path": folder.name},
            **more}


def advertised_hosts(cluster: LocalCluster) -> set[str]:
    """The hosts of the addresses the release's workers registered in its etcd."""
    etcd = cluster.service_url("llm-tandem-etcd", "client")
    records = httpx.post(f"{etcd}/v3/kv/range", json={"key": base64.b64encode(b"v1/instances/").decode(),
                                                       "range_end": base64.b64encode(b"v1/instances0").decode()}).json()
    return {json.loads(base64.b64decode(kv["value"]))["transport"]["tcp"].rsplit(":", 1)[0]
            for kv in records.get("kvs", [])}


@needs_root
def test_an_aggregated_release_runs_pod_by_pod_and_serves_through_its_service(smollm2: str, tmp_path: Path) -> None:
    docs = render("agg.yaml", values=local_values(smollm2, serviceMonitor={"enabled": True},
                                                  workers={"agg": {"replicas": 2, "extraArgs": MOCKER}}))
    cluster = LocalCluster(docs, tmp_path, IMAGES, namespace="serving")
    try:
        cluster.wait_ready(timeout=90)  # every pod's startup, readiness and liveness probes pass
        url = cluster.service_url("llm-tandem-frontend", "http")
        assert len(httpx.get(f"{url}/health").json()["instances"]) == 2
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=4)
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 4
        # Each worker registered the address of its own pod (DYN_ADVERTISE_HOST from status.podIP).
        assert advertised_hosts(cluster) == {pod.ip for pod in cluster.pods_of("llm-tandem-worker")}
        # The ServiceMonitor's targets answer with tandem's metrics.
        assert "dynamo_frontend_requests_total" in httpx.get(f"{url}/metrics").text
        for pod in cluster.pods_of("llm-tandem-worker"):
            assert "dynamo_component_requests_total" in httpx.get(f"http://{pod.ip}:9090/metrics").text
        # Deleting the release stops etcd along with the rest: every process still exits on SIGTERM.
        assert cluster.stop() == []
    finally:
        cluster.stop()


@needs_root
def test_a_release_with_an_encoder_group_has_its_images_encoded_by_the_encoder_pod(vlm_folder: str,
                                                                                    tmp_path: Path) -> None:
    """Mocker engines of the tiny vision-language model: an image question through the frontend's Service is
    answered by the aggregated worker pod, whose image the encoder pod encoded (its request count moves)."""
    mocker = [*MOCKER, "--image-encode-ms", "100"]
    docs = render("agg.yaml", values=local_values(vlm_folder, workers={"agg": {"extraArgs": mocker},
                                                                        "encode": {"replicas": 1, "extraArgs": mocker}}))
    cluster = LocalCluster(docs, tmp_path, IMAGES, namespace="serving")
    try:
        cluster.wait_ready(timeout=90)
        (encoder,) = cluster.pods_of("llm-tandem-encoder")

        def encoded() -> float:
            text = httpx.get(f"http://{encoder.ip}:9090/metrics").text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("dynamo_component_requests_total{") and 'endpoint="generate"' in line)

        url = cluster.service_url("llm-tandem-frontend", "http")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        before = encoded()
        reply = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_url(png("red"))}}]}])
        assert reply.usage.completion_tokens == 2 and reply.usage.prompt_tokens > 64  # the image's tokens counted
        assert encoded() == before + 1
        assert cluster.stop() == []
    finally:
        cluster.stop()


@needs_root
@pytest.mark.slow
def test_a_disaggregated_vllm_release_on_nats_with_credentials_runs_pod_by_pod(smollm2: str, tmp_path: Path) -> None:
    """Real vLLM engines in the prefill and decode pods (one core each), the KV cache moving between the pods
    through NIXL at the pods' addresses; both planes on the bundled NATS with a password; an API key."""
    engine = [*VLLM_TEST_ARGS, *engine_memory_args(on_cpu()), "--distributed-executor-backend", "uni",
              "--max-model-len", "512"]
    values = local_values(smollm2, engine="vllm", nats={"authSecret": "nats-creds"}, frontend={"apiKeySecret": "api-key"},
                          workers={"prefill": {"replicas": 1, "extraArgs": [*engine, "--cpu-cores", "0"]},
                                   "decode": {"replicas": 1, "extraArgs": [*engine, "--cpu-cores", "1"]}})
    docs = render("disagg.yaml", "nats.yaml", values=values)
    secrets = {"nats-creds": {"username": "tandem", "password": "s3cret"}, "api-key": {"api-key": "k-123"}}
    cluster = LocalCluster(docs, tmp_path, IMAGES, namespace="serving", secrets=secrets)
    try:
        cluster.wait_ready(timeout=240)  # under the test's own 300 s bound, so the logs are shown
        url = cluster.service_url("llm-tandem-frontend", "http")
        health = httpx.get(f"{url}/health").json()
        assert len(health["instances"]) == 1 and len(health["prefill_instances"]) == 1
        refused = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []})
        assert refused.status_code == 401
        prefill_url, decode_url = (f"http://{cluster.pods_of(f'llm-tandem-{pool}')[0].ip}:9090/metrics"
                                   for pool in ("prefill", "decode"))
        prefill_before, decode_before = (prompt_sources(httpx.get(u).text) for u in (prefill_url, decode_url))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k-123", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content
        # The prompt was prefilled in the prefill pod, and the decode pod pulled its KV cache from there through
        # NIXL, at the prefill pod's address: it computed none of the prompt itself.
        prefill_page, decode_page = httpx.get(prefill_url).text, httpx.get(decode_url).text
        assert metric_sum(prefill_page, "dynamo_component_requests_total", dynamo_component="prefill",
                          dynamo_endpoint="generate") == 1
        prompt_tokens = reply.usage.prompt_tokens
        prefill = deltas(prompt_sources(prefill_page), prefill_before)
        decode = deltas(prompt_sources(decode_page), decode_before)
        assert prefill["local_compute"] == prompt_tokens, prefill
        assert decode["local_compute"] == 0 and decode["external_kv_transfer"] > 0, decode
        assert decode["external_kv_transfer"] + decode["local_cache_hit"] == prompt_tokens, decode
        assert metric_sum(decode_page, "vllm:nixl_xfer_time_seconds_count") >= 1
        assert metric_sum(decode_page, "dynamo_component_remote_prefill_requests_total") == 1
        assert cluster.stop() == []
    finally:
        cluster.stop()


@needs_root
def test_the_planner_pod_scales_the_worker_deployment_and_the_new_pod_registers_and_serves(
        smollm2: str, tmp_path: Path) -> None:
    """The chart's planner pod, logged in with its ServiceAccount, decides every second on the traffic it reads
    from the frontend (found in discovery) that one mocker worker is enough. Raising its `min_endpoint` through
    its control API makes it PATCH the worker Deployment's scale to 2 through the API server, which the Role the
    chart grants it allows; the pod runner starts a second worker pod, which registers its own address, and the
    frontend routes requests to it, as its own metrics count. Back to a floor of 1, it scales the Deployment down
    and the pod runner deletes that pod, no request failing."""
    from tests.planner.test_planner_run import write_profiles

    profiles = tmp_path / "profiles"
    write_profiles(profiles)
    # Round-robin: the new worker gets every other request once the frontend sees it (the KV router would keep
    # the chat template's prefix on the worker that has it cached).
    values = local_values(smollm2, frontend={"routerMode": "round-robin"},
                          workers={"agg": {"replicas": 1, "extraArgs": MOCKER}}, planner={
        "enabled": True, "rbac": {"create": True}, "adjustmentInterval": 1,
        "profile": {"volume": {"hostPath": {"path": str(profiles), "type": "Directory"}}},
        "extraArgs": ["--load-predictor", "constant", "--no-correction", "--control-api-host", "0.0.0.0"],
        "extraEnv": [{"name": "PLANNER_CONTROL_API_KEY", "value": "control-key"}]})
    cluster = LocalCluster(render("agg.yaml", values=values), tmp_path / "pods", IMAGES, namespace="serving")
    load: Load | None = None
    try:
        cluster.wait_ready(timeout=90)
        url = cluster.service_url("llm-tandem-frontend", "http")
        [first] = cluster.pods_of("llm-tandem-worker")
        [planner] = cluster.pods_of("llm-tandem-planner")
        load = Load(url, clients=1, pause=0.2, words=20)

        def decided(action: str) -> bool:
            assert planner.containers[0].starts == 1, planner.containers[0].tail()  # it never exited
            try:
                page = httpx.get(f"http://{planner.ip}:9090/metrics").text
            except httpx.TransportError:  # not listening yet
                return False
            return metric_sum(page, "tandem_planner_decisions_total", action=action) >= 1

        wait_until(lambda: decided("unchanged"), "the planner decided that one worker is enough", timeout=60)
        assert cluster.replicas["llm-tandem-worker"] == 1 and [r for r in cluster.api.requests if
                                                              r.verb == "patch" and not r.dry_run] == []
        changed = httpx.patch(f"http://{planner.ip}:9086/v1/min-endpoints", json={"min_endpoint": 2},
                              headers={"Authorization": "Bearer control-key"})
        assert changed.status_code == 200, changed.text
        wait_until(lambda: len(cluster.pods_of("llm-tandem-worker")) == 2, "a second worker pod", timeout=60)
        # The planner's ServiceAccount scaled the Deployment: a dry run at its start, then the real PATCH.
        account = "system:serviceaccount:serving:llm-tandem-planner"
        scale = "/apis/apps/v1/namespaces/serving/deployments/llm-tandem-worker/scale"
        assert [(r.user, r.path, r.dry_run, r.body, r.status) for r in cluster.api.requests if r.verb == "patch"] == [
            (account, scale, True, {"spec": {"replicas": 1}}, 200), (account, scale, False, {"spec": {"replicas": 2}}, 200)]
        [new] = [pod for pod in cluster.pods_of("llm-tandem-worker") if pod is not first]
        cluster.wait_ready(timeout=60)
        # The new pod registered its own address; the frontend found it there and routes to it: two requests
        # once the frontend lists it (nothing else sent meanwhile), one of them served by the new pod, as its own
        # metrics count.
        wait_until(lambda: advertised_hosts(cluster) == {first.ip, new.ip}, "the new worker registered", timeout=30)
        wait_until(lambda: len(httpx.get(f"{url}/health").json()["instances"]) == 2, "the frontend saw it", timeout=30)
        load.stop()
        assert load.served > 0 and load.failures == []
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        served = [client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": f"request {i}"}]) for i in range(2)]
        assert all(reply.usage.completion_tokens == 2 for reply in served)
        page = httpx.get(f"http://{new.ip}:9090/metrics").text
        assert metric_sum(page, "dynamo_component_requests_total", dynamo_endpoint="generate") >= 1

        # Back to a floor of 1: on the same traffic the planner scales the Deployment down, and the pod runner
        # deletes the newest pod (SIGTERM: it leaves discovery and drains), with no request failing.
        load = Load(url, clients=1, pause=0.2, words=20)
        changed = httpx.patch(f"http://{planner.ip}:9086/v1/min-endpoints", json={"min_endpoint": 1},
                              headers={"Authorization": "Bearer control-key"})
        assert changed.status_code == 200, changed.text
        wait_until(lambda: cluster.pods_of("llm-tandem-worker") == [first], "the new pod deleted", timeout=60)
        wait_until(lambda: len(httpx.get(f"{url}/health").json()["instances"]) == 1, "the frontend let it go",
                   timeout=30)
        assert [(r.dry_run, r.body) for r in cluster.api.requests if r.verb == "patch"][-1] == (
            False, {"spec": {"replicas": 1}})
        load.stop()
        assert load.failures == []
        assert cluster.stop() == []  # the deleted pod's worker exited on SIGTERM too
    finally:
        if load is not None:
            load.stop()
        cluster.stop()
