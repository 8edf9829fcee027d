"""The planner's control API: read and change each pool's min and max endpoints and the GPU budgets while it
runs, as Dynamo's planner allows at `/v1/min-endpoints`.

    GET   /v1/min-endpoints   the settings the current mode uses, and both budgets
    PATCH /v1/min-endpoints   {"decode_min_endpoint": 2, "max_gpu_budget": 6, ...}: some of them

Fields by mode: `disagg` uses `prefill_min_endpoint`, `decode_min_endpoint` (and `prefill_max_endpoint`,
`decode_max_endpoint`); `prefill` and `decode` their own pool's; `agg` uses `min_endpoint` (and
`max_endpoint`). Every mode takes `min_gpu_budget` and `max_gpu_budget` (-1: no limit). A max endpoint of
null removes it. A change is checked as a whole with the planner's own rules and applied at once, or not at
all (400 naming the field); it takes effect at the next decision, in this process only.

The server listens on loopback by default (`--control-api-host`, `--control-api-port`, 0 to turn it off). With
a key (`--control-api-key`, env `PLANNER_CONTROL_API_KEY`) every request needs `Authorization: Bearer KEY`;
without one a non-loopback bind refuses every request (403) unless `--control-api-allow-unauthenticated`,
as the workers' system port does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from tandem.planner.config import PlannerConfig, PlannerMode
from tandem.runtime.auth import refusal
from tandem.runtime.config import ConfigError

log = logging.getLogger(__name__)

PATH = "/v1/min-endpoints"
BUDGETS = ("min_gpu_budget", "max_gpu_budget")
MAXIMA = ("max_endpoint", "prefill_max_endpoint", "decode_max_endpoint")


def endpoint_fields(mode: PlannerMode) -> tuple[str, ...]:
    """The endpoint settings `mode` reads."""
    return {
        PlannerMode.DISAGG: ("prefill_min_endpoint", "decode_min_endpoint", "prefill_max_endpoint",
                             "decode_max_endpoint"),
        PlannerMode.PREFILL: ("prefill_min_endpoint", "prefill_max_endpoint"),
        PlannerMode.DECODE: ("decode_min_endpoint", "decode_max_endpoint"),
        PlannerMode.AGG: ("min_endpoint", "max_endpoint"),
    }[mode]


def current(config: PlannerConfig) -> dict[str, Any]:
    """The settings of this mode as they apply now (a pool's own min falls back to `min_endpoint`)."""
    values: dict[str, Any] = {}
    for name in endpoint_fields(config.mode):
        pool = "prefill" if name.startswith("prefill") else "decode"
        values[name] = config.max_replicas(pool) if "max" in name else config.min_replicas(pool)
    values.update({name: getattr(config, name) for name in BUDGETS})
    values["mode"] = config.mode.value
    return values


def patched(config: PlannerConfig, body: Any) -> PlannerConfig:
    """`config` with `body`'s changes, checked; raises ConfigError naming the field."""
    if not isinstance(body, dict) or not body:
        raise ConfigError("the body must be a JSON object of settings to change")
    allowed = (*endpoint_fields(config.mode), *BUDGETS)
    changes: dict[str, Any] = {}
    for name, value in body.items():
        if name not in allowed:
            raise ConfigError(f"{name}: not a setting of the {config.mode.value} planner (it takes "
                              f"{', '.join(allowed)})")
        if value is None and name not in MAXIMA:
            raise ConfigError(f"{name}: must be an integer")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{name}: must be an integer, got {value!r}")
        changes[name] = value
    if config.mode is PlannerMode.AGG:  # the aggregated pool's own settings would shadow the ones it changes
        if "min_endpoint" in changes:
            changes["decode_min_endpoint"] = None
        if "max_endpoint" in changes:
            changes["decode_max_endpoint"] = None
    return replace(config, **changes).validate()


@dataclass
class ControlSettings:
    host: str = "127.0.0.1"
    port: int = 9086  # 0: no control API
    api_key: str | None = None
    allow_unauthenticated: bool = False


class ControlServer:
    """Serves the API for the live `config`, which it changes in place (the planner reads it every decision)."""

    def __init__(self, config: PlannerConfig, settings: ControlSettings) -> None:
        self.config = config
        self.settings = settings
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(middlewares=[self._guard], client_max_size=64 * 1024)
        app.router.add_get(PATH, self._get)
        app.router.add_patch(PATH, self._patch)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.host, self.settings.port)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise ConfigError(f"--control-api-port: cannot listen on {self.settings.host}:{self.settings.port}: "
                              f"{e.strerror or e}") from e
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("planner: control API on http://%s:%d%s", self.settings.host, self.port, PATH)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        s = self.settings
        status = refusal(request.headers.get("Authorization", ""), s.api_key, s.host, s.allow_unauthenticated)
        if status == 401:
            return _error(401, "the planner's control API needs Authorization: Bearer <PLANNER_CONTROL_API_KEY>")
        if status == 403:
            return _error(403, f"the planner's control API is disabled: it listens on {s.host}, not loopback, and "
                               "no key is set. Set PLANNER_CONTROL_API_KEY, or bind --control-api-host 127.0.0.1, "
                               "or give --control-api-allow-unauthenticated")
        return await handler(request)

    async def _get(self, request: web.Request) -> web.Response:
        return web.json_response(current(self.config))

    async def _patch(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            return _error(400, "the body is not valid JSON")
        try:
            changed = patched(self.config, body)
        except ConfigError as e:
            return _error(400, str(e))
        for name in body.keys() | {"decode_min_endpoint", "decode_max_endpoint"}:
            setattr(self.config, name, getattr(changed, name))
        log.info("planner: settings changed through the control API: %s",
                 ", ".join(f"{name}={value}" for name, value in body.items()))
        return web.json_response(current(self.config))


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)
