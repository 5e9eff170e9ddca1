"""Leader election's decisions (operator/leadership.py) in simulated time: two candidates and a Lease held
by an API server that applies writes in order with optimistic concurrency. Never two acting leaders at any
instant, a takeover within the lease duration (plus a retry) after the leader stops, an immediate one after
it releases, a leader whose tries were held back past its renew deadline acting again only if no one took
over, and timings that could let two act refused."""

from __future__ import annotations

import datetime

import pytest

from neuronfleet.operator.leadership import Leading, Seen, Timing, released, step

T = Timing()
EPOCH = datetime.datetime(2026, 12, 3, tzinfo=datetime.UTC)


class Candidate:
    def __init__(self, me: str) -> None:
        self.me, self.seen, self.leading, self.alive = me, Seen(), Leading(), True

    def act(self, server: dict, now: float) -> None:
        """One try (every retry period): read, decide, write; a conflicting write fails."""
        sent = now
        lease = server.get("lease")
        version = server.get("version", 0)
        move = step(lease, self.me, self.seen, now, EPOCH + datetime.timedelta(seconds=now), T,
                    namespace="ns", name="neuronfleet-operator")  # fmt: skip
        if move.write is not None and server.get("version", 0) == version:
            server["lease"], server["version"] = move.write, version + 1
            if move.leading:
                self.leading.renewed_at = sent


def simulate(until: float, events: dict[float, str]) -> tuple[list[tuple[float, set[str]]], list[Candidate]]:
    """Both candidates try every retry period (b a little later); `events` stop or release a candidate at
    a time, or hold its tries back for some seconds ("a stall 12": its process starved). Returns who was
    acting, sampled every 0.1 s."""
    server: dict = {}
    a, b = Candidate("a"), Candidate("b")
    timeline, now, due = [], 0.0, {"a": 0.0, "b": 0.7}
    while now < until:
        for at, what in list(events.items()):
            if now >= at:
                who, _, how = what.partition(" ")
                c = a if who == "a" else b
                if how.startswith("stall "):
                    due[c.me] = now + float(how.split()[1])
                    del events[at]
                    continue
                if how == "release" and server.get("lease", {}).get("spec", {}).get("holderIdentity") == c.me:
                    server["lease"], server["version"] = released(server["lease"]), server["version"] + 1
                c.alive, c.leading.renewed_at = False, None
                del events[at]
        for c in (a, b):
            if c.alive and now >= due[c.me]:
                c.act(server, now)
                due[c.me] = now + T.retry_period
        timeline.append((now, {c.me for c in (a, b) if c.alive and c.leading.acting(now, T)}))
        now = round(now + 0.1, 1)
    return timeline, [a, b]


def test_one_leader_at_a_time_and_a_takeover_once_the_lease_lapses():
    timeline, _ = simulate(60.0, {20.0: "a stop"})  # a: killed (kill -9): it renews no more
    assert all(len(acting) <= 1 for _, acting in timeline)
    first = next(t for t, acting in timeline if acting)
    assert first == 0.0 and {"a"} == timeline[5][1]  # the first to try creates the Lease
    b_from = next(t for t, acting in timeline if "b" in acting)
    assert 20.0 < b_from <= 20.0 + T.lease_duration + T.retry_period + 0.2, b_from
    assert not any(acting for t, acting in timeline if 20.0 <= t < b_from)  # the gap: nobody acts


def test_a_leader_that_releases_is_followed_at_once():
    timeline, _ = simulate(40.0, {20.0: "a release"})
    b_from = next(t for t, acting in timeline if "b" in acting)
    assert 20.0 < b_from <= 20.0 + T.retry_period + 0.2, b_from


def test_a_leader_held_back_past_its_renew_deadline_acts_again_only_if_no_one_took_over():
    # held back 12 s (its last renewal at 18): it stops acting at 28, past its deadline; its late renewal at
    # 32 finds the Lease still its own (b may take it only at 18.7 + 15), so it acts again and b never does
    timeline, _ = simulate(60.0, {20.0: "a stall 12"})
    assert all(len(acting) <= 1 for _, acting in timeline)
    idle = [t for t, acting in timeline if not acting and t > 1]
    assert idle and min(idle) == 18.0 + T.renew_deadline and max(idle) < 32.0, idle
    assert not any("b" in acting for _, acting in timeline)
    assert all(acting == {"a"} for t, acting in timeline if t >= 32.0)
    # held back 20 s: b takes the Lease once it lapses; a's late try finds b's, and a never acts again
    timeline, _ = simulate(60.0, {20.0: "a stall 20"})
    assert all(len(acting) <= 1 for _, acting in timeline)
    b_from = next(t for t, acting in timeline if "b" in acting)
    assert 18.7 + T.lease_duration <= b_from <= 18.7 + T.lease_duration + T.retry_period + 0.1, b_from
    assert all(acting == {"b"} for t, acting in timeline if t >= b_from)


def test_a_leader_that_cannot_renew_stops_acting_before_anyone_may_take_over():
    leading = Leading(renewed_at=100.0)
    assert leading.acting(100.0 + T.renew_deadline - 0.01, T)
    assert not leading.acting(100.0 + T.renew_deadline, T)
    # a candidate that saw that renewal no earlier than it was sent may take over only at +lease_duration
    lease = {"spec": {"holderIdentity": "a", "renewTime": "x", "leaseTransitions": 0}}
    seen = Seen()
    assert step(lease, "b", seen, 100.0, EPOCH, T, namespace="n", name="l").write is None
    assert (
        step(lease, "b", seen, 100.0 + T.lease_duration - 0.01, EPOCH, T, namespace="n", name="l").write
        is None
    )
    taken = step(lease, "b", seen, 100.0 + T.lease_duration, EPOCH, T, namespace="n", name="l")
    assert taken.leading and taken.write["spec"]["holderIdentity"] == "b"
    assert taken.write["spec"]["leaseTransitions"] == 1
    assert T.renew_deadline < T.lease_duration


def test_a_renewal_seen_restarts_the_wait():
    lease = {"spec": {"holderIdentity": "a", "renewTime": "t1", "leaseTransitions": 0}}
    seen = Seen()
    step(lease, "b", seen, 0.0, EPOCH, T, namespace="n", name="l")
    renewed = {"spec": {**lease["spec"], "renewTime": "t2"}}
    assert step(renewed, "b", seen, 14.0, EPOCH, T, namespace="n", name="l").write is None
    assert (
        step(renewed, "b", seen, 14.0 + T.lease_duration - 0.1, EPOCH, T, namespace="n", name="l").write
        is None
    )


@pytest.mark.parametrize(
    "timing, why",
    [
        (Timing(10, 10, 2), "must be longer than the renew deadline"),
        (Timing(15, 2, 2), "must be longer than 1.2 x the retry period"),
        (Timing(15, 10, 0), "positive"),
    ],
)
def test_timings_that_could_let_two_leaders_act_are_refused(timing, why):
    assert any(why in p for p in timing.problems()), timing.problems()
    assert Timing().problems() == []
