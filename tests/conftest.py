"""Shared fixtures: tiny checkpoints are built once per session (they take a few seconds each)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import make_checkpoint  # noqa: E402
from services import RunningService, start_engine  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU; skipped without CUDA (make gpu-check runs them)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (an NVIDIA GPU)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """checkpoint_dir(arch) -> Path of a cached tiny random checkpoint for that architecture."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_checkpoint(tmp_path_factory.mktemp(arch.replace("-", "_")), arch)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ignis-tiny checkpoint, generated once per test session into a scratch cache."""
    from engine.model.tiny import ensure_tiny_checkpoint

    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def dense_chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dense (Qwen3-layout) random checkpoint that carries the ignis-tiny tokenizer and chat template."""
    from engine.text.tiny_tokenizer import TINY_VOCAB_SIZE, write_tiny_tokenizer

    path = make_checkpoint(tmp_path_factory.mktemp("dense_chat"), "Qwen3ForCausalLM", seed=5,
                           vocab_size=TINY_VOCAB_SIZE, hidden_size=128, num_hidden_layers=4)
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """A real engine process serving ignis-tiny on a free port, one per test module that asks."""
    # One engine serves a whole module's unrelated tests: with the default TTL the first eight
    # conversations would keep the retained slots (protected) and later ones would never be
    # retained. Recency alone here; protection has its own tests (test_engine_tiers.py).
    service = start_engine(tmp_path_factory.mktemp("engine"), str(tiny_model_dir),
                           ["--served-model-name", "ignis-tiny", "--max-queue", "64",
                            "--set", "reuse.retained_interactive_ttl=0"])
    yield service
    assert service.stop() == 0, service.log()
