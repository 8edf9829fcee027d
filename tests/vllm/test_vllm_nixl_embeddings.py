"""Encoder outputs handed over by real NIXL (UCX) between two processes, as an encoder and its consumer do
(tandem/vllm/embedding_transfer.py) minus the request plane: the consumer READs an offered tensor
(nixl-read) or has the encoder WRITE it into the buffer the consumer registered once (nixl-write). The
workers' end-to-end use is in test_vllm_embedding_transfer.py."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

pytestmark = pytest.mark.slow

BUFFER = 1 << 16  # the consumer's write buffer: 64 KiB, so that a larger tensor gets memory of its own
TIMEOUT_S = 2.0


def source(n: int, shape: tuple[int, ...], dtype: str) -> Any:
    import torch

    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * 0.5 + n).to(
        getattr(torch, dtype))


def _encoder(conn: Any) -> None:
    """Offers a tensor per job, serving reads and write requests in its event loop meanwhile."""
    from tandem.vllm.embedding_transfer import NixlOffers

    async def serve() -> None:
        offers = NixlOffers()
        offers.start()
        loop = asyncio.get_running_loop()
        while (job := await loop.run_in_executor(None, conn.recv)) is not None:
            if job == "held":
                conn.send(offers.held)
            else:
                n, shape, dtype, to_write = job
                conn.send(msgspec.msgpack.encode(offers.offer(source(n, shape, dtype), to_write)))
        await offers.stop()

    run(serve())


def _consumer(conn: Any) -> None:
    """Receives an offered tensor per job, by a read or by a write; answers with it or the error's text."""
    from tandem.vllm.embedding_transfer import NixlReader, NixlWriteReceiver
    from tandem.worker.encoders import NixlTensor

    receivers = {"read": NixlReader(), "write": NixlWriteReceiver(BUFFER, TIMEOUT_S)}
    writes = receivers["write"]
    while (job := conn.recv()) is not None:
        if job == "free":
            conn.send(writes.free_bytes)  # type: ignore[union-attr]
            continue
        how, offered = job
        try:
            conn.send(run(receivers[how].receive(msgspec.msgpack.decode(offered, type=NixlTensor))))
        except RuntimeError as e:
            conn.send(str(e))


def run(receiving: Any) -> Any:
    """On uvloop, as the workers run (its sleeps are never shorter than 1 ms, asyncio's can be)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(receiving)
    return uvloop.run(receiving)


class Pair:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.encoder, encoder_end = ctx.Pipe()
        self.consumer, consumer_end = ctx.Pipe()
        self.processes = {"encoder": ctx.Process(target=_encoder, args=(encoder_end,), daemon=True),
                          "consumer": ctx.Process(target=_consumer, args=(consumer_end,), daemon=True)}
        for process in self.processes.values():
            process.start()

    def offer(self, n: int, shape: tuple[int, ...], dtype: str = "float32", to_write: bool = True) -> bytes:
        self.encoder.send((n, shape, dtype, to_write))
        assert self.encoder.poll(60), "the encoder did not offer"
        return self.encoder.recv()

    def receive(self, how: str, offered: bytes) -> Any:
        self.consumer.send((how, offered))
        assert self.consumer.poll(60), "the consumer did not answer"
        return self.consumer.recv()

    def ask(self, end: Any, what: str) -> Any:
        end.send(what)
        assert end.poll(30)
        return end.recv()

    def stop(self) -> None:
        for end in (self.encoder, self.consumer):
            try:
                end.send(None)
            except OSError:
                pass
        for process in self.processes.values():
            process.join(30)
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    pytest.importorskip("vllm.distributed.nixl_utils")
    pair = Pair()
    try:
        yield pair
    finally:
        pair.stop()


def test_read_and_written_tensors_equal_the_offered_ones_and_the_encoder_lets_them_go(pair: Pair) -> None:
    """Reads and writes of float32 and bfloat16 outputs of several sizes, one larger than the consumer's write
    buffer (written into memory registered for it), arrive equal to what the encoder offered, and so do 30 more
    one after another; the encoder then holds none of them and the consumer's buffer is all free again."""
    import torch

    jobs = [(1, (16, 128), "float32", "write"), (2, (16, 128), "float32", "read"), (3, (37, 64), "bfloat16", "write"),
            (4, (300, 256), "float32", "write"), (5, (300, 256), "float32", "read"), (6, (5, 7), "float32", "write")]
    for n, shape, dtype, how in jobs:
        got = pair.receive(how, pair.offer(n, shape, dtype, to_write=how == "write"))
        assert isinstance(got, torch.Tensor), got
        assert got.dtype == getattr(torch, dtype) and torch.equal(got, source(n, shape, dtype)), (n, how)
    # one after another, as a consumer's requests come: each lands long before the timeout
    for n in range(10, 40):
        how = "write" if n % 3 else "read"
        assert torch.equal(pair.receive(how, pair.offer(n, (16, 128), to_write=how == "write")),
                           source(n, (16, 128), "float32")), (n, how)
    for _ in range(100):
        if pair.ask(pair.encoder, "held") == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert pair.ask(pair.encoder, "held") == 0
    assert pair.ask(pair.consumer, "free") == BUFFER


def test_a_write_the_encoder_cannot_do_is_refused_at_once_and_frees_its_span(pair: Pair) -> None:
    """An offer written already is not written twice: the encoder says so and the consumer's span is free
    again (no timeout waited for)."""
    offered = pair.offer(7, (8, 8))
    assert pair.receive("write", offered).shape == (8, 8)
    refused = pair.receive("write", offered)
    assert isinstance(refused, str) and "could not write it" in refused
    assert pair.ask(pair.consumer, "free") == BUFFER


def test_a_write_not_landing_in_time_fails_and_its_span_waits_for_the_late_write(pair: Pair) -> None:
    """An encoder that does not answer (stopped): the consumer gives up after its timeout with a clear error and
    keeps the span out of use, since the write may still land there; once the encoder runs again and the late
    write lands, the span is free. An encoder gone is an error at once."""
    offered = pair.offer(8, (16, 16))
    encoder = pair.processes["encoder"]
    assert encoder.pid is not None
    os.kill(encoder.pid, signal.SIGSTOP)
    try:
        failed = pair.receive("write", offered)
    finally:
        os.kill(encoder.pid, signal.SIGCONT)
    assert isinstance(failed, str) and f"no write landed within {TIMEOUT_S:g} s" in failed
    assert pair.ask(pair.consumer, "free") == BUFFER - 16 * 16 * 4
    assert torch_equal(pair.receive("write", pair.offer(9, (4, 4))), source(9, (4, 4), "float32"))
    assert pair.ask(pair.consumer, "free") == BUFFER  # the late write landed, and was let go

    offered = pair.offer(10, (16, 16))
    encoder.kill()
    encoder.join(10)
    failed = pair.receive("write", offered)
    assert isinstance(failed, str) and "NIXL write from" in failed and "DISCONNECT" in failed
    assert pair.ask(pair.consumer, "free") == BUFFER


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return isinstance(a, torch.Tensor) and torch.equal(a, b)
