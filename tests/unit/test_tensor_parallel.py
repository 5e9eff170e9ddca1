"""Tensor parallelism (`runtime/model/tensor_parallel.py`): two ranks over gloo, each holding half of every
layer's heads, key/value heads and MLP columns, give the logits of the whole model (tensor parallelism 1) on
the same passes: a prefill, a decode over the prefilled slots, a prefill after a cached prefix, and a step of
both. This holds op by op and with the passes compiled (`aot_eager`: the graphs a device backend is given, the
all-reduce inside them as an operator). A split the model's shape does not allow, or quantized weights, is
refused saying what works."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support import free_port, make_tiny_llama, run_neuronfleet, running_server

from neuronfleet.runtime.model import tensor_parallel
from neuronfleet.runtime.model.compiled_steps import CompiledSteps
from neuronfleet.runtime.model.llama import LlamaModel, PrefillBatch
from neuronfleet.runtime.model.model_config import ModelLoadError, load_model_config

SLOTS, MAX_SEQ = 4, 64


def model_of(folder, shard=None, pack: bool = True) -> LlamaModel:
    folder = Path(folder)
    return LlamaModel(folder, load_model_config(folder), SLOTS, MAX_SEQ, torch.float32, torch.device("cpu"),
                      capture_decode=False, pack=pack, shard=shard)  # fmt: skip


def passes(model: LlamaModel, compiled: bool) -> list[torch.Tensor]:
    """The logits of a fixed sequence of passes, each over the cache the ones before it wrote."""
    gen = torch.Generator().manual_seed(7)
    steps = CompiledSteps(model, "aot_eager") if compiled else None
    out = []
    tokens = torch.randint(3, 500, (2, 16), generator=gen)
    first = PrefillBatch(tokens, torch.tensor([15, 11]), torch.tensor([0, 1]))
    if compiled:  # (a compiled pass reads every prompt through its positions, up to a context bucket)
        first.positions, first.context = torch.arange(16).expand(2, 16).contiguous(), 32
    out.append(steps.prefill(first) if compiled else model.forward(first, None)[0])
    decode = model.decode_batch(torch.randint(3, 500, (2,), generator=gen), torch.tensor([16, 12]), 32, None)
    out.append(steps.decode(decode) if compiled else model.forward(None, decode)[1])
    later = PrefillBatch(torch.randint(3, 500, (1, 8), generator=gen), torch.tensor([7]), torch.tensor([0]),
                         torch.arange(17, 25)[None], context=32)  # fmt: skip
    out.append(steps.prefill(later) if compiled else model.forward(later, None)[0])
    if not compiled:  # a step of both kinds at once (op by op only: compiled, each is its own graph)
        both = PrefillBatch(
            torch.randint(3, 500, (1, 6), generator=gen), torch.tensor([5]), torch.tensor([2])
        )
        again = model.decode_batch(
            torch.randint(3, 500, (2,), generator=gen), torch.tensor([25, 13]), 32, None
        )
        out.extend(model.forward(both, again))
    return out


def rank_main(rank: int, world: int, port: int, folder: str, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        shard = tensor_parallel.Shard(rank, world)
        model = model_of(folder, shard, pack=False)
        targets: list[str] = []

        def recorder(gm, example_inputs):  # what a device backend would be given
            targets.extend(str(node.target) for node in gm.graph.nodes)
            return gm.forward

        decode = model.decode_batch(torch.tensor([5, 6]), torch.tensor([0, 0]), 32, None)
        CompiledSteps(model, recorder).decode(decode)
        got = {
            "op by op": passes(model_of(folder, shard), compiled=False),
            "compiled": passes(model_of(folder, shard, pack=False), compiled=True),
            "heads": (model.config.num_heads, model.config.num_kv_heads, model.kv_cache.shape[3]),
            "all-reduces in the graph": sum("all_reduce" in t for t in targets),
        }
        torch.save(got, f"{results}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))  # 4 heads, 2 key/value heads, 128 columns


def test_two_ranks_over_gloo_give_the_whole_models_logits(tiny, tmp_path):
    want = {
        "op by op": passes(model_of(tiny), compiled=False),
        "compiled": passes(model_of(tiny, pack=False), compiled=True),
    }
    mp.spawn(rank_main, args=(2, free_port(), str(tiny), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["heads"] == (2, 1, 1)  # half of 4 heads and 2 key/value heads, and its cache holds one
        assert got["all-reduces in the graph"] == 2 * 2  # o and down, each of 2 layers, inside one graph
        for mode, logits in want.items():
            assert len(got[mode]) == len(logits), mode
            for g, w in zip(got[mode], logits, strict=True):
                torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5, msg=f"{mode}, rank {rank}")


def test_a_split_the_model_does_not_allow_or_quantized_weights_is_refused_saying_what_works(tiny):
    config = load_model_config(tiny)
    assert tensor_parallel.refusal(config, 2) is None
    why = tensor_parallel.refusal(config, 3)
    assert "must divide the model's attention heads 4, key/value heads 2, MLP columns 128" in why
    assert "use one of 1, 2" in why
    with pytest.raises(ModelLoadError, match="use one of 1, 2"):
        model_of(tiny, tensor_parallel.Shard(0, 3))
    with pytest.raises(ModelLoadError, match="tensor parallelism splits float weights; int8"):
        LlamaModel(tiny, config, SLOTS, MAX_SEQ, torch.bfloat16, torch.device("cpu"), "int8",
                   shard=tensor_parallel.Shard(0, 2))  # fmt: skip


def conversations(engine) -> tuple[list[list[int]], int]:
    """Three conversations of two turns on two slots: the third's prompt takes a slot whose conversation is
    saved to the host KV store, and that conversation's next turn is fetched back from it (prefix reuse across
    moves, saves and fetches). Greedy answers, and the prompt tokens found cached."""
    from neuronfleet.runtime.serving.sampling_params import SamplingParams

    found = []
    engine.step_observers.append(lambda report: found.append(report.reused_prompt_tokens))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    firsts = [[3 + (7 * i + 13 * c) % 400 for i in range(20 + 5 * c)] for c in range(3)]
    answers = []
    for prompt in firsts:
        answers.append(engine.generate([prompt], params)[0].token_ids)
    for c in (0, 1):
        turn = [*firsts[c], *answers[c], 11, 12, 13]
        answers.append(engine.generate([turn], params)[0].token_ids)
    return answers, sum(found)


@pytest.mark.parametrize("compiled", ["off", "aot_eager"])
def test_an_engine_over_two_ranks_answers_as_one_rank_and_finds_the_same_prefixes(
    tiny, smollm2_dir, compiled
):
    """`--tensor-parallel 2` through the engine: rank 0 starts rank 1, tells it each step's work (slot moves,
    host KV saves and fetches, the pass's inputs) and samples; greedy answers and the prompt tokens found
    cached equal one rank's, op by op and compiled; rank 1 stops with the runner."""
    from neuronfleet.runtime.engine.config import RuntimeConfig
    from neuronfleet.runtime.engine.engine import Engine
    from neuronfleet.runtime.engine.model_runner import ModelRunner
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    def engine_of(tp: int) -> Engine:
        config = RuntimeConfig(slots=2, max_seq_len=64, prefill_buckets=[16, 32, 48], decode_buckets=[32, 64],
                               dtype="float32", compiled_steps=compiled, tensor_parallel=tp)  # fmt: skip
        runner = ModelRunner(tiny, config)
        return Engine(runner, Tokenizer(smollm2_dir, runner.model_config.eos_token_ids))

    one = engine_of(1)
    want, want_found = conversations(one)
    two = engine_of(2)
    try:
        assert two.runner.model.config.num_heads == 2 and two.runner.ranks is not None
        got, got_found = conversations(two)
    finally:
        two.runner.close()
    assert got == want and got_found == want_found
    assert want_found > 0 and two.scheduler.store is not None  # (prefixes were found: the test's point)
    assert all(p.exitcode == 0 for p in two.runner.ranks.processes)


