"""Waiting for a started node command's event (infra.node.events): a server naming the port it chose, a bench's
figure. The orchestrator starts the command with an EventTap as its line sink and waits on the tap."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from infra.cancel import CANCEL
from infra.compute.access.remote import CANCEL_POLL_S, LineSink, Process, RemoteError, last_error
from infra.node.events import Event, NodeEvent, parse


class EventTap:
    """A line sink that keeps the events it sees (and passes every line on to sink), so a caller can wait for one.

    error makes the exception a failed wait raises (its message names the command, the event and why); markers pick
    the command's own error line out of its output for that message."""

    def __init__(self, sink: LineSink | None = None, *, error: Callable[[str], Exception] = RemoteError,
                 markers: Sequence[str] = ()) -> None:
        self._sink = sink
        self._error = error
        self._markers = markers
        self._events: list[Event] = []
        self._changed = threading.Condition()

    def __call__(self, line: str) -> None:
        event = parse(line)
        if event is not None:
            with self._changed:
                self._events.append(event)
                self._changed.notify_all()
        if self._sink is not None:
            self._sink(line)

    def all(self, kind: NodeEvent) -> list[Event]:
        with self._changed:
            return [event for event in self._events if event.kind is kind]

    def wait_for(self, kind: NodeEvent, process: Process, timeout_s: float, what: str) -> Event:
        """The newest `kind` event of process, waited for up to timeout_s (a cancel ends the wait with Cancelled);
        error(...) when the process exits without it or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while not (found := self.all(kind)):
            if process.poll() is not None or time.monotonic() > deadline:
                break
            CANCEL.check()
            with self._changed:
                self._changed.wait_for(lambda: any(e.kind is kind for e in self._events),
                                       min(CANCEL_POLL_S, max(0.0, deadline - time.monotonic())))
        if found:
            return found[-1]
        if process.poll() is None:
            raise self._error(f"{what}: no '{kind}' within {timeout_s:.0f}s: check the node")
        process.wait(5)  # lets the output pump deliver the last lines
        if found := self.all(kind):
            return found[-1]
        raise self._error(f"{what}: exited {process.poll()} without '{kind}': "
                          f"{last_error(process, self._markers, lines=200)}")

    def last(self, kind: NodeEvent, what: str) -> Event:
        found = self.all(kind)
        if not found:
            raise self._error(f"{what}: printed no '{kind}' event")
        return found[-1]
