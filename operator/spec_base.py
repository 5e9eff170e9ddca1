"""The bases of the NeuronModel's sections (`spec.py` and the sections it imports, such as
`gateway_spec.py`): camelCase fields, unknown fields refused, cross-field rules declared once for the CRD's
CEL and for Python; Kubernetes' syntax of the names, label keys and values, quantities and Secret keys a spec
names (each pattern with the words a refusal uses, `MEANINGS`), and the text fields that reach a container's
arguments or environment, where `$(` is refused (`ArgText`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
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


# QUALIFIED_NAME in CEL, for a string of at most 317 characters at `{0}` (a prefix of at most 253, a name of
# at most 63: RE2's bounded repetition)
QUALIFIED_NAME_CEL = (
    r"{0}.matches('^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]{{0,61}})?[A-Za-z0-9]$') && !{0}.matches('^[^/]{{254,}}/')"
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


# Kubernetes quantity suffixes (apimachinery pkg/api/resource/suffix.go): binary, then decimal
_SUFFIXES = {
    **{s: 1024**i for i, s in enumerate(("", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18},
}


def quantity_value(text: str) -> float:
    """A Kubernetes quantity's value (`500m` 0.5, `2Gi` 2147483648, `1e3` 1000); ValueError if malformed."""
    text = str(text).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if suffix and text.endswith(suffix):
            return float(text[: -len(suffix)]) * _SUFFIXES[suffix]
    return float(text)


class Rule:
    """A rule over one section of the spec, declared once: a CEL expression that the CRD carries as an
    `x-kubernetes-validations` entry (the API server refuses an object that breaks it, at apply), and the
    same check in Python for what does not pass through the API server (`neuronfleet validate` and `render`,
    and an object stored before the CRD had the rule: the Validated condition). tests/unit/test_cel_rules.py
    holds the two to agreeing on a table of good and bad objects.

    CEL as Kubernetes offers it (https://kubernetes.io/docs/reference/using-api/cel/, v1.30): the standard
    definitions and macros, and Kubernetes' libraries (here only `isSorted` of its list library and `join` of
    cel-go's strings extension); `self` is the section, after the schema's defaults; a rule that iterates a
    list or a string needs maxItems or maxLength on it, so that the API server's estimate of its cost is
    bounded (https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/custom-resource-definitions/
    #resource-use-by-validation-functions). localcluster/semantics.py evaluates the same rules."""

    def __init__(
        self,
        cel: str,
        message: str,
        check: Callable[[Any], bool],
        explain: Callable[[Any], str] | None = None,
        message_expression: str | None = None,
    ) -> None:
        """`message` is the API server's (static); `message_expression`, when given, a CEL expression that
        words it with the object's values (the API server falls back on `message` if it fails); `explain`,
        when given, words the Python twin's refusal with the values at hand (naming a default the user did not
        set)."""
        self.cel, self.message, self.check, self.explain = cel, message, check, explain
        self.message_expression = message_expression

    def refusal(self, section: Any) -> str | None:
        """The Python twin's refusal of a section, or None when the section keeps the rule."""
        if self.check(section):
            return None
        return self.explain(section) if self.explain else self.message

    def validation(self) -> dict[str, str]:
        """The CRD's x-kubernetes-validations entry."""
        out = {"rule": self.cel, "message": self.message}
        if self.message_expression:
            out["messageExpression"] = self.message_expression
        return out


def rules(*declared: Rule):
    """Class decorator: attach rules to a section, checked when it is parsed (a spec that breaks one does not
    parse); the CRD generator reads `__rules__`."""

    def attach(cls):
        cls.__rules__ = list(declared)
        return cls

    return attach


def validated_rules(*declared: Rule):
    """Class decorator: attach rules to a section that `validation.validate` checks with the rest of its
    checks (a spec that breaks one parses, and every refusal is reported together); in the CRD alike."""

    def attach(cls):
        cls.__validated_rules__ = list(declared)
        return cls

    return attach


def broken_rules(section: BaseModel, words: Mapping[Rule, Callable[[Any], str]] | None = None) -> list[str]:
    """The refusals of every validated rule (`validated_rules`) of a parsed section and the sections in it;
    `words` words a rule's refusal where the caller knows more (validation names the engines that run)."""
    words = words or {}
    out = []
    for rule in getattr(type(section), "__validated_rules__", []):
        if not rule.check(section):
            out.append(words[rule](section) if rule in words else rule.refusal(section) or "")
    for name in type(section).model_fields:
        value = getattr(section, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                out += broken_rules(item, words)
    return out


class Spec(BaseModel):
    """Base of every section: camelCase names as written, unknown fields refused, rules checked."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_default=True)
    __rules__: list[Rule] = []
    __validated_rules__: list[Rule] = []

    @model_validator(mode="after")
    def _check_rules(self):
        for r in type(self).__rules__:
            if (refusal := r.refusal(self)) is not None:
                raise ValueError(refusal)
        return self


def section(cls: type[BaseModel], description: str):
    """A nested section that is always present, defaulted field by field (`default: {}` in the CRD)."""
    return Field(default_factory=cls, description=description)