def spawned_children(pid: int) -> list[int]:
    """The processes multiprocessing spawned from `pid` (their command lines name its spawn entry)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # (gone meanwhile)
            continue
        if int(fields[1]) == pid and b"multiprocessing.spawn" in command:
            out.append(int(stat.parent.name))
    return out


def listening_addresses(pids: list[int]) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* write them) of the TCP sockets these processes listen
    on."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pids[0]}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                out.add(fields[1].rsplit(":", 1)[0])
    return out


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


def test_a_server_over_three_ranks_answers_the_openai_client_as_one_rank_does(smollm2_dir):
    """`neuronfleet serve --tensor-parallel 3` on SmolLM2 (9 heads, 3 key/value heads: 3 divides both), as a
    user runs it: ready, a greedy chat through the official client equal to one rank's answer, no socket of
    the group open beyond loopback, and a SIGTERM that stops it cleanly, its other ranks with it. A degree
    the model does not allow, or another role, is refused at start saying what works."""
    import openai

    from neuronfleet.runtime.engine.config import RuntimeConfig
    from neuronfleet.runtime.engine.engine import Engine
    from neuronfleet.runtime.serving.sampling_params import SamplingParams

    options = ("--slots", "2", "--max-seq-len", "256", "--dtype", "float32")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reference = Engine.from_model_dir(
        str(smollm2_dir), RuntimeConfig(slots=2, max_seq_len=256, dtype="float32")
    )
    prompt = reference.tokenizer.encode_chat(messages)
    want = reference.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    with running_server(smollm2_dir, *options, "--tensor-parallel", "3") as (base, server):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        answer = client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=12, temperature=0
        )
        assert answer.choices[0].message.content == reference.tokenizer.decode(want)
        ranks = spawned_children(server.popen.pid)
        assert len(ranks) == 2
        # the ranks meet and talk on loopback only: nothing of the group is reachable from another pod (the
        # server's own HTTP port is on 127.0.0.1 here, as the tests bind it)
        listening = listening_addresses([server.popen.pid, *ranks])
        assert listening and listening <= LOOPBACK, listening
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    refusals = [
        (("--tensor-parallel", "2"), "use one of 1, 3"),
        (("--tensor-parallel", "3", "--role", "decode"), "serves role unified only"),
    ]
    for bad, says in refusals:
        run = run_neuronfleet("serve", "--model", str(smollm2_dir), *options, *bad)
        assert run.returncode != 0 and says in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize(
    ("visible", "world", "cores"),
    [
        ("4-7", 4, ["4", "5", "6", "7"]),  # the device plugin's four cores of a pod
        ("0,2-3,8", 3, ["0", "2", "3"]),  # a list of ranges: the first `world`
        (None, 2, ["0", "1"]),  # no list: the runtime sees every core, rank i takes core i
    ],
)
def test_each_rank_takes_one_of_the_pods_neuroncores(visible, world, cores):
    from neuronfleet.runtime.engine.tp_ranks import rank_cores

    assert rank_cores(visible, world) == cores


@pytest.mark.parametrize(
    ("visible", "says"),
    [
        ("4-5", "this pod has 2 (NEURON_RT_VISIBLE_CORES=4-5): request 4 NeuronCores, or serve at --tensor"),
        ("4-x", "expected core indices and ranges, like 0-3 or 0,2"),
        ("7-4", "the range 7-4 runs backwards"),
        ("1,1-3", "names a core twice"),
    ],
)
def test_a_pod_with_too_few_or_unreadable_neuroncores_is_refused_before_any_rank_starts(visible, says):
    from neuronfleet.runtime.engine.tp_ranks import rank_cores

    with pytest.raises(ValueError, match="NEURON_RT_VISIBLE_CORES") as e:
        rank_cores(visible, 4)
    assert says in str(e.value)
