"""Settings shared by all three services.

Sections and keys mirror the TOML file::

    [reuse]
    prompt = true
    retained_device = 8
    kv_host_pool_bytes = "1GiB"

    [kv_disk]
    bytes = "4GiB"
    path = "~/.cache/ignis/kv-disk"

Each key is read from the TOML file, then from an environment variable
``IGNIS_<SECTION>__<KEY>`` (``IGNIS_REUSE__PROMPT=0``, ``IGNIS_KV_DISK__BYTES=8GiB``),
then from an override keyed ``section.key`` (``--set reuse.prompt=false`` on a
command line); the later source wins. An unknown section or key, or a value
that does not parse, is a SettingsError naming the source and the key.

Environment variables whose name starts with ``IGNIS_`` and contains ``__`` are
settings; other ``IGNIS_`` variables (``IGNIS_CONFIG``) are not.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import tempfile
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from common.sizes import parse_size

ENV_PREFIX = "IGNIS_"
CONFIG_ENV = "IGNIS_CONFIG"  # path of the TOML file when --config is not given

GiB = 1024**3
MiB = 1024**2


class SettingsError(ValueError):
    """A setting that is unknown or does not parse; the message names where it came from.

    ``key`` is the ``section.key`` concerned, when there is one.
    """

    def __init__(self, message: str, *, key: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.key = key
        self.detail = detail if detail is not None else message


# ---------------------------------------------------------------- value parsers
# Each takes a native value (from TOML or code) or a string (from the
# environment or a flag) and returns the typed value, or raises ValueError
# with a message that names the value.

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    raise ValueError(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {value!r}")


def parse_int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"expected an integer, got {value!r}")


def parse_float(value: object) -> float:
    result: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    elif isinstance(value, str):
        try:
            result = float(value.strip())
        except ValueError:
            pass
    if result is None or not math.isfinite(result):
        raise ValueError(f"expected a number, got {value!r}")
    return result


def parse_str(value: object) -> str:
    if isinstance(value, str):
        return value.strip()
    raise ValueError(f"expected a string, got {value!r}")


def parse_path(value: object) -> str:
    """A filesystem path, ``~`` expanded and made absolute; empty stays empty."""
    text = parse_str(value)
    return os.path.abspath(os.path.expanduser(text)) if text else ""


def parse_step_time_target(value: object) -> float:
    """`auto` (0.0), `off` (infinity) or milliseconds > 0 (engine.step_time_target_ms)."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word == "auto":
            return 0.0
        if word == "off":
            return math.inf
        try:
            value = float(word)
        except ValueError:
            raise ValueError(f"expected auto, off or milliseconds; got {value!r}") from None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    if value == 0:
        return 0.0
    raise ValueError(f"expected auto, off or milliseconds > 0; got {value!r}")


def choice(*allowed: str) -> Callable[[object], str]:
    """A parser accepting one of ``allowed`` (case-insensitive)."""

    def parse_choice(value: object) -> str:
        word = value.strip().lower() if isinstance(value, str) else None
        if word is None or word not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}; got {value!r}")
        return word

    return parse_choice


def parse_device(value: object) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    word = value.strip().lower() if isinstance(value, str) else ""
    index = word.removeprefix("cuda:")
    if word in ("auto", "cpu", "cuda") or (index != word and index.isdigit()):
        return word
    raise ValueError(f"expected auto, cpu, cuda or cuda:N; got {value!r}")


# ---------------------------------------------------------------- sections


def setting(default: Any, parse: Callable[[object], Any], *, minimum: float | None = None, doc: str) -> Any:
    """Declares one key of a section: its default, parser, lower bound and meaning."""
    return field(default=default, metadata={"parse": parse, "minimum": minimum, "doc": doc})


