"""Our Llama-family model against Hugging Face transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import platform

import pinned_steps
import pytest
import torch
from support import make_tiny_llama
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from neuronfleet.runtime.engine.config import RuntimeConfig
from neuronfleet.runtime.engine.model_runner import ModelRunner
from neuronfleet.runtime.engine.prefix_cache import MIN_PREFIX_REUSE, PrefixCache
from neuronfleet.runtime.model.llama import HalfWeightLinear, Linear, LlamaModel, PrefillBatch
from neuronfleet.runtime.model.model_config import ModelLoadError, load_model_config

LOGIT_ATOL = 1e-4  # float32, same weights: differences come only from summation order


def reference_logits(model_dir, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def reference_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=n,
        )
    return out[0, len(ids) :].tolist()


def reference_first(model, prompts: list[list[int]]) -> list[int]:
    """Each prompt's first greedy token from transformers."""
    return [reference_greedy(model, ids, 1)[0] for ids in prompts]


class Slots:
    """The runner as the engine drives it: each step reuses the prefixes the slots' caches hold (planned by
    the prefix cache, which then books what the step wrote)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.cache = PrefixCache(runner.config.slots, runner.config.prefix_reuse)

    def step(self, prefill_slots, prompts, decode_slots, tokens, positions) -> tuple[list[int], list[int]]:
        """Greedy: the prompts' first tokens and the decode slots' next ones (`pinned_steps.step`)."""
        return pinned_steps.step(
            self.runner, self.cache, prefill_slots, prompts, decode_slots, tokens, positions
        )

    def admit(self, slots: list[int], prompts: list[list[int]]) -> list[int]:
        """Prefill the prompts into their slots as one group: their first tokens."""
        return self.step(slots, prompts, [], [], [])[0]

    def decode(self, slots: list[int], tokens: list[int], positions: list[int]) -> list[int]:
        return self.step([], [], slots, tokens, positions)[1]

    def prefill_logits(self, tokens: torch.Tensor, last_index: torch.Tensor, slot_ids: torch.Tensor):
        """tokens [P, T] (right-padded to bucket T), last_index [P], slot_ids [P] -> logits [P, vocab]."""
        return self.runner.model.forward(PrefillBatch(tokens, last_index, slot_ids), None)[0]

    def decode_logits(self, tokens: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """tokens [B], positions [B] for slots 0..B-1 over cache length bucket `length` -> logits [B, V]."""
        model = self.runner.model
        return model.forward(None, model.decode_batch(tokens, positions, length, None))[1]


def make_slots(model_dir, **settings) -> Slots:
    """Float32 unless a test asks otherwise: transformers runs float32 here (the default dtype, auto, is
    bfloat16 on CPUs with native bfloat16)."""
    return Slots(ModelRunner(model_dir, RuntimeConfig(**{"dtype": "float32", **settings})))


def our_greedy(runner: Slots, slot: int, ids: list[int], n: int) -> list[int]:
    out = runner.admit([slot], [ids])
    while len(out) < n:
        out += runner.decode([slot], [out[-1]], [len(ids) + len(out) - 1])
    return out


def our_logits_by_decoding(runner: Slots, ids: list[int]) -> torch.Tensor:
    """Logits for every position: prefill the first token, then feed the rest one decode step at a time."""
    rows = [runner.prefill_logits(torch.tensor([ids[:1]]), torch.tensor([0]), torch.tensor([0]))[0]]
    for pos in range(1, len(ids)):
        rows.append(runner.decode_logits(torch.tensor([ids[pos]]), torch.tensor([pos]), 64)[0])
    return torch.stack(rows)


def assert_logits_match(runner: Slots, ids: list[int], ref: torch.Tensor, bucket: int, slot: int) -> None:
    """Our prefill logits (prompt padded to `bucket`) and every decode step's logits equal `ref`."""
    padded = torch.tensor([ids + [0] * (bucket - len(ids))])
    prefill = runner.prefill_logits(padded, torch.tensor([len(ids) - 1]), torch.tensor([slot]))
    torch.testing.assert_close(prefill[0], ref[-1], atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(our_logits_by_decoding(runner, ids), ref, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"num_key_value_heads": 4},
        {"num_key_value_heads": 1, "head_dim": 32},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
    ],
    ids=["untied", "tied", "mha", "mqa-headdim", "llama3-rope", "linear-rope"],
)
def test_tiny_llama_logits_match_transformers(tmp_path, overrides):
    model_dir = make_tiny_llama(tmp_path, **overrides)
    ids = [1, 17, 300, 42, 9, 250, 77, 5, 5, 400, 123, 64, 3]
    ref = reference_logits(model_dir, ids)
    runner = make_slots(model_dir, slots=2, max_seq_len=64, prefill_buckets=[16, 64], decode_buckets=[64])
    assert_logits_match(runner, ids, ref, bucket=16, slot=1)


