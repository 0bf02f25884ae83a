"""common/settings.py and common/sizes.py: sources, precedence, parsing, errors."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from pathlib import Path

import pytest

from common.settings import (
    EngineSettings,
    KvDiskSettings,
    ReuseSettings,
    Settings,
    SettingsError,
    TierstoreSettings,
    add_settings_flags,
    load_settings,
    setting_keys,
    settings_from_args,
)
from common.sizes import parse_size
from engine.config import EngineConfig

GiB = 1024**3
MiB = 1024**2


def make_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ignis.toml"
    path.write_text(text)
    return path


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    return parser


# ---------------------------------------------------------------- defaults


def test_defaults() -> None:
    s = load_settings(None, {}, {})
    assert s.reuse == ReuseSettings(
        prompt=True,
        retained_device=8,
        retained_host=0,
        retained_interactive_ttl=300.0,
        kv_host_pool_bytes=GiB,
    )
    assert s.kv_disk.bytes == 4 * GiB
    assert s.kv_disk.path == os.path.expanduser("~/.cache/ignis/kv-disk")
    assert s.engine == EngineSettings(
        page_size=16,
        max_model_len=0,
        max_queue=256,
        max_num_seqs=64,
        prefill_chunk_tokens=2048,
        kv_cache_bytes=512 * MiB,
        dtype="auto",
        device="auto",
    )
    assert s.tierstore == TierstoreSettings(address="")
    assert s.responses.path == os.path.expanduser("~/.cache/ignis/responses")
    assert (s.responses.max_stored, s.responses.ttl) == (10000, 30 * 86400.0)
    assert s == Settings()


def test_value_reads_section_dot_key() -> None:
    settings = load_settings(None, {}, {"tierstore.address": "127.0.0.1:50052"})
    assert settings.value("reuse.retained_device") == 8
    assert settings.value("tierstore.address") == "127.0.0.1:50052"
    assert [settings.value(key) for key in setting_keys()][:2] == [True, 8]  # reuse.prompt, reuse.retained_device


# A value other than the default for every setting the engine core reads.
ENGINE_CONFIG_VALUES = {
    "engine.page_size": 32, "engine.kv_dtype": "bfloat16", "engine.kv_cache_bytes": 3 << 20,
    "engine.max_num_seqs": 5, "engine.prefill_chunk_tokens": 100, "engine.step_time_target_ms": 25.0,
    "engine.max_queue": 9,
    "engine.max_model_len": 777, "reuse.prompt": False, "reuse.retained_device": 2, "reuse.retained_host": 4,
    "reuse.retained_host_tokens": 300, "reuse.retained_interactive_ttl": 12.5, "tierstore.address": "unix:/run/ts.sock",
    "tierstore.secret_file": "/etc/ignis/secret", "engine.spill_window_pages": 3,
    "engine.integrity_key_file": "/var/lib/ignis/key", "speculative.method": "ngram", "speculative.num_tokens": 6,
    "speculative.disable_batch_size": 3, "lora.enabled": True, "lora.max_adapters": 6, "lora.max_rank": 32,
    "lora.dtype": "bfloat16",
    "reuse.encoder_cache_bytes": 5 << 20,
}


def test_the_engine_config_is_built_from_every_setting_it_reads() -> None:
    """One function copies the settings into EngineConfig, and each default is written once: a field
    read from a setting has the setting's default (but the key file, which a config built by hand
    leaves to its process)."""
    read = {f.metadata["setting"]: f.name for f in fields(EngineConfig) if "setting" in f.metadata}
    assert read.keys() == ENGINE_CONFIG_VALUES.keys()
    settings = load_settings(None, {}, ENGINE_CONFIG_VALUES)
    config = EngineConfig.from_settings(settings)
    for key, name in read.items():
        assert getattr(config, name) == ENGINE_CONFIG_VALUES[key] != getattr(EngineConfig(), name), key
        if key != "engine.integrity_key_file":
            assert getattr(EngineConfig(), name) == getattr(EngineConfig.from_settings(Settings()), name), key
    assert EngineConfig().integrity_key_file == ""


def test_env_none_means_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IGNIS_ENGINE__MAX_QUEUE", "7")
    assert load_settings().engine.max_queue == 7
    assert load_settings(env={}).engine.max_queue == 256


# ---------------------------------------------------------------- precedence


def test_toml_then_env_then_override(tmp_path: Path) -> None:
    path = make_toml(
        tmp_path,
        """
