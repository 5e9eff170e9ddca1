"""The OpenAPI schemas kubectl reads: /openapi/v3 (an index of group versions, then one document per group
version), and the definitions `openapi_v2` publishes as /openapi/v2.

kubectl uses them for server-side field validation (the fieldValidation parameter of PATCH, PUT and POST) and
for `kubectl explain`, which finds the kind's schema in components.schemas by x-kubernetes-group-version-kind
and walks its properties, resolving $ref and single-element allOf (kubectl pkg/explain/v2/templates/
plaintext.tmpl). Built-in kinds get a small but truthful subset of Kubernetes' schemas (the fields and
descriptions of k8s.io/api v1.32 for the kinds the local cluster serves; the types in PARTIAL list only some
of their fields); a custom resource gets its CRD's openAPIV3Schema as applied, with apiVersion, kind and
metadata described as the apiextensions-apiserver does (pkg/controller/openapi/builder).

Pure functions of the kinds the store serves.
"""

from __future__ import annotations

import copy
from typing import Any

from .semantics import Resource

CONVENTIONS = "https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md"
API_VERSION = (
    "APIVersion defines the versioned schema of this representation of an object. Servers should convert "
    "recognized schemas to the latest internal value, and may reject unrecognized values. More info: "
    f"{CONVENTIONS}#resources"
)
KIND = (
    "Kind is a string value representing the REST resource this object represents. Servers may infer this "
    "from the endpoint the client submits requests to. Cannot be updated. In CamelCase. More info: "
    f"{CONVENTIONS}#types-kinds"
)
METADATA = f"Standard object's metadata. More info: {CONVENTIONS}#metadata"
META = "io.k8s.apimachinery.pkg.apis.meta.v1."
CORE = "io.k8s.api.core.v1."

