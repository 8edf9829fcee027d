"""`tandem profile`: measure one worker's prefill and decode performance, for the SLA planner.

    tandem profile [--engine vllm|mocker] [--model M] [--output DIR] [--quick] [-- worker flags]

Starts a frontend and one aggregated worker on this machine, as `tandem run --workers 1` would, and sweeps:
- **prefill**: the time to first token of one request at a time, over a range of prompt lengths (random
  token ids, so no prompt reuses another's cached prefix); throughput = prompt tokens / TTFT;
- **decode**: batches of `c` concurrent streams of a given prompt length and a fixed output length
  (`ignore_eos`), `c` doubling until the KV cache (or the engine's sequence limit) is full; per batch the mean
  inter-token latency and the output tokens per second.

Writes Dynamo's profile layout (`selected_prefill_interpolation/raw_data.npz`,
`selected_decode_interpolation/raw_data.npz`), which `tandem run --planner sla --profile-results-dir DIR`
and Dynamo's planner both read, and a plot of each (`prefill.png`, `decode.png`). The engine runs as the
planner will run it: pass the same worker flags after `--` (for the mocker, its `--speedup-ratio`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tandem.launch.main import LaunchError, wait_until_serving
from tandem.launch.plan import Plan
from tandem.launch.spec import ENGINES, SpecError, build_spec
from tandem.launch.supervisor import LogMux, Supervisor
from tandem.models.resolve import ModelNotFoundError, resolve_model
from tandem.planner.perf import DECODE_NPZ, PREFILL_NPZ

TOKEN_IDS = (1000, 30000)  # random prompt tokens are drawn from here: ordinary vocabulary, no special tokens


@dataclass(frozen=True)
class Sweep:
    prefill_points: int  # prompt lengths measured for prefill
    repeats: int  # requests per prompt length (the median TTFT counts)
    decode_contexts: int  # prompt lengths measured for decode
    osl: int  # output tokens of each decode stream
    max_concurrency: int


QUICK = Sweep(prefill_points=5, repeats=2, decode_contexts=3, osl=32, max_concurrency=16)
FULL = Sweep(prefill_points=10, repeats=3, decode_contexts=5, osl=128, max_concurrency=256)


@dataclass(frozen=True)
class EngineLimits:
    """What the frontend reports of the worker's engine."""

    context_length: int
    kv_tokens: int
    max_num_seqs: int


@dataclass
class Profile:
    prefill_isl: list[float]
    prefill_ttft_ms: list[float]
    prefill_thpt: list[float]
    kv_usage: list[float]
    context: list[float]
    itl_ms: list[float]
    decode_thpt: list[float]
    kv_tokens: int


def geometric(low: int, high: int, points: int) -> list[int]:
    return sorted({int(round(v)) for v in np.geomspace(low, high, points)})


async def engine_of(http: aiohttp.ClientSession, url: str, model: str) -> EngineLimits:
    async with http.get(f"{url}/metrics") as response:
        text = await response.text()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model") == model:
                values[sample.name.removeprefix("dynamo_frontend_model_")] = sample.value
    try:
        return EngineLimits(int(values["context_length"]),
                            int(values["total_kv_blocks"] * values["kv_cache_block_size"]), int(values["max_num_seqs"]))
    except KeyError as e:
        raise RuntimeError(f"the frontend does not report the engine's {e.args[0]} for {model}") from None