[reuse]
retained_device = 2
retained_host = 3
prompt = false

[engine]
page_size = 32
""",
    )
    env = {"IGNIS_REUSE__RETAINED_DEVICE": "4", "IGNIS_REUSE__RETAINED_HOST": "5"}
    overrides = {"reuse.retained_device": "6"}
    s = load_settings(path, env, overrides)
    assert s.reuse.retained_device == 6  # toml 2 < env 4 < override 6
    assert s.reuse.retained_host == 5  # toml 3 < env 5
    assert s.reuse.prompt is False  # toml only
    assert s.engine.page_size == 32  # toml only
    assert s.engine.max_num_seqs == 64  # default


def test_flags_win_over_env_and_file(tmp_path: Path) -> None:
    path = make_toml(tmp_path, "[reuse]\nprompt = true\n[kv_disk]\nbytes = '1GiB'\n")
    args = make_parser().parse_args(
        ["--config", str(path), "--set", "reuse.prompt=off", "--set", "kv_disk.bytes=2GiB"]
    )
    s = settings_from_args(args, {"IGNIS_REUSE__PROMPT": "yes", "IGNIS_KV_DISK__BYTES": "3GiB"})
    assert s.reuse.prompt is False
    assert s.kv_disk.bytes == 2 * GiB


def test_later_set_flag_wins() -> None:
    args = make_parser().parse_args(["--set", "engine.max_queue=1", "--set", "engine.max_queue=9"])
    assert settings_from_args(args, {}).engine.max_queue == 9


def test_config_path_from_env(tmp_path: Path) -> None:
    path = make_toml(tmp_path, "[engine]\nmax_num_seqs = 3\n")
    args = make_parser().parse_args([])
    assert settings_from_args(args, {"IGNIS_CONFIG": str(path)}).engine.max_num_seqs == 3
    assert settings_from_args(args, {}).engine.max_num_seqs == 64


def test_overrides_accept_native_values() -> None:
    s = load_settings(None, {}, {"reuse.prompt": False, "engine.kv_cache_bytes": 1000, "reuse.retained_interactive_ttl": 5})
    assert s.reuse.prompt is False
    assert s.engine.kv_cache_bytes == 1000
    assert s.reuse.retained_interactive_ttl == 5.0


def test_other_ignis_env_vars_are_not_settings() -> None:
    env = {"IGNIS_CONFIG_DIR": "x", "IGNIS_LOG_LEVEL": "debug", "PATH": "/bin", "OTHER__X": "1"}
    assert load_settings(None, env, {}) == Settings()


# ---------------------------------------------------------------- value forms


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        (" 4096 ", 4096),
        ("100B", 100),
        ("100KB", 100_000),
        ("100kb", 100_000),
        ("1.5GB", 1_500_000_000),
        ("2MB", 2_000_000),
        ("3TB", 3 * 10**12),
        ("1KiB", 1024),
        ("1.5KiB", 1536),
        ("512MiB", 512 * MiB),
        ("512 MiB", 512 * MiB),
        ("4GiB", 4 * GiB),
        ("0.5GiB", GiB // 2),
        ("2TiB", 2 * 1024**4),
        ("0.3KiB", 307),  # 307.2 bytes rounds down
        (123, 123),
        (2.0e9, 2_000_000_000),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "1.2.3", "-1", "-1GiB", "4GiBs", "4 G i B", "1e9", "GiB", -5, 1.5, True, None])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        parse_size(bad)


def test_sizes_from_every_source(tmp_path: Path) -> None:
    path = make_toml(tmp_path, '[reuse]\nkv_host_pool_bytes = "512MiB"\n[engine]\nkv_cache_bytes = 1048576\n')
    s = load_settings(path, {"IGNIS_KV_DISK__BYTES": "1.5GB"}, {"engine.kv_cache_bytes": "2MiB"})
    assert s.reuse.kv_host_pool_bytes == 512 * MiB
    assert s.kv_disk.bytes == 1_500_000_000
    assert s.engine.kv_cache_bytes == 2 * MiB


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("True", True),
        ("1", True),
        ("yes", True),
        ("on", True),
        ("ON", True),
        ("false", False),
        ("0", False),
        ("no", False),
        ("off", False),
        (" Off ", False),
    ],
)
def test_booleans_from_env(text: str, expected: bool) -> None:
    assert load_settings(None, {"IGNIS_REUSE__PROMPT": text}, {}).reuse.prompt is expected


def test_booleans_from_toml(tmp_path: Path) -> None:
    assert load_settings(make_toml(tmp_path, "[reuse]\nprompt = false\n"), {}, {}).reuse.prompt is False


def test_choices_are_case_insensitive() -> None:
    s = load_settings(None, {"IGNIS_ENGINE__DTYPE": "BFloat16", "IGNIS_ENGINE__DEVICE": "CUDA:1"}, {})
    assert (s.engine.dtype, s.engine.device) == ("bfloat16", "cuda:1")


def test_kv_disk_path_is_expanded(tmp_path: Path) -> None:
    s = load_settings(None, {"IGNIS_KV_DISK__PATH": "~/kv"}, {})
    assert s.kv_disk.path == os.path.join(os.path.expanduser("~"), "kv")
    s = load_settings(None, {}, {"kv_disk.path": "rel/dir"})
    assert s.kv_disk.path == os.path.join(os.getcwd(), "rel", "dir")


def test_kv_disk_off_needs_no_path() -> None:
    s = load_settings(None, {"IGNIS_KV_DISK__BYTES": "0", "IGNIS_KV_DISK__PATH": ""}, {})
    assert (s.kv_disk.bytes, s.kv_disk.path) == (0, "")


# ---------------------------------------------------------------- errors


def test_bad_integer_from_env_names_variable() -> None:
    with pytest.raises(SettingsError) as e:
        load_settings(None, {"IGNIS_REUSE__RETAINED_DEVICE": "abc"}, {})
    assert str(e.value) == "IGNIS_REUSE__RETAINED_DEVICE: expected an integer, got 'abc'"
    assert e.value.key == "reuse.retained_device"
    assert isinstance(e.value, ValueError)


def test_bad_value_from_toml_names_file_and_key(tmp_path: Path) -> None:
    path = make_toml(tmp_path, "[engine]\npage_size = 1.5\n")
    with pytest.raises(SettingsError, match=rf"^{path} \[engine\] page_size: expected an integer, got 1.5$"):
        load_settings(path, {}, {})


def test_bad_value_from_flag_names_flag() -> None:
    args = make_parser().parse_args(["--set", "reuse.prompt=maybe"])
    with pytest.raises(SettingsError, match=r"^--set reuse.prompt: expected a boolean .* got 'maybe'$"):
        settings_from_args(args, {})


def test_error_names_the_source_that_won(tmp_path: Path) -> None:
    path = make_toml(tmp_path, "[engine]\nmax_queue = 5\n")
    with pytest.raises(SettingsError, match=r"^IGNIS_ENGINE__MAX_QUEUE: must be >= 1, got 0$"):
        load_settings(path, {"IGNIS_ENGINE__MAX_QUEUE": "0"}, {})
    # A bad lower-priority value that is overridden is never parsed.
    assert load_settings(path, {"IGNIS_ENGINE__MAX_QUEUE": "x"}, {"engine.max_queue": 3}).engine.max_queue == 3


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"IGNIS_REUSE__RETAINED_DEVICE": "-1"}, "IGNIS_REUSE__RETAINED_DEVICE: must be >= 0, got -1"),
        ({"IGNIS_REUSE__RETAINED_INTERACTIVE_TTL": "nan"}, "IGNIS_REUSE__RETAINED_INTERACTIVE_TTL: expected a number, got 'nan'"),
        ({"IGNIS_ENGINE__PAGE_SIZE": "0"}, "IGNIS_ENGINE__PAGE_SIZE: must be >= 1, got 0"),
        ({"IGNIS_ENGINE__DTYPE": "int8"}, "IGNIS_ENGINE__DTYPE: expected one of auto, float32, bfloat16, float16; got 'int8'"),
        ({"IGNIS_ENGINE__DEVICE": "tpu"}, "IGNIS_ENGINE__DEVICE: expected auto, cpu, cuda or cuda:N; got 'tpu'"),
        ({"IGNIS_ENGINE__KV_CACHE_BYTES": "lots"}, "IGNIS_ENGINE__KV_CACHE_BYTES: expected a size"),
        ({"IGNIS_KV_DISK__PATH": " "}, "IGNIS_KV_DISK__PATH: must be set when kv_disk.bytes > 0"),
        ({"IGNIS_REUSE__PROMPT": ""}, "IGNIS_REUSE__PROMPT: expected a boolean"),
    ],
)
def test_bad_values(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as e:
        load_settings(None, env, {})
    assert str(e.value).startswith(message)


def test_unknown_key_in_toml(tmp_path: Path) -> None:
    path = make_toml(tmp_path, "[reuse]\nretained_devices = 4\n")
    with pytest.raises(SettingsError, match=r"unknown key 'retained_devices' in \[reuse\]; did you mean 'retained_device'\?") as e:
        load_settings(path, {}, {})
    assert str(e.value).startswith(str(path))


def test_unknown_section_in_toml(tmp_path: Path) -> None:
    path = make_toml(tmp_path, "[reus]\nprompt = true\n")
    with pytest.raises(SettingsError, match=r"unknown section 'reus'; did you mean 'reuse'\?"):
        load_settings(path, {}, {})


def test_top_level_key_in_toml(tmp_path: Path) -> None:
    path = make_toml(tmp_path, "prompt = true\n")
    with pytest.raises(SettingsError, match=r"'prompt' is not a \[section\]"):
        load_settings(path, {}, {})


def test_invalid_or_missing_toml(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="invalid TOML"):
        load_settings(make_toml(tmp_path, "[reuse\n"), {}, {})
    with pytest.raises(SettingsError, match="cannot read the config file"):
        load_settings(tmp_path / "missing.toml", {}, {})


def test_unknown_key_in_env() -> None:
    with pytest.raises(SettingsError, match=r"^IGNIS_ENGINE__PAGESIZE: unknown key 'pagesize' in \[engine\]"):
        load_settings(None, {"IGNIS_ENGINE__PAGESIZE": "16"}, {})


def test_unknown_section_in_env() -> None:
    with pytest.raises(SettingsError, match=r"^IGNIS_KVDISK__BYTES: unknown section 'kvdisk'; did you mean 'kv_disk'\?"):
        load_settings(None, {"IGNIS_KVDISK__BYTES": "1GiB"}, {})


def test_unknown_key_in_flag() -> None:
    args = make_parser().parse_args(["--set", "engine.nope=1"])
    with pytest.raises(SettingsError, match=r"^--set engine.nope: unknown key 'nope' in \[engine\]"):
        settings_from_args(args, {})


@pytest.mark.parametrize("item", ["reuse.prompt", "prompt=1"])
def test_malformed_set_flag(item: str) -> None:
    args = make_parser().parse_args(["--set", item])
    with pytest.raises(SettingsError, match="--set"):
        settings_from_args(args, {})


def test_direct_construction_is_validated() -> None:
    with pytest.raises(SettingsError, match=r"^engine.page_size: must be >= 1, got 0$"):
        EngineSettings(page_size=0)
    with pytest.raises(SettingsError, match=r"^reuse.retained_device: expected an integer, got True$"):
        ReuseSettings(retained_device=True)
    with pytest.raises(SettingsError, match="kv_disk.path"):
        KvDiskSettings(bytes=1, path="")
    with pytest.raises(SettingsError, match="reuse"):
        Settings(reuse=EngineSettings())  # type: ignore[arg-type]


def test_help_lists_keys() -> None:
    help_text = make_parser().format_help()
    assert "--set SECTION.KEY=VALUE" in help_text
    assert "--config PATH" in help_text
