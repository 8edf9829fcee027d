"""API routes benchmark: the frontend's CPU time per request on its APIs in the same run — OpenAI chat
completions (the baseline), OpenAI Responses, Anthropic Messages, vLLM's token-in/token-out generate and
OpenAI embeddings — in front of tandem's test engine, which answers at once.

    python bench/api_routes_bench.py                     # every route, streamed and unary (~5 min)
    python bench/api_routes_bench.py --routes chat       # chat completions only
    python bench/api_routes_bench.py --routes chat,messages --modes stream --json routes.json
    python bench/api_routes_bench.py --routes chat,generate,embeddings,embeddings16
    python bench/api_routes_bench.py --baseline-tree /tmp/base   # and each route against another commit

The deployment is frontend_bench.py's: tandem's frontend + `python -m tandem.testing.engine` with file
discovery and the TCP request plane, the frontend pinned to core 0, the engine and the load generator
(raw HTTP/1.1 keep-alive connections, one per concurrent request) to core 1. The same prompt goes to
every route (a user message; the Responses API's `input` string), max tokens 32:
  * POST /v1/chat/completions  {"messages": [...], "max_tokens": 32, "stream": ...}
  * POST /v1/responses         {"input": "...", "max_output_tokens": 32, "stream": ...}
  * POST /v1/messages          {"messages": [...], "max_tokens": 32, "stream": ...} (+ anthropic-version)
  * POST /inference/v1/generate  {"token_ids": [the chat route's prompt, templated and tokenized],
                                  "sampling_params": {"max_tokens": 32, "temperature": 0}, "stream": ...}
  * POST /v1/embeddings        {"input": "..."} (embeddings) or 16 copies of it (embeddings16), unary only:
    served by a second test engine, `--endpoint-types embedding --model-name SmolLM2-135M-embed`, on the same
    namespace and core as the first (it answers with a pseudo-random unit vector of 576 values per input).
  * claude-code, codex: a turn of each agent CLI as it sent it (tests/agents: Claude Code's second request,
    25 tools, a mid-conversation system message, a tool call and its result, with its session and beta
    headers; Codex's second request, developer messages, namespace and hosted tools, a function call and
    its output, with its session header), their max tokens set to 32; each is compared with a plain chat
    request of the same conversation (chat-as-claude, chat-as-codex: the chat messages the frontend maps the
    turn onto, without tools, which SmolLM2's template leaves out: the same prompt, 3,069 and 4,657 tokens),
    not with chat:
      python bench/api_routes_bench.py --routes chat-as-claude,claude-code,chat-as-codex,codex --modes stream
For each route, streamed and unary, at concurrency 1 and 16, for --duration s each (closed loop):
requests/s, p50 latency, and the frontend's CPU time per request (user + system from /proc/<pid>/stat
over the measured time, divided by the requests served). Within a level (mode, concurrency) the routes
take turns: --rounds rounds of --duration/--rounds s per route, in an order that rotates, so a drift
or a disturbance during the level hits every route alike. Each new route is reported as a ratio
against chat completions measured in the same run at the same mode and concurrency (its CPU per
request / chat's), the median of the per-run ratios (their range in the lines under the table).

The load generator checks every response: HTTP 200; streamed, the route's events in order up to its
final one (`data: [DONE]`; `response.completed`, or `response.incomplete` for max_output_tokens, which
is how the Responses API ends an answer cut at its limit; `message_stop`), no error event, text
deltas (generate: token ids), 32 output tokens (usage where the route reports it, else the text chunks);
unary, the route's JSON with its text (generate: token ids) and 32 output tokens; embeddings, one vector of
576 values per input, in order, and usage.prompt_tokens > 0. Anything else, a connection error or a request over 30 s is
an error: a level with errors is reported in the table (and its first error messages below it), kept
out of the medians, and the exit status is 1.

Each of the --repeat runs starts a fresh deployment and warms every route up; a route the frontend
does not serve (404) or answers wrongly stops the benchmark before any measurement. On a shared
machine a round during which other processes used > --max-others % of a core is measured again (up to
--attempts times; else the least disturbed one is kept, with a warning). The default run takes ~5
minutes on an idle machine (--routes chat: ~1.5).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
from _common import (
    REPO,
    Proc,
    StreamConn,
    cpu_seconds,
    file_discovery_env,
    fmt,
    interrupt_on_sigterm,
    machine_busy_seconds,
    model_path,
    pct,
    wait_quiet,
    write_json,
)
from frontend_bench import ENGINE_CORE, FRONTEND_CORE, MESSAGES, MODEL_NAME, NAMESPACE, start_deployment

PROMPT = MESSAGES[0]["content"]
EMBED_MODEL = "SmolLM2-135M-embed"  # the embedding test engine's model name
CONCURRENCIES = (1, 16)
MODES = ("stream", "unary")
REQUEST_TIMEOUT = 30.0
_decode = msgspec.json.decode


class BadResponse(Exception):
    """A response that is not a complete, successful answer of its route."""


# -- the routes: request bodies and response checks ---------------------------------------------------
def _sse(event: bytes) -> tuple[str, bytes]:
    """(event name, "" when none; the data lines joined) of one server-sent event."""
    name, data = "", []
    for line in event.split(b"\n"):
        line = line.rstrip(b"\r")
        if line.startswith(b"data:"):
            data.append(line[6:] if line.startswith(b"data: ") else line[5:])
        elif line.startswith(b"event:"):
            name = line[6:].strip().decode()
    return name, b"\n".join(data)


def _typed(events: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
    """The events' JSON data, each with a `type` equal to its `event:` name (the Responses and Messages
    APIs name every event twice); an `error` event raises."""
    out = []
    for name, data in events:
        obj = _decode(data)
        kind = obj.get("type")
        if name and kind != name:
            raise BadResponse(f"event {name!r} carries data of type {kind!r}")
        if kind in ("error", "response.failed") or (kind is None and "error" in obj):
            raise BadResponse(f"error event: {data[:300]!r}")
        out.append(obj)
    return out


def _done_stream(events: list[tuple[str, bytes]], count: Callable[[dict[str, Any]], int]) -> int:
    """A `data:` stream ending in `data: [DONE]` with a finish_reason: the sum of `count` over its choices."""
    if not events or events[-1][1] != b"[DONE]":
        raise BadResponse(f"the stream does not end with data: [DONE] (last: {events[-1][1][:200] if events else b''!r})")
    total, finish = 0, None
    for _, data in events[:-1]:
        chunk = _decode(data)
        if "error" in chunk:
            raise BadResponse(f"error event: {data[:300]!r}")
        for choice in chunk["choices"]:
            total += count(choice)
            finish = choice.get("finish_reason") or finish
    if finish is None:
        raise BadResponse("no chunk with a finish_reason")
    return total


def _chat_stream(events: list[tuple[str, bytes]]) -> int:
    return _done_stream(events, lambda choice: bool(choice["delta"].get("content")))  # chunks with text


def _chat_unary(body: dict[str, Any]) -> int:
    choice = body["choices"][0]
    if not choice["message"].get("content") or not choice.get("finish_reason"):
        raise BadResponse(f"no content or finish_reason: {str(body)[:300]}")
    return int(body["usage"]["completion_tokens"])


def _responses_done(response: dict[str, Any], final: str) -> None:
    """A Responses API answer that ended normally: completed, or incomplete at max_output_tokens."""
    status = response.get("status")
    cut = status == "incomplete" and (response.get("incomplete_details") or {}).get("reason") == "max_output_tokens"
    if not (status == "completed" or cut) or final != f"response.{status}":
        raise BadResponse(f"final event {final!r} with status {status!r} ({response.get('incomplete_details')})")


def _responses_stream(events: list[tuple[str, bytes]]) -> int:
    objs = _typed(events)
    if not objs:
        raise BadResponse("no events")
    if objs[0]["type"] != "response.created":
        raise BadResponse(f"first event {objs[0]['type']!r}, not response.created")
    final = objs[-1]
    _responses_done(final.get("response") or {}, final["type"])
    deltas = sum(1 for o in objs if o["type"] == "response.output_text.delta" and o.get("delta"))
    if not deltas:
        raise BadResponse("no response.output_text.delta event")
    usage = final["response"].get("usage") or {}
    return int(usage.get("output_tokens", deltas))


def _responses_unary(body: dict[str, Any]) -> int:
    if body.get("object") != "response":
        raise BadResponse(f"not a response object: {str(body)[:300]}")
    _responses_done(body, f"response.{body.get('status')}")
    text = "".join(part.get("text", "") for item in body.get("output", []) if item.get("type") == "message"
                   for part in item.get("content", []) if part.get("type") == "output_text")
    if not text:
        raise BadResponse(f"no output_text: {str(body)[:300]}")
    return int(body["usage"]["output_tokens"])


def _messages_stream(events: list[tuple[str, bytes]]) -> int:
    objs = _typed(events)
    if not objs or objs[0]["type"] != "message_start" or objs[-1]["type"] != "message_stop":
        raise BadResponse(f"events {[o['type'] for o in objs[:1]]}...{[o['type'] for o in objs[-1:]]}, "
                          "not message_start...message_stop")
    deltas, tokens, stop = 0, None, None
    for o in objs:
        if o["type"] == "content_block_delta" and (o.get("delta") or {}).get("text"):
            deltas += 1
        elif o["type"] == "message_delta":
            stop = (o.get("delta") or {}).get("stop_reason")
            tokens = (o.get("usage") or {}).get("output_tokens", tokens)
    if not deltas or stop is None:
        raise BadResponse(f"{deltas} text deltas, stop_reason {stop!r}")
    return int(tokens if tokens is not None else deltas)


def _messages_unary(body: dict[str, Any]) -> int:
    if body.get("type") != "message" or not body.get("stop_reason"):
        raise BadResponse(f"not a finished message: {str(body)[:300]}")
    if not "".join(b.get("text", "") for b in body.get("content", []) if b.get("type") == "text"):
        raise BadResponse(f"no text content: {str(body)[:300]}")
    return int(body["usage"]["output_tokens"])


def _generate_stream(events: list[tuple[str, bytes]]) -> int:
    return _done_stream(events, lambda choice: len(choice.get("token_ids") or []))


def _generate_unary(body: dict[str, Any]) -> int:
    choice = body["choices"][0]
    tokens = int(body["usage"]["completion_tokens"])
    if len(choice.get("token_ids") or []) != tokens or not choice.get("finish_reason"):
        raise BadResponse(f"token_ids do not match usage, or no finish_reason: {str(body)[:300]}")
    return tokens


@functools.cache
def _prompt_token_ids() -> list[int]:
    """The chat route's prompt as the frontend renders it (MESSAGES through the chat template): what the
    token-in route sends, so that the engine sees the same prompt."""
    from frontend_bench import _prompt_ids

    return _prompt_ids()[0]


@functools.cache
def _vector_size() -> int:
    """The test engine's embedding size: the model's hidden size."""
    with open(os.path.join(model_path(), "config.json")) as f:
        return int(json.load(f)["hidden_size"])


def _embeddings_unary(inputs: int) -> Callable[[dict[str, Any]], None]:
    def check(body: dict[str, Any]) -> None:
        data = body.get("data") or []
        if len(data) != inputs or any(v.get("index") != i or len(v.get("embedding") or []) != _vector_size()
                                       for i, v in enumerate(data)):
            raise BadResponse(f"wanted {inputs} vectors of {_vector_size()} values in order: {str(body)[:300]}")
        if int(body["usage"]["prompt_tokens"]) <= 0:
            raise BadResponse(f"usage.prompt_tokens {body['usage']['prompt_tokens']}")
        return None  # no output tokens to compare
    return check


def _unary_only(events: list[tuple[str, bytes]]) -> int:
    raise BadResponse("this route has no streamed mode")


@dataclass(frozen=True)
class Route:
    label: str
    path: str
    body: Callable[[int, bool], dict[str, Any]]  # (max tokens, stream) -> the request's JSON
    stream_check: Callable[[list[tuple[str, bytes]]], int]  # the SSE events -> output tokens; raises
    unary_check: Callable[[dict[str, Any]], int | None]  # the JSON body -> output tokens (None: none); raises
    headers: bytes = b""
    modes: tuple[str, ...] = MODES  # the modes the route serves
    engine: str = "chat"  # the engine that answers it: "chat", or "embedding" (a second test engine)
    baseline: str = "chat"  # the route its CPU per request is compared with


# -- agent turns: what Claude Code and Codex sent (tests/agents), against chat requests of their prompt's size --
AGENTS = os.path.join(REPO, "tests", "agents")


@functools.cache
def _captured(name: str, turn: int) -> tuple[dict[str, Any], dict[str, str]]:
    """A captured agent request (body, headers), its `[[say:...]]` scripts (for tandem's test engine) defused:
    the engine answers it with its default sentence, to max tokens, as it does the other routes."""
    with open(os.path.join(AGENTS, name)) as f:
        captured = json.load(f)[turn]
    body = json.loads(json.dumps(captured["body"]).replace("[[say:", "[say:"))
    return body, captured["headers"]


def _agent_body(name: str, turn: int, limit: str) -> Callable[[int, bool], dict[str, Any]]:
    def body(n: int, stream: bool) -> dict[str, Any]:
        return {**_captured(name, turn)[0], "model": MODEL_NAME, limit: n, "stream": stream}
    return body


def _agent_headers(name: str, turn: int, keep: tuple[str, ...]) -> bytes:
    headers = _captured(name, turn)[1]
    return "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k in keep).encode()


@functools.cache
def _agent_conversation(name: str) -> tuple[dict[str, Any], ...]:
    """An agent route's conversation as the frontend maps it onto chat messages (its system and developer
    messages, tool calls and tool results): the same prompt text, without the agent's API around it."""
    from tandem.frontend.api.anthropic.protocol import parse_messages_request
    from tandem.frontend.api.responses.protocol import parse_request

    route = ROUTES[name]
    raw = json.dumps(route.body(1, False)).encode()
    if route.path == "/v1/messages":
        return tuple(parse_messages_request(raw).messages)
    return tuple(parse_request(raw).chat([]).messages)


