"""What the API server checks and fills in on objects before it stores them, beyond a custom resource's
schema (`semantics.admit`): names by the kind's DNS rule, labels, and the defaults of built-in kinds (a Job's
selector and pod labels, a Namespace's phase, a Secret's type, a Service's type and ports, a Deployment's
replicas). Messages are worded as the real server words them (apimachinery pkg/util/validation).

Pure functions of their arguments.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .semantics import ApiError, Resource, dig

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# The messages of apimachinery's validation (pkg/util/validation/validation.go): IsDNS1123Label,
# IsDNS1123Subdomain, IsDNS1035Label; namespaces are labels, services DNS-1035 labels (ValidateServiceName),
# everything else (custom resources included) subdomains.
_LABEL_MESSAGE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start "
    "and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
_SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_DNS1035_MESSAGE = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
    "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
    "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)


def name_problems(kind: Resource, name: str) -> list[str]:
    """What the API server finds wrong with an object's name (empty: it is fine)."""
    if kind.plural == "namespaces":
        rule, message, limit = DNS1123_LABEL, _LABEL_MESSAGE, 63
    elif kind.plural == "services" and not kind.group:
        rule, message, limit = DNS1035_LABEL, _DNS1035_MESSAGE, 63
    else:
        rule, message, limit = DNS1123_SUBDOMAIN, _SUBDOMAIN_MESSAGE, 253
    problems = []
    if len(name) > limit:
        problems.append(f"must be no more than {limit} characters")
    if not rule.match(name):
        problems.append(message)
    return problems


def check_name(kind: Resource, name: str) -> None:
    """422 Invalid for a name a real API server refuses, worded as it words it."""
    problems = name_problems(kind, name)
    if not problems:
        return
    what = f"{kind.kind}.{kind.group}" if kind.group else kind.kind
    causes = [
        {"reason": "FieldValueInvalid", "message": f"Invalid value: {json.dumps(name)}: {p}",
         "field": "metadata.name"}
        for p in problems
    ]  # fmt: skip
    detail = "; ".join(problems)
    raise ApiError(
        422, "Invalid",
        f'{what} "{name}" is invalid: metadata.name: Invalid value: {json.dumps(name)}: {detail}',
        name=name, group=kind.group, kind=kind.kind, causes=causes,
    )  # fmt: skip


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_VALUE_MESSAGE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used "
    "for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


def label_problems(labels: dict[str, Any] | None, where: str) -> list[tuple[str, str]]:
    """apimachinery's ValidateLabels: keys are qualified names (an optional DNS subdomain prefix and a name
    of at most 63 characters), values at most 63 characters of the label alphabet."""
    problems = []
    for key, value in (labels or {}).items():
        prefix, _, name = key.rpartition("/")
        if (
            (prefix and name_problems(Resource("", "", "", "", True), prefix))
            or len(name) > 63
            or not (_QUALIFIED_NAME.match(name))
        ):
            problems.append((where, f"Invalid value: {json.dumps(key)}: not a valid label key"))
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) > 63:
            problems.append((where, f"Invalid value: {json.dumps(text)}: must be no more than 63 characters"))
        if not _LABEL_VALUE.match(text):
            problems.append((where, f"Invalid value: {json.dumps(text)}: {_LABEL_VALUE_MESSAGE}"))
    return problems


def check_labels(kind: Resource, obj: dict[str, Any]) -> None:
    """422 Invalid for labels a real API server refuses: the object's own, and its pod template's (a Job
    named past 63 characters is refused this way: its pods' job-name label cannot hold the name)."""
    problems = label_problems(obj["metadata"].get("labels"), "metadata.labels")
    template = dig(obj, ["spec", "template", "metadata", "labels"])
    if kind.schema is None and isinstance(template, dict):
        problems += label_problems(template, "spec.template.labels")
    if not problems:
        return
    what = f"{kind.kind}.{kind.group}" if kind.group else kind.kind
    texts = [f"{field}: {message}" for field, message in problems]
    detail = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    name = obj["metadata"].get("name")
    causes = [{"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in problems]
    raise ApiError(
        422, "Invalid", f'{what} "{name}" is invalid: {detail}',
        name=name, group=kind.group, kind=kind.kind, causes=causes,
    )  # fmt: skip


def default_on_create(kind: Resource, obj: dict[str, Any]) -> dict[str, Any]:
    """The defaults the API server gives built-in objects on create (the object already has its uid):
    a Job's selector and pod-template labels (batch/v1 Job strategy, unless spec.manualSelector), a
    Namespace's Active phase, a Secret's Opaque type, a Service's type, port
    protocols and target ports."""
    meta = obj["metadata"]
    if (kind.group, kind.plural) == ("batch", "jobs"):
        spec = obj.setdefault("spec", {})
        if not spec.get("manualSelector"):
            uid, name = meta["uid"], meta["name"]
            spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
            template_meta = spec.setdefault("template", {}).setdefault("metadata", {})
            template_meta["labels"] = {
                **(template_meta.get("labels") or {}),
                "batch.kubernetes.io/controller-uid": uid,
                "batch.kubernetes.io/job-name": name,
                "controller-uid": uid,
                "job-name": name,
            }
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completions", 1)
        spec.setdefault("parallelism", 1)
        spec.setdefault("completionMode", "NonIndexed")
        spec.setdefault("suspend", False)
    elif (kind.group, kind.plural) == ("", "namespaces"):
        obj["status"] = {"phase": "Active"}
    elif (kind.group, kind.plural) == ("", "secrets"):
        obj.setdefault("type", "Opaque")
    elif (kind.group, kind.plural) == ("", "services"):
        spec = obj.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
    elif (kind.group, kind.plural) == ("apps", "deployments"):
        obj.setdefault("spec", {}).setdefault("replicas", 1)
    return obj
