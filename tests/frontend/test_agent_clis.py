"""Real agent command-line clients against tandem: Claude Code (`claude -p`, on the Messages API) and Codex
(`codex exec`, on the Responses API), the pinned versions `scripts/install.sh` puts in `.venv/agents`.

Against mocker workers (ending each answer after a few tokens, as a model does) each client runs one turn,
exits 0 and prints the answer. Against two test engines with the Hermes tool-call parser, a run takes two
turns: the scripted model calls the client's shell tool, the client runs the command and sends its output
back, and that output scripts the next answer (`[[say:...]]`, tandem.testing.engine). Both turns, and the
first-turn side request Claude Code makes, carry the client's session header, so all of them reach one
worker (each engine reports its requests to its own file), where round-robin alone would alternate."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.frontend.test_frontend_tools import TEMPLATES
from tests.support import REPO
from tests.support.deployment import Deployment
from tests.support.engines import wait_until

AGENTS = REPO / ".venv" / "agents" / "node_modules" / ".bin"
CLAUDE, CODEX = AGENTS / "claude", AGENTS / "codex"
MODEL = "agent"
# Agent prompts are long (Claude Code's system prompt and 24 tools are ~20k tokens in a template that renders
# tools), so the simulated models get a context that holds them.
CONTEXT = ["--context-length", "65536"]
HERMES = ["--dyn-tool-call-parser", "hermes", "--custom-jinja-template", str(TEMPLATES / "hermes_tools.jinja")]
# A shell command whose output is the next script, written so the command itself holds no directive.
NEXT = "printf '\\x5b\\x5bsay:All done\\x5d\\x5d'"

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is missing: the agent CLIs run on it")


@pytest.fixture(scope="module")
def mocked(tmp_path_factory, smollm2):
    deployment = Deployment(tmp_path_factory.mktemp("agents-mocker"), smollm2, engine_module="tandem.mocker",
                            engines=[["--model-name", MODEL, "--answer-tokens", "8", *CONTEXT]])
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def small(tmp_path_factory, smollm2):
    """A mocker whose context cannot hold an agent's prompt."""
    deployment = Deployment(tmp_path_factory.mktemp("agents-small"), smollm2, engine_module="tandem.mocker",
                            engines=[["--model-name", MODEL, "--answer-tokens", "8", "--context-length", "1024"]])
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, smollm2):
    """Two scripted engines behind a round-robin frontend; `reports[i]` lists engine i's finished requests."""
    root = tmp_path_factory.mktemp("agents-scripted")
    reports = [root / "engine0.log", root / "engine1.log"]
    deployment = Deployment(root, smollm2, engines=[["--model-name", MODEL, *HERMES, *CONTEXT, "--report", str(r)]
                                                    for r in reports])
    deployment.reports = reports  # type: ignore[attr-defined]
    yield deployment
    deployment.stop()


def served(deployment: Deployment) -> list[int]:
    """How many requests each engine has finished so far."""
    return [len(r.read_text().split()) if r.exists() else 0 for r in deployment.reports]  # type: ignore[attr-defined]


def assert_on_one_engine(deployment: Deployment, before: list[int]) -> None:
    """The run's requests (both turns at least) all went to one engine. An engine reports a request as its
    stream closes, which may come just after the client has its answer."""
    def grown() -> list[int]:
        return [after - b for after, b in zip(served(deployment), before, strict=True)]

    wait_until(lambda: sum(grown()) >= 2, "both turns are reported")
    assert 0 in grown(), f"the session's requests were spread over the engines: {grown()}"


def claude(deployment: Deployment, prompt: str, workdir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    assert CLAUDE.exists(), f"{CLAUDE} is missing: scripts/install.sh installs the agent CLIs from npm"
    env = {**os.environ, "ANTHROPIC_BASE_URL": deployment.url, "ANTHROPIC_API_KEY": "none", "HOME": str(workdir),
           "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    return subprocess.run([str(CLAUDE), "-p", prompt, "--model", MODEL, *flags], cwd=workdir, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180)


def codex(deployment: Deployment, prompt: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    assert CODEX.exists(), f"{CODEX} is missing: scripts/install.sh installs the agent CLIs from npm"
    home = workdir / "codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(f'model = "{MODEL}"\nmodel_provider = "tandem"\n'
                                      '[model_providers.tandem]\nname = "tandem"\n'
                                      f'base_url = "{deployment.url}/v1"\nwire_api = "responses"\n'
                                      'env_key = "TANDEM_API_KEY"\n')
    env = {**os.environ, "CODEX_HOME": str(home), "TANDEM_API_KEY": "none"}
    return subprocess.run([str(CODEX), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                           prompt], cwd=workdir, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=180)


def test_claude_code_answers_on_a_mocker(mocked, tmp_path):
    run = claude(mocked, "Say hello in five words.", tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() and "API Error" not in run.stdout


def test_the_mocker_ends_answers_unless_told_to_ignore_eos(mocked):
    message = httpx.post(f"{mocked.url}/v1/messages", timeout=30, json={
        "model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert (message["stop_reason"], message["usage"]["output_tokens"]) == ("end_turn", 8)
    chat = mocked.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=20, extra_body={"ignore_eos": True})
    assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == ("length", 20)


def test_a_prompt_beyond_the_context_is_refused_with_the_context_length(small, tmp_path):
    run = claude(small, "Say hello in five words.", tmp_path)
    assert run.returncode != 0
    assert "API Error: 400" in run.stdout and "maximum context length is 1024 tokens" in run.stdout, run.stdout


def test_codex_answers_on_a_mocker(mocked, tmp_path):
    run = codex(mocked, "Say hello in five words.", tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    answer = run.stdout.strip()
    assert answer and "ERROR" not in run.stderr


def test_claude_code_prints_the_scripted_answer(scripted, tmp_path):
    run = claude(scripted, "[[say:Hello from tandem.]]", tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "Hello from tandem."


def test_claude_code_runs_a_tool_and_finishes_the_turn_on_one_worker(scripted, tmp_path):
    call = json.dumps({"name": "Bash", "arguments": {"command": NEXT, "description": "Print the next script"}})
    before = served(scripted)
    run = claude(scripted, f"Run the command. [[say:<tool_call>\n{call}\n</tool_call>]]", tmp_path,
                 "--allowedTools", "Bash")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "All done"
    assert_on_one_engine(scripted, before)


def test_codex_runs_a_tool_and_finishes_the_turn_on_one_worker(scripted, tmp_path):
    call = json.dumps({"name": "exec_command", "arguments": {"cmd": NEXT}})
    before = served(scripted)
    run = codex(scripted, f"Run the command. [[say:<tool_call>\n{call}\n</tool_call>]]", tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().splitlines()[-1] == "All done"
    assert_on_one_engine(scripted, before)
