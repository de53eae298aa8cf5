"""uvicorn's h11 protocol with a deadline on request headers.

uvicorn closes idle keep-alive connections, but a client that opens a connection and sends its
headers a byte at a time (slowloris) holds it forever: nothing times the headers of a request.
``GuardedH11`` arms a timer when a connection opens and after every response; if the next
request's headers have not all arrived when it fires, the connection is closed. Bodies are timed
by the app (server/requests.py ``read_json``).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0


class GuardedH11(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:   # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        waiting_for = self.cycle     # the request in progress when armed (None on a new connection)
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire, waiting_for)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _expire(self, waiting_for) -> None:
        self._header_timer = None
        # a new request cycle started since the timer was armed: its headers arrived in time
        if self.cycle is waiting_for and not self.transport.is_closing():
            self.logger.warning("closing a connection whose request headers did not arrive within %g s",
                                self.header_timeout_s)
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.cycle is not None and not self.cycle.response_complete:
            self._disarm()          # the headers are in; the app times the body

    def on_response_complete(self) -> None:
        super().on_response_complete()     # may already have started a pipelined request's cycle
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()             # the next request on this keep-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
