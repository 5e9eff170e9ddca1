"""Shared by the engine contract tests: a sample with some sections changed, rendered by the builders as the
operator applies it (after validation accepts it)."""

from __future__ import annotations

import yaml
from support import ROOT

from neuronfleet.operator import builders, validation

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
