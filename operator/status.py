"""A NeuronModel's status (phase, conditions, replicas, artifacts, endpoint, compile progress) computed from
what was observed: its spec's validation errors, the compile Job, the compile pod's report and log tail and
the serving Deployments. Pure: no I/O and no clock (the caller passes the time)."""

from __future__ import annotations

import calendar
import json
import time
from typing import Any, Literal

from neuronfleet.contract import SOURCE_UNAVAILABLE, parse_progress, progress_text

from . import node_offers

CONDITION_TYPES = ("Validated", "Compiled", "Ready", "Progressing", "Degraded")
VALID = "the spec fits its instance type"


def job_state(job: dict[str, Any] | None) -> tuple[str, str]:
    """(absent | running | succeeded | failed, message) of a compile Job."""
    if job is None:
        return "absent", ""
    status = job.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("status") == "True" and c.get("type") == "Complete":
            return "succeeded", c.get("message", "")
        if c.get("status") == "True" and c.get("type") == "Failed":
            return "failed", f"{c.get('reason', 'Failed')}: {c.get('message', 'the compile Job failed')}"
    if status.get("succeeded"):
        return "succeeded", ""
    return "running", f"compile Job {job['metadata']['name']} is running"


def compile_failure(pods: list[dict[str, Any]]) -> str:
    """Why a failed compile Job's pods ended: the newest failed pod's termination message (the compile's own
    error, or its fetch-model initContainer's), its last line, or from the line that says the model source
    was unreadable on (a Hub client's error spans lines: the words retried on must not be cut off,
    `rollout.source_retry_at`); "" when none left one."""
    failed = []
    for pod in pods:
        pod_status = pod.get("status") or {}
        for status in [
            *(pod_status.get("initContainerStatuses") or []),
            *(pod_status.get("containerStatuses") or []),
        ]:
            terminated = (status.get("state") or {}).get("terminated") or {}
            if terminated.get("exitCode") not in (None, 0) and terminated.get("message"):
                failed.append((terminated.get("finishedAt") or "", _failure_words(terminated["message"])))
    return max(failed)[1] if failed else ""