# name -> (description, {field: (type, description)}, required). A type is "string", "integer", "boolean",
# "object", "[]string", "map[string]string", "Name" (another schema here) or "[]Name".
Fields = dict[str, tuple[str, str]]
TYPES: dict[str, tuple[str, Fields, list[str]]] = {
    META + "ObjectMeta": (
        "ObjectMeta is metadata that all persisted resources must have, which includes all objects users "
        "must create.",
        {
            "annotations": ("map[string]string", "Annotations is an unstructured key value map stored with a "
             "resource that may be set by external tools to store and retrieve arbitrary metadata. They are "
             "not queryable and should be preserved when modifying objects. More info: "
             "https://kubernetes.io/docs/concepts/overview/working-with-objects/annotations"),
            "creationTimestamp": ("string", "CreationTimestamp is a timestamp representing the server time "
             "when this object was created. It is not guaranteed to be set in happens-before order across "
             "separate operations. Clients may not set this value. It is represented in RFC3339 form and is "
             "in UTC."),
            "deletionGracePeriodSeconds": ("integer", "Number of seconds allowed for this object to "
             "gracefully terminate before it will be removed from the system. Only set when "
             "deletionTimestamp is also set. May only be shortened. Read-only."),
            "deletionTimestamp": ("string", "DeletionTimestamp is RFC 3339 date and time at which this "
             "resource will be deleted. This field is set by the server when a graceful deletion is "
             "requested by the user, and is not directly settable by a client."),
            "finalizers": ("[]string", "Must be empty before the object is deleted from the registry. Each "
             "entry is an identifier for the responsible component that will remove the entry from the "
             "list."),
            "generateName": ("string", "GenerateName is an optional prefix, used by the server, to generate "
             "a unique name ONLY IF the Name field has not been provided."),
            "generation": ("integer", "A sequence number representing a specific generation of the desired "
             "state. Populated by the system. Read-only."),
            "labels": ("map[string]string", "Map of string keys and values that can be used to organize and "
             "categorize (scope and select) objects. May match selectors of replication controllers and "
             "services. More info: https://kubernetes.io/docs/concepts/overview/working-with-objects/labels"),
            "managedFields": ("[]object", "ManagedFields maps workflow-id and version to the set of fields "
             "that are managed by that workflow. This is mostly for internal housekeeping, and users "
             "typically shouldn't need to set or understand this field."),
            "name": ("string", "Name must be unique within a namespace. Is required when creating resources, "
             "although some resources may allow a client to request the generation of an appropriate name "
             "automatically. Name is primarily intended for creation idempotence and configuration "
             "definition. Cannot be updated. More info: "
             "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names"),
            "namespace": ("string", "Namespace defines the space within which each name must be unique. An "
             "empty namespace is equivalent to the \"default\" namespace, but \"default\" is the canonical "
             "representation. Not all objects are required to be scoped to a namespace - the value of this "
             "field for those objects will be empty. Must be a DNS_LABEL. Cannot be updated. More info: "
             "https://kubernetes.io/docs/concepts/overview/working-with-objects/namespaces"),
            "ownerReferences": ("[]" + META + "OwnerReference", "List of objects depended by this object. If "
             "ALL objects in the list have been deleted, this object will be garbage collected. If this "
             "object is managed by a controller, then an entry in this list will point to this controller, "
             "with the controller field set to true. There cannot be more than one managing controller."),
            "resourceVersion": ("string", "An opaque value that represents the internal version of this "
             "object that can be used by clients to determine when objects have changed. Populated by the "
             "system. Read-only."),
            "selfLink": ("string", "Deprecated: selfLink is a legacy read-only field that is no longer "
             "populated by the system."),
            "uid": ("string", "UID is the unique in time and space value for this object. It is typically "
             "generated by the server on successful creation of a resource and is not allowed to change on "
             "PUT operations. Populated by the system. Read-only."),
        },
        [],
    ),
    META + "OwnerReference": (
        "OwnerReference contains enough information to let you identify an owning object. An owning object "
        "must be in the same namespace as the dependent, or be cluster-scoped, so there is no namespace "
        "field.",
        {
            "apiVersion": ("string", "API version of the referent."),
            "blockOwnerDeletion": ("boolean", "If true, AND if the owner has the \"foregroundDeletion\" "
             "finalizer, then the owner cannot be deleted from the key-value store until this reference is "
             "removed."),
            "controller": ("boolean", "If true, this reference points to the managing controller."),
            "kind": ("string", f"Kind of the referent. More info: {CONVENTIONS}#types-kinds"),
            "name": ("string", "Name of the referent. More info: "
             "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names"),
            "uid": ("string", "UID of the referent. More info: "
             "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#uids"),
        },
        ["apiVersion", "kind", "name", "uid"],
    ),
    META + "LabelSelector": (
        "A label selector is a label query over a set of resources. The result of matchLabels and "
        "matchExpressions are ANDed. An empty label selector matches all objects. A null label selector "
        "matches no objects.",
        {
            "matchExpressions": ("[]object", "matchExpressions is a list of label selector requirements. The "
             "requirements are ANDed."),
            "matchLabels": ("map[string]string", "matchLabels is a map of {key,value} pairs."),
        },
        [],
    ),
    CORE + "Pod": (
        "Pod is a collection of containers that can run on a host. This resource is created by clients and "
        "scheduled onto hosts.",
        {
            "spec": (CORE + "PodSpec", "Specification of the desired behavior of the pod. More info: "
             f"{CONVENTIONS}#spec-and-status"),
            "status": (CORE + "PodStatus",
             "Most recently observed status of the pod. This data may not be up to date. "
             f"Populated by the system. Read-only. More info: {CONVENTIONS}#spec-and-status"),
        },
        [],
    ),
    CORE + "PodTemplateSpec": (
        "PodTemplateSpec describes the data a pod should have when created from a template",
        {
            "metadata": (META + "ObjectMeta", METADATA),
            "spec": (CORE + "PodSpec", "Specification of the desired behavior of the pod. More info: "
             f"{CONVENTIONS}#spec-and-status"),
        },
        [],
    ),
    CORE + "PodSpec": (
        "PodSpec is a description of a pod.",
        {
            "containers": ("[]" + CORE + "Container", "List of containers belonging to the pod. Containers "
             "cannot currently be added or removed. There must be at least one container in a Pod. Cannot "
             "be updated."),
            "nodeSelector": ("map[string]string", "NodeSelector is a selector which must be true for the pod "
             "to fit on a node. Selector which must match a node's labels for the pod to be scheduled on "
             "that node. More info: https://kubernetes.io/docs/concepts/configuration/assign-pod-node/"),
            "restartPolicy": ("string", "Restart policy for all containers within the pod. One of Always, "
             "OnFailure, Never. In some contexts, only a subset of those values may be permitted. Default to "
             "Always. More info: https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/"
             "#restart-policy"),
            "serviceAccountName": ("string", "ServiceAccountName is the name of the ServiceAccount to use to "
             "run this pod. More info: https://kubernetes.io/docs/tasks/configure-pod-container/"
             "configure-service-account/"),
            "terminationGracePeriodSeconds": ("integer", "Optional duration in seconds the pod needs to "
             "terminate gracefully. May be decreased in delete request. Value must be non-negative integer. "
             "The value zero indicates stop immediately via the kill signal (no opportunity to shut down)."),
            "volumes": ("[]object", "List of volumes that can be mounted by containers belonging to the pod. "
             "More info: https://kubernetes.io/docs/concepts/storage/volumes"),
        },
        ["containers"],
    ),
    CORE + "Container": (
        "A single application container that you want to run within a pod.",
        {
            "args": ("[]string", "Arguments to the entrypoint. The container image's CMD is used if this is "
             "not provided."),
            "command": ("[]string", "Entrypoint array. Not executed within a shell. The container image's "
             "ENTRYPOINT is used if this is not provided."),
            "env": ("[]object", "List of environment variables to set in the container. Cannot be updated."),
            "image": ("string", "Container image name. More info: "
             "https://kubernetes.io/docs/concepts/containers/images"),
            "name": ("string", "Name of the container specified as a DNS_LABEL. Each container in a pod must "
             "have a unique name (DNS_LABEL). Cannot be updated."),
            "ports": ("[]object", "List of ports to expose from the container."),
            "resources": ("object", "Compute Resources required by this container. Cannot be updated. More "
             "info: https://kubernetes.io/docs/concepts/configuration/manage-resources-containers/"),
        },
        ["name"],
    ),
    "io.k8s.api.apps.v1.Deployment": (
        "Deployment enables declarative updates for Pods and ReplicaSets.",
        {
            "spec": ("io.k8s.api.apps.v1.DeploymentSpec", "Specification of the desired behavior of the "
             "Deployment."),
            "status": ("io.k8s.api.apps.v1.DeploymentStatus",
             "Most recently observed status of the Deployment."),
        },
        [],
    ),
    "io.k8s.api.apps.v1.DeploymentSpec": (
        "DeploymentSpec is the specification of the desired behavior of the Deployment.",
        {
            "replicas": ("integer", "Number of desired pods. This is a pointer to distinguish between "
             "explicit zero and not specified. Defaults to 1."),
            "selector": (META + "LabelSelector", "Label selector for pods. Existing ReplicaSets whose pods "
             "are selected by this will be the ones affected by this deployment. It must match the pod "
             "template's labels."),
            "strategy": ("object", "The deployment strategy to use to replace existing pods with new ones."),
            "template": (CORE + "PodTemplateSpec", "Template describes the pods that will be created. The "
             "only allowed template.spec.restartPolicy value is \"Always\"."),
        },
        ["selector", "template"],
    ),
    "io.k8s.api.batch.v1.Job": (
        "Job represents the configuration of a single job.",
        {
            "spec": ("io.k8s.api.batch.v1.JobSpec", "Specification of the desired behavior of a job. More "
             f"info: {CONVENTIONS}#spec-and-status"),
            "status": ("io.k8s.api.batch.v1.JobStatus",
             f"Current status of a job. More info: {CONVENTIONS}#spec-and-status"),
        },
        [],
    ),
    "io.k8s.api.batch.v1.JobSpec": (
        "JobSpec describes how the job execution will look like.",
        {
            "backoffLimit": ("integer", "Specifies the number of retries before marking this job failed. "
             "Defaults to 6"),
            "manualSelector": ("boolean", "manualSelector controls generation of pod labels and pod "
             "selectors. Leave `manualSelector` unset unless you are certain what you are doing."),
            "selector": (META + "LabelSelector", "A label query over pods that should match the pod count. "
             "Normally, the system sets this field for you. More info: https://kubernetes.io/docs/concepts/"
             "overview/working-with-objects/labels/#label-selectors"),
            "template": (CORE + "PodTemplateSpec", "Describes the pod that will be created when executing a "
             "job. The only allowed template.spec.restartPolicy values are \"Never\" or \"OnFailure\". More "
             "info: https://kubernetes.io/docs/concepts/workloads/controllers/jobs-run-to-completion/"),
            "ttlSecondsAfterFinished": ("integer", "ttlSecondsAfterFinished limits the lifetime of a Job "
             "that has finished execution (either Complete or Failed). If this field is set, "
             "ttlSecondsAfterFinished after the Job finishes, it is eligible to be automatically deleted."),
        },
        ["template"],
    ),
    CORE + "Service": (
        "Service is a named abstraction of software service (for example, mysql) consisting of local port "
        "(for example 3306) that the proxy listens on, and the selector that determines which pods will "
        "answer requests sent through the proxy.",
        {
            "spec": (CORE + "ServiceSpec", "Spec defines the behavior of a service. "
             f"{CONVENTIONS}#spec-and-status"),
            "status": (CORE + "ServiceStatus",
             "Most recently observed status of the service. Populated by the system. "
             f"Read-only. More info: {CONVENTIONS}#spec-and-status"),
        },
        [],
    ),
    CORE + "ServiceSpec": (
        "ServiceSpec describes the attributes that a user creates on a service.",
        {
            "clusterIP": ("string", "clusterIP is the IP address of the service and is usually assigned "
             "randomly. If an address is specified manually, is in-range (as per system configuration), and "
             "is not in use, it will be allocated to the service; otherwise creation of the service will "
             "fail. This field may not be changed through updates unless the type field is also being "
             "changed to ExternalName."),
            "ports": ("[]object", "The list of ports that are exposed by this service. More info: "
             "https://kubernetes.io/docs/concepts/services-networking/service/#virtual-ips-and-service-proxies"),
            "selector": ("map[string]string", "Route service traffic to pods with label keys and values "
             "matching this selector. If empty or not present, the service is assumed to have an external "
             "process managing its endpoints, which Kubernetes will not modify."),
            "type": ("string", "type determines how the Service is exposed. Defaults to ClusterIP. Valid "
             "options are ExternalName, ClusterIP, NodePort, and LoadBalancer."),
        },
        [],
    ),
    CORE + "ConfigMap": (
        "ConfigMap holds configuration data for pods to consume.",
        {
            "binaryData": ("map[string]string", "BinaryData contains the binary data. Each key must consist "
             "of alphanumeric characters, '-', '_' or '.'."),
            "data": ("map[string]string", "Data contains the configuration data. Each key must consist of "
             "alphanumeric characters, '-', '_' or '.'. Values with non-UTF-8 byte sequences must use the "
             "BinaryData field. The keys stored in Data must not overlap with the keys in the BinaryData "
             "field, this is enforced during validation process."),
            "immutable": ("boolean", "Immutable, if set to true, ensures that data stored in the ConfigMap "
             "cannot be updated (only object metadata can be modified). If not set to true, the field can "
             "be modified at any time. Defaulted to nil."),
        },
        [],
    ),
    CORE + "Secret": (
        "Secret holds secret data of a certain type. The total bytes of the values in the Data field must "
        "be less than MaxSecretSize bytes.",
        {
            "data": ("map[string]string", "Data contains the secret data. Each key must consist of "
             "alphanumeric characters, '-', '_' or '.'. The serialized form of the secret data is a base64 "
             "encoded string, representing the arbitrary (possibly non-string) data value here. Described in "
             "https://tools.ietf.org/html/rfc4648#section-4"),
            "immutable": ("boolean", "Immutable, if set to true, ensures that data stored in the Secret "
             "cannot be updated (only object metadata can be modified). If not set to true, the field can "
             "be modified at any time. Defaulted to nil."),
            "stringData": ("map[string]string", "stringData allows specifying non-binary secret data in "
             "string form. It is provided as a write-only input field for convenience. All keys and values "
             "are merged into the data field on write, overwriting any existing values. The stringData field "
             "is never output when reading from the API."),
            "type": ("string", "Used to facilitate programmatic handling of secret data. More info: "
             "https://kubernetes.io/docs/concepts/configuration/secret/#secret-types"),
        },
        [],
    ),
    CORE + "Namespace": (
        "Namespace provides a scope for Names. Use of multiple namespaces is optional.",
        {
            "spec": (CORE + "NamespaceSpec", "Spec defines the behavior of the Namespace. More info: "
             f"{CONVENTIONS}#spec-and-status"),
            "status": (CORE + "NamespaceStatus",
             "Status describes the current status of a Namespace. More info: "
             f"{CONVENTIONS}#spec-and-status"),
        },
        [],
    ),
    CORE + "PodStatus": (
        "PodStatus represents information about the status of a pod. Status may trail the actual state of a "
        "system, especially if the node that hosts the pod cannot contact the control plane.",
        {
            "conditions": ("[]object", "Current service state of pod. More info: https://kubernetes.io/docs/"
             "concepts/workloads/pods/pod-lifecycle#pod-conditions"),
            "containerStatuses": ("[]object", "Statuses of containers in this pod. Each container in the pod "
             "should have at most one status in this list, and all statuses should be for containers in the "
             "pod."),
            "phase": ("string",
             "The phase of a Pod is a simple, high-level summary of where the Pod is in its "
             "lifecycle. The conditions array, the reason and message fields, and the individual container "
             "status arrays contain more detail about the pod's status."),
            "podIP": ("string", "podIP address allocated to the pod. Routable at least within the cluster. "
             "Empty if not yet allocated."),
            "startTime": ("string", "RFC 3339 date and time at which the object was acknowledged by the "
             "Kubelet. This is before the Kubelet pulled the container image(s) for the pod."),
        },
        [],
    ),
    "io.k8s.api.apps.v1.DeploymentStatus": (
        "DeploymentStatus is the most recently observed status of the Deployment.",
        {
            "availableReplicas": ("integer", "Total number of available pods (ready for at least "
             "minReadySeconds) targeted by this deployment."),
            "conditions": ("[]object", "Represents the latest available observations of a deployment's "
             "current state."),
            "observedGeneration": ("integer", "The generation observed by the deployment controller."),
            "readyReplicas": ("integer", "readyReplicas is the number of pods targeted by this Deployment "
             "with a Ready Condition."),
            "replicas": ("integer", "Total number of non-terminating pods targeted by this deployment (their "
             "labels match the selector)."),
            "updatedReplicas": ("integer", "Total number of non-terminating pods targeted by this deployment "
             "that have the desired template spec."),
        },
        [],
    ),
    "io.k8s.api.batch.v1.JobStatus": (
        "JobStatus represents the current state of a Job.",
        {
            "active": ("integer", "The number of pending and running pods which are not terminating (without "
             "a deletionTimestamp). The value is zero for finished jobs."),
            "completionTime": ("string", "Represents time when the job was completed. It is not guaranteed "
             "to be set in happens-before order across separate operations. It is represented in RFC3339 "
             "form and is in UTC."),
            "conditions": ("[]object", "The latest available observations of an object's current state. "
             "When a Job fails, one of the conditions will have type \"Failed\" and status true."),
            "failed": ("integer", "The number of pods which reached phase Failed. The value increases "
             "monotonically."),
            "startTime": ("string", "Represents time when the job controller started processing a job."),
            "succeeded": ("integer", "The number of pods which reached phase Succeeded. The value increases "
             "monotonically for a given spec."),
        },
        [],
    ),
    CORE + "ServiceStatus": (
        "ServiceStatus represents the current status of a service.",
        {
            "conditions": ("[]object", "Current service state"),
            "loadBalancer": ("object", "LoadBalancer contains the current status of the load-balancer, if "
             "one is present."),
        },
        [],
    ),
    CORE + "NamespaceSpec": (
        "NamespaceSpec describes the attributes on a Namespace.",
        {
            "finalizers": ("[]string", "Finalizers is an opaque list of values that must be empty to "
             "permanently remove object from storage. More info: https://kubernetes.io/docs/tasks/"
             "administer-cluster/namespaces/"),
        },
        [],
    ),
    CORE + "NamespaceStatus": (
        "NamespaceStatus is information about the current status of a Namespace.",
        {
            "conditions": ("[]object", "Represents the latest available observations of a namespace's "
             "current state."),
            "phase": ("string", "Phase is the current lifecycle phase of the namespace. More info: "
             "https://kubernetes.io/docs/tasks/administer-cluster/namespaces/"),
        },
        [],
    ),
}  # fmt: skip