def test_float32_weights_are_held_once_and_rows_together_match_transformers(tmp_path):
    """On x86, float32 layers multiply through oneDNN's packed weights without keeping the plain ones, and a
    tied LM head reads the embedding table itself (no copy); one row and three rows at once match
    transformers."""
    model_dir = make_tiny_llama(tmp_path, tie_word_embeddings=True)
    ids = [1, 17, 300, 42, 9, 250, 77, 5, 5, 400, 123, 64, 3]
    ref = reference_logits(model_dir, ids)
    runner = make_slots(model_dir, slots=4, max_seq_len=64, prefill_buckets=[16], decode_buckets=[64])
    weights = runner.runner.model.weights
    if platform.machine() in ("x86_64", "AMD64"):
        linears = [getattr(layer, n) for layer in weights.layers for n in ("qkv", "o", "gate_up", "down")]
        assert all(lin.weight is None and lin.packed is not None for lin in linears)
        assert weights.lm_head.packed.data_ptr() == weights.embed.weight.data_ptr()
    assert_logits_match(runner, ids, ref, bucket=16, slot=0)
    padded = torch.tensor([ids + [0] * (16 - len(ids))] * 3)
    together = runner.prefill_logits(padded, torch.tensor([len(ids) - 1] * 3), torch.tensor([1, 2, 3]))
    torch.testing.assert_close(together, ref[-1].expand(3, -1), atol=LOGIT_ATOL, rtol=0)


