"""The errors a request can meet while it is served (pure): one base class that carries the HTTP status.

The server answers any `ServingError` with its `status`, or `tgi_status` on the TGI routes, where the two APIs
differ (an invalid request: OpenAI 400, TGI 422; a full queue or an expected wait past the bound: OpenAI 429,
TGI 503; a drain's refusal or hand-back: 503 on both), with Retry-After on every 429 and 503, and counts it as
`reason` in `neuronfleet:requests_rejected`. Anything else that escapes is a bug: logged and answered 500.
"""

from __future__ import annotations


class ServingError(Exception):
    """A request refused or failed; the subclass says how the APIs answer it."""

    status = 500
    tgi_status: int | None = None  # None: the same as `status`
    reason = "failed"
    field_name: str | None = None  # the request field at fault, for OpenAI's `param`
    retry_after: int | None = None  # seconds for the Retry-After header of a 429 or 503 (None: the default)

    def http_status(self, tgi: bool) -> int:
        return self.tgi_status if tgi and self.tgi_status is not None else self.status


class InvalidRequest(ServingError, ValueError):
    """A request the engine refuses; the message names the field, the value and the allowed range."""

    status, tgi_status, reason = 400, 422, "invalid"

    def __init__(self, message: str, field_name: str | None = None) -> None:
        super().__init__(message)
        self.field_name = field_name


class BodyTooLarge(InvalidRequest):
    """The request body is over the configured limit."""

    status, tgi_status, reason = 413, 413, "body_too_large"


class UnsupportedEncoding(InvalidRequest):
    """The request body has a content coding (`Content-Encoding`) other than identity."""

    status, tgi_status, reason = 415, 415, "unsupported_encoding"


class RequestTimeout(ServingError):
    """The client did not send its request (headers or body) within the server's time for it."""

    status, tgi_status, reason = 408, 408, "request_timeout"


class QueueFull(ServingError):
    """The waiting queue is at its bound; retry after `retry_after` seconds (None: 1)."""

    status, tgi_status, reason = 429, 503, "queue_full"

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Overloaded(QueueFull):
    """The request would wait for a slot longer than the bound (`--max-queue-wait`): refused at once when
    its expected wait passes it (`engine.admission`), or once it has waited that long; Retry-After says when
    the queue ahead will have drained enough."""

    reason = "overloaded"


class Draining(QueueFull):
    """The server is shutting down and takes no new requests."""

    status, tgi_status, reason = 503, 503, "draining"


class HandedBack(Draining):
    """A draining server gives back a request it accepted and will not finish in its grace period, before
    its answer starts: 503 with Retry-After, which our routers send to another pod at once."""

    reason = "handed_back"


class RequestFailed(ServingError):
    """One request failed inside the engine; the engine and the other requests go on."""


class EngineFailed(ServingError):
    """The engine itself failed (a model step raised) or has shut down; no request can run."""


class Unavailable(EngineFailed):
    """No pod could serve the request now (a router without a decode pod that answers)."""

    status, tgi_status, reason = 503, 503, "unavailable"


def queue_full_message(slots: int, max_waiting: int) -> str:
    return f"all {slots} slots are busy and the waiting queue holds {max_waiting} requests; retry later"


# OpenAI's error types by status, as its Python client names its exceptions (openai._exceptions)
OPENAI_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "BadRequestError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def openai_error_body(status: int, message: str, param: str | None = None) -> dict:
    """An error in the OpenAI API's format (`error.message`, `type`, `param`, `code`)."""
    kind = OPENAI_ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


# TGI's error types by status (text-generation-inference router/src/server.rs, ErrorResponse.error_type)
TGI_ERROR_TYPES = {
    404: "not_found",
    413: "validation",
    422: "validation",
    429: "overloaded",
    503: "overloaded",
    500: "generation",
}


def tgi_error_body(status: int, message: str) -> dict:
    """An error in the TGI API's format (`error`, `error_type`)."""
    return {
        "error": message,
        "error_type": TGI_ERROR_TYPES.get(status, "validation" if status < 500 else "generation"),
    }
