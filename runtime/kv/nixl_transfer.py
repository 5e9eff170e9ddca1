"""KV transfer over NIXL (ai-dynamo/nixl), the library vLLM's NixlConnector, SGLang and the vLLM Neuron
plugin move KV caches with. The only module that imports it: PyPI `nixl-cu12==1.5.1`, import name `nixl_cu12`
(or `nixl` where the meta package is installed), the extra `neuronfleet[nixl]`. Backends: UCX (any network;
between processes of one machine it picks shared memory) and LIBFABRIC (EFA; what it loads:
`LIBFABRIC_PLUGIN_NEEDS`).

The decode pod reads (docs/disaggregation.md says why and what it costs). The prefill pod's engine exports a
request's keys and values into memory this agent registered once (`export_buffer`, a pool: `_lend` says
why); for each layer the prefill pod sends the decode pod's agent a NIXL notification `pull` that describes
the write as the tcp path's header does (receiver
identity, model, region, offset, dtype, shape) and where to read it; then, while the decode pod reads, it
hashes them (XXH3-64) and sends the checksums (`sums`). The decode pod checks each pull (`AgentBase.check`),
reads the bytes into the leased region with NIXL READs (a few layers each), hashes them, and once it has the
writer's checksum answers with a notification `ack` (ok, or why not); a verified write is notified to the
decode role as `<request>:<layer>`, as over tcp.
The decode pod's memory is thus only ever written by reads it started under a live lease: a late or stalled
writer can never land bytes in a region another request holds since.

One thread per agent makes the NIXL calls of transfers and notifications (NIXL's own progress thread spins a
whole core, so it is off; the event loop posts what to send, never waiting for NIXL, which may take a minute
to connect): it polls notifications and transfers every millisecond, every 0.1 ms while transfers are in
flight, at once when something is posted; a second thread hashes (what a decode pod read, what a prefill pod
offered).

Faults for tests (docs/testing.md): where `NEURONFLEET_KV_FAULT_FILE` is set, the first agent that can take
the fault written in that file takes it, once (the file is renamed): `flip` (a prefill pod flips a byte after
hashing), `kill` (a prefill pod dies after its first pull), `stall` (a decode pod's read never completes),
`cut` (a decode pod's connection to the writer breaks before it reads: over UCX it drops the writer, over
LIBFABRIC, whose connections only both ends can make again, its read fails), `die` (a decode pod dies on a
pull).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import ctypes
import ctypes.util
import hmac
import itertools
import json
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from neuronfleet.runtime.kv.kv_transfer import (
    AgentBase,
    Descriptor,
    Region,
    Transfer,
    TransportUnavailable,
    checksum_tag,
    tensor_bytes,
    write_mac,
)

log = logging.getLogger(__name__)

PACKAGE = "nixl-cu12==1.5.1"  # pyproject's extra `nixl`
BACKENDS = {"ucx": "UCX", "libfabric": "LIBFABRIC"}  # --kv-nixl-backend -> NIXL's plugin name
# what NIXL 1.5.1's LIBFABRIC plugin (nixl_cu12.libs/nixl/libplugin_LIBFABRIC.so) needs besides NIXL's own
# libraries, read off the plugin (readelf -d, objdump -T): libfabric's ABI FABRIC_1.10 (fi_getinfo,
# fi_dupinfo, fi_freeinfo), which libfabric's main branch added in August 2026, after its release 2.6.0
# (ofiwg/libfabric, libfabric.map.in; AWS's EFA installer 1.51.0 ships libfabric 2.7.0amzn2.0, 1.50.0 2.6.0:
# docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-changelog.html); libhwloc.so.15; libcudart.so.12; and
# libcuda.so.1, of which it calls cuCtxSetCurrent, cuDeviceGetPCIBusId and cuPointerGetAttributes only for
# GPU memory, so a stub serves where there is no CUDA driver (the vLLM Neuron DLC of SDK 2.34 builds one:
# aws-neuron/deep-learning-containers, vllm/inference/0.24.0.1.1.0/Dockerfile.neuronx). Where each comes from,
# for start-up's message:
LIBFABRIC_PLUGIN_NEEDS = {
    "FABRIC_1.10": "a libfabric newer than 2.6.0 (AWS's EFA installer 1.51.0 or later puts libfabric 2.7 in "
    "/opt/amazon/efa)",
    "libfabric.so.1": "AWS's EFA userspace (the EFA installer puts libfabric in /opt/amazon/efa)",
    "libhwloc.so.15": "hwloc 2 (Debian and Ubuntu: libhwloc15)",
    "libcudart.so.12": "pip's nvidia-cuda-runtime-cu12",
    "libcuda.so.1": "a stub where there is no CUDA driver (docs/disaggregation.md)",
}
FAULT_FILE_ENV = "NEURONFLEET_KV_FAULT_FILE"
POLL_IDLE, POLL_BUSY = 0.001, 0.0001  # seconds between polls of NIXL
READ_BATCH = 2  # layers per READ: small enough that hashing one overlaps reading the next
# READs from one writer in flight at once, the others waiting their turn: all at once, UCX moves them side by
# side and they end together, so that the hashing of none overlaps the reading of another (measured: a
# 47 MB hand-off in about 20 ms with 2, 24 with all 15). Per writer: a stalled one holds up only its own.
READ_WINDOW = 2


def _nixl_api():
    """NIXL's Python API, or TransportUnavailable saying how to install it."""
    try:
        from nixl_cu12 import _api
    except ImportError:
        try:
            from nixl import _api
        except ImportError:
            raise TransportUnavailable(
                f"--kv-transport nixl needs NIXL: pip install 'neuronfleet[nixl]' ({PACKAGE}, in the runtime "
                "images); it is not installed here. Or use --kv-transport tcp"
            ) from None
    return _api


