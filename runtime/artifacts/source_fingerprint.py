"""`neuronfleet source-fingerprint`: what a model source is now, in one string, so that the operator can tell
when the source of a failed compile has changed (then it compiles again).

- file:// and pvc:// (mounted at the model mount): a hash of every file's relative path, size and
  modification time (not their bytes: a 100 GB model is not read to notice it was replaced).
- hf://: the Hub's commit sha of the revision (`HfApi.model_info(...).sha`, huggingface_hub), so a moved
  branch or a new upload is a change; the token comes from the environment (the model's Secret).
- s3://: a hash of every listed object's key, size and ETag (runtime/artifacts/s3_source.py; credentials from
  the default chain, the probe Job's ServiceAccount).
A source that cannot be read is `compile_artifacts.SourceUnavailable`, as in the compile.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from neuronfleet.contract import HF_TOKEN_ENVS, MODEL_MOUNT
from neuronfleet.runtime.artifacts.compile_artifacts import CompileError, SourceUnavailable
from neuronfleet.runtime.artifacts.s3_source import S3Unavailable, fingerprint


def local_fingerprint(path: Path) -> str:
    """sha256 of (relative path, size, mtime in ns) of every file under `path` (or of `path` itself)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for f in files:
        stat = f.stat()
        digest.update(
            f"{f.relative_to(path) if f != path else f.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode()
        )
    return f"files:{len(files)}:{digest.hexdigest()[:32]}"


def source_fingerprint(uri: str, revision: str | None = None, model_mount: str = MODEL_MOUNT) -> str:
    if uri.startswith(("file://", "pvc://")):
        if uri.startswith("file://"):
            path = Path(uri.removeprefix("file://"))
        else:
            path = Path(model_mount) / uri.removeprefix("pvc://").split("/", 1)[1]
        if not path.exists():
            raise SourceUnavailable(uri, f"not found at {path}")
        return local_fingerprint(path)
    if uri.startswith("hf://"):
        try:
            from huggingface_hub import HfApi
        except ImportError:
            raise CompileError("hf:// models need huggingface_hub in the runtime image") from None
        try:
            info = HfApi().model_info(
                uri.removeprefix("hf://"), revision=revision, token=os.environ.get(HF_TOKEN_ENVS[0])
            )
        except Exception as e:  # not found, gated, no network: huggingface_hub's errors say which
            raise SourceUnavailable(uri, f"{type(e).__name__}: {e}") from None
        return f"hf:{info.sha}"
    if uri.startswith("s3://"):
        try:
            return fingerprint(uri)
        except S3Unavailable as e:
            raise SourceUnavailable(uri, e.why) from None
    raise CompileError(f"model source {uri} has no fingerprint (file://, pvc://, hf:// and s3:// have)")
