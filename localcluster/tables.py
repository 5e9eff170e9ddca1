"""Server-side tables: what `kubectl get` prints, as the API server computes it (`Accept: ...;as=Table`).

The columns and cells follow Kubernetes' printers for v1.32 (pkg/printers/internalversion/printers.go:
podColumnDefinitions, deploymentColumnDefinitions, serviceColumnDefinitions, eventColumnDefinitions, ...;
printPod, printService, printEvent, printJob ...), and a CRD's additionalPrinterColumns
(apiextensions-apiserver pkg/registry/customresource/tableconvertor; an Age column when a version declares
none). The server always prints the wide cells (priority 1 columns included); kubectl shows them under
`-o wide` only.

Pure functions of the objects and the current time.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from .semantics import Resource, dig, json_path

Row = Callable[[dict[str, Any]], list[Any]]


def _parse(timestamp: str | None) -> datetime.datetime | None:
    if not timestamp:
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S.%fZ"):
        try:
            return datetime.datetime.strptime(timestamp, fmt).replace(tzinfo=datetime.UTC)
        except ValueError:
            continue
    try:
        return datetime.datetime.fromisoformat(timestamp)
    except ValueError:
        return None


def human_duration(seconds: float) -> str:
    """apimachinery's duration.HumanDuration: 45s, 119s, 2m5s, 15m, 3h20m, 20h, 3d4h, 30d, 2y45d."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def since(timestamp: str | None) -> str:
    """translateTimestampSince: the age of a timestamp, "<unknown>" when there is none."""
    then = _parse(timestamp)
    if then is None:
        return "<unknown>"
    return human_duration((datetime.datetime.now(tz=datetime.UTC) - then).total_seconds())


def _age(o: dict[str, Any]) -> str:
    return since(o["metadata"].get("creationTimestamp"))


def _col(name: str, type_: str = "string", priority: int = 0, fmt: str = "") -> dict[str, Any]:
    return {"name": name, "type": type_, "format": fmt, "description": "", "priority": priority}


NAME = _col("Name", fmt="name")
AGE = _col("Age")


def _containers(template_spec: dict[str, Any]) -> tuple[str, str]:
    containers = template_spec.get("containers") or []
    return ",".join(c.get("name", "") for c in containers), ",".join(c.get("image", "") for c in containers)


def _selector(selector: dict[str, Any] | None) -> str:
    """metav1.FormatLabelSelector: k=v,k2 in (a,b); "<none>" when empty."""
    if not selector:
        return "<none>"
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for e in selector.get("matchExpressions") or []:
        op = e.get("operator", "")
        values = ",".join(e.get("values") or [])
        if op in ("In", "NotIn"):
            terms.append(f"{e['key']} {op.lower()} ({values})")
        else:
            terms.append(e["key"] if op == "Exists" else f"!{e['key']}")
    return ",".join(terms) or "<none>"


def _map_selector(selector: dict[str, str] | None) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted((selector or {}).items())) or "<none>"


# ---- pods ------------------------------------------------------------------------------------------------


def _pod(o: dict[str, Any]) -> list[Any]:
    status = o.get("status") or {}
    reason = status.get("reason") or status.get("phase") or ""
    statuses = status.get("containerStatuses") or []
    total = len(dig(o, ["spec", "containers"]) or [])
    ready, restarts, last_restart = 0, 0, None
    has_running = False
    for c in reversed(statuses):
        restarts += c.get("restartCount", 0)
        finished = _parse(dig(c, ["lastState", "terminated", "finishedAt"]) or None)
        if finished and (last_restart is None or finished > last_restart):
            last_restart = finished
        state = c.get("state") or {}
        waiting, terminated = state.get("waiting"), state.get("terminated")
        if waiting and waiting.get("reason"):
            reason = waiting["reason"]
        elif terminated and terminated.get("reason"):
            reason = terminated["reason"]
        elif terminated:
            signal = terminated.get("signal")
            reason = f"Signal:{signal}" if signal else f"ExitCode:{terminated.get('exitCode', 0)}"
        elif c.get("ready") and state.get("running") is not None:
            has_running = True
            ready += 1
    if reason == "Completed" and has_running:
        conditions = status.get("conditions") or []
        pod_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        reason = "Running" if pod_ready else "NotReady"
    if o["metadata"].get("deletionTimestamp") and status.get("phase") not in ("Succeeded", "Failed"):
        reason = "Terminating"
    restarts_text = str(restarts)
    if restarts and last_restart is not None:
        ago = human_duration((datetime.datetime.now(tz=datetime.UTC) - last_restart).total_seconds())
        restarts_text = f"{restarts} ({ago} ago)"
    gates = dig(o, ["spec", "readinessGates"]) or []
    return [
        o["metadata"]["name"],
        f"{ready}/{total}",
        reason,
        restarts_text,
        _age(o),
        status.get("podIP") or "<none>",
        dig(o, ["spec", "nodeName"]) or "<none>",
        status.get("nominatedNodeName") or "<none>",
        f"0/{len(gates)}" if gates else "<none>",
    ]


