"""Tool-call and reasoning parser cost: tandem's parsers (`tandem.llm.parsers`) against the parsers in the
installed `vllm` package, on the same outputs, in the same run; then the frontend's CPU per request with a
parser on against parser off.

    .venv/bin/python bench/parser_bench.py                  # both parts
    .venv/bin/python bench/parser_bench.py --skip-e2e       # parsers only (no processes)

Part 1 (in process): for each family, a model output of a few hundred tokens in that family's format
(thinking or text, then two calls with nested, non-ASCII arguments) is tokenized with the SmolLM2
tokenizer extended with the family's special tokens and detokenized token by token, as the frontend does.
Each parser is then fed those pieces one call per token, tandem's through `feed(piece)`, vLLM's through
`extract_tool_calls_streaming` / `extract_reasoning_streaming` (given the texts and token ids it asks for,
built outside the timed call). Reported: µs per token (mean, p50, p99 of the single calls) over
`--rounds` passes, and each parser's result checked against the expected calls.

Part 2 (processes): a frontend and two test engines scripted to write the same output (thinking, text,
one Hermes call; `--e2e-tokens` tokens); one engine's model has `--dyn-tool-call-parser hermes
--dyn-reasoning-parser qwen3`, the other none. Rounds of `--e2e-requests` streamed requests alternate
between them (each with `tools` on the parsed model); the frontend's CPU seconds per request are compared.
With `--baseline-tree DIR` (a checkout of an earlier commit, e.g. a `git worktree`), a second frontend
from that tree serves the plain model in the same rounds: the parser-off path against the code before.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import Proc, cpu_seconds, free_port, model_path, pct, write_json  # noqa: E402
from tandem.llm.parsers import chat_parser  # noqa: E402

SPECIAL = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "<think>", "</think>",
           "<TOOLCALL>", "</TOOLCALL>", "<tool_calls>", "</tool_calls>", "functools", "<minimax:tool_call>",
           "</minimax:tool_call>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
           "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
           "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>", "<arg_key>", "</arg_key>",
           "<arg_value>", "</arg_value>", "<|tool_call>", "<tool_call|>", '<|"|>', "◁think▷", "◁/think▷",
           "[THINK]", "[/THINK]"]  # fmt: skip
ARGS_1 = {"city": "São Paulo", "days": 3, "units": {"temp": "C", "wind": ["km/h", "m/s"]}}
ARGS_2 = {"query": "cafés near Zürich ☕ open late", "filters": {"rating": 4.5, "tags": ["wifi", "quiet"]}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "object"}}}}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
             "query": {"type": "string"}, "filters": {"type": "object"}}}}}]  # fmt: skip
PROSE = ("The user asks about the weather and about places to sit with a laptop, so I will look up the forecast "
         "for the next days first and then search for quiet cafés with wifi that stay open late. ") * 3


def _json(name: str, key: str, args: dict[str, Any]) -> str:
    return json.dumps({"name": name, key: args}, ensure_ascii=False)


def _args(args: dict[str, Any]) -> str:
    return json.dumps(args, ensure_ascii=False)


def _json_list(key: str = "arguments") -> str:
    return "[" + _json("get_weather", key, ARGS_1) + ", " + _json("search", key, ARGS_2) + "]"


def _invokes(prefix: str = "", typed: bool = False) -> str:
    """Two calls as `<invoke name=...><parameter name=...>` markup (MiniMax; DSML with its prefix)."""
    def param(key: str, value: Any) -> str:
        text = value if isinstance(value, str) else _args(value)
        attr = f' string="{str(isinstance(value, str)).lower()}"' if typed else ""
        return f'<{prefix}parameter name="{key}"{attr}>{text}</{prefix}parameter>\n'
    return "".join(f'<{prefix}invoke name="{name}">\n' + "".join(param(k, v) for k, v in args.items())
                   + f"</{prefix}invoke>\n" for name, args in (("get_weather", ARGS_1), ("search", ARGS_2)))


def _deepseek(v3: bool) -> str:
    calls = "".join(
        "<｜tool▁call▁begin｜>" + ("function<｜tool▁sep｜>" + name + "\n```json\n" + _args(args) + "\n```" if v3
                                  else name + "<｜tool▁sep｜>" + _args(args)) + "<｜tool▁call▁end｜>"
        for name, args in (("get_weather", ARGS_1), ("search", ARGS_2)))
    return PROSE + "<｜tool▁calls▁begin｜>" + calls + "<｜tool▁calls▁end｜>"


def _gemma(value: Any) -> str:
    if isinstance(value, str):
        return '<|"|>' + value + '<|"|>'
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_gemma(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_gemma(v) for v in value) + "]"
    return json.dumps(value)


# family -> (tandem tool parser, tandem reasoning parser, vLLM tool parser, vLLM reasoning parser, output)
FAMILIES: dict[str, tuple[str | None, str | None, str | None, str | None, str]] = {
    "hermes": ("hermes", None, "hermes", None,
               PROSE + "\n<tool_call>\n" + _json("get_weather", "arguments", ARGS_1) + "\n</tool_call>\n<tool_call>\n"
               + _json("search", "arguments", ARGS_2) + "\n</tool_call>"),
    "llama3_json": ("llama3_json", None, "llama3_json", None,
                    "<|python_tag|>" + _json("get_weather", "parameters", ARGS_1) + "; "
                    + _json("search", "parameters", ARGS_2)),
    "mistral": ("mistral", None, "mistral", None,
                PROSE + "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(ARGS_1, ensure_ascii=False)
                + "[TOOL_CALLS]search[ARGS]" + json.dumps(ARGS_2, ensure_ascii=False)),
    "pythonic": ("pythonic", None, "pythonic", None,
                 "[get_weather(city='São Paulo', days=3, units={'temp': 'C', 'wind': ['km/h', 'm/s']}), "
                 "search(query='cafés near Zürich ☕ open late', filters={'rating': 4.5, 'tags': ['wifi', 'quiet']})]"),
    "qwen3_coder": ("qwen3_coder", None, "qwen3_coder", None,
                    PROSE + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=units>\n" + json.dumps(ARGS_1["units"]) +
                    "\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\n"
                    "cafés near Zürich ☕ open late\n</parameter>\n<parameter=filters>\n" + json.dumps(ARGS_2["filters"])
                    + "\n</parameter>\n</function>\n</tool_call>"),
    "deepseek_r1": (None, "deepseek_r1", None, "deepseek_r1", PROSE + "</think>\n\n" + PROSE),
    "qwen3": (None, "qwen3", None, "qwen3", "<think>\n" + PROSE + "</think>\n\n" + PROSE),
    # part 2 (issue 17); None: vLLM has no parser of that format
    "nemotron_deci": ("nemotron_deci", None, None, None, PROSE + "<TOOLCALL>" + _json_list() + "</TOOLCALL>"),
    "phi4": ("phi4", None, "phi4_mini_json", None, "functools" + _json_list()),
    "jamba": ("jamba", None, "jamba", None, PROSE + "<tool_calls>" + _json_list() + "</tool_calls>"),
    "minimax_m2": ("minimax_m2", None, "minimax_m2", None,
                   PROSE + "<minimax:tool_call>\n" + _invokes() + "</minimax:tool_call>"),
    "deepseek_v3": ("deepseek_v3", None, "deepseek_v3", None, _deepseek(v3=True)),
    "deepseek_v3_1": ("deepseek_v3_1", None, "deepseek_v31", None, _deepseek(v3=False)),
    "deepseek_v3_2": ("deepseek_v3_2", None, "deepseek_v32", None,
                      PROSE + "<｜DSML｜function_calls>\n" + _invokes("｜DSML｜", typed=True) + "</｜DSML｜function_calls>"),
    "deepseek_v4": ("deepseek_v4", None, "deepseek_v4", None,
                    PROSE + "<｜DSML｜tool_calls>\n" + _invokes("｜DSML｜", typed=True) + "</｜DSML｜tool_calls>"),
    "kimi_k2": ("kimi_k2", None, "kimi_k2", None,
                PROSE + "<|tool_calls_section_begin|>" + "".join(
                    f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{_args(args)}<|tool_call_end|>"
                    for i, (name, args) in enumerate((("get_weather", ARGS_1), ("search", ARGS_2))))
                + "<|tool_calls_section_end|>"),
    "glm47": ("glm47", None, "glm47", None, PROSE + "".join(
        f"<tool_call>{name}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{v if isinstance(v, str) else _args(v)}"
                                       "</arg_value>" for k, v in args.items()) + "</tool_call>"
        for name, args in (("get_weather", ARGS_1), ("search", ARGS_2)))),
    "gemma4": ("gemma4", None, "gemma4", None, PROSE + "".join(
        f"<|tool_call>call:{name}{_gemma(args)}<tool_call|>" for name, args in (("get_weather", ARGS_1),
                                                                                ("search", ARGS_2)))),
    "kimi": (None, "kimi", None, None, "◁think▷" + PROSE + "◁/think▷" + PROSE),
    "mistral (reasoning)": (None, "mistral", None, None, "[THINK]" + PROSE + "[/THINK]" + PROSE),
    "granite": (None, "granite", None, "granite",
                "Here's my thought process: " + PROSE + "Here's my response: " + PROSE),
    "step3": (None, "step3", None, "step3", PROSE + "</think>" + PROSE),
    "glm45 (reasoning)": (None, "glm45", None, "glm45", "<think>" + PROSE + "</think>" + PROSE),
    "minimax_append_think": (None, "minimax_append_think", None, "minimax_m2_append_think",
                             PROSE + "</think>" + PROSE),
}
EXPECTED_CALLS = {name: 2 for name, (tool, *_) in FAMILIES.items() if tool is not None}
# Why a family has no vLLM row.
NO_VLLM = {"nemotron_deci": "vLLM has no parser of this format", "kimi": "vLLM's kimi parsers read <think>",
           "mistral (reasoning)": "vLLM's needs a Mistral tokenizer"}


def extended_tokenizer(workdir: str) -> str:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HfTokenizer

    folder = os.path.join(workdir, "extended")
    os.makedirs(folder)
    for f in Path(model_path()).iterdir():
        if f.is_file():
            shutil.copy(f, folder)
    hf = HfTokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    hf.save(os.path.join(folder, "tokenizer.json"))
    return folder


def pieces_of(folder: str, text: str) -> tuple[list[int], list[str]]:
    from tandem.llm.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(folder)
    ids = tok.encode(text, add_special_tokens=False)
    step = tok.decode_stream([], skip_special_tokens=False).step
    pieces = [step(i) for i in ids]
    assert "".join(pieces) == text
    return ids, pieces


def time_calls(make: Callable[[], Callable[[int], Any]], n: int, rounds: int) -> tuple[list[float], Any]:
    """Per-call µs of `feed(i)` for i in range(n), over `rounds` fresh parsers; and the last round's result."""
    times: list[float] = []
    result: Any = None
    clock = time.perf_counter_ns
    gc.collect()
    for _ in range(rounds):
        feed = make()
        out = []
        for i in range(n):
            t0 = clock()
            r = feed(i)
            times.append((clock() - t0) / 1000)
            out.append(r)
        result = out
    return times, result


