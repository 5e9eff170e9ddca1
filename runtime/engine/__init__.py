"""The engine: continuous batching over static slots, a `Backend`. The step loop and its thread (`engine`),
the scheduler that plans exactly what a step runs and books what it did (`scheduler`) with the prefix reuse it
books (`prefix_cache`), the model runner that runs a planned step (`model_runner`) with its sampler
(`sampler`), the serving settings decided once (`config`), and text out, stop strings included
(`text_output`)."""
