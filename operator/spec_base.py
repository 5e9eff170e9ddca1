"""The bases of the NeuronModel's sections (`spec.py` and the sections it imports, such as
`gateway_spec.py`): camelCase fields, unknown fields refused, cross-field rules declared once for the CRD's
CEL and for Python."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


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