def tandem_run(family: str, pieces: list[str], rounds: int) -> tuple[list[float], int]:
    tool, reasoning, *_ = FAMILIES[family]
    holder: dict[str, Any] = {}

    def make() -> Callable[[int], Any]:
        parser = chat_parser(tool_parser=tool, reasoning_parser=reasoning, tools=TOOLS if tool else None)
        assert parser is not None
        holder["parser"] = parser
        return lambda i: parser.feed(pieces[i])

    times, deltas = time_calls(make, len(pieces), rounds)
    deltas.append(holder["parser"].finish())
    calls = sum(1 for d in deltas for c in d.tool_calls if c.id is not None)
    return times, calls


def vllm_run(family: str, folder: str, ids: list[int], pieces: list[str], rounds: int) -> tuple[list[float], int]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager
    from vllm.tokenizers import get_tokenizer
    from vllm.tool_parsers import ToolParserManager

    _, _, tool, reasoning, _ = FAMILIES[family]
    tok = get_tokenizer(folder)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    texts = ["".join(pieces[: i + 1]) for i in range(len(pieces))]
    previous = [""] + texts[:-1]
    id_prefixes = [ids[: i + 1] for i in range(len(ids))]

    def make() -> Callable[[int], Any]:
        if tool is not None:
            cls = ToolParserManager.get_tool_parser(tool)
            parser = cls(tok, request.tools)
            return lambda i: parser.extract_tool_calls_streaming(
                previous[i], texts[i], pieces[i], id_prefixes[i - 1] if i else [], id_prefixes[i], [ids[i]], request)
        rparser = ReasoningParserManager.get_reasoning_parser(reasoning)(tok)
        return lambda i: rparser.extract_reasoning_streaming(
            previous[i], texts[i], pieces[i], id_prefixes[i - 1] if i else [], id_prefixes[i], [ids[i]])

    times, deltas = time_calls(make, len(pieces), rounds)
    calls = sum(1 for d in deltas if d is not None for c in (getattr(d, "tool_calls", None) or [])
                if c.function is not None and c.function.name)
    return times, calls


def summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"mean_us": statistics.fmean(ordered), "p50_us": pct(ordered, 0.5), "p99_us": pct(ordered, 0.99)}


def part1(rounds: int, workdir: str) -> dict[str, Any]:
    folder = extended_tokenizer(workdir)
    results: dict[str, Any] = {}
    print(f"{'family':<20} {'tokens':>6} | {'tandem µs/token mean p50 p99':>30} | {'vLLM µs/token mean p50 p99':>28} "
          f"| {'vLLM/tandem':>11} | calls t/v")
    for family, (_, _, _, _, text) in FAMILIES.items():
        ids, pieces = pieces_of(folder, text)
        t_times, t_calls = tandem_run(family, pieces, rounds)
        t = summary(t_times)
        expected = EXPECTED_CALLS.get(family, 0)
        results[family] = {"tokens": len(ids), "tandem": t, "tandem_calls": t_calls, "expected_calls": expected}
        line = f"{family:<20} {len(ids):>6} | {t['mean_us']:>10.2f} {t['p50_us']:>8.2f} {t['p99_us']:>9.2f} | "
        if FAMILIES[family][2] is None and FAMILIES[family][3] is None:
            print(line + f"({NO_VLLM[family]}) | {t_calls}/- (of {expected})")
            continue
        v_times, v_calls = vllm_run(family, folder, ids, pieces, rounds)
        v = summary(v_times)
        results[family].update(vllm=v, vllm_calls=v_calls, ratio_mean=v["mean_us"] / t["mean_us"])
        print(line + f"{v['mean_us']:>9.2f} {v['p50_us']:>8.2f} {v['p99_us']:>8.2f} | "
              f"{v['mean_us'] / t['mean_us']:>10.1f}x | {t_calls}/{v_calls} (of {expected})")
    return results


