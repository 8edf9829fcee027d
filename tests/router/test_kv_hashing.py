"""Router block hashing (Dynamo's) against a naive reference and hand-computed values."""

from __future__ import annotations

import struct
from array import array

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.router.hashing import (
    XXH3_SEED,
    block_hashes,
    local_block_hashes,
    request_seed,
    sequence_hashes,
    tokens_to_bytes,
)

U32 = st.integers(min_value=0, max_value=2**32 - 1)
NAMES = st.one_of(st.none(), st.just(""), st.text(max_size=20))


def ref_seed(lora: str | None, salt: str | None) -> int:
    seed = 1337
    if lora:
        seed += xxhash.xxh3_64(lora.encode("utf-8"), seed=0).intdigest()
    if salt:
        seed += xxhash.xxh3_64(salt.encode("utf-8"), seed=1).intdigest()
    return seed % 2**64


def ref_local(tokens: list[int], block_size: int, seed: int, mm: list[list[int] | None] | None = None) -> list[int]:
    out = []
    for n in range(len(tokens) // block_size):
        data = b"".join(struct.pack("<I", t) for t in tokens[n * block_size : (n + 1) * block_size])
        extra = mm[n] if mm and n < len(mm) else None
        if extra:
            data += b"".join(struct.pack("<Q", h) for h in sorted(extra))
        out.append(xxhash.xxh3_64(data, seed=seed).intdigest())
    return out


def ref_sequence(local: list[int]) -> list[int]:
    out: list[int] = []
    for i, h in enumerate(local):
        out.append(h if i == 0 else xxhash.xxh3_64(struct.pack("<Q", out[-1]) + struct.pack("<Q", h), seed=1337).intdigest())
    return out


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(U32, max_size=300), block_size=st.integers(1, 64), lora=NAMES, salt=NAMES)
def test_matches_reference(tokens: list[int], block_size: int, lora: str | None, salt: str | None) -> None:
    seed = request_seed(lora, salt)
    assert seed == ref_seed(lora, salt)
    local = local_block_hashes(tokens, block_size, seed)
    assert local == ref_local(tokens, block_size, seed)
    assert len(local) == len(tokens) // block_size
    assert sequence_hashes(local) == ref_sequence(local)
    assert block_hashes(tokens, block_size, lora, salt) == (local, ref_sequence(local))


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(U32, min_size=1, max_size=100),
    block_size=st.integers(1, 16),
    mm=st.lists(st.one_of(st.none(), st.lists(st.integers(0, 2**64 - 1), max_size=3)), max_size=10),
)
def test_multimodal_blocks_match_reference(tokens: list[int], block_size: int, mm: list[list[int] | None]) -> None:
    assert local_block_hashes(tokens, block_size, mm_hashes=mm) == ref_local(tokens, block_size, XXH3_SEED, mm)


def test_hand_computed_values() -> None:
    # xxh3_64(LE u32 [1, 2], 1337) and xxh3_64(LE u32 [3, 4], 1337); token 5 is a partial block.
    local = local_block_hashes([1, 2, 3, 4, 5], 2)
    assert local == [10773075109927122010, 2662118915037317746]
    # seq[1] = xxh3_64(LE u64 seq[0] || LE u64 local[1], 1337)
    assert sequence_hashes(local) == [10773075109927122010, 5890102321129957602]
    # 1337 + xxh3_64(b"my-lora", 0) + xxh3_64(b"salt", 1)
    assert request_seed("my-lora", "salt") == 1337 + 12827409268353071524 + 4028552866779080445
    assert request_seed() == request_seed("", "") == XXH3_SEED == 1337


def test_seed_addition_wraps_to_u64() -> None:
    # find a pair of names whose hashes overflow when added, then check the wrap
    lora = next(f"lora-{i}" for i in range(1000) if xxhash.xxh3_64(f"lora-{i}".encode()).intdigest() > 2**63)
    salt = next(f"salt-{i}" for i in range(1000) if xxhash.xxh3_64(f"salt-{i}".encode(), seed=1).intdigest() > 2**63)
    seed = request_seed(lora, salt)
    assert seed == ref_seed(lora, salt) < 2**64
    assert 1337 + xxhash.xxh3_64(lora.encode()).intdigest() + xxhash.xxh3_64(salt.encode(), seed=1).intdigest() >= 2**64


def test_lora_and_salt_change_every_block_hash() -> None:
    tokens = list(range(64))
    base = local_block_hashes(tokens, 16)
    with_lora = local_block_hashes(tokens, 16, request_seed("a"))
    assert all(a != b for a, b in zip(base, with_lora, strict=True))
    assert with_lora != local_block_hashes(tokens, 16, request_seed("b"))
    assert with_lora != local_block_hashes(tokens, 16, request_seed("a", "s"))


def test_input_types_and_edges() -> None:
    tokens = [7, 2**32 - 1, 0, 123456]
    expected = local_block_hashes(tokens, 2)
    assert local_block_hashes(tuple(tokens), 2) == expected
    assert local_block_hashes(array("I", tokens), 2) == expected
    import numpy as np
    assert local_block_hashes(np.array(tokens, dtype=np.int64), 2) == expected
    assert tokens_to_bytes(tokens) == struct.pack("<4I", *tokens)
    assert local_block_hashes([], 4) == [] and local_block_hashes([1, 2, 3], 4) == []
    assert sequence_hashes([]) == [] and sequence_hashes([5]) == [5]
    with pytest.raises(OverflowError):
        local_block_hashes([2**32], 1)
    with pytest.raises(ValueError):
        local_block_hashes([1], 0)


def test_hashing_cost_is_linear_in_the_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each token's bytes are hashed once, one xxh3 call per block, and one more per block to chain them:
    a long prompt costs in proportion to its length, however fast the machine."""
    import tandem.router.hashing as hashing

    calls: list[int] = []  # bytes hashed by each xxh3 call

    def counting(data: bytes, seed: int) -> int:
        calls.append(len(data))
        return xxhash.xxh3_64_intdigest(data, seed)

    monkeypatch.setattr(hashing, "_xxh3", counting)
    for tokens in (8192, 32768):
        calls.clear()
        local = local_block_hashes(list(range(tokens)), 32)
        assert calls == [32 * 4] * (tokens // 32)
        calls.clear()
        sequence_hashes(local)
        assert calls == [16] * (tokens // 32 - 1)  # the previous sequence hash and this block's, u64 each
