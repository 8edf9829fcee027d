"""Encoder workers at scale, simulated: `tandem run --engine mocker` with W + E aggregated mocker workers against
W mocker workers in --ec-consumer-mode and E mocker encoder workers (--vllm-native-encoder-worker), the same
number of engines, as the images per request grow. Where is the crossover?

    python bench/mocker_encoders.py                                   # W=4, E=2, 0/1/2/4/8 images, ~8 min
    python bench/mocker_encoders.py --images 0,4 --duration 10 --plot docs/images/mocker-encoders.png
    python bench/mocker_encoders.py --from-json run.json --plot run.png    # the table and plot of a saved run
    python bench/mocker_encoders.py --decode-workers 2                # E+P+D against P+D, prefill workers W (+ E)

The simulated model is the tiny vision-language model's text side (tests/support/vision_model.py: SmolLM2 with
an image token); every engine has the same timing model (Dynamo's default fit), speedup 1, --image-tokens 64,
--image-encode-ms --encode-ms [40]. An aggregated worker pays an image's encode time in the step that admits its
request, so every request in that step waits for it; a consumer hands the images to an encoder (one request's
images at a time per encoder, taken in turn) and computes only the prompt. Each system serves through one
frontend (round-robin), all processes on both cores.

Load: a closed loop of --concurrency streamed chat requests, each one user message of k images (distinct
32x32 PNGs, data URLs) and --isl tokens of new text, --osl tokens out (ignore_eos); a warm-up of --warmup s,
then --duration s measured. Requests/s is answers / window; TTFT is to the first content chunk; ITL the mean gap
between a request's later chunks. Every answer is checked (HTTP 200, [DONE], --osl tokens of usage).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import _common
import msgspec
from _common import Proc, StreamConn, fmt, pct
from _serve_compare import make_texts

MODEL_NAME = "tiny-vlm"


def build_model(folder: str) -> str:
    sys.path.insert(0, _common.REPO)
    from pathlib import Path

    from tests.support.vision_model import build_text_side

    build_text_side(Path(folder), Path(_common.model_path()))
    return folder


class Images:
    """Distinct 32x32 PNGs as data URLs, made on demand (a counter's colour and a seeded noise pixel)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self) -> str:
        from PIL import Image

        self.next += 1
        n = self.next
        image = Image.new("RGB", (32, 32), ((n * 37) % 256, (n * 101) % 256, (n * 7) % 256))
        image.putpixel((n % 32, (n // 32) % 32), (n % 251, 255 - n % 256, 128))
        out = io.BytesIO()
        image.save(out, "PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None


_decode = msgspec.json.Decoder(_Chunk).decode


def start(split: bool, args: argparse.Namespace, model: str, workdir: str) -> tuple[Proc, str]:
    """`tandem run`: W + E aggregated workers, or W consumers and E encoders (with --decode-workers D: the W + E or
    W workers prefill workers, and D decode workers); serving when this returns."""
    port = _common.free_port()
    namespace = f"mmenc{os.getpid()}{int(split)}"
    env = {**os.environ, "DYN_FILE_KV": os.path.join(workdir, "kv"), "DYN_DISCOVERY_BACKEND": "file",
           "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1",
           "DYN_SYSTEM_ENABLED": "false", "PYTHONPATH": _common.REPO}
    for name in ("DYN_LOG", "DYN_HTTP_PORT", "DYN_SYSTEM_PORT", "DYN_NAMESPACE"):
        env.pop(name, None)
    computing = str(args.workers if split else args.workers + args.encoders)  # the workers computing prompts
    shape = (["--prefill-workers", computing, "--decode-workers", str(args.decode_workers)] if args.decode_workers
             else ["--workers", computing])
    if split:
        shape += ["--encode-workers", str(args.encoders)]
    engine = ["--enable-multimodal", "--image-tokens", "64", "--image-encode-ms", str(args.encode_ms),
              "--speedup-ratio", "1", "--block-size", "16"]
    logdir = os.path.join(workdir, "logs")
    os.makedirs(logdir, exist_ok=True)
    launcher = Proc("tandem-run", [sys.executable, "-m", "tandem", "run", "--engine", "mocker", "--model", model,
                                   "--model-name", MODEL_NAME, *shape, "--router-mode", "round-robin",
                                   "--http-port", str(port), "--namespace", namespace, "--stop-timeout", "15",
                                   "--", *engine], env, logdir)
    try:
        launcher.wait_line("==> serving", timeout=180)
        url = f"http://127.0.0.1:{port}"
        _common.wait_serving(url, [launcher], MODEL_NAME)
    except BaseException:
        launcher.stop()
        raise
    return launcher, url


async def load(url: str, images_per_request: int, args: argparse.Namespace, texts: list[str],
               pictures: Images) -> dict[str, Any]:
    """The closed loop (see the module's docstring); its requests/s, TTFT, ITL and latency."""
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    measure_from, end = t0 + args.warmup, t0 + args.warmup + args.duration
    done: list[tuple[float, float, float, float]] = []  # start, first content, end, mean gap
    errors: list[str] = []
    text_index = 0

    def body() -> bytes:
        nonlocal text_index
        text_index += 1
        parts: list[dict[str, Any]] = [{"type": "text", "text": texts[text_index % len(texts)]}]
        parts += [{"type": "image_url", "image_url": {"url": pictures.take()}} for _ in range(images_per_request)]
        return msgspec.json.encode({
            "model": MODEL_NAME, "messages": [{"role": "user", "content": parts}], "max_tokens": args.osl,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})

    async def client() -> None:
        conn = StreamConn(host, int(port))
        while time.monotonic() < end:
            start = time.monotonic()
            try:
                status, events = await conn.post("/v1/chat/completions", body())
                stamps: list[float] = []
                tokens, finished = 0, False
                async for event in events:
                    payload = event.removeprefix(b"data: ").strip()
                    if payload == b"[DONE]":
                        finished = True
                        continue
                    chunk = _decode(payload)
                    if any(c.delta is not None and c.delta.content for c in chunk.choices):
                        stamps.append(time.monotonic())
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                if b" 200 " not in status or not finished or tokens != args.osl or not stamps:
                    raise RuntimeError(f"{status!r}: finished {finished}, {tokens} tokens")
            except Exception as e:  # noqa: BLE001 - counted and shown
                errors.append(f"{type(e).__name__}: {e}"[:200])
                conn.close()
                continue
            if start >= measure_from and stamps[-1] <= end:
                gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
                done.append((start, stamps[0], time.monotonic(), statistics.fmean(gaps) if gaps else 0.0))
        conn.close()

    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    ttfts = sorted(first - start for start, first, _, _ in done)
    latencies = sorted(stop - start for start, _, stop, _ in done)
    itls = sorted(gap for *_, gap in done)
    return {"rps": len(done) / args.duration, "requests": len(done), "errors": len(errors),
            "error_samples": sorted(set(errors))[:3],
            "ttft_p50_ms": pct(ttfts, 0.5) * 1e3 if done else 0.0, "ttft_p90_ms": pct(ttfts, 0.9) * 1e3 if done else 0.0,
            "itl_p50_ms": pct(itls, 0.5) * 1e3 if done else 0.0,
            "latency_p50_ms": pct(latencies, 0.5) * 1e3 if done else 0.0}


def report(results: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace) -> None:
    counts = sorted(results["aggregated"])
    side = "prefill" if args.decode_workers else "aggregated"
    decode = f" (both with {args.decode_workers} decode workers)" if args.decode_workers else ""
    print(f"\nmocker_encoders: {args.workers + args.encoders} {side} mocker workers against {args.workers} "
          f"consumers + {args.encoders} encoders{decode}; {args.encode_ms:g} ms per image, 64 image tokens, {args.isl} text "
          f"tokens in, {args.osl} out, concurrency {args.concurrency}, {args.duration:g} s per row\n")
    print(f"| images/request | {side} req/s | encoders req/s | ratio | {side} TTFT p50 / p90 ms | encoders TTFT "
          f"p50 / p90 ms | ratio p50 | {side} ITL p50 ms | encoders ITL p50 ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for k in counts:
        a, e = results["aggregated"][k], results["encoders"][k]
        print(f"| {k} | {fmt(a['rps'])} | {fmt(e['rps'])} | {e['rps'] / a['rps']:.2f}x | {fmt(a['ttft_p50_ms'])} / "
              f"{fmt(a['ttft_p90_ms'])} | {fmt(e['ttft_p50_ms'])} / {fmt(e['ttft_p90_ms'])} | "
              f"{e['ttft_p50_ms'] / a['ttft_p50_ms']:.2f}x | {fmt(a['itl_p50_ms'])} | {fmt(e['itl_p50_ms'])} | "
              f"{e['itl_p50_ms'] / a['itl_p50_ms']:.2f}x |")


def plot(results: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace, path: str) -> None:
    import _serve_compare

    counts = sorted(results["aggregated"])

    def ratio(metric: str) -> list[float]:
        return [results["encoders"][k][metric] / results["aggregated"][k][metric] for k in counts]

    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(counts, ratio("rps"), "o-", label="requests/s (higher: encoders better)")
        ax.plot(counts, ratio("ttft_p50_ms"), "s-", label="TTFT p50 (lower: encoders better)")
        ax.plot(counts, ratio("itl_p50_ms"), "^-", label="ITL p50 (lower: encoders better)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("images per request")
        side = f"prefill (+{args.decode_workers} decode)" if args.decode_workers else "aggregated"
        ax.set_ylabel(f"{args.workers} consumers + {args.encoders} encoders / {args.workers + args.encoders} {side}")
        ax.legend(fontsize=8)
        ax.set_title(f"mocker, {args.encode_ms:g} ms per image, concurrency {args.concurrency}", fontsize=10)
        return fig

    _serve_compare.plot(path, draw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="consumers (the aggregated side has W + E workers)")
    parser.add_argument("--encoders", type=int, default=2, help="encoder workers")
    parser.add_argument("--decode-workers", type=int, default=0,
                        help="disaggregated: D decode workers on both sides, the W (+ E) workers prefill workers [0]")
    parser.add_argument("--images", default="0,1,2,4,8", help="images per request, one measurement each")
    parser.add_argument("--encode-ms", type=float, default=40.0, help="simulated encode time per image")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--isl", type=int, default=128, help="new text tokens per request")
    parser.add_argument("--osl", type=int, default=32)
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--plot", default=None, metavar="PNG")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="also write the results as JSON (stdout without PATH)")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="print the table (and --plot) of a run --json wrote, without running")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            saved = msgspec.json.decode(f.read())
        vars(args).update({k: v for k, v in saved["args"].items() if k not in ("plot", "json", "from_json")})
        results = {name: {int(k): got for k, got in per.items()} for name, per in saved["results"].items()}
    else:
        results = run(args)
    report(results, args)
    if args.plot:
        plot(results, args, args.plot)
    if not args.from_json:
        _common.write_json(args.json, {"args": vars(args), "results": results})
    if any(r["errors"] for per in results.values() for r in per.values()):
        sys.exit(1)


def run(args: argparse.Namespace) -> dict[str, dict[int, dict[str, Any]]]:
    _common.interrupt_on_sigterm()
    counts = [int(k) for k in args.images.split(",")]
    scratch = tempfile.mkdtemp(prefix="mmenc-")
    results: dict[str, dict[int, dict[str, Any]]] = {"aggregated": {}, "encoders": {}}
    try:
        model = build_model(os.path.join(scratch, "model"))
        texts = make_texts(2000, args.isl, seed=args.isl)
        pictures = Images()
        for name, split in (("aggregated", False), ("encoders", True)):
            launcher, url = start(split, args, model, os.path.join(scratch, name))
            try:
                for k in counts:
                    got = asyncio.run(load(url, k, args, texts, pictures))
                    results[name][k] = got
                    print(f"  {name} {k} images: {got['rps']:.1f} req/s, TTFT p50 {got['ttft_p50_ms']:.0f} ms, "
                          f"ITL p50 {got['itl_p50_ms']:.1f} ms, {got['errors']} errors {got['error_samples']}",
                          file=sys.stderr, flush=True)
            finally:
                launcher.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
