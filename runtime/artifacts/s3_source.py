"""Models from S3: an `s3://bucket/prefix` downloaded into a local folder (the compile cache), resumable and
verified, and its fingerprint (what the listed objects are now), with the AWS SDK for Python (boto3).

- Credentials and endpoint come from boto3's default chain only: in a pod, IRSA or EKS Pod Identity (the
  compile Job's ServiceAccount); AWS_ENDPOINT_URL for an S3-compatible endpoint. Nothing comes from the spec.
- `s3://bucket/prefix` is a folder (every object under `prefix/`) or, when `prefix` is one object's key, that
  object (a .gguf file). Folder markers (keys ending in "/") are skipped.
- Resumable: a file already complete (its size and ETag recorded in `.neuronfleet-s3.json` when it was
  verified) is skipped; a partial one (`NAME.partial`, beside `NAME.partial.etag`) is continued with a Range
  GET that must match the same ETag (If-Match), else started again. Files are renamed into place once
  verified; local files no longer listed are removed.
- Verified: the size, and the ETag: a single-part upload's ETag is the MD5 of the bytes; a multipart upload's
  is MD5(MD5(part 1) + ... + MD5(part n))-n, computed with the part size S3 reports for part 1 (HeadObject
  PartNumber=1); an SSE-KMS object's ETag is no digest, so only its size is checked.
- Failures are `S3Unavailable`, worded as the operator retries them (contract.SOURCE_UNAVAILABLE): a missing
  bucket, no objects under the prefix, access denied, no credentials, an unreachable endpoint, a download cut
  in the middle (the next try resumes), a file whose bytes do not match its ETag (removed: the next try
  downloads it again).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from neuronfleet.contract import SOURCE_UNAVAILABLE

CHUNK = 1 << 20  # bytes per read of a body, and per progress report
STATE_FILE = ".neuronfleet-s3.json"  # key -> {"size", "etag"} of the files verified complete
ATTEMPTS = 3  # tries per file in one run (each one resumes); then the run fails and the operator retries
Progress = Callable[[int, int, int, int], None]  # bytes_done, bytes_total, files_done, files_total


class S3Unavailable(ValueError):
    """The source cannot be read now (missing, denied, unreachable, cut): it may be readable on a later
    try."""

    def __init__(self, uri: str, why: str) -> None:
        self.uri, self.why = uri, why
        super().__init__(f"{SOURCE_UNAVAILABLE} {uri}: {why}")


class S3Corrupt(ValueError):
    """A downloaded object's bytes do not match its size or ETag."""


@dataclass(frozen=True)
class S3Object:
    key: str
    size: int
    etag: str  # without quotes
    path: str  # relative path in the local folder


def parse_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, prefix without a leading or trailing "/")."""
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri} is not an s3:// URI; use s3://bucket/prefix")
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise ValueError(f"{uri} names no bucket; use s3://bucket/prefix")
    return bucket, prefix.strip("/")


def client():
    """An S3 client from the default credential chain (env, IRSA/Pod Identity web identity, instance role)
    and AWS_ENDPOINT_URL when set (botocore reads it itself); botocore's standard retries for requests."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"max_attempts": 5, "mode": "standard"}, connect_timeout=10, read_timeout=60)
    return boto3.session.Session().client("s3", config=config)


def _fix(bucket: str, prefix: str) -> str:
    policy = f"s3:ListBucket on arn:aws:s3:::{bucket} and s3:GetObject on arn:aws:s3:::{bucket}/{prefix}*"
    return (
        f"the compile Job's credentials need {policy} (name the ServiceAccount whose IAM role allows it in "
        "compile.serviceAccountName; with the chart: compile.serviceAccount.annotations "
        "eks.amazonaws.com/role-arn)"
    )