class _Section:
    """Base of a settings section: parses and checks every field after __init__."""

    __slots__ = ()
    NAME: ClassVar[str]

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            key = f"{self.NAME}.{f.name}"
            try:
                value = f.metadata["parse"](getattr(self, f.name))
                low = f.metadata["minimum"]
                if low is not None and value < low:
                    raise ValueError(f"must be >= {low}, got {value!r}")
            except ValueError as e:
                raise SettingsError(f"{key}: {e}", key=key, detail=str(e)) from None
            setattr(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Checks across keys of the section; raises SettingsError."""


@dataclass(slots=True)
class ReuseSettings(_Section):
    """[reuse]: retained state and prompt reuse."""

    NAME: ClassVar[str] = "reuse"
    prompt: bool = setting(True, parse_bool, doc="reuse retained state for prompts found by content")
    retained_device: int = setting(8, parse_int, minimum=0, doc="retained-state slots in device memory (an "
                                   "attention-only model: kept prompt ends; 0 = none)")
    retained_host: int = setting(0, parse_int, minimum=0, doc="retained-state slots in pinned host memory; "
                                 "captures go there first (hybrid models)")
    retained_host_tokens: int = setting(0, parse_int, minimum=0, doc="the longest state a host slot holds (it "
                                        "sizes each slot); 0 = the context length")
    retained_interactive_ttl: float = setting(
        300.0, parse_float, minimum=0, doc="seconds an interactive state, once claimed, stays protected from eviction"
    )
    kv_host_pool_bytes: int = setting(GiB, parse_size, minimum=0, doc="size of the KV-RAM arena (bytes)")
    encoder_cache_bytes: int = setting(256 * MiB, parse_size, minimum=0, doc="the vision tower's outputs kept on "
                                       "the device by image digest, least recently used out (bytes); 0 keeps none")


@dataclass(slots=True)
class KvDiskSettings(_Section):
    """[kv_disk]: the disk tier."""

    NAME: ClassVar[str] = "kv_disk"
    bytes: int = setting(4 * GiB, parse_size, minimum=0, doc="disk tier budget (bytes); 0 turns it off")
    path: str = setting("~/.cache/ignis/kv-disk", parse_path, doc="folder of the disk tier")
    copy_ahead: bool = setting(True, parse_bool, doc="write each KV-RAM state's disk copy in the background while "
                               "the disk has free room, so RAM pressure frees a copied state without a write")

    def check(self) -> None:
        if self.bytes > 0 and not self.path:
            detail = "must be set when kv_disk.bytes > 0"
            raise SettingsError(f"kv_disk.path: {detail}", key="kv_disk.path", detail=detail)


def runtime_dir() -> str:
    """Where a service keeps its sockets: ``$XDG_RUNTIME_DIR/ignis``, else ``<tmp>/ignis-<uid>`` (made 0700 by its user)."""
    base = os.environ.get("XDG_RUNTIME_DIR", "")
    if base and os.path.isabs(base) and os.path.isdir(base):
        return os.path.join(base, "ignis")
    return os.path.join(tempfile.gettempdir(), f"ignis-{os.getuid()}")


def default_tierstore_socket() -> str:
    return os.path.join(runtime_dir(), "tierstore.sock")


def default_engine_socket() -> str:
    return os.path.join(runtime_dir(), "engine.sock")


@dataclass(slots=True)
class EngineSettings(_Section):
    """[engine]: the model host."""

    NAME: ClassVar[str] = "engine"
    page_size: int = setting(16, parse_int, minimum=1, doc="tokens per KV page")
    max_model_len: int = setting(0, parse_int, minimum=0, doc="context length; 0 = the model's own")
    max_queue: int = setting(256, parse_int, minimum=1, doc="waiting requests before RESOURCE_EXHAUSTED")
    max_num_seqs: int = setting(64, parse_int, minimum=1, doc="sequences running at once")
    prefill_chunk_tokens: int = setting(2048, parse_int, minimum=1, doc="prefill token budget per step")
    step_time_target_ms: float = setting(0.0, parse_step_time_target,
                                         doc="a step that runs prompt tokens is sized to take about this long, "
                                             "so requests that arrive meanwhile wait little: auto (2.5x the "
                                             "engine's cheapest recent prefill step while others wait, 8x "
                                             "alone), off (the token budget alone) or milliseconds")
    kv_cache_bytes: int = setting(512 * MiB, parse_size, minimum=1, doc="device KV page pool (bytes)")
    dtype: str = setting("auto", choice("auto", "float32", "bfloat16", "float16"), doc="compute dtype")
    kv_dtype: str = setting("auto", choice("auto", "float32", "bfloat16", "float16"),
                            doc="dtype of the KV pages (auto: the compute dtype); state slots keep theirs")
    weight_dtype: str = setting("auto", choice("auto", "float32", "bfloat16"),
                                doc="the linear layers' weights (auto: the compute dtype); bfloat16 on an fp32 CPU "
                                    "model: half the bytes per decode step, inputs rounded to bf16 (oneDNN)")
    device: str = setting("auto", parse_device, doc="auto, cpu, cuda or cuda:N")
    cpu_linear: str = setting("auto", choice("auto", "onednn", "c", "torch"),
                              doc="fp32 CPU linear layers: onednn (weights reordered once at load: faster "
                                  "decode and prefill, a copy of them in memory), c (oneDNN, but calls of at "
                                  "most 8 rows on ignis' C kernel over the weights as loaded), auto (oneDNN, and "
                                  "each row count up to 8 on whichever of the two measured faster at load) or "
                                  "torch (MKL on the mapped file, no copy)")
    integrity_key_file: str = setting("~/.cache/ignis/engine-integrity.key", parse_path,
                                      doc="the engine's key for the integrity tag on state it writes to the tierstore "
                                          "(made 0600 on first start; states tagged with another key are never served)")
    spill_window_pages: int = setting(16, parse_int, minimum=1,
                                      doc="KV pages of a live sequence moved down to KV-RAM per step when a "
                                          "higher-ranked request needs its room")
    socket: str = setting(default_engine_socket(), parse_path,
                          doc="Unix socket the engine serves gRPC on (0600, in a 0700 folder), for a gateway on "
                              "this host; empty = none (then --port)")
    secret_file: str = setting("", parse_path, doc="file holding the shared secret every TCP call (--port) must "
                                                   "carry, health checks aside (the engine creates it, 0600, if "
                                                   "missing); required for TCP")


@dataclass(slots=True)
class TierstoreSettings(_Section):
    """[tierstore]: how the engine and its tierstore reach each other."""

    NAME: ClassVar[str] = "tierstore"
    address: str = setting("", parse_str, doc="the engine's tierstore: unix:/path (one host) or host:port (TCP, "
                                              "with tierstore.secret_file); empty = none")
    socket: str = setting(default_tierstore_socket(), parse_path,
                          doc="Unix socket the tierstore listens on (0600, in a 0700 folder); empty = none")
    secret_file: str = setting("", parse_path, doc="file holding the shared secret of TCP calls (the tierstore "
                                                   "creates it, 0600, if missing); required for TCP")

    def check(self) -> None:
        if self.address.startswith("unix:") and not os.path.isabs(self.address.removeprefix("unix:")):
            detail = f"a Unix socket address needs an absolute path (unix:/path), got {self.address!r}"
            raise SettingsError(f"tierstore.address: {detail}", key="tierstore.address", detail=detail)


@dataclass(slots=True)
class SpeculativeSettings(_Section):
    """[speculative]: drafted tokens verified in one forward of the model (speculative decoding)."""

    NAME: ClassVar[str] = "speculative"
    method: str = setting("none", choice("none", "ngram", "mtp"),
                          doc="none, ngram (prompt lookup: the continuation of the latest earlier occurrence of the "
                              "last tokens; every model) or mtp (the checkpoint's multi-token-prediction layer)")
    num_tokens: int = setting(4, parse_int, minimum=1, doc="tokens drafted per step (k); each step verifies them "
                                                          "in one forward and keeps between 1 and k+1 tokens")
    disable_batch_size: int = setting(-1, parse_int, minimum=-1,
                                      doc="no drafting in a step with more than this many sequences running "
                                          "(vLLM's speculative_disable_by_batch_size); 0: no limit; -1: 1 on "
                                          "models with recurrent state (a hybrid's verify loses at batch 8 at "
                                          "every acceptance, bench/speculative.py), no limit on the others")


@dataclass(slots=True)
class LoraSettings(_Section):
    """[lora]: LoRA adapters served beside the base model (`--lora NAME=PATH`, /v1/load_lora_adapter)."""

    NAME: ClassVar[str] = "lora"
    enabled: bool = setting(False, parse_bool, doc="serve LoRA adapters (on by itself with --lora): the model's "
                                                  "linears get their adapter slots at start")
    max_adapters: int = setting(4, parse_int, minimum=1, doc="adapters resident at once (their slots: each holds "
                                                            "one adapter's weights for every adaptable linear)")
    max_rank: int = setting(16, parse_int, minimum=1, doc="the highest adapter rank served (a slot's width)")
    dtype: str = setting("auto", choice("auto", "float32", "bfloat16"),
                         doc="the adapters' weights as served: auto (the model's dtype), float32, or bfloat16 "
                             "(half the memory and the bytes a decode step reads; the weights rounded once, "
                             "the products summed in fp32; a rounded adapter's state is its own)")


@dataclass(slots=True)
class ResponsesSettings(_Section):
    """[responses]: the engine's store of Responses API records (`store`, `previous_response_id`)."""

    NAME: ClassVar[str] = "responses"
    path: str = setting("~/.cache/ignis/responses", parse_path,
                        doc="LMDB folder of stored responses (0700, files 0600); empty = store none")
    max_stored: int = setting(10000, parse_int, minimum=1, doc="stored responses kept; the oldest go first")
    ttl: float = setting(30 * 86400.0, parse_float, minimum=0,
                         doc="seconds a stored response is kept (30 days, as OpenAI); 0 = until evicted")


_SECTIONS: dict[str, type[_Section]] = {
    cls.NAME: cls for cls in (ReuseSettings, KvDiskSettings, EngineSettings, TierstoreSettings, ResponsesSettings,
                              SpeculativeSettings, LoraSettings)
}


@dataclass(slots=True)
class Settings:
    """All settings, one attribute per TOML section."""

    reuse: ReuseSettings = field(default_factory=ReuseSettings)
    kv_disk: KvDiskSettings = field(default_factory=KvDiskSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    tierstore: TierstoreSettings = field(default_factory=TierstoreSettings)
    responses: ResponsesSettings = field(default_factory=ResponsesSettings)
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), _SECTIONS[f.name]):
                raise SettingsError(f"{f.name}: expected a {_SECTIONS[f.name].__name__}", key=f.name)

    def value(self, key: str) -> Any:
        """The value of ``section.key``."""
        section, _, name = key.partition(".")
        return getattr(getattr(self, section), name)