# ---- workloads -------------------------------------------------------------------------------------------


def _deployment(o: dict[str, Any]) -> list[Any]:
    spec, status = o.get("spec") or {}, o.get("status") or {}
    containers, images = _containers(dig(spec, ["template", "spec"]) or {})
    return [
        o["metadata"]["name"],
        f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 1)}",
        status.get("updatedReplicas", 0),
        status.get("availableReplicas", 0),
        _age(o),
        containers,
        images,
        _selector(spec.get("selector")),
    ]


def _replicaset(o: dict[str, Any]) -> list[Any]:
    spec, status = o.get("spec") or {}, o.get("status") or {}
    containers, images = _containers(dig(spec, ["template", "spec"]) or {})
    return [
        o["metadata"]["name"],
        spec.get("replicas", 1),
        status.get("replicas", 0),
        status.get("readyReplicas", 0),
        _age(o),
        containers,
        images,
        _selector(spec.get("selector")),
    ]


def _job(o: dict[str, Any]) -> list[Any]:
    spec, status = o.get("spec") or {}, o.get("status") or {}
    true = {c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"}
    if "Complete" in true:
        state = "Complete"
    elif "Failed" in true:
        state = "Failed"
    elif o["metadata"].get("deletionTimestamp"):
        state = "Terminating"
    elif "Suspended" in true:
        state = "Suspended"
    elif "FailureTarget" in true:
        state = "FailureTarget"
    elif "SuccessCriteriaMet" in true:
        state = "SuccessCriteriaMet"
    else:
        state = "Running"
    succeeded = status.get("succeeded", 0)
    if spec.get("completions") is not None:
        completions = f"{succeeded}/{spec['completions']}"
    else:
        parallelism = spec.get("parallelism", 0)
        completions = f"{succeeded}/1 of {parallelism}" if parallelism > 1 else f"{succeeded}/1"
    start, end = _parse(status.get("startTime")), _parse(status.get("completionTime"))
    duration = ""
    if start is not None:
        end = end or datetime.datetime.now(tz=datetime.UTC)
        duration = human_duration((end - start).total_seconds())
    containers, images = _containers(dig(spec, ["template", "spec"]) or {})
    return [
        o["metadata"]["name"],
        state,
        completions,
        duration,
        _age(o),
        containers,
        images,
        _selector(spec.get("selector")),
    ]


# ---- services and networking -----------------------------------------------------------------------------


def _service_external_ip(spec: dict[str, Any], status: dict[str, Any]) -> str:
    kind = spec.get("type") or "ClusterIP"
    external = list(spec.get("externalIPs") or [])
    if kind in ("ClusterIP", "NodePort"):
        return ",".join(external) or "<none>"
    if kind == "LoadBalancer":
        ingress = [i.get("ip") or i.get("hostname") for i in dig(status, ["loadBalancer", "ingress"]) or []]
        found = [i for i in ingress if i] + external
        return ",".join(found) if found else "<pending>"
    if kind == "ExternalName":
        return spec.get("externalName", "")
    return "<unknown>"


def _service_ports(ports: list[dict[str, Any]]) -> str:
    if not ports:
        return "<none>"
    out = []
    for p in ports:
        protocol = p.get("protocol", "TCP")
        if p.get("nodePort"):
            out.append(f"{p['port']}:{p['nodePort']}/{protocol}")
        else:
            out.append(f"{p['port']}/{protocol}")
    return ",".join(out)


def _service(o: dict[str, Any]) -> list[Any]:
    spec, status = o.get("spec") or {}, o.get("status") or {}
    cluster_ip = spec.get("clusterIP") or "<none>"
    return [
        o["metadata"]["name"],
        spec.get("type") or "ClusterIP",
        cluster_ip,
        _service_external_ip(spec, status),
        _service_ports(spec.get("ports") or []),
        _age(o),
        _map_selector(spec.get("selector")),
    ]


def _endpoints(o: dict[str, Any]) -> list[Any]:
    addresses = []
    for subset in o.get("subsets") or []:
        ports = [p.get("port") for p in subset.get("ports") or []] or [None]
        for a in subset.get("addresses") or []:
            addresses += [f"{a.get('ip')}:{p}" if p else a.get("ip") for p in ports]
    shown = ",".join(addresses[:3]) + (f" + {len(addresses) - 3} more..." if len(addresses) > 3 else "")
    return [o["metadata"]["name"], shown or "<none>", _age(o)]


def _endpointslice(o: dict[str, Any]) -> list[Any]:
    ports = ",".join(str(p.get("port")) for p in o.get("ports") or []) or "<unset>"
    addresses = [a for e in o.get("endpoints") or [] for a in e.get("addresses") or []]
    shown = ",".join(addresses[:3]) + (f" + {len(addresses) - 3} more..." if len(addresses) > 3 else "")
    return [o["metadata"]["name"], o.get("addressType", ""), ports, shown or "<unset>", _age(o)]


# ---- configuration, events, namespaces -------------------------------------------------------------------


def _configmap(o: dict[str, Any]) -> list[Any]:
    return [o["metadata"]["name"], len(o.get("data") or {}) + len(o.get("binaryData") or {}), _age(o)]


def _secret(o: dict[str, Any]) -> list[Any]:
    return [o["metadata"]["name"], o.get("type") or "Opaque", len(o.get("data") or {}), _age(o)]


def _event(o: dict[str, Any]) -> list[Any]:
    """printEvent: LAST SEEN falls back to the first timestamp, then the event time; a count of 1 for
    singletons."""
    o = {  # events.k8s.io/v1 names (deprecated*, regarding, note) read as core/v1's, as the printer sees both
        "firstTimestamp": o.get("deprecatedFirstTimestamp"),
        "lastTimestamp": o.get("deprecatedLastTimestamp"),
        "count": o.get("deprecatedCount"), "source": o.get("deprecatedSource"), **o,
    }  # fmt: skip
    first = since(o.get("firstTimestamp")) if o.get("firstTimestamp") else since(o.get("eventTime"))
    last = since(o["lastTimestamp"]) if o.get("lastTimestamp") else first
    count = o.get("count") or 1
    if o.get("series"):
        last, count = since(o["series"].get("lastObservedTime")), o["series"].get("count", count)
    involved = o.get("involvedObject") or o.get("regarding") or {}
    kind = (involved.get("kind") or "").lower()
    target = f"{kind}/{involved['name']}" if involved.get("name") else kind
    source = o.get("source") or {}
    component = source.get("component") or o.get("reportingController") or ""
    host = source.get("host") or o.get("reportingInstance") or ""
    source_text = f"{component}, {host}" if component and host else component
    return [
        last,
        o.get("type", ""),
        o.get("reason", ""),
        target,
        involved.get("fieldPath", ""),
        source_text,
        (o.get("message") or o.get("note") or "").strip(),
        first,
        count,
        o["metadata"]["name"],
    ]


def _namespace(o: dict[str, Any]) -> list[Any]:
    return [o["metadata"]["name"], dig(o, ["status", "phase"]) or "Active", _age(o)]


def _pdb(o: dict[str, Any]) -> list[Any]:
    spec = o.get("spec") or {}
    return [
        o["metadata"]["name"],
        str(spec["minAvailable"]) if "minAvailable" in spec else "N/A",
        str(spec["maxUnavailable"]) if "maxUnavailable" in spec else "N/A",
        dig(o, ["status", "disruptionsAllowed"]) or 0,
        _age(o),
    ]


def _crd(o: dict[str, Any]) -> list[Any]:
    return [o["metadata"]["name"], o["metadata"].get("creationTimestamp", "")]


BUILTIN_TABLES: dict[tuple[str, str], tuple[list[dict[str, Any]], Row]] = {
    ("", "pods"): (
        [NAME, _col("Ready"), _col("Status"), _col("Restarts"), AGE, _col("IP", priority=1),
         _col("Node", priority=1), _col("Nominated Node", priority=1), _col("Readiness Gates", priority=1)],
        _pod,
    ),
    ("apps", "deployments"): (
        [NAME, _col("Ready"), _col("Up-to-date", "string"), _col("Available", "string"), AGE,
         _col("Containers", priority=1), _col("Images", priority=1), _col("Selector", priority=1)],
        _deployment,
    ),
    ("apps", "replicasets"): (
        [NAME, _col("Desired", "integer"), _col("Current", "integer"), _col("Ready", "integer"), AGE,
         _col("Containers", priority=1), _col("Images", priority=1), _col("Selector", priority=1)],
        _replicaset,
    ),
    ("batch", "jobs"): (
        [NAME, _col("Status"), _col("Completions"), _col("Duration"), AGE,
         _col("Containers", priority=1), _col("Images", priority=1), _col("Selector", priority=1)],
        _job,
    ),
    ("", "services"): (
        [NAME, _col("Type"), _col("Cluster-IP"), _col("External-IP"), _col("Port(s)"), AGE,
         _col("Selector", priority=1)],
        _service,
    ),
    ("", "endpoints"): ([NAME, _col("Endpoints"), AGE], _endpoints),
    ("discovery.k8s.io", "endpointslices"): (
        [NAME, _col("AddressType"), _col("Ports"), _col("Endpoints"), AGE],
        _endpointslice,
    ),
    ("", "configmaps"): ([NAME, _col("Data", "string"), AGE], _configmap),
    ("", "secrets"): ([NAME, _col("Type"), _col("Data", "string"), AGE], _secret),
    ("", "events"): (
        [_col("Last Seen"), _col("Type"), _col("Reason"), _col("Object"), _col("Subobject", priority=1),
         _col("Source", priority=1), _col("Message"), _col("First Seen", priority=1),
         _col("Count", priority=1), _col("Name", priority=1, fmt="name")],
        _event,
    ),
    ("events.k8s.io", "events"): (
        [_col("Last Seen"), _col("Type"), _col("Reason"), _col("Object"), _col("Subobject", priority=1),
         _col("Source", priority=1), _col("Message"), _col("First Seen", priority=1),
         _col("Count", priority=1), _col("Name", priority=1, fmt="name")],
        _event,
    ),
    ("", "namespaces"): ([NAME, _col("Status"), AGE], _namespace),
    ("policy", "poddisruptionbudgets"): (
        [NAME, _col("Min Available"), _col("Max Unavailable"), _col("Allowed Disruptions", "integer"), AGE],
        _pdb,
    ),
    ("apiextensions.k8s.io", "customresourcedefinitions"): ([NAME, _col("Created At", "date")], _crd),
}  # fmt: skip


def columns_and_row(kind: Resource) -> tuple[list[dict[str, Any]], Row]:
    """The kind's column definitions and the function that turns one object into its cells."""
    if kind.schema is not None or kind.printer_columns:
        declared = kind.printer_columns or [
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
        ]
        columns = [NAME] + [
            _col(c["name"], c.get("type", "string"), c.get("priority", 0))
            | {"description": c.get("description", "")}
            for c in declared
        ]

        def row(o: dict[str, Any]) -> list[Any]:
            cells: list[Any] = [o["metadata"]["name"]]
            for c in declared:
                value = json_path(o, c["jsonPath"])
                if c.get("type") == "date" and value is not None:
                    value = since(value)
                cells.append(value)
            return cells

        return columns, row
    return BUILTIN_TABLES.get(
        (kind.group, kind.plural), ([NAME, AGE], lambda o: [o["metadata"]["name"], _age(o)])
    )


def table(
    kind: Resource,
    items: list[dict[str, Any]],
    resource_version: int | str,
    headers: bool = True,
    include: str = "Metadata",
) -> dict[str, Any]:
    """A meta.k8s.io/v1 Table of the objects; without `headers`, no columnDefinitions (as in the watch events
    after the first, which the API server sends with NoHeaders). Each row carries its object as the request's
    `includeObject` asks: `Metadata` (the default: a PartialObjectMetadata), `Object` (the whole object:
    kubectl asks for it to sort by a field, `--sort-by`) or `None`."""
    columns, row = columns_and_row(kind)
    rows = []
    for obj in items:
        entry: dict[str, Any] = {"cells": row(obj)}
        if include == "Object":
            entry["object"] = {"apiVersion": kind.api_version, "kind": kind.kind, **obj}
        elif include != "None":
            entry["object"] = {
                "apiVersion": "meta.k8s.io/v1",
                "kind": "PartialObjectMetadata",
                "metadata": obj["metadata"],
            }
        rows.append(entry)
    out: dict[str, Any] = {
        "apiVersion": "meta.k8s.io/v1",
        "kind": "Table",
        "metadata": {"resourceVersion": str(resource_version)},
        "columnDefinitions": columns if headers else None,
        "rows": rows,
    }
    return out
