"""A local pod's process, as the process kubelet runs it: the container's command rewritten for this machine
(ports mapped to free local ports, 0.0.0.0 to 127.0.0.1, container paths to local folders, the installed
`neuronfleet` for the image), the process supervised (its output logged per instance with per-line times,
restarted with a growing delay as the restart policy says, its termination message and last state kept),
killed and stopped gracefully (a deleted pod's preStop `sleep` hook first), and the pod status that follows
from all of it (probes: `probes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .guard import open_private
from .podlogs import LogOptions, copy_lines, select
from .semantics import now

log = logging.getLogger(__name__)

PORT_FLAGS = ("--port", "--kv-port")
DEVICE_RESOURCES = ("aws.amazon.com/neuron", "aws.amazon.com/neuroncore", "vpc.amazonaws.com/efa")
# a pod's terminationGracePeriodSeconds is honoured up to this (a serving pod's is derived from what it may
# hold: 72 s for the local samples' 512-token sequences, the 5 s preStop sleep and the runtime's drain), so a
# request in flight on a deleted pod finishes, as a real kubelet lets it, on a busy machine too, while a
# deletion never holds a test for minutes (a process that exits sooner costs nothing more)
MAX_GRACE_SECONDS = 60.0
# a preStop hook that used up the grace period leaves the process this long after SIGTERM: the kubelet's
# "one-off grace period extension of 2 seconds" (kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle,
# "Termination of Pods")
MIN_GRACE_AFTER_HOOK_SECONDS = 2.0
POD_IP = "127.0.0.1"  # every pod's address: its ports, not its address, tell pods apart


def map_path(value: str, mounts: list[tuple[str, Path]]) -> str:
    """A container path (or `--flag=path`) with its mount's local folder in place of the mount path."""
    flag, eq, rest = value.partition("=") if value.startswith("--") and "=" in value else ("", "", value)
    for mount, local in mounts:  # longest mount paths first
        if rest == mount or rest.startswith(mount + "/"):
            return f"{flag}{eq}{local}{rest[len(mount) :]}"
    return value


def mounted_folders(container: dict[str, Any], volumes: dict[str, Path]) -> list[tuple[str, Path]]:
    """The container's mounts as (mount path, local folder), longest mount paths first (as `map_path` reads
    them): its volume's folder, or at a `subPath` the folder inside it, made when missing as the kubelet
    makes it (a subPath that would leave its volume is refused, as the API server refuses it)."""
    out = []
    for m in container.get("volumeMounts", []):
        if m["name"] not in volumes or m["mountPath"] == "/dev/shm":
            continue
        folder = volumes[m["name"]]
        if m.get("subPath"):
            inside = (folder / m["subPath"]).resolve()
            if not inside.is_relative_to(folder.resolve()):
                raise ValueError(f"volumeMount {m['name']}: subPath {m['subPath']} leaves its volume")
            inside.mkdir(parents=True, exist_ok=True)
            folder = inside
        out.append((m["mountPath"], folder))
    return sorted(out, key=lambda m: -len(m[0]))


def rewrite_command(command: list[str], ports: dict[int, int], mounts: list[tuple[str, Path]]) -> list[str]:
    """The container's command as it runs here: ports mapped, 0.0.0.0 -> 127.0.0.1, container paths mapped."""
    out: list[str] = []
    for i, arg in enumerate(command):
        before = command[i - 1] if i else ""
        if before in PORT_FLAGS and arg.isdigit() and int(arg) in ports:
            arg = str(ports[int(arg)])
        elif before == "--host" and arg in ("0.0.0.0", "::"):
            arg = "127.0.0.1"
        elif before == "--kv-events-config":
            arg = _local_events_endpoint(arg, ports)
        else:
            arg = map_path(arg, mounts)
        out.append(arg)
    if out and out[0] == "neuronfleet":  # the image's entry point: the installed command
        out[0] = shutil.which("neuronfleet") or str(Path(sys.executable).parent / "neuronfleet")
    return out


def _local_events_endpoint(config: str, ports: dict[int, int]) -> str:
    """A pod's KV-cache event publisher (`--kv-events-config` JSON) on this machine: its `tcp://*:PORT`
    endpoint and replay endpoint on 127.0.0.1 and the pod's local ports, as its other ports."""
    try:
        values = json.loads(config)
    except ValueError:
        return config  # the pod says what is wrong with it
    if not isinstance(values, dict):
        return config
    for key in ("endpoint", "replay_endpoint"):
        scheme, _, rest = str(values.get(key) or "").partition("://")
        host, _, port = rest.rpartition(":")
        if scheme == "tcp" and port.isdigit() and int(port) in ports:
            host = POD_IP if host in ("*", "0.0.0.0", "[::]") else host
            values[key] = f"tcp://{host}:{ports[int(port)]}"
    return json.dumps(values)


