"""The engine matrix (operator/engines/matrix.py) against what it summarises: each cell says "refused" exactly
where `neuronfleet validate` refuses that engine and mode on the family's largest instance type (Llama 3.1 8B,
tensor parallelism 8, 1 on cpu, the prompt limit the engine takes), and where the API server refuses it at
`kubectl apply` (the CRD's rules, as the emulated API server evaluates them); each pinned contract is the one
the engine renders for that family, and the README's "What runs where" and "Pinned images" tables are the
matrix's."""

from __future__ import annotations

import copy

import pytest
from support import ROOT

from neuronfleet.localcluster import semantics
from neuronfleet.operator import builders, crd, spec, validation
from neuronfleet.operator.engines import matrix

README = (ROOT / "README.md").read_text()
DISAGGREGATED = {"mode": "disaggregated", "prefill": {}, "decode": {}}


def instance_of(family: str) -> str:
    return (
        "cpu" if family == "cpu" else [i for i in validation.topology.INSTANCES if i.startswith(family)][-1]
    )


def model(engine: str, mode: str, family: str) -> dict:
    neuron = {"instanceType": instance_of(family), "tensorParallel": 1 if family == "cpu" else 8}
    if engine == "vllm":
        neuron["maxInputLength"] = 4096 - 1  # the default sequenceLength - 1
    return {
        "apiVersion": spec.API_VERSION, "kind": spec.KIND, "metadata": {"name": "m"},
        "spec": {"model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}, "engine": engine,
                 "neuron": neuron, "serving": dict(DISAGGREGATED) if mode == "disaggregated" else {}},
    }  # fmt: skip


CELLS = [(e, m, f) for e in matrix.ENGINES for m in matrix.MODES for f in matrix.FAMILIES]


# what an experimental cell names: engine embedded's TorchNeuron path on trn2 and trn3
EXPERIMENTAL = {
    "tensorParallel": 1, "compiledSteps": "neuron",
    "buckets": {"context": [128, 1024, 3072], "generation": [1024, 4096]},
}  # fmt: skip


def refusals(obj: dict) -> tuple[list[str], list[str]]:
    """What validation and the API server (the CRD's rules) refuse of a NeuronModel."""
    schema = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    at_apply = semantics.schema_errors(semantics.apply_defaults(copy.deepcopy(obj), schema), schema)
    return validation.check(obj).errors, at_apply


@pytest.mark.parametrize(("engine", "mode", "family"), CELLS)
def test_every_cell_is_what_validation_and_the_api_server_say(engine, mode, family):
    """A "works" cell validates as the matrix's model is; an "experimental" one with the settings it names
    (and not without: the refusal says to set them); a "refused" one never."""
    cell = matrix.cell(engine, mode, family)
    assert cell.split(" ")[0] in ("works", "refused", "experimental"), cell
    obj = model(engine, mode, family)
    errors, at_apply = refusals(obj)
    assert (not errors) == cell.startswith("works"), (cell, errors)
    assert (not at_apply) == cell.startswith("works"), (cell, at_apply)
    if cell.startswith("experimental"):
        assert any("neuron.compiledSteps neuron" in e for e in errors), errors
        obj["spec"]["neuron"].update(copy.deepcopy(EXPERIMENTAL))
        assert refusals(obj) == ([], []), cell


@pytest.mark.parametrize(("engine", "family"), [k for k, s in matrix.MATRIX.items() if s.pinned is not None])
def test_each_pinned_contract_is_the_one_the_engine_renders_there(engine, family):
    obj = model(engine, "unified", family)
    parsed, errors = validation.parse(obj)
    assert not errors
    pinned = matrix.MATRIX[(engine, family)].pinned
    assert builders.engines.image_for(parsed) == pinned.image
    built = builders.build_all(builders.Owner("m", "ns"), parsed, serving_hash="h")
    deployments = [o for o in built if o["kind"] == "Deployment"]
    assert sorted(d["metadata"]["name"] for d in deployments) == ["m-router", "m-unified"]  # the front door
    for deployment in (d for d in deployments if d["metadata"]["name"] == "m-unified"):
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == pinned.image


@pytest.mark.parametrize(
    ("marker", "table"),
    [("what-runs-where", matrix.what_runs_where), ("pinned-images", matrix.pinned_images)],
)
def test_the_readmes_tables_are_the_matrixs(marker, table):
    written = README.split(f"<!-- {marker}: begin -->")[1].split(f"<!-- {marker}: end -->")[0].strip()
    assert written == table(), f"README's {marker} table is stale; it should read:\n{table()}"
