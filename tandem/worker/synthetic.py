"""What the engines without a model (the mocker, the deterministic test engine) make up the same way, so that
a test or a benchmark can compute the answer it expects: embedding vectors."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def synthetic_embedding(token_ids: Sequence[int], size: int, dimensions: int | None = None) -> list[float]:
    """A deterministic unit vector for an input: pseudo-random, seeded by its token ids (the same input
    gets the same vector anywhere), cut to `dimensions` and normalized again when asked (matryoshka)."""
    rng = random.Random(hash(tuple(token_ids)))  # a tuple of ints hashes the same in every process
    vector = [rng.gauss(0.0, 1.0) for _ in range(dimensions or size)]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]