def _explain(uri: str, error: Exception) -> S3Unavailable:
    """boto3's error in the operator's words: what is wrong and what would fix it."""
    from botocore.exceptions import (
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    bucket, prefix = parse_uri(uri)
    if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
        return S3Unavailable(
            uri,
            f"no AWS credentials found ({error}); {_fix(bucket, prefix)}, or set AWS_* in its environment",
        )
    if isinstance(error, EndpointConnectionError):
        return S3Unavailable(uri, f"cannot reach S3: {error}")
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return S3Unavailable(
                uri, f"bucket {bucket} does not exist (NoSuchBucket); check the bucket name in model.uri"
            )
        if code in ("AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                    "ExpiredToken", "InvalidToken") or status == 403:  # fmt: skip
            return S3Unavailable(uri, f"access denied ({code or status}): {_fix(bucket, prefix)}")
        if code in ("NoSuchKey", "404") or status == 404:
            return S3Unavailable(
                uri, f"an object was removed while it was read ({code}); the next try lists again"
            )
        return S3Unavailable(uri, f"S3 answered {code or status}: {error}")
    return S3Unavailable(uri, f"{type(error).__name__}: {error}")


def list_objects(uri: str, s3=None) -> list[S3Object]:
    """The objects the URI names: the one object whose key is the prefix, or every object under `prefix/`
    (the whole bucket for an empty prefix), each with the path it takes in the local folder."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = parse_uri(uri)
    s3 = s3 or client()
    folder = f"{prefix}/" if prefix else ""
    found: list[S3Object] = []
    try:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for item in page.get("Contents", []):
                key = item["Key"]
                if key.endswith("/"):
                    continue  # a folder marker
                etag = item["ETag"].strip('"')
                if key == prefix:  # the URI names one object
                    return [S3Object(key, item["Size"], etag, key.rsplit("/", 1)[-1])]
                if key.startswith(folder):
                    found.append(S3Object(key, item["Size"], etag, key.removeprefix(folder)))
    except (ClientError, BotoCoreError) as e:
        raise _explain(uri, e) from None
    for obj in found:
        parts = obj.path.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise S3Unavailable(uri, f"key {obj.key} cannot be a local file name (empty, . or .. parts)")
    if not found:
        raise S3Unavailable(
            uri, f"no objects under it (NoSuchKey: nothing in bucket {bucket} starts with "
            f"{folder or prefix!r}); check the prefix in model.uri (keys are case-sensitive)",
        )  # fmt: skip
    return found


def fingerprint(uri: str, s3=None) -> str:
    """What the source is now: the hash of every listed key's path, size and ETag (no byte is read)."""
    objects = list_objects(uri, s3)
    digest = hashlib.sha256()
    for obj in sorted(objects, key=lambda o: o.key):
        digest.update(f"{obj.path}\0{obj.size}\0{obj.etag}\n".encode())
    return f"s3:{len(objects)}:{digest.hexdigest()[:32]}"


def _md5_of(path: Path, start: int = 0, length: int | None = None) -> bytes:
    md5 = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        f.seek(start)
        left = length if length is not None else -1
        while left != 0:
            block = f.read(CHUNK if left < 0 else min(CHUNK, left))
            if not block:
                break
            md5.update(block)
            left -= len(block) if left > 0 else 0
    return md5.digest()


def etag_of(path: Path, parts: int, part_size: int) -> str:
    """The ETag S3 gives these bytes: their MD5 for a single-part upload (`parts` 0), else the MD5 of the
    parts' MD5s, "-" and the number of parts."""
    if parts == 0:
        return _md5_of(path).hex()
    digests = b"".join(_md5_of(path, i * part_size, part_size) for i in range(parts))
    return f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{parts}"


def verify(s3, bucket: str, obj: S3Object, path: Path, encryption: str | None) -> None:
    size = path.stat().st_size
    if size != obj.size:
        raise S3Corrupt(f"s3://{bucket}/{obj.key}: {size} bytes downloaded, S3 lists {obj.size}")
    if encryption == "aws:kms" or not obj.etag:
        return  # an SSE-KMS object's ETag is not a digest of its bytes: its size is what can be checked
    parts = int(obj.etag.rsplit("-", 1)[1]) if "-" in obj.etag else 0
    part_size = 0
    if parts:
        head = s3.head_object(Bucket=bucket, Key=obj.key, PartNumber=1)  # its part 1's size
        part_size = int(head["ContentLength"])
    actual = etag_of(path, parts, part_size)
    if actual != obj.etag:
        raise S3Corrupt(
            f"s3://{bucket}/{obj.key}: the downloaded bytes' ETag is {actual}, S3 lists {obj.etag}"
        )


def _read_state(folder: Path) -> dict:
    try:
        return json.loads((folder / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_state(folder: Path, state: dict) -> None:
    tmp = folder / f"{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    tmp.replace(folder / STATE_FILE)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One downloader per folder (two compile Jobs of one source share it)."""
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _fetch_one(s3, uri: str, bucket: str, obj: S3Object, dest: Path, report: Callable[[int], None]) -> None:
    """Download one object into `dest` through `dest.partial`, resuming a partial file of the same ETag."""
    from botocore.exceptions import BotoCoreError, ClientError

    partial = dest.with_name(dest.name + ".partial")
    marker = dest.with_name(dest.name + ".partial.etag")
    if partial.exists() and (not marker.exists() or marker.read_text() != obj.etag):
        partial.unlink()  # a partial file of another version of the object: start again
    marker.write_text(obj.etag)
    encryption = None
    for attempt in range(1, ATTEMPTS + 1):
        have = partial.stat().st_size if partial.exists() else 0
        report(have)
        if have > obj.size:
            partial.unlink()
            have = 0
        try:
            if have < obj.size or obj.size == 0:
                args = {"Bucket": bucket, "Key": obj.key, "IfMatch": f'"{obj.etag}"'}
                if have:
                    args["Range"] = f"bytes={have}-"
                response = s3.get_object(**args)
                encryption = response.get("ServerSideEncryption")
                with partial.open("ab") as out:
                    for block in response["Body"].iter_chunks(CHUNK):
                        out.write(block)
                        have += len(block)
                        report(have)
            break
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") == "PreconditionFailed":
                raise S3Unavailable(uri, f"{obj.key} changed while it was downloaded; the next try starts "
                                    "it again") from None  # fmt: skip
            raise _explain(uri, e) from None
        except (BotoCoreError, OSError) as e:  # the connection cut in the middle of the body, a timeout
            if isinstance(e, OSError) and not isinstance(e, ConnectionError):
                raise  # the local disk: not the source's fault
            if attempt == ATTEMPTS:
                done = partial.stat().st_size if partial.exists() else 0
                raise S3Unavailable(
                    uri, f"the download of {obj.key} was cut at {done} of {obj.size} bytes "
                    f"({type(e).__name__}: {e}) {ATTEMPTS} times; the next try resumes from there",
                ) from None  # fmt: skip
            time.sleep(attempt)  # then resume from what arrived
    partial.touch()
    try:
        verify(s3, bucket, obj, partial, encryption)
    except S3Corrupt as e:
        partial.unlink()  # the next try downloads it whole
        raise S3Unavailable(uri, f"{e}; the next try downloads it again") from None
    except ClientError as e:
        raise _explain(uri, e) from None
    partial.replace(dest)
    marker.unlink(missing_ok=True)


def download(uri: str, into: Path, on_progress: Progress | None = None, s3=None) -> Path:
    """Download the URI into the folder `into` (created) and return the local model: `into` itself, or the
    one file a single-object URI names. Files verified earlier are skipped, partial ones resumed."""
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    s3 = s3 or client()
    bucket, _ = parse_uri(uri)
    with _locked(into):
        objects = list_objects(uri, s3)
        state = _read_state(into)
        state = {k: v for k, v in state.items() if k in {o.path for o in objects}}
        total = sum(o.size for o in objects)
        done_bytes, done_files = 0, 0

        def progress(extra: int = 0) -> None:
            if on_progress is not None:
                on_progress(done_bytes + extra, total, done_files, len(objects))

        for obj in objects:
            dest = into / obj.path
            known = state.get(obj.path)
            complete = known == {"size": obj.size, "etag": obj.etag}
            if not (complete and dest.is_file() and dest.stat().st_size == obj.size):
                state.pop(obj.path, None)
                _write_state(into, state)
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.unlink(missing_ok=True)
                _fetch_one(s3, uri, bucket, obj, dest, progress)
                state[obj.path] = {"size": obj.size, "etag": obj.etag}
                _write_state(into, state)
            done_bytes += obj.size
            done_files += 1
            progress()
        listed = {obj.path for obj in objects}
        for stale in [p for p in into.rglob("*") if p.is_file()]:
            rel = stale.relative_to(into).as_posix()
            if rel not in listed and rel not in (STATE_FILE, ".lock"):
                stale.unlink()  # removed from the bucket, or a partial file of a removed object
    if len(objects) == 1 and objects[0].key == parse_uri(uri)[1]:
        return into / objects[0].path
    return into


def cache_folder(cache_root: Path, uri: str) -> Path:
    """Where a source is downloaded on the compile cache: sources/<sha256 of the URI, 16 hex>/ (the operator
    names the same folder: operator/engines/common.py s3_source_dir)."""
    return Path(cache_root) / "sources" / hashlib.sha256(uri.encode()).hexdigest()[:16]