def part2(requests: int, rounds: int, tokens: int, workdir: str, baseline_tree: str | None) -> dict[str, Any]:
    import httpx

    say = ("<think>" + PROSE + "</think>\n\nLet me check. " + PROSE)
    call = "\n<tool_call>\n" + _json("get_weather", "arguments", ARGS_1) + "\n</tool_call>"
    words = say.split(" ")
    while len(words) < tokens // 1.3:
        words += words
    say = " ".join(words[: int(tokens / 1.3)]) + call
    env = {**os.environ, "DYN_FILE_KV": os.path.join(workdir, "kv"), "DYN_NAMESPACE": "parser-bench",
           "DYN_DISCOVERY_BACKEND": "file"}
    procs: list[Proc] = []
    try:
        for name, extra in (("parsed", ["--dyn-tool-call-parser", "hermes", "--dyn-reasoning-parser", "qwen3"]),
                            ("plain", [])):
            procs.append(Proc(f"engine-{name}", [sys.executable, "-m", "tandem.testing.engine", "--model",
                                                 model_path(), "--model-name", name, *extra], env, workdir, core=1))
        frontends: dict[str, tuple[Proc, str]] = {}
        for name, tree in (("current", None), ("baseline", baseline_tree)):
            if name == "baseline" and tree is None:
                continue
            port = free_port()
            proc = Proc(f"frontend-{name}", [sys.executable, "-m", "tandem.frontend", "--http-host", "127.0.0.1",
                                             "--http-port", str(port)], env, workdir, core=0,
                        **({"cwd": tree} if tree else {}))
            procs.append(proc)
            frontends[name] = (proc, f"http://127.0.0.1:{port}")
        for p in procs:
            p.wait_line("READY")
        client = httpx.Client(timeout=60)
        for _, where in frontends.values():
            deadline = time.monotonic() + 60
            while len(client.get(f"{where}/health").json().get("instances", [])) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("a frontend did not see both engines")
                time.sleep(0.1)
        frontend, url = frontends["current"]

        def one(model: str, url: str = url) -> int:
            body: dict[str, Any] = {"model": model, "stream": True, "max_tokens": tokens + 200,
                                    "messages": [{"role": "user", "content": f"[[say:{say}]]"}]}
            if model == "parsed":
                body["tools"] = TOOLS
            n = 0
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    n += line.startswith("data: ")
            return n

        # (label, frontend, model): parser on and off on this tree, and off on the baseline tree.
        runs = [("parsed", "current", "parsed"), ("plain", "current", "plain")]
        if "baseline" in frontends:
            runs.append(("plain (baseline tree)", "baseline", "plain"))
        cpu: dict[str, list[float]] = {label: [] for label, _, _ in runs}
        events: dict[str, int] = {}
        for label, which, model in runs:  # warm-up
            events[label] = one(model, frontends[which][1])
        with ThreadPoolExecutor(4) as pool:
            for _ in range(rounds):
                for label, which, model in runs:
                    proc, where = frontends[which]
                    before = cpu_seconds(proc.pid)
                    list(pool.map(one, [model] * requests, [where] * requests))
                    cpu[label].append((cpu_seconds(proc.pid) - before) / requests * 1000)
        median = {label: statistics.median(values) for label, values in cpu.items()}
        # Rounds drift together (the client shares the machine): compare within each round.
        paired = {label: statistics.median(a / b for a, b in zip(values, cpu["plain"], strict=True))
                  for label, values in cpu.items()}
        print(f"frontend CPU per request ({tokens}-token streamed answers, {requests} requests x {rounds} rounds, "
              f"4 at a time), median of rounds; ratio: median of the per-round ratios to parser off:")
        for label in cpu:
            print(f"  {label:<22} {median[label]:6.2f} ms  {paired[label]:.3f}x  ({events[label]} SSE events per answer)")
        return {"cpu_ms_per_request": cpu, "median_ms": median, "paired_ratio": paired, "sse_events": events}
    finally:
        for p in reversed(procs):
            p.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="passes over each output (part 1)")
    parser.add_argument("--skip-e2e", action="store_true", help="part 1 only")
    parser.add_argument("--e2e-requests", type=int, default=40)
    parser.add_argument("--e2e-rounds", type=int, default=5)
    parser.add_argument("--e2e-tokens", type=int, default=300)
    parser.add_argument("--baseline-tree", default=None, metavar="DIR",
                        help="also run the plain model through a frontend from this checkout (part 2)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON ('-': stdout)")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="parser-bench-")
    try:
        results: dict[str, Any] = {"parsers": part1(args.rounds, workdir)}
        if not args.skip_e2e:
            results["frontend"] = part2(args.e2e_requests, args.e2e_rounds, args.e2e_tokens, workdir,
                                        args.baseline_tree)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    write_json(args.json, results)


if __name__ == "__main__":
    main()
