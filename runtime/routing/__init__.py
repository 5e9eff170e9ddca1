"""Routing: the routers, which load no model. Ours in front of prefill and decode pods (`router`), the one in
front of an engine's own prefill and decode servers (`pd_proxy`) speaking vLLM's or SGLang's P/D protocol
(`pd_protocols`), the front door of unified pods of any engine (`front_door`), the requests every router holds
while a model is at zero (`holding`), and the peers each router resolves, probes and ranks (`peers`)."""
