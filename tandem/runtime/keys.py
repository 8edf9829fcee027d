"""Discovery key layout, as in Dynamo's KV-store discovery."""

from __future__ import annotations

INSTANCES = "v1/instances"
MODELS = "v1/mdc"
EVENT_CHANNELS = "v1/event_channels"


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


def event_channel_prefix(scope: str, topic: str) -> str:
    return f"{EVENT_CHANNELS}/{scope}/topic/{topic}/"


def event_channel_key(scope: str, topic: str, publisher_id: str) -> str:
    return f"{event_channel_prefix(scope, topic)}{publisher_id}"
