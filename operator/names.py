"""The names of a NeuronModel's children, and the limits Kubernetes puts on them (pure).

Every child is named after its model: `NAME` (public Service), `NAME-runtime` (ConfigMap),
`NAME-compile-cache` (claim), `NAME-compile-<hash10>` (compile Job), `NAME-source-<hash10>` (the Job that
fingerprints a failed compile's source, shorter than the compile Job's), `NAME-unified` (Deployment),
`NAME-<role>-<revision8>` (a disaggregated set's Deployments, headless Services and PDBs), `NAME-internal`
(the internal token's Secret), `NAME-pods` and `NAME-public` (NetworkPolicies). A model name is refused when
one of these would break a limit.

Limits, as of Kubernetes 1.31-1.37 (the chart's kubeVersion range):
- a Service name is an RFC 1035 label: at most 63 characters, starting with a letter
  (https://kubernetes.io/docs/concepts/services-networking/service/ "the name of a Service object must be a
  valid RFC 1035 label name");
- a Job name "must be no longer than 63 characters" even though it is a DNS subdomain, because the Job
  controller copies it into label values (https://kubernetes.io/docs/concepts/workloads/controllers/job/
  "Writing a Job spec");
- Deployments: "For best compatibility, the name should follow the more restrictive rules for a DNS label"
  (https://kubernetes.io/docs/concepts/workloads/controllers/deployment/ "Writing a Deployment Spec"): the
  pods' hostnames come from it.
- label values (our `neuronfleet.dev/model` and `app.kubernetes.io/instance` carry the model name): at most
  63 characters (https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/).
"""

from __future__ import annotations

import hashlib
import re

MAX_NAME = 63
RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
HASH_IN_NAME = 10  # compile-hash characters in a compile Job's name
REVISION_LENGTH = 8
ROLES = ("unified", "prefill", "decode", "router")


def compile_job(model: str, chash: str) -> str:
    return f"{model}-compile-{chash[:HASH_IN_NAME]}"


def source_probe(model: str, chash: str) -> str:
    """The Job that fingerprints a failed compile's model source (as long as `compile_job`'s name)."""
    return f"{model}-source-{chash[:HASH_IN_NAME]}"


def cache_claim(model: str) -> str:
    return f"{model}-compile-cache"


def config_map(model: str) -> str:
    return f"{model}-runtime"


def internal(model: str) -> str:
    """The internal token's Secret."""
    return f"{model}-internal"


def pods_policy(model: str) -> str:
    """The NetworkPolicy of every pod of the model."""
    return f"{model}-pods"


def public_policy(model: str) -> str:
    """The NetworkPolicy of the pods clients reach."""
    return f"{model}-public"


def deployment(model: str, role: str, revision: str | None = None) -> str:
    """A role's Deployment: `NAME-unified`, or `NAME-<role>-<revision>` in a disaggregated set."""
    return f"{model}-{role}-{revision}" if revision else f"{model}-{role}"


def revision(*parts: object) -> str:
    """A disaggregated set's identity: what its prefill, decode and router pods must agree on."""
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:REVISION_LENGTH]


def longest_children(model: str) -> list[tuple[str, str]]:
    """(what, name) of each child name pattern, at its longest."""
    h, r = "x" * 16, "x" * REVISION_LENGTH
    return [
        ("its public Service", model),
        ("its compile Job", compile_job(model, h)),
        ("its compile cache claim", cache_claim(model)),
        ("its ConfigMap", config_map(model)),
        ("its Secret", internal(model)),
        ("its NetworkPolicies", public_policy(model)),
        ("its unified Deployment", deployment(model, "unified")),
        *((f"its {role} Deployment and Service", deployment(model, role, r)) for role in ROLES[1:]),
    ]


def max_model_name() -> int:
    """The longest model name whose children all fit."""
    return MAX_NAME - max(len(name) - 1 for _, name in longest_children("m"))


def name_errors(model: str) -> list[str]:
    """Why a NeuronModel of this name cannot have its children, or nothing."""
    if not RFC1035.match(model):
        return [
            f"metadata.name {model!r} must be an RFC 1035 label (lower-case letters, digits and '-', "
            "starting with a letter, ending with a letter or digit): it names the model's Service"
        ]
    what, longest = max(longest_children(model), key=lambda c: len(c[1]))
    if len(longest) > MAX_NAME:
        return [
            f"metadata.name {model!r} has {len(model)} characters; at most {max_model_name()} fit, because "
            f"{what} is named {longest!r} ({len(longest)} characters) and Kubernetes allows {MAX_NAME}"
        ]
    return []
