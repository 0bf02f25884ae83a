"""One slow health probe does not take an engine out of routing (issue 49, attack item 5).

Under load (a long prefill holding the engine's CPU) single probes missed their deadline and a
single-engine gateway answered 503 to /tokenize and /v1/models. Now an engine leaves routing after
SLOW_PROBES_TO_MARK_DOWN probes in a row time out, at once when it refuses or says NOT_SERVING.
A real engine process is stopped (SIGSTOP) so that its probes time out for certain, then resumed.
Probes that must be answered get a deadline a loaded machine meets (ANSWERED); only the probes of
the stopped process get a short one, which they miss whatever the load.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Iterator

import pytest

from common.launch import free_port
from gateway.engines import SLOW_PROBES_TO_MARK_DOWN, EnginePool
from services import RunningService, start_engine

ANSWERED, STOPPED = 60.0, 0.5  # probe deadlines (s): one a live engine meets under load, one a stopped one misses


@pytest.fixture
def engine(tiny_model_dir: Path, tmp_path: Path) -> Iterator[RunningService]:
    service = start_engine(tmp_path / "engine", str(tiny_model_dir), ["--served-model-name", "ignis-tiny"])
    yield service
    service.process.send_signal(signal.SIGCONT)
    service.stop()


def test_slow_probes_keep_an_engine_until_enough_in_a_row_and_a_refusal_drops_it_at_once(
        engine: RunningService) -> None:
    async def run() -> None:
        pool = EnginePool([engine.address], probe_timeout=ANSWERED, sessions=False)
        [client] = pool.engines

        def stopped() -> None:
            engine.process.send_signal(signal.SIGSTOP)  # it answers nothing now: every probe times out
            pool.probe_timeout = STOPPED

        def resumed() -> None:
            engine.process.send_signal(signal.SIGCONT)
            pool.probe_timeout = ANSWERED

        try:
            assert await pool.probe(client) and client.models_known
            stopped()
            for missed in range(1, SLOW_PROBES_TO_MARK_DOWN):
                assert await pool.probe(client), f"taken out after {missed} slow probe(s)"
                assert pool.candidates("ignis-tiny", _keys())[0] is client and client.healthy
            resumed()
            assert await pool.probe(client) and client.slow_probes == 0  # an answer resets the count
            stopped()
            for _ in range(SLOW_PROBES_TO_MARK_DOWN):
                await pool.probe(client)
            assert not client.healthy  # enough in a row: out of routing
            resumed()
            assert await pool.probe(client)  # back
        finally:
            await pool.close()
        # A refused connection (nothing listens there) is down on the first probe.
        gone = EnginePool([f"127.0.0.1:{free_port()}"], probe_timeout=ANSWERED, sessions=False)
        try:
            gone.engines[0].healthy = True
            assert not await gone.probe(gone.engines[0])
        finally:
            await gone.close()

    asyncio.run(run())


def _keys():  # type: ignore[no-untyped-def]
    from gateway.routing import RouteKeys

    return RouteKeys(head=b"", conversation=b"")
