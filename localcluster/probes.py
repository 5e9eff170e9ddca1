"""A container's probes as the kubelet runs them: startup, readiness and liveness, each at its declared
`periodSeconds` after `initialDelaySeconds`, each check bounded by `timeoutSeconds`, a result changing only
after `successThreshold` / `failureThreshold` consecutive checks (httpGet, tcpSocket or exec).

Kubernetes' semantics (pkg/kubelet/prober/worker.go, prober_manager.go; API defaults in
pkg/apis/core/v1/defaults.go: period 10 s, timeout 1 s, success 1, failure 3):
- readiness and liveness do not run until the startup probe succeeded; the startup probe stops once it has;
  when it succeeds, readiness runs at once (prober_manager's manual trigger) instead of at its next tick;
- readiness starts False for each new container instance, and is False while the container does not run;
- a liveness or startup result of Failure kills the container (the restart policy decides what follows) and
  holds the probe until the next instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

USER_AGENT = "kube-probe/1.32"  # what the kubelet sends (pkg/probe/http/request.go)
KINDS = ("startup", "readiness", "liveness")
CLIENT_TIMEOUT = "Client.Timeout exceeded while awaiting headers"  # Go's net/http, in a timed-out probe


@dataclass
class Probe:
    """One declared probe, with the API's defaults."""

    kind: str
    action: dict[str, Any]
    period: float = 10.0
    initial_delay: float = 0.0
    timeout: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3

    @classmethod
    def from_spec(cls, kind: str, spec: dict[str, Any] | None) -> Probe | None:
        if not spec:
            return None
        action = {k: spec[k] for k in ("httpGet", "tcpSocket", "exec", "grpc") if k in spec}
        return cls(
            kind,
            action,
            period=float(spec.get("periodSeconds", 10)),
            initial_delay=float(spec.get("initialDelaySeconds", 0)),
            timeout=float(spec.get("timeoutSeconds", 1)),
            success_threshold=int(spec.get("successThreshold", 1)),
            failure_threshold=int(spec.get("failureThreshold", 3)),
        )


class Streak:
    """The result of a probe from its checks: it moves only after enough consecutive equal checks."""

    def __init__(self, probe: Probe, initial: bool | None) -> None:
        self.probe, self.result = probe, initial
        self._last: bool | None = None
        self._run = 0

    def record(self, ok: bool) -> bool | None:
        """Count one check; return the (possibly new) result."""
        self._run = self._run + 1 if ok == self._last else 1
        self._last = ok
        if self._run >= (self.probe.success_threshold if ok else self.probe.failure_threshold):
            self.result = ok
        return self.result


@dataclass
class Target:
    """What a prober sees of its container and may do to it."""

    running: Callable[[], bool]
    instance: Callable[[], int]  # changes with each new container instance
    started_at: Callable[[], float]  # time.monotonic() when the instance started
    port: Callable[[str], int | None]  # a container port (name or number) -> its local port
    host: str
    kill: Callable[[str], Awaitable[None]]  # stop the instance, saying why
    changed: Callable[[], None]
    container: str = "main"
    event: Callable[[str, str, str], None] = lambda type_, reason, message: None  # records an Event


