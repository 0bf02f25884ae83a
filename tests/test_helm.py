"""deploy/helm/ignis rendered by Helm itself (helm-python-sdk: Helm's Go SDK behind a C ABI, from PyPI; no
cluster needed), then checked like the compose file (tests/test_compose.py): every container command
parses with its service's own argument parser and settings, and ports, probes, volumes, the engines'
headless Service and the gateway's DNS name agree; every object validates against the Kubernetes schema
(kubernetes-validate); `helm lint` finds nothing. One probe runs for real: the tierstore's exec probe
against a real tierstore on its Unix socket."""

from __future__ import annotations

import argparse
import base64
import importlib
import os
import re
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, Iterator

import helm_python as helm
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

from common import healthcheck
from common.bearer import MIN_SECRET, read_secret
from common.secret_auth import load_secret
from common.settings import load_settings
from common.sizes import parse_size
from engine.tiers.integrity import IntegrityKey
from gateway.discovery import DnsName
from services import start_tierstore

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "ignis"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
KUBE_VERSION = "1.31.0"
RELEASE, NAMESPACE = "prod", "llm"
BASE = {"apiKey": {"value": "a-key"}}


def quantity(q: str) -> int:
    """Bytes of a Kubernetes quantity with a binary suffix ("2100Mi", "4Gi")."""
    return parse_size(re.sub(r"([KMGT])i$", r"\1iB", q))


