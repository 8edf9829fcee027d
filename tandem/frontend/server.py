"""The HTTP server (aiohttp): the app, its middlewares (errors in the route's shape, the shutdown gate, the
API key), the drain at shutdown, the service routes (/health, /live, /metrics, /openapi.json), and the
APIs, each mounted from its module in `frontend.api` (`APIS`: adding an API is one module and one line).

A client that disconnects kills its request on the worker at once (handler cancellation).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tandem.frontend.api import anthropic, embeddings, generate, openai, responses, tokenize
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.models import ModelManager
from tandem.frontend.openapi import openapi_spec
from tandem.frontend.protocol.errors import RequestError
from tandem.frontend.serving import ErrorShape, HttpConfig, Mount, Serving
from tandem.runtime import DistributedRuntime
from tandem.runtime.auth import bearer_matches, key_matches

log = logging.getLogger("tandem.frontend")

# Every API the server serves: each module's `routes(serving)` gives its routes and error shape.
APIS = (openai, responses, anthropic, embeddings, tokenize, generate)
# Paths behind --api-key and closed to new POSTs while draining: vLLM's --api-key guards /inference too.
_GUARDED = ("/v1/", "/inference/")


class FrontendServer:
    def __init__(self, runtime: DistributedRuntime, manager: ModelManager, metrics: FrontendMetrics,
                 config: HttpConfig) -> None:
        self.runtime = runtime
        self.manager = manager
        self.config = config
        self.serving = Serving(runtime, manager, metrics, config)
        self.mounts: list[Mount] = [api.routes(self.serving) for api in APIS]
        self._shapes = [(m.prefix, m.error_shape) for m in self.mounts if m.error_shape is not None]
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.draining = False  # new generation requests are refused (shutdown)

    # -- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.body_limit_bytes,
                              middlewares=[self._errors, self._admit])
        for mount in self.mounts:
            app.add_routes(mount.routes)
        app.add_routes([web.get("/health", self.health), web.get("/live", self.live),
                        web.get("/metrics", self.metrics_route), web.get("/openapi.json", self.openapi)])
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        ssl_context = None
        if self.config.tls_cert_path:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.config.tls_cert_path, self.config.tls_key_path)
        site = web.TCPSite(self._runner, self.config.host, self.config.port, ssl_context=ssl_context,
                           backlog=1024, reuse_port=self.config.reuse_port or None)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        scheme = "https" if ssl_context else "http"
        log.info("OpenAI API on %s://%s:%d/v1", scheme, self.config.host, self.port)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _shape(self, path: str) -> ErrorShape | None:
        """The error shape of the API that serves `path` (None: OpenAI's)."""
        return next((shape for prefix, shape in self._shapes if path.startswith(prefix)), None)

    def _error(self, request: web.Request, error: RequestError) -> web.Response:
        """An error in the shape of the route asked for."""
        shape = self._shape(request.path)
        return web.json_response(shape(error) if shape else error.body(), status=error.status)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except RequestError as e:
            return self._error(request, e)
        except web.HTTPException as e:
            if e.status == 413:
                limit = self.config.body_limit_bytes
                return self._error(request, RequestError(f"request body exceeds the limit of {limit} bytes", status=413))
            if isinstance(e, web.HTTPMethodNotAllowed):
                response = self._error(request, RequestError(f"{request.method} {request.path}: {e.reason}", status=405))
                response.headers["Allow"] = ", ".join(sorted(e.allowed_methods))
                return response
            if e.status == 404:
                return self._error(request, RequestError(f"{request.method} {request.path}: {e.reason}", status=404))
            raise
        except Exception:  # a defect here, never the client's mistake: the route's error shape, one log record
            log.exception("unexpected error serving %s %s", request.method, request.path)
            return self._error(request, RequestError("internal error while serving the request", status=500))

    @web.middleware
    async def _admit(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Generation routes: refused while draining (503), and without the API key when one is set (401)."""
        key = self.config.api_key
        if (self.draining or key) and request.path.startswith(_GUARDED):
            if self.draining and request.method == "POST":
                error = RequestError("the server is shutting down; send the request to another frontend", status=503)
                response = self._error(request, error)
                response.headers["Connection"] = "close"
                return response
            headers = request.headers
            # Anthropic's clients send the key as x-api-key, OpenAI's as a bearer token: either will do.
            if key and not (bearer_matches(headers.get("Authorization", ""), key)
                            or key_matches(headers.get("x-api-key"), key)):
                return self._error(request, RequestError("Incorrect or missing API key", status=401,
                                                         type="invalid_request_error", code="invalid_api_key"))
        return await handler(request)

    async def drain(self, timeout: float) -> None:
        """Shutdown: refuse new generation requests (503, and /health says unhealthy), let those in flight
        finish for at most `timeout` seconds, then cut the rest off with a "shutting down" error."""
        self.draining = True
        inflight = self.serving.inflight
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if inflight:
            log.info("draining %d in-flight requests (at most %.0f s)", len(inflight), timeout)
        while inflight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if inflight:
            log.warning("drain bound reached: cutting off %d requests", len(inflight))
            self.serving.drain_expired = True
            for context in list(inflight.values()):
                context.kill()
            cutoff = loop.time() + 5.0  # their handlers write the error and end
            while inflight and loop.time() < cutoff:
                await asyncio.sleep(0.05)

    # -- service routes ------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return web.json_response({"status": "unhealthy", "message": "shutting down", "endpoints": [],
                                      "instances": []}, status=503)
        models = self.manager.served()
        endpoints = sorted({path for m in models for path in m.instances.values()})
        instances = sorted({i for m in models for i in m.instances})
        if not endpoints:
            return web.json_response({"status": "unhealthy", "message": "No endpoints available",
                                      "endpoints": [], "instances": []}, status=503)
        # Prefill workers serve no request themselves: listed apart (disaggregated serving).
        prefill = sorted({i for m in models for i in m.prefill_instances})
        return web.json_response({"status": "healthy", "endpoints": endpoints, "instances": instances,
                                  "prefill_instances": prefill, "frontend": f"{self.runtime.instance_id:x}"})

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "live", "message": "Service is live"})

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.runtime.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_spec([m.name for m in self.manager.served()],
                                              anthropic=self.config.anthropic_api))
