"""How an encoder's outputs reach a consumer that takes them as embeddings (--embedding-transfer-mode): by the
file the encoder's connector wrote (`local`: a filesystem both see), or by NIXL with no shared filesystem (UCX
moves the bytes, over RDMA where there is some, shared memory or TCP otherwise): the consumer READs the tensor
from the encoder's memory (`nixl-read`), or asks the encoder to WRITE it into a buffer the consumer registered
once at start (`nixl-write`: no memory registration per image on the consumer, where RDMA makes it costly).

The encoder offers each output the same way for both (`NixlOffers`) and keeps it registered until it is read
(the reader's notification says so), written, or `OFFER_TTL_S` has passed (a consumer that died never asks)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import msgspec

from tandem.worker.encoders import NIXL_READ_ANNOTATION, NIXL_WRITE_ANNOTATION, NixlTensor

log = logging.getLogger(__name__)

OFFER_TTL_S = 120.0  # an offered tensor nobody read or asked for by then is let go
WRITE_TIMEOUT_S = 10.0  # a write asked for that has not landed by then is given up (the encoder may be gone)
# The consumer's buffer for writes; a larger output (or one finding it full) gets memory registered for itself.
WRITE_BUFFER_BYTES = 128 << 20
# A transfer's end (or a write's notification) is looked for at once, then every _POLL_S: never in a tighter
# loop, whose NIXL calls would keep the agent's UCX progress thread from sending and receiving (a write request
# then reached its encoder only once the consumer gave up waiting). 1 ms is also the finest sleep uvloop does:
# shorter ones return at once.
_POLL_S = 0.001
# How often an encoder looks for write requests and finished transfers: every _POLL_S for _SERVE_BUSY_S after an
# offer to be written, a notification or a write, then less and less often while nothing happens (readers need
# no answer: their notifications only let offers go).
_SERVE_POLL_S = (_POLL_S, 0.02)
_SERVE_BUSY_S = 0.05
_ALIGN = 64
FAILED = b"failed:"  # an encoder's notification, before a write's tag, that the write will not happen


class WriteRequest(msgspec.Struct, array_like=True):
    """A consumer's NIXL notification asking an encoder to write an offered tensor into the consumer's memory."""

    offer: bytes  # the offer's key (NixlTensor.done)
    agent: str  # the consumer's agent name
    metadata: bytes  # the consumer agent's metadata when the encoder may not have it (new, or memory added); else b""
    descs: bytes  # the serialized descriptor of the memory to write into
    tag: bytes  # the notification the write carries, by which the consumer knows it landed


def load_stored(path: str) -> Any:
    """The one (tokens x hidden) tensor of an encoder-cache connector's file; OSError or ValueError when it
    cannot be read or holds something else."""
    from safetensors.torch import load_file

    stored = load_file(path)
    if len(stored) != 1:
        raise ValueError(f"{path} holds {len(stored)} tensors, not one")
    tensor = next(iter(stored.values()))
    if tensor.dim() != 2:
        raise ValueError(f"{path} holds a tensor of shape {tuple(tensor.shape)}, not tokens x hidden")
    return tensor


def _nixl_agent(role: str) -> Any:
    """A NIXL agent with the UCX backend, loaded as vLLM loads it; with tandem's poll timeout for its progress
    thread on CPU hosts (see nixl_cpu.py). RuntimeError when NIXL is not installed."""
    from vllm.distributed import nixl_utils

    from tandem.vllm.nixl_cpu import install_progress_delay

    if not install_progress_delay():
        raise RuntimeError("--embedding-transfer-mode nixl-read and nixl-write need NIXL, which is not installed")
    return nixl_utils.NixlWrapper(f"tandem-{role}-{uuid.uuid4().hex[:12]}",
                                  nixl_utils.nixl_agent_config(backends=["UCX"]))


class NixlOffers:
    """An encoder's outputs offered by NIXL: each stays registered (and alive) until read (the reader's
    notification), written into the memory a consumer's `WriteRequest` names, or OFFER_TTL_S."""

    def __init__(self) -> None:
        self.agent = _nixl_agent("encoder")
        self._held: dict[bytes, tuple[Any, Any, float]] = {}  # offer key -> (tensor, registration, expiry)
        self._writing: dict[bytes, tuple[Any, str, bytes]] = {}  # offer key -> (transfer, consumer, tag)
        self._offered = asyncio.Event()
        self._serving: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Serve write requests and let go of finished offers while there are some."""
        self._serving = asyncio.create_task(self._serve())

    async def stop(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving

    async def _serve(self) -> None:
        fastest, slowest = _SERVE_POLL_S
        pause = fastest
        busy_until = 0.0
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._offered.wait(), pause)
            busy = self._offered.is_set() or bool(self._writing)
            self._offered.clear()
            try:
                busy = self.serve_once() or busy
            except Exception:  # NIXL's errors derive from Exception only; the next round may do better
                log.exception("serving NIXL offers failed")
            now = time.monotonic()
            if busy:
                busy_until = now + _SERVE_BUSY_S
            pause = fastest if now < busy_until else min(pause * 2, slowest)

    def offer(self, tensor: Any, to_write: bool = False) -> NixlTensor:
        """The tensor offered; `to_write`: its consumer will ask for it to be written (so look out for that)."""
        tensor = tensor.contiguous()
        registration = self.agent.register_memory(tensor)
        key = uuid.uuid4().bytes
        self._held[key] = (tensor, registration, time.monotonic() + OFFER_TTL_S)
        if to_write:
            self._offered.set()
        descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs(tensor))
        dtype = str(tensor.dtype).removeprefix("torch.")
        # The agent's metadata as of now: it carries the keys of the memory just registered.
        return NixlTensor(self.agent.name, self.agent.get_agent_metadata(), descs, list(tensor.shape), dtype, key)

    def serve_once(self) -> bool:
        """Start the writes consumers asked for; let go of the tensors read, written, or not asked for in time.
        True when a notification came."""
        notified = False
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                notified = True
                if message in self._held:
                    self._let_go(message)  # a reader's: it is done
                else:
                    self._start_write(message)
        for key, (transfer, consumer, tag) in list(self._writing.items()):
            state = self.agent.check_xfer_state(transfer)
            if state in ("DONE", "ERR"):
                self.agent.release_xfer_handle(transfer)
                del self._writing[key]
                self._let_go(key)
                if state == "ERR":
                    self._refuse(consumer, tag, "the transfer ended in error")
        now = time.monotonic()
        for key in [key for key, (_, _, expiry) in self._held.items() if expiry < now and key not in self._writing]:
            self._let_go(key)
        return notified

    def _start_write(self, message: bytes) -> None:
        try:
            asked = msgspec.msgpack.decode(message, type=WriteRequest)
        except msgspec.DecodeError:
            log.debug("a NIXL notification naming no offer held (a late reader's?): ignored")
            return
        if asked.metadata:
            self.agent.add_remote_agent(asked.metadata)
        held = self._held.get(asked.offer)
        if held is None or asked.offer in self._writing:
            self._refuse(asked.agent, asked.tag, "no such offer (expired, or asked for twice)")
            return
        try:
            transfer = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(held[0]),
                                                  self.agent.deserialize_descs(asked.descs), asked.agent, asked.tag)
            self.agent.transfer(transfer)
        except Exception as e:  # NIXL's own errors (remote unknown, descriptors not registered there, ...)
            self._refuse(asked.agent, asked.tag, f"{type(e).__name__}: {e}")
            return
        self._writing[asked.offer] = (transfer, asked.agent, asked.tag)

    def _refuse(self, consumer: str, tag: bytes, why: str) -> None:
        log.warning("a NIXL write to %s does not happen: %s", consumer, why)
        with contextlib.suppress(Exception):  # a consumer this agent does not know waits until its timeout
            self.agent.send_notif(consumer, FAILED + tag)

    def _let_go(self, key: bytes) -> None:
        _, registration, _ = self._held.pop(key)
        self.agent.deregister_memory(registration)

    @property
    def held(self) -> int:
        return len(self._held)


async def _until_done(agent: Any, transfer: Any) -> str:
    """The transfer's final state, DONE or ERR."""
    state = agent.transfer(transfer)
    while state not in ("DONE", "ERR"):
        await asyncio.sleep(_POLL_S)
        state = agent.check_xfer_state(transfer)
    return state


