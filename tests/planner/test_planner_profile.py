"""`tandem profile` on a mocker worker: the profile lands in Dynamo's layout, loads as the planner loads it,
covers the KV cache as far as the engine allows (a cache smaller than the context included), and comes with its plots; a bad command line exits 2."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from tandem.planner.perf import DECODE_NPZ, PREFILL_NPZ, DecodeProfile, PrefillProfile
from tests.support import REPO

# 4,096 tokens, under the model's context: the longest decode prompt must be cut to fit the cache.
SMALL_KV = ["--block-size", "16", "--num-gpu-blocks-override", "256", "--speedup-ratio", "20"]


def test_a_quick_mocker_profile_is_one_the_planner_loads(tmp_path, smollm2) -> None:
    done = subprocess.run([sys.executable, "-m", "tandem.launch.profile", "--engine", "mocker", "--model", smollm2,
                           "--quick", "--output", str(tmp_path), "--", *SMALL_KV],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stderr
    written = done.stdout.split()
    assert written == [str(tmp_path / PREFILL_NPZ), str(tmp_path / DECODE_NPZ), str(tmp_path / "prefill.png"),
                       str(tmp_path / "decode.png")]
    for png in written[2:]:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with np.load(tmp_path / PREFILL_NPZ) as prefill:
        assert len(prefill["prefill_isl"]) == 5 and (prefill["prefill_ttft"] > 0).all()
        assert np.allclose(prefill["prefill_thpt_per_gpu"], prefill["prefill_isl"] / prefill["prefill_ttft"] * 1000)
    with np.load(tmp_path / DECODE_NPZ) as decode:
        assert decode["max_kv_tokens"].tolist() == [4096]
        assert decode["y_context_length"].max() <= 4096
        assert len(set(decode["y_context_length"].tolist())) == 3  # three prompt lengths
        assert decode["x_kv_usage"].max() > 0.5  # the longest prompts filled the cache as far as it goes
        assert (decode["z_thpt_per_gpu"] > 0).all()
    PrefillProfile.load(tmp_path)
    assert DecodeProfile.load(tmp_path).best_throughput_per_gpu(50, 500)[0] > 0


def test_a_bad_command_line_exits_2(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "tandem.launch.profile", "--engine", "mocker", "--model",
                           str(tmp_path / "nowhere"), "--output", str(tmp_path)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 2 and "does not exist" in done.stderr
