"""`serving.gateway`: a model behind an inference gateway (the Gateway API Inference Extension). The fields
the operator turns into an InferencePool (`inference.networking.k8s.io/v1`) and, optionally, an HTTPRoute
(`gateway.networking.k8s.io/v1`) to it (`gateway.py` builds them; docs/gateway.md).

Bounds follow the pinned CRDs (tests/data): the InferencePool's endpointPickerRef (GIE v1.6.0,
api/v1/inferencepool_types.go) and the HTTPRoute's parentRefs, hostnames and path match (Gateway API v1.6.1,
apis/v1/shared_types.go, httproute_types.go), so a spec this accepts makes objects those CRDs accept.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .spec_base import DNS_LABEL, DNS_SUBDOMAIN, Rule, Spec, rules

# the endpoint picker's ext-proc gRPC port (GIE v1.5.0 pkg/epp/server/options.go: DefaultGrpcPort = 9002)
EPP_PORT = 9002
# Gateway API v1.6.1 apis/v1/shared_types.go: Hostname, SectionName, ObjectName (a DNS subdomain)
HOSTNAME = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SUBDOMAIN = DNS_SUBDOMAIN


class EndpointPicker(Spec):
    """The endpoint picker (EPP) the gateway asks which pod serves each request: a Service in the model's
    namespace (e.g. the one the GIE `inferencepool` Helm chart or llm-d deploys)."""

    name: str = Field(
        description="Name of the endpoint picker's Service, in the NeuronModel's namespace.",
        pattern=DNS_LABEL,
        max_length=63,
    )
    port: int = Field(EPP_PORT, description="The endpoint picker's gRPC (ext-proc) port.", ge=1, le=65535)
    failureMode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose",
        description="When the endpoint picker does not answer: FailClose (the gateway refuses the request) "
        "or FailOpen (the gateway picks a pod of the pool itself).",
    )


class ParentRef(Spec):
    name: str = Field(description="Name of the Gateway.", pattern=SUBDOMAIN, min_length=1, max_length=253)
    namespace: str | None = Field(
        None, description="Namespace of the Gateway (default: the NeuronModel's).", pattern=DNS_LABEL,
        max_length=63,
    )  # fmt: skip
    sectionName: str | None = Field(
        None, description="A listener of the Gateway, by name (default: all).", pattern=SUBDOMAIN,
        max_length=253,
    )  # fmt: skip


@rules(
    Rule(
        "self.parentRefs.all(p, self.parentRefs.exists_one(q, q.name == p.name"
        " && (has(q.namespace) ? q.namespace : '') == (has(p.namespace) ? p.namespace : '')"
        " && (has(q.sectionName) ? q.sectionName : '') == (has(p.sectionName) ? p.sectionName : '')))",
        "serving.gateway.httpRoute.parentRefs must name each Gateway (and listener) once",
        lambda s: len({(p.name, p.namespace, p.sectionName) for p in s.parentRefs}) == len(s.parentRefs),
        lambda s: (
            "serving.gateway.httpRoute.parentRefs must name each Gateway (and listener) once; "
            "named twice: "
            + ", ".join(
                sorted(
                    {
                        "/".join(x for x in (p.namespace, p.name, p.sectionName) if x)
                        for p in s.parentRefs
                        if [(q.name, q.namespace, q.sectionName) for q in s.parentRefs].count(
                            (p.name, p.namespace, p.sectionName)
                        )
                        > 1
                    }
                )
            )
        ),
    )
)
class HTTPRoute(Spec):
    """An HTTPRoute that sends a Gateway's requests for these hostnames and path to the model's pool."""

    parentRefs: list[ParentRef] = Field(
        description="The Gateways (kind Gateway) whose listeners take the route.", min_length=1, max_length=32
    )
    hostnames: list[Annotated[str, Field(pattern=HOSTNAME, min_length=1, max_length=253)]] = Field(
        default_factory=list,
        description="Host names the route matches (e.g. llm.example.com, *.example.com); empty: any.",
        max_length=16,
    )
    path: str = Field(
        "/",
        description="Path prefix the route matches (e.g. / or /v1).",
        pattern=r"^/[^\s?#]*$",
        max_length=1024,
    )


class Gateway(Spec):
    """An InferencePool of the model's pods for a gateway's endpoint picker; optionally an HTTPRoute."""

    endpointPicker: EndpointPicker = Field(description="The endpoint picker the pool names.")
    httpRoute: HTTPRoute | None = Field(
        None, description="Also make an HTTPRoute from these Gateways to the pool (default: none)."
    )
