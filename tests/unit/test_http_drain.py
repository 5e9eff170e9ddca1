"""The drain every HTTP process shares (runtime/serving/http_app.py), in time that the test moves: new
requests are served until the grace period's last tenth, then refused; an idle connection is closed after
IDLE_CLOSE_SECONDS, one that runs a request is not. (The served requests' `Connection: close` and the exit
are checked with real clients in tests/integration/test_server.py.)"""

from __future__ import annotations

from neuronfleet.runtime.serving import http_app
from neuronfleet.runtime.serving.http_app import IDLE_CLOSE_SECONDS, REFUSE_WITHIN, HttpApp


class Connection:
    def __init__(self) -> None:
        self.closed = False

    def force_close(self) -> None:
        self.closed = True


def test_new_requests_are_refused_only_in_the_grace_periods_last_tenth(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(http_app.time, "monotonic", lambda: clock[0])
    app = HttpApp("m", 1 << 20, None)
    assert not app.refusing()
    app.start_drain(60.0)
    assert app.draining and not app.refusing()
    clock[0] += 60.0 * (1 - REFUSE_WITHIN) - 0.5
    assert not app.refusing()
    clock[0] += 1.0
    assert app.refusing()


def test_idle_connections_close_and_busy_ones_stay_while_draining(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(http_app.time, "monotonic", lambda: clock[0])
    app = HttpApp("m", 1 << 20, None)
    idle, busy, recent, unknown = Connection(), Connection(), Connection(), Connection()
    app._connections.update({idle: [0, 990.0], busy: [1, 990.0], recent: [0, 1000.0]})
    app.start_drain(30.0)
    everyone = [idle, busy, recent, unknown]
    app.close_idle(everyone)
    assert not any(c.closed for c in everyone)  # nobody is idle for that long since the drain began
    clock[0] += IDLE_CLOSE_SECONDS
    app._connections[recent] = [0, clock[0] - 0.5]  # its last request ended just now
    app.close_idle(everyone)
    assert (idle.closed, busy.closed, recent.closed, unknown.closed) == (True, False, False, True)
    app.close_idle([busy])  # the closed ones are gone from the server's list: forgotten
    assert set(app._connections) == {busy}