def rounded_to_float16(model_dir, out, keep=()):
    """The checkpoint with the weights `auto` holds in float16 (the projections, the embedding and the LM
    head) rounded to float16 and back, the norms and the weights named in `keep` as they are: what
    float16-held weights compute on."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight")) and name not in keep:
                tensor.copy_(tensor.half().float())
    model.save_pretrained(out)
    return out


def test_weights_past_float16s_range_are_held_in_float32_not_clamped(tmp_path, float16_weights):
    """fbgemm would clamp a weight past float16's range to 65504: a fused projection (q, k and v of a layer
    together) or an embedding table holding one stays float32, the rest float16, and the logits are
    transformers' on exactly that."""
    model_dir = make_tiny_llama(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = 7e4  # sharpens attention, logits stay small
        model.model.embed_tokens.weight[499, 3] = -7e4  # a token the prompt does not hold
    model.save_pretrained(tmp_path / "big")
    prefix = "model.layers.0.self_attn."
    kept = {prefix + f"{n}_proj.weight" for n in "qkv"} | {"model.embed_tokens.weight"}
    ids = [1, 17, 300, 42, 9, 250, 77, 5, 5, 400, 123, 64, 3]
    ref = reference_logits(rounded_to_float16(tmp_path / "big", tmp_path / "rounded", kept), ids)
    runner = Slots(
        ModelRunner(tmp_path / "big", RuntimeConfig(slots=2, max_seq_len=64, prefill_buckets=[16]))
    )
    weights = runner.runner.model.weights
    assert isinstance(weights.layers[0].qkv, Linear) and isinstance(weights.layers[1].qkv, HalfWeightLinear)
    assert isinstance(weights.lm_head, HalfWeightLinear) and weights.embed.weight.dtype == torch.float32
    assert_logits_match(runner, ids, ref, bucket=16, slot=0)


@pytest.mark.parametrize(
    "overrides",
    [{"tie_word_embeddings": True}, {}, {"attention_bias": True}],
    ids=["tied", "untied", "attention-bias"],
)
def test_float16_held_weights_compute_in_float32_exactly_on_the_rounded_weights(
    tmp_path, float16_weights, overrides
):
    """`auto` on a CPU without native bfloat16 holds the layers, the LM head and the embedding table in
    float16 (fbgemm's float16-weight GEMM) and computes in float32: transformers in float32 on the same
    weights rounded to float16 gives the same logits (summation order aside), one row at a time and three
    rows at once. Against the unrounded weights the difference is the rounding's, which this test tells."""
    model_dir = make_tiny_llama(tmp_path / "m", **overrides)
    ids = [1, 17, 300, 42, 9, 250, 77, 5, 5, 400, 123, 64, 3]
    ref = reference_logits(rounded_to_float16(model_dir, tmp_path / "rounded"), ids)
    assert (reference_logits(model_dir, ids) - ref).abs().max() > 10 * LOGIT_ATOL
    runner = Slots(
        ModelRunner(
            model_dir, RuntimeConfig(slots=4, max_seq_len=64, prefill_buckets=[16], decode_buckets=[64])
        )
    )
    assert (runner.runner.dtype_name, runner.runner.weights_dtype_name) == ("float32", "float16")
    weights, model = runner.runner.model.weights, runner.runner.model
    linears = [getattr(layer, n) for layer in weights.layers for n in ("qkv", "o", "gate_up", "down")]
    assert all(isinstance(x, HalfWeightLinear) for x in [*linears, weights.lm_head])
    assert weights.embed.weight.dtype == torch.float16
    assert weights.norm.weight.dtype == model.kv_cache.dtype == torch.float32
    assert_logits_match(runner, ids, ref, bucket=16, slot=0)
    padded = torch.tensor([ids + [0] * (16 - len(ids))] * 3)
    together = runner.prefill_logits(padded, torch.tensor([len(ids) - 1] * 3), torch.tensor([1, 2, 3]))
    torch.testing.assert_close(together, ref[-1].expand(3, -1), atol=LOGIT_ATOL, rtol=0)
    # an explicit float32 keeps the weights as they are
    exact = ModelRunner(model_dir, RuntimeConfig(slots=1, max_seq_len=64, dtype="float32"))
    assert exact.weights_dtype_name == "float32" and isinstance(exact.model.weights.layers[0].qkv, Linear)


def test_weights_held_in_a_dtype_no_kernel_pairs_with_the_activations_are_refused(tmp_path):
    model_dir = make_tiny_llama(tmp_path)
    with pytest.raises(ModelLoadError, match="float16 weights go with float32 activations on CPU"):
        LlamaModel(
            model_dir, load_model_config(model_dir), 1, 64, torch.bfloat16, torch.device("cpu"),
            weights_dtype=torch.float16,
        )  # fmt: skip


@pytest.mark.parametrize(("dtype", "atol"), [("bfloat16", 0.06), ("float16", 0.01)])
def test_half_precision_logits_match_transformers_within_their_precision(tmp_path, dtype, atol):
    """bfloat16 runs single rows (one decode) through torch's matrix-vector kernel and several rows through
    oneDNN's packed weights; float16 (no AVX512-FP16 here) through the plain kernels. All stay within the
    dtype's rounding of float32 transformers, and a row's logits do not depend on the batch around it."""
    model_dir = make_tiny_llama(tmp_path)
    ids = [1, 17, 300, 42, 9, 250, 77, 5, 5, 400, 123, 64, 3]
    ref = reference_logits(model_dir, ids)
    runner = make_slots(
        model_dir, slots=4, max_seq_len=64, prefill_buckets=[16], decode_buckets=[64], dtype=dtype
    )
    one_by_one = our_logits_by_decoding(runner, ids).float()  # single-row steps
    torch.testing.assert_close(one_by_one, ref, atol=atol, rtol=0)
    padded = torch.tensor([ids + [0] * (16 - len(ids))] * 3)  # three rows at once
    together = runner.prefill_logits(padded, torch.tensor([len(ids) - 1] * 3), torch.tensor([1, 2, 3]))
    torch.testing.assert_close(together.float(), ref[-1].expand(3, -1), atol=atol, rtol=0)
    torch.testing.assert_close(together[0].float(), one_by_one[-1], atol=atol / 2, rtol=0)


def test_tiny_llama_greedy_tokens_match_transformers(tmp_path):
    model_dir = make_tiny_llama(tmp_path, seed=3)
    ref_model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = make_slots(model_dir, slots=4, max_seq_len=128, prefill_buckets=[8, 32])
    for slot, ids in enumerate(
        [[1, 2, 3], [1, 450, 33, 21, 8, 9, 10, 11, 12, 13], [1, *list(range(100, 125))]]
    ):
        assert our_greedy(runner, slot, ids, 40) == reference_greedy(ref_model, ids, 40)


def test_sliding_window_matches_transformers_mistral(tmp_path):
    model_dir = make_tiny_llama(
        tmp_path, architecture="mistral", vocab_size=300, max_position_embeddings=128, sliding_window=8
    )
    ids = list(range(3, 23))
    ref = reference_logits(model_dir, ids)
    runner = make_slots(model_dir, slots=1, max_seq_len=64, prefill_buckets=[32, 64], decode_buckets=[64])
    assert_logits_match(runner, ids, ref, bucket=32, slot=0)


@pytest.mark.real_model
def test_smollm2_matches_transformers(smollm2_dir):
    from neuronfleet.runtime.serving.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    ref_model = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    runner = make_slots(smollm2_dir, slots=2, max_seq_len=256, prefill_buckets=[64, 128])
    prompts = [
        tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
        tok.encode("The three primary colors are"),
        tok.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}]),
    ]
    for ids in prompts:
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids])).logits[0, -1]
        padded = torch.tensor([ids + [0] * (128 - len(ids))])
        ours = runner.prefill_logits(padded, torch.tensor([len(ids) - 1]), torch.tensor([0]))[0]
        torch.testing.assert_close(ours, ref, atol=2e-3, rtol=0)
        assert our_greedy(runner, 1, ids, 24) == reference_greedy(ref_model, ids, 24)


