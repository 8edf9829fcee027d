"""What real agent clients send, without processes: requests captured from Claude Code 2.1.197 and Codex
0.171.0 (`tests/agents/*.json`: path, headers and body of each request of a two-turn run with a shell tool
call) through the Messages and Responses parsers, and the pieces they rely on: instructions placed where
the chat template takes them, namespace tools, tandem's opaque reasoning, hosted tools left out, the
tolerant reader's log lines, and the session key the router keeps a session on one worker by."""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import pytest

from tandem.frontend.api.anthropic.protocol import _CountBody, note_betas, parse_messages_request
from tandem.frontend.api.anthropic.serving import MessagesAnswer
from tandem.frontend.api.responses.protocol import ResponsesRequest, input_messages, parse_request
from tandem.frontend.api.responses.serving import ResponseAnswer
from tandem.frontend.api.responses.store import ResponseStore
from tandem.frontend.hints import routing_hints
from tandem.frontend.protocol.answer import Ending, Outcome, Usage
from tandem.frontend.protocol.errors import RequestError
from tandem.frontend.requests import chat_request
from tandem.frontend.routing import by_session
from tandem.frontend.tolerant import WARNING_HEADER, Notice, TolerantDecoder, left_out_header, notice
from tandem.llm.chat_template import ChatTemplate
from tandem.llm.parsers.base import ParsedDelta, ToolCallDelta
from tandem.llm.postprocess import ProcessedDelta
from tandem.llm.tokenizer import Tokenizer
from tandem.router.selector import select_worker
from tests.support import TESTS

AGENTS = TESTS / "agents"
CLAUDE = json.loads((AGENTS / "claude-code-2.1.197.json").read_text())
CODEX = json.loads((AGENTS / "codex-0.171.0.json").read_text())


def encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


# -- Claude Code -----------------------------------------------------------------------------------


@pytest.mark.parametrize("captured", CLAUDE, ids=["title", "turn1", "turn2"])
def test_every_claude_code_request_is_served(captured):
    request = parse_messages_request(encoded(captured["body"]))
    chat = request.chat(reasoning=False)
    assert chat.model == "agent" and chat.stream
    assert request.left_out_tools == []
    hints = routing_hints(chat, captured["headers"])
    assert hints is not None and hints.session_id == captured["headers"]["x-claude-code-session-id"]


def test_claude_code_turn_maps_onto_chat():
    body = CLAUDE[2]["body"]
    request = parse_messages_request(encoded(body))
    roles = [m["role"] for m in request.messages]
    # The system blocks (its billing header left out), the user turn, the mid-conversation system message,
    # the tool call and its result.
    assert roles == ["system", "user", "system", "assistant", "tool"]
    assert not request.messages[0]["content"].startswith("x-anthropic-billing-header")
    assert request.messages[2]["content"] == body["messages"][1]["content"]
    assert request.messages[3]["tool_calls"][0]["function"]["name"] == "Bash"
    assert request.messages[4]["content"] == "[[say:All done]]"
    assert len(request.tools) == len(body["tools"]) == 25
    assert (request.thinking, request.reasoning_effort, request.max_tokens) == (True, "high", 32000)


def test_server_tools_are_left_out_with_a_warning():
    body = {**CLAUDE[1]["body"], "tools": [*CLAUDE[1]["body"]["tools"],
                                           {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}
    request = parse_messages_request(encoded(body))
    assert request.left_out_tools == ["web_search"]
    assert "web_search" not in {t["function"]["name"] for t in request.tools}
    answer = MessagesAnswer("agent", "msg_1", 10, request.left_out_tools)
    assert "web_search" in answer.headers[WARNING_HEADER]
    assert MessagesAnswer("agent", "msg_2", 10).headers == {}


def thinking_turns(messages: list[dict[str, Any]]) -> list[str]:
    return [m.get("reasoning_content", "-") for m in messages if m["role"] == "assistant"]


@pytest.mark.parametrize(("keep", "kept"), [
    ("all", ["one", "two", "three"]),
    (None, ["-", "-", "three"]),  # Anthropic's default: the last thinking turn
    ({"type": "thinking_turns", "value": 2}, ["-", "two", "three"]),
    ({"type": "thinking_turns", "value": 0}, ["-", "-", "-"]),
])  # fmt: skip
def test_clear_thinking_keeps_the_last_turns(keep, kept):
    turns: list[dict[str, Any]] = []
    for word in ("one", "two", "three"):
        turns += [{"role": "user", "content": "go"},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": word, "signature": ""},
                                                    {"type": "text", "text": "ok"}]}]
    turns.append({"role": "user", "content": "go"})
    edit = {"type": "clear_thinking_20251015"} | ({} if keep is None else {"keep": keep})
    body = {"model": "m", "max_tokens": 10, "messages": turns,
            "context_management": {"edits": [edit, {"type": "clear_tool_uses_20250919"}]}}
    assert thinking_turns(parse_messages_request(encoded(body)).messages) == kept


