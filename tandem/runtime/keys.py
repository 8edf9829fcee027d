"""Discovery key layout, as in Dynamo's KV-store discovery."""

from __future__ import annotations

INSTANCES = "v1/instances"
MODELS = "v1/mdc"
EVENT_CHANNELS = "v1/event_channels"
FRONTENDS = "v1/frontends"  # each frontend process: the URL of its own /metrics (what the planner reads)


def parse_endpoint_path(path: str) -> tuple[str, str, str]:
    """`ns.component.endpoint` or `dyn://ns.component.endpoint` -> its three parts."""
    text = path.removeprefix("dyn://")
    parts = text.split(".")
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"endpoint {path!r} must look like 'namespace.component.endpoint'")
    return parts[0], parts[1], parts[2]


def endpoint_prefix(namespace: str, component: str, endpoint: str) -> str:
    return f"{INSTANCES}/{namespace}/{component}/{endpoint}/"


def instance_key(namespace: str, component: str, endpoint: str, instance_id: int) -> str:
    return f"{endpoint_prefix(namespace, component, endpoint)}{instance_id:x}"


def model_key(namespace: str, component: str, endpoint: str, instance_id: int, suffix: str | None = None) -> str:
    base = f"{MODELS}/{namespace}/{component}/{endpoint}/{instance_id:x}"
    return f"{base}/{suffix}" if suffix else base


def models_prefix(namespace: str | None = None) -> str:
    """Where the model cards of `namespace` (of every namespace for None) are."""
    return f"{MODELS}/{namespace}/" if namespace else f"{MODELS}/"


def parse_model_key(key: str) -> tuple[str, str, str, int, str | None]:
    """`v1/mdc/ns/comp/ep/{id:x}[/lora]` -> (ns, comp, ep, instance id, lora name or None)."""
    parts = key.split("/")
    if len(parts) < 6 or f"{parts[0]}/{parts[1]}" != MODELS:
        raise ValueError(f"not a model card key: {key!r}")
    return parts[2], parts[3], parts[4], int(parts[5], 16), "/".join(parts[6:]) or None


def event_channel_prefix(scope: str, topic: str) -> str:
    return f"{EVENT_CHANNELS}/{scope}/topic/{topic}/"


def event_channel_key(scope: str, topic: str, publisher_id: str) -> str:
    return f"{event_channel_prefix(scope, topic)}{publisher_id}"


def frontends_prefix(namespace: str) -> str:
    return f"{FRONTENDS}/{namespace}/"


def frontend_key(namespace: str, instance_id: int) -> str:
    return f"{frontends_prefix(namespace)}{instance_id:x}"