def test_fused_prefill_and_decode_step_equals_separate_passes(tmp_path):
    """Prefilling new prompts in the same pass as other slots' decode changes neither's logits."""
    model_dir = make_tiny_llama(tmp_path, seed=5)
    ref_model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = make_slots(model_dir, slots=4, max_seq_len=64, prefill_buckets=[8, 16])

    old, new = [1, 5, 9, 13, 200], [1, 300, 301, 302, 17, 18, 19, 20, 21]
    first_old = runner.admit([0], [old])[0]
    # slot 2 is prefilled while slot 0 decodes its second token, in one pass
    (first_new,), (second_old,) = runner.step([2], [new], [0], [first_old], [len(old)])
    assert first_new == reference_greedy(ref_model, new, 1)[0]
    assert [first_old, second_old] == reference_greedy(ref_model, old, 2)
    # and both continue correctly afterwards
    a, b = runner.decode([0, 2], [second_old, first_new], [len(old) + 1, len(new)])
    assert [first_old, second_old, a] == reference_greedy(ref_model, old, 3)
    assert [first_new, b] == reference_greedy(ref_model, new, 2)


@pytest.mark.parametrize("architecture", ["llama", "mistral"])
def test_prompts_reusing_a_slots_cached_prefix_match_transformers(tmp_path, architecture):
    """A prompt that starts like what its slot last held skips those tokens' prefill (its cache already has
    their keys and values); its tokens still equal transformers', alone and in a group with a prompt that
    reuses nothing, and across cache blocks."""
    extra = {"sliding_window": 12} if architecture == "mistral" else {}
    model_dir = make_tiny_llama(tmp_path, seed=7, architecture=architecture, **extra)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = make_slots(model_dir, slots=4, max_seq_len=128, prefill_buckets=[8, 16, 48])
    shared = [1, *range(40, 80)]  # 41 tokens: more than one cache block
    first = our_greedy(runner, 0, [*shared, 7, 8], 6)
    assert first == reference_greedy(ref_model, [*shared, 7, 8], 6)
    # slot 0 now holds shared + [7, 8] + 5 generated tokens: the next prompt reuses the 41 shared ones
    follow = [*shared, 9, 10, 11]
    assert runner.cache.reusable(0, follow) == len(shared)
    assert runner.cache.reusable(1, follow) == 0  # never used
    assert our_greedy(runner, 0, follow, 8) == reference_greedy(ref_model, follow, 8)
    # one prefill group: slot 0 reuses (a prompt that is the held one plus more), slot 1 starts from scratch
    again, fresh = [*follow, 99, 98], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert runner.cache.reusable(0, again) == len(follow)
    assert runner.admit([0, 1], [again, fresh]) == reference_first(ref_model, [again, fresh])


def test_a_prefix_held_by_another_slot_is_copied_and_matches_transformers(tmp_path):
    model_dir = make_tiny_llama(tmp_path, seed=11)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = make_slots(model_dir, slots=3, max_seq_len=128, prefill_buckets=[8, 16, 48])
    shared = [1, *range(60, 100)]  # 41 tokens
    base = [*shared, 5]
    assert our_greedy(runner, 0, base, 4) == reference_greedy(ref_model, base, 4)
    a, b = [*shared, 7, 8, 9], [*shared, 10, 11]
    # a goes into slot 1 and b into slot 2, in one group: both copy the shared 41 tokens from slot 0
    assert runner.cache.plan([1, 2], [a, b]) == [(0, len(shared)), (0, len(shared))]
    first = runner.admit([1, 2], [a, b])
    assert first == reference_first(ref_model, [a, b])
    out = runner.decode([1, 2], first, [len(a), len(b)])
    assert out == [reference_greedy(ref_model, a, 2)[1], reference_greedy(ref_model, b, 2)[1]]
    # a slot this group writes into is still a source: its copy is read before the pass writes it (slot 0
    # holds base; a prompt of its own goes there, and the second prompt copies base from it first)
    other, longer = [1, 9, 9, 9], [*base, 3]
    assert runner.cache.plan([0, 1], [other, longer]) == [(0, 0), (0, len(base))]
    assert runner.admit([0, 1], [other, longer]) == reference_first(ref_model, [other, longer])


