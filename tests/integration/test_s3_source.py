"""Models from S3 against a real S3 API server (moto's server mode, a subprocess on a free loopback port),
through boto3's default credential chain and AWS_ENDPOINT_URL as a pod has them
(runtime/artifacts/s3_source.py, the `neuronfleet fetch-model` and `source-fingerprint` commands,
`neuronfleet compile` of an s3:// model):
- a prefix downloads whole and verified (single-part and multipart ETags), a second run rewrites nothing, a
  changed object is fetched again and a removed one removed;
- a download cut in the middle (a proxy that closes the connection mid-body) fails saying so, and the next
  run resumes where it stopped (the proxy counts the bytes it carries);
- a missing bucket, a missing key (nothing under the prefix) and a permission denied (moto enforcing IAM
  policies) are each a reason in the operator's words (contract.SOURCE_UNAVAILABLE) saying what would fix it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import boto3
import pytest
from s3_server import ALLOW_ALL, KEYS, CuttingProxy, MotoServer
from support import make_tiny_llama, run_neuronfleet

from neuronfleet.contract import SOURCE_UNAVAILABLE, TERMINATION_LOG_ENV, parse_progress
from neuronfleet.runtime.artifacts import s3_source
from neuronfleet.runtime.artifacts.compile_artifacts import SourceUnavailable, compile_artifacts
from neuronfleet.runtime.progress import Reporter

MB = 1 << 20


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def aws(moto, monkeypatch):
    """The test's own process as a pod sees S3: keys in the environment, the endpoint in AWS_ENDPOINT_URL."""
    for name, value in {**KEYS, "AWS_ENDPOINT_URL": moto.url}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    return boto3.client("s3", endpoint_url=moto.url)


@pytest.fixture
def bucket(aws, request):
    name = request.node.name.lower().replace("_", "-")[:50]
    aws.create_bucket(Bucket=name)
    return name


def upload_folder(s3, bucket: str, folder: Path, prefix: str) -> dict[str, bytes]:
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    for rel, data in files.items():
        s3.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=data)
    return files


def upload_multipart(s3, bucket: str, key: str, data: bytes, part: int = 5 * MB) -> str:
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for i, start in enumerate(range(0, len(data), part), 1):
        etag = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=i,
                              Body=data[start : start + part])["ETag"]  # fmt: skip
        parts.append({"PartNumber": i, "ETag": etag})
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
    return s3.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')


def test_a_prefix_downloads_verified_and_a_second_run_rewrites_nothing(aws, bucket, tmp_path):
    files = upload_folder(aws, bucket, make_tiny_llama(tmp_path / "tiny"), "models/tiny")
    big = os.urandom(12 * MB + 123)
    etag = upload_multipart(aws, bucket, "models/tiny/extra/big.bin", big)
    assert etag.endswith("-3")  # a multipart ETag: verified through the part size S3 reports
    aws.put_object(Bucket=bucket, Key="models/tiny-other/not-this.bin", Body=b"x")  # a sibling prefix
    files["extra/big.bin"] = big
    reports = []
    into = tmp_path / "cache" / "sources" / "x"
    got = s3_source.download(f"s3://{bucket}/models/tiny", into, lambda *r: reports.append(r))
    assert got == into
    local = {p.relative_to(into).as_posix(): p.read_bytes() for p in into.rglob("*") if p.is_file()}
    local = {k: v for k, v in local.items() if not k.startswith(".")}
    assert local == files  # every object, nothing of the sibling prefix, no partial files left
    total = sum(len(v) for v in files.values())
    assert reports[-1] == (total, total, len(files), len(files))
    assert [r[0] for r in reports] == sorted(r[0] for r in reports)  # bytes only go up
    stamps = {p: p.stat().st_mtime_ns for p in into.rglob("*") if p.is_file() and not p.name.startswith(".")}

    aws.put_object(Bucket=bucket, Key="models/tiny/config.json", Body=b'{"changed": true}')
    aws.delete_object(Bucket=bucket, Key="models/tiny/extra/big.bin")
    s3_source.download(f"s3://{bucket}/models/tiny", into)
    assert (into / "config.json").read_bytes() == b'{"changed": true}'
    assert not (into / "extra" / "big.bin").exists()  # removed from the bucket: removed here
    for path, stamp in stamps.items():  # every unchanged file was left as it was
        if path.name not in ("config.json", "big.bin"):
            assert path.stat().st_mtime_ns == stamp, path


def test_a_uri_naming_one_object_downloads_that_file(aws, bucket, tmp_path):
    aws.put_object(Bucket=bucket, Key="gguf/model.gguf", Body=b"GGUF" + bytes(1000))
    got = s3_source.download(f"s3://{bucket}/gguf/model.gguf", tmp_path / "into")
    assert got == tmp_path / "into" / "model.gguf" and got.read_bytes() == b"GGUF" + bytes(1000)


