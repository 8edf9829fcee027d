"""Per-process system status server (DYN_SYSTEM_PORT): health, liveness, metrics, engine routes.

Health, liveness and metrics are open (probes and scrapers need them). Every other route changes or
reveals the engine's state (`/engine/*`, LoRA loading): it needs `Authorization: Bearer KEY` when a key is
set (DYN_SYSTEM_API_KEY, else DYN_API_KEY), and without one it is served only on a loopback bind, unless
DYN_SYSTEM_ALLOW_UNAUTHENTICATED=true."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tandem.runtime.auth import refusal
from tandem.runtime.config import ConfigError, RuntimeConfig

log = logging.getLogger(__name__)

EngineRoute = Callable[[Any], Awaitable[Any]]
# handler(json body or None, path parameters) -> (HTTP status, JSON-serialisable body)
JsonRoute = Callable[[Any, dict[str, str]], Awaitable[tuple[int, Any]]]


class SystemHealth:
    """Readiness of the process and of each endpoint it serves.

    The process is ready once it says so (`set_ready`) or DYN_SYSTEM_STARTING_HEALTH_STATUS=ready;
    when DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS lists endpoints, it is ready when those are ready.
    An endpoint is ready while it is served and its canary health checks pass.
    """

    def __init__(self, config: RuntimeConfig) -> None:
        self.ready = config.system_starting_health_status == "ready"
        self.required = list(config.system_use_endpoint_health_status)
        self.endpoints: dict[str, str] = {}
        self.started = time.monotonic()

    def set_ready(self, ready: bool = True) -> None:
        self.ready = ready

    def set_endpoint(self, name: str, ready: bool) -> None:
        self.endpoints[name] = "ready" if ready else "notready"

    def is_ready(self) -> bool:
        if self.required:
            return all(self.endpoints.get(name) == "ready" for name in self.required)
        return self.ready and all(state == "ready" for state in self.endpoints.values())

    def report(self) -> dict[str, Any]:
        uptime = time.monotonic() - self.started
        return {
            "status": "ready" if self.is_ready() else "notready",
            "uptime": {"secs": int(uptime), "nanos": int((uptime % 1) * 1e9)},
            "endpoints": dict(self.endpoints),
        }


class SystemStatusServer:
    def __init__(self, config: RuntimeConfig, health: SystemHealth, registry: CollectorRegistry) -> None:
        self._config = config
        self._health = health
        self._registry = registry
        self._engine_routes: dict[str, EngineRoute] = {}
        self._routes: dict[tuple[str, str], tuple[re.Pattern[str], JsonRoute]] = {}
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def register_engine_route(self, name: str, handler: EngineRoute) -> None:
        """Serve `handler(json_body) -> json` at `/engine/{name}`."""
        self._engine_routes[name.strip("/")] = handler

    def register_route(self, method: str, path: str, handler: JsonRoute) -> None:
        """Serve `handler(json_body_or_None, path_params) -> (status, json)` for `method path`.

        Works before or after `start()`: one catch-all aiohttp route, added last, dispatches to this
        table, so the built-in routes (health, live, metrics, /engine/...) always win. `path` uses
        aiohttp's syntax: `{name}` matches one segment, `{name:regex}` a regex (`{name:.+}` may
        span slashes). `method` is an HTTP method or `*`. Registering the same method and path again
        replaces the handler; the first registered pattern that matches a request wins.
        """
        if not path.startswith("/"):
            raise ValueError(f"route path must start with '/': {path!r}")
        if path in self._builtin_paths() or path.startswith("/engine/"):
            raise ValueError(f"{path!r} is a built-in route of the system status server")
        self._routes[(method.upper(), path)] = (_compile_path(path), handler)

    def _builtin_paths(self) -> set[str]:
        return {self._config.system_health_path, self._config.system_live_path, "/metrics"}

    async def start(self) -> None:
        app = web.Application(client_max_size=16 * 1024 * 1024, middlewares=[self._guard])
        app.router.add_get(self._config.system_health_path, self._health_route)
        if self._config.system_live_path != self._config.system_health_path:
            app.router.add_get(self._config.system_live_path, self._health_route)
        app.router.add_get("/metrics", self._metrics_route)
        app.router.add_route("*", "/engine/{name:.+}", self._engine_route)
        app.router.add_route("*", "/{tail:.*}", self._dispatch_route)  # register_route's table; keep last
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._config.system_host, self._config.system_port or 0)
        try:
            await site.start()
        except OSError as e:  # the port the user chose is taken: say which, not a traceback
            await self._runner.cleanup()
            raise ConfigError(f"DYN_SYSTEM_PORT: cannot listen on {self._config.system_host}:"
                              f"{self._config.system_port}: {e.strerror or e}") from e
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info("system status server on http://%s:%d", self._config.system_host, self.port)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Routes other than health, liveness and metrics need the key (see the module's docstring)."""
        if request.method in ("GET", "HEAD") and request.path in self._builtin_paths():
            return await handler(request)
        config = self._config
        status = refusal(request.headers.get("Authorization", ""), config.system_api_key, config.system_host,
                         config.system_allow_unauthenticated)
        if status == 401:
            return _error(401, "this route of the system port needs Authorization: Bearer <DYN_SYSTEM_API_KEY>")
        if status == 403:
            return _error(403, f"this route of the system port is disabled: the port listens on "
                               f"{config.system_host}, not loopback, and no key is set. Set DYN_SYSTEM_API_KEY, "
                               "or bind DYN_SYSTEM_HOST=127.0.0.1, or set DYN_SYSTEM_ALLOW_UNAUTHENTICATED=true")
        return await handler(request)

    async def _health_route(self, request: web.Request) -> web.Response:
        report = self._health.report()
        return web.json_response(report, status=200 if report["status"] == "ready" else 503)

    async def _metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _engine_route(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        handler = self._engine_routes.get(name)
        if handler is None:
            return _error(404, f"unknown engine route {name!r}; known: {sorted(self._engine_routes)}")
        body, bad = await _json_body(request)
        if bad is not None:
            return bad
        try:
            result = await handler(body)
        except ValueError as e:
            return _error(400, str(e))
        except Exception as e:
            log.exception("engine route %s failed", name)
            return _error(500, f"{type(e).__name__}: {e}")
        return web.json_response(result)

    async def _dispatch_route(self, request: web.Request) -> web.Response:
        allowed: set[str] = set()
        for (method, path), (pattern, handler) in list(self._routes.items()):
            match = pattern.fullmatch(request.path)
            if match is None:
                continue
            if method not in ("*", request.method):
                allowed.add(method)
                continue
            body, bad = await _json_body(request)
            if bad is not None:
                return bad
            try:
                status, result = await handler(body, match.groupdict())
            except Exception as e:
                log.exception("route %s %s failed", method, path)
                return _error(500, f"{type(e).__name__}: {e}")
            return web.json_response(result, status=status)
        if request.path in self._builtin_paths():
            allowed.add("GET")  # aiohttp falls through to this catch-all for e.g. POST /health
        if allowed:
            return web.json_response(
                {"error": {"message": f"method {request.method} not allowed", "code": 405}},
                status=405, headers={"Allow": ", ".join(sorted(allowed))},
            )
        return _error(404, f"no route for {request.path}")

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def _compile_path(path: str) -> re.Pattern[str]:
    """aiohttp-style `/a/{x}/{rest:.+}` -> a regex with named groups (matched against the whole path)."""
    parts: list[str] = []
    pos = 0
    for m in re.finditer(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([^{}]*(?:\{[^{}]*\}[^{}]*)*))?\}", path):
        parts.append(re.escape(path[pos:m.start()]))
        parts.append(f"(?P<{m.group(1)}>{m.group(2) or '[^/]+'})")
        pos = m.end()
    parts.append(re.escape(path[pos:]))
    return re.compile("".join(parts))


async def _json_body(request: web.Request) -> tuple[Any, web.Response | None]:
    """The request's JSON body (None when empty), or a 400 response when it is not JSON."""
    raw = await request.read()
    if not raw:
        return None, None
    try:
        return json.loads(raw), None
    except (ValueError, UnicodeDecodeError) as e:
        return None, _error(400, f"request body is not valid JSON: {e}")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)