def default_value(key: str) -> Any:
    """A setting's built-in default (parsed: a path expanded), for records built from settings."""
    section, _, name = key.partition(".")
    return getattr(_SECTIONS[section](), name)


def _default_of(key: str) -> object:
    """A setting's built-in default, as `--help` shows it."""
    value = default_value(key)
    return value if value != "" else "empty"


def setting_keys() -> list[str]:
    """Every ``section.key``, in declaration order."""
    return [f"{name}.{f.name}" for name, cls in _SECTIONS.items() for f in fields(cls)]  # type: ignore[arg-type]


# ---------------------------------------------------------------- loading

# section -> key -> (raw value, where it came from)
_Raw = dict[str, dict[str, tuple[Any, str]]]


def _unknown(source: str, kind: str, name: str, known: list[str], where: str = "") -> SettingsError:
    """An unknown section or key, with the closest known name as a hint."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(known)})"
    return SettingsError(f"{source}: unknown {kind} {name!r}{where}{hint}")


def _put(raw: _Raw, section: str, key: str, value: Any, source: str) -> None:
    cls = _SECTIONS.get(section)
    if cls is None:
        raise _unknown(source, "section", section, list(_SECTIONS))
    keys = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    if key not in keys:
        raise _unknown(source, "key", key, keys, f" in [{section}]")
    raw.setdefault(section, {})[key] = (value, source)


def _read_toml(path: str, raw: _Raw) -> None:
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except OSError as e:
        raise SettingsError(f"{path}: cannot read the config file: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"{path}: invalid TOML: {e}") from None
    for section, table in doc.items():
        if not isinstance(table, dict):
            raise SettingsError(
                f"{path}: {section!r} is not a [section]; settings live in "
                + ", ".join(f"[{s}]" for s in _SECTIONS)
            )
        for key, value in table.items():
            _put(raw, section, key, value, f"{path} [{section}] {key}")


def _read_env(env: Mapping[str, str], raw: _Raw) -> None:
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        section, _, key = name[len(ENV_PREFIX):].partition("__")
        _put(raw, section.lower(), key.lower(), env[name], name)


def _read_overrides(overrides: Mapping[str, Any], raw: _Raw) -> None:
    for dotted, value in overrides.items():
        section, dot, key = dotted.partition(".")
        if not dot:
            raise SettingsError(f"--set {dotted}: expected section.key, e.g. reuse.prompt")
        _put(raw, section, key, value, f"--set {dotted}")


def load_settings(
    config_path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Settings from a TOML file, then ``IGNIS_<SECTION>__<KEY>`` variables, then overrides.

    ``env`` defaults to ``os.environ``; pass ``{}`` to ignore the environment.
    ``overrides`` maps ``"section.key"`` to a string (as typed on a command
    line) or a native value. Raises SettingsError naming the source and key.
    """
    raw: _Raw = {}
    if config_path is not None:
        _read_toml(os.fspath(config_path), raw)
    _read_env(os.environ if env is None else env, raw)
    _read_overrides(overrides or {}, raw)

    sections: dict[str, _Section] = {}
    for name, cls in _SECTIONS.items():
        given = raw.get(name, {})
        try:
            sections[name] = cls(**{key: value for key, (value, _) in given.items()})
        except SettingsError as e:
            key = e.key.partition(".")[2] if e.key else ""
            if key in given:  # name the source that supplied the bad value
                raise SettingsError(f"{given[key][1]}: {e.detail}", key=e.key, detail=e.detail) from None
            raise
    return Settings(**sections)  # type: ignore[arg-type]