def test_a_cut_download_says_so_and_the_next_run_resumes_where_it_stopped(aws, bucket, moto, tmp_path,
                                                                           monkeypatch):  # fmt: skip
    data = os.urandom(8 * MB)
    aws.put_object(Bucket=bucket, Key="m/weights.safetensors", Body=data)
    proxy = CuttingProxy(moto.port)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        proxy.cut(1 * MB)  # every connection closes after 1 MB of response
        into = tmp_path / "into"
        with pytest.raises(s3_source.S3Unavailable) as cut:
            s3_source.download(f"s3://{bucket}/m", into)
        message = str(cut.value)
        start = f"{SOURCE_UNAVAILABLE} s3://{bucket}/m: the download of m/weights.safetensors was cut at "
        assert message.startswith(start), message
        assert f"of {len(data)} bytes" in message and "the next try resumes from there" in message, message
        partial = into / "weights.safetensors.partial"
        kept = partial.stat().st_size
        assert 2 * MB < kept < len(data)  # each of the tries moved it on
        assert not (into / "weights.safetensors").exists()  # never in place unverified

        proxy.heal()
        s3_source.download(f"s3://{bucket}/m", into)
        assert (into / "weights.safetensors").read_bytes() == data
        assert not partial.exists()
        # only the rest came through (plus headers and the listing), not the whole object again
        assert proxy.carried < len(data) - kept + 64 * 1024, (proxy.carried, len(data) - kept)
    finally:
        proxy.close()


def test_a_partial_file_of_another_version_is_started_again(aws, bucket, tmp_path):
    aws.put_object(Bucket=bucket, Key="m/w.bin", Body=b"new" * 1000)
    into = tmp_path / "into"
    into.mkdir()
    (into / "w.bin.partial").write_bytes(b"old" * 500)
    (into / "w.bin.partial.etag").write_text("0123456789abcdef0123456789abcdef")
    s3_source.download(f"s3://{bucket}/m", into)
    assert (into / "w.bin").read_bytes() == b"new" * 1000


def test_a_missing_bucket_is_a_clear_reason(aws, tmp_path):
    with pytest.raises(s3_source.S3Unavailable) as e:
        s3_source.download("s3://no-such-bucket-here/models/x", tmp_path)
    assert str(e.value) == (
        f"{SOURCE_UNAVAILABLE} s3://no-such-bucket-here/models/x: bucket no-such-bucket-here does not exist "
        "(NoSuchBucket); check the bucket name in model.uri"
    )


def test_a_missing_key_is_a_clear_reason(aws, bucket, tmp_path):
    aws.put_object(Bucket=bucket, Key="models/Tiny/config.json", Body=b"{}")
    with pytest.raises(s3_source.S3Unavailable) as e:
        s3_source.download(f"s3://{bucket}/models/tiny", tmp_path)
    message = str(e.value)
    assert message.startswith(f"{SOURCE_UNAVAILABLE} s3://{bucket}/models/tiny: no objects under it"), message
    assert "check the prefix in model.uri (keys are case-sensitive)" in message
    with pytest.raises(s3_source.S3Unavailable, match="no objects under it"):
        s3_source.fingerprint(f"s3://{bucket}/models/tiny")


def test_the_fingerprint_follows_sizes_and_etags(aws, bucket):
    uri = f"s3://{bucket}/m"
    aws.put_object(Bucket=bucket, Key="m/a", Body=b"one")
    first = s3_source.fingerprint(uri)
    assert first.startswith("s3:1:") and s3_source.fingerprint(uri) == first
    aws.put_object(Bucket=bucket, Key="m/a", Body=b"two")  # same size, another ETag
    second = s3_source.fingerprint(uri)
    assert second != first
    aws.put_object(Bucket=bucket, Key="m/b", Body=b"")
    assert s3_source.fingerprint(uri).startswith("s3:2:")


@pytest.fixture(scope="module")
def iam_moto(tmp_path_factory):
    """moto enforcing IAM policies after the 5 requests that create an admin and a reader without any
    permission."""
    server = MotoServer(tmp_path_factory.mktemp("iam") / "moto.log", iam_setup_requests=5)
    admin = server.user("admin", ALLOW_ALL)
    reader = server.user("reader", None)
    s3 = server.client("s3", admin)
    s3.create_bucket(Bucket="models")
    s3.put_object(Bucket="models", Key="tiny/config.json", Body=b"{}")
    yield server, reader
    server.stop()


