"""The distributed runtime: discovery, request plane, event plane, health, metrics, shutdown."""

from tandem.runtime.client import Client
from tandem.runtime.component import Component, Endpoint, Namespace, ServedEndpoint
from tandem.runtime.config import ConfigError, RuntimeConfig
from tandem.runtime.context import Context
from tandem.runtime.errors import (
    EngineShutdown,
    InstanceUnreachableError,
    MessageTooLargeError,
    NoInstancesError,
    RemoteError,
    StreamIncompleteError,
)
from tandem.runtime.logs import configure_logging
from tandem.runtime.options import add_runtime_args
from tandem.runtime.runtime import DistributedRuntime, run

__all__ = [
    "Client", "Component", "ConfigError", "Context", "DistributedRuntime", "Endpoint", "EngineShutdown",
    "InstanceUnreachableError", "MessageTooLargeError", "Namespace", "NoInstancesError", "RemoteError",
    "RuntimeConfig", "ServedEndpoint", "StreamIncompleteError", "add_runtime_args", "configure_logging", "run",
]
