"""How an encoder's outputs reach a consumer that takes them as embeddings (--embedding-transfer-mode): by the
file the encoder's connector wrote (`local`: a filesystem both see), or by a NIXL READ from the encoder's memory
(`nixl-read`: no shared filesystem; UCX moves the bytes, over RDMA where there is some, shared memory or TCP
otherwise). The encoder keeps a tensor it offered registered until the reader's notification says it is done,
or `OFFER_TTL_S` has passed (a reader that died never says so)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

from tandem.worker.encoders import NixlTensor

log = logging.getLogger(__name__)

OFFER_TTL_S = 120.0  # an offered tensor nobody read by then is let go
# A READ between processes of one host takes tens of microseconds: its state is checked without yielding for
# this long first, then between sleeps of _POLL_S (a longer one, across hosts, lets the event loop run).
_SPIN_S = 0.0002
_POLL_S = 0.0005


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
        raise RuntimeError("--embedding-transfer-mode nixl-read needs NIXL, which is not installed")
    return nixl_utils.NixlWrapper(f"tandem-{role}-{uuid.uuid4().hex[:12]}",
                                  nixl_utils.nixl_agent_config(backends=["UCX"]))


class NixlOffers:
    """An encoder's outputs offered for NIXL reads: each stays registered (and alive) until its reader's
    notification, or OFFER_TTL_S."""

    def __init__(self) -> None:
        self.agent = _nixl_agent("encoder")
        self._held: dict[bytes, tuple[Any, Any, float]] = {}  # done message -> (tensor, registration, expiry)
        self._releases: asyncio.Task[None] | None = None

    def start(self, every_s: float = 1.0) -> None:
        """Let go of read (or expired) tensors every `every_s`, not only when the next one is offered."""
        self._releases = asyncio.create_task(self._release_every(every_s))

    async def stop(self) -> None:
        if self._releases is not None:
            self._releases.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._releases

    async def _release_every(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            self.release_done()

    def offer(self, tensor: Any) -> NixlTensor:
        self.release_done()
        tensor = tensor.contiguous()
        registration = self.agent.register_memory(tensor)
        done = uuid.uuid4().bytes
        self._held[done] = (tensor, registration, time.monotonic() + OFFER_TTL_S)
        descs = self.agent.get_serialized_descs(self.agent.get_xfer_descs(tensor))
        dtype = str(tensor.dtype).removeprefix("torch.")
        # The agent's metadata as of now: it carries the keys of the memory just registered.
        return NixlTensor(self.agent.name, self.agent.get_agent_metadata(), descs, list(tensor.shape), dtype, done)

    def release_done(self) -> None:
        """Let go of the tensors read (their readers said so) or not read in time."""
        finished = {message for messages in self.agent.get_new_notifs().values() for message in messages}
        now = time.monotonic()
        for done in [key for key, (_, _, expiry) in self._held.items() if key in finished or expiry < now]:
            _, registration, _ = self._held.pop(done)
            self.agent.deregister_memory(registration)

    @property
    def held(self) -> int:
        return len(self._held)


class NixlReader:
    """A consumer's NIXL agent, reading the tensors encoders offer."""

    def __init__(self) -> None:
        self.agent = _nixl_agent("consumer")

    async def read(self, offered: NixlTensor) -> Any:
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
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(tensor),
                                                self.agent.deserialize_descs(offered.descs), offered.agent,
                                                offered.done)
            try:
                state = self.agent.transfer(handle)
                spin_until = time.perf_counter() + _SPIN_S
                while state not in ("DONE", "ERR") and time.perf_counter() < spin_until:
                    state = self.agent.check_xfer_state(handle)
                while state not in ("DONE", "ERR"):
                    await asyncio.sleep(_POLL_S)
                    state = self.agent.check_xfer_state(handle)
            finally:
                self.agent.release_xfer_handle(handle)
        finally:
            self.agent.deregister_memory(registration)
        if state == "ERR":
            raise RuntimeError("the transfer ended in error")
        return tensor
