"""The model: the Llama-family weights and forward pass on a static KV cache (`llama`), its import from GGUF
(`gguf_import`, the file's metadata and tensor index read by `gguf_file`), weight-only int8/int4 quantization
(`quantize`), what dtype `auto` is on this machine and for these weights (`dtypes`), the model's shape read
from its config.json (`model_config`), and its loading: safetensors files read into tensors that own their
memory (`weights_file`), the C heap given back while it loads (`heap_returns`) and torch's CPU threads within
the container's quota and affinity (`cpu_threads`). Of the runtime it imports only `progress`."""