def compile_report(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The manifest a compile pod left as its termination message (bytes, compiledAt, cacheHit), if any."""
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            message = ((status.get("state") or {}).get("terminated") or {}).get("message")
            try:
                report = json.loads(message) if message else None
            except ValueError:
                continue
            if isinstance(report, dict):
                return report
    return None


# ---- compile progress (the compile pod's log lines, contract.CompileProgress) ------------------------------

PROGRESS_READ_SECONDS = 12.0  # a running compile pod's log tail is read at most this often per model
PROGRESS_WRITE_SECONDS = 15.0  # status.compileProgress is written at most this often (a new phase at once)
PROGRESS_TAIL_LINES = 40  # lines of the log read: a compile prints one progress line per 2 s at most


def _epoch(timestamp: str) -> float:
    """Seconds since the epoch of an RFC 3339 time as the API server writes them (2026-01-02T03:04:05Z)."""
    return float(calendar.timegm(time.strptime(timestamp[:19], "%Y-%m-%dT%H:%M:%S")))


def compile_progress(tail: str | None, started_at: str | None, at: str) -> dict[str, Any] | None:
    """status.compileProgress from the tail of a running compile pod's log (the newest progress line in it)
    and when its container started; the elapsed time is counted to `at` (the line may be older: a long step
    prints none); None when the tail holds no progress line."""
    progress = parse_progress(tail or "")
    if progress is None:
        return None
    elapsed = progress.elapsed
    if started_at:
        elapsed = max(elapsed, _epoch(at) - _epoch(started_at))
    return {
        **progress.model_dump(exclude={"elapsed"}),
        "startedAt": started_at,
        "elapsed": round(elapsed, 1),
        "text": progress_text(progress, elapsed),
        "updatedAt": at,
    }


def progress_due(
    old: dict[str, Any] | None, new: dict[str, Any] | None, at: str, every: float = PROGRESS_WRITE_SECONDS
) -> dict[str, Any] | None:
    """The compileProgress to keep in status: `new` when what it shows changed and the old one was written
    `every` seconds ago or more, or its phase changed; else `old` (no write). None (no line yet) keeps old."""
    if new is None or (old is not None and old.get("text") == new["text"]):
        return old
    if old is None or old.get("phase") != new["phase"] or not old.get("updatedAt"):
        return new
    return new if _epoch(at) - _epoch(old["updatedAt"]) >= every else old


# a container waiting for one of these will not start without a change (the kubelet's reasons:
# https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#container-state-waiting and
# pkg/kubelet/images, pkg/kubelet/container/sync_result.go at v1.31)
STUCK_REASONS = (
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
    "CreateContainerError", "RunContainerError",
)  # fmt: skip


def _failure_words(message: str, limit: int = 400) -> str:
    """A termination message's last line, or its lines from the one naming an unreadable model source
    (contract.SOURCE_UNAVAILABLE) on, joined with '; ', shortened."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if SOURCE_UNAVAILABLE in line), None)
    if start is None:
        return _last_line(message, limit)
    words = "; ".join(lines[start:])
    return words if len(words) <= limit else words[: limit - 3] + "..."


MAX_PROBLEMS = 3  # pods named in a message; the rest are counted


def _last_line(text: str | None, limit: int = 240) -> str:
    """The last non-empty line of a termination message or log tail, shortened."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last if len(last) <= limit else last[: limit - 3] + "..."


def pod_problem(pod: dict[str, Any]) -> str | None:
    """Why a serving pod that is not ready will not become ready without a change, or None: a container
    crash-looping (with its last exit code and termination message), an image that cannot be pulled, a
    container that cannot be created, or a pod no node can take."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
        return None
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    if (conditions.get("Ready") or {}).get("status") == "True":
        return None
    name = meta.get("name", "?")
    scheduled = conditions.get("PodScheduled") or {}
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        return f"pod {name} cannot be scheduled: {_last_line(scheduled.get('message')) or 'no node fits'}"
    for c in status.get("containerStatuses") or []:
        waiting = (c.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason not in STUCK_REASONS:
            continue
        if reason == "CrashLoopBackOff":
            last = (c.get("lastState") or {}).get("terminated") or {}
            why = _last_line(last.get("message")) or last.get("reason") or "no message"
            return (
                f"pod {name} is crash-looping ({c.get('restartCount', 0)} restarts; last exit code "
                f"{last.get('exitCode', '?')}: {why})"
            )
        return f"pod {name}: {reason}: {_last_line(waiting.get('message')) or 'no message'}"
    return None


def pod_problems(pods: list[dict[str, Any]]) -> list[str]:
    """`pod_problem` of each serving pod (compile pods are the Job's), at most MAX_PROBLEMS named."""
    found = [
        p for pod in pods
        if ((pod.get("metadata") or {}).get("labels") or {}).get("neuronfleet.dev/role") != "compile"
        and (p := pod_problem(pod)) is not None
    ]  # fmt: skip
    found.sort()
    if len(found) > MAX_PROBLEMS:
        return [*found[:MAX_PROBLEMS], f"and {len(found) - MAX_PROBLEMS} more"]
    return found


def condition(
    old: list[dict], type_: str, ok: bool | None, reason: str, message: str, generation: int, at: str
) -> dict:
    """A condition of `type_`: True, False or (`ok` None) Unknown; its lastTransitionTime kept while its
    status is the old one's."""
    value = "Unknown" if ok is None else "True" if ok else "False"
    previous = next((c for c in old if c.get("type") == type_), None)
    since = previous["lastTransitionTime"] if previous and previous.get("status") == value else at
    return {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


ROUTER = "router"  # a role whose pods route to the serving pods and serve no model themselves


def serving_pods(roles: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """(desired, ready) pods that serve the model: every role's but the routers' (a front door, a
    disaggregated model's router), each role's ready at most its desired; the READY column (readyReplicas)
    and the conditions' pod counts."""
    serving = [(d, r) for role, (d, r) in roles.items() if role != ROUTER]
    return sum(d for d, _ in serving), sum(min(r, d) for d, r in serving)


def pods_stopped(status: dict[str, Any]) -> dict[str, Any]:
    """The status of a model all of whose pods were stopped together, and are started again as its
    Deployments' pods (local mode's `down`, then `up`): no pod ready, and none reached, so the first pass
    after it reports a deploy (Deploying, then RolledOut), not a loss (ReplicasUnavailable)."""
    replicas = {
        role: {**counts, "ready": 0, "reached": 0} for role, counts in (status.get("replicas") or {}).items()
    }
    desired, _ = serving_pods({role: (c.get("desired", 0), 0) for role, c in replicas.items()})
    return {**status, "replicas": replicas, "readyReplicas": f"0/{desired}"} if replicas else status


def reached(old: dict[str, Any], roles: dict[str, tuple[int, int]], live: bool) -> dict[str, int]:
    """Per role, the most pods ready at once since the role's set went live, at most desired (kept in
    status.replicas[role].reached): a live set with fewer ready pods than it reached is Degraded, however
    many passes ago it lost them; a scale-up or a first deploy is not."""
    if not live:
        return {role: 0 for role in roles}
    before = old.get("replicas") or {}
    return {
        role: min(d, max(r, (before.get(role) or {}).get("reached", 0))) for role, (d, r) in roles.items()
    }


def compute_status(
    *,
    old: dict[str, Any],
    generation: int,
    errors: list[str],
    compile_hash: str | None,
    serving_hash: str | None,
    job: tuple[str, str],
    roles: dict[str, tuple[int, int]],  # role -> (desired, ready) of the wanted serving set
    rolled_out: bool = True,  # every Deployment of the wanted set runs its latest template, all ready
    live: bool = True,  # the public Service selects the wanted set
    serving_now: bool = False,  # some set answers (its pods are ready): a change rolls, not deploys
    report: dict[str, Any] | None = None,  # the compile pod's manifest, when it left one
    serving_spec: dict[str, Any] | None = None,  # the compiled sections of serving_hash's spec
    drain_until: str | None = None,  # retired entry pods drain until then; their set goes after
    retry_at: str | None = None,  # a compile whose model source was unreadable is tried again then
    source_check: tuple[str | None, str | None] = (
        None,
        None,
    ),  # a failed compile's source: (fingerprint, next check)
    failing: list[str] | None = None,  # serving pods that will not become ready (`pod_problems`)
    compile_step: bool = True,  # False: the engine compiles as each server starts (no Job, no artifacts)
    compiling: dict[str, Any] | None = None,  # a running compile's progress (`compile_progress`)
    notice: tuple[str, str] | None = None,  # (reason, message) a user of this engine should know
    # (`engines.notice`: LegacyEngine, Experimental): said once
    replicas_notice: str | None = None,  # which replica count decides (`scaling.replicas_notice`): said once
    endpoint: str | None,
    at: str,
) -> dict[str, Any]:
    """The NeuronModel status from what was observed (pure)."""
    conds = old.get("conditions") or []
    state, job_message = job
    if errors:
        message = "; ".join(errors)
        kept = [c for c in conds if c.get("type") not in ("Validated", "Progressing")]
        return {
            "phase": "Failed",
            "observedGeneration": generation,
            "compileHash": old.get("compileHash"),
            "conditions": [
                condition(conds, "Validated", False, "Invalid", message, generation, at),
                *kept,
                condition(conds, "Progressing", False, "Invalid", "the spec is refused", generation, at),
            ],
        }
    compiled = serving_hash is not None and serving_hash == compile_hash
    failed = state == "failed" and not compiled
    if not compile_step:
        compiled_cond = ("NoCompileStep", "the engine compiles as each server starts; nothing is compiled "
                         "ahead and no artifacts are kept")  # fmt: skip
    elif compiled and report and report.get("cacheHit"):
        compiled_cond = ("CacheHit", f"artifacts/{compile_hash}/ existed already: nothing was compiled")
    elif compiled:
        compiled_cond = ("Compiled", f"artifacts/{compile_hash}/ is complete")
    elif failed:
        compiled_cond = ("CompileFailed", f"compile of {compile_hash} failed: {job_message}")
    else:
        compiled_cond = ("Compiling", f"compiling {compile_hash}: {job_message or 'the Job is starting'}"
                         + (f"; {compiling['text']}" if compiling else ""))  # fmt: skip
    desired, ready = serving_pods(roles)  # (the READY column and its messages: routers serve no model)
    routers_waiting = [f"{role} {min(r, d)}/{d} ready" for role, (d, r) in roles.items()
                       if role == ROUTER and r < d]  # fmt: skip
    high = reached(old, roles, live and serving_hash is not None)
    lost = {role: (r, high[role]) for role, (_, r) in roles.items() if r < high[role]}
    all_ready = serving_hash is not None and sum(d for d, _ in roles.values()) > 0 and rolled_out and live
    failing = (failing or []) if serving_hash is not None and not all_ready else []
    if failed:
        health = ("CompileFailed", compiled_cond[1])
    elif lost:  # (and if their replacements will not start, why: a Warning of its own)
        health = ("PodsFailing" if failing else "ReplicasUnavailable", "; ".join(["pods lost: " + ", ".join(
            f"{role} {r}/{h} ready" for role, (r, h) in sorted(lost.items())
        ), *failing]))  # fmt: skip
    elif failing:
        health = ("PodsFailing", "; ".join(failing))
    else:
        health = ("Healthy", f"{ready}/{desired} pods ready")
    degraded = health[0] != "Healthy"
    if serving_hash is None:
        phase = "Failed" if failed else "Compiling"
    elif degraded and not (health[0] == "PodsFailing" and serving_now):
        phase = "Degraded"  # (new pods failing while the old ones serve: still Rolling, with the Warning)
    elif all_ready and compiled:
        phase = "Ready"
    else:
        phase = "Rolling" if serving_now else "Deploying"
    serves = f"artifacts/{serving_hash}/" if compile_step else f"revision {serving_hash}"
    if failed and retry_at:
        progress = ("CompileFailed", f"the model source could not be read; compiling again at {retry_at}")
    elif failed:
        progress = ("CompileFailed", "not compiling: it starts again when the spec or the model source "
                    "changes (checked every 10 minutes), or on neuronfleet.dev/retry")  # fmt: skip
    elif not compiled:
        progress = ("Compiling", f"compiling {compile_hash}; then the serving pods roll to it")
    elif not all_ready:
        progress = ("Recovering" if degraded else phase, f"{ready}/{desired} pods of {serves} ready")
    else:
        progress = ("Stable", f"serving {serves}")
    ready_reason = "AllReplicasReady" if all_ready else ("NotCompiled" if serving_hash is None else "Waiting")
    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": generation,
        "compileHash": serving_hash,
        "conditions": [
            condition(
                conds,
                "Validated",
                True,
                *_validated(notice, replicas_notice),
                generation,
                at,
            ),
            condition(conds, "Compiled", compiled and compile_step, *compiled_cond, generation, at),
            condition(
                conds,
                "Ready",
                all_ready,
                ready_reason,
                "; ".join([f"{ready}/{desired} pods ready", *routers_waiting]),
                generation,
                at,
            ),
            condition(
                conds, "Progressing", progress[0] != "Stable" and not failed, *progress, generation, at
            ),
            condition(conds, "Degraded", degraded, *health, generation, at),
        ],
        "replicas": {
            role: {"desired": d, "ready": min(r, d), "reached": high[role]} for role, (d, r) in roles.items()
        },
        "readyReplicas": f"{ready}/{desired}",
    }
    if serving_hash is not None and not compile_step:
        status["artifacts"] = None  # (null clears what an engine that compiled left)
    elif serving_hash is not None:
        status["artifacts"] = {"path": f"artifacts/{serving_hash}/"}
        if compiled and report:
            status["artifacts"].update(
                {k: report[k] for k in ("bytes", "compiledAt", "cacheHit") if report.get(k) is not None}
            )
        elif (old.get("artifacts") or {}).get("path") == status["artifacts"]["path"]:
            status["artifacts"] = old["artifacts"]
    if serving_hash is not None:
        status["endpoint"] = endpoint
        if serving_spec is not None:
            status["servingSpec"] = serving_spec
        status["drainUntil"] = drain_until  # None (null) clears it
    status["compileRetryAt"] = retry_at if failed else None
    status["compileProgress"] = compiling if compiled_cond[0] == "Compiling" else None  # (null clears it)
    status["sourceFingerprint"], status["sourceCheckAt"] = source_check if failed else (None, None)
    return status


def autoscaling_condition(
    old: list[dict], generation: int, at: str, autoscaler: dict[str, Any] | None = None,
    builtin: Literal["Builtin", "DryRun"] | None = None,
) -> dict:  # fmt: skip
    """For a spec that enables autoscaling: AutoscalingActive=True with the kind of the object the cluster
    scales with (`autoscaler`: an HPA or a KEDA ScaledObject) as its reason; for provider builtin (no such
    object), reason Builtin (the operator scales) or DryRun (it records its decisions and acts on none)."""
    if autoscaler is None:
        message = (
            "the operator reads the serving pods' /metrics every 15 s and sets the replicas; "
            "status.autoscaling says what it decided and why"
            if builtin != "DryRun"
            else "dry run: the operator reads the serving pods' /metrics and records its decisions in "
            "status.autoscaling.lastDecision; the replicas stay as the spec says"
        )
        return condition(old, "AutoscalingActive", True, builtin or "Builtin", message, generation, at)
    kind, name = autoscaler["kind"], autoscaler["metadata"]["name"]
    message = (
        f"{kind} {name} ({autoscaler['apiVersion']}) scales spec.replicas through the scale subresource; its "
        "own status says what it decides"
    )
    return condition(old, "AutoscalingActive", True, kind, message, generation, at)


NOTICES = ("LegacyEngine", "Experimental")  # the Validated reasons of `engines.notice`


def _validated(notice: tuple[str, str] | None, replicas_notice: str | None) -> tuple[str, str]:
    """The Validated condition's reason and message for a valid spec: what its engine's user should know
    (LegacyEngine, Experimental) and which replica count decides (ReplicasFromScale), each said where it
    applies."""
    if notice:
        reason, message = notice
        return reason, f"{message}; {replicas_notice}" if replicas_notice else message
    if replicas_notice:
        return "ReplicasFromScale", f"{VALID}; {replicas_notice}"
    return "Valid", VALID


def transitions(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(event type, reason, message) for what changed: Normal for progress (compile started, compiled or a
    cache hit, a roll started, rolled out, recovered), Warning only for problems (refused, compile failed,
    pods lost). Every event has a message."""
    before = {c["type"]: c for c in old.get("conditions") or []}
    out: list[tuple[str, str, str]] = []
    for c in new.get("conditions") or []:
        prev = before.get(c["type"]) or {}
        changed = (prev.get("status"), prev.get("reason")) != (c["status"], c["reason"])
        kind, status, reason, message = c["type"], c["status"], c["reason"], c.get("message") or c["reason"]
        if kind == "Validated" and status == "False" and (changed or prev.get("message") != message):
            out.append(("Warning", "Refused", message))
        elif kind == "Validated" and reason in NOTICES and changed:
            out.append(("Normal", reason, message))
        elif kind == "Validated" and reason == "ReplicasFromScale" and prev.get("message") != message:
            out.append(("Normal", "ReplicasFromScale", message))
        elif kind == "Compiled" and reason == "Compiling" and (changed or prev.get("message") != message):
            if prev.get("message", "").split(":")[0] != message.split(":")[0]:  # a new hash, not progress
                out.append(("Normal", "CompileStarted", message))
        elif kind == "Compiled" and changed and reason == "CompileFailed":
            out.append(("Warning", "CompileFailed", message))
        elif kind == "Compiled" and changed and status == "True":
            out.append(("Normal", reason, message))
        elif kind == "Progressing" and changed and reason == "Rolling":
            out.append(("Normal", "Rolling", message))
        elif kind == "Ready" and changed and status == "True":
            serves = (new.get("artifacts") or {}).get("path") or f"revision {new.get('compileHash')}"
            out.append(("Normal", "RolledOut", f"{message}; serving {serves}"))
        elif kind == "Degraded" and changed and status == "True" and reason != "CompileFailed":
            out.append(("Warning", reason, message))
        elif kind == "Degraded" and changed and status == "False" and prev.get("status") == "True":
            out.append(("Normal", "Recovered", message))
        elif kind == "Conflict" and prev.get("message") != message:
            out.append(("Warning", "Conflict", message))
        elif (
            kind == node_offers.CONDITION
            and changed
            and (status == "False" or reason == node_offers.SCHEDULER_EXTENSION_ADVISED)
        ):  # what the nodes lack, said before a pod waits
            out.append(("Warning", reason, message))
        elif kind == node_offers.CONDITION and changed and prev:
            out.append(("Normal", reason, message))
    if "Conflict" in before and not any(c["type"] == "Conflict" for c in new.get("conditions") or []):
        out.append(("Normal", "ConflictResolved", "no object of this model is controlled by another owner"))
    return out


def with_conflicts(
    status: dict[str, Any], old: dict[str, Any], conflicts: list[str], generation: int, at: str
) -> dict[str, Any]:
    """The status with a `Conflict=True` condition naming each object another owner controls (the operator
    leaves those alone), or without any Conflict condition when there is none; `old` is the previous status
    (the condition keeps its lastTransitionTime)."""
    conds = [c for c in status.get("conditions") or [] if c.get("type") != "Conflict"]
    if conflicts:
        message = "; ".join(sorted(set(conflicts)))
        previous = old.get("conditions") or []
        conds.append(condition(previous, "Conflict", True, "OwnedElsewhere", message, generation, at))
    return {**status, "conditions": conds}
