"""docker-compose.yml, docker-compose.cpu.yml, Dockerfile and .dockerignore, checked without a Docker engine.

Each service's compose `command` is parsed by that service's own `parse_args`, with the environment
the container would have (the image's ENV, then the service's `environment`), so a misspelt flag, an
unknown IGNIS_* setting or a port that nobody listens on fails here and not at `docker compose up`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import pytest
import yaml  # type: ignore[import-untyped]

from common import healthcheck
from common.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
IGNIS_SERVICES = ("tierstore", "engine", "gateway")
VENV_BIN = "/opt/venv/bin"


# ---------------------------------------------------------------- compose files


class _Reset:
    """Compose's `!reset` tag: the override file removes the key."""


RESET = _Reset()


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)

# ${NAME}, ${NAME:-default} (unset or empty), ${NAME-default} (unset), ${NAME:?error} (an error when unset
# or empty), ${NAME?error} (when unset), and $$ for a literal $.
_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<default>[^}]*))?\}")


class MissingVariable(ValueError):
    """What `docker compose` refuses to start without (a ${NAME:?error} form)."""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution over a loaded file, for the forms this project uses."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op = m.group("name"), m.group("op")
        if op == ":-" and not env.get(name):
            return m.group("default")
        if op == "-" and name not in env:
            return m.group("default")
        if (op == ":?" and not env.get(name)) or (op == "?" and name not in env):
            raise MissingVariable(f"{name}: {m.group('default')}")
        return env.get(name, "")

    text = _VARIABLE.sub(substitute, value)
    if "$" in _VARIABLE.sub("", value):
        raise ValueError(f"a $ form this test does not model: {value!r}")
    return text


