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


def test_the_access_log_leaves_out_successful_probes_and_keeps_every_other_request(caplog):
    """`kubectl logs` of a pod shows its requests, not the kubelet's probes every few seconds; a failed
    probe (503 while draining) is kept, and at DEBUG the probes come back."""
    import logging

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from neuronfleet.runtime.serving.http_app import QuietProbesAccessLog

    logger = logging.getLogger("test.access")
    access = QuietProbesAccessLog(logger, web.AccessLogger.LOG_FORMAT)
    with caplog.at_level(logging.INFO, logger="test.access"):
        for method, path, status in (("GET", "/health", 200), ("GET", "/ready", 200),
                                     ("POST", "/v1/chat/completions", 200), ("GET", "/ready", 503),
                                     ("GET", "/metrics", 200)):  # fmt: skip
            access.log(make_mocked_request(method, path), web.Response(status=status), 0.01)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in lines[0]
    assert '"GET /ready HTTP/1.1" 503' in lines[1] and '"GET /metrics HTTP/1.1" 200' in lines[2]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="test.access"):
        access.log(make_mocked_request("GET", "/ready"), web.Response(status=200), 0.01)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("DEBUG", "GET /ready 200")]
