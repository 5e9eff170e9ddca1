"""Local mode's loopback ports: from a pool below the ephemeral range (or the setting), never handed out twice
while the pool lasts, and a clear error for a setting that is not a range."""

from __future__ import annotations

import socket

import pytest

from neuronfleet.localcluster import ports


def test_the_default_pool_lies_below_the_ephemeral_range(tmp_path, monkeypatch):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", ranges)
    assert ports.pool({}) == range(32768 - ports.POOL_SIZE, 32768)
    ranges.write_text("1500\t40000\n")  # no room below: the ports above it
    assert ports.pool({}) == range(40001, 65536)


@pytest.mark.parametrize("value", ["20000", "a-b", "30000-20000", "80-2000", "20000-70000"])
def test_a_setting_that_is_not_a_range_says_what_is_expected(value):
    with pytest.raises(ValueError, match=f"{ports.POOL_ENV}=.*expected"):
        ports.pool({ports.POOL_ENV: value})


def test_ports_come_from_the_setting_each_once_and_free(monkeypatch):
    # ports this process handed out from another pool do not count against this one's
    monkeypatch.setattr(ports, "_handed_out", set(range(40000, 40100)))
    environ = {ports.POOL_ENV: "21000-21009"}
    with socket.socket() as taken:
        try:
            taken.bind(("127.0.0.1", 21003))
        except OSError:
            pytest.skip("port 21003 is in use on this machine")
        taken.listen()
        picked = [ports.loopback_port(environ) for _ in range(4)]
    assert len(set(picked)) == 4 and all(21000 <= p <= 21009 and p != 21003 for p in picked)


def test_up_keeps_the_wake_port_an_earlier_up_used_while_it_is_free(tmp_path):
    """The wake endpoint's URL is in the routers' pod templates: the same port over `down` and `up` leaves
    them as they were (a new one would roll every router)."""
    from neuronfleet.localcluster.local import _kept_port

    kept = tmp_path / "wake-port"
    first = _kept_port(kept)
    assert kept.read_text() == str(first) and _kept_port(kept) == first
    with socket.socket() as taken:  # another process holds it now: a new one, kept from then on
        taken.bind(("127.0.0.1", first))
        second = _kept_port(kept)
    assert second != first and kept.read_text() == str(second) and _kept_port(kept) == second
