"""A model's passes that failed in a row, pure (times are the caller's monotonic seconds): when its next pass
is due, whether a trigger waits for it, and which Warning Events the failing passes have said already.

- `Backoff`: the delay after the n-th failure in a row, `first` doubled per failure, at most `most`, and
  never sooner than the API server's Retry-After where it gave one. client-go's default controller rate
  limiter (what controller-runtime's controllers use unless told otherwise) doubles from 5 ms up to 1000 s
  per item (`DefaultTypedControllerRateLimiter`, with a 10/s overall bucket beside it:
  https://github.com/kubernetes/client-go/blob/master/util/workqueue/default_rate_limiters.go).
  Ours starts at 1 s and stops at 300 s: what reaches it is already past the client's own retries (429, 503
  and a dropped connection are sent again by `kube`), so it is mostly a refusal that lasts (an admission
  webhook, a quota, an invalid object), for which ten passes in the first 5 s, as from 5 ms, would be ten
  refused writes; and a refusal lifted (a quota raised, a webhook fixed) is picked up within 5 minutes, not
  17, at one refused write per failing model per 5 minutes.
- `Retries`: per model, the failures in a row, when its retry is due, the generation that failed, and the
  Events said since its last good pass. A trigger of a model that waits is left to its retry (a child's
  change, a come-back time, the autoscaler, the resync), except a new generation of the model: the user
  changed it, so it is tried at once. A pass that succeeds forgets it all: a later failure starts again at
  `first`, and a refusal said before is said again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Key = tuple[str, str]  # namespace, name
Said = tuple[str, str, str]  # an Event: type, reason, message
SAID_MAX = 32  # Events remembered per failing model (a message that changes every time stays bounded)


@dataclass(frozen=True)
class Backoff:
    """Seconds before a failing model's next pass: `first`, times `factor` per failure in a row, at most
    `most`."""

    first: float = 1.0
    most: float = 300.0
    factor: float = 2.0

    def __post_init__(self) -> None:
        if not (0 < self.first <= self.most) or self.factor < 1:
            raise ValueError(
                f"a back-off needs 0 < first <= most and factor >= 1 (got first={self.first}, "
                f"most={self.most}, factor={self.factor})"
            )

    def delay(self, failures: int) -> float:
        """The delay after `failures` (1 or more) failures in a row."""
        if failures <= 1:
            return self.first
        # (the exponent bounded: past the cap it only has to be at least `most`)
        return min(self.most, self.first * self.factor ** min(failures - 1, 64))


@dataclass
class _Failing:
    failures: int = 0
    due: float = 0.0
    generation: int = 0
    uid: str | None = None  # the model's (a model of the name made anew is another model)
    said: dict[Said, None] = field(default_factory=dict)  # (insertion-ordered: the oldest goes first)


def retry_after_seconds(value: str | None) -> float | None:
    """An HTTP Retry-After in seconds (RFC 9110 section 10.2.3: delay-seconds, what the API server sends);
    None for none, or for a value that is not a number of seconds."""
    try:
        seconds = float((value or "").strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


class Retries:
    """Failing models' retries and the Events their failures said (see the module's docstring)."""

    def __init__(self, backoff: Backoff | None = None) -> None:
        self.backoff = backoff or Backoff()
        self._failing: dict[Key, _Failing] = {}

    def failed(
        self, key: Key, now: float, generation: int, server_delay: float | None = None, uid: str | None = None
    ) -> float:
        """A pass of the model at `generation` failed at `now`: the seconds until its retry (the back-off's,
        or the API server's Retry-After where that is longer). A model of another `uid` (the name deleted and
        made again) starts its own back-off."""
        failing = self._failing.get(key)
        if failing is not None and uid is not None and failing.uid not in (None, uid):
            del self._failing[key]
        failing = self._failing.setdefault(key, _Failing())
        failing.uid = uid or failing.uid
        failing.failures += 1
        failing.generation = max(failing.generation, generation)
        delay = max(self.backoff.delay(failing.failures), server_delay or 0.0)
        failing.due = now + delay
        return delay

    def succeeded(self, key: Key) -> None:
        """A pass of the model succeeded (or found it gone): its failures and what they said are forgotten."""
        self._failing.pop(key, None)

    def failures(self, key: Key) -> int:
        """The model's failed passes in a row (0: its last pass succeeded)."""
        failing = self._failing.get(key)
        return failing.failures if failing else 0

    def waiting(self, key: Key, now: float) -> bool:
        """Whether the model's retry is still ahead: a trigger now waits for it."""
        failing = self._failing.get(key)
        return failing is not None and failing.failures > 0 and now < failing.due

    def changed_by_user(self, key: Key, generation: int, uid: str | None = None) -> bool:
        """Whether `generation` of a failing model is newer than the one that failed (its spec changed), or
        the model is another of its name (`uid`: the failing one deleted and this one made)."""
        failing = self._failing.get(key)
        if failing is None or failing.failures == 0:
            return False
        return generation > failing.generation or (failing.uid not in (None, uid) and uid is not None)

    def first_said(self, key: Key, event: Said) -> bool:
        """Whether the Event is said for the first time since the model's last good pass (it is remembered
        now; `unsay` forgets it again where it could not be posted)."""
        said = self._failing.setdefault(key, _Failing()).said
        if event in said:
            return False
        said[event] = None
        while len(said) > SAID_MAX:
            del said[next(iter(said))]
        return True

    def unsay(self, key: Key, event: Said) -> None:
        failing = self._failing.get(key)
        if failing is not None:
            failing.said.pop(event, None)

    def __len__(self) -> int:
        """How many models are remembered (failing, or with Events said by a pass that failed)."""
        return len(self._failing)