@dataclass(eq=False)
class LocalPod:
    """A pod's process (its container's current instance) and what the kubelet knows of it."""

    namespace: str
    name: str
    uid: str
    folder: Path
    log_dir: Path  # one CRI log file per container instance: 0.log, 1.log, ...
    ports: dict[str, int]  # container port name (or number) -> local port
    port_numbers: dict[int, int]  # container port -> local port
    restart_policy: str = "Always"
    grace_seconds: float = 30.0
    pre_stop: dict[str, Any] | None = None  # the container's lifecycle.preStop handler
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    exit_code: int | None = None
    message: str = ""
    started_at: str = ""
    started_mono: float = 0.0
    finished_at: str = ""
    instance: int = -1  # the current instance (its log file's number); -1 before the first
    writing: bool = False  # the current instance's streams are still being copied to its log
    last_state: dict[str, Any] | None = None  # the previous instance's `terminated` record
    last_instance: int = -1  # and its number
    backoff: float = 0.0  # > 0: waiting this long to restart (CrashLoopBackOff)
    prober: Any = None  # its `probes.Prober`
    container: str = "main"  # the container's name
    event: Callable[[str, str, str], None] = lambda type_, reason, message: None  # records an Event
    tasks: list[asyncio.Task] = field(default_factory=list)
    stopping: bool = False

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def ready(self) -> bool:
        return self.running and (self.prober.ready if self.prober is not None else True)

    @property
    def started(self) -> bool:
        return self.running and (self.prober.started if self.prober is not None else True)

    def log_file(self, instance: int) -> Path:
        return self.log_dir / f"{instance}.log"

    def restarts_after(self, exit_code: int) -> bool:
        return self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and exit_code != 0)

    def terminated(self) -> dict[str, Any]:
        """The record of the instance that just ended (the kubelet's ContainerStateTerminated)."""
        return {
            "exitCode": self.exit_code,
            "reason": "Completed" if self.exit_code == 0 else "Error",
            "message": self.message[:4096],
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
            "containerID": f"local://{self.uid}/{self.instance}",
        }


def exit_status(returncode: int) -> int:
    """A process's exit code as a container runtime reports it (killed by signal N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


async def supervise(
    pod: LocalPod, command: list[str], env: dict[str, str], changed: Callable[[], None]
) -> None:
    """Run the process, its stdout and stderr copied line by line to the instance's CRI log file; restart it
    as the restart policy says, with a growing delay. `changed()` is called when the pod's state moved."""
    delay = 1.0
    pod.log_dir.mkdir(parents=True, exist_ok=True)
    while not pod.stopping:
        pod.instance += 1
        with open_private(pod.log_file(pod.instance)) as out:  # (0600: what a pod logs is its user's)
            pod.started_at, pod.started_mono, pod.writing = now(), time.monotonic(), True
            pod.exit_code, pod.finished_at = None, ""
            pod.process = await asyncio.create_subprocess_exec(
                *command,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                cwd=pod.folder,
                start_new_session=True,
            )
            (pod.folder / "pid").write_text(str(pod.process.pid))
            pod.event("Normal", "Created", f"Created container {pod.container}")
            pod.event("Normal", "Started", f"Started container {pod.container}")
            changed()
            assert pod.process.stdout is not None and pod.process.stderr is not None
            copies = [
                asyncio.ensure_future(copy_lines(pod.process.stdout, "stdout", out)),
                asyncio.ensure_future(copy_lines(pod.process.stderr, "stderr", out)),
            ]
            try:
                code = exit_status(await pod.process.wait())
                # what a child left holding the streams may still write; the instance's log ends soon after
                await asyncio.wait(copies, timeout=2.0)
            finally:
                for copy in copies:
                    copy.cancel()
                pod.writing = False  # followers of this instance's log end (also when stopped for good)
        pod.exit_code, pod.finished_at = code, now()
        termination = pod.folder / "termination-log"
        pod.message = termination.read_text() if termination.is_file() else ""
        if not pod.message and pod.exit_code != 0:  # FallbackToLogsOnError: the log's last lines
            data = pod.log_file(pod.instance).read_bytes()
            if len(data) > 8192:  # the last 8 KiB, from a line's start
                data = data[-8192:]
                data = data[data.find(b"\n") + 1 :]
            text, _ = select(data, LogOptions(tail=80))
            pod.message = text[-2048:].decode(errors="replace")
        changed()
        if pod.stopping or not pod.restarts_after(pod.exit_code):
            return
        pod.last_state, pod.last_instance = pod.terminated(), pod.instance
        pod.restarts += 1
        log.warning(
            "pod %s/%s exited %s; restarting (%d)", pod.namespace, pod.name, pod.exit_code, pod.restarts
        )
        pod.backoff = delay
        pod.event("Warning", "BackOff", f"Back-off restarting failed container {pod.container} in pod "
                  f"{pod.name}_{pod.namespace}({pod.uid})")  # fmt: skip
        changed()
        await asyncio.sleep(delay)
        pod.backoff = 0.0
        delay = min(delay * 2, 10.0)


