"""Command lines: `--help` of each service shows the defaults, and `--model` takes a Hugging Face
repo id that is in the local cache (never downloading), with a clear error when it is not."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest

import engine.__main__ as engine_main
import gateway.__main__ as gateway_main
import tierstore.__main__ as tierstore_main
from engine.model.loader import load_model
from engine.model.tiny import resolve_model_path


@pytest.mark.parametrize("service, wants", [
    (engine_main, ["(default: ignis-tiny)", "engine.secret_file=VALUE (default: empty)",
                   "engine.kv_cache_bytes=VALUE (default: 536870912)",
                   "tierstore.address=VALUE (default: empty)"]),
    (tierstore_main, ["kv_disk.bytes=VALUE (default: 4294967296)"]),
    (gateway_main, ["(default: 8000)", "(default: 2.0)"]),
], ids=["engine", "tierstore", "gateway"])
def test_help_shows_the_defaults(service, wants: list[str], capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # no wrapping inside a word
    with pytest.raises(SystemExit) as exited:
        service.parse_args(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for want in wants:
        assert want in text


def fake_hub_cache(root: Path, repo_id: str, checkpoint: Path) -> Path:
    """The Hugging Face cache's own layout: models--org--name/{refs/main, snapshots/<rev>/...}."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    shutil.copytree(checkpoint, snapshot)
    return snapshot


def test_a_repo_id_in_the_local_cache_is_served_from_it(tmp_path: Path, tiny_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = fake_hub_cache(tmp_path / "hub", "ignis-test/tiny-hybrid", tiny_model_dir)
    path = resolve_model_path("ignis-test/tiny-hybrid")
    assert path.resolve() == snapshot.resolve()
    assert load_model(path).config.vocab_size > 0
    with pytest.raises(ValueError, match="nor in the local Hugging Face cache.*huggingface-cli download"):
        resolve_model_path("ignis-test/not-downloaded")


def test_a_missing_directory_is_not_mistaken_for_a_repo_id(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path / "no" / "such" / "dir")) == tmp_path / "no" / "such" / "dir"