# The built-in kinds with a schema above: (group, version, kind) -> schema name.
BUILTIN_SCHEMAS = {
    ("", "v1", "Pod"): CORE + "Pod",
    ("", "v1", "Service"): CORE + "Service",
    ("", "v1", "ConfigMap"): CORE + "ConfigMap",
    ("", "v1", "Secret"): CORE + "Secret",
    ("", "v1", "Namespace"): CORE + "Namespace",
    ("apps", "v1", "Deployment"): "io.k8s.api.apps.v1.Deployment",
    ("batch", "v1", "Job"): "io.k8s.api.batch.v1.Job",
}


# The types above whose field lists are a subset of k8s.io/api v1.32's (the others list all their fields).
# kubectl refuses a field its OpenAPI v2 schema does not list: `openapi_v2` publishes these as open objects.
PARTIAL = {
    CORE + "PodSpec", CORE + "Container", CORE + "PodStatus", CORE + "ServiceSpec",
    "io.k8s.api.apps.v1.DeploymentSpec", "io.k8s.api.apps.v1.DeploymentStatus",
    "io.k8s.api.batch.v1.JobSpec", "io.k8s.api.batch.v1.JobStatus",
}  # fmt: skip
V2_PREFIX = "#/definitions/"  # where swagger 2.0 keeps schemas (OpenAPI v3: #/components/schemas/)


