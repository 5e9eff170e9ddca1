"""`kubectl apply` (the real kubectl) against the emulated API server with the generated CRD: a NeuronModel
that breaks a rule of the spec is refused at apply with the rule's message, and stored nowhere; the ones that
keep the rules are created (tests/rule_cases.py, the table the CEL and the operator's Python agree on)."""

from __future__ import annotations

import pytest
import yaml
from rule_cases import CASES, Case
from support import ROOT, ApiServer

CRD = ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml"
REFUSED = [c for c in CASES if c.words]
ACCEPTED = [c for c in CASES if not c.words]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = ApiServer(tmp_path_factory.mktemp("cel-rules"))
    server.kubectl("apply", "-f", str(CRD))
    yield server
    server.stop()


def manifest(case: Case) -> tuple[str, str]:
    obj = case.manifest()
    obj["metadata"]["namespace"] = "default"
    return obj["metadata"]["name"], yaml.safe_dump(obj)


@pytest.mark.parametrize("case", REFUSED, ids=[c.id for c in REFUSED])
def test_kubectl_apply_refuses_a_model_that_breaks_a_rule_saying_what_is_wrong(api, case):
    name, text = manifest(case)
    run = api.kubectl("apply", "-f", "-", stdin=text, check=False)
    assert run.returncode != 0
    assert "is invalid" in run.stderr and case.words in run.stderr, run.stderr
    assert api.kubectl.get("nm", name) is None


@pytest.mark.parametrize("case", ACCEPTED, ids=[c.id for c in ACCEPTED])
def test_kubectl_apply_creates_a_model_that_keeps_the_rules(api, case):
    name, text = manifest(case)
    assert f"neuronmodel.neuronfleet.dev/{name} created" in api.kubectl("apply", "-f", "-", stdin=text).stdout
    api.kubectl("delete", "nm", name)