# ---------------------------------------------------------------- command line


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """Adds ``--config PATH`` and a repeatable ``--set section.key=value``."""
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help=f"TOML settings file (default: ${CONFIG_ENV} if set)",
    )
    parser.add_argument(
        "--set",
        dest="settings_overrides",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        help="override one setting; repeatable; wins over the file and IGNIS_* variables. "
        "Keys: " + ", ".join(setting_keys()),
    )


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    """Settings from flags added by add_settings_flags; ``env`` defaults to ``os.environ``."""
    env = os.environ if env is None else env
    overrides: dict[str, str] = {}
    for item in args.settings_overrides:
        dotted, eq, value = item.partition("=")
        if not eq:
            raise SettingsError(f"--set {item}: expected SECTION.KEY=VALUE, e.g. reuse.prompt=false")
        overrides[dotted.strip()] = value
    config = args.config or env.get(CONFIG_ENV) or None
    return load_settings(config, env, overrides)


def parse_service_args(
    parser: argparse.ArgumentParser, shorthands: Mapping[str, str], argv: list[str] | None = None
) -> tuple[argparse.Namespace, Settings]:
    """Parse a service's command line: its own flags, `shorthands` (flag name -> settings key,
    e.g. {"max_queue": "engine.max_queue"}, each a `--max-queue VALUE` that wins like --set),
    and --config/--set. A bad setting is a usage error naming it."""
    for name, key in shorthands.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                            help=f"same as --set {key}=VALUE (default: {_default_of(key)})")
    add_settings_flags(parser)
    args = parser.parse_args(argv)
    for name, key in shorthands.items():
        value = getattr(args, name)
        if value is not None:
            args.settings_overrides.append(f"{key}={value}")
    try:
        return args, settings_from_args(args)
    except SettingsError as exc:
        parser.error(str(exc))
