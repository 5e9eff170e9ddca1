"""What the Hugging Face Hub says about an hf:// model before anything compiles it: its config.json's length
limit (`contract.model_length_limit`), read with the model's token and kept, so validation refuses a
`neuron.sequenceLength` the model cannot serve at `kubectl apply` instead of in a compile pod. The operator's
and `neuronfleet validate`'s only talk to the Hub.

The Hub's own environment variables are honoured: `HF_ENDPOINT` (another Hub, or a mirror) and
`HF_HUB_OFFLINE=1` (read nothing). A read that fails (no network, gated without a token, no config.json: a
GGUF repository) refuses nothing: the compile reads the files themselves and checks again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from neuronfleet.contract import model_length_limit

ENDPOINT_ENV = "HF_ENDPOINT"
OFFLINE_ENV = "HF_HUB_OFFLINE"
DEFAULT_ENDPOINT = "https://huggingface.co"
READ_TIMEOUT = 5.0  # seconds one read may take: a reconcile waits on it
KEEP_SECONDS = 3600.0  # a branch's config (main) may change; a commit's never does
RETRY_SECONDS = 300.0  # a failed read is tried again after this
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubConfig:
    """One read of a model's config.json: its length limit (None when it says none), or why it could not
    be read."""

    limit: int | None = None
    error: str | None = None

    def where(self, uri: str, revision: str | None) -> str:
        """What the limit was read from, for a refusal's message."""
        return f"from {uri}{'@' + revision if revision else ''}'s config.json on the Hub"


def offline() -> bool:
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def config_url(endpoint: str, repo: str, revision: str | None) -> str:
    """The Hub's address of a file at a revision (`/{repo}/resolve/{revision}/{file}`)."""
    return f"{endpoint.rstrip('/')}/{repo}/resolve/{quote(revision or 'main', safe='')}/config.json"


class HubConfigs:
    """config.json reads, kept per (repository, revision, token): a commit's for good, a branch's for
    KEEP_SECONDS, a failure for RETRY_SECONDS. Concurrent asks for one key share one read."""

    def __init__(
        self,
        endpoint: str | None = None,
        timeout: float = READ_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT
        self.timeout = timeout
        self.clock = clock
        self._kept: dict[tuple[str, str | None, str], tuple[HubConfig, float]] = {}
        self._reading: dict[tuple[str, str | None, str], asyncio.Future[HubConfig]] = {}

    def _still_kept(self, key: tuple[str, str | None, str]) -> HubConfig | None:
        entry = self._kept.get(key)
        return entry[0] if entry and entry[1] > self.clock() else None

    async def read(self, uri: str, revision: str | None, token: str | None) -> HubConfig:
        """The config of an hf://org/name model at `revision` (main when None), read with `token`."""
        repo = uri.removeprefix("hf://")
        if offline():
            return HubConfig(error=f"not read: {OFFLINE_ENV} is set")
        key = _key(repo, revision, token)
        if (kept := self._still_kept(key)) is not None:
            return kept
        if key in self._reading:
            return await asyncio.shield(self._reading[key])
        future: asyncio.Future[HubConfig] = asyncio.get_running_loop().create_future()
        self._reading[key] = future
        try:
            result = await self._fetch(repo, revision, token)
            if result.error:  # (once per RETRY_SECONDS: the failure is kept)
                log.info("hf://%s config.json not read (%s): its length is checked when it compiles", repo,
                         result.error)  # fmt: skip
            lasts = float("inf") if revision and _COMMIT.match(revision) else KEEP_SECONDS
            self._kept[key] = (result, self.clock() + (RETRY_SECONDS if result.error else lasts))
            future.set_result(result)
            return result
        finally:
            del self._reading[key]

    async def _fetch(self, repo: str, revision: str | None, token: str | None) -> HubConfig:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        url = config_url(self.endpoint, repo, revision)
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout)
            async with (
                aiohttp.ClientSession(timeout=timeout, headers=headers) as session,
                session.get(url, allow_redirects=True) as r,
            ):
                if r.status != 200:
                    return HubConfig(error=_status_text(r.status, token))
                config = json.loads(await r.read())
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            return HubConfig(error=f"the Hub did not answer ({type(e).__name__})")
        except ValueError:
            return HubConfig(error="its config.json is not JSON")
        if not isinstance(config, dict):
            return HubConfig(error="its config.json is not a JSON object")
        return HubConfig(limit=model_length_limit(config))


def _key(repo: str, revision: str | None, token: str | None) -> tuple[str, str | None, str]:
    """The token as a digest: a kept read says nothing of it."""
    return repo, revision, hashlib.sha256((token or "").encode()).hexdigest()


def _status_text(status: int, token: str | None) -> str:
    if status in (401, 403):
        return f"the Hub refused the read ({status}): " + (
            "the token in the model's secretRef has no access" if token else "gated or private; no token"
        )
    if status == 404:
        return "no config.json there (404)"
    return f"the Hub answered {status}"


def secret_token(secret: dict[str, Any] | None, key: str) -> str | None:
    """A token from a Secret's data (base64, as the API serves it), or None."""
    import base64

    value = ((secret or {}).get("data") or {}).get(key)
    if not isinstance(value, str):
        return None
    try:
        return base64.b64decode(value).decode().strip() or None
    except ValueError:
        return None
