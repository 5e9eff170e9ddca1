"""Which transfer agent `--kv-transport` makes: tcp (`kv_transfer.TcpAgent`), nixl (`nixl_transfer.NixlAgent`
with the backend `--kv-nixl-backend` names), efa (NIXL with its LIBFABRIC backend)."""

from __future__ import annotations

from neuronfleet.runtime.kv.kv_transfer import TcpAgent

TRANSPORTS = ("tcp", "nixl", "efa")  # efa: NIXL with its LIBFABRIC backend


def make_agent(
    transport: str, name: str, model_id: str, host: str = "127.0.0.1", backend: str | None = None, **options
):
    """The agent for `--kv-transport` (and `--kv-nixl-backend`); NIXL without what its backend needs fails
    here with what is missing, never falls back to another transport."""
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if transport == "tcp":
        if backend is not None:
            raise ValueError("--kv-nixl-backend is for --kv-transport nixl; tcp has no backend to choose")
        return TcpAgent(name, model_id, host, **options)
    if transport == "efa":
        if backend not in (None, "libfabric"):
            raise ValueError(f"--kv-transport efa is NIXL over LIBFABRIC, not {backend}; use --kv-transport "
                             f"nixl --kv-nixl-backend {backend}")  # fmt: skip
        backend = "libfabric"
    from neuronfleet.runtime.kv.nixl_transfer import NixlAgent  # imports NIXL (and only it does)

    options.pop("advertise", None)  # NIXL's own metadata carries its addresses
    return NixlAgent(name, model_id, backend=backend or "ucx", **options)