def libfabric_version() -> tuple[int, int] | None:
    """The loadable libfabric's (major, minor) (its fi_version()), None when there is none."""
    for name in (ctypes.util.find_library("fabric"), "libfabric.so.1", "/opt/amazon/efa/lib/libfabric.so.1"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.fi_version.restype = ctypes.c_uint32
        version = lib.fi_version()
        return version >> 16, version & 0xFFFF
    return None


def libfabric_problem() -> str:
    """Why NIXL's LIBFABRIC backend cannot start here ("" when it can try): no libfabric, or the plugin does
    not load (the loader names the first library or symbol version it cannot find, as it would for NIXL)."""
    version = libfabric_version()
    if version is None:
        return (
            "--kv-nixl-backend libfabric (and --kv-transport efa) needs libfabric (libfabric.so.1): none is "
            f"installed. On EFA instances install {LIBFABRIC_PLUGIN_NEEDS['FABRIC_1.10']} in the image and "
            "run the pod with its EFA devices; elsewhere use --kv-nixl-backend ucx"
        )
    plugin = libfabric_plugin()
    if plugin is None:  # not where the wheel puts it: NIXL's own answer, when it tries, says more
        return ""
    try:
        ctypes.CDLL(plugin)
    except OSError as e:
        return f"NIXL's LIBFABRIC plugin does not load here: {e}" + plugin_load_hint(str(e), version)
    return ""


def libfabric_plugin() -> str | None:
    """The LIBFABRIC plugin NIXL loads: from $NIXL_PLUGIN_DIR, else the one the wheel carries."""
    try:
        import nixl_cu12
    except ImportError:
        return None
    folders = [os.environ.get("NIXL_PLUGIN_DIR", ""), f"{os.path.dirname(nixl_cu12.__file__)}.libs/nixl"]
    paths = [os.path.join(folder, "libplugin_LIBFABRIC.so") for folder in folders if folder]
    return next((path for path in paths if os.path.exists(path)), None)


def plugin_load_hint(error: str, libfabric: tuple[int, int]) -> str:
    """What provides what the loader's `error` says is missing ("" when it names nothing we know)."""
    for need, source in LIBFABRIC_PLUGIN_NEEDS.items():
        if f"`{need}'" in error or error.startswith(f"{need}:"):
            if need == "FABRIC_1.10":
                installed = ".".join(map(str, libfabric))
                return f": the libfabric installed, {installed}, is too old; install {source}"
            return f": {need} comes from {source}"
    return ""


@dataclass(eq=False)
class _Outgoing:
    """A pull this agent asked a receiver for: its handle, and the registered memory the receiver reads."""

    transfer: Transfer
    source: _Export  # the registered memory the receiver reads
    remote: str
    loop: asyncio.AbstractEventLoop
    free_after: float = 0.0  # abandoned: registered still (a read may be on its way) until then


@dataclass(eq=False)
class _Export:
    """A buffer of the memory a prefill pod offers: registered with NIXL once, kept for the agent's life, and
    lent to one export at a time (its holds: the prefill role's, and one per pull not yet settled)."""

    buffer: torch.Tensor  # uint8
    holds: int = 0

    def holds_range(self, start: int, nbytes: int) -> bool:
        first = self.buffer.data_ptr()
        return first <= start and start + nbytes <= first + self.buffer.numel()


@dataclass(eq=False)
class _Verified:
    """A layer read and hashed, waiting for its writer's checksum (or the checksum, waiting for the layer)."""

    pull: dict[str, Any] | None = None
    region: Region | None = None
    digest: int | None = None  # of the bytes read
    expected: int | None = None  # the writer's
    tag: str = ""  # the writer's HMAC of its checksum under the lease key (`checksum_tag`)
    since: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Incoming:
    """One READ this agent makes for the pulls a writer had offered when it looked (their regions pinned)."""

    writer: str
    pulls: list[tuple[dict[str, Any], Region]]
    handle: Any
    deadline: float
    stalled: bool = False


class NixlAgent(AgentBase):
    """A transfer agent over NIXL with the TcpAgent's interface: receivers `register_memory` and `start`,
    writers `write_nowait` to a receiver's `metadata()`; notifications and checks are the same."""

    transport_name = "nixl"

    def __init__(
        self,
        name: str,
        model_id: str,
        backend: str = "ucx",
        stall_seconds: float = 30.0,
        *,
        secret: bytes | str,
    ) -> None:
        """`stall_seconds`: how long a read may take before the receiver gives it up (and answers so);
        `secret`: the model's (every pull and checksum carries an HMAC under its lease's key, and the metadata
        NIXL needs to read a writer's memory travels only in those pulls and in the authenticated reserve
        answer)."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown NIXL backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        super().__init__(name, model_id, secret=secret, stall_seconds=stall_seconds)
        self.backend = backend
        api = _nixl_api()
        if backend == "libfabric" and (problem := libfabric_problem()):
            raise TransportUnavailable(problem)
        config = api.nixl_agent_config(enable_prog_thread=False, backends=[BACKENDS[backend]])
        try:
            self._nixl = api.nixl_agent(name, config)
        except Exception as e:
            raise TransportUnavailable(f"NIXL could not start an agent: {e}") from None
        if BACKENDS[backend] not in self._nixl.backends:
            raise TransportUnavailable(
                f"NIXL's {BACKENDS[backend]} backend did not start here (plugins found: "
                f"{', '.join(self._nixl.plugin_list) or 'none'})"
            )
        # every NIXL call holds it (the agent is made without locks). The event loop never waits for it once
        # the memory is registered (a NIXL call on the agent's thread may wait a minute for a connection)
        self._nixl_lock = threading.Lock()
        self._pool_lock = threading.Lock()  # the export pool's holds
        self._metadata = ""
        self._registered: dict[int, int] = {}  # NIXL-registered memory: start address -> bytes
        self._remotes: dict[str, str] = {}  # agents whose metadata NIXL holds: name -> that metadata
        self._names: dict[str, str] = {}  # metadata -> the agent it names
        self._outgoing: dict[str, _Outgoing] = {}
        self._incoming: list[_Incoming] = []
        self._queued: list[tuple[str, list[tuple[dict[str, Any], Region]], bool, bool]] = []  # reads to start
        self._cancelling: list[_Incoming] = []  # given up, but NIXL could not cancel yet: region kept pinned
        self._exports: list[_Export] = []  # the memory this agent offers (a pool: see `_lend`)
        # offered this turn, checksum not sent yet: (receiver's metadata, pull id, bytes, flipped digest, the
        # lease key and the pull's mac, which the checksum's tag is made with)
        self._unhashed: list[tuple[str, str, memoryview, int | None, bytes, str]] = []
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # notifications for the agent's thread to send
        self._wake = threading.Event()  # something for the agent's thread to do now
        # LIBFABRIC's connections are made by both ends together (each waits for the other's handshake): one
        # end that dropped a live peer would wait for it in vain, so only UCX drops peers after a failure
        self._drops_peers = backend == "ucx"
        self._to_hash: queue.SimpleQueue = queue.SimpleQueue()  # for the hashing thread: reads done, sums
        self._hashed: queue.SimpleQueue = queue.SimpleQueue()  # and what it hashed
        self._hashing = 0  # reads handed to the hashing thread and not judged yet (the agent's thread counts)
        self._verifying: dict[tuple[str, str], _Verified] = {}  # (writer, pull id) -> read or checksum
        self.unproven = 0  # pulls dropped for not proving the model's secret
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-nixl-{name}", daemon=True)
        self._thread.start()
        threading.Thread(target=self._hash, name=f"kv-nixl-hash-{name}", daemon=True).start()

    # ---- memory ----

    def _register(self, tensor: torch.Tensor) -> None:
        """Register the memory under `tensor` with NIXL once (its whole storage: the staging pool's
        regions are views of a few tensors, allocated at start-up)."""
        storage = tensor.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
        if self._registered_at(start, nbytes):  # (a lease's region: registered with the pool at start-up)
            return
        with self._nixl_lock:
            if not self._registered_at(start, nbytes):
                self._nixl.register_memory([(start, nbytes, 0, "")], "DRAM")
                self._registered[start] = nbytes
                self._renew_metadata()

    def _registered_at(self, start: int, nbytes: int) -> bool:
        return any(s <= start and start + nbytes <= s + n for s, n in list(self._registered.items()))

    def _renew_metadata(self) -> None:
        """After a registration (with `_nixl_lock` held): a reader of this agent's memory needs it."""
        self._metadata = base64.b64encode(self._nixl.get_agent_metadata()).decode()

    def prepare(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            self._register(tensor)

    def register_memory(self, name: str, tensor: torch.Tensor, key: bytes) -> dict[str, Any]:
        self._register(tensor)
        return super().register_memory(name, tensor, key)

    def _md(self) -> str:
        """This agent's NIXL metadata (base64), made again at each registration."""
        if not self._metadata:
            with self._nixl_lock:
                if not self._metadata:
                    self._renew_metadata()
        return self._metadata

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "backend": self.backend, "nixl": self._md()}

    async def start(self, port: int = 0) -> int:
        """Notifications reach the event loop from here on (the port is NIXL's own business: 0)."""
        self._loop = asyncio.get_running_loop()
        return 0

    async def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        self._to_hash.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 5)

    # ---- writing (the prefill pod) ----

    def _lend(self, nbytes: int) -> _Export:
        """A free buffer of the pool for `nbytes`, held once; a new one (registered now) when none fits.

        Why a pool: NIXL's peers keep the first registration they loaded at an address (a newer one at the
        same address is not taken: nixlRemoteSection::addDescList), so memory registered per request, freed,
        and allocated again at the same address would be read with a stale registration (seen over
        LIBFABRIC: reads canceled). A buffer is therefore registered once and never freed; the pool grows to
        the most memory a pod's exports held at once. Sizes are powers of two (at least 1 MiB), so that
        exports of different lengths share buffers."""
        with self._pool_lock:
            fits = [e for e in self._exports if not e.holds and e.buffer.numel() >= nbytes]
            export = min(fits, key=lambda e: e.buffer.numel(), default=None)
            if export is not None:
                export.holds += 1
                return export
        size = 1 << max(20, (max(nbytes, 1) - 1).bit_length())
        export = _Export(torch.empty(size, dtype=torch.uint8), holds=1)
        self._register(export.buffer)  # (the pool grows while the prefill pod warms up, then no more)
        with self._pool_lock:
            self._exports.append(export)
        return export

    def export_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return self._lend(nbytes).buffer[:nbytes].view(dtype).view(shape)

    def release_export(self, tensor: torch.Tensor) -> None:
        self._withdraw(self._export_of(tensor.data_ptr(), tensor.nbytes))

    def _export_of(self, start: int, nbytes: int) -> _Export | None:
        with self._pool_lock:
            return next((e for e in self._exports if e.holds_range(start, nbytes)), None)

    def _offer(self, src: torch.Tensor) -> tuple[_Export, torch.Tensor]:
        """The registered memory the receiver will read `src` from, held until the pull settles: `src` itself
        where it lies in a buffer of the pool (an `export_buffer`), else a copy of it in one."""
        nbytes = src.nbytes
        export = self._export_of(src.data_ptr(), nbytes)
        if export is not None:
            with self._pool_lock:
                export.holds += 1
            return export, src
        export = self._lend(nbytes)
        copy = export.buffer[:nbytes].view(src.dtype).view(src.shape)
        copy.copy_(src)
        return export, copy

    def _withdraw(self, export: _Export | None) -> None:
        if export is not None:
            with self._pool_lock:
                export.holds -= 1

    def write_nowait(
        self, remote: dict[str, Any], src: torch.Tensor, dst: Descriptor, notification: str
    ) -> Transfer:
        """Offer `src` to the receiver, which reads it into its region at `dst`; the handle is done when the
        receiver has verified the bytes."""
        transfer = Transfer(nbytes=len(tensor_bytes(src)))  # (a contiguous CPU tensor, or ValueError)
        if mismatch := self.transport_mismatch(remote):
            transfer.finish(mismatch, integrity=True)
            return transfer
        self._loop = self._loop or asyncio.get_running_loop()
        source, src = self._offer(src)
        payload = tensor_bytes(src)
        flipped = None
        if _take_fault({"flip"}) and len(payload):  # hashed as it was, then a byte flipped
            flipped = xxhash.xxh3_64_intdigest(payload)
            payload[len(payload) // 2] ^= 0xFF
        pull_id = f"{self.name}/{next(self._ids)}"
        # the receiver reads this agent's memory: it needs the registrations (`md`), signed with the rest
        pull = self.write_header(remote, src, dst, notification, len(payload), op="pull", id=pull_id,
                                 address=src.data_ptr(), md=self._md())  # fmt: skip
        pull["proof"] = write_mac(self.connection_key, pull)  # that this agent holds the model's secret
        self._outgoing[pull_id] = _Outgoing(transfer, source, remote["agent"], self._loop)
        # the pull's `to` still names the lease's agent; the notification goes to whom the metadata names
        self._post(remote["nixl"], [pull_id], json.dumps(pull).encode(), "kill")
        # the checksums go once this turn's pulls are out (the receiver reads meanwhile)
        if not self._unhashed:
            self._loop.call_soon(self._send_sums)
        self._unhashed.append((remote["nixl"], pull_id, payload, flipped, dst.key, pull["mac"]))
        return transfer

    def _post(self, to: str, pull_ids: list[str], message: bytes, fault: str = "") -> None:
        """Have the agent's thread send `message` to the agent whose metadata is `to` (NIXL may take long
        to connect, which the event loop must not wait for); failing, the pulls named fail."""
        self._outbox.put((to, pull_ids, message, fault))
        self._wake.set()

    def _send_posted(self) -> None:
        """The agent's thread: send what was posted, in order."""
        while not self._outbox.empty():
            to, pull_ids, message, fault = self._outbox.get()
            if not any(pull_id in self._outgoing for pull_id in pull_ids):
                continue  # settled meanwhile (the receiver answered, or was given up on)
            try:
                receiver = self._load(to)
                with self._nixl_lock:
                    self._nixl.send_notif(receiver, message)
            except Exception as e:  # the receiver is gone: its pulls fail
                receiver = self._names.get(to, "the decode pod")
                self._drop(receiver)
                for pull_id in pull_ids:
                    self._settle(pull_id, f"NIXL could not reach {receiver}: {e}", integrity=False)
                continue
            if fault and _take_fault({fault}):  # the prefill pod dies with its pull on the way
                os.kill(os.getpid(), signal.SIGKILL)

    def _send_sums(self) -> None:
        """Have the hashing thread hash what this turn offered and post each receiver its checksums."""
        unhashed, self._unhashed = self._unhashed, []
        self._to_hash.put(("sums", unhashed))

    def _hash_sums(self, unhashed: list[tuple[str, str, memoryview, int | None, bytes, str]]) -> None:
        sums: dict[str, dict[str, int]] = {}
        tags: dict[str, dict[str, str]] = {}
        for to, pull_id, payload, flipped, key, mac in unhashed:
            if pull_id in self._outgoing:
                digest = flipped if flipped is not None else xxhash.xxh3_64_intdigest(payload)
                sums.setdefault(to, {})[pull_id] = digest
                tags.setdefault(to, {})[pull_id] = checksum_tag(key, mac, digest).hex()
        for to, digests in sums.items():
            message = {"op": "sums", "sums": digests, "tags": tags[to]}
            self._post(to, list(digests), json.dumps(message).encode())

    def abandon(self, remote: dict[str, Any], reason: str) -> None:
        """Give up on what this agent offered `remote`: pending handles fail now; their memory stays
        registered until the receiver answers or could no longer be reading it."""
        later = time.monotonic() + 2 * self.stall_seconds
        for out in list(self._outgoing.values()):
            if out.remote == remote["agent"] and not out.free_after:
                out.free_after = later
                out.loop.call_soon_threadsafe(out.transfer.finish, reason)

    def _settle(self, pull_id: str, error: str, integrity: bool) -> None:
        out = self._outgoing.pop(pull_id, None)
        if out is None:
            return
        self._withdraw(out.source)
        if not out.free_after:
            out.loop.call_soon_threadsafe(out.transfer.finish, error, integrity)

    def _load(self, metadata: str) -> str:
        """Give NIXL the metadata of the agent it names, again whenever that changed (an agent that
        registered more memory since: NIXL takes the new registrations and keeps the connection); returns the
        name it holds, which is who a notification reaches (a lease of an earlier life names another)."""
        with self._nixl_lock:
            agent = self._names.get(metadata)
            if agent is None or self._remotes.get(agent) != metadata:
                name = self._nixl.add_remote_agent(base64.b64decode(metadata))
                agent = name.decode() if isinstance(name, bytes) else str(name)
                self._remotes[agent], self._names[metadata] = metadata, agent
            return agent

    def _drop(self, agent: str) -> None:
        """After a failure: over UCX forget the peer, so that its next pull (which carries its metadata)
        connects afresh; over LIBFABRIC keep it (see `_drops_peers`)."""
        if self._drops_peers:
            self._forget_remote(agent)

    def _forget_remote(self, agent: str) -> None:
        with self._nixl_lock:
            if (metadata := self._remotes.pop(agent, None)) is not None:
                self._names.pop(metadata, None)
                with contextlib.suppress(Exception):
                    self._nixl.remove_remote_agent(agent)

    # ---- the agent's thread ----

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.clear()  # (set again meanwhile: the wait below returns at once)
            try:
                busy = self._poll()
            except Exception:
                log.exception("the NIXL agent's thread hit an error; it goes on")
                busy = False
            self._wake.wait(POLL_BUSY if busy else POLL_IDLE)

    def _poll(self) -> bool:
        self._send_posted()
        try:
            with self._nixl_lock:
                notifications = self._nixl.get_new_notifs()
        except Exception as e:  # the backend says why in its own log; what it failed times out or fails
            log.debug("NIXL could not get notifications: %s", e)
            notifications = {}
        for writer, messages in notifications.items():
            writer = writer.decode() if isinstance(writer, bytes) else writer
            offered = []
            for raw in messages:
                try:
                    message = json.loads(raw)
                except ValueError:
                    log.warning("agent %s sent a notification that is not JSON; ignored", writer)
                    continue
                if message.get("op") == "pull":
                    offered.append(message)
                elif message.get("op") == "ack" and _proven(self.connection_key, message):  # the model's
                    for answer in _dicts(message.get("acks")):
                        if str(answer.get("id")) in self._outgoing:
                            self._settle(str(answer.get("id")), str(answer.get("error", "")),
                                         bool(answer.get("integrity")))  # fmt: skip
                elif message.get("op") == "sums":
                    answers = []
                    sums, tags = message.get("sums"), message.get("tags")
                    for pull_id, expected in sums.items() if isinstance(sums, dict) else ():
                        if type(expected) is not int or not isinstance(tags, dict):
                            continue
                        entry = self._verifying.setdefault((writer, str(pull_id)), _Verified())
                        entry.expected, entry.tag = expected, str(tags.get(pull_id, ""))
                        answers += self._verdict(writer, str(pull_id))
                    self._ack(writer, answers)
            if offered:
                self._read(writer, offered)
        self._progress()
        self._judge_hashed()
        now = time.monotonic()
        for pull_id, out in list(self._outgoing.items()):  # abandoned and never answered
            if out.free_after and now > out.free_after:
                self._settle(pull_id, "", False)
        for key, entry in list(self._verifying.items()):  # a checksum that never came, or came for nothing
            if now - entry.since > self.stall_seconds:
                del self._verifying[key]
                if entry.pull is not None:
                    late = f"no checksum from {key[0]} within {self.stall_seconds} s"
                    self._ack(key[0], [(entry.pull, late, False)])
        waiting = any(entry.pull is not None for entry in self._verifying.values())  # for checksums
        return bool(self._incoming or self._queued or self._cancelling or self._outgoing or waiting
                    or self._hashing)  # fmt: skip

    def _verdict(self, writer: str, pull_id: str) -> list[tuple[dict[str, Any], str, bool]]:
        """The answer to a pull once both its bytes' hash and the writer's checksum are here (else none yet):
        a verified layer is notified to the decode role."""
        entry = self._verifying.get((writer, pull_id))
        if entry is None or entry.pull is None or entry.expected is None:
            return []
        del self._verifying[(writer, pull_id)]
        pull = entry.pull
        if self.regions.get(pull["region"]) is not entry.region:  # (then its bytes may be another's since)
            return [(pull, f"region {pull['region']!r} was deregistered (its lease ended) meanwhile", True)]
        tag = checksum_tag(entry.region.key, pull["mac"], entry.expected).hex()
        if not hmac.compare_digest(entry.tag, tag):
            return [(pull, "refused: the checksum does not carry the lease key the pull was made with", True)]
        if entry.digest != entry.expected:
            return [(pull, "checksum mismatch: the bytes arrived corrupted", True)]
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._notify, writer, pull["notification"])
        return [(pull, "", False)]

    def _ack(self, writer: str, answers: list[tuple[dict[str, Any], str, bool]]) -> None:
        """Answer pulls of one writer, (pull, error or "", whether the bytes or their description were
        refused) each, in one notification; where the connection to the writer broke, connect again from the
        metadata the pulls carried (the writer waits for these answers)."""
        if not answers:
            return
        acks = [{"id": str(pull.get("id")), **({"error": error, "integrity": integrity} if error else {})}
                for pull, error, integrity in answers]  # fmt: skip
        answer = {"op": "ack", "acks": acks}
        answer["proof"] = write_mac(self.connection_key, answer)  # that a pod of the model answers
        for attempt in range(2):
            try:
                if attempt:
                    self._load(str(answers[-1][0].get("md")))
                with self._nixl_lock:
                    self._nixl.send_notif(writer, json.dumps(answer).encode())
                return
            except Exception as e:
                failure = e
        log.info("could not answer %s's pulls: %s", writer, failure)

    def _read(self, writer: str, offered: list[dict[str, Any]]) -> None:
        """A writer offers layers: drop those that do not prove the model's secret (`proof`: nothing of them,
        their metadata included, reaches NIXL), check each other one (its lease key among the rest), pin their
        regions and read them with NIXL READs."""
        proven = [pull for pull in offered if _proven(self.connection_key, pull)]
        if len(proven) < len(offered):
            self.unproven += len(offered) - len(proven)
            log.warning("agent %s offered %d pulls without the model's proof; dropped", writer,
                        len(offered) - len(proven))  # fmt: skip
        if not proven:
            return
        try:  # the newest metadata: it has every registration the offered pulls name
            if self._load(str(proven[-1].get("md"))) != writer:
                raise ValueError(f"they name another agent than {writer}")
        except Exception as e:
            error = f"refused: the writer's NIXL metadata did not load: {e}"
            return self._ack(writer, [(pull, error, True) for pull in proven])
        pulls, refusals = [], []
        with self._lock:  # checked and pinned at once: a lease ending cannot slip in between
            for pull in proven:
                if problem := self.check(pull):
                    refusals.append((pull, problem, True))
                    continue
                region = self.regions[pull["region"]]
                region.receiving += 1
                pulls.append((pull, region))
        self._ack(writer, refusals)
        if not pulls:
            return
        if (fault := _take_fault({"cut", "stall", "die"})) == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "cut" and self._drops_peers:  # the connection to the writer is gone
            self._forget_remote(writer)
        for at in range(0, len(pulls), READ_BATCH):  # (over LIBFABRIC a cut read fails instead)
            self._queued.append((writer, pulls[at : at + READ_BATCH], fault == "stall", fault == "cut"))
        self._start_queued()

    def _start_queued(self) -> None:
        """Start the queued reads whose writer has fewer than READ_WINDOW in flight, in order."""
        flying = collections.Counter(reading.writer for reading in self._incoming)
        waiting = []
        for read in self._queued:
            if flying[read[0]] < READ_WINDOW:
                flying[read[0]] += 1
                self._start_read(*read)
            else:
                waiting.append(read)
        self._queued = waiting

    def _start_read(
        self, writer: str, pulls: list[tuple[dict[str, Any], Region]], stalled: bool, cut: bool = False
    ) -> None:
        into = [(region.tensor.data_ptr() + pull["offset"], pull["nbytes"], 0) for pull, region in pulls]
        sources = [(0 if cut else int(pull["address"]), pull["nbytes"], 0) for pull, _ in pulls]
        try:
            with self._nixl_lock:
                local = self._nixl.get_xfer_descs(into, "DRAM")
                source = self._nixl.get_xfer_descs(sources, "DRAM")
                handle = self._nixl.initialize_xfer("READ", local, source, writer)
                state = self._nixl.transfer(handle)
        except Exception as e:
            with self._lock:
                for _, region in pulls:
                    region.receiving -= 1
            self._drop(writer)
            return self._ack(writer, [(pull, f"the NIXL read from {writer} failed: {e}", False)
                                      for pull, _ in pulls])  # fmt: skip
        reading = _Incoming(writer, pulls, handle, time.monotonic() + self.stall_seconds, stalled)
        if state == "ERR":
            return self._finish(reading, "ERR")
        self._incoming.append(reading)

    def _progress(self) -> None:
        now = time.monotonic()
        for reading in list(self._incoming):
            try:
                with self._nixl_lock:
                    state = self._nixl.check_xfer_state(reading.handle)
            except Exception:  # the backend failed this read (its own log says how): answered as failed
                state = "ERR"
            if reading.stalled:
                state = "PROC"  # the fault: as if the link carried nothing more
            if state != "PROC" or now > reading.deadline:
                self._incoming.remove(reading)
                self._finish(reading, "TIMEOUT" if state == "PROC" else state)
        for reading in list(self._cancelling):
            if self._release(reading):
                self._cancelling.remove(reading)
        self._start_queued()

    def _release(self, reading: _Incoming) -> bool:
        """Release the read's handle (NIXL cancels it if it is still on its way); True once its regions'
        memory can no longer be written by it."""
        try:
            with self._nixl_lock:
                self._nixl.release_xfer_handle(reading.handle)
        except Exception:
            return False
        with self._lock:
            for _, region in reading.pulls:
                region.receiving -= 1
        return True

    def _finish(self, reading: _Incoming, state: str) -> None:
        writer = reading.writer
        if not self._release(reading):
            self._cancelling.append(reading)  # its regions stay pinned until NIXL lets them go
        if state != "DONE":
            if state == "TIMEOUT":
                error = f"the NIXL read from {writer} passed its {self.stall_seconds} s"
            else:
                error = f"the NIXL read from {writer} failed ({state})"
                self._drop(writer)
            failed = list(reading.pulls)
            for read in [read for read in self._queued if read[0] == writer]:  # theirs would fare no better
                self._queued.remove(read)
                with self._lock:
                    for _, region in read[1]:
                        region.receiving -= 1
                failed += read[1]
            return self._ack(writer, [(pull, error, False) for pull, _ in failed])
        self._hashing += 1
        self._to_hash.put(("read", writer, reading.pulls))

    def _hash(self) -> None:
        """The hashing thread: the bytes of finished reads, while the agent's thread goes on reading (NIXL and
        XXH3 each run without the GIL); the digests go back to the agent's thread."""
        while (job := self._to_hash.get()) is not None:
            if job[0] == "sums":  # a prefill pod's: what its turn offered
                self._hash_sums(job[1])
                continue
            _, writer, pulls = job
            digests = [xxhash.xxh3_64_intdigest(region.view[pull["offset"] : pull["offset"] + pull["nbytes"]])
                       for pull, region in pulls]  # fmt: skip
            self._hashed.put((writer, pulls, digests))
            self._wake.set()

    def _judge_hashed(self) -> None:
        """Verdicts on what the hashing thread finished (on the agent's thread)."""
        while not self._hashed.empty():
            writer, pulls, digests = self._hashed.get()
            self._hashing -= 1
            answers = []
            for (pull, region), digest in zip(pulls, digests, strict=True):
                entry = self._verifying.setdefault((writer, str(pull.get("id"))), _Verified())
                entry.pull, entry.region, entry.digest = pull, region, digest
                answers += self._verdict(writer, str(pull.get("id")))
            self._ack(writer, answers)


def _proven(key: bytes, message: dict[str, Any]) -> bool:
    """The message (a pull, an answer) carries the proof that its sender holds the model's secret."""
    proof = message.get("proof")
    return isinstance(proof, str) and hmac.compare_digest(proof, write_mac(key, message))


def _dicts(items: object) -> list[dict[str, Any]]:
    """The dicts of a list a peer sent (anything else in it, or no list, counts for nothing)."""
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def _take_fault(kinds: set[str]) -> str | None:
    """The fault written in $NEURONFLEET_KV_FAULT_FILE when it is one of `kinds` and this process is the
    first to take it (tests only; see the module's docstring)."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            kind = json.load(f).get("kind")
        if kind not in kinds:
            return None
        os.rename(path, f"{path}.taken.{os.getpid()}")  # atomic: one process takes it
    except (OSError, ValueError):
        return None
    return kind