def field(kind: str, description: str, prefix: str) -> dict[str, Any]:
    """The schema of a field of this kind (a type as in TYPES), described; a reference under prefix."""
    if kind.startswith("[]"):
        return {"type": "array", "description": description, "items": field(kind[2:], "", prefix)}
    if kind.startswith("map[string]"):
        return {"type": "object", "description": description, "additionalProperties": {"type": "string"}}
    if kind in ("string", "integer", "boolean", "object"):
        out: dict[str, Any] = {"type": kind, "description": description}
        if kind == "integer":
            out["format"] = "int64"
        return {k: v for k, v in out.items() if v != ""}
    ref = {"$ref": f"{prefix}{kind}"}
    if not description:
        return ref
    if prefix == V2_PREFIX:  # swagger 2.0 describes a reference beside its $ref (kube-openapi's v2 builder)
        return {"description": description, **ref}
    return {"description": description, "allOf": [ref], "default": {}}


def _schema(name: str, prefix: str, gvk: dict[str, str] | None) -> dict[str, Any]:
    description, fields, required = TYPES[name]
    properties = {k: field(t, d, prefix) for k, (t, d) in fields.items()}
    if gvk is not None:  # a kind: its type meta and metadata
        properties.update(
            apiVersion={"type": "string", "description": API_VERSION},
            kind={"type": "string", "description": KIND},
            metadata=field(META + "ObjectMeta", METADATA, prefix),
        )
    out: dict[str, Any] = {
        "description": description,
        "type": "object",
        "properties": dict(sorted(properties.items())),
    }
    if required:
        out["required"] = required
    if gvk is not None:
        out["x-kubernetes-group-version-kind"] = [gvk]
    return out


