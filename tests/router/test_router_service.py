"""`tandem router` as a service: other components route through it (`generate`) or ask it where a
prompt should go (`best_worker_id`). Mocker workers, real processes."""

from __future__ import annotations

from pathlib import Path

from tests.support.deployment import MODEL, Deployment
from tests.support.processes import TandemProcess

BLOCK = 16
MOCKER = ["--block-size", str(BLOCK), "--speedup-ratio", "100"]


def _request(tokens: list[int]) -> dict:
    return {"model": MODEL, "token_ids": tokens, "stop_conditions": {"max_tokens": 2}}


def test_router_service_routes_by_cached_prefix(tmp_path: Path, smollm2: str) -> None:
    deployment = Deployment(tmp_path, smollm2, engine_module="tandem.mocker", engines=[MOCKER, MOCKER, MOCKER])
    router = TandemProcess("tandem.router", "--endpoint", f"dyn://{deployment.namespace}.backend.generate",
                           "--block-size", str(BLOCK), "--discovery-backend", "file", env=deployment.env)
    try:
        for n in range(4):
            prefix = list(range(1000 * (n + 1), 1000 * (n + 1) + 8 * BLOCK))
            first = deployment.call("router.generate", _request(prefix))
            assert first[-1]["completion_usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            best = deployment.call("router.best_worker_id", {"token_ids": prefix + [7, 8, 9]})[0]
            assert best["overlap_blocks"] == 8
            for turn in range(3):
                out = deployment.call("router.generate", _request(prefix + [turn] * 5))
                assert sum(len(o["token_ids"]) for o in out) == 2
                assert out[-1]["completion_usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK
    finally:
        router.stop()
        deployment.stop()


def test_router_service_rejects_bad_flags() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tandem.router", "--block-size", "16", "--router-temperature", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--router-temperature" in proc.stderr
