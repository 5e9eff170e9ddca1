"""The continuous-batching engine: requests in, token and text deltas out.

`Engine` is the synchronous core: each `step()` is the scheduler's plan (`Scheduler.schedule`), run as it is
by the model runner (`ModelRunner.run`: the next token of every row), then incremental detokenization and the
stop conditions (EOS ids, stop strings that are never emitted, `max_tokens`, the slot's length), and the
scheduler's bookkeeping (`Scheduler.postprocess`: tokens appended, prefixes booked, finished slots freed).
`AsyncEngine` runs that loop on a background thread and gives the server an async interface: submit a
request, iterate over its outputs, cancel it. It admits a request only when its expected wait for a slot is
within the bound (`admission`; else `Overloaded`, with Retry-After), and between steps turns away the waiting
requests that have waited past the bound, or, while draining, that it could not finish in time (`HandedBack`:
a 503 our routers send elsewhere); at the end of a drain what is left is handed back too, never failed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from neuronfleet.runtime.engine import admission
from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.grammar_masks import GrammarVocabulary
from neuronfleet.runtime.engine.host_kv_store import HostKvStore
from neuronfleet.runtime.engine.kv_events import BlockLedger
from neuronfleet.runtime.engine.kv_events import Event as KvEvent
from neuronfleet.runtime.engine.model_runner import ExportMemory, ModelRunner, StepResult
from neuronfleet.runtime.engine.scheduler import Scheduler, StepPlan
from neuronfleet.runtime.engine.scheduler import Sequence as Seq
from neuronfleet.runtime.engine.text_output import TextOutput
from neuronfleet.runtime.serving.backend import (
    FinishReason,
    Limits,
    RequestOutput,
    TokenLogprobs,
    check_fits,
)
from neuronfleet.runtime.serving.engine_metrics import StepMetrics, StepReport
from neuronfleet.runtime.serving.errors import (
    EngineFailed,
    HandedBack,
    InvalidRequest,
    Overloaded,
    QueueFull,
    RequestFailed,
    ServingError,
    queue_full_message,
)
from neuronfleet.runtime.serving.sampling_params import SamplingParams
from neuronfleet.runtime.serving.tokenizer import Tokenizer

if TYPE_CHECKING:  # the engine itself holds no tensors: the runner does
    import torch

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters for metrics and benchmarks."""

    steps: int = 0
    prefill_calls: int = 0  # steps that admitted requests
    model_seconds: float = 0.0  # inside the model runner (forward + sampling)
    step_seconds: float = 0.0  # whole steps


@dataclass(eq=False)
class _Stream:
    """A request and its text state."""

    seq: Seq
    text: TextOutput


