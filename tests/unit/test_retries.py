"""A failing model's retries (operator/retries.py), in simulated time: the back-off grows from `first`,
doubling, up to `most`, and no sooner than the API server's Retry-After; a pass that succeeds starts it over;
a trigger waits for the retry unless the model has a new generation; each Event is said once per failing
streak. (The shell, against the emulated API server: tests/e2e/test_refused_writes.py.)"""

from __future__ import annotations

import itertools

import pytest

from neuronfleet.operator.retries import SAID_MAX, Backoff, Retries, retry_after_seconds

KEY = ("ns", "m")


def fail_at_each_retry(retries: Retries, until: float, start: float = 0.0) -> list[float]:
    """When the passes run for a model whose every pass fails, each as soon as its retry is due."""
    at, tries = start, []
    while at < until:
        tries.append(at)
        at += retries.failed(KEY, at, generation=1)
    return tries


def test_the_delays_double_from_one_second_up_to_five_minutes():
    backoff = Backoff()
    assert [backoff.delay(n) for n in range(1, 12)] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]
    assert backoff.delay(10_000) == 300  # (no overflow, however long it fails)


def test_a_refusal_that_lasts_an_hour_is_tried_20_times_not_360():
    """The intervals between tries grow, then stay at the cap: 20 tries in the first hour (10 in the first
    8.5 minutes, then one every 5 minutes), where a fixed 10 s made 360."""
    tries = fail_at_each_retry(Retries(), until=3600.0)
    intervals = [b - a for a, b in itertools.pairwise(tries)]
    assert intervals[:9] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert set(intervals[9:]) == {300}
    assert len(tries) == 20


def test_a_pass_that_succeeds_starts_the_back_off_over():
    retries = Retries(Backoff(first=2, most=60))
    fail_at_each_retry(retries, until=100.0)
    assert retries.failures(KEY) == 6 and retries.waiting(KEY, 100.0)
    retries.succeeded(KEY)
    assert retries.failures(KEY) == 0 and not retries.waiting(KEY, 100.0) and len(retries) == 0
    assert retries.failed(KEY, 200.0, generation=1) == 2  # from `first` again


def test_a_trigger_waits_for_the_retry_until_it_is_due():
    retries = Retries()
    assert not retries.waiting(KEY, 0.0)  # (never failed: at once)
    assert retries.failed(KEY, 10.0, generation=1) == 1
    assert retries.failed(KEY, 11.0, generation=1) == 2
    assert retries.waiting(KEY, 12.9) and not retries.waiting(KEY, 13.0)
    assert not retries.waiting(("ns", "other"), 12.0)  # (per model)


def test_the_api_servers_retry_after_is_honoured_where_it_is_longer():
    retries = Retries(Backoff(first=1, most=300))
    assert retries.failed(KEY, 0.0, generation=1, server_delay=30.0) == 30
    assert retries.waiting(KEY, 29.0) and not retries.waiting(KEY, 30.0)
    assert retries.failed(KEY, 30.0, generation=1, server_delay=0.5) == 2  # (shorter: the back-off's)
    assert retries.failed(KEY, 32.0, generation=1, server_delay=None) == 4


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("5", 5.0), (" 120 ", 120.0), ("0", 0.0), ("1.5", 1.5), (None, None), ("", None), ("-3", None),
     ("Wed, 21 Oct 2015 07:28:00 GMT", None)],
)  # fmt: skip
def test_retry_after_is_read_in_seconds(header, seconds):
    assert retry_after_seconds(header) == seconds


def test_only_a_new_generation_of_a_failing_model_goes_at_once():
    retries = Retries()
    assert not retries.changed_by_user(KEY, 5)  # (not failing: any trigger goes at once anyway)
    retries.failed(KEY, 0.0, generation=3)
    assert not retries.changed_by_user(KEY, 3)  # its status or metadata changed: it waits
    assert not retries.changed_by_user(KEY, 2)  # (an older copy)
    assert retries.changed_by_user(KEY, 4)  # the user changed the spec
    retries.failed(KEY, 1.0, generation=4)  # (and that generation failed too)
    assert not retries.changed_by_user(KEY, 4)


def test_each_event_is_said_once_until_a_pass_succeeds():
    retries = Retries()
    refused = ("Warning", "ApplyRefused", "the API server refused ...: exceeded quota")
    reworded = ("Warning", "ApplyRefused", "the API server refused ...: denied by the webhook")
    assert retries.first_said(KEY, refused)
    assert not retries.first_said(KEY, refused)
    assert retries.first_said(KEY, reworded)  # a new message is said
    assert not retries.first_said(KEY, refused)  # (and the first one still not again)
    assert retries.first_said(("ns", "other"), refused)  # (per model)
    retries.unsay(KEY, reworded)  # (it could not be posted: said with the next failure)
    assert retries.first_said(KEY, reworded)
    retries.succeeded(KEY)
    assert retries.first_said(KEY, refused)  # the same refusal, after a good pass: said again


def test_what_a_failing_model_said_is_bounded():
    retries = Retries()
    for i in range(1000):  # (a message that changes every time: a quota's "used" count)
        assert retries.first_said(KEY, ("Warning", "ApplyRefused", f"used {i}"))
    assert not retries.first_said(KEY, ("Warning", "ApplyRefused", "used 999"))
    assert retries.first_said(KEY, ("Warning", "ApplyRefused", f"used {999 - SAID_MAX}"))  # (forgotten)


@pytest.mark.parametrize(("first", "most", "factor"), [(0, 1, 2), (5, 1, 2), (1, 10, 0.5), (-1, 10, 2)])
def test_a_back_off_that_cannot_work_is_refused_saying_what_would(first, most, factor):
    with pytest.raises(ValueError, match="0 < first <= most and factor >= 1"):
        Backoff(first=first, most=most, factor=factor)


def test_a_model_made_anew_under_a_failing_ones_name_does_not_wait_out_its_back_off():
    """The failing model deleted and another of its name made (a new uid, its generation back at 1): its
    change goes at once, and its own failures start their back-off from the first delay."""
    retries = Retries(Backoff(first=1.0, most=300.0))
    for at in range(6):
        retries.failed(KEY, float(at), generation=3, uid="old")
    assert retries.waiting(KEY, 6.0) and not retries.changed_by_user(KEY, 1, "old")
    assert retries.changed_by_user(KEY, 1, "new")
    assert retries.failed(KEY, 7.0, generation=1, uid="new") == 1.0  # its own back-off, from the first
    assert retries.failures(KEY) == 1 and not retries.changed_by_user(KEY, 1, "new")
