"""A deployment on etcd discovery (a real etcd on loopback): the OpenAI client through a frontend to mocker
workers, and what a restart of etcd under load changes (nothing a client sees)."""

from __future__ import annotations

import threading
import time

import httpx

from tests.support.deployment import MODEL, Deployment

MOCKER = ["--block-size", "16", "--speedup-ratio", "20", "--num-gpu-blocks-override", "2048"]


def test_mocker_deployment_on_etcd_serves_the_openai_client(tmp_path, smollm2, etcd):
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER, MOCKER],
                            discovery="etcd")
    try:
        client = deployment.client()
        assert [m.id for m in client.models.list().data] == [MODEL]
        replies = [client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": f"hello {i}"}]) for i in range(4)]
        assert all(r.usage.completion_tokens == 4 for r in replies)
        keys = etcd.call("/v3/kv/range", {"key": "djEv", "range_end": "djEw", "keys_only": True})
        assert int(keys.get("count", 0)) >= 4  # instances and model cards live in etcd
    finally:
        deployment.stop()


def test_etcd_restart_under_load_fails_no_request_and_registrations_survive(tmp_path, smollm2, etcd):
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER], discovery="etcd")
    try:
        client = deployment.client()
        failures: list[BaseException] = []
        done = threading.Event()
        served = [0]

        def load() -> None:
            while not done.is_set():
                try:
                    client.chat.completions.create(model=MODEL, max_tokens=8,
                                                   messages=[{"role": "user", "content": "under load"}])
                    served[0] += 1
                except Exception as e:  # noqa: BLE001 - every failure is what the test reports
                    failures.append(e)

        thread = threading.Thread(target=load)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while served[0] < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            etcd.stop()
            stopped_at = served[0]
            while served[0] < stopped_at + 3 and time.monotonic() < deadline:
                time.sleep(0.05)  # served while etcd is down: routing needs no discovery round trip
            etcd.start()
            # A worker that registers after the restart is found: the frontend's watch resumed.
            deployment.add_engine(*MOCKER)
            deployment.wait_for_instances(2, timeout=30)
            resumed = served[0]
            while served[0] < resumed + 3 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            done.set()
            thread.join(30)
        assert not failures, failures[:3]
        assert served[0] >= stopped_at + 3 and served[0] >= resumed + 3
        health = httpx.get(f"{deployment.url}/health").json()
        assert health["status"] == "healthy" and len(health["instances"]) == 2
    finally:
        deployment.stop()


def test_tandem_run_no_frontend_adds_workers_to_a_deployment_elsewhere(tmp_path, smollm2, launch, etcd):
    """`tandem run --no-frontend` on a "second host": its workers join the frontend's deployment through etcd,
    serve its requests, and leave it when the run stops."""
    import signal

    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER], discovery="etcd")
    try:
        run = launch("--workers", "2", "--no-frontend", "--discovery-backend", "etcd", "--", *MOCKER,
                     env={"ETCD_ENDPOINTS": etcd.url, "DYN_NAMESPACE": deployment.namespace})  # the same card
        run.wait_for(r"==> 2 worker\(s\) of \S+ ready and registered in etcd at \S+ \(ETCD_ENDPOINTS\)")
        deployment.wait_for_instances(3)
        client = deployment.client()
        for n in range(6):
            assert client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": f"served by any of three {n}"}]).usage.completion_tokens == 2
        assert run.stop(signal.SIGINT) == 0
        deployment.wait_for_instances(1)
        assert run.leftovers() == []
    finally:
        deployment.stop()


def test_tandem_run_on_etcd_forgets_a_dead_worker(launch, etcd):
    """`tandem run --discovery-backend etcd`: the deployment registers in the etcd server ETCD_ENDPOINTS names,
    and the launcher removes a killed worker's keys there (its five-minute lease would keep them)."""
    import os
    import signal

    from tests.launch.test_launch import LONG_LEASES, _health, _wait_instances

    run = launch("--workers", "2", "--discovery-backend", "etcd", env={"ETCD_ENDPOINTS": etcd.url, **LONG_LEASES})
    url = run.serving()
    assert len(_health(url)["instances"]) == 2
    assert run.wait_for(r"discovery: etcd at (\S+)").group(1) == etcd.url
    os.killpg(run.children_running("tandem.mocker")[0], signal.SIGKILL)
    _wait_instances(url, 1)
    assert run.client(url).chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "still served"}]).usage.completion_tokens == 2
    assert run.stop(signal.SIGINT) == 0
    assert run.leftovers() == []


def test_processes_stop_gracefully_when_etcd_went_first(tmp_path, smollm2, etcd):
    """Deleting a release stops etcd with everything else: a frontend and a worker told to stop after etcd
    went away still run their shutdown to the end and exit (before, unregistering raised and the ZMQ
    publisher's close never finished, so they hung until killed)."""
    import signal

    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER], discovery="etcd")
    try:
        etcd.stop()
        processes = [deployment.frontend, *deployment.engines]
        for process in processes:
            process.proc.send_signal(signal.SIGTERM)
        for process in processes:
            assert process.proc.wait(timeout=60) == 0, process.stderr()  # bounds a hang; not a timing claim
            assert "runtime shut down" in process.stderr()
        assert "could not leave discovery" in deployment.engines[0].stderr()
    finally:
        deployment.stop()