def render(values: dict[str, Any] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """`helm template` of the chart: {(kind, name): object}."""
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render({**BASE, **(values or {})}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for path, text in files.items():
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict[str, Any]]:
    return render()


def engine_pod(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return objects[("StatefulSet", f"{RELEASE}-ignis-engine")]["spec"]["template"]


def gateway_pod(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return objects[("Deployment", f"{RELEASE}-ignis-gateway")]["spec"]["template"]


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def env_of(c: dict[str, Any]) -> dict[str, str]:
    """Plain values, and `secret:NAME/KEY` for one taken from a Secret."""
    out = {}
    for item in c.get("env", []):
        if "value" in item:
            out[item["name"]] = str(item["value"])
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            out[item["name"]] = f"secret:{ref['name']}/{ref['key']}"
    return out


def mounts(pod: dict[str, Any], c: dict[str, Any]) -> dict[str, tuple[dict[str, Any], bool]]:
    """mountPath -> (the pod volume, or {"claimTemplate": NAME} for a StatefulSet's per-pod claim; read-only)."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    return {m["mountPath"]: (volumes.get(m["name"], {"claimTemplate": m["name"]}), bool(m.get("readOnly")))
            for m in c.get("volumeMounts", [])}


def entry_module(script: str) -> Any:
    target = PYPROJECT["project"]["scripts"][script]
    return importlib.import_module(target.partition(":")[0])


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    """parse(container, secrets) -> (args, config) from the service's own parse_args, in its environment."""

    def _parse(c: dict[str, Any], secrets: dict[str, str] | None = None) -> tuple[argparse.Namespace, Any]:
        for key in [k for k in os.environ if k.startswith("IGNIS_")]:
            monkeypatch.delenv(key)
        for key, value in env_of(c).items():
            monkeypatch.setenv(key, (secrets or {}).get(value, value))
        command = c["command"]
        try:
            parsed: tuple[argparse.Namespace, Any] = entry_module(command[0]).parse_args(command[1:])
            return parsed
        except SystemExit:
            pytest.fail(f"{c['name']}: {command} does not parse:\n{capsys.readouterr().err}", pytrace=False)

    yield _parse


# ---------------------------------------------------------------- Helm's and Kubernetes' own checks


def test_the_objects(objects: dict[tuple[str, str], dict[str, Any]]) -> None:
    assert set(objects) == {("StatefulSet", f"{RELEASE}-ignis-engine"), ("Service", f"{RELEASE}-ignis-engine"),
                            ("Deployment", f"{RELEASE}-ignis-gateway"), ("Service", f"{RELEASE}-ignis-gateway"),
                            ("Secret", f"{RELEASE}-ignis-api-key"), ("Secret", f"{RELEASE}-ignis-engine-key"),
                            ("Secret", f"{RELEASE}-ignis-engine-auth")}


@pytest.mark.parametrize("values", [{}, {"otlpEndpoint": "http://jaeger-collector.obs:4317",
                                         "gateway": {"metricsAuth": False},
                                         "engine": {"models": {"existingClaim": "checkpoints"}, "onePerHost": False,
                                                    "extraArgs": ["--max-num-seqs", "128"]},
                                         "tierstore": {"kvDisk": {"storageClassName": "fast-ssd"}}}])
def test_every_object_validates_against_the_kubernetes_schema(values: dict[str, Any]) -> None:
    for key, obj in render(values).items():
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)  # raises naming the field


def test_helm_lint_is_clean() -> None:
    result = helm.lint(str(CHART), BASE, strict=True)
    messages = [m for m in result.get("messages", []) if str(m.get("severity", "")).upper() not in ("INFO", "1")]
    assert not result.get("errors") and not messages, result


def test_no_api_key_no_chart() -> None:
    with pytest.raises(helm.HelmError, match="apiKey"):
        with helm.Chart.load(str(CHART)) as chart:
            chart.render({}, name=RELEASE, namespace=NAMESPACE)
    objects = render({"apiKey": {"existingSecret": "ignis-keys", "value": ""}})
    assert ("Secret", f"{RELEASE}-ignis-api-key") not in objects  # the operator's Secret is used instead
    env = env_of(container(gateway_pod(objects), "gateway"))
    assert env["IGNIS_API_KEY"] == "secret:ignis-keys/api-key"


# ---------------------------------------------------------------- the commands, by their own parsers


def test_every_command_parses(objects: dict[tuple[str, str], dict[str, Any]], parse: Any) -> None:
    for pod, name in ((engine_pod(objects), "tierstore"), (engine_pod(objects), "engine"),
                      (gateway_pod(objects), "gateway")):
        c = container(pod, name)
        args, settings = parse(c, {f"secret:{RELEASE}-ignis-api-key/api-key": "a-key"})
        assert entry_module(c["command"][0]).__name__ == f"{name}.__main__"
        assert args.host == "0.0.0.0", f"{name} must listen beyond the pod's loopback"
        assert pod["spec"]["terminationGracePeriodSeconds"] > args.grace, f"{name} would be killed mid-drain"
        if name != "gateway":
            load_settings(None, env=env_of(c))  # raises on an unknown key or a bad value


def test_engine_and_tierstore_share_the_arena_and_the_socket(objects: dict[tuple[str, str], dict[str, Any]],
                                                              parse: Any) -> None:
    pod = engine_pod(objects)
    store, engine = container(pod, "tierstore"), container(pod, "engine")
    store_args, store_settings = parse(store)
    engine_args, engine_settings = parse(engine)
    store_mounts, engine_mounts = mounts(pod, store), mounts(pod, engine)
    shm, _ = store_mounts["/dev/shm"]
    assert engine_mounts["/dev/shm"] == (shm, False)  # one memory-backed folder: the arena file the engine maps
    assert shm["emptyDir"]["medium"] == "Memory"
    assert quantity(shm["emptyDir"]["sizeLimit"]) > store_settings.reuse.kv_host_pool_bytes
    assert store_args.port is None  # no TCP: the private Unix socket only (no secret needed)
    socket = Path(store_settings.tierstore.socket)
    assert engine_settings.tierstore.address == f"unix:{socket}"
    sockets = [p for p in store_mounts if socket.is_relative_to(p) and p != "/"]
    assert sockets and engine_mounts[sockets[0]] == store_mounts[sockets[0]]
    assert socket.parent != Path(sockets[0])  # the tierstore makes its 0700 folder inside the shared one
    kv = Path(store_settings.kv_disk.path)
    assert store_settings.kv_disk.bytes > 0
    disk = next(p for p in store_mounts if kv.is_relative_to(p) and p != "/dev/shm")
    assert kv != Path(disk)  # a folder of the tierstore's own inside the claim (the claim's root is root's)
    claim = objects[("StatefulSet", f"{RELEASE}-ignis-engine")]["spec"]["volumeClaimTemplates"][0]
    assert store_mounts[disk] == ({"claimTemplate": claim["metadata"]["name"]}, False)
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert quantity(claim["spec"]["resources"]["requests"]["storage"]) > \
        store_settings.kv_disk.bytes
    assert "kv-disk" not in {v["name"] for v in pod["spec"]["volumes"]}  # per pod, from the claim template
    assert pod["spec"]["securityContext"]["runAsUser"] == 10001  # one user: its 0600 arena opens in the engine


# ---------------------------------------------------------------- what the engine keeps across restarts


def mount_like_kubelet(folder: Path, secret: dict[str, Any], volume: dict[str, Any], fs_group: int | None) -> None:
    """A Secret volume as kubelet writes it (its AtomicWriter): the files in a timestamped folder, `..data`
    a symlink to that, each item a symlink through `..data`; the files root's, in the volume's mode, and with
    an fsGroup also in that group with 0440 added (SetVolumeOwnership on a read-only volume: defaultMode
    0400 becomes 0440, kubernetes/kubernetes#57923)."""
    stamp = folder / "..2025_01_01_00_00_00.000000001"
    stamp.mkdir(parents=True)
    source = volume["secret"]
    for item in source.get("items") or [{"key": k, "path": k} for k in secret["data"]]:
        target = stamp / item["path"]
        target.write_bytes(base64.b64decode(secret["data"][item["key"]]))
        os.chown(target, 0, 0 if fs_group is None else fs_group)
        os.chmod(target, item.get("mode", source.get("defaultMode", 0o644)) | (0 if fs_group is None else 0o440))
        (folder / item["path"]).symlink_to(Path("..data") / item["path"])
    (folder / "..data").symlink_to(stamp.name)


def test_the_engines_integrity_key_is_a_secret_made_once_and_kept(
        objects: dict[tuple[str, str], dict[str, Any]], parse: Any) -> None:
    """With a new key every state the engine wrote (KV-disk outlives the pod) is refused: the key is a
    Secret the chart makes at install (random: two renders differ), finds again at every upgrade (lookup,
    which `helm template` cannot exercise: checked in the template's text) and uninstall leaves (keep)."""
    pod = engine_pod(objects)
    engine = container(pod, "engine")
    _, settings = parse(engine)
    key_file = Path(settings.engine.integrity_key_file)
    volume, read_only = mounts(pod, engine)[str(key_file.parent)]
    assert read_only and volume["secret"]["items"] == [{"key": key_file.name, "path": key_file.name}]
    secret = objects[("Secret", volume["secret"]["secretName"])]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(secret["data"][key_file.name])) == 32
    again = render()[("Secret", volume["secret"]["secretName"])]
    assert again["data"] != secret["data"]  # generated, not a constant of the chart
    template = (CHART / "templates" / "engine-key-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template and "$key | default (randBytes 32)" in template
    mode = volume["secret"]["defaultMode"]
    assert mode & 0o007 == 0 and mode & 0o040  # others never; the engine reads it through the pod's fsGroup
    assert pod["spec"]["securityContext"]["fsGroup"] and pod["spec"]["securityContext"]["runAsUser"] != 0
    assert volume["secret"]["secretName"] not in str(mounts(pod, container(pod, "tierstore")))  # the engine's only
    own = render({"engine": {"integrityKey": {"existingSecret": "engine-keys"}}})
    assert not any(kind == "Secret" and "engine-key" in name for kind, name in own)
    own_pod = engine_pod(own)
    own_volume, _ = mounts(own_pod, container(own_pod, "engine"))[str(key_file.parent)]
    assert own_volume["secret"]["secretName"] == "engine-keys"


@pytest.mark.skipif(os.geteuid() != 0, reason="makes root-owned files, as kubelet does")
def test_the_engine_reads_its_key_as_kubernetes_mounts_the_secret(
        objects: dict[tuple[str, str], dict[str, Any]], parse: Any, tmp_path: Path) -> None:
    """The rendered Secret and volume, mounted as kubelet mounts them (root's, group fsGroup, 0440, a
    symlink into ..data): the engine's IntegrityKey.from_file takes the Secret's 32 bytes, and still
    refuses a key others may read, its group may write, or a group-readable key of a user's own."""
    pod = engine_pod(objects)
    engine = container(pod, "engine")
    _, settings = parse(engine)
    key_file = Path(settings.engine.integrity_key_file)
    volume, _ = mounts(pod, engine)[str(key_file.parent)]
    secret = objects[("Secret", volume["secret"]["secretName"])]
    folder = tmp_path / "mount"  # stands in for key_file.parent
    mount_like_kubelet(folder, secret, volume, pod["spec"]["securityContext"]["fsGroup"])
    path = folder / key_file.name
    assert path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o440
    data = b"some state bytes"
    tag = IntegrityKey.from_file(path).tag(b"n" * 16, b"s" * 16, 3, data)
    mac = IntegrityKey(base64.b64decode(secret["data"][key_file.name])).hasher(b"n" * 16, b"s" * 16, 3, len(data), tag)
    mac.update(data)
    assert IntegrityKey.matches(tag, mac)  # the Secret's key, read through the symlink
    assert sorted(p.name for p in folder.iterdir()) == sorted(["..data", "..2025_01_01_00_00_00.000000001",
                                                                key_file.name])  # nothing was created
    for mode, owner in ((0o444, 0), (0o460, 0), (0o440, 10001), (0o640, 10001)):
        os.chown(path, owner, pod["spec"]["securityContext"]["fsGroup"])
        os.chmod(path, mode)
        with pytest.raises(PermissionError, match="open to others"):
            IntegrityKey.from_file(path)


# ---------------------------------------------------------------- the engines' TCP secret


def secret_volume(pod: dict[str, Any], c: dict[str, Any], file: Path) -> dict[str, Any]:
    """The Secret volume that holds `file` in container `c`, mounted read-only, that one file its only item."""
    volume, read_only = mounts(pod, c)[str(file.parent)]
    assert read_only and volume["secret"]["items"] == [{"key": file.name, "path": file.name}]
    return volume


GW_SECRETS = {f"secret:{RELEASE}-ignis-api-key/api-key": "a-key"}


def test_the_engines_tcp_secret_is_a_secret_made_once_that_the_gateways_send(
        objects: dict[tuple[str, str], dict[str, Any]], parse: Any) -> None:
    """The engine serves --port only with engine.secret_file (it exits 2 without): the file comes from a
    Secret the chart makes at install (random, printable: it goes in a header), finds again at every
    upgrade (lookup) and keeps, mounted read-only in the engine pods and in the gateways, which send it."""
    pod = engine_pod(objects)
    engine = container(pod, "engine")
    args, settings = parse(engine)
    assert args.port is not None and settings.engine.secret_file  # TCP, so a secret
    secret_file = Path(settings.engine.secret_file)
    volume = secret_volume(pod, engine, secret_file)
    mode = volume["secret"]["defaultMode"]
    assert mode & 0o007 == 0 and mode & 0o040  # others never; read through the pod's fsGroup
    assert pod["spec"]["securityContext"]["fsGroup"] and pod["spec"]["securityContext"]["runAsUser"] != 0
    name = volume["secret"]["secretName"]
    assert name not in str(mounts(pod, container(pod, "tierstore")))  # the engine's and the gateways' only
    gw_pod = gateway_pod(objects)
    gateway = container(gw_pod, "gateway")
    _, config = parse(gateway, GW_SECRETS)
    assert config.engine_secret_file == str(secret_file)
    gw_volume = secret_volume(gw_pod, gateway, secret_file)
    assert gw_volume["secret"] == volume["secret"] and gw_pod["spec"]["securityContext"]["fsGroup"]
    secret = objects[("Secret", name)]
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    value = base64.b64decode(secret["data"][secret_file.name])
    assert len(value.strip()) >= MIN_SECRET and value.decode().isprintable()
    assert render()[("Secret", name)]["data"] != secret["data"]  # generated, not a constant of the chart
    template = (CHART / "templates" / "engine-auth-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template and "$secret | default (" in template
    own = render({"engine": {"authSecret": {"existingSecret": "engine-auth"}}})
    assert not any(kind == "Secret" and "engine-auth" in name for kind, name in own)
    for p, c in ((engine_pod(own), "engine"), (gateway_pod(own), "gateway")):
        assert secret_volume(p, container(p, c), secret_file)["secret"]["secretName"] == "engine-auth"


@pytest.mark.skipif(os.geteuid() != 0, reason="makes root-owned files, as kubelet does")
def test_the_engine_and_the_gateways_read_their_secret_as_kubernetes_mounts_it(
        objects: dict[tuple[str, str], dict[str, Any]], parse: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rendered Secret and volume, mounted as kubelet mounts them (root's, group fsGroup, 0440, a symlink
    into ..data) and read as the pod's user: the engine (load_secret, which would create a missing file) and
    the gateway (read_secret) take the Secret's value; a file root's but open to others, or another user's,
    is still refused (whoever wrote it would have chosen the secret)."""
    pod = engine_pod(objects)
    engine = container(pod, "engine")
    _, settings = parse(engine)
    secret_file = Path(settings.engine.secret_file)
    volume = secret_volume(pod, engine, secret_file)
    secret = objects[("Secret", volume["secret"]["secretName"])]
    context = pod["spec"]["securityContext"]
    folder = tmp_path / "mount"  # stands in for secret_file.parent
    mount_like_kubelet(folder, secret, volume, context["fsGroup"])
    path = folder / secret_file.name
    assert path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o440
    monkeypatch.setattr(os, "getuid", lambda: context["runAsUser"])  # the pod's user, not the file's owner
    value = base64.b64decode(secret["data"][secret_file.name]).strip()
    assert read_secret(path) == value
    assert load_secret(path, create=True, setting="engine.secret_file") == value
    assert len(list(folder.iterdir())) == 3  # ..data, its folder, the file: nothing was created
    other = context["runAsUser"] + 1
    for mode, owner, match in ((0o444, 0, "root's and open to others"), (0o460, 0, "root's and open to others"),
                               (0o440, other, f"belongs to uid {other}"), (0o640, other, f"belongs to uid {other}")):
        os.chown(path, owner, context["fsGroup"])
        os.chmod(path, mode)
        with pytest.raises(ValueError, match=match):
            read_secret(path)


def test_the_engines_responses_are_on_the_pods_claim(objects: dict[tuple[str, str], dict[str, Any]],
                                                     parse: Any) -> None:
    """Stored responses outlive the pod as KV-disk does: a folder of the engine's own on the pod's claim
    (the claim itself is mounted: kubelet would make a subPath folder root's, which the engine refuses)."""
    pod = engine_pod(objects)
    engine, store = container(pod, "engine"), container(pod, "tierstore")
    _, settings = parse(engine)
    _, store_settings = parse(store)
    responses = Path(settings.responses.path)
    engine_mounts = mounts(pod, engine)
    claim = objects[("StatefulSet", f"{RELEASE}-ignis-engine")]["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    holders = [p for p in engine_mounts if responses.is_relative_to(p) and p != "/"]
    assert holders, f"{responses} is in the container's own layer: lost with the pod"
    holder = max(holders, key=len)
    assert engine_mounts[holder] == ({"claimTemplate": claim}, False) and responses != Path(holder)
    assert not any("subPath" in m for m in engine["volumeMounts"])
    kv = Path(store_settings.kv_disk.path)
    assert not responses.is_relative_to(kv) and not kv.is_relative_to(responses)  # each its own folder
    moved = render({"tierstore": {"kvDisk": {"mountPath": "/data", "path": "/data/kv"}},
                    "engine": {"responsesDir": "stored"}})
    moved_engine = container(engine_pod(moved), "engine")
    assert env_of(moved_engine)["IGNIS_RESPONSES__PATH"] == "/data/stored"
    assert mounts(engine_pod(moved), moved_engine)["/data"] == ({"claimTemplate": claim}, False)


def test_probes_ask_the_ports_and_socket_the_services_bind(objects: dict[tuple[str, str], dict[str, Any]],
                                                           parse: Any) -> None:
    pod = engine_pod(objects)
    engine = container(pod, "engine")
    engine_args, _ = parse(engine)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[probe]["grpc"] == {"port": engine_args.port}  # whole-server health: SERVING once loaded
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] >= 600
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    assert ports == {"grpc": engine_args.port, "metrics": engine_args.metrics_port}
    store = container(pod, "tierstore")
    _, store_settings = parse(store)
    for probe in ("startupProbe", "livenessProbe"):
        command = store[probe]["exec"]["command"]
        assert command[:3] == ["python", "-m", "common.healthcheck"]
        probe_args = healthcheck.parse_args(command[3:])
        assert (probe_args.kind, probe_args.address) == ("grpc", f"unix:{store_settings.tierstore.socket}")
    store_args, _ = parse(store)
    assert {p["name"]: p["containerPort"] for p in store["ports"]} == {"store-metrics": store_args.metrics_port}
    gateway = container(gateway_pod(objects), "gateway")
    gw_args, gw_config = parse(gateway, {f"secret:{RELEASE}-ignis-api-key/api-key": "a-key"})
    assert gateway["ports"] == [{"name": "http", "containerPort": gw_args.port}]
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "/health" in gw_config.public_paths  # the probe needs no key
    assert gateway["livenessProbe"]["tcpSocket"] == {"port": "http"}  # no engine up is not a reason to restart


def test_the_tierstore_probe_answers_on_a_real_socket(tmp_path: Path) -> None:
    store = start_tierstore(tmp_path, ["--kv-host-pool-bytes", "1MiB", "--kv-disk-bytes", "0"])
    try:
        done = subprocess.run([sys.executable, "-m", "common.healthcheck", "grpc", store.address], cwd=ROOT,
                              capture_output=True, text=True, timeout=30)
        assert store.address.startswith("unix:") and done.returncode == 0, done.stderr
    finally:
        store.stop()


def test_gateways_find_the_engines_through_the_headless_service(objects: dict[tuple[str, str], dict[str, Any]],
                                                                parse: Any) -> None:
    service = objects[("Service", f"{RELEASE}-ignis-engine")]
    statefulset = objects[("StatefulSet", f"{RELEASE}-ignis-engine")]
    assert service["spec"]["clusterIP"] == "None"  # headless: DNS answers every ready pod's address
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    pod_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    engine_args, _ = parse(container(engine_pod(objects), "engine"))
    [port] = service["spec"]["ports"]
    assert port["port"] == engine_args.port and port["targetPort"] == "grpc"
    _, config = parse(container(gateway_pod(objects), "gateway"), {f"secret:{RELEASE}-ignis-api-key/api-key": "k"})
    assert config.engines == [] and len(config.engine_dns) == 1
    name = DnsName.parse(config.engine_dns[0])
    assert name == DnsName(f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local", engine_args.port)
    assert (config.routing, config.load_bound, config.dns_refresh) == ("bounded", 1.25, 10.0)
    assert config.api_key == "k" and config.metrics_auth
    gw_service = objects[("Service", f"{RELEASE}-ignis-gateway")]
    assert gw_service["spec"]["ports"][0]["targetPort"] == "http"
    assert gw_service["spec"]["selector"].items() <= gateway_pod(objects)["metadata"]["labels"].items()
    assert not gw_service["spec"]["selector"].items() <= pod_labels.items()  # gateways only


def test_the_cluster_domain_is_a_value(parse: Any) -> None:
    """Clusters not named cluster.local (kubeadm's --service-dns-domain) find their engines too."""
    objects = render({"clusterDomain": "k8s.example.org"})
    service = objects[("Service", f"{RELEASE}-ignis-engine")]
    engine_args, _ = parse(container(engine_pod(objects), "engine"))
    _, config = parse(container(gateway_pod(objects), "gateway"), {f"secret:{RELEASE}-ignis-api-key/api-key": "k"})
    [name] = config.engine_dns
    assert DnsName.parse(name) == DnsName(f"{service['metadata']['name']}.{NAMESPACE}.svc.k8s.example.org",
                                          engine_args.port)
    rendered = "\n".join(str(obj) for obj in objects.values())
    assert "cluster.local" not in rendered


def test_gpus_hosts_and_the_knobs(parse: Any) -> None:
    objects = render({"engine": {"hosts": 5, "model": "/models/Qwen3-8B", "servedModelName": "qwen3",
                                 "extraArgs": ["--max-num-seqs", "96"],
                                 "env": {"IGNIS_REUSE__RETAINED_DEVICE": "16"}},
                      "tierstore": {"arenaBytes": "3GiB", "shmSizeLimit": "4Gi"},
                      "gateway": {"replicas": 3, "routing": "affinity", "loadBound": 1.5, "dnsRefresh": 30}})
    statefulset = objects[("StatefulSet", f"{RELEASE}-ignis-engine")]
    assert statefulset["spec"]["replicas"] == 5
    pod = statefulset["spec"]["template"]
    anti = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"  # one engine pod per GPU host
    engine = container(pod, "engine")
    assert engine["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert all("resources" not in container(pod, n) for n in ("tierstore",))
    assert "resources" not in container(gateway_pod(objects), "gateway")
    args, settings = parse(engine)
    assert (args.model, args.served_model_name, settings.engine.max_num_seqs) == ("/models/Qwen3-8B", "qwen3", 96)
    assert settings.reuse.retained_device == 16
    _, store_settings = parse(container(pod, "tierstore"))
    assert store_settings.reuse.kv_host_pool_bytes == 3 << 30
    assert objects[("Deployment", f"{RELEASE}-ignis-gateway")]["spec"]["replicas"] == 3
    _, config = parse(container(gateway_pod(objects), "gateway"), {f"secret:{RELEASE}-ignis-api-key/api-key": "k"})
    assert (config.routing, config.load_bound, config.dns_refresh) == ("affinity", 1.5, 30.0)


def test_models_volume_otlp_and_scrape_annotations(parse: Any) -> None:
    plain = render()
    assert mounts(engine_pod(plain), container(engine_pod(plain), "engine"))["/models"][0]["emptyDir"] == {}
    assert not any(k.startswith("OTEL_") for c in engine_pod(plain)["spec"]["containers"] for k in env_of(c))
    assert "annotations" not in gateway_pod(plain)["metadata"]  # /metrics is behind the key there
    objects = render({"otlpEndpoint": "http://jaeger-collector.obs:4317", "gateway": {"metricsAuth": False},
                      "engine": {"models": {"existingClaim": "checkpoints"}}})
    pod = engine_pod(objects)
    volume, read_only = mounts(pod, container(pod, "engine"))["/models"]
    assert volume["persistentVolumeClaim"] == {"claimName": "checkpoints", "readOnly": True} and read_only
    for p, name in ((pod, "engine"), (pod, "tierstore"), (gateway_pod(objects), "gateway")):
        env = env_of(container(p, name))
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger-collector.obs:4317"
        assert env["OTEL_SERVICE_NAME"] == f"ignis-{name}"
    engine_args, _ = parse(container(pod, "engine"))
    assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true", "prometheus.io/path": "/metrics",
                                              "prometheus.io/port": str(engine_args.metrics_port)}
    gw_args, config = parse(container(gateway_pod(objects), "gateway"), {f"secret:{RELEASE}-ignis-api-key/api-key": "k"})
    assert not config.metrics_auth and "/metrics" in config.public_paths
    assert gateway_pod(objects)["metadata"]["annotations"]["prometheus.io/port"] == str(gw_args.port)
    off = render({"prometheus": {"annotations": False}})
    assert "annotations" not in engine_pod(off)["metadata"]