class CompletionClient:
    """Completions streamed from the frontend and timed, on prompts of random token ids (seeded)."""

    def __init__(self, http: aiohttp.ClientSession, url: str, model: str, seed: int) -> None:
        self.http, self.url, self.model = http, url, model
        self.random = random.Random(seed)

    def prompt(self, length: int) -> list[int]:
        return [self.random.randrange(*TOKEN_IDS) for _ in range(length)]

    async def stream(self, prompt: list[int], max_tokens: int) -> tuple[float, list[float], int]:
        """(seconds to the first token, arrival times of every token chunk, output tokens)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        start = time.monotonic()
        arrivals: list[float] = []
        tokens = 0
        async with self.http.post(f"{self.url}/v1/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"the frontend answered {response.status}: {(await response.text())[:300]}")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices"):
                    arrivals.append(time.monotonic())
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
        if not arrivals:
            raise RuntimeError("a profiling request produced no token")
        return arrivals[0] - start, arrivals, tokens


async def sweep_prefill(client: CompletionClient, engine: EngineLimits,
                        sweep: Sweep) -> tuple[list[float], list[float], list[float]]:
    top = max(64, min(engine.context_length - 2, engine.kv_tokens - 2, 8192))
    isls, ttfts, thpts = [], [], []
    for isl in geometric(min(64, top), top, sweep.prefill_points):
        seconds = statistics.median([(await client.stream(client.prompt(isl), 1))[0] for _ in range(sweep.repeats)])
        isls.append(float(isl))
        ttfts.append(seconds * 1000)
        thpts.append(isl / seconds)
    return isls, ttfts, thpts


Series = list[float]


async def sweep_decode(client: CompletionClient, engine: EngineLimits,
                       sweep: Sweep) -> tuple[Series, Series, Series, Series]:
    usage, contexts, itls, thpts = [], [], [], []
    # One stream of the longest prompt must fit the context and the KV cache (a mocker's can be small).
    longest = max(64, min(engine.context_length - sweep.osl - 1, engine.kv_tokens - sweep.osl - 1, 4096))
    for isl in geometric(min(64, longest), longest, sweep.decode_contexts):
        fits = min(engine.kv_tokens // (isl + sweep.osl), engine.max_num_seqs, sweep.max_concurrency)
        concurrency = 1
        while concurrency <= max(fits, 1):
            start = time.monotonic()
            results = await asyncio.gather(*(client.stream(client.prompt(isl), sweep.osl) for _ in range(concurrency)))
            wall = time.monotonic() - start
            gaps = [(arrivals[-1] - arrivals[0]) / (tokens - 1) for _, arrivals, tokens in results if tokens > 1]
            context = isl + sweep.osl / 2
            usage.append(concurrency * context / engine.kv_tokens)
            contexts.append(context)
            itls.append(statistics.mean(gaps) * 1000 if gaps else 0.0)
            thpts.append(sum(tokens for _, _, tokens in results) / wall)
            concurrency *= 2
    return usage, contexts, itls, thpts


async def measure(url: str, model: str, sweep: Sweep, seed: int = 0) -> Profile:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        engine = await engine_of(http, url, model)
        client = CompletionClient(http, url, model, seed)
        await client.stream(client.prompt(16), 2)  # warm-up
        isl, ttft, prefill_thpt = await sweep_prefill(client, engine, sweep)
        usage, context, itl, decode_thpt = await sweep_decode(client, engine, sweep)
    return Profile(isl, ttft, prefill_thpt, usage, context, itl, decode_thpt, engine.kv_tokens)


def write_profile(folder: Path, profile: Profile) -> list[Path]:
    """The npz files in Dynamo's layout and the two plots; returns their paths."""
    prefill, decode = folder / PREFILL_NPZ, folder / DECODE_NPZ
    prefill.parent.mkdir(parents=True, exist_ok=True)
    decode.parent.mkdir(parents=True, exist_ok=True)
    np.savez(prefill, prefill_isl=np.array(profile.prefill_isl), prefill_ttft=np.array(profile.prefill_ttft_ms),
             prefill_thpt_per_gpu=np.array(profile.prefill_thpt))
    np.savez(decode, x_kv_usage=np.array(profile.kv_usage), y_context_length=np.array(profile.context),
             z_itl=np.array(profile.itl_ms), z_thpt_per_gpu=np.array(profile.decode_thpt),
             max_kv_tokens=np.array([profile.kv_tokens]))
    return [prefill, decode, *plot(folder, profile)]