class NixlReader:
    """A consumer's NIXL agent, reading the tensors encoders offer (nixl-read)."""

    annotation = NIXL_READ_ANNOTATION  # how its consumer asks encoders for their outputs

    def __init__(self) -> None:
        self.agent = _nixl_agent("consumer")

    async def receive(self, offered: NixlTensor) -> Any:
        """The offered tensor, copied into this process; RuntimeError when it cannot be read."""
        try:
            return await self._read(offered)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # NIXL's own errors (not found, remote gone, ...) derive from Exception only
            raise RuntimeError(f"the NIXL read from {offered.agent} failed: {type(e).__name__}: {e}") from e

    async def _read(self, offered: NixlTensor) -> Any:
        import torch

        # Loaded for each read: the holder's metadata names the memory it registered since the last one.
        self.agent.add_remote_agent(offered.metadata)
        tensor = torch.empty(offered.shape, dtype=getattr(torch, offered.dtype))
        registration = self.agent.register_memory(tensor)
        try:
            transfer = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(tensor),
                                                  self.agent.deserialize_descs(offered.descs), offered.agent,
                                                  offered.done)
            try:
                state = await _until_done(self.agent, transfer)
            finally:
                self.agent.release_xfer_handle(transfer)
        finally:
            self.agent.deregister_memory(registration)
        if state == "ERR":
            raise RuntimeError("the transfer ended in error")
        return tensor


class _Refused(RuntimeError):
    """An encoder's word that a write will not happen."""


