"""The bases of the NeuronModel's sections (`spec.py` and the sections it imports, such as
`gateway_spec.py`): camelCase fields, unknown fields refused, cross-field rules declared once for the CRD's
CEL and for Python; Kubernetes' syntax of the names, label keys and values, quantities and Secret keys a spec
names (each pattern with the words a refusal uses, `MEANINGS`), and the text fields that reach a container's
arguments or environment, where `$(` is refused (`ArgText`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

# Kubernetes' syntax, as its API server checks it (k8s.io/apimachinery pkg/util/validation/validation.go,
# v0.31: IsDNS1123Label, IsDNS1123Subdomain, IsQualifiedName, IsValidLabelValue, IsConfigMapKey, which a
# Secret's data keys follow; pkg/api/resource/quantity.go for a Quantity's form)
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
QUANTITY = r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
NO_SPACE = r"^\S+$"
# What each pattern means, in the words a refusal of a value uses (validation.parse)
MEANINGS = {
    DNS_LABEL: "a DNS-1123 label (lowercase letters, digits and '-', starting and ending with a letter or "
    "digit, at most 63 characters)",
    DNS_SUBDOMAIN: "a DNS-1123 subdomain (lowercase letters, digits, '-' and '.', each part between dots "
    "starting and ending with a letter or digit, at most 253 characters)",
    LABEL_VALUE: "a label value (letters, digits, '-', '_' and '.', starting and ending with a letter or "
    "digit, at most 63 characters; or empty)",
    SECRET_KEY: "a key of a Secret's data (letters, digits, '-', '_' and '.', at most 253 characters)",
    QUANTITY: "a Kubernetes quantity (e.g. 500m, 4, 2Gi, 200Gi)",
    NO_SPACE: "one word, without spaces",
}
_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
QUALIFIED_NAME = (
    "a qualified name (an optional DNS-1123 subdomain prefix and '/', then at most 63 letters, digits, '-', "
    "'_' and '.', starting and ending with a letter or digit; e.g. node.kubernetes.io/instance-type)"
)


def qualified_name(value: str) -> str:
    """A label key or resource name as Kubernetes' IsQualifiedName accepts it, else a ValueError."""
    prefix, slash, name = value.rpartition("/")
    ok = (
        bool(_NAME.match(name))
        and len(name) <= 63
        and (not slash or (bool(re.match(DNS_SUBDOMAIN, prefix)) and len(prefix) <= 253))
    )
    if not ok:
        raise ValueError(f"must be {QUALIFIED_NAME}, got {value!r}")
    return value


# The kubelet expands $(VAR) in a container's command, arguments and environment values when VAR is one of
# the container's variables, $$( escaping it (https://kubernetes.io/docs/tasks/inject-data-application/
# define-interdependent-environment-variables/, v1.31): a spec field that reaches them must not hold `$(`, or
# the value the process gets could be another variable's (a Secret's, where one comes from a Secret).
VAR_REF = (
    "must not contain $(: the kubelet expands $(VAR) in a container's arguments and environment, so the "
    "process would get another variable's value"
)


NO_VAR_REF_RULE = "!self.contains('$(')"


def no_var_ref(value: str) -> str:
    if "$(" in value:
        raise ValueError(VAR_REF)
    return value


def var_refs(value: Any, where: str) -> Iterator[str]:
    """The paths under `where` of every string (key or value, at any depth) in `value` that holds `$(`."""
    if isinstance(value, str):
        if "$(" in value:
            yield where
    elif isinstance(value, dict):
        for key, item in value.items():
            if "$(" in str(key):
                yield f"{where} key {key!r}"
            yield from var_refs(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from var_refs(item, f"{where}[{i}]")


def arg_text(pattern: str, max_length: int) -> Any:
    """The type of a text field that reaches a container's arguments or environment, of this syntax: `$(`
    refused here and, through the CRD's rule, by the API server at apply (max_length keeps the rule's cost
    bounded). (Its constraints live in the type: pydantic would leave a field's own pattern out of the
    schema of an optional field validated after.)"""
    rule = {"rule": NO_VAR_REF_RULE, "message": VAR_REF}
    return Annotated[
        str,
        Field(pattern=pattern, max_length=max_length, json_schema_extra={"x-kubernetes-validations": [rule]}),
        AfterValidator(no_var_ref),
    ]


LabelKey = Annotated[str, AfterValidator(qualified_name)]  # (a map's keys: checked here, not by the CRD)
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE, max_length=63)]
Quantity = Annotated[str, Field(pattern=QUANTITY, max_length=64)]


class Rule:
    """A cross-field rule: a CEL expression for the API server and the same check in Python."""

    def __init__(
        self,
        cel: str,
        message: str,
        check: Callable[[Any], bool],
        explain: Callable[[Any], str] | None = None,
    ) -> None:
        """`message` is the API server's (static); `explain`, when given, words the Python twin's refusal
        with the values at hand (naming a default the user did not set)."""
        self.cel, self.message, self.check, self.explain = cel, message, check, explain


def rules(*declared: Rule):
    """Class decorator: attach rules to a model (the CRD generator reads `__rules__`)."""

    def attach(cls):
        cls.__rules__ = list(declared)
        return cls

    return attach


class Spec(BaseModel):
    """Base of every section: camelCase names as written, unknown fields refused, rules checked."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_default=True)
    __rules__: list[Rule] = []

    @model_validator(mode="after")
    def _check_rules(self):
        for r in type(self).__rules__:
            if not r.check(self):
                raise ValueError(r.explain(self) if r.explain else r.message)
        return self


def section(cls: type[BaseModel], description: str):
    """A nested section that is always present, defaulted field by field (`default: {}` in the CRD)."""
    return Field(default_factory=cls, description=description)
