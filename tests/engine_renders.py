"""Shared by the engine contract tests: a sample with some sections changed, rendered by the builders as the
operator applies it (after validation accepts it); a rendered value or environment read against the facts an
engine module records (`Fact.value`: a kind such as "int" or "path", or the choices "a|b")."""

from __future__ import annotations

import yaml
from support import ROOT

from neuronfleet.operator import builders, validation
from neuronfleet.operator.engines.common import Fact

OWNER = builders.Owner("m", "ns", "6f1f0d38-5d2c-4d5e-9c2a-3b1d2f4e5a6b")


def manifest(name: str, change: dict | None = None) -> dict:
    """The sample `name` with `change`'s sections merged in (a None value removes a field)."""
    obj = yaml.safe_load((ROOT / "crds" / "samples" / name).read_text())
    for section, fields in (change or {}).items():
        merged = {**obj["spec"].get(section, {}), **fields}
        obj["spec"][section] = {k: v for k, v in merged.items() if v is not None}
    return obj


def cases(samples: list[str], variants: dict[str, tuple[str, dict]]) -> list[tuple[str, dict]]:
    """(label, manifest) of every sample, then of every variant (label -> (sample, change))."""
    return [(name, manifest(name)) for name in samples] + [
        (label, manifest(base, change)) for label, (base, change) in variants.items()
    ]


def rendered(obj: dict) -> tuple[object, list[dict]]:
    report = validation.check(obj)
    assert report.ok, report.errors
    spec, _ = validation.parse(obj)
    return spec, builders.build_all(OWNER, spec, serving_hash=builders.compile_hash(spec))


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def serving_deployment(objects: list[dict]) -> dict:
    """The unified pods' Deployment (a model of more than one pod has its front door's too)."""
    (deployment,) = [d for d in of_kind(objects, "Deployment")
                     if d["metadata"]["labels"]["neuronfleet.dev/role"] == "unified"]  # fmt: skip
    return deployment


KINDS = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or str(v).isdigit(),
    "int-list": lambda v: isinstance(v, list) and all(isinstance(i, int) for i in v),
    "path": lambda v: isinstance(v, str) and v.startswith("/"),
    "str": lambda v: isinstance(v, str) and v != "",
    "json": lambda v: isinstance(v, dict | list),
}


def check_value(fact: Fact, value: object) -> None:
    """A value against its fact's recorded kind, or its recorded choices (JSON values for config keys,
    strings for environment variables)."""
    if fact.value in KINDS:
        assert KINDS[fact.value](value), (fact.name, fact.value, value)
    else:
        assert str(value) in fact.value.split("|"), (fact.name, value)


def check_env(env: list[dict], recorded: dict[str, Fact], seen: set[str]) -> dict[str, object]:
    """A container's environment: every name recorded, every plain value of its recorded kind; the names go
    into `seen`; returns name -> value (or valueFrom)."""
    out = {}
    for e in env:
        fact = recorded.get(e["name"])
        assert fact is not None, f"environment variable {e['name']} is not recorded in PINNED"
        if "value" in e:
            check_value(fact, e["value"])
        out[e["name"]] = e.get("value", e.get("valueFrom"))
        seen.add(fact.name)
    return out