# -- Codex -----------------------------------------------------------------------------------------


def test_codex_turns_map_onto_chat():
    first, second = (parse_request(encoded(c["body"])) for c in CODEX)
    names = [t["function"]["name"] for t in first.chat([]).tools or []]
    assert "multi_agent_v1__spawn_agent" in names and "exec_command" in names
    assert first.left_out_tools == ["web_search"]
    assert (first.session_id, first.encrypted_reasoning, first.store) == (CODEX[0]["body"]["prompt_cache_key"], True,
                                                                          False)
    assert [m["role"] for m in first.input] == ["developer", "developer", "user", "user"]
    assert [m["role"] for m in second.input][-2:] == ["assistant", "tool"]
    assert second.input[-2]["tool_calls"][0]["function"]["name"] == "exec_command"
    chat = second.chat([])
    hints = routing_hints(chat, CODEX[1]["headers"])
    assert hints is not None and hints.session_id == CODEX[1]["headers"]["session-id"]
    echoed = {t["type"] for t in first.echo()["tools"]}
    assert echoed == {"function", "namespace"}


def answer_for(request: ResponsesRequest) -> ResponseAnswer:
    return ResponseAnswer(request, "resp_1", "agent", [], ResponseStore(4, 1))


def test_a_namespace_function_is_called_back_by_namespace_and_name():
    request = parse_request(encoded(CODEX[0]["body"]))
    answer = answer_for(request)
    answer.collect(ProcessedDelta(), ParsedDelta(tool_calls=[
        ToolCallDelta(0, '{"message": "hi"}', "call_1", "multi_agent_v1__spawn_agent"),
        ToolCallDelta(1, '{"cmd": "ls"}', "call_2", "exec_command")]))
    body = answer.body(Outcome(), Ending("eos", None, True, Usage(10, 4)))
    calls = [(i["name"], i.get("namespace")) for i in body["output"]]
    assert calls == [("spawn_agent", "multi_agent_v1"), ("exec_command", None)]
    assert WARNING_HEADER in answer.headers
    # Sent back, the call is the same function in the conversation.
    item = {**body["output"][0], "call_id": "call_1"}
    assert input_messages([item])[0]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"


def test_opaque_reasoning_comes_back_as_the_thinking():
    request = parse_request(encoded({**CODEX[0]["body"], "stream": False}))
    answer = answer_for(request)
    answer.collect(ProcessedDelta(), ParsedDelta(reasoning="Think "))
    answer.collect(ProcessedDelta(), ParsedDelta(reasoning="é.", content="Done"))
    reasoning = answer.body(Outcome(), Ending("eos", None, False, Usage(10, 4)))["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"].startswith("tandem1:")
    # Codex keeps nothing but the opaque form (store false): that is enough for the next turn.
    kept = {"type": "reasoning", "summary": [], "encrypted_content": reasoning["encrypted_content"]}
    call = {"type": "function_call", "call_id": "c", "name": "exec_command", "arguments": "{}"}
    assert input_messages([kept, call])[0]["reasoning_content"] == "Think é."
    # Another server's encrypted reasoning cannot be read: the turn goes on without it.
    foreign = {**kept, "encrypted_content": "gAAAAABo-opaque"}
    assert "reasoning_content" not in input_messages([foreign, call])[0]
    without = parse_request(encoded({**CODEX[0]["body"], "include": []}))
    plain = answer_for(without)
    plain.collect(ProcessedDelta(), ParsedDelta(reasoning="Think"))
    assert "encrypted_content" not in plain.body(Outcome(), Ending("eos", None, False, Usage(1, 1)))["output"][0]


# -- instructions in chat templates --------------------------------------------------------------------

# A template in the style of those that allow a system message only first (Mistral's, Gemma's).
FIRST_ONLY = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
              "{{ raise_exception('system messages must come first') }}{% endif %}"
              "<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}")


def test_a_template_that_takes_late_system_messages_gets_them_in_place(smollm2):
    template = ChatTemplate.for_tokenizer(Tokenizer.from_folder(smollm2))
    assert template.takes_late_system
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "system", "content": "Now French."},
                {"role": "user", "content": "again"}]
    text = template.render(messages)
    assert "<|im_start|>system\nBe brief." in text and "developer" not in text
    assert text.index("hello") < text.index("<|im_start|>system\nNow French.") < text.index("again")


