"""Artifacts: the compile (`neuronfleet compile`, a model source turned once into artifacts on the compile
cache, `compile_artifacts`) and model sources (an `s3://` model downloaded resumable and verified,
`s3_source`; what a source is now, `source_fingerprint`)."""
