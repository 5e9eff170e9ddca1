"""kubectl's client-side validation against the emulated API server. kubectl v1.32 still validates a
`kind: List` on the client (kubectl pkg/validation/schema.go: server-side fieldValidation is checked per kind
from /openapi/v3, and List is no kind the server serves), against /openapi/v2, which it asks for in protobuf.
What it prints is kubectl's own: kube-openapi pkg/util/proto/validation/errors.go formats
`ValidationError(<kind>.<path>): unknown field "<f>" in <definition>`, the definition named as the real server
names it (io.k8s.api.core.v1.ConfigMap; a CRD's group reversed: dev.neuronfleet.v1alpha1.NeuronModel)."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request

import pytest
import yaml
from support import HTTP_TIMEOUT, ROOT, ApiServer

CRD = ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml"
SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
STOP = "; if you choose to ignore these errors, turn validation off with --validate=false\n"
PROTOBUF = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"  # what client-go asks for


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = ApiServer(tmp_path_factory.mktemp("kubectl-validate"))
    server.kubectl("apply", "-f", str(CRD))
    yield server
    server.stop()


def configmap(name: str, **extra) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"k": name}, **extra}


def neuronmodel(name: str) -> dict:
    model = next(d for d in yaml.safe_load_all(SAMPLE.read_text()) if d and d["kind"] == "NeuronModel")
    model = copy.deepcopy(model)
    model["metadata"] = {"name": name, "namespace": "default"}
    return model


def list_file(tmp_path, *items: dict):
    path = tmp_path / "list.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": list(items)}))
    return path


def test_a_list_of_configmaps_applies(api, tmp_path):
    path = list_file(tmp_path, configmap("first"), configmap("second"))
    assert (
        api.kubectl("apply", "-f", str(path)).stdout == "configmap/first created\nconfigmap/second created\n"
    )
    assert api.kubectl.get("cm", "second")["data"] == {"k": "second"}
    assert api.kubectl("apply", "-f", str(path)).stdout == (
        "configmap/first unchanged\nconfigmap/second unchanged\n"
    )


def test_a_list_holding_a_neuronmodel_applies(api, tmp_path):
    path = list_file(tmp_path, configmap("settings"), neuronmodel("listed"))
    out = api.kubectl("apply", "-f", str(path)).stdout
    assert out == "configmap/settings created\nneuronmodel.neuronfleet.dev/listed created\n"
    assert api.kubectl.get("neuronmodel", "listed")["spec"]["neuron"]["batchSize"] == 4


def with_bogus_spec(name: str) -> dict:
    model = neuronmodel(name)
    model["spec"]["bogus"] = 1
    return model


def without_spec(name: str) -> dict:
    model = neuronmodel(name)
    del model["spec"]
    return model


@pytest.mark.parametrize(
    ("item", "error"),
    [
        (
            configmap("typo", datta={"x": "1"}),
            'ValidationError(ConfigMap): unknown field "datta" in io.k8s.api.core.v1.ConfigMap',
        ),
        (
            configmap("typo-meta", metadata={"name": "typo-meta", "lables": {"a": "b"}}),
            'ValidationError(ConfigMap.metadata): unknown field "lables" in '
            "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
        ),
        (
            with_bogus_spec("bogus"),
            'ValidationError(NeuronModel.spec): unknown field "bogus" in '
            "dev.neuronfleet.v1alpha1.NeuronModel.spec",
        ),
        (
            without_spec("nospec"),
            'ValidationError(NeuronModel): missing required field "spec" in '
            "dev.neuronfleet.v1alpha1.NeuronModel",
        ),
    ],
)
def test_a_bad_item_in_a_list_is_refused_before_anything_is_applied(api, tmp_path, item, error):
    path = list_file(tmp_path, configmap("before-" + item["metadata"]["name"]), item)
    run = api.kubectl("apply", "-f", str(path), check=False)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr == f'error: error validating "{path}": error validating data: {error}{STOP}'
    assert api.kubectl.get("cm", "before-" + item["metadata"]["name"]) is None  # nothing was sent


def test_validate_false_still_applies_the_list_and_the_server_drops_the_unknown_field(api, tmp_path):
    path = list_file(tmp_path, configmap("lenient"), with_bogus_spec("lenient"))
    out = api.kubectl("apply", "--validate=false", "-f", str(path)).stdout
    assert out == "configmap/lenient created\nneuronmodel.neuronfleet.dev/lenient created\n"
    spec = api.kubectl.get("neuronmodel", "lenient")["spec"]
    assert "bogus" not in spec and spec["neuron"]["batchSize"] == 4  # pruned, as fieldValidation=Ignore does


def test_a_single_object_is_still_validated_by_the_server(api, tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(with_bogus_spec("single")))
    run = api.kubectl("apply", "-f", str(path), check=False)
    assert run.returncode == 1 and "error validating data" not in run.stderr  # not kubectl's client side
    assert 'unknown field "spec.bogus"' in run.stderr and "error when creating" in run.stderr


def test_a_changed_crd_is_what_the_next_validation_reads(api, tmp_path):
    path = list_file(tmp_path, with_bogus_spec("grown"))
    assert api.kubectl("apply", "-f", str(path), check=False).returncode == 1  # also fills kubectl's cache
    crd = yaml.safe_load(CRD.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["bogus"] = {"type": "integer", "description": "Added for the test."}
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(crd))
    try:
        out = api.kubectl("apply", "-f", str(path)).stdout
        assert out == "neuronmodel.neuronfleet.dev/grown created\n"
    finally:
        api.kubectl("apply", "-f", str(CRD))
    run = api.kubectl("apply", "-f", str(path), check=False)
    assert run.returncode == 1 and 'unknown field "bogus"' in run.stderr


def fetch(api, headers: dict) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(api.url + "/openapi/v2", headers={**api.headers(None), **headers})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT, context=api.context) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_openapi_v2_is_served_as_the_real_handler_serves_it(api):
    status, headers, body = fetch(api, {"Accept": PROTOBUF})
    assert (
        status == 200
        and headers["Content-Type"] == "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"
    )
    assert body[:2] == b"\x0a\x03" and body[2:5] == b"2.0"  # Document.swagger (field 1) = "2.0"
    etag = headers["ETag"]
    assert etag.startswith('"') and len(etag) == 130 and headers["Vary"] == "Accept"  # a quoted SHA-512
    status, headers, body = fetch(api, {"Accept": PROTOBUF, "If-None-Match": etag})
    assert (status, body, headers["ETag"]) == (304, b"", etag)
    status, headers, body = fetch(api, {"Accept": "application/json"})
    assert status == 200 and headers["Content-Type"] == "application/json" and headers["ETag"] == etag
    assert json.loads(body)["definitions"]["io.k8s.api.core.v1.ConfigMap"]["x-kubernetes-group-version-kind"]
    status, _, body = fetch(api, {"Accept": "text/html"})
    assert status == 406 and json.loads(body)["reason"] == "NotAcceptable"


def test_explain_from_openapi_v2_reads_the_protobuf_document(api):
    out = api.kubectl("explain", "--output", "plaintext-openapiv2", "neuronmodel.spec.neuron").stdout
    assert out.startswith(
        "KIND:     NeuronModel\nVERSION:  neuronfleet.dev/v1alpha1\n\nRESOURCE: neuron <Object>\n"
    )
    assert "   instanceType\t<string> -required-\n" in out and "   batchSize\t<integer>\n" in out
    out = api.kubectl("explain", "--output", "plaintext-openapiv2", "configmap.metadata").stdout
    assert "RESOURCE: metadata <Object>\n" in out  # kubectl's v2 explain names every kind Object
    assert "   labels\t<map[string]string>\n" in out and "   ownerReferences\t<[]Object>\n" in out