def test_a_permission_denied_is_a_clear_reason(iam_moto, monkeypatch, tmp_path):
    server, reader = iam_moto
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", reader["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", reader["SecretAccessKey"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with pytest.raises(s3_source.S3Unavailable) as e:
        s3_source.download("s3://models/tiny", tmp_path)
    assert str(e.value) == (
        f"{SOURCE_UNAVAILABLE} s3://models/tiny: access denied (AccessDenied): the compile Job's credentials "
        "need s3:ListBucket on arn:aws:s3:::models and s3:GetObject on arn:aws:s3:::models/tiny* (name the "
        "ServiceAccount whose IAM role allows it in compile.serviceAccountName; with the chart: "
        "compile.serviceAccount.annotations eks.amazonaws.com/role-arn)"
    )


def test_the_commands_fetch_fingerprint_and_leave_the_reason_as_termination_message(aws, bucket, moto,
                                                                                    tmp_path):  # fmt: skip
    aws.put_object(Bucket=bucket, Key="m/config.json", Body=b"{}")
    env = {**os.environ, TERMINATION_LOG_ENV: str(tmp_path / "termination-log")}
    run = run_neuronfleet("fetch-model", "--uri", f"s3://{bucket}/m", "--into", str(tmp_path / "m"), env=env)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "m" / "config.json").read_bytes() == b"{}"
    last = parse_progress(run.stdout)  # the progress lines on stdout, as `neuronfleet compile` writes them
    assert last is not None and last.phase == "download", run.stdout
    assert (last.bytesDone, last.bytesTotal, last.filesDone, last.filesTotal) == (2, 2, 1, 1), run.stdout
    run = run_neuronfleet("source-fingerprint", "--uri", f"s3://{bucket}/m", env=env)
    assert run.returncode == 0 and run.stdout.startswith("s3:1:"), run.stderr
    assert json.loads((tmp_path / "termination-log").read_text()) == {"fingerprint": run.stdout.strip()}

    run = run_neuronfleet("fetch-model", "--uri", f"s3://{bucket}/nothing", "--into", str(tmp_path / "n"),
                          env=env)  # fmt: skip
    assert run.returncode != 0
    message = (tmp_path / "termination-log").read_text()
    assert message.startswith(
        f"neuronfleet fetch-model: {SOURCE_UNAVAILABLE} s3://{bucket}/nothing: no objects"
    )
    run = run_neuronfleet("source-fingerprint", "--uri", f"s3://{bucket}/nothing", env=env)
    assert run.returncode != 0 and SOURCE_UNAVAILABLE in (tmp_path / "termination-log").read_text()


def test_the_embedded_compile_reads_an_s3_model_and_keeps_no_download(aws, bucket, tmp_path):
    upload_folder(aws, bucket, make_tiny_llama(tmp_path / "tiny"), "tiny")
    config = {
        "compileHash": "abc", "engine": "embedded", "model": {"uri": f"s3://{bucket}/tiny"},
        "instanceType": "cpu", "tensorParallel": 1, "batchSize": 2, "sequenceLength": 64,
        "maxInputLength": 48, "dtype": "float32",
    }  # fmt: skip
    (tmp_path / "compile.json").write_text(json.dumps(config))
    cache = tmp_path / "cache"
    seen = []
    sink = type("Sink", (), {"interval": 0.0, "show": lambda self, p, final: seen.append(p)})()
    manifest = compile_artifacts(
        tmp_path / "compile.json", cache / "artifacts" / "abc", log=lambda m: None, progress=Reporter(sink)
    )
    assert manifest["cacheHit"] is False
    download = [p for p in seen if p.phase == "download"]  # the download's bytes and files, as they came
    files = [f for f in (tmp_path / "tiny").rglob("*") if f.is_file()]
    assert download[-1].bytesDone == download[-1].bytesTotal == sum(f.stat().st_size for f in files)
    assert download[-1].filesDone == download[-1].filesTotal == len(files)
    assert (cache / "artifacts" / "abc" / "model" / "config.json").is_file()
    assert (cache / "sources").is_dir()  # it was downloaded there (where a failed compile's next try resumes)
    assert not [p for p in (cache / "sources").rglob("*") if p.is_file()]  # converted: not kept

    aws.put_object(Bucket=bucket, Key="notes/README", Body=b"not a model")
    config["model"]["uri"] = f"s3://{bucket}/notes"
    (tmp_path / "compile.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"neither a Hugging Face model folder nor a \.gguf file"):
        compile_artifacts(tmp_path / "compile.json", cache / "artifacts" / "bad", log=lambda m: None)
    kept = s3_source.cache_folder(cache, config["model"]["uri"])
    assert (kept / "README").read_bytes() == b"not a model"  # a failed compile keeps it: the next try resumes

    config["model"]["uri"] = f"s3://{bucket}/gone"
    (tmp_path / "compile.json").write_text(json.dumps(config))
    with pytest.raises(SourceUnavailable, match=f"^{SOURCE_UNAVAILABLE} s3://{bucket}/gone: no objects"):
        compile_artifacts(tmp_path / "compile.json", cache / "artifacts" / "def", log=lambda m: None)
