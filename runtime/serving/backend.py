"""What the HTTP server needs of whatever runs its requests (pure; imports no torch or aiohttp).

The local engine (`engine.AsyncEngine`) and the router's remote backend (`router.RemoteBackend`) both offer
the `Backend` protocol; the server is typed to it alone. Here too are the types that cross it
(`RequestOutput`, `Limits`, `FinishReason`) and `check_fits`, the one check of whether a request can ever run.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from neuronfleet.runtime.serving.errors import InvalidRequest

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from neuronfleet.runtime.serving.sampling_params import SamplingParams
    from neuronfleet.runtime.serving.tokenizer import Tokenizer


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS token or a stop string
    LENGTH = "length"  # max_tokens or the slot's length
    ABORT = "abort"  # cancelled by the client or the server


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log probability under the model (the log-softmax of its raw logits, before the
    repetition penalty, temperature, top-k and top-p: what vLLM reports by default, `raw_logprobs`), and
    the most likely tokens' (id, log probability) at that step, most likely first, as many as asked."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens and text, and the finish reason once finished;
    with `logprobs` each new token's (`TokenLogprobs`, one per token id) where the request asked for them."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None  # set (with finish_reason ABORT) when this request failed inside the engine
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def absorb(self, later: RequestOutput) -> None:
        """Fold a later output of the same request into this one (for callers that want the whole answer)."""
        self.token_ids += later.token_ids
        self.text += later.text
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason = later.finish_reason
        self.error = later.error
        self.prompt_tokens, self.completion_tokens = later.prompt_tokens, later.completion_tokens


@dataclass(frozen=True)
class Limits:
    """What a backend accepts and holds: for /v1/models, /info and request checks."""

    max_seq_len: int
    max_prompt_len: int
    slots: int
    dtype: str  # as resolved (never `auto` on a backend that holds the model)
    device: str
    dtype_auto: bool = False  # the dtype was `auto`, resolved for this machine
    quantization: str = "none"  # weight-only quantization of the linear layers: none, int8, int4
    weights_dtype: str | None = None  # what float layers' weights are held in (None: `dtype`, or unknown)


def check_fits(limits: Limits, prompt_len: int, max_tokens: int | None) -> int:
    """Refuse a request that can never run (InvalidRequest); returns its resolved max_tokens (what the slot
    leaves when it asks for no limit)."""
    if prompt_len < 1:
        raise InvalidRequest("the prompt is empty; send at least one token", "prompt")
    if prompt_len > limits.max_prompt_len:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens; the longest this deployment accepts is "
            f"{limits.max_prompt_len} (its largest prefill bucket)",
            "prompt",
        )
    room = limits.max_seq_len - prompt_len
    if room < 1:
        raise InvalidRequest(
            f"the prompt has {prompt_len} tokens and leaves no room to generate within the slot length "
            f"{limits.max_seq_len}",
            "prompt",
        )
    if max_tokens is not None and max_tokens > room:
        raise InvalidRequest(
            f"max_tokens {max_tokens} plus the prompt's {prompt_len} tokens exceeds the slot length "
            f"{limits.max_seq_len}; at most {room} new tokens fit",
            "max_tokens",
        )
    return max_tokens if max_tokens is not None else room


class Backend(Protocol):
    """The surface the HTTP server serves from.

    `generate` raises a `ServingError` (InvalidRequest, QueueFull, EngineFailed...) before its first output
    when the request is refused, and may raise RequestFailed or EngineFailed later; leaving the iteration
    early cancels the request.
    """

    error: BaseException | None  # set once the backend has failed for good (liveness fails)

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def eos_ids(self) -> frozenset[int]:
        """Token ids that end a request."""
        ...

    @property
    def limits(self) -> Limits: ...

    @property
    def alive(self) -> bool:
        """Ready to take requests."""
        ...

    @property
    def num_requests(self) -> int:
        """Requests accepted and not finished."""
        ...

    @property
    def num_pending(self) -> int:
        """Of those, the ones still waiting for room."""
        ...

    def load_gauges(self) -> list[tuple[str, str, Callable[[], float]]]:
        """(name, help, read) of the gauges that describe this backend's load."""
        ...

    def register_metrics(self, registry: CollectorRegistry, model_name: str) -> None:
        """Add the backend's own metrics to the server's registry."""
        ...

    def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]: ...

    def shutdown(self) -> None: ...