def test_a_slot_an_earlier_prompt_of_the_group_copied_into_is_no_source(tmp_path):
    """Copies run in the group's order: after one lands in a slot, that slot no longer holds what it did."""
    model_dir = make_tiny_llama(tmp_path, seed=13)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = make_slots(model_dir, slots=3, max_seq_len=128, prefill_buckets=[8, 16, 48])
    p0, p1 = [1, *range(20, 40)], [1, *range(60, 75)]  # what slots 0 and 1 hold
    runner.admit([0, 1], [p0, p1])
    a, b = [*p0, 5], [*p1, 6]  # a goes into slot 1 (copying p0 from slot 0 over p1); b into slot 2
    assert runner.cache.plan([1, 2], [a, b]) == [(0, len(p0)), (2, 0)]
    assert runner.admit([1, 2], [a, b]) == reference_first(ref_model, [a, b])


@pytest.mark.parametrize("architecture", ["llama", "mistral"])
def test_prompts_with_one_token_left_decode_it_and_match_transformers(tmp_path, architecture):
    """A prompt whose every token but the last is cached (in its own slot, or copied from another) runs that
    token as a decode row, beside running requests and a prompt prefilled in the same step: every first
    token is transformers', each slot's keys and values are those a whole prefill writes, and all continue
    as transformers do. So does a one-token prompt, which has nothing cached."""
    extra = {"sliding_window": 12} if architecture == "mistral" else {}
    model_dir = make_tiny_llama(tmp_path, seed=17, architecture=architecture, **extra)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    settings = dict(slots=6, max_seq_len=128, prefill_buckets=[8, 16, 48])
    runner = make_slots(model_dir, **settings)
    held = [1, *range(100, 130)]  # 31 tokens, slot 0's after its first request
    running = [1, 7, 7, 8, 9]
    runner.admit([0, 5], [held, running])
    again = [*held, 200]  # slot 0 holds all of it but its last token
    elsewhere = [*held, 201]  # into slot 1, its prefix copied from slot 0 first
    fresh = [1, 44, 45, 46, 47, 48]  # nothing cached: a prefill
    one = [3]  # one token, nothing cached
    slots, prompts = [1, 0, 2, 3], [elsewhere, again, fresh, one]
    assert runner.cache.plan(slots, prompts) == [(0, len(held)), (0, len(held)), (2, 0), (3, 0)]
    second = reference_greedy(ref_model, running, 2)  # slot 5 decodes its second token in the same step
    first, (decoded,) = runner.step(slots, prompts, [5], [second[0]], [len(running)])
    assert first == reference_first(ref_model, prompts)
    assert decoded == second[1]
    whole = make_slots(model_dir, **settings)  # the same prompts prefilled whole, prompt i into slot i
    whole.admit(list(range(len(prompts))), prompts)
    for i, (slot, ids) in enumerate(zip(slots, prompts, strict=True)):
        ours, reference = runner.runner.export_kv(slot, len(ids)), whole.runner.export_kv(i, len(ids))
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    out = runner.decode(slots, first, [len(ids) for ids in prompts])
    assert out == [reference_greedy(ref_model, ids, 2)[1] for ids in prompts]


def test_prefix_reuse_off_prefills_everything(tmp_path):
    model_dir = make_tiny_llama(tmp_path, seed=7)
    runner = make_slots(model_dir, slots=1, max_seq_len=64, prefill_buckets=[16, 32], prefix_reuse=False)
    ids = list(range(1, 20))
    our_greedy(runner, 0, ids, 3)
    assert runner.cache.reusable(0, ids) == 0


def test_a_short_or_whole_common_prefix_is_not_reused(tmp_path):
    """Fewer than MIN_PREFIX_REUSE common tokens are prefilled again, and a prompt's last token always is."""
    model_dir = make_tiny_llama(tmp_path, seed=7)
    runner = make_slots(model_dir, slots=1, max_seq_len=64, prefill_buckets=[16, 32])
    ids = list(range(1, 21))
    our_greedy(runner, 0, ids, 3)
    assert runner.cache.reusable(0, ids) == len(ids) - 1
    assert runner.cache.reusable(0, [*ids[: MIN_PREFIX_REUSE - 1], 250, 251]) == 0
    assert runner.cache.reusable(0, [*ids[:MIN_PREFIX_REUSE], 250]) == MIN_PREFIX_REUSE
