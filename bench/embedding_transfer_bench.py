"""The hand-off of one image's encoder output from an encoder to its consumer (--embedding-transfer-mode), timed
between two processes on this host at the sizes real vision-language models produce: `local` (the consumer
reads the safetensors file the encoder's connector wrote: tandem.vllm.embedding_transfer.load_stored) against
`nixl-read` (the encoder registers the tensor with its NIXL agent, the consumer READs it into its own memory:
NixlOffers / NixlReader, UCX) and `nixl-write` (the consumer asks by a NIXL notification, the encoder WRITEs into
the buffer the consumer registered at start: NixlWriteReceiver). All are what the workers run, minus the
request plane.

    python bench/embedding_transfer_bench.py                  # ~1 min
    python bench/embedding_transfer_bench.py --repeat 50 --json out.json

Per size, --repeat hand-offs of distinct tensors, each timed in the consumer from receiving the hand-off to
having the tensor (nixl-read: the remote agent's metadata loaded, memory registered, the READ done and the
notification sent; nixl-write: the request sent, the WRITE done by the encoder's serving loop, its notification
seen, the tensor copied out of the buffer; local: the file read, from the page cache as on one host), after
--warmup untimed ones. The
encoder side's cost is timed too: writing the file (what the connector does anyway) and, for NIXL, loading it
and registering it (what an encoder offering NIXL reads adds). Also the hand-off's size on the request plane
(the NIXL agent metadata and descriptors). Each process pinned to its own core.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import _common
import msgspec

# (label, tokens per image, hidden size, dtype): the tests' tiny BLIP-2, then the sizes of common models' images
SIZES = [("tiny BLIP-2 (16 x 128 fp32)", 16, 128, "float32"),
         ("LLaVA-1.5-7B (576 x 4096 bf16)", 576, 4096, "bfloat16"),
         ("Qwen2.5-VL-7B 1024x1024 (1369 x 3584 bf16)", 1369, 3584, "bfloat16"),
         ("Llama-3.2-90B-V tile set (6404 x 8192 bf16)", 6404, 8192, "bfloat16")]


def _encoder(conn: Any, folder: str, core: int) -> None:
    """The encoder's side: per request, a new tensor written as the connector would, then offered by NIXL twice
    (once to be read, once to be written: an offer goes once), with the offers served in an event loop."""
    import asyncio

    import torch
    from safetensors.torch import save_file

    from tandem.vllm.embedding_transfer import NixlOffers, load_stored

    os.sched_setaffinity(0, {core})

    async def serve() -> None:
        offers = NixlOffers()
        offers.start()
        loop = asyncio.get_running_loop()
        while (job := await loop.run_in_executor(None, conn.recv)) is not None:
            n, tokens, hidden, dtype = job
            tensor = torch.full((tokens, hidden), float(n % 97), dtype=getattr(torch, dtype))
            path = os.path.join(folder, f"{n}.safetensors")
            t0 = time.perf_counter()
            save_file({"ec_cache": tensor}, path)
            t1 = time.perf_counter()
            to_read = offers.offer(load_stored(path))
            t2 = time.perf_counter()
            to_write = offers.offer(load_stored(path), to_write=True)
            conn.send((path, msgspec.msgpack.encode(to_read), msgspec.msgpack.encode(to_write), t1 - t0, t2 - t1))
        await offers.stop()

    asyncio.run(serve())


def _consumer(conn: Any, core: int) -> None:
    """The consumer's side: each hand-off taken the three ways, timed."""
    import asyncio

    import torch

    from tandem.vllm.embedding_transfer import NixlReader, NixlWriteReceiver, load_stored
    from tandem.worker.encoders import NixlTensor

    os.sched_setaffinity(0, {core})
    reader, writes = NixlReader(), NixlWriteReceiver()
    while (job := conn.recv()) is not None:
        path, to_read, to_write, expect = job
        t0 = time.perf_counter()
        by_file = load_stored(path)
        t1 = time.perf_counter()
        by_read = asyncio.run(reader.receive(msgspec.msgpack.decode(to_read, type=NixlTensor)))
        t2 = time.perf_counter()
        by_write = asyncio.run(writes.receive(msgspec.msgpack.decode(to_write, type=NixlTensor)))
        t3 = time.perf_counter()
        ok = torch.equal(by_file, by_read) and torch.equal(by_file, by_write) and float(by_read[0, 0]) == expect
        conn.send((t1 - t0, t2 - t1, t3 - t2, ok))


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    folder = tempfile.mkdtemp(prefix="embxfer-")
    ctx = mp.get_context("spawn")
    enc_parent, enc_child = ctx.Pipe()
    con_parent, con_child = ctx.Pipe()
    encoder = ctx.Process(target=_encoder, args=(enc_child, folder, 0), daemon=True)
    consumer = ctx.Process(target=_consumer, args=(con_child, 1 if (os.cpu_count() or 1) > 1 else 0), daemon=True)
    encoder.start()
    consumer.start()
    results = []
    n = 0
    try:
        for label, tokens, hidden, dtype in SIZES:
            if args.sizes and label.split(" (")[0] not in args.sizes:
                continue
            times: dict[str, list[float]] = {"local": [], "nixl": [], "nixl_write": [], "write": [], "offer": []}
            handoff_bytes = 0
            for i in range(args.warmup + args.repeat):
                n += 1
                enc_parent.send((n, tokens, hidden, dtype))
                path, handoff, to_write, write_s, offer_s = enc_parent.recv()
                con_parent.send((path, handoff, to_write, float(n % 97)))
                local_s, nixl_s, nixl_write_s, ok = con_parent.recv()
                if not ok:
                    raise SystemExit(f"{label}: a tensor handed over by NIXL differs from the file's")
                os.unlink(path)
                if i >= args.warmup:
                    for name, value in (("local", local_s), ("nixl", nixl_s), ("nixl_write", nixl_write_s),
                                        ("write", write_s), ("offer", offer_s)):
                        times[name].append(value * 1000)
                    handoff_bytes = len(handoff)
            mb = tokens * hidden * (4 if dtype == "float32" else 2) / 1e6
            row = {"size": label, "mb": mb, "handoff_bytes": handoff_bytes,
                   **{f"{name}_p50_ms": statistics.median(v) for name, v in times.items()},
                   **{f"{name}_p90_ms": sorted(v)[int(0.9 * (len(v) - 1))] for name, v in times.items()}}
            results.append(row)
            print(f"  {label}: local {row['local_p50_ms']:.2f} ms, nixl-read {row['nixl_p50_ms']:.2f} ms, "
                  f"nixl-write {row['nixl_write_p50_ms']:.2f} ms", file=sys.stderr, flush=True)
    finally:
        for pipe in (enc_parent, con_parent):
            pipe.send(None)
        encoder.join(30)
        consumer.join(30)
        for path in os.listdir(folder):
            os.unlink(os.path.join(folder, path))
        os.rmdir(folder)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=30, help="timed hand-offs per size")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sizes", nargs="*", default=None, help="only these sizes (the label before its shape)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH")
    args = parser.parse_args()
    rows = run(args)
    print(f"\nembedding_transfer_bench: one image's encoder output, encoder process on core 0, consumer on core 1, "
          f"{args.repeat} hand-offs per size (after {args.warmup}), p50 (p90) ms\n")
    print("| size | MB | consumer: local (file) | consumer: nixl-read | consumer: nixl-write | read / local | "
          "write / local | encoder: write file | encoder: load + register (nixl) | hand-off bytes (nixl) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['mb']:.2f} | {r['local_p50_ms']:.2f} ({r['local_p90_ms']:.2f}) | "
              f"{r['nixl_p50_ms']:.2f} ({r['nixl_p90_ms']:.2f}) | "
              f"{r['nixl_write_p50_ms']:.2f} ({r['nixl_write_p90_ms']:.2f}) | "
              f"{r['nixl_p50_ms'] / r['local_p50_ms']:.2f}x | {r['nixl_write_p50_ms'] / r['local_p50_ms']:.2f}x | "
              f"{r['write_p50_ms']:.2f} | {r['offer_p50_ms']:.2f} | {r['handoff_bytes']} |")
    _common.write_json(args.json, {"rows": rows, "repeat": args.repeat})


if __name__ == "__main__":
    main()