async def kill(pod: LocalPod, why: str = "", grace: float | None = None) -> None:
    """Stop the current instance (SIGTERM to its process group, SIGKILL after the grace period); the
    supervisor then restarts it or not, as the restart policy says. `why` (a probe failed) is logged and
    recorded (event Killing); `grace`: the seconds SIGTERM has before SIGKILL (the pod's grace period)."""
    proc = pod.process
    if proc is None or proc.returncode is not None:
        return
    if why:
        log.warning("pod %s/%s: %s", pod.namespace, pod.name, why)
    pod.event("Normal", "Killing", why or f"Stopping container {pod.container}")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), grace if grace is not None else _grace(pod))
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()


def _grace(pod: LocalPod) -> float:
    return min(pod.grace_seconds, MAX_GRACE_SECONDS)


async def pre_stop(pod: LocalPod) -> float:
    """Run the container's preStop hook, as the kubelet does before SIGTERM when a pod is deleted, within the
    grace period; the seconds it took. Local mode runs the `sleep` action (Kubernetes 1.30+, KEP-3960), the
    one neuronfleet's serving pods use: the pod is already out of its Services, so requests routed to it in
    the meantime still get answers. Other handlers (exec, httpGet, tcpSocket) are not run here: a Warning
    Event says so."""
    hook = pod.pre_stop or {}
    if not hook or not pod.running:
        return 0.0
    if "sleep" not in hook:
        kind = next(iter(hook))
        pod.event(
            "Warning", "FailedPreStopHook", f"the local kubelet runs only sleep preStop hooks, not {kind}"
        )
        return 0.0
    seconds = min(float(hook["sleep"].get("seconds") or 0), _grace(pod))
    began = time.monotonic()
    log.info("pod %s/%s: preStop sleep %g s", pod.namespace, pod.name, seconds)
    await asyncio.sleep(seconds)
    return time.monotonic() - began


async def stop(pod: LocalPod, hooks: bool = True) -> None:
    """Stop the pod for good: its preStop hook (`hooks`: a deleted pod; not when the whole node stops), its
    process (gracefully, in what the hook left of the grace period), its supervisor and probes."""
    pod.stopping = True
    took = await pre_stop(pod) if hooks else 0.0
    await kill(pod, grace=max(_grace(pod) - took, MIN_GRACE_AFTER_HOOK_SECONDS) if took else _grace(pod))
    if pod.prober is not None:
        await pod.prober.close()
    for task in pod.tasks:
        task.cancel()
    log.info("pod %s/%s stopped", pod.namespace, pod.name)


def pod_status(pod: dict[str, Any], local: LocalPod) -> dict[str, Any]:
    """The pod's status from its process: phase, container state (running, waiting in ContainerCreating or
    CrashLoopBackOff, terminated Completed/Error) and the previous instance's (`lastState`), readiness,
    restarts, device requests (recorded, not enforced: condition DevicesEnforced False)."""
    container = pod["spec"]["containers"][0]
    finished = local.exit_code is not None and not local.restarts_after(local.exit_code)
    if finished:
        phase = "Succeeded" if local.exit_code == 0 else "Failed"
        state: dict[str, Any] = {"terminated": local.terminated()}
    elif local.running:
        phase, state = "Running", {"running": {"startedAt": local.started_at}}
    elif local.backoff:
        phase = "Running"
        message = (
            f"back-off {local.backoff:g}s restarting failed container={container['name']} "
            f"pod={local.name}_{local.namespace}({local.uid})"
        )
        state = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
    else:
        phase = "Running" if local.restarts else "Pending"
        state = {"waiting": {"reason": "ContainerCreating"}}
    limits = (container.get("resources") or {}).get("limits") or {}
    devices = {k: v for k, v in limits.items() if k in DEVICE_RESOURCES}
    ready = local.ready
    conditions = [
        {"type": "Ready", "status": "True" if ready else "False"},
        {"type": "ContainersReady", "status": "True" if ready else "False"},
    ]
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
    status = {
        "name": container["name"],
        "ready": ready,
        "started": local.started,
        "restartCount": local.restarts,
        "image": container.get("image", ""),
        "state": state,
        "lastState": {"terminated": local.last_state} if local.last_state else {},
    }
    if local.instance >= 0:
        status["containerID"] = f"local://{local.uid}/{local.instance}"
    return {
        "phase": phase,
        "podIP": POD_IP,
        "hostIP": POD_IP,
        "conditions": conditions,
        "containerStatuses": [status],
    }
