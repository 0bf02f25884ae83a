"""The checkpoint's generation_config.json gives the sampling defaults of fields a request leaves unset
(issue 42), as vLLM applies them; a field the request sets keeps its value."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import grpc
import pytest

from engine.proto_convert import sampling_params
from engine.sampling.defaults import SamplingDefaults
from ignis.v1 import engine_pb2, engine_pb2_grpc
from services import start_engine

QWEN_LIKE = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "temperature": 0.6, "top_k": 20,
             "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.05, "max_new_tokens": 7}


def write(folder: Path, config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_the_defaults_are_read_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ignis.engine"):
        defaults = SamplingDefaults.from_checkpoint(write(tmp_path, QWEN_LIKE))
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.05,
                                        max_tokens=7)
    assert "temperature=0.6" in caplog.text and "top_k=20" in caplog.text


def test_no_file_or_a_bad_value_keeps_the_built_in_defaults(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert SamplingDefaults.from_checkpoint(tmp_path) == SamplingDefaults()
    (tmp_path / "generation_config.json").write_text("{not json")
    assert SamplingDefaults.from_checkpoint(tmp_path) == SamplingDefaults()
    bad = {"temperature": 9.0, "top_p": 0, "top_k": 2.5, "repetition_penalty": -1, "max_new_tokens": 0,
           "min_p": "0.1", "top_k_": 3}
    with caplog.at_level(logging.WARNING, logger="ignis.engine"):
        assert SamplingDefaults.from_checkpoint(write(tmp_path, bad)) == SamplingDefaults()
    assert "temperature = 9.0 ignored" in caplog.text


def test_unset_fields_take_the_defaults_and_set_ones_win() -> None:
    defaults = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.05,
                                max_tokens=7)
    unset = sampling_params(engine_pb2.SamplingParams(), defaults, room=100)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty, unset.max_tokens) \
        == pytest.approx((0.6, 0.95, 20, 0.05, 1.05, 7))
    given = sampling_params(engine_pb2.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                                      repetition_penalty=1.0, max_tokens=50), defaults, room=100)
    assert (given.temperature, given.top_p, given.top_k, given.min_p, given.repetition_penalty, given.max_tokens) \
        == (1.0, 1.0, 0, 0.0, 1.0, 50)  # "off", said explicitly, is kept
    assert sampling_params(engine_pb2.SamplingParams(), defaults, room=4).max_tokens == 4  # never past the context
    assert sampling_params(engine_pb2.SamplingParams()).max_tokens is None  # no default: the rest of the context


def test_an_engine_serves_its_checkpoints_defaults(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A checkpoint saying temperature 0 and max_new_tokens 5: a request that sets neither is greedy and
    gets 5 tokens, the same as one that asks for exactly that."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    write(model, {"temperature": 0.0, "max_new_tokens": 5})
    engine = start_engine(tmp_path / "engine", str(model), ["--served-model-name", "m"])
    try:
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)

            def tokens(**sampling: object) -> list[int]:
                request = engine_pb2.GenerateRequest(model="m", text="Tell me about caches.",
                                                     sampling=engine_pb2.SamplingParams(ignore_eos=True, **sampling))  # type: ignore[arg-type]
                return [t for m in stub.Generate(request, timeout=120) for t in m.token_ids]
            unset = tokens()
            assert len(unset) == 5
            assert unset == tokens(temperature=0.0, max_tokens=5)
            assert len(tokens(max_tokens=9)) == 9
        assert "sampling defaults from" in engine.log()
    finally:
        engine.stop()
