"""Prefill time of SmolLM2-135M in vLLM on this CPU, bfloat16 against float32: the measurement behind what
`--dtype auto` picks on CPU (tandem/vllm/cpu_dtype.py).

    flock /tmp/cpu.lock .venv/bin/python bench/cpu_dtype_bench.py --lengths 128,512,1024 --repeat 5

Each engine runs in a child process of its own (vLLM's engine in-process, threads bound to `--cores`,
prefix caching off so that every prompt is computed), in the order bfloat16, float32, float32, bfloat16, ...
(`--rounds` pairs), so that a slow minute of the shared machine weighs on both dtypes. A child warms up
once per prompt length, then times `--repeat` prompts of each length (random token ids, a new prompt each
time, one output token: the time is the prefill's), the lengths interleaved. The table has the medians over
all rounds of the wall time and of the process's CPU time, and bfloat16's median over float32's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from _common import model_path

DTYPES = ("bfloat16", "float32")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "bf16", "sve", "svebf16",
         "asimdhp")


def child(args: argparse.Namespace) -> None:
    """One engine in `args.child`'s dtype: prints {length: [[wall, cpu], ...]} as JSON on its last line."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.monotonic()
    llm = LLM(model=args.model, dtype=args.child, enforce_eager=not args.compiled, enable_prefix_caching=False,
              max_model_len=max(args.lengths) + 32, max_num_batched_tokens=max(args.lengths) + 32, block_size=32,
              kv_cache_memory_bytes=256 * 2**20, max_num_seqs=1, seed=0)
    started = time.monotonic() - start
    params = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(args.seed)

    def prefill(length: int) -> tuple[float, float]:
        prompt = TokensPrompt(prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(length)])
        wall, cpu = time.perf_counter(), time.process_time()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - wall, time.process_time() - cpu

    for length in args.lengths:
        prefill(length)
    times: dict[int, list[tuple[float, float]]] = {length: [] for length in args.lengths}
    for _ in range(args.repeat):
        for length in args.lengths:
            times[length].append(prefill(length))
    print(json.dumps({"start_s": started, "times": times}), flush=True)


def run_child(dtype: str, args: argparse.Namespace, model: str, seed: int) -> dict:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": args.cores, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_USE_AOT_COMPILE": "0"}
    argv = [sys.executable, os.path.abspath(__file__), "--child", dtype, "--model", model, "--seed", str(seed),
            "--lengths", ",".join(map(str, args.lengths)), "--repeat", str(args.repeat)]
    if args.compiled:
        argv.append("--compiled")
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode:
        raise RuntimeError(f"{dtype} engine failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_description() -> str:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                if key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    have = [f for f in FLAGS if f in flags]
    return f"{model or 'unknown CPU'}, {os.cpu_count()} cores; of {', '.join(FLAGS)}: {', '.join(have) or 'none'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=lambda s: [int(n) for n in s.split(",")], default=[128, 512, 1024])
    parser.add_argument("--repeat", type=int, default=5, help="timed prompts per length and engine")
    parser.add_argument("--rounds", type=int, default=1, help="pairs of engines (bf16, f32, f32, bf16, ...)")
    parser.add_argument("--cores", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND of the engines")
    parser.add_argument("--compiled", action="store_true", help="vLLM's torch.compile (default: eager)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per engine")
    parser.add_argument("--child", choices=DTYPES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0

    model = model_path()
    print(f"CPU: {cpu_description()}", flush=True)
    # bf16, f32 | f32, bf16 | bf16, f32 ...
    order = [d for n in range(args.rounds) for d in (DTYPES if n % 2 == 0 else DTYPES[::-1])]
    results: dict[str, dict[int, list[tuple[float, float]]]] = {d: {n: [] for n in args.lengths} for d in DTYPES}
    for seed, dtype in enumerate(order):
        data = run_child(dtype, args, model, seed)
        for length, samples in data["times"].items():
            results[dtype][int(length)].extend(tuple(s) for s in samples)
        medians = ", ".join(f"{n}: {statistics.median(w for w, _ in data['times'][str(n)]) * 1000:.0f} ms"
                            for n in args.lengths)
        print(f"{dtype} engine (started in {data['start_s']:.0f} s): {medians}", flush=True)

    print(f"\n{'eager' if not args.compiled else 'compiled'}, cores {args.cores}, {args.repeat} prompts per length "
          f"and engine, {len(order) // 2} engine(s) per dtype\n")
    print("| prompt tokens | bf16 wall p50 (ms) | f32 wall p50 (ms) | bf16 / f32 wall | bf16 CPU p50 (ms) "
          "| f32 CPU p50 (ms) | bf16 / f32 CPU |")
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        wall = {d: statistics.median(w for w, _ in results[d][length]) for d in DTYPES}
        cpu = {d: statistics.median(c for _, c in results[d][length]) for d in DTYPES}
        print(f"| {length} | {wall['bfloat16'] * 1000:.0f} | {wall['float32'] * 1000:.0f} "
              f"| {wall['bfloat16'] / wall['float32']:.2f}x | {cpu['bfloat16'] * 1000:.0f} "
              f"| {cpu['float32'] * 1000:.0f} | {cpu['bfloat16'] / cpu['float32']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
