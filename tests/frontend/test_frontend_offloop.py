"""Long prompts (bodies over `OFF_LOOP_PROMPT_BYTES`) are tokenized off the frontend's event loop: while
one such request is held inside its tokenization (tests/workers/gated_frontend.py), the same frontend still
answers /health, /v1/models and /metrics. Were it tokenized on the loop, those would wait for it; the
deadline below turns that into a failure. (Short prompts tokenize on the loop: a thread costs more.)"""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import httpx

from tandem.frontend.preprocess import OFF_LOOP_PROMPT_BYTES
from tests.support.deployment import MODEL, Deployment
from tests.support.engines import wait_until
from tests.support.processes import TandemProcess


def test_a_prompt_being_tokenized_does_not_hold_up_the_frontend(tmp_path: Path, smollm2: str) -> None:
    deployment = Deployment(tmp_path, smollm2)  # a test engine, and an ordinary frontend we do not use
    gate = tmp_path / "gate"
    frontend = TandemProcess("tests.workers.gated_frontend", "--http-host", "127.0.0.1", "--http-port", "0",
                             "--discovery-backend", "file", env={**deployment.env, "TANDEM_TEST_GATE": str(gate)})
    try:
        url = frontend.ready[0]
        wait_until(lambda: httpx.get(f"{url}/health").json().get("instances"), "the frontend sees the worker", 30)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = "[[say:held]] " + "and so on " * (OFF_LOOP_PROMPT_BYTES // 10)
            reply = pool.submit(httpx.post, f"{url}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": long}], "max_tokens": 5})
            wait_until(lambda: os.path.exists(f"{gate}.entered"), "the request is being tokenized", 30)
            for path in ("/health", "/v1/models", "/metrics"):
                assert httpx.get(f"{url}{path}", timeout=5).status_code == 200, path
            assert not reply.done()  # it is still held
            gate.touch()
            answer = reply.result(timeout=60)
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "held"
    finally:
        frontend.stop()
        deployment.stop()