def _plain_chat(agent: str) -> Callable[[int, bool], dict[str, Any]]:
    """The agent's conversation as a plain chat request: no tools (SmolLM2's template leaves them out of the
    prompt anyway, so the prompt is the same, token for token), none of the agent's other fields."""
    def body(n: int, stream: bool) -> dict[str, Any]:
        return {"model": MODEL_NAME, "messages": list(_agent_conversation(agent)), "max_tokens": n, "stream": stream}
    return body


ROUTES = {
    "chat": Route("chat completions", "/v1/chat/completions",
                  lambda n, s: {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": n, "stream": s},
                  _chat_stream, _chat_unary),
    "responses": Route("responses", "/v1/responses",
                       lambda n, s: {"model": MODEL_NAME, "input": PROMPT, "max_output_tokens": n, "stream": s},
                       _responses_stream, _responses_unary),
    "messages": Route("messages", "/v1/messages",
                      lambda n, s: {"model": MODEL_NAME, "max_tokens": n, "messages": MESSAGES, "stream": s},
                      _messages_stream, _messages_unary, headers=b"anthropic-version: 2023-06-01\r\n"),
    "generate": Route("generate (token ids)", "/inference/v1/generate",
                      lambda n, s: {"model": MODEL_NAME, "token_ids": _prompt_token_ids(),
                                    "sampling_params": {"max_tokens": n, "temperature": 0}, "stream": s},
                      _generate_stream, _generate_unary),
    "embeddings": Route("embeddings, 1 input", "/v1/embeddings", lambda n, s: {"model": EMBED_MODEL, "input": PROMPT},
                        _unary_only, _embeddings_unary(1), modes=("unary",), engine="embedding"),
    "embeddings16": Route("embeddings, 16 inputs", "/v1/embeddings",
                          lambda n, s: {"model": EMBED_MODEL, "input": [PROMPT] * 16},
                          _unary_only, _embeddings_unary(16), modes=("unary",), engine="embedding"),
    # A Claude Code turn (25 tools, a mid-conversation system message, a tool call and its result) and a Codex
    # turn (developer messages, namespace and hosted tools, a function call and its output), each against a
    # plain chat request with a prompt of the same token count.
    "chat-as-claude": Route("chat, Claude Code's conversation", "/v1/chat/completions", _plain_chat("claude-code"),
                            _chat_stream, _chat_unary),
    "claude-code": Route("Claude Code turn (messages)", "/v1/messages",
                         _agent_body("claude-code-2.1.197.json", 2, "max_tokens"), _messages_stream, _messages_unary,
                         headers=_agent_headers("claude-code-2.1.197.json", 2, (
                             "anthropic-version", "anthropic-beta", "x-claude-code-session-id")),
                         baseline="chat-as-claude"),
    "chat-as-codex": Route("chat, Codex's conversation", "/v1/chat/completions", _plain_chat("codex"),
                           _chat_stream, _chat_unary),
    "codex": Route("Codex turn (responses)", "/v1/responses",
                   _agent_body("codex-0.171.0.json", 1, "max_output_tokens"), _responses_stream, _responses_unary,
                   headers=_agent_headers("codex-0.171.0.json", 1, ("session-id",)), baseline="chat-as-codex"),
}


BASELINES = frozenset(route.baseline for route in ROUTES.values())


def _serves(name: str, mode: str) -> bool:
    return mode in ROUTES[name].modes


# -- load generator ----------------------------------------------------------------------------------
class Client(StreamConn):
    async def call(self, route: Route, body: bytes, stream: bool, max_tokens: int) -> None:
        """One request, read to its end; raises BadResponse (or what the connection raised) unless it is a
        complete answer with `max_tokens` output tokens."""
        status, events = await self.post(route.path, body, route.headers)
        raw = [e async for e in events]
        if not status.startswith(b"HTTP/1.1 200"):
            raise BadResponse(f"{status.decode(errors='replace').strip()}: {b''.join(raw)[:300]!r}")
        tokens: int | None
        if stream:
            tokens = route.stream_check([_sse(e) for e in raw if e.strip()])
        else:
            tokens = route.unary_check(_decode(b"\n\n".join(raw)))
        if tokens is not None and tokens != max_tokens:
            raise BadResponse(f"{tokens} output tokens, wanted {max_tokens}")


async def level(url: str, route: Route, stream: bool, concurrency: int, duration: float, max_tokens: int,
                frontend: int, engine: int) -> dict[str, Any]:
    """Closed loop: `concurrency` connections each send the next request when the last one ended, after
    one warm-up request each."""
    host, port = url.split("//")[1].rsplit(":", 1)
    body = json.dumps(route.body(max_tokens, stream)).encode()
    conns = [Client(host, int(port)) for _ in range(concurrency)]
    latencies: list[float] = []
    errors: list[str] = []

    async def one(conn: Client) -> None:
        start = time.perf_counter()
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                await conn.call(route, body, stream, max_tokens)
        except Exception as e:  # noqa: BLE001 — every failure is counted and reported
            conn.close()  # (the rest of the response may still be on the way)
            errors.append(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            return
        latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(one(c) for c in conns))  # connect + warm up (its errors count too)
    latencies.clear()  # (warm-up errors stay: they count)
    cpu0 = (cpu_seconds(frontend), cpu_seconds(engine), cpu_seconds(os.getpid()), machine_busy_seconds())
    start = time.perf_counter()
    deadline = start + duration

    async def worker(conn: Client) -> None:
        while time.perf_counter() < deadline:
            await one(conn)

    await asyncio.gather(*(worker(c) for c in conns))
    elapsed = time.perf_counter() - start
    cpu_frontend, cpu_engine = cpu_seconds(frontend) - cpu0[0], cpu_seconds(engine) - cpu0[1]
    cpu_others = (machine_busy_seconds() - cpu0[3] - cpu_frontend - cpu_engine
                  - (cpu_seconds(os.getpid()) - cpu0[2]))
    for c in conns:
        c.close()
    return {"elapsed": elapsed, "latencies": latencies, "errors": errors, "cpu_frontend": cpu_frontend,
            "cpu_engine": cpu_engine, "cpu_others": max(cpu_others, 0.0)}


def combine(slices: list[dict[str, Any]]) -> dict[str, Any]:
    """One route's figures at one level from its slices (the rounds)."""
    elapsed = sum(s["elapsed"] for s in slices)
    cpu_frontend, cpu_engine = sum(s["cpu_frontend"] for s in slices), sum(s["cpu_engine"] for s in slices)
    latencies = sorted(x for s in slices for x in s["latencies"])
    errors = [e for s in slices for e in s["errors"]]
    n = len(latencies)
    return {"requests": n, "errors": len(errors), "error_samples": sorted(set(errors))[:3],
            "rps": n / elapsed, "p50_ms": pct(latencies, 0.5) * 1e3 if n else 0.0,
            "frontend_cpu_ms_per_req": cpu_frontend / n * 1e3 if n else 0.0,
            "frontend_core_busy_pct": cpu_frontend / elapsed * 100,
            "engine_cpu_ms_per_req": cpu_engine / n * 1e3 if n else 0.0,
            "others_cpu_pct": sum(s["cpu_others"] for s in slices) / elapsed * 100}


def _key(route: str, mode: str, concurrency: int) -> str:
    return f"{route}_{mode}_c{concurrency}"


# -- one run: a fresh deployment, every level ----------------------------------------------------------
def wait_model(url: str, model: str, timeout: float = 60) -> None:
    """Until the frontend at `url` lists `model` (a worker it discovers after its start)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if any(m.get("id") == model for m in httpx.get(f"{url}/v1/models", timeout=5).json().get("data", [])):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the frontend does not list {model!r} after {timeout:.0f} s")


def probe(url: str, names: list[str], modes: list[str], max_tokens: int) -> None:
    """One request per route and mode before measuring: a route the frontend does not serve, or does not
    answer correctly, stops the benchmark here."""
    import uvloop

    host, port = url.split("//")[1].rsplit(":", 1)

    async def check() -> list[str]:
        problems = []
        for name in names:
            for mode in filter(partial(_serves, name), modes):
                route, conn = ROUTES[name], Client(host, int(port))
                body = json.dumps(route.body(max_tokens, mode == "stream")).encode()
                try:
                    await conn.call(route, body, mode == "stream", max_tokens)
                except Exception as e:  # noqa: BLE001
                    problems.append(f"POST {route.path} ({mode}): {type(e).__name__}: {e}")
                conn.close()
        return problems

    problems = uvloop.run(check())
    if problems:
        raise SystemExit("the frontend does not serve every route asked for (see --routes, --modes):\n  "
                         + "\n  ".join(problems))


def run_once(index: int, names: list[str], args: argparse.Namespace, tree: str = REPO) -> dict[str, dict[str, Any]]:
    """One run on a fresh deployment of the code in `tree` (this checkout, or --baseline-tree)."""
    import uvloop

    workdir = tempfile.mkdtemp(prefix="routes-bench-")
    logdir = os.path.join(workdir, "logs")
    os.makedirs(logdir)
    env = file_discovery_env(workdir, NAMESPACE, tree)
    procs: list[Proc] = []
    results: dict[str, dict[str, Any]] = {}
    try:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        wait_quiet(args.max_others)
        engines: dict[str, int] = {}
        if any(ROUTES[name].engine == "embedding" for name in names):
            # a second test engine, an embedding model under its own name, on the same namespace
            embedder = Proc("embedding-engine", [
                sys.executable, "-m", "tandem.testing.engine", "--model", model_path(), "--model-name", EMBED_MODEL,
                "--endpoint-types", "embedding", "--discovery-backend", "file"], env, logdir, ENGINE_CORE)
            procs.append(embedder)
            embedder.wait_line("READY")
            engines["embedding"] = embedder.pid
        engine, frontend, url = start_deployment("tandem", sys.executable, env, logdir, False, args.profile)
        procs += [engine, frontend]
        engines["chat"] = engine.pid
        if "embedding" in engines:
            wait_model(url, EMBED_MODEL)
        if ENGINE_CORE < (os.cpu_count() or 1):
            os.sched_setaffinity(0, {ENGINE_CORE})  # the load generator shares the engines' core
        probe(url, names, args.modes, args.max_tokens)
        for name in names:  # warm up every path
            for mode in filter(partial(_serves, name), args.modes):
                route = ROUTES[name]
                warm = combine([uvloop.run(level(url, route, mode == "stream", 16, args.warmup,
                                                 args.max_tokens, frontend.pid, engines[route.engine]))])
                if warm["errors"]:
                    print(f"(run {index + 1}, warm-up {name} {mode}: {warm['errors']} errors: "
                          f"{warm['error_samples']})", file=sys.stderr)
        for mode in args.modes:
            for concurrency in CONCURRENCIES:
                results.update(measure(url, [n for n in names if _serves(n, mode)], mode, concurrency, args,
                                       frontend.pid, engines, index))
    except BaseException as e:
        if procs and not isinstance(e, (KeyboardInterrupt, SystemExit)):
            for p in procs:
                print(f"--- {p.name} log ---\n{p.tail()}", file=sys.stderr)
        print(f"(logs kept in {logdir})", file=sys.stderr)
        raise
    finally:
        for p in reversed(procs):
            p.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    return results


def measure(url: str, names: list[str], mode: str, concurrency: int, args: argparse.Namespace, frontend: int,
            engines: dict[str, int], index: int) -> dict[str, dict[str, Any]]:
    """One level for every route, interleaved: --rounds rounds, each of a slice of every route (in an order
    that rotates), so that what drifts during the level hits every route alike. A round during which
    other processes used more than --max-others % of a core is measured again."""
    import uvloop

    slices: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    where = f"run {index + 1}, {mode} c={concurrency}"
    for r in range(args.rounds):
        shift = (index * args.rounds + r) % len(names)
        order = names[shift:] + names[:shift]
        kept: list[tuple[float, dict[str, dict[str, Any]]]] = []
        for attempt in range(args.attempts):
            if attempt:
                wait_quiet(args.max_others, timeout=60, exclude=lambda: [frontend, *engines.values()])
            got = {name: uvloop.run(level(url, ROUTES[name], mode == "stream", concurrency, args.duration / args.rounds,
                                          args.max_tokens, frontend, engines[ROUTES[name].engine]))
                   for name in order}
            others = sum(g["cpu_others"] for g in got.values()) / sum(g["elapsed"] for g in got.values()) * 100
            kept.append((others, got))
            if others <= args.max_others:
                break
            print(f"({where}, round {r + 1}: other processes used {others:.0f}% of a core; measured again)",
                  file=sys.stderr)
        others, got = min(kept, key=lambda k: k[0])
        if others > args.max_others:
            print(f"warning: {where}, round {r + 1} kept with other processes at {others:.0f}% of a core",
                  file=sys.stderr)
        for name in names:
            slices[name].append(got[name])
    out = {}
    for name in names:
        stats = out[_key(name, mode, concurrency)] = combine(slices[name])
        if stats["errors"]:
            print(f"{where}, {name}: {stats['errors']} errors ({stats['requests']} ok): {stats['error_samples']}",
                  file=sys.stderr)
    return out


# -- summary -----------------------------------------------------------------------------------------
def summarize(runs: list[dict[str, dict[str, Any]]], names: list[str], modes: list[str]) -> dict[str, Any]:
    """Per level: medians over the runs without errors; per new route: the median of its per-run ratios
    to chat's CPU per request (runs where both levels were error-free)."""
    medians: dict[str, dict[str, float]] = {}
    ratios: dict[str, dict[str, float]] = {}
    errors: dict[str, dict[str, Any]] = {}
    for name in names:
        for mode in filter(partial(_serves, name), modes):
            for c in CONCURRENCIES:
                key = _key(name, mode, c)
                clean = [run[key] for run in runs if not run[key]["errors"]]
                bad = [run[key] for run in runs if run[key]["errors"]]
                if bad:
                    errors[key] = {"runs_with_errors": len(bad), "errors": sum(r["errors"] for r in bad),
                                   "samples": sorted({s for r in bad for s in r["error_samples"]})[:5]}
                if clean:
                    medians[key] = {k: statistics.median(r[k] for r in clean) for k in
                                    ("rps", "p50_ms", "frontend_cpu_ms_per_req", "frontend_core_busy_pct",
                                     "engine_cpu_ms_per_req", "others_cpu_pct")}
                    medians[key]["runs"] = len(clean)
                base = _key(ROUTES[name].baseline, mode, c)
                if name == ROUTES[name].baseline or ROUTES[name].baseline not in names or name in BASELINES:
                    continue
                per_run = [run[key]["frontend_cpu_ms_per_req"] / run[base]["frontend_cpu_ms_per_req"]
                           for run in runs if not run[key]["errors"] and not run[base]["errors"]
                           and run[base]["frontend_cpu_ms_per_req"] > 0]
                if per_run:
                    ratios[key] = {"cpu_vs_chat": statistics.median(per_run), "min": min(per_run),
                                   "max": max(per_run), "runs": len(per_run)}
    return {"medians": medians, "cpu_ratio_vs_chat": ratios, "errors": errors}


def report(summary: dict[str, Any], names: list[str], modes: list[str], args: argparse.Namespace) -> list[str]:
    medians, ratios, errors = summary["medians"], summary["cpu_ratio_vs_chat"], summary["errors"]
    head = "| route | mode |"
    for c in CONCURRENCIES:
        head += f" req/s c={c} | frontend CPU ms/req c={c} | vs baseline c={c} |"
    lines = [f"api_routes_bench: frontend CPU per request by route, max tokens {args.max_tokens}, "
             f"{args.duration:g} s per route and level in {args.rounds} rounds, median of {args.repeat} runs; frontend on core {FRONTEND_CORE}, "
             f"engine + load generator on core {ENGINE_CORE}", "", head + " errors |",
             "|---" * (3 + 3 * len(CONCURRENCIES)) + "|"]
    for mode in modes:
        for name in filter(lambda n: _serves(n, mode), names):
            row = f"| {ROUTES[name].label} | {mode} |"
            bad = []
            for c in CONCURRENCIES:
                key = _key(name, mode, c)
                m, r = medians.get(key), ratios.get(key)
                if m is None:
                    row += " n/a | n/a | n/a |"
                else:
                    vs = "1 (baseline)" if name in BASELINES else f"{r['cpu_vs_chat']:.2f}x" if r else "n/a"
                    row += f" {fmt(m['rps'])} | {m['frontend_cpu_ms_per_req']:.3f} | {vs} |"
                if key in errors:
                    e = errors[key]
                    bad.append(f"c={c}: {e['errors']} in {e['runs_with_errors']}/{len(args.runs)} runs")
            lines.append(row + (" **" + "; ".join(bad) + "** |" if bad else " 0 |"))
    lines.append("")
    for mode in modes:
        for name in filter(lambda n: _serves(n, mode), names):
            if name in BASELINES:
                continue
            r = {c: ratios.get(_key(name, mode, c)) for c in CONCURRENCIES}
            parts = [f"{r[c]['cpu_vs_chat']:.2f}x at c={c} (runs {r[c]['min']:.2f}-{r[c]['max']:.2f})"
                     for c in reversed(CONCURRENCIES) if r[c]]
            base = ROUTES[ROUTES[name].baseline].label
            lines.append(f"- {ROUTES[name].label} {mode}: " + (", ".join(parts) + f" the CPU per request of {base}"
                                                                if parts else "no error-free run to compare"))
    if errors:
        lines += ["", "Errors (levels with errors are left out of the medians and ratios):"]
        for key, e in errors.items():
            lines.append(f"- {key}: {e['errors']} errors in {e['runs_with_errors']} runs, e.g. "
                         + " / ".join(e["samples"]))
    return lines


def versus_tree(runs: list[dict[str, dict[str, Any]]], base_runs: list[dict[str, dict[str, Any]]],
                names: list[str], modes: list[str]) -> dict[str, dict[str, float]]:
    """Per level: this checkout's frontend CPU per request and requests/s over the baseline tree's, the
    median of the ratios of runs made back to back (both error-free)."""
    out = {}
    for name in names:
        for mode in filter(partial(_serves, name), modes):
            for c in CONCURRENCIES:
                key = _key(name, mode, c)
                pairs = [(run[key], base[key]) for run, base in zip(runs, base_runs, strict=True)
                         if not run[key]["errors"] and not base[key]["errors"] and base[key]["frontend_cpu_ms_per_req"] > 0]
                if pairs:
                    cpu = [a["frontend_cpu_ms_per_req"] / b["frontend_cpu_ms_per_req"] for a, b in pairs]
                    out[key] = {"cpu": statistics.median(cpu), "min": min(cpu), "max": max(cpu),
                                "rps": statistics.median(a["rps"] / b["rps"] for a, b in pairs), "runs": len(pairs)}
    return out


def report_versus_tree(versus: dict[str, dict[str, float]], names: list[str], modes: list[str], tree: str) -> list[str]:
    lines = ["", f"vs the baseline tree {tree} (this checkout / baseline, runs back to back):", "",
             "| route | mode |" + "".join(f" CPU/req c={c} | req/s c={c} |" for c in CONCURRENCIES),
             "|---" * (2 + 2 * len(CONCURRENCIES)) + "|"]
    for mode in modes:
        for name in filter(lambda n: _serves(n, mode), names):
            row = f"| {ROUTES[name].label} | {mode} |"
            for c in CONCURRENCIES:
                v = versus.get(_key(name, mode, c))
                row += f" {v['cpu']:.3f}x ({v['min']:.2f}-{v['max']:.2f}) | {v['rps']:.3f}x |" if v else " n/a | n/a |"
            lines.append(row)
    return lines


def _bars(value: Callable[[str], float], names: list[str], modes: list[str], ylabel: str, path: str,
          line: float | None = None) -> None:
    """Bars of `value(level key)` per route and concurrency, one panel per mode; `line`: a reference level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    width = 0.8 / len(CONCURRENCIES)
    for ax, mode in zip(axes[0], modes, strict=True):
        shown = [n for n in names if _serves(n, mode)]
        for i, c in enumerate(CONCURRENCIES):
            values = [value(_key(n, mode, c)) for n in shown]
            ax.bar([x + i * width for x in range(len(shown))], values, width, label=f"concurrency {c}")
        if line is not None:
            ax.axhline(line, color="black", linewidth=0.8)
        ax.set_xticks([x + width * (len(CONCURRENCIES) - 1) / 2 for x in range(len(shown))])
        ax.set_xticklabels([ROUTES[n].label for n in shown], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{mode}ed" if mode == "stream" else mode)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(summary: dict[str, Any], names: list[str], modes: list[str], path: str) -> None:
    """Bars of the frontend's CPU per request, per route and concurrency (one panel per mode)."""
    _bars(lambda key: summary["medians"].get(key, {}).get("frontend_cpu_ms_per_req", 0), names, modes,
          "frontend CPU per request (ms)", path)


def plot_versus(versus: dict[str, dict[str, float]], names: list[str], modes: list[str], path: str) -> None:
    """Bars of this checkout's frontend CPU per request over the baseline tree's, per route and concurrency."""
    _bars(lambda key: versus.get(key, {}).get("cpu", 0), names, modes,
          "frontend CPU per request, this tree / baseline", path, line=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routes", default=",".join(ROUTES),
                        help=f"comma-separated, of {', '.join(ROUTES)} (default: all); chat is the baseline")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of stream, unary (default: both)")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per route and level")
    parser.add_argument("--rounds", type=int, default=4,
                        help="the routes take turns this many times within each level (duration / rounds each)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up per route and mode, each run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3, help="runs (fresh deployments); medians are reported")
    parser.add_argument("--max-others", type=float, default=15.0,
                        help="measure a level again if other processes used more than this %% of a core meanwhile")
    parser.add_argument("--attempts", type=int, default=3, help="measurements tried per level")
    parser.add_argument("--profile", default=None, help="write a cProfile of the frontend to this file (last run)")
    parser.add_argument("--baseline-tree", default=None, metavar="WORKTREE",
                        help="also run tandem from this tree (a git worktree of another commit), each run back to back "
                             "with this checkout's, in alternating order, and report the ratios")
    parser.add_argument("--plot", default=None, metavar="PNG", help="also draw the CPU per request of each route")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="also write the results (every run, medians, ratios, errors) as JSON (stdout without PATH)")
    args = parser.parse_args()
    interrupt_on_sigterm()
    names = [n.strip() for n in args.routes.split(",") if n.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not names or set(names) - set(ROUTES) or not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--routes takes {', '.join(ROUTES)}; --modes takes {', '.join(MODES)}")
    names.sort(key=list(ROUTES).index)
    for name in names:
        if name not in BASELINES and ROUTES[name].baseline not in names:
            print(f"(no {ROUTES[name].baseline} in --routes: no ratio for {name})", file=sys.stderr)
    args.runs, base_runs = [], []
    for index in range(args.repeat):
        if args.baseline_tree and index % 2:
            base_runs.append(run_once(index, names, args, args.baseline_tree))
        args.runs.append(run_once(index, names, args))
        if args.baseline_tree and not index % 2:
            base_runs.append(run_once(index, names, args, args.baseline_tree))
    summary = summarize(args.runs, names, args.modes)
    print("\n" + "\n".join(report(summary, names, args.modes, args)))
    if args.baseline_tree:
        summary["baseline_tree"] = {"tree": args.baseline_tree, "runs": base_runs,
                                    "versus": versus_tree(args.runs, base_runs, names, args.modes)}
        print("\n".join(report_versus_tree(summary["baseline_tree"]["versus"], names, args.modes,
                                             args.baseline_tree)))
        if args.plot:
            root, ext = os.path.splitext(args.plot)
            plot_versus(summary["baseline_tree"]["versus"], names, args.modes, f"{root}-vs-baseline{ext}")
    if args.plot:
        plot(summary, names, args.modes, args.plot)
    write_json(args.json, {"routes": names, "modes": args.modes, "concurrencies": list(CONCURRENCIES),
                           "max_tokens": args.max_tokens, "duration_s": args.duration, "runs": args.runs, **summary})
    if summary["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
