"""What other threads hand the engine's step thread: typed messages, taken in order between steps.

`submit`, `abort` and the Monitor's snapshot run on gRPC and asyncio threads; the
engine's pools, queues and indexes are touched only on the step thread. Each
message is a small record the step thread dispatches on by type.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.request import EngineRequest

if TYPE_CHECKING:
    from engine.state_listing import EngineSnapshot


@dataclass(frozen=True, slots=True)
class AddRequest:
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True, slots=True)
class TakeSnapshot:
    future: Future[EngineSnapshot]  # set on the step thread with a copy of the stats and retained states


@dataclass(frozen=True, slots=True)
class ChangeAdapters:
    """Load or unload a LoRA adapter (engine/lora/registry.py): its slots' weights are read by a step."""

    change: Callable[[], Any]
    future: Future[Any]  # set on the step thread with what `change` returned, or its exception


InboxMessage = AddRequest | AbortRequest | TakeSnapshot | ChangeAdapters


class Inbox:
    """Messages in arrival order, and the event that wakes an idle step thread for them."""

    def __init__(self) -> None:
        self._messages: deque[InboxMessage] = deque()
        self.wake = threading.Event()

    def put(self, message: InboxMessage) -> None:
        """Any thread: queue `message` and wake the step thread."""
        self._messages.append(message)  # deque appends and pops are atomic: no lock needed
        self.wake.set()

    def take(self) -> InboxMessage | None:
        """The step thread: the oldest message, or None."""
        return self._messages.popleft() if self._messages else None