class Prober:
    """Runs a container's probes until `close()`; `ready` and `started` are their current results."""

    def __init__(self, container: dict[str, Any], target: Target) -> None:
        self.target = target
        self.probes = {
            k: p for k in KINDS if (p := Probe.from_spec(k, container.get(f"{k}Probe"))) is not None
        }
        self._ready = False
        self._started = False
        self._instance = -1
        self._trigger = asyncio.Event()  # readiness, now (the startup probe succeeded)
        self._tasks: list[asyncio.Task] = []
        self._session: aiohttp.ClientSession | None = None

    @property
    def started(self) -> bool:
        """The startup probe succeeded for the running instance (always, without one)."""
        return self.target.running() and self._current() and ("startup" not in self.probes or self._started)

    @property
    def ready(self) -> bool:
        """Readiness of the running instance (running and started, without a readiness probe)."""
        if not self.started:
            return False
        return "readiness" not in self.probes or self._ready

    def _current(self) -> bool:
        instance = self.target.instance()
        if instance != self._instance:  # a new container instance: every result starts over
            self._instance, self._ready, self._started = instance, False, False
        return True

    def start(self) -> None:
        self._session = aiohttp.ClientSession(headers={"User-Agent": USER_AGENT})
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._worker(p)) for p in self.probes.values()]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        # gather, not `suppress(CancelledError): await task`: that would also swallow a cancellation of the
        # caller (the kubelet stopping while it stops a pod), which then never stopped
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _worker(self, probe: Probe) -> None:
        instance, streak, held = None, Streak(probe, None), False
        while True:
            if self.target.instance() != instance:
                instance, held = self.target.instance(), False
                streak = Streak(probe, False if probe.kind == "readiness" else None)
            await self._step(probe, streak, held)
            if probe.kind in ("liveness", "startup") and streak.result is False:
                held = True
            wait = probe.period
            if probe.kind == "readiness":
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._trigger.wait(), wait)
                    self._trigger.clear()
                    continue
            else:
                await asyncio.sleep(wait)

    async def _step(self, probe: Probe, streak: Streak, held: bool) -> None:
        target = self.target
        self._current()
        if not target.running():
            if probe.kind == "readiness" and self._ready:
                self._ready = False
                target.changed()
            return
        gated = "startup" in self.probes and (self._started if probe.kind == "startup" else not self._started)
        if held or gated:
            return  # startup: done already; readiness and liveness: not yet
        if time.monotonic() - target.started_at() < probe.initial_delay:
            return
        instance = target.instance()
        ok, output = await self._check(probe)
        if target.instance() != instance:
            return  # the instance changed while the check ran
        if not ok:  # every failed check is an event (the recorder counts repeats): prober.go
            target.event("Warning", "Unhealthy", f"{probe.kind.capitalize()} probe failed: {output}")
        before = streak.result
        result = streak.record(ok)
        if probe.kind == "startup" and result:
            self._started = True
            self._trigger.set()
            target.changed()
        elif probe.kind == "readiness" and result != self._ready:
            self._ready = bool(result)
            target.changed()
        elif probe.kind in ("liveness", "startup") and result is False and before is not False:
            await target.kill(f"Container {target.container} failed {probe.kind} probe, will be restarted")

    async def _check(self, probe: Probe) -> tuple[bool, str]:
        """The check's result and, when it failed, why, in the kubelet's words (pkg/probe/http/http.go:
        "HTTP probe failed with statuscode: N"; Go's error for a failed request)."""
        action, url = probe.action, ""
        try:
            if "httpGet" in action:
                get = action["httpGet"]
                port = self.target.port(str(get["port"]))
                if port is None:
                    return False, f"unknown port {get['port']!r}"
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders", [])}
                url = f"http://{self.target.host}:{port}{get.get('path', '/')}"
                assert self._session is not None
                timeout = aiohttp.ClientTimeout(total=probe.timeout)
                async with self._session.get(url, headers=headers, timeout=timeout) as r:
                    ok = 200 <= r.status < 400
                    return ok, "" if ok else f"HTTP probe failed with statuscode: {r.status}"
            if "tcpSocket" in action:
                port = self.target.port(str(action["tcpSocket"]["port"]))
                if port is None:
                    return False, f"unknown port {action['tcpSocket']['port']!r}"
                url = f"{self.target.host}:{port}"
                opening = asyncio.open_connection(self.target.host, port)
                _, writer = await asyncio.wait_for(opening, probe.timeout)
                writer.close()
                return True, ""
            if "exec" in action:
                command = action["exec"]["command"]
                process = await asyncio.create_subprocess_exec(
                    *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
                )
                try:
                    out, _ = await asyncio.wait_for(process.communicate(), probe.timeout)
                except TimeoutError:
                    process.kill()
                    await process.wait()
                    return False, f"command {command!r} timed out"
                return process.returncode == 0, out.decode(errors="replace").strip()
        except TimeoutError:
            if url.startswith("http"):
                return False, f'Get "{url}": context deadline exceeded ({CLIENT_TIMEOUT})'
            return False, f"dial tcp {url}: i/o timeout"
        except (aiohttp.ClientError, OSError) as e:
            refused = isinstance(e, ConnectionRefusedError) or "Connect call failed" in str(e)
            address = url.split("/")[2] if url.startswith("http") else url
            why = f"dial tcp {address}: connect: connection refused" if refused else str(e)
            return False, f'Get "{url}": {why}' if url.startswith("http") else why
        return False, "grpc probes are not supported by the local kubelet"
