"""A local pod's process, as the process kubelet runs it: the container's command rewritten for this machine
(ports mapped to free local ports, 0.0.0.0 to 127.0.0.1, container paths to local folders, the installed
`neuronfleet` for the image), the process supervised (restarted with a growing delay under restartPolicy
Always, its termination message kept), its readiness probed, its stop graceful, and the pod status that
follows from all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .semantics import now

log = logging.getLogger(__name__)

PORT_FLAGS = ("--port", "--kv-port")
DEVICE_RESOURCES = ("aws.amazon.com/neuron", "aws.amazon.com/neuroncore", "vpc.amazonaws.com/efa")
MAX_GRACE_SECONDS = 10.0
POD_IP = "127.0.0.1"  # every pod's address: its ports, not its address, tell pods apart


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def map_path(value: str, mounts: list[tuple[str, Path]]) -> str:
    """A container path (or `--flag=path`) with its mount's local folder in place of the mount path."""
    flag, eq, rest = value.partition("=") if value.startswith("--") and "=" in value else ("", "", value)
    for mount, local in mounts:  # longest mount paths first
        if rest == mount or rest.startswith(mount + "/"):
            return f"{flag}{eq}{local}{rest[len(mount) :]}"
    return value


def rewrite_command(command: list[str], ports: dict[int, int], mounts: list[tuple[str, Path]]) -> list[str]:
    """The container's command as it runs here: ports mapped, 0.0.0.0 -> 127.0.0.1, container paths mapped."""
    out: list[str] = []
    for i, arg in enumerate(command):
        before = command[i - 1] if i else ""
        if before in PORT_FLAGS and arg.isdigit() and int(arg) in ports:
            arg = str(ports[int(arg)])
        elif before == "--host" and arg in ("0.0.0.0", "::"):
            arg = "127.0.0.1"
        else:
            arg = map_path(arg, mounts)
        out.append(arg)
    if out and out[0] == "neuronfleet":  # the image's entry point: the installed command
        out[0] = shutil.which("neuronfleet") or str(Path(sys.executable).parent / "neuronfleet")
    return out


@dataclass(eq=False)
class LocalPod:
    """A pod's process and what the kubelet knows of it."""

    namespace: str
    name: str
    uid: str
    folder: Path
    log_path: Path
    ports: dict[str, int]  # container port name (or number) -> local port
    port_numbers: dict[int, int]  # container port -> local port
    restart_always: bool
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    ready: bool = False
    exit_code: int | None = None
    message: str = ""
    started_at: str = ""
    tasks: list[asyncio.Task] = field(default_factory=list)
    stopping: bool = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None


async def supervise(
    pod: LocalPod, command: list[str], env: dict[str, str], changed: Callable[[], None]
) -> None:
    """Run the process; restart it when it dies (restartPolicy Always), with a growing delay. `changed()` is
    called when the pod's state moved."""
    delay = 1.0
    while not pod.stopping:
        with open(pod.log_path, "ab") as out:
            pod.started_at = now()
            pod.process = await asyncio.create_subprocess_exec(
                *command,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                cwd=pod.folder,
                start_new_session=True,
            )
        (pod.folder / "pid").write_text(str(pod.process.pid))
        pod.exit_code = await pod.process.wait()
        pod.ready = False
        termination = pod.folder / "termination-log"
        pod.message = termination.read_text() if termination.is_file() else ""
        if not pod.message and pod.exit_code != 0:  # FallbackToLogsOnError
            pod.message = pod.log_path.read_bytes()[-2048:].decode(errors="replace")
        if pod.stopping or not pod.restart_always:
            return
        pod.restarts += 1
        log.warning(
            "pod %s/%s exited %s; restarting (%d)", pod.namespace, pod.name, pod.exit_code, pod.restarts
        )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 10.0)
        pod.exit_code = None
        changed()


async def probe_readiness(pod: LocalPod, probe: dict[str, Any] | None, changed: Callable[[], None]) -> None:
    """Keep `pod.ready` true while the process runs and its readiness probe (httpGet) answers 2xx or 3xx."""
    period = float((probe or {}).get("periodSeconds", 1))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not pod.stopping:
            ready = pod.running
            if ready and probe and "httpGet" in probe:
                port = pod.ports.get(str(probe["httpGet"]["port"]))
                try:
                    async with session.get(f"http://{POD_IP}:{port}{probe['httpGet'].get('path', '/')}") as r:
                        ready = 200 <= r.status < 400
                except (aiohttp.ClientError, OSError, TimeoutError):
                    ready = False
            if ready != pod.ready:
                pod.ready = ready
                changed()
            await asyncio.sleep(min(period, 1.0))


async def stop(pod: LocalPod) -> None:
    """SIGTERM to the pod's process group, SIGKILL after the grace period; its tasks end."""
    pod.stopping = True
    proc = pod.process
    if proc is not None and proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), MAX_GRACE_SECONDS)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    for task in pod.tasks:
        task.cancel()
    log.info("pod %s/%s stopped", pod.namespace, pod.name)


def pod_status(pod: dict[str, Any], local: LocalPod) -> dict[str, Any]:
    """The pod's status from its process: phase, container state, readiness, restarts, device requests
    (recorded, not enforced: condition DevicesEnforced False)."""
    finished = not local.restart_always and local.exit_code is not None
    if finished:
        phase = "Succeeded" if local.exit_code == 0 else "Failed"
        state: dict[str, Any] = {
            "terminated": {
                "exitCode": local.exit_code,
                "message": local.message[:4096],
                "reason": "Completed" if local.exit_code == 0 else "Error",
            }
        }
    elif local.running:
        phase, state = "Running", {"running": {"startedAt": local.started_at}}
    else:
        phase, state = (
            ("Running" if local.restarts else "Pending"),
            {"waiting": {"reason": "ContainerCreating"}},
        )
    container = pod["spec"]["containers"][0]
    limits = (container.get("resources") or {}).get("limits") or {}
    devices = {k: v for k, v in limits.items() if k in DEVICE_RESOURCES}
    conditions = [{"type": "Ready", "status": "True" if local.ready else "False"}]
    if devices:
        conditions.append(
            {
                "type": "DevicesEnforced",
                "status": "False",
                "reason": "LocalMode",
                "message": "recorded, not enforced (local mode has no devices): "
                + ", ".join(f"{k}={v}" for k, v in sorted(devices.items())),
            }
        )
    return {
        "phase": phase,
        "podIP": POD_IP,
        "hostIP": POD_IP,
        "conditions": conditions,
        "containerStatuses": [
            {
                "name": container["name"],
                "ready": local.ready,
                "restartCount": local.restarts,
                "image": container.get("image", ""),
                "state": state,
            }
        ],
    }