class Engine:
    """Synchronous continuous-batching engine over one model runner."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config = runner.config
        self.limits = Limits(
            config.max_seq_len, config.max_prompt_len, config.slots, runner.dtype_name, runner.device.type,
            dtype_auto=config.dtype == "auto", quantization=runner.quantization,
            weights_dtype=runner.weights_dtype_name,
        )  # fmt: skip
        self.eos_ids = frozenset(runner.model_config.eos_token_ids) | tokenizer.eos_token_ids
        # constrained requests' grammars read the tokenizer's vocabulary, as wide as the model's logits
        runner.sampler.grammar = GrammarVocabulary(tokenizer, self.eos_ids, runner.model_config.vocab_size)
        store = HostKvStore(runner.host_blocks) if runner.host_blocks and config.prefix_reuse else None
        self.scheduler = Scheduler(config, store)
        self.stats = EngineStats()
        self.step_observers: list[Callable[[StepReport], None]] = []
        self._ledger: BlockLedger | None = None
        self._publish_events: Callable[[list[KvEvent]], None] = lambda events: None
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self.last_step_seconds = 0.0  # how long the last step took: a request that waits one more passes it

    @classmethod
    def from_model_dir(cls, model_dir: str, config: RuntimeConfig | None = None) -> Engine:
        runner = ModelRunner(model_dir, config or RuntimeConfig())
        return cls(runner, Tokenizer(model_dir, runner.model_config.eos_token_ids))

    # ---- requests ------------------------------------------------------------------------------------------

    def make_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> Seq:
        """Tokenize and check a request without queueing it; raises InvalidRequest when it can never fit."""
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        vocab = self.runner.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        max_tokens = check_fits(self.limits, len(prompt_ids), params.max_tokens)
        return Seq(
            request_id=request_id or f"req-{next(self._ids)}",
            prompt_ids=prompt_ids,
            params=params,
            max_tokens=max_tokens,
        )

    def enqueue(self, seq: Seq) -> str:
        """Queue a checked request; raises QueueFull when the waiting queue is at its bound."""
        if seq.request_id in self._streams:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.scheduler.add(seq)
        self._streams[seq.request_id] = _Stream(
            seq=seq, text=TextOutput(self.tokenizer, seq.prompt_ids, seq.params.stop)
        )
        return seq.request_id

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Check and queue a request (text or token ids); returns its id."""
        return self.enqueue(self.make_request(prompt, params, request_id))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request now and free its slot; returns its final output, or None when it is unknown."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return None
        self.scheduler.abort(request_id)
        return self._output(stream, [], "", FinishReason.ABORT)

    def prefill_and_export(
        self,
        token_ids: Sequence[int],
        params: SamplingParams | None = None,
        into: ExportMemory | None = None,
    ):
        """A prefill pod's work for one prompt: run it in a free slot (reusing any cached prefix) and return
        its first token and its keys and values ([layers, 2, kv_heads, len, head_dim]; in the memory `into`
        gives, where given). The slot keeps the prompt for prefix reuse and is free again at once."""
        ids = list(token_ids)
        seq = Seq(request_id="export", prompt_ids=ids, params=params or SamplingParams(), max_tokens=1)
        start = time.perf_counter()
        plan = self.scheduler.plan_export(seq)
        result = self._run(plan)
        if result.failed:
            raise result.failed[0][1]
        self.scheduler.postprocess(plan, result.tokens, {})
        self._report(plan, result, time.perf_counter() - start)  # its prompt and prefix cache counters
        self._kv_events()
        return result.tokens[seq], self.runner.export_kv(seq.slot, len(ids), into=into)

    def import_prefix(self, token_ids: Sequence[int], kv: torch.Tensor) -> int | None:
        """Place a prompt's keys and values, computed by another engine (a prefill pod), into a free slot, so
        that a request for that prompt prefills only its last token. Returns the slot, or None when no slot
        is free (the request then prefills whole: slower, never wrong)."""
        taken = self.scheduler.slot_for_import(list(token_ids))
        if taken is None:
            return None
        slot, save = taken
        try:
            if save is not None:  # what the slot held, kept in the host KV store first
                self.runner.save_blocks(save.slot, save.blocks, save.places)
            self.runner.import_kv(slot, kv, len(token_ids))
        except BaseException:  # (keys and values that do not fit): the slot is booked as holding nothing
            self.scheduler.prefixes.holds(slot, [])
            raise
        finally:
            self._kv_events()
        return slot

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def turn_away(self, now: float) -> list[tuple[str, ServingError]]:
        """The waiting requests turned away now, each with the error its client gets: those that would wait
        past the bound by the end of the next step, which will not give them a slot (`Overloaded`), and while
        draining those that would not finish in time (`HandedBack`). Their streams end here; the service time
        estimate is brought up to date."""
        sched = self.scheduler
        sched.estimate(now)
        bound = sched.max_queue_wait
        out: list[tuple[str, ServingError]] = []
        for seq in sched.overdue(now, within=self.last_step_seconds):
            waited = now - seq.arrival_time
            error = Overloaded(
                f"the request waited {waited:.0f} s for a slot, past the bound of {bound:g} s "
                "(--max-queue-wait); retry later",
                retry_after=self._retry_after(),
            )
            out.append((seq.request_id, error))
        for seq in sched.hand_backs(now):
            error = HandedBack("the server is shutting down and would not finish this request in its grace "
                               "period; send it again (another pod will take it)", retry_after=1)  # fmt: skip
            out.append((seq.request_id, error))
        for rid, _ in out:
            self._streams.pop(rid, None)
        return out

    def _retry_after(self) -> int:
        """Seconds until a slot is expected to free: a slot's service time over the slots (at least 1)."""
        seconds = self.scheduler.slot_seconds or 0.0
        return max(1, math.ceil(seconds / self.config.slots))

    # ---- the step ------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one planned step (a prefill group and the decode rows together); returns its outputs.

        A failure that belongs to one request (setting up its sampler, detokenizing, stop handling) ends that
        request with an error output and leaves the others running; a failing model call raises.
        """
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        result = self._run(plan)
        outputs, finished = [], {}
        for seq, error in result.failed:
            outputs.append(self._failed(seq, error))
            finished[seq] = FinishReason.ABORT
        for seq, token in result.tokens.items():
            out = self._accept(seq, token, result.logprobs.get(seq))
            outputs.append(out)
            if out is not None and out.finish_reason is not None:
                finished[seq] = out.finish_reason
        self.scheduler.postprocess(plan, result.tokens, finished)
        self.last_step_seconds = time.perf_counter() - start
        self._report(plan, result, self.last_step_seconds)
        self._kv_events()
        return [o for o in outputs if o is not None]

    def publish_kv_events(self, publish: Callable[[list[KvEvent]], None]) -> None:
        """From now on, after every step, the blocks the pod came to hold or stopped holding (in its slots'
        caches or its host KV store) go to `publish` as KV-cache events (`kv_events`: vLLM's format)."""
        self._ledger = BlockLedger(self.config.slots)
        self._publish_events = publish

    def _kv_events(self) -> None:
        if self._ledger is not None:
            events = self._ledger.sync(self.scheduler.prefixes.held, self.scheduler.store)
            if events:
                self._publish_events(events)

    def _run(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        try:
            result = self.runner.run(plan)
        except BaseException:
            self.scheduler.lost_cache()
            self._kv_events()
            raise
        self.stats.model_seconds += time.perf_counter() - t0
        return result

    def _report(self, plan: StepPlan, result: StepResult, seconds: float) -> None:
        ran = [s for s in plan.admitted if s in result.tokens]
        now = time.monotonic()
        self.stats.steps += 1
        self.stats.prefill_calls += bool(ran)
        self.stats.step_seconds += seconds
        report = StepReport(
            prefill_requests=len(ran),
            decode_requests=len(result.tokens) - len(ran),
            seconds=seconds,
            queue_seconds=[(s.slot_time or now) - s.arrival_time for s in ran],  # arrival to its slot
            prompt_tokens=sum(len(s.prompt_ids) for s in ran),
            reused_prompt_tokens=plan.reused_tokens(result.tokens),
        )
        for observer in self.step_observers:
            observer(report)

    def _failed(self, seq: Seq, error: Exception) -> RequestOutput | None:
        """The output of a request that failed inside the engine; the scheduler frees its slot, the others
        go on."""
        log.exception("request %s failed", seq.request_id, exc_info=error)
        stream = self._streams.pop(seq.request_id, None)
        if stream is None:
            return None
        out = self._output(stream, [], "", FinishReason.ABORT)
        out.error = f"{type(error).__name__}: {error}"
        return out

    def _accept(self, seq: Seq, token: int, logprobs: TokenLogprobs | None = None) -> RequestOutput | None:
        """One new token of a sequence (and its log probabilities, where asked) as its output:
        detokenization and the stop checks (the scheduler appends the token and frees a finished one's slot);
        a failure here ends this request alone."""
        stream = self._streams.get(seq.request_id)
        if stream is None:  # aborted while the step ran
            return None
        n = len(seq.output_ids) + 1
        try:
            text, reason = stream.text.accept(
                token,
                eos=token in self.eos_ids and not seq.params.ignore_eos,
                last=n >= seq.max_tokens or len(seq.prompt_ids) + n >= self.config.max_seq_len,
            )
        except Exception as e:
            return self._failed(seq, e)
        if reason is not None:
            del self._streams[seq.request_id]
        out = self._output(stream, [token], text, reason, completion_tokens=n)
        if logprobs is not None:
            out.logprobs = [logprobs]
        return out

    @staticmethod
    def _output(
        stream: _Stream, ids: list[int], text: str, reason: FinishReason | None, completion_tokens: int = -1
    ) -> RequestOutput:
        seq = stream.seq
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=ids,
            text=text,
            finish_reason=reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids) if completion_tokens < 0 else completion_tokens,
        )

    # ---- offline use ---------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion together; one aggregated output per prompt, in order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        results = {i: RequestOutput(request_id=i, token_ids=[], text="") for i in ids}
        while self.has_work():
            for out in self.step():
                results[out.request_id].absorb(out)
        return [results[i] for i in ids]


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _put_all(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)