class _Buffer:
    """First fit over one registered byte buffer: the spans writes land in."""

    def __init__(self, size: int) -> None:
        self.free: list[tuple[int, int]] = [(0, size)]  # (start, length), by start

    def take(self, length: int) -> int | None:
        length = -(-length // _ALIGN) * _ALIGN
        for i, (start, free) in enumerate(self.free):
            if free >= length:
                self.free[i:i + 1] = [(start + length, free - length)] if free > length else []
                return start
        return None

    def give_back(self, start: int, length: int) -> None:
        length = -(-length // _ALIGN) * _ALIGN
        spans = sorted([*self.free, (start, length)])
        merged = [spans[0]]
        for span_start, span_length in spans[1:]:
            last_start, last_length = merged[-1]
            if last_start + last_length == span_start:
                merged[-1] = (last_start, last_length + span_length)
            else:
                merged.append((span_start, span_length))
        self.free = merged


class NixlWriteReceiver:
    """A consumer's NIXL agent with a buffer registered once, into which encoders write the tensors they offer
    (nixl-write): the consumer names a span of it in a `WriteRequest` notification, the encoder WRITEs with a
    notification of its own, and the tensor is copied out so the span serves the next image."""

    annotation = NIXL_WRITE_ANNOTATION  # how its consumer asks encoders for their outputs

    def __init__(self, buffer_bytes: int = WRITE_BUFFER_BYTES, timeout_s: float = WRITE_TIMEOUT_S) -> None:
        import torch

        self.agent = _nixl_agent("consumer")
        self._buffer = torch.empty(buffer_bytes, dtype=torch.uint8)
        self._registration = self.agent.register_memory(self._buffer)
        self._spans = _Buffer(buffer_bytes)
        self.timeout_s = timeout_s
        self._met: set[str] = set()  # encoders' agents loaded (and given this agent's metadata)
        self._arrived: set[bytes] = set()  # notifications received and not yet claimed
        # Memory of writes given up on, by tag: not reused until they land (or their encoder says they will not)
        self._abandoned: dict[bytes, tuple[Any, Any]] = {}

    async def receive(self, offered: NixlTensor) -> Any:
        """The offered tensor, written here by its encoder and copied out; RuntimeError when it is not."""
        try:
            return await self._receive(offered)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # NIXL's own errors derive from Exception only
            raise RuntimeError(f"the NIXL write from {offered.agent} failed: {type(e).__name__}: {e}") from e

    async def _receive(self, offered: NixlTensor) -> Any:
        import torch

        dtype = getattr(torch, offered.dtype)
        length = torch.Size(offered.shape).numel() * dtype.itemsize
        start = self._spans.take(length)
        registration = None
        if start is None:  # memory of its own, which the encoder learns of from this agent's metadata
            target = torch.empty(length, dtype=torch.uint8)
            registration = self.agent.register_memory(target)
        else:
            target = self._buffer[start:start + length]
        new = offered.agent not in self._met
        if new:
            self.agent.add_remote_agent(offered.metadata)
            self._met.add(offered.agent)
        tag = uuid.uuid4().bytes
        asked = WriteRequest(offered.done, self.agent.name,
                             self.agent.get_agent_metadata() if new or registration is not None else b"",
                             self.agent.get_serialized_descs(self.agent.get_xfer_descs(target)), tag)
        held = (start, length) if registration is None else (target, registration)
        try:
            self.agent.send_notif(offered.agent, msgspec.msgpack.encode(asked))
        except Exception:
            self._let_go(held)  # the encoder was never asked
            raise
        try:
            await self._landed(tag)
        except _Refused:
            self._let_go(held)
            raise
        except BaseException:  # given up (timed out, cancelled): a write may still land there
            self._abandoned[tag] = held
            raise
        tensor = target.view(dtype).view(offered.shape).clone()
        self._let_go(held)
        return tensor

    async def _landed(self, tag: bytes) -> None:
        """Returns once the write tagged `tag` landed; _Refused when its encoder says it will not, RuntimeError
        when it has not landed in time."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._collect()
            if tag in self._arrived:
                self._arrived.discard(tag)
                return
            if FAILED + tag in self._arrived:
                self._arrived.discard(FAILED + tag)
                raise _Refused("the encoder could not write it")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no write landed within {self.timeout_s:g} s")
            await asyncio.sleep(_POLL_S)

    def _collect(self) -> None:
        for messages in self.agent.get_new_notifs().values():
            for message in messages:
                late = self._abandoned.pop(message.removeprefix(FAILED), None)
                if late is None:
                    self._arrived.add(message)
                else:
                    self._let_go(late)

    @property
    def free_bytes(self) -> int:
        """The buffer's bytes no write is bound to land in."""
        return sum(length for _, length in self._spans.free)

    def _let_go(self, held: tuple[Any, Any]) -> None:
        first, second = held
        if isinstance(first, int):
            self._spans.give_back(first, second)
        else:
            self.agent.deregister_memory(second)
