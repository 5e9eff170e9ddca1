"""Events as the kubelet and the built-in controllers record them: core/v1 Events about an object (type,
reason, message, source), a repeat (same object, type, reason and message) counted on the first one
(`count`, `lastTimestamp`) as client-go's EventCorrelator aggregates them (k8s.io/client-go/tools/record).
Writing never blocks the caller and a failed write is dropped, as a real recorder's is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from .semantics import now
from .store import ClusterClient

log = logging.getLogger(__name__)

NODE = "local"  # the node's name (every pod's spec.nodeName)


def reference(obj: dict[str, Any], field_path: str = "") -> dict[str, Any]:
    """An ObjectReference to `obj` (for a container: field_path "spec.containers{NAME}")."""
    meta = obj["metadata"]
    ref = {"kind": obj.get("kind", ""), "namespace": meta.get("namespace", ""), "name": meta["name"],
           "uid": meta["uid"], "apiVersion": obj.get("apiVersion", "")}  # fmt: skip
    if field_path:
        ref["fieldPath"] = field_path
    return ref


class Recorder:
    """Records events from one component (e.g. "kubelet", "job-controller")."""

    def __init__(self, cluster: ClusterClient, component: str) -> None:
        self.cluster, self.component = cluster, component
        self._seen: dict[tuple, tuple[str, int]] = {}  # (uid, type, reason, message) -> (event name, count)
        self._writes: set[asyncio.Task] = set()

    def record(self, involved: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Record an event about the referenced object (see `reference`), soon."""
        task = asyncio.get_running_loop().create_task(self._write(involved, type_, reason, message))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _write(self, involved: dict[str, Any], type_: str, reason: str, message: str) -> None:
        key = (involved["uid"], involved.get("fieldPath", ""), type_, reason, message)
        stamp, ns = now(), involved.get("namespace") or "default"
        with contextlib.suppress(Exception):  # the object's namespace went away meanwhile: dropped
            if key in self._seen:
                name, count = self._seen[key]
                self._seen[key] = (name, count + 1)
                await self.cluster.patch(
                    "", "v1", "events", ns, name, {"count": count + 1, "lastTimestamp": stamp}
                )
                return
            name = f"{involved['name']}.{time.time_ns():x}"
            event = {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": name, "namespace": ns},
                "involvedObject": involved,
                "type": type_,
                "reason": reason,
                "message": message,
                "source": {"component": self.component, "host": NODE},
                "reportingComponent": self.component,
                "reportingInstance": NODE,
                "firstTimestamp": stamp,
                "lastTimestamp": stamp,
                "count": 1,
            }
            self._seen[key] = (name, 1)
            await self.cluster.create("", "v1", "events", ns, event)

    async def settle(self) -> None:
        """Wait for the writes under way."""
        await asyncio.gather(*self._writes, return_exceptions=True)

    def forget(self, uid: str) -> None:
        """Drop what is known of an object's events (it was deleted)."""
        for key in [k for k in self._seen if k[0] == uid]:
            del self._seen[key]