def _reachable(name: str, seen: set[str]) -> set[str]:
    if name in seen or name not in TYPES:
        return seen
    seen.add(name)
    for kind, _ in TYPES[name][1].values():
        _reachable(kind.removeprefix("[]"), seen)
    return seen


def _crd_schema(r: Resource, prefix: str) -> dict[str, Any]:
    """A CRD version's schema as the API server publishes it: type meta described, metadata as ObjectMeta."""
    schema = copy.deepcopy(r.schema or {"type": "object", "x-kubernetes-preserve-unknown-fields": True})
    properties = schema.setdefault("properties", {})
    properties["apiVersion"] = {"type": "string", "description": API_VERSION}
    properties["kind"] = {"type": "string", "description": KIND}
    properties["metadata"] = field(META + "ObjectMeta", METADATA, prefix)
    schema["x-kubernetes-group-version-kind"] = [{"group": r.group, "kind": r.kind, "version": r.version}]
    return schema


def schema_name(r: Resource) -> str:
    """The name under which a kind's schema is published: Kubernetes' for built-ins, the reversed group for
    a custom resource (neuronfleet.dev/v1alpha1 NeuronModel -> dev.neuronfleet.v1alpha1.NeuronModel)."""
    builtin = BUILTIN_SCHEMAS.get((r.group, r.version, r.kind))
    if builtin:
        return builtin
    if r.schema is None:
        group = r.group or "core"
        return f"io.k8s.api.{group.split('.')[0]}.{r.version}.{r.kind}"
    return ".".join([*reversed(r.group.split(".")), r.version, r.kind])