def plot(folder: Path, profile: Profile) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft, thpt) = plt.subplots(1, 2, figsize=(10, 4))
    ttft.plot(profile.prefill_isl, profile.prefill_ttft_ms, "o-")
    ttft.set(xlabel="prompt tokens", ylabel="TTFT (ms)", title="Prefill: time to first token", xscale="log")
    thpt.plot(profile.prefill_isl, profile.prefill_thpt, "o-")
    thpt.set(xlabel="prompt tokens", ylabel="prompt tokens/s", title="Prefill: throughput", xscale="log")
    figure.tight_layout()
    figure.savefig(folder / "prefill.png", dpi=100)
    plt.close(figure)

    figure, (itl, thpt) = plt.subplots(1, 2, figsize=(10, 4))
    for context in sorted(set(profile.context)):
        rows = [i for i, c in enumerate(profile.context) if c == context]
        usage = [profile.kv_usage[i] for i in rows]
        itl.plot(usage, [profile.itl_ms[i] for i in rows], "o-", label=f"context {context:.0f}")
        thpt.plot(usage, [profile.decode_thpt[i] for i in rows], "o-", label=f"context {context:.0f}")
    itl.set(xlabel="KV cache usage", ylabel="ITL (ms)", title="Decode: inter-token latency")
    thpt.set(xlabel="KV cache usage", ylabel="output tokens/s", title="Decode: throughput")
    itl.legend()
    figure.tight_layout()
    figure.savefig(folder / "decode.png", dpi=100)
    plt.close(figure)
    return [folder / "prefill.png", folder / "decode.png"]


async def profile_worker(spec_flags: dict[str, object], worker_args: list[str], output: Path, sweep: Sweep,
                         log_path: Path) -> list[Path]:
    spec = build_spec({**spec_flags, "workers": 1, "http_port": 0}, worker_args=worker_args)
    model_path = resolve_model(spec.model)
    discovery = tempfile.mkdtemp(prefix="tandem-profile-")
    with open(log_path, "w") as log:
        supervisor = Supervisor(Plan(spec, model_path, discovery), LogMux(log, color=False))
        supervisor.start()
        try:
            url = await wait_until_serving(supervisor, supervisor.plan.served_name, spec.ready_timeout)
            assert url is not None
            profile = await measure(url, supervisor.plan.served_name, sweep)
        except BaseException:
            supervisor.kill()
            raise
        finally:
            await supervisor.stop(spec.stop_timeout)
            shutil.rmtree(discovery, ignore_errors=True)
    return write_profile(output, profile)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    own, worker_args = (args[: args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
    parser = argparse.ArgumentParser(prog="tandem profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="model name, folder or hub id [smollm2]")
    parser.add_argument("--engine", choices=ENGINES, default="vllm", help="worker engine [vllm]")
    parser.add_argument("--output", type=Path, default=Path("profiles"), help="where the profile goes [./profiles]")
    parser.add_argument("--quick", action="store_true",
                        help=f"fewer points: {QUICK.prefill_points} prompt lengths, {QUICK.decode_contexts} decode "
                        f"contexts of {QUICK.osl} output tokens, at most {QUICK.max_concurrency} streams")
    parsed = parser.parse_args(own)
    output: Path = parsed.output
    output.mkdir(parents=True, exist_ok=True)
    log_path = output / "profile.log"
    try:
        written = asyncio.run(profile_worker({"model": parsed.model, "engine": parsed.engine}, worker_args, output,
                                             QUICK if parsed.quick else FULL, log_path))
    except (SpecError, ModelNotFoundError) as e:
        print(f"tandem profile: {e}", file=sys.stderr)
        return 2
    except (LaunchError, RuntimeError, aiohttp.ClientError) as e:
        print(f"tandem profile: {e} (the processes' output is in {log_path})", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
