"""What the engine's state volume is for (docker-compose.yml's `engine-state`, the Helm chart's claim and key
Secret): a recreated engine that finds its responses folder and its integrity key again serves the stored
responses and claims the states it wrote to KV-disk; one with a new key serves the responses but refuses
every saved state ("integrity tag mismatch") and prefills cold.

Real processes, as compose recreates them: a tierstore with a disk tier, an engine with the
IGNIS_RESPONSES__PATH and IGNIS_ENGINE__INTEGRITY_KEY_FILE that docker-compose.yml gives it, moved from the
named volume's mount point onto a 0700 folder here (as the image prepares the volume), and a gateway. All
three are stopped (the arena goes with the tierstore; KV-disk stays) and started again on the same folders."""

from __future__ import annotations

import json
import shutil
import stat
import time
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import yaml  # type: ignore[import-untyped]

from services import RunningService, start_engine, start_gateway, start_tierstore
from tierstore.client import TierStoreClient

ROOT = Path(__file__).resolve().parent.parent
MODEL = "ignis-tiny"
MiB = 1 << 20
STATE_SETTINGS = ("IGNIS_RESPONSES__PATH", "IGNIS_ENGINE__INTEGRITY_KEY_FILE")
KEY = "client-key"  # the gateway's scope of a stored response: the same client after the restart


def topic(name: str) -> str:
    return f"Conversation about {name}: " + f"tell me about {name}. " * 6  # above the 32-token restore floor


def compose_state(volumes: Path) -> dict[str, str]:
    """The engine's two settings as docker-compose.yml gives them, each moved from the mount point of the named
    volume holding it to `volumes`/NAME (made 0700, as an empty volume takes the image folder's mode)."""
    engine = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["engine"]
    env, where = engine.get("environment", {}), {}
    mounted = [tuple(str(v).split(":")[:2]) for v in engine.get("volumes", [])]
    for name in STATE_SETTINGS:
        path = PurePosixPath(env.get(name, "~/.cache/ignis"))  # unset: the default, in the container's home
        held = [(source, target) for source, target in mounted if path.is_relative_to(target) and path != target]
        assert held, f"docker-compose.yml: the engine's {name} ({path}) is on no volume: lost with the container"
        source, target = held[0]
        (volumes / source).mkdir(mode=0o700, parents=True, exist_ok=True)
        where[name] = str(volumes / source / path.relative_to(target))
    return where


def tierstore(workdir: Path, disk: Path) -> RunningService:
    return start_tierstore(workdir, ["--kv-host-pool-bytes", str(16 * MiB), "--kv-disk-path", str(disk),
                                     "--kv-disk-bytes", str(64 * MiB)])


def engine(workdir: Path, model: Path, store: RunningService, state: dict[str, str]) -> RunningService:
    """Two device slots and nothing protected: each new conversation moves the one before down to KV-RAM."""
    return start_engine(workdir, str(model), [
        "--served-model-name", MODEL, "--tierstore", store.address,
        "--set", "reuse.retained_device=2", "--set", "reuse.retained_interactive_ttl=0"], env=state)


def create(gateway: RunningService, **body: Any) -> dict[str, Any]:
    with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as client:
        reply = client.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 4, "temperature": 0, **body})
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def stored(gateway: RunningService, response_id: str) -> httpx.Response:
    return httpx.get(f"http://127.0.0.1:{gateway.port}/v1/responses/{response_id}", timeout=30,
                     headers={"Authorization": f"Bearer {KEY}"})


def events(service: RunningService, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in service.log().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == name]


def wait_for_disk_copies(store: RunningService, timeout: float = 60.0) -> int:
    """Polls until every KV-RAM state has its disk copy (kv_disk.copy_ahead); returns how many there are."""
    deadline = time.monotonic() + timeout
    with TierStoreClient(store.address) as client:
        while True:
            s = client.stats()
            if 0 < s.states_ram <= s.copies_ahead:
                return int(s.states_ram)
            assert time.monotonic() < deadline, f"not copied to disk: {s}"
            time.sleep(0.05)


def stop_all(*services: RunningService | None) -> None:
    for service in services:
        if service is not None:
            assert service.stop() == 0, service.log()


def restarted(work: Path, model: Path, ts: Path, disk: Path, state: dict[str, str], first: dict[str, Any]
              ) -> tuple[httpx.Response, dict[str, Any], RunningService]:
    """A fresh tierstore on `disk`, engine and gateway: the stored `first` read back, then continued."""
    store = tierstore(ts, disk)
    eng = gateway = None
    try:
        with TierStoreClient(store.address) as client:
            assert client.stats().states_disk > 0  # the arena went with the last tierstore; KV-disk did not
        eng = engine(work / "engine", model, store, state)
        gateway = start_gateway(work / "gateway", [eng.address])
        got = stored(gateway, first["id"])
        follow = create(gateway, input="And then?", previous_response_id=first["id"])
        return got, follow, eng
    finally:
        stop_all(gateway, eng, store)


def test_a_recreated_engine_keeps_its_responses_and_claims_its_states_only_with_its_key(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    state = compose_state(tmp_path / "volumes")
    key, responses = Path(state["IGNIS_ENGINE__INTEGRITY_KEY_FILE"]), Path(state["IGNIS_RESPONSES__PATH"])
    disk = tmp_path / "kv-disk"
    store = tierstore(tmp_path / "ts", disk)
    eng = gateway = None
    try:
        eng = engine(tmp_path / "run1" / "engine", tiny_model_dir, store, state)
        gateway = start_gateway(tmp_path / "run1" / "gateway", [eng.address])
        first = create(gateway, input=topic("tides"))
        for other in ("glaciers", "volcanoes"):  # two slots: the tides states move down to KV-RAM
            create(gateway, input=topic(other), store=False)
        stop_all(gateway, eng)
        gateway = eng = None
        assert wait_for_disk_copies(store) >= 2  # the opener and the end-of-reply checkpoint, at least
    finally:
        stop_all(gateway, eng, store)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(responses.stat().st_mode) == 0o700
    written = key.read_bytes()
    shutil.copytree(disk, tmp_path / "kv-disk-copy")  # the same saved states, for the engine with a new key

    # The same folders: the response is there, and the conversation's state comes back from KV-disk.
    got, follow, eng = restarted(tmp_path / "run2", tiny_model_dir, tmp_path / "ts", disk, state, first)
    assert got.status_code == 200 and got.json()["output"] == first["output"]
    assert follow["usage"]["input_tokens_details"]["cached_tokens"] > 0, eng.log()
    assert [e["tier"] for e in events(eng, "ignis.request.restored")] == ["disk"]
    assert not events(eng, "ignis.request.restore_rejected")
    assert key.read_bytes() == written

    # A new key (its volume lost, or a key made per container): stored responses do not depend on it, but
    # every state written under the old one is refused, and the conversation is prefilled from scratch.
    fresh = {**state, "IGNIS_ENGINE__INTEGRITY_KEY_FILE": str(tmp_path / "new-key" / "integrity.key")}
    got, follow, eng = restarted(tmp_path / "run3", tiny_model_dir, tmp_path / "ts3", tmp_path / "kv-disk-copy",
                                 fresh, first)
    assert got.status_code == 200 and got.json()["output"] == first["output"]
    assert Path(fresh["IGNIS_ENGINE__INTEGRITY_KEY_FILE"]).read_bytes() != written
    assert follow["usage"]["input_tokens_details"]["cached_tokens"] == 0, eng.log()
    assert events(eng, "ignis.request.restore_rejected") and not events(eng, "ignis.request.restored")
