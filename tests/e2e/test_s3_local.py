"""Models from S3 in local mode (the real operator, kubelet, runtime and `kubectl`), against a real S3 API
server (moto's server mode on a free loopback port, enforcing IAM policies) that the compile pods reach
through AWS_ENDPOINT_URL (a proxy in front of it, which can cut downloads) and the default credential chain
(the access key of a user whose policy denies one bucket), as a pod on EKS reaches S3 with its
ServiceAccount's role:
- the real SmolLM2 GGUF uploaded to a bucket: a NeuronModel with its s3:// URI compiles, becomes Ready and
  answers a chat;
- a missing bucket, a missing key and a denied bucket are each the compile's reason in `kubectl get
  neuronmodel -o yaml` (CompileFailed, `model source unavailable: s3://...: ...` saying what would fix it);
  the missing key is tried again by itself (status.compileRetryAt) and, once the object is uploaded, the model
  becomes Ready with no change to its spec;
- a download cut in the middle is the reason too; once the connection holds, the next try resumes (the proxy
  carries less than the file) and the model becomes Ready."""

from __future__ import annotations

import os

import pytest
import yaml
from s3_server import ALLOW_ALL, CuttingProxy, MotoServer, env_of
from support import ROOT, chat, local_mode

from neuronfleet.contract import model_cache_folder
from neuronfleet.runtime.model.gguf_import import default_gguf_path

SAMPLE = ROOT / "crds" / "samples" / "smollm2-135m-local-cpu.yaml"
GGUF = default_gguf_path()
MB = 1 << 20
DENY_PRIVATE = {"Version": "2012-10-17", "Statement": [
    *ALLOW_ALL["Statement"],
    {"Effect": "Deny", "Action": "s3:*", "Resource": ["arn:aws:s3:::private", "arn:aws:s3:::private/*"]},
]}  # fmt: skip

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto enforcing IAM after the 6 requests that make an admin and the compile's user; the buckets."""
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log", iam_setup_requests=6)
    proxy = CuttingProxy(server.port)
    try:
        admin = server.client("s3", server.user("admin", ALLOW_ALL))
        compile_key = server.user("compile", DENY_PRIVATE)
        for bucket in ("models", "private", "cut-bucket"):
            admin.create_bucket(Bucket=bucket)
        for bucket, key in (("models", "smollm2/smollm2-135m-instruct.gguf"), ("private", "smollm2.gguf"),
                            ("cut-bucket", "smollm2.gguf")):  # fmt: skip
            admin.upload_file(str(GGUF), bucket, key)
        yield admin, proxy, env_of(proxy.url, compile_key)
    finally:
        proxy.close()
        server.stop()


@pytest.fixture(scope="module")
def local(s3, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3[2])  # what every pod of the local kubelet inherits
    with local_mode(tmp_path_factory.mktemp("local"), env=env) as cluster:
        yield cluster


def apply(local, name: str, uri: str) -> None:
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"]["model"]["uri"] = uri
    local.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))