class AsyncEngine:
    """Runs an Engine on a background thread; the asyncio side submits, streams and cancels requests.

    Only the engine thread touches the engine's state: submissions and cancellations are handed over through
    a command queue that the thread drains before every step, so the event loop never waits for a model call.
    The engine is also built on that thread (`make_engine` runs there): torch's OpenMP pool belongs to the
    thread that first runs parallel work, and a second pool on another thread contends with the first for the
    cores (a decode step is much slower when the model was loaded on another thread).
    """

    def __init__(self, make_engine: Callable[[], Engine]) -> None:
        self._commands: collections.deque = collections.deque()
        self.kv_events_endpoint: str | None = None  # where its KV-cache events are published, if they are
        self.kv_events_replay: str | None = None  # where it answers replays of them, if it does
        self.kv_events_auth: str | None = (
            None  # what a subscriber needs (kv_event_publisher.AUTH), if anything
        )
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.engine: Engine
        self._thread = threading.Thread(target=self._run, args=(make_engine,), name="neuronfleet-engine")
        self._thread.daemon = True
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_requests(self) -> int:
        """Requests submitted and not finished: running, waiting, or on their way to the engine thread."""
        return len(self._queues)

    @property
    def num_pending(self) -> int:
        """Requests submitted that do not hold a slot yet."""
        return max(0, len(self._queues) - len(self.engine.scheduler.running))

    def _run(self, make_engine: Callable[[], Engine]) -> None:
        try:
            self.engine = make_engine()
        except BaseException as e:  # raised again by the constructor, on the caller's thread
            self._build_error = e
            return
        finally:
            self._built.set()
        try:
            self._loop()
        finally:  # (a tensor-parallel runner's other ranks stop with it, from this thread, as they ran)
            self.engine.runner.close()

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            while not self._stopping:
                self._drain_commands()
                turned_away = self.engine.turn_away(time.monotonic())
                if turned_away:
                    self._deliver_all(turned_away)
                if not self.engine.has_work():
                    break
                try:
                    outputs = self.engine.step()
                except BaseException as e:  # an engine failure fails every request, loudly
                    log.exception("engine step failed")
                    self.error = e
                    self._fail_all(e)
                    return
                self._deliver_all([(out.request_id, out) for out in outputs])

    def _drain_commands(self) -> None:
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                try:
                    self.engine.enqueue(payload)
                except (QueueFull, ValueError) as e:
                    self._deliver(payload.request_id, e)
            elif kind == "call":
                fn, loop, future = payload
                try:
                    result, error = fn(self.engine), None
                except Exception as e:  # the caller gets it; the engine goes on
                    result, error = None, e
                with contextlib.suppress(RuntimeError):  # the caller's loop may be closed
                    loop.call_soon_threadsafe(_settle, future, result, error)
            else:
                out = self.engine.abort(payload)
                if out is not None:
                    self._deliver(payload, out)

    def _deliver(self, request_id: str, out: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, out)])

    def _deliver_all(self, items: Sequence[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand outputs to their requests' queues: one wake-up per event loop per step, not one per output."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, out in items:
            entry = self._queues.get(request_id)
            if entry is None:
                continue
            loop, queue = entry
            if isinstance(out, RequestOutput) and out.error is not None:
                out = RequestFailed(f"the request failed inside the engine: {out.error}")
            if isinstance(out, BaseException) or out.finished:
                self._queues.pop(request_id, None)
            by_loop.setdefault(loop, []).append((queue, out))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop may be closed
                loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self._queues):
            self._deliver(rid, EngineFailed(f"the engine failed: {error!r}"))

    # ---- the Backend surface (serving.backend) the HTTP server serves from ----

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.engine.eos_ids

    @property
    def limits(self) -> Limits:
        return self.engine.limits

    @property
    def kv_usage(self) -> float:
        """Share of the KV cache's tokens in use (1 = full)."""
        config = self.engine.config
        return self.engine.scheduler.used_tokens() / (config.slots * config.max_seq_len)

    def load_gauges(self) -> list[tuple[str, str, Callable[[], float]]]:
        """(name, help, read) of the gauges that describe this backend's load."""
        sched, config = self.engine.scheduler, self.engine.config
        return [
            ("vllm:num_requests_running", "Requests in slots.", lambda: len(sched.running)),
            ("vllm:num_requests_waiting", "Requests waiting for a slot.", lambda: self.num_pending),
            (
                "vllm:kv_cache_usage_perc",
                "Share of KV cache tokens in use (1 = full).",
                lambda: self.kv_usage,
            ),
            (
                "neuronfleet:slots_busy",
                "Slots holding a request.",
                lambda: config.slots - sched.num_free_slots,
            ),
            (
                "neuronfleet:host_kv_cache_blocks",
                "Blocks of 16 tokens the host KV store holds (prefixes kept after their slot was taken).",
                lambda: len(sched.store) if sched.store is not None else 0,
            ),
        ]

    def register_metrics(self, registry: CollectorRegistry, model_name: str) -> None:
        """The engine's step metrics, observed on the engine thread after every step."""
        config = self.engine.config
        metrics = StepMetrics(registry, model_name, config.slots, config.max_seq_len)
        self.engine.step_observers.append(metrics.observe)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run fn(engine) on the engine's thread between two steps (the runner is not thread-safe), and
        return its result; its exception is raised here and the engine goes on."""
        if self.error is not None or self._stopping:
            raise EngineFailed("the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.append(("call", (fn, loop, future)))
        self._wake.set()
        return await future

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs as they come; leaving the iteration early aborts it.

        Raises InvalidRequest for a request that can never fit and QueueFull when the queue is at its bound.
        """
        if self.error is not None:
            raise EngineFailed(f"the engine failed earlier: {self.error!r}")
        seq = self.engine.make_request(prompt, params, request_id)
        sched = self.engine.scheduler
        ahead, seconds, bound = len(self._queues), sched.slot_seconds, sched.max_queue_wait
        refused = admission.refusal(ahead, sched.num_slots, seconds, bound, sched.slot_spread)
        if refused is not None:
            wait, retry = refused
            raise Overloaded(
                f"the request would likely wait {wait:.0f} s for a slot, past the bound of {bound:g} s "
                f"(--max-queue-wait): {ahead} requests are ahead on {sched.num_slots} slots, each serving "
                f"one in {seconds:.1f} s; retry after {retry} s",
                retry_after=retry,
            )
        if ahead >= sched.capacity:
            message = queue_full_message(sched.num_slots, sched.max_waiting)
            raise QueueFull(message, self.engine._retry_after())
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[seq.request_id] = (asyncio.get_running_loop(), queue)
        if self.error is not None or self._stopping:  # failed or stopped meanwhile: nobody would answer
            self._queues.pop(seq.request_id, None)
            raise EngineFailed("the engine is not running")
        self._commands.append(("add", seq))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(seq.request_id)

    def abort(self, request_id: str) -> None:
        """Cancel a request; its slot is freed before the engine's next step."""
        self._queues.pop(request_id, None)
        self._commands.append(("abort", request_id))
        self._wake.set()

    def drain(self, grace_period: float) -> None:
        """The server drains: from now on, waiting requests that would not finish within `grace_period`
        seconds are handed back (`Engine.turn_away`), those that would are served."""
        self.engine.scheduler.drain_deadline = time.monotonic() + grace_period
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight are handed back (`HandedBack`: a 503 with
        Retry-After where their answer has not started) instead of hanging."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        for rid in list(self._queues):
            self._deliver(rid, HandedBack("the server stopped at the end of its grace period before the "
                                          "request finished; send it again", retry_after=1))  # fmt: skip

    def __enter__(self) -> AsyncEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
