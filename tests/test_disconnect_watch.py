"""gateway/cancel.py's DisconnectWatch on a real event loop: a disconnect cancels the block, and only the block."""

from __future__ import annotations

import asyncio

from starlette.types import Message

from gateway.cancel import DisconnectWatch


def test_a_disconnect_that_lands_as_the_block_ends_cancels_nothing_after_it() -> None:
    async def handler() -> str:
        arrived = asyncio.Event()

        async def receive() -> Message:
            await arrived.wait()
            return {"type": "http.disconnect"}

        with DisconnectWatch(receive):
            arrived.set()
            # The listener ends in the next turn, and its done callback is queued behind this block's
            # end: the block exits with that callback still pending.
            await asyncio.sleep(0)
        for _ in range(3):  # the pending callback runs here: it must not cancel work past the block
            await asyncio.sleep(0)
        return "done"

    assert asyncio.run(handler()) == "done"


def test_a_disconnect_inside_the_block_cancels_it_and_is_swallowed_at_its_end() -> None:
    async def handler() -> tuple[bool, str]:
        async def receive() -> Message:
            return {"type": "http.disconnect"}

        with DisconnectWatch(receive) as watch:
            await asyncio.sleep(10)  # cancelled by the disconnect
        return watch.disconnected, "after"

    assert asyncio.run(handler()) == (True, "after")