def condition(model: dict, type_: str) -> dict:
    return next((c for c in (model.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def test_a_missing_bucket_a_missing_key_and_a_denied_bucket_are_the_reason_in_the_models_status(local):
    apply(local, "no-bucket", "s3://no-such-bucket/smollm2.gguf")
    apply(local, "s3-later", "s3://models/later/smollm2.gguf")
    apply(local, "denied", "s3://private/smollm2.gguf")
    for name in ("no-bucket", "s3-later", "denied"):
        model = lambda n=name: local.get("nm", n)  # noqa: E731
        local.wait(f"{name} CompileFailed", lambda m=model: condition(m(), "Compiled").get("reason")
                   == "CompileFailed")  # fmt: skip

    def said(name: str) -> str:
        """The Compiled condition's message, as `kubectl get -o yaml` shows it (parsed: YAML quotes it as
        it likes)."""
        shown = yaml.safe_load(local.kubectl("get", "neuronmodel", name, "-o", "yaml").stdout)
        return " ".join(condition(shown, "Compiled")["message"].split())

    assert (
        "model source unavailable: s3://no-such-bucket/smollm2.gguf: bucket no-such-bucket does not exist "
        "(NoSuchBucket); check the bucket name in model.uri" in said("no-bucket")
    ), said("no-bucket")
    assert "model source unavailable: s3://models/later/smollm2.gguf: no objects under it" in said("s3-later")
    assert (
        "model source unavailable: s3://private/smollm2.gguf: access denied (AccessDenied): the compile "
        "Job's credentials need s3:ListBucket on arn:aws:s3:::private and s3:GetObject on "
        "arn:aws:s3:::private/smollm2.gguf*" in said("denied")
    ), said("denied")
    later = local.get("nm", "s3-later")
    assert later["status"]["phase"] == "Failed" and later["status"]["compileRetryAt"], later["status"]


def test_an_s3_model_becomes_ready_and_answers(local):
    apply(local, "from-s3", "s3://models/smollm2/smollm2-135m-instruct.gguf")
    model = lambda: local.get("nm", "from-s3")  # noqa: E731
    local.wait("from-s3 Ready", lambda: (model().get("status") or {}).get("phase") == "Ready")
    assert chat(model()["status"]["endpoint"], "from-s3", 4)[1]
    claim = local.get("pvc", "-l", "neuronfleet.dev/model=from-s3")["items"][0]["metadata"]["name"]
    sources = local.state / "node" / "volumes" / "default" / claim / model_cache_folder("from-s3") / "sources"
    assert sources.is_dir() and not [p for p in sources.rglob("*") if p.is_file()]  # converted: not kept
    local.kubectl("delete", "neuronmodel", "from-s3")  # (one serving pod fewer on this small machine)


def test_a_missing_key_is_tried_again_and_ready_once_uploaded(local, s3):
    client = s3[0]
    model = lambda: local.get("nm", "s3-later")  # noqa: E731
    local.wait(
        "s3-later CompileFailed", lambda: condition(model(), "Compiled").get("reason") == "CompileFailed"
    )
    client.upload_file(str(GGUF), "models", "later/smollm2.gguf")
    local.wait("s3-later Ready with no change", lambda: (model().get("status") or {}).get("phase") == "Ready")
    assert model()["metadata"]["generation"] == 1
    assert chat(model()["status"]["endpoint"], "s3-later", 4)[1]


def test_a_cut_download_is_the_reason_and_the_next_try_resumes(local, s3):
    proxy = s3[1]
    size = GGUF.stat().st_size
    proxy.cut(8 * MB, marker=b"GET /cut-bucket/smollm2.gguf")  # each GET of the object closes after 8 MB
    apply(local, "s3-cut", "s3://cut-bucket/smollm2.gguf")
    model = lambda: local.get("nm", "s3-cut")  # noqa: E731
    local.wait(
        "s3-cut CompileFailed", lambda: condition(model(), "Compiled").get("reason") == "CompileFailed"
    )
    text = " ".join(local.kubectl("get", "neuronmodel", "s3-cut", "-o", "yaml").stdout.split())
    assert (
        "model source unavailable: s3://cut-bucket/smollm2.gguf: the download of smollm2.gguf was cut at "
        in text
    )
    assert f"of {size} bytes" in text and "the next try resumes from there" in text, text
    assert model()["status"]["compileRetryAt"]

    proxy.heal()  # the connection holds from here on
    local.wait("s3-cut Ready with no change", lambda: (model().get("status") or {}).get("phase") == "Ready")
    assert model()["metadata"]["generation"] == 1
    assert proxy.carried < size - 16 * MB, (proxy.carried, size)  # resumed: not the whole file again
    assert chat(model()["status"]["endpoint"], "s3-cut", 4)[1]
