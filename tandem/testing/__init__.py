"""Deterministic engines for tests and benchmarks (no GPU, no vLLM)."""