def schemas(kinds: list[Resource], prefix: str) -> dict[str, Any]:
    """The schemas of these kinds and of the types they refer to."""
    out: dict[str, Any] = {}
    needed: set[str] = set()
    for r in kinds:
        name = schema_name(r)
        gvk = {"group": r.group, "kind": r.kind, "version": r.version}
        if r.schema is not None:
            out[name] = _crd_schema(r, prefix)
            needed |= _reachable(META + "ObjectMeta", set())
        elif name in TYPES:
            out[name] = _schema(name, prefix, gvk)
            for kind, _ in TYPES[name][1].values():
                needed |= _reachable(kind.removeprefix("[]"), set())
            needed |= _reachable(META + "ObjectMeta", set())
        else:  # a kind without a detailed schema here: its type meta and metadata, other fields kept
            out[name] = {
                "description": f"{r.kind} ({r.api_version}).",
                "type": "object",
                "properties": {
                    "apiVersion": {"type": "string", "description": API_VERSION},
                    "kind": {"type": "string", "description": KIND},
                    "metadata": field(META + "ObjectMeta", METADATA, prefix),
                },
                "x-kubernetes-preserve-unknown-fields": True,
                "x-kubernetes-group-version-kind": [gvk],
            }
            needed |= _reachable(META + "ObjectMeta", set())
    for name in sorted(needed - set(out)):
        out[name] = _schema(name, prefix, None)
    return out