def test_a_template_that_refuses_them_gets_them_folded_into_the_next_user_turn():
    template = ChatTemplate(FIRST_ONLY)
    assert not template.takes_late_system
    messages = [{"role": "system", "content": "A."}, {"role": "developer", "content": "B."},
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "system", "content": "C."}, {"role": "user", "content": "again"},
                {"role": "system", "content": "D."}]
    assert template.render(messages) == ("<system>A.\n\nB.</system><user>hi</user><assistant>yo</assistant>"
                                         "<user>C.\n\nagain\n\nD.</user>")
    # A template that knows the developer role gets it as it is.
    assert "<developer>" in ChatTemplate(FIRST_ONLY.replace("system", "developer")).render(messages[1:3])


# -- the tolerant reader -------------------------------------------------------------------------------


def test_unknown_fields_are_accepted_and_logged_once(caplog):
    caplog.set_level(logging.WARNING, "tandem.frontend.tolerant")
    body = encoded({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                    "future_field": {"x": 1}, "other_field": 2})
    for _ in range(3):
        assert parse_messages_request(body).max_tokens == 5
    logged = [r.getMessage() for r in caplog.records]
    assert sum("'future_field'" in line for line in logged) == 1
    assert sum("'other_field'" in line for line in logged) == 1
    parse_request(encoded(CODEX[0]["body"]))  # (notices are once per process: maybe logged earlier)
    assert "/v1/responses field 'client_metadata'" in notice._seen
    note_betas("claude-code-20250219, brand-new-beta-2027-01-01")
    note_betas("brand-new-beta-2027-01-01")
    logged = [r.getMessage() for r in caplog.records]
    assert sum("brand-new-beta" in line for line in logged) == 1
    assert not any("claude-code-20250219" in line for line in logged)


def test_the_tolerant_decoder_leaves_errors_to_the_route():
    reader = TolerantDecoder(_CountBody, "/test")
    assert reader.decode(b'{"model": "m", "messages": []}') is not None
    assert reader.decode(b'{"model": 5}') is None  # the route's own decode names the field
    assert reader.decode(b"{") is None
    # An unknown field in a body the lenient decode will refuse anyway: nothing raised here.
    assert reader.decode(b'{"model": "m", "x": 1, "messages": [{"role": "user", "content": "\xff"}]}') is None
    assert reader.decode(b'{"model": "m", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}") is None
    notice = Notice(limit=2)
    for key in ("a", "b", "a", "c", "d"):
        notice.once(key, "x")
    assert notice._seen == {"a", "b", "c"}  # the third marks the limit: nothing more is kept


def test_the_warning_header_holds_only_what_a_header_can():
    header = left_out_header(["web\r\nSet-Cookie: x", "\x1f", "é", "n" * 600])[WARNING_HEADER]
    assert header.startswith("tools left out (tandem does not run them): web??Set-Cookie: x, ?, ?, nnn")
    assert header.endswith("...") and all(" " <= c <= "~" for c in header) and len(header) < 600


# -- sessions ------------------------------------------------------------------------------------------


def test_session_headers_and_their_bounds():
    chat = chat_request(model="m", messages=[], stream=False, max_tokens=None, session_id="from-body")
    assert routing_hints(chat).session_id == "from-body"
    assert routing_hints(chat, {"Session-Id": "codex"}).session_id == "codex"
    both = {"X-Claude-Code-Session-Id": "claude", "X-Dynamo-Session-ID": "dynamo"}
    assert routing_hints(chat, both).session_id == "dynamo"
    with pytest.raises(RequestError) as info:
        routing_hints(chat, {"session-id": "s" * 257})
    assert info.value.param == "session-id"


def test_a_session_stays_on_its_worker_and_sessions_spread():
    workers = [11, 22, 33, 44]
    picks = {f"session-{n}": by_session(workers, f"session-{n}") for n in range(400)}
    assert all(by_session(list(reversed(workers)), s) == w for s, w in picks.items())  # order does not matter
    counts = [list(picks.values()).count(w) for w in workers]
    assert min(counts) > 60, counts
    # A worker leaving moves only its own sessions.
    moved = [s for s, w in picks.items() if w != 44 and by_session(workers[:3], s) != w]
    assert moved == []


def test_kv_ties_go_to_the_session_worker():
    costs = {(1, 0): 5.0, (2, 0): 5.0, (3, 0): 9.0}
    rng = random.Random(0)
    chosen = {select_worker(costs, 0.0, rng, "abc") for _ in range(20)}
    assert len(chosen) == 1 and chosen <= {(1, 0), (2, 0)}
    assert select_worker({(1, 0): 1.0, (2, 0): 5.0}, 0.0, rng, "abc") == (1, 0)  # the cache decides first
