"""Policies of disaggregated serving in the frontend; `ModelPipeline` runs the flow.

A token request of a model with prefill workers goes to a prefill worker first (a copy with
`max_tokens` 1), then to a decode worker with the prefill's KV transfer parameters in
`prefill_result`. These functions decide the parts that are pure policy: whether conditional
disaggregation keeps a request on its decode worker, and how the decode stage is routed.
"""

from __future__ import annotations

from typing import Any

from tandem.router.config import KvRouterConfig

# `dynamo_frontend_remote_prefills_total{outcome}` values.
OK = "ok"  # the prefill worker computed the prompt; the decode worker pulled its KV
FALLBACK = "fallback"  # no prefill worker could take it, or the prefill failed: decoded with local prefill
ERROR = "error"  # the same under --enforce-disagg: the request failed with 503
SKIPPED_CONDITIONAL = "skipped_conditional"  # conditional disaggregation kept it on its decode worker
CANCELLED = "cancelled"  # the client went away during the prefill: no decode was started


def decode_stage_override(existing: dict[str, Any] | None, conditional: bool) -> dict[str, Any]:
    """The router override of a disaggregated request's decode stage: its prompt was computed elsewhere,
    so it loads the decode worker with no prefill and its blocks arrive fresh (no assumed reuse). Plain
    disaggregation also routes decode by load alone (no credit on any tier); under conditional
    disaggregation decode workers publish KV events and the transferred prefix may already be there."""
    override = {**(existing or {}), "assume_kv_reuse": False, "track_prefill_tokens": False}
    if not conditional:
        override.update(overlap_score_credit=0.0, host_cache_hit_weight=0.0, disk_cache_hit_weight=0.0)
    return override


def bypass_remote_prefill(prompt_tokens: int, cached_tokens: int, config: KvRouterConfig) -> bool:
    """Dynamo's `isl_bounding` policy: prefill locally on the decode worker when the prompt tokens it
    does not cache (the effective ISL) are few in absolute terms AND a small part of the prompt:
    `eff < eff_isl_threshold and eff / max(prompt, 1) < eff_isl_ratio_threshold`."""
    if not config.conditional_disagg:
        return False
    effective = max(prompt_tokens - cached_tokens, 0)
    if effective >= config.conditional_disagg_eff_isl_threshold:
        return False
    return effective / max(prompt_tokens, 1) < config.conditional_disagg_eff_isl_ratio_threshold
