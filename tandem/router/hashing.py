"""Block hashing for KV-aware routing (Dynamo `lib/kv-router` semantics, bit-exact).

* Local block hash ("tokens_hash"): the token sequence is cut into consecutive full blocks of
  `block_size` tokens (a partial tail is ignored); each block's bytes are the little-endian u32 of
  its tokens (followed, for multimodal blocks, by the block's sorted mm hashes as little-endian
  u64); hash = `xxh3_64(bytes, seed)`. The seed is `XXH3_SEED` (1337) mixed with the request's
  identity (`request_seed`: LoRA name, cache salt).
* Sequence hash (position-aware): `seq[0] = local[0]`,
  `seq[i] = xxh3_64(LE_u64(seq[i-1]) || LE_u64(local[i]), 1337)`.

Workers compute local hashes for the blocks vLLM reports stored; routers compute them for
incoming requests; both must agree, so this module is the single implementation.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import xxhash

if TYPE_CHECKING:
    from tandem.llm.model_card import ImagePrompt

XXH3_SEED = 1337
U64_MASK = (1 << 64) - 1

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
# array('I') is the fast path from a list of ints to packed u32 (~4x faster than struct.pack);
# it needs 4-byte items, and a byte swap on big-endian hosts.
_ARRAY_U32 = "I" if array("I").itemsize == 4 else ("L" if array("L").itemsize == 4 else None)
_BIG_ENDIAN = sys.byteorder == "big"


def request_seed(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The hash seed for a request: 1337, plus `xxh3_64(lora_name, seed 0)` and
    `xxh3_64(cache_salt, seed 1)` when those are non-empty (wrapping u64 adds)."""
    seed = XXH3_SEED
    if lora_name:
        seed = (seed + _xxh3(lora_name.encode(), 0)) & U64_MASK
    if cache_salt:
        seed = (seed + _xxh3(cache_salt.encode(), 1)) & U64_MASK
    return seed


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian u32 bytes of `tokens` (OverflowError if a token is not a u32)."""
    if isinstance(tokens, array) and tokens.itemsize == 4 and tokens.typecode in "IL" and not _BIG_ENDIAN:
        return tokens.tobytes()
    astype = getattr(tokens, "astype", None)
    if astype is not None:  # numpy array
        return bytes(astype("<u4", copy=False).tobytes())
    if _ARRAY_U32 is not None:
        packed = array(_ARRAY_U32, tokens)
        if _BIG_ENDIAN:
            packed.byteswap()
        return packed.tobytes()
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as e:
        raise OverflowError(str(e)) from None


def local_block_hashes(
    tokens: Sequence[int],
    block_size: int,
    seed: int = XXH3_SEED,
    *,
    mm_hashes: Sequence[Sequence[int] | None] | None = None,
) -> list[int]:
    """Local hash of every full block of `tokens` (the partial tail is ignored).

    `mm_hashes`, if given, holds per block the multimodal item hashes (u64) overlapping that
    block; they are sorted and appended to the block's bytes as little-endian u64.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(tokens) // block_size
    if n_blocks == 0:
        return []
    data = tokens_to_bytes(tokens[: n_blocks * block_size] if len(tokens) != n_blocks * block_size else tokens)
    step = block_size * 4
    xxh3 = _xxh3
    if not mm_hashes or not any(mm_hashes):
        return [xxh3(data[i : i + step], seed) for i in range(0, n_blocks * step, step)]
    out = []
    for n in range(n_blocks):
        chunk = data[n * step : (n + 1) * step]
        extra = mm_hashes[n] if n < len(mm_hashes) else None
        if extra:
            values = sorted(h & U64_MASK for h in extra)
            chunk += struct.pack(f"<{len(values)}Q", *values)
        out.append(xxh3(chunk, seed))
    return out


class MediaSpan(NamedTuple):
    """Where one image (or other media item) sits in the expanded prompt, and its content hash (u64)."""

    offset: int
    length: int
    hash: int


def media_block_hashes(spans: Sequence[MediaSpan], n_blocks: int, block_size: int) -> list[list[int] | None]:
    """Per block, the hashes of the media items whose span overlaps it (what the engine's KV events carry
    for those blocks, so `local_block_hashes(..., mm_hashes=...)` gives the same hashes on both sides)."""
    out: list[list[int] | None] = [None] * n_blocks
    for span in spans:
        if span.length <= 0:
            continue
        first = span.offset // block_size
        last = min((span.offset + span.length - 1) // block_size, n_blocks - 1)
        for n in range(first, last + 1):
            out[n] = [*(out[n] or ()), span.hash]
    return out


def expand_placeholders(token_ids: list[int], image_token_id: int, prompt: ImagePrompt,
                        hashes: list[int]) -> tuple[list[int], list[MediaSpan]]:
    """`token_ids` with each `image_token_id` replaced by the image prompt's tokens, and each image's span
    there with its hash (`hashes`, one per placeholder, in order)."""
    out: list[int] = []
    spans: list[MediaSpan] = []
    start = 0
    for image_hash in hashes:
        at = token_ids.index(image_token_id, start)
        out += token_ids[start:at]
        spans.append(MediaSpan(len(out) + prompt.offset, prompt.length, image_hash))
        out += prompt.tokens
        start = at + 1
    out += token_ids[start:]
    return out, spans


def digest_hash(digest: str) -> int:
    """A media item's content hash as a u64: its hex digest's first 16 digits (the engine's events name items
    by the digest they were given)."""
    return int(digest[:16], 16)


def sequence_hashes(local: Sequence[int]) -> list[int]:
    """Position-aware hashes: each block's hash chains the previous block's sequence hash."""
    if not local:
        return []
    xxh3, pack = _xxh3, _pack_pair
    prev = local[0]
    out = [prev]
    append = out.append
    for h in local[1:]:
        prev = xxh3(pack(prev, h), XXH3_SEED)
        append(prev)
    return out


def block_hashes(
    tokens: Sequence[int], block_size: int, lora_name: str | None = None, cache_salt: str | None = None
) -> tuple[list[int], list[int]]:
    """`(local, sequence)` hashes of a request's full blocks, with the request-identity seed."""
    local = local_block_hashes(tokens, block_size, request_seed(lora_name, cache_salt))
    return local, sequence_hashes(local)
