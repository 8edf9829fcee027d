"""A model given as a hub id that is not in the local HF cache yet: the vLLM worker downloads it (from a hub
this test serves, so nothing leaves the machine) and its model card still records the tokenizer and config
files, so a frontend serves the model from the HF cache's snapshot.

The fake hub answers the few Hub API calls huggingface_hub and vLLM make to download a repo (repo info, tree
listing, file resolution), serving the prepared SmolLM2 folder as `acme/tiny-chat` at one commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from tandem.llm.model_card import file_checksums
from tandem.models.resolve import loaded_model_folder, resolve_model
from tests.support.deployment import Deployment
from tests.support.engines import ENGINE_TIMEOUT, engine_memory_args, on_cpu

REPO = "acme/tiny-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# What an engine leaves in the HF cache: the files it needed, not the whole repo (huggingface_hub knows, from
# the tree listing it cached, that such a snapshot is incomplete).
LOADED_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]


class FakeHub:
    """An HTTP server that serves the files of `folder` as hub repo `repo_id` at commit COMMIT (any revision
    name resolves to it); `requests` records what was asked for."""

    def __init__(self, repo_id: str, folder: Path) -> None:
        self.repo_id = repo_id
        self.files = {path.name: path.read_bytes() for path in sorted(folder.iterdir())
                      if path.is_file() and not path.name.startswith(".")}
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloaded(self) -> set[str]:
        """The files whose content was sent."""
        prefix = f"/{self.repo_id}/resolve/"
        return {path.removeprefix(prefix).split("/", 1)[1] for method, path in self.requests
                if method == "GET" and path.startswith(prefix)}

    def answer(self, request: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlparse(request.path).path)
        self.requests.append((request.command, path))
        api = f"/api/models/{self.repo_id}"
        if path == api or path.startswith(f"{api}/revision/"):
            return self._send(request, body, json.dumps({
                "id": self.repo_id, "sha": COMMIT, "siblings": [{"rfilename": name} for name in self.files]}).encode())
        if path.startswith(f"{api}/tree/"):
            return self._send(request, body, json.dumps([
                {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                for name, data in self.files.items()]).encode())
        prefix = f"/{self.repo_id}/resolve/"
        name = path.removeprefix(prefix).split("/", 1)[-1] if path.startswith(prefix) else None
        if name in self.files:
            data = self.files[name]
            return self._send(request, body, data, {"X-Repo-Commit": COMMIT,
                                                   "ETag": f'"{hashlib.sha256(data).hexdigest()}"'})
        # What huggingface_hub takes for "no such file in this repo" (transformers and vLLM probe optional ones).
        request.send_response(404)
        request.send_header("X-Error-Code", "EntryNotFound" if name is not None else "RepoNotFound")
        request.send_header("Content-Length", "0")
        request.end_headers()

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, body: bool, data: bytes, headers: dict[str, str] | None = None) -> None:
        request.send_response(200)
        for name, value in (headers or {}).items():
            request.send_header(name, value)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        if body:
            request.wfile.write(data)


@pytest.fixture
def hub(smollm2: str) -> Iterator[FakeHub]:
    with FakeHub(REPO, Path(smollm2)) as served:
        yield served


# -- where the card's files are, once an engine has loaded the model (no engine) ------------------------------
def test_loaded_model_folder_is_the_snapshot_an_engine_downloaded(hub: FakeHub, smollm2: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import snapshot_download

    cache = tmp_path / "hub"
    snapshot = snapshot_download(REPO, cache_dir=cache, allow_patterns=LOADED_FILES, endpoint=hub.url)
    assert Path(snapshot).name == COMMIT and hub.downloaded() == set(LOADED_FILES)

    assert loaded_model_folder(REPO, "main", str(cache)) == snapshot
    assert loaded_model_folder(REPO, COMMIT, str(cache)) == snapshot
    assert loaded_model_folder(REPO, None, str(cache)) == snapshot
    expected = file_checksums(smollm2)
    assert file_checksums(snapshot) == {name: expected[name] for name in LOADED_FILES if name in expected}
    # Not there: another revision, another repo (the id comes back unchanged, as before).
    assert loaded_model_folder(REPO, "v2", str(cache)) == REPO
    assert loaded_model_folder("acme/other", "main", str(cache)) == "acme/other"
    # A local folder is what the card describes, as before.
    assert loaded_model_folder(smollm2, "main", str(cache)) == smollm2
    # Startup resolution still wants a complete snapshot: a worker given the incomplete one as its model
    # folder could not fetch the missing files.
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    assert resolve_model(REPO) == REPO


def test_offline_hub_id_is_the_snapshot_vllm_resolved(hub: FakeHub, tmp_path: Path) -> None:
    """`HF_HUB_OFFLINE=1` with a cache an earlier download left: vLLM loads the snapshot, and the card describes
    it (the startup resolution, which wants a complete snapshot, passes the hub id on)."""
    from huggingface_hub import snapshot_download

    snapshot = snapshot_download(REPO, cache_dir=tmp_path / "hf" / "hub", allow_patterns=LOADED_FILES,
                                 endpoint=hub.url)
    code = ("from tandem.models.resolve import loaded_model_folder\n"
            "from tandem.vllm.args import build_config\n"
            f"config = build_config(['--model', {REPO!r}], apply_env=False)\n"
            "args = config.engine_args\n"
            "print(config.model_path, loaded_model_folder(args.model, args.revision, args.download_dir))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
                                 "HF_ENDPOINT": "http://127.0.0.1:9"})  # nothing answers there
    assert result.returncode == 0, result.stderr
    model_path, card_folder = result.stdout.split()[-2:]
    assert (model_path, card_folder) == (REPO, snapshot)


# -- a real vLLM worker downloads the model, and a frontend serves it from the card ---------------------------
@pytest.mark.slow
def test_vllm_worker_serves_a_hub_id_it_downloaded(hub: FakeHub, smollm2: str, tmp_path: Path) -> None:
    home = tmp_path / "hf"  # empty: the model reaches the worker only through the hub and the HF cache
    deployment = Deployment(tmp_path, REPO, engines=[], engine_module="tandem.vllm", engine_timeout=ENGINE_TIMEOUT,
                            engine_env={"HF_HOME": str(home), "HF_ENDPOINT": hub.url})
    try:
        deployment.add_engine("--cpu-cores", "0", *engine_memory_args(on_cpu()), "--distributed-executor-backend",
                              "uni", "--max-model-len", "512", "--max-num-seqs", "4")
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= hub.downloaded()

        [card] = deployment.cards()
        snapshot = home / "hub" / "models--acme--tiny-chat" / "snapshots" / COMMIT
        assert card.display_name == REPO and card.source_path == str(snapshot)
        expected = file_checksums(smollm2)
        assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= card.files.keys()
        assert card.files == {name: expected[name] for name in card.files}

        deployment.wait_for_instances(1)
        client = deployment.client()
        assert [model.id for model in client.models.list().data] == [REPO]
        reply = client.chat.completions.create(model=REPO, messages=QUESTION, max_tokens=12, temperature=0)
        assert "Paris" in (reply.choices[0].message.content or "")
    finally:
        deployment.stop()
