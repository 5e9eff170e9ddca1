"""The embedded inference runtime, in parts that import only downwards (.importlinter, `runtime_layers`):

- `assemble`: what `neuronfleet serve` puts together for its role and runs until SIGTERM;
- `routing` (the routers, which load no model), `kv` (the KV hand-off between prefill and decode pods) and
  `artifacts` (the compile and model sources), independent of each other;
- `engine`: continuous batching over static slots, a serving backend;
- `serving`: the HTTP API over any backend (request parsing, the Backend protocol, errors, the server);
- `model`: the Llama-family model, its import from GGUF, quantization, dtypes, loading;
- `progress`: a compile's or an import's progress (standard library only).
"""
