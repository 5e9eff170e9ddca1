"""bench/chaos.py's pure parts: the audit check that finds a write from a replica not holding the Lease,
and the measures it reports (failover after a kill, settling after a restart, the fault schedule)."""

from __future__ import annotations

from support import bench_module

chaos = bench_module("chaos")


def call(user: str, verb: str, resource: str = "deployments", code: int = 200) -> dict:
    return {"user": user, "verb": verb, "resource": resource, "code": code}


def test_a_write_is_the_leaders_only_after_its_lease_write_succeeded_and_until_another_one_did():
    audit = [
        call("operator-1", "update", "leases"),
        call("operator-1", "create"),
        call("operator-2", "update", "leases", code=409),  # (a refused try: operator-1 still leads)
        call("operator-2", "list"),  # (reads are anyone's)
        call("operator-1", "patch", "neuronmodels/status"),
        call("operator-2", "create", code=403),  # (refused: no write happened)
        call("kubectl", "delete", "neuronmodels"),  # (not an operator)
        call("operator-2", "update", "leases"),
        call("operator-2", "create"),
    ]
    assert chaos.leaderless_writes(audit) == []
    late = call("operator-1", "delete")  # the old leader writes after the new one took the Lease
    assert chaos.leaderless_writes([*audit, late]) == [{**late, "leading": "operator-2"}]
    assert chaos.leaderless_writes([call("operator-3", "create")]) == [{**call("operator-3", "create"),
                                                                        "leading": ""}]  # fmt: skip
    assert chaos.writes_by_user([*audit, late]) == {"operator-1": 4, "operator-2": 2, "kubectl": 1}


def test_failover_is_timed_to_the_first_other_holder_and_settling_to_the_last_earlier_write():
    holders = [(0.0, "operator-1"), (10.0, "operator-1"), (14.5, "operator-2"), (30.0, "operator-3")]
    assert chaos._next_holder(holders, at=9.0, killed="operator-1") == 5.5
    assert chaos._next_holder(holders, at=31.0, killed="operator-3") is None  # (nobody took over: reported)
    lags = [(1.0, 0.5), (4.0, 3.0), (6.0, 0.1)]  # (written at, seconds to its reconcile)
    assert chaos._settled(lags, up=5.0) == 2.0  # the write at 4 s, reconciled at 7 s
    assert chaos._settled(lags, up=0.5) is None
    assert chaos._every(15, 75) == [15, 30, 45, 60]  # (none at the churn's end)
