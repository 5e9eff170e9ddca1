"""`kubectl explain` against the emulated API server: it reads /openapi/v3 and prints, as for a real cluster,
a built-in kind's fields and a custom resource's schema as applied (kubectl pkg/explain/v2/templates/
plaintext.tmpl: KIND/VERSION, FIELD, DESCRIPTION wrapped at 76 columns, FIELDS as `name<TAB><type>`
with -required- and enum lines)."""

from __future__ import annotations

import json
import urllib.request

import pytest
import yaml
from support import HTTP_TIMEOUT, ROOT, ApiServer

CRD = ROOT / "crds" / "neuronfleet.dev_neuronmodels.yaml"
CONVENTIONS = "https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    server = ApiServer(tmp_path_factory.mktemp("kubectl-explain"))
    server.kubectl("apply", "-f", str(CRD))
    yield server
    server.stop()


def test_explain_pods_prints_the_kind_and_its_top_level_fields(api):
    out = api.kubectl("explain", "pods").stdout
    expected = f"""\
KIND:       Pod
VERSION:    v1

DESCRIPTION:
    Pod is a collection of containers that can run on a host. This resource is
    created by clients and scheduled onto hosts.
    
FIELDS:
  apiVersion\t<string>
    APIVersion defines the versioned schema of this representation of an object.
    Servers should convert recognized schemas to the latest internal value, and
    may reject unrecognized values. More info:
    {CONVENTIONS}#resources

  kind\t<string>
    Kind is a string value representing the REST resource this object
    represents. Servers may infer this from the endpoint the client submits
    requests to. Cannot be updated. In CamelCase. More info:
    {CONVENTIONS}#types-kinds

  metadata\t<ObjectMeta>
    Standard object's metadata. More info:
    {CONVENTIONS}#metadata

  spec\t<PodSpec>
    Specification of the desired behavior of the pod. More info:
    {CONVENTIONS}#spec-and-status
"""  # noqa: W293  (kubectl indents the description's final empty line)
    assert out.startswith(expected), out
    assert "  status\t<PodStatus>\n" in out


def test_explain_follows_references_into_built_in_types(api):
    out = api.kubectl("explain", "deployment.spec.template.spec.containers").stdout
    assert out.startswith(
        "GROUP:      apps\nKIND:       Deployment\nVERSION:    v1\n\nFIELD: containers <[]Container>\n"
    )
    assert "  image\t<string>\n" in out and "  name\t<string> -required-\n" in out
    out = api.kubectl("explain", "job.spec.selector").stdout
    assert "FIELD: selector <LabelSelector>" in out and "  matchLabels\t<map[string]string>\n" in out


def test_explain_a_custom_resource_field_prints_the_crds_descriptions(api):
    out = api.kubectl("explain", "neuronmodel.spec.neuron").stdout
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    neuron = schema["properties"]["spec"]["properties"]["neuron"]
    assert out.startswith(
        "GROUP:      neuronfleet.dev\nKIND:       NeuronModel\nVERSION:    v1alpha1\n\n"
        "FIELD: neuron <Object>\n"
    ), out
    assert f"DESCRIPTION:\n    {neuron['description']}\n" in out
    for name, field in neuron["properties"].items():  # every field, its type, and its description's words
        kind = {"object": "Object"}.get(field["type"], field["type"])
        required = " -required-" if name in neuron.get("required", []) else ""
        assert f"\n  {name}\t<{kind}>{required}\n" in out, name
        assert " ".join(field["description"].split()[:4]) in " ".join(out.split()), name
    assert "\n  enum: auto, bfloat16, float16, float32\n" in out  # dtype's enum, as kubectl lists it
    top = api.kubectl("explain", "neuronmodels").stdout
    assert "  metadata\t<ObjectMeta>\n" in top and "  spec\t<Object> -required-\n" in top
    # (kubectl wraps a long description at its width: compared word by word)
    assert "DESCRIPTION:\n" in top and " ".join(schema["description"].split()) in " ".join(top.split())


def test_the_openapi_documents_describe_the_crd_as_applied(api):
    request = urllib.request.Request(api.url + "/openapi/v3", headers=api.headers(None))
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT, context=api.context) as r:
        index = json.loads(r.read())["paths"]
    assert {"api/v1", "apis/apps/v1", "apis/batch/v1", "apis/neuronfleet.dev/v1alpha1"} <= set(index)
    request = urllib.request.Request(
        api.url + index["apis/neuronfleet.dev/v1alpha1"]["serverRelativeURL"], headers=api.headers(None)
    )
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT, context=api.context) as r:
        doc = json.loads(r.read())
    schema = doc["components"]["schemas"]["dev.neuronfleet.v1alpha1.NeuronModel"]
    assert schema["x-kubernetes-group-version-kind"] == [
        {"group": "neuronfleet.dev", "kind": "NeuronModel", "version": "v1alpha1"}
    ]
    assert "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta" in doc["components"]["schemas"]
    # a changed CRD is what explain shows next (a new document hash, so kubectl's cache does not answer)
    crd = yaml.safe_load(CRD.read_text())
    neuron = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "neuron"
    ]
    neuron["description"] = "Changed for the test."
    api.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(crd))
    assert "DESCRIPTION:\n    Changed for the test.\n" in api.kubectl("explain", "nm.spec.neuron").stdout
    api.kubectl("apply", "-f", str(CRD))
    # /openapi/v2 as JSON, for clients that ask for it
    request = urllib.request.Request(
        api.url + "/openapi/v2", headers={**api.headers(None), "Accept": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT, context=api.context) as r:
        v2 = json.loads(r.read())
    assert v2["swagger"] == "2.0" and "io.k8s.api.core.v1.Pod" in v2["definitions"]
    assert "dev.neuronfleet.v1alpha1.NeuronModel" in v2["definitions"]
