"""KV hand-off between prefill and decode pods: a request's KV cache written from one pod into another and
verified (`kv_transfer`), the decode pod's leases on its KV staging regions (`leases`), and the internal
endpoints of the prefill and decode roles (`roles`)."""