def load_compose(name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A compose file as `docker compose config` sees it with the variables in `env` (none by default)."""
    doc = yaml.load((ROOT / name).read_text(), Loader=ComposeLoader)
    assert isinstance(doc, dict), f"{name} is not a mapping"
    return dict(interpolate(doc, env or {}))


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override file, for mappings and `!reset` (what docker-compose.cpu.yml uses)."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            if value is RESET:
                merged.pop(key, None)
            else:
                merged[key] = merge(merged[key], value) if key in merged else value
        return merged
    if isinstance(base, list) or isinstance(override, list):
        raise NotImplementedError("Compose merges sequences by per-key rules that this test does not model")
    return override


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):  # ["KEY=value", ...]
        env = dict(item.partition("=")[::2] for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def published(service: dict[str, Any]) -> dict[int, int]:
    """container port -> host port, from `ports` in the short syntax ("[IP:]HOST:CONTAINER")."""
    return {container: host_port for container, (_, host_port) in published_on(service).items()}


def published_on(service: dict[str, Any]) -> dict[int, tuple[str, int]]:
    """container port -> (host address, host port); the address is "0.0.0.0" (every interface) unless given."""
    ports: dict[int, tuple[str, int]] = {}
    for spec in service.get("ports", []):
        parts = str(spec).partition("/")[0].split(":")
        assert 2 <= len(parts) <= 3, f"{spec!r}: give the host port explicitly (IPv6 addresses are not modelled)"
        ports[int(parts[-1])] = (parts[0] if len(parts) == 3 else "0.0.0.0", int(parts[-2]))
    return ports


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool


def mounts(service: dict[str, Any]) -> dict[str, Mount]:
    """target -> Mount, from `volumes` in the short syntax ("SOURCE:TARGET[:ro]")."""
    found: dict[str, Mount] = {}
    for spec in service.get("volumes", []):
        source, target, *mode = str(spec).split(":")
        found[target] = Mount(source, target, mode == ["ro"])
    return found


def tmpfs_size(options: str) -> int:
    """Bytes of a tmpfs mount from its options ("size=2g,mode=1777"); k/m/g are powers of 1024."""
    opts = dict(o.partition("=")[::2] for o in options.split(","))
    match = re.fullmatch(r"(\d+)([kmg]?)", opts["size"].lower())
    assert match, f"size={opts['size']!r} is not bytes with an optional k/m/g"
    return int(match.group(1)) * 1024 ** " kmg".index(match.group(2) or " ")


def probe_args(service: dict[str, Any]) -> argparse.Namespace:
    """The service's healthcheck parsed by common.healthcheck's own parser."""
    test = service["healthcheck"]["test"]
    assert test[:4] == ["CMD", "python", "-m", "common.healthcheck"], test
    return healthcheck.parse_args(test[4:])


API_KEY = "a-key-from-dot-env"  # IGNIS_API_KEY as `docker compose` reads it from the environment or .env
COMPOSE = load_compose("docker-compose.yml", {"IGNIS_API_KEY": API_KEY})
CPU = load_compose("docker-compose.cpu.yml")


# ---------------------------------------------------------------- Dockerfile


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def dockerfile_stages(text: str) -> list[list[Instruction]]:
    """Instructions of each stage (the first list holds those before the first FROM)."""
    stages: list[list[Instruction]] = [[]]
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not pending):
            continue  # comment lines are dropped, even inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        pending = ""
        if keyword.upper() == "FROM":
            stages.append([])
        stages[-1].append(Instruction(keyword.upper(), args.strip()))
    return stages


def env_of(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in stage:
        if ins.keyword == "ENV":
            env.update(item.partition("=")[::2] for item in shlex.split(ins.args))
    return env


DOCKERFILE = dockerfile_stages((ROOT / "Dockerfile").read_text())
BUILD_STAGE = next(s for s in DOCKERFILE[1:] if s[0].args.lower().endswith(" as build"))
RUNTIME_STAGE = DOCKERFILE[-1]


# ---------------------------------------------------------------- the services' own parsers


def entry_module(script: str) -> Any:
    """The module behind a console script of pyproject.toml, imported."""
    target = PYPROJECT["project"]["scripts"].get(script)
    assert target is not None, f"{script!r} is not a console script in pyproject.toml"
    module_name, _, func = target.partition(":")
    module = importlib.import_module(module_name)
    assert callable(getattr(module, func, None)), f"{target} is not callable"
    return module


def container_env(service: dict[str, Any]) -> dict[str, str]:
    """What the process sees: the image's ENV, then the service's `environment`."""
    return {**env_of(RUNTIME_STAGE), **environment(service)}


Parse = Callable[..., tuple[argparse.Namespace, Any]]


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Parse:
    """parse(name, compose=COMPOSE) -> what the service's parse_args returns for its compose command."""

    def _parse(name: str, compose: dict[str, Any] = COMPOSE) -> tuple[argparse.Namespace, Any]:
        service = compose["services"][name]
        command = service["command"]
        assert isinstance(command, list), f"{name}: give the command as a list (no shell in between)"
        for key in [k for k in os.environ if k.startswith("IGNIS_")]:
            monkeypatch.delenv(key)
        for key, value in container_env(service).items():
            monkeypatch.setenv(key, value)
        try:
            return entry_module(command[0]).parse_args(command[1:])
        except SystemExit:
            usage = capsys.readouterr().err  # argparse's message
        pytest.fail(f"{name}: {shlex.join(command)} does not parse:\n{usage}", pytrace=False)

    return _parse


# ---------------------------------------------------------------- tests: compose


def test_the_four_services() -> None:
    assert set(COMPOSE["services"]) == {"jaeger", *IGNIS_SERVICES}
    assert COMPOSE["name"] == "ignis"  # docs/docker.md names the volumes ignis_*


def test_ignis_services_run_one_image_built_from_the_dockerfile() -> None:
    services = [COMPOSE["services"][name] for name in IGNIS_SERVICES]
    assert {s["image"] for s in services} == {"ignis:cuda"}
    for s in services:
        assert s["build"] == {"context": ".", "args": {"VARIANT": "cuda"}}
        assert s["init"] is True
        assert "user" not in s  # the image's user: the tierstore's 0600 arena file must open in the engine


@pytest.mark.parametrize("name", IGNIS_SERVICES)
def test_commands_parse_with_the_services_own_parsers(parse: Parse, name: str) -> None:
    args, _ = parse(name)
    assert args.host == "0.0.0.0", f"{name} must listen beyond the container's loopback"
    grace = re.fullmatch(r"(\d+)s", COMPOSE["services"][name]["stop_grace_period"])
    assert grace and int(grace.group(1)) > args.grace, f"{name}: Docker would kill it before its --grace ends"
    assert entry_module(COMPOSE["services"][name]["command"][0]).__name__ == f"{name}.__main__"


def test_ignis_settings_in_the_environment_are_known() -> None:
    for name in IGNIS_SERVICES:
        load_settings(None, env=container_env(COMPOSE["services"][name]))  # raises on an unknown key or bad value


def test_only_the_gateway_is_published_and_jaegers_ui_on_loopback(parse: Parse) -> None:
    services = COMPOSE["services"]
    gateway_args, _ = parse("gateway")
    assert published_on(services["gateway"]) == {gateway_args.port: ("0.0.0.0", 8000)}  # behind the key
    assert published_on(services["jaeger"]) == {16686: ("127.0.0.1", 16686)}  # the UI has no login; no OTLP
    assert "ports" not in services["engine"] and "ports" not in services["tierstore"]


def test_the_stack_does_not_start_without_an_api_key() -> None:
    for env in ({}, {"IGNIS_API_KEY": ""}):
        with pytest.raises(MissingVariable, match="IGNIS_API_KEY"):
            load_compose("docker-compose.yml", env)


def test_the_published_gateway_requires_the_key_on_the_api_and_metrics(parse: Parse) -> None:
    args, config = parse("gateway")
    assert config.api_key == API_KEY and args.metrics_auth
    assert config.public_paths == ("/health",)  # the healthcheck's route, and nothing else, is open
    assert urlsplit(probe_args(COMPOSE["services"]["gateway"]).url).path in config.public_paths


@pytest.mark.parametrize("name", ["engine", "tierstore"])
def test_grpc_and_metrics_ports_are_exposed_on_the_network(parse: Parse, name: str) -> None:
    args, _ = parse(name)
    assert args.metrics_port > 0, f"{name} serves no /metrics"
    assert {int(p) for p in COMPOSE["services"][name]["expose"]} == {args.port, args.metrics_port}


@pytest.mark.parametrize("name", ["engine", "tierstore"])
def test_grpc_healthcheck_asks_the_port_the_service_binds(parse: Parse, name: str) -> None:
    args, _ = parse(name)
    probe = probe_args(COMPOSE["services"][name])
    assert probe.kind == "grpc"
    host, _, port = probe.address.rpartition(":")
    assert (host, int(port)) == ("127.0.0.1", args.port)
    assert probe.service == ""  # the whole server: engine health says SERVING only once the model is loaded


def test_gateway_healthcheck_asks_its_health_route(parse: Parse) -> None:
    args, _ = parse("gateway")
    probe = probe_args(COMPOSE["services"]["gateway"])
    assert probe.kind == "http"
    url = urlsplit(probe.url)
    assert (url.scheme, url.hostname, url.port, url.path) == ("http", "127.0.0.1", args.port, "/health")


def test_jaeger_has_a_healthcheck_on_its_admin_port() -> None:
    test = COMPOSE["services"]["jaeger"]["healthcheck"]["test"]
    assert test[0] == "CMD" and "http://127.0.0.1:14269/" in test


def test_start_order_waits_for_health() -> None:
    services = COMPOSE["services"]
    expected = {"jaeger": set(), "tierstore": {"jaeger"}, "engine": {"jaeger", "tierstore"},
                "gateway": {"jaeger", "engine"}}
    for name, needs in expected.items():
        depends = services[name].get("depends_on", {})
        assert set(depends) == needs, name
        for other in depends:
            assert depends[other] == {"condition": "service_healthy"}, (name, other)
            assert services[other]["healthcheck"]["test"], f"{other} has no healthcheck to wait for"


def test_engine_and_tierstore_share_dev_shm(parse: Parse) -> None:
    services = COMPOSE["services"]
    engine_shm, tierstore_shm = mounts(services["engine"])["/dev/shm"], mounts(services["tierstore"])["/dev/shm"]
    assert engine_shm.source == tierstore_shm.source  # one tmpfs: the engine opens the path the tierstore names
    assert not engine_shm.read_only and not tierstore_shm.read_only
    volume = COMPOSE["volumes"][tierstore_shm.source]
    assert volume["driver_opts"]["type"] == "tmpfs"
    _, settings = parse("tierstore")
    assert tmpfs_size(volume["driver_opts"]["o"]) >= settings.reuse.kv_host_pool_bytes


def test_gpu_reserved_for_the_engine_only() -> None:
    services = COMPOSE["services"]
    devices = services["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert all("deploy" not in services[name] for name in services if name != "engine")


def test_cpu_override_builds_the_cpu_image_without_a_gpu(parse: Parse) -> None:
    assert set(CPU["services"]) <= set(COMPOSE["services"]), "the override names a service that does not exist"
    merged = merge(COMPOSE, CPU)
    services = merged["services"]
    assert services["engine"]["deploy"]["resources"]["reservations"].get("devices") is None
    images = {services[name]["image"] for name in IGNIS_SERVICES}
    assert images == {"ignis:cpu"}  # not the CUDA image's tag: both builds can sit side by side
    for name in IGNIS_SERVICES:
        assert services[name]["build"] == {"context": ".", "args": {"VARIANT": "cpu"}}
        assert services[name]["command"] == COMPOSE["services"][name]["command"]
        parse(name, merged)
    assert services["jaeger"] == COMPOSE["services"]["jaeger"]


def test_kv_disk_volume_holds_the_disk_tier(parse: Parse) -> None:
    _, settings = parse("tierstore")
    assert settings.kv_disk.bytes > 0
    mount = mounts(COMPOSE["services"]["tierstore"])[settings.kv_disk.path]
    assert mount.source in COMPOSE["volumes"] and not mount.read_only


def volume_holding(service: dict[str, Any], path: str) -> Mount | None:
    """The named volume whose mount holds `path` (a folder or file below its target), if one does."""
    found = [m for m in mounts(service).values()
             if Path(path).is_relative_to(m.target) and Path(path) != Path(m.target)]
    return max(found, key=lambda m: len(m.target)) if found else None


def test_the_engines_responses_and_integrity_key_outlive_its_container(parse: Parse) -> None:
    """Stored responses and the integrity key sit on a named volume of the engine's, not in the container's
    home: a recreated container keeps its responses, and its key, without which every state on the
    kv-disk volume is refused ("integrity tag mismatch", cached_tokens 0)."""
    engine = COMPOSE["services"]["engine"]
    _, settings = parse("engine")
    for path in (settings.responses.path, settings.engine.integrity_key_file):
        volume = volume_holding(engine, path)
        assert volume is not None, f"{path} is in the container's own layer: lost when it is recreated"
        assert volume.source in COMPOSE["volumes"] and not volume.read_only
        assert "driver_opts" not in (COMPOSE["volumes"][volume.source] or {}), f"{volume.source}: on disk, not tmpfs"
        assert all(volume.source not in [m.source for m in mounts(COMPOSE["services"][name]).values()]
                   for name in ("tierstore", "gateway")), "the engine's key is its alone"


def test_the_image_prepares_the_engines_state_volume_private_to_its_user(parse: Parse) -> None:
    """An empty named volume takes the owner and mode of the image's folder it is mounted on: the image's
    user (the engine's) must own it, and the integrity key's folder must be 0700 (the key file is 0600)."""
    engine = COMPOSE["services"]["engine"]
    _, settings = parse("engine")
    volume = volume_holding(engine, settings.engine.integrity_key_file)
    assert volume is not None
    prepare = next(ins.args for ins in RUNTIME_STAGE if ins.keyword == "RUN" and "useradd" in ins.args)
    user = re.search(r"useradd .*?(\S+)$", prepare.split("&&")[0].strip())
    assert user and user.group(1) == "ignis"
    steps = [step.split() for step in prepare.split("&&")]
    assert any(step[:2] == ["mkdir", "-p"] and volume.target in step for step in steps)
    assert any(step[:2] == ["chown", "ignis:ignis"] and volume.target in step for step in steps)
    if Path(settings.engine.integrity_key_file).parent == Path(volume.target):  # else the engine makes it 0700
        assert any(step[0] == "chmod" and step[1] in ("700", "0700") and volume.target in step for step in steps)


def test_models_volume_and_model_choice(parse: Parse) -> None:
    engine = COMPOSE["services"]["engine"]
    models = next(m for m in mounts(engine).values() if m.source == "models")
    assert "models" in COMPOSE["volumes"] and models.read_only
    args, _ = parse("engine")
    assert args.model == "ignis-tiny"  # MODEL unset
    chosen = load_compose("docker-compose.yml", {"IGNIS_API_KEY": API_KEY, "MODEL": f"{models.target}/Qwen3-8B"})
    args, _ = parse("engine", chosen)
    assert Path(args.model).parent == Path(models.target)


def test_generated_model_cache_is_a_writable_volume() -> None:
    engine = COMPOSE["services"]["engine"]
    cache = mounts(engine)[container_env(engine)["IGNIS_CACHE_DIR"]]
    assert cache.source in COMPOSE["volumes"] and not cache.read_only


def test_traces_go_to_jaeger() -> None:
    services = COMPOSE["services"]
    assert environment(services["jaeger"])["COLLECTOR_OTLP_ENABLED"] == "true"
    names = set()
    for name in IGNIS_SERVICES:
        env = environment(services[name])
        endpoint = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert endpoint.scheme == "http" and endpoint.hostname == "jaeger"
        assert endpoint.port in {int(p) for p in services["jaeger"]["expose"]}  # Jaeger's OTLP receiver
        names.add(env["OTEL_SERVICE_NAME"])
    assert names == {f"ignis-{name}" for name in IGNIS_SERVICES}


def test_services_find_each_other_by_name(parse: Parse) -> None:
    tierstore_args, _ = parse("tierstore")
    engine_args, engine_settings = parse("engine")
    _, gateway_config = parse("gateway")
    assert engine_settings.tierstore.address == f"tierstore:{tierstore_args.port}"
    assert gateway_config.engines == [f"engine:{engine_args.port}"]


def test_the_gateway_sends_the_engines_secret_from_a_tmpfs_only_they_mount(parse: Parse) -> None:
    """Over TCP the engine refuses every call but health without its secret (engine.secret_file, which it
    creates): the gateway reads the same file, on a memory-backed volume no other service mounts."""
    _, engine_settings = parse("engine")
    _, gateway_config = parse("gateway")
    secret = engine_settings.engine.secret_file
    assert secret and gateway_config.engine_secret_file == secret
    services = COMPOSE["services"]
    engine_volume, gateway_volume = volume_holding(services["engine"], secret), volume_holding(services["gateway"], secret)
    assert engine_volume is not None and gateway_volume is not None
    assert engine_volume.source == gateway_volume.source and not engine_volume.read_only
    assert COMPOSE["volumes"][engine_volume.source]["driver_opts"]["type"] == "tmpfs"  # never on a disk
    assert engine_volume.source not in [m.source for m in mounts(services["tierstore"]).values()]


# ---------------------------------------------------------------- tests: Dockerfile and context


def _torch_install_script() -> str:
    runs = [ins.args for ins in BUILD_STAGE if ins.keyword == "RUN" and "download.pytorch.org" in ins.args]
    assert len(runs) == 1, "expected one RUN that installs torch from the PyTorch index"
    return runs[0]


@pytest.mark.parametrize(("variant", "index"), [("cuda", "https://download.pytorch.org/whl/cu130"),
                                                ("cpu", "https://download.pytorch.org/whl/cpu")])
def test_variant_build_arg_picks_the_torch_index(tmp_path: Path, variant: str, index: str) -> None:
    # The install step's shell, run as the build runs it; `pip` records its arguments instead of
    # downloading (no network here).
    args = {ins.args.partition("=")[0]: ins.args.partition("=")[2] for ins in BUILD_STAGE if ins.keyword == "ARG"}
    assert args["VARIANT"] == "cuda"
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    shim = tmp_path / "bin" / "pip"
    shim.parent.mkdir()
    shim.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > pip.args\n')
    shim.chmod(0o755)
    env = {**args, "VARIANT": variant, "PATH": f"{shim.parent}:/usr/bin:/bin"}
    subprocess.run(["/bin/sh", "-c", _torch_install_script()], cwd=tmp_path, env=env, check=True)
    torch_pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch=="))
    assert (tmp_path / "pip.args").read_text().split() == ["install", "--index-url", index, torch_pin]


def test_unknown_variant_fails_the_build(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    result = subprocess.run(["/bin/sh", "-c", _torch_install_script()], cwd=tmp_path, capture_output=True,
                            text=True, env={"VARIANT": "rocm", "PATH": "/usr/bin:/bin"})
    assert result.returncode != 0 and "VARIANT must be cuda or cpu" in result.stderr


def test_stubs_are_generated_before_the_project_is_installed() -> None:
    copied = [ins.args.split()[0] for ins in BUILD_STAGE if ins.keyword == "COPY" and "--from" not in ins.args]
    runs = [ins.args for ins in BUILD_STAGE if ins.keyword == "RUN"]
    install = next(i for i, run in enumerate(runs) if re.search(r"pip install (--no-deps )?\.(\s|$)", run))
    generate = next(i for i, run in enumerate(runs) if "python scripts/gen_protos.py" in run)
    assert generate < install or runs[install].index("gen_protos.py") < runs[install].index("pip install")
    assert {"protos", "scripts/gen_protos.py", "pyproject.toml"} <= set(copied)
    packages = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
    missing = [p for p in packages if p != "ignis" and p not in copied]  # ignis/: generated, not copied
    assert not missing, f"pyproject packages the image does not copy: {missing}"


def test_runtime_stage_runs_every_service_as_a_user() -> None:
    keywords = [ins.keyword for ins in RUNTIME_STAGE]
    assert "ENTRYPOINT" not in keywords  # compose's `command` is the whole argv
    assert any(ins.keyword == "COPY" and ins.args.split() == ["--from=build", "/opt/venv", "/opt/venv"]
               for ins in RUNTIME_STAGE)
    assert any(ins.keyword == "RUN" and "python -m venv /opt/venv" in ins.args for ins in BUILD_STAGE)
    assert env_of(RUNTIME_STAGE)["PATH"].split(":")[0] == VENV_BIN  # `python` in the healthchecks is the venv's
    users = [ins.args for ins in RUNTIME_STAGE if ins.keyword == "USER"]
    assert users and users[-1] not in ("root", "0")
    default = json.loads(next(ins.args for ins in RUNTIME_STAGE if ins.keyword == "CMD"))
    args, _ = entry_module(default[0]).parse_args(default[1:])
    # The engine has no authentication: listening beyond the container's loopback is asked for, not the default.
    assert args.host == "127.0.0.1"


def test_build_context_leaves_out_local_state() -> None:
    patterns = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "ignis", "bench/peers/build", "**/__pycache__"} <= patterns