FIELD_VALIDATION = {
    "name": "fieldValidation",
    "in": "query",
    "description": "fieldValidation instructs the server on how to handle objects in the request "
    "(POST/PUT/PATCH) containing unknown or duplicate fields. Valid values are: Ignore, Warn, Strict.",
    "schema": {"type": "string", "uniqueItems": True},
}


def kind_paths(kinds: list[Resource], prefix: str, v2: bool) -> dict[str, Any]:
    """The operations on each kind's collection and item paths under prefix (kubectl finds a kind's PATCH by
    its x-kubernetes-group-version-kind and checks it takes fieldValidation)."""
    paths: dict[str, Any] = {}
    param = FIELD_VALIDATION
    if v2:  # swagger 2.0: a parameter's type and keywords beside its name
        param = {k: v for k, v in FIELD_VALIDATION.items() if k != "schema"} | FIELD_VALIDATION["schema"]
    for r in kinds:
        base = f"/{prefix}/namespaces/{{namespace}}/{r.plural}" if r.namespaced else f"/{prefix}/{r.plural}"
        gvk = {"group": r.group, "version": r.version, "kind": r.kind}
        read = {"x-kubernetes-group-version-kind": gvk, "x-kubernetes-action": "list", "responses": {}}
        write = {"parameters": [param], "x-kubernetes-group-version-kind": gvk, "responses": {}}
        paths[base] = {"get": read, "post": write | {"x-kubernetes-action": "post"}}
        paths[f"{base}/{{name}}"] = {
            "get": read | {"x-kubernetes-action": "get"},
            "put": write | {"x-kubernetes-action": "put"},
            "patch": write | {"x-kubernetes-action": "patch"},
            "delete": read | {"x-kubernetes-action": "delete"},
        }
    return paths


def v3_index(group_versions: list[tuple[str, str]], revision: str) -> dict[str, Any]:
    """/openapi/v3: where each group version's document is (the hash changes when kinds change)."""
    index = {}
    for g, v in group_versions:
        path = f"apis/{g}/{v}" if g else f"api/{v}"
        index[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={revision}"}
    return {"paths": dict(sorted(index.items()))}


def v3_document(group: str, version: str, kinds: list[Resource], server_version: str) -> dict[str, Any]:
    """/openapi/v3/apis/GROUP/VERSION (or /openapi/v3/api/v1): the group version's paths and schemas."""
    prefix = f"apis/{group}/{version}" if group else f"api/{version}"
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": server_version},
        "paths": kind_paths(kinds, prefix, v2=False),
        "components": {"schemas": schemas(kinds, "#/components/schemas/")},
    }
