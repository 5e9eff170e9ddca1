"""The chart's ServiceAccount for compile Jobs (values compile.serviceAccount), rendered by Helm's own engine
(helm-python-sdk): off by default; on, one per namespace where models live, with the IRSA annotation, no API
token, valid Kubernetes; a bad name is refused by the values schema."""

from __future__ import annotations

import helm_python as helm  # helm-python-sdk, installed by scripts/setup.sh
import kubernetes_validate
import pytest
import yaml
from support import ROOT

CHART = ROOT / "charts" / "neuronfleet"
ROLE = "arn:aws:iam::111122223333:role/neuronfleet-models"


def accounts(values: dict) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name="nf", namespace="neuronfleet-system", is_install=True)
    docs = [d for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]  # fmt: skip
    return [d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] != "nf-neuronfleet"]


def test_no_compile_service_account_by_default():
    assert accounts({}) == []


def test_one_per_namespace_with_the_role_and_no_api_token():
    on = {"create": True, "name": "model-reader", "annotations": {"eks.amazonaws.com/role-arn": ROLE}}
    (one,) = accounts({"compile": {"serviceAccount": on}})
    assert one["metadata"]["namespace"] == "neuronfleet-system" and one["metadata"]["name"] == "model-reader"
    assert one["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": ROLE}
    assert one["automountServiceAccountToken"] is False
    kubernetes_validate.validate(one, "1.37.0", strict=True)
    watched = {
        "watch": {"mode": "namespaces", "namespaces": ["team-a", "team-b"]},
        "compile": {"serviceAccount": on},
    }
    assert [a["metadata"]["namespace"] for a in accounts(watched)] == ["team-a", "team-b"]
    listed = {"compile": {"serviceAccount": {**on, "namespaces": ["ml"]}}}
    assert [a["metadata"]["namespace"] for a in accounts(listed)] == ["ml"]


@pytest.mark.parametrize("bad", [{"create": True, "name": "Model_Reader"}, {"create": "yes", "name": "a"},
                                 {"create": True, "name": "a", "keys": "no"}])  # fmt: skip
def test_bad_values_are_refused(bad):
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmError):
        chart.validate_schema(chart.merge_values({"compile": {"serviceAccount": bad}}))
