"""The HF adapter on real tiny architectures: tree verification, greedy == HF greedy, refusals, bf16."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_tiny import ARCHITECTURES, full_last_logits, hf_greedy, noisy_copy, tiny_model

import spectr
from spectr.hf import HFCausalLM
from spectr.kv_cache import tree_attention

PROMPTS = [[3, 17, 42, 8, 1], [9], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
METHODS = ["autoregressive", "speculative", "spectr", "specinfer", "block"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch_pair(request):
    target = tiny_model(request.param, vocab_size=64, init_std=0.2, seed=3)
    # a draft that agrees with the target often but not always, so greedy runs both accept and reject
    draft = noisy_copy(target, noise_std=0.05, seed=4)
    return request.param, target, draft


@torch.inference_mode()
def test_tree_forward_matches_separate_full_forwards(arch_pair):
    """Prefix in the cache, then K=3 branches of L=2 tokens in ONE forward == each path run alone."""
    _, target, _ = arch_pair
    model = HFCausalLM(target)
    prompts = [[3, 17, 42, 8, 1], [9, 2]]
    branches = torch.tensor([[[4, 5], [6, 7], [4, 9]], [[1, 1], [2, 3], [60, 61]]])  # [B, K, L]
    cache = model.new_cache(2, 32)
    from spectr.generate import prefill

    prefill(model, cache, prompts, torch.device("cpu"))
    lengths = cache.rows.lengths  # [B] = prompt length - 1
    num_drafts, draft_length = 3, 2
    nodes = 1 + num_drafts * draft_length
    depth = torch.tensor([0] + [1 + j for _ in range(num_drafts) for j in range(draft_length)])
    visible = torch.zeros(nodes, nodes, dtype=torch.bool)
    visible[:, 0] = True
    for k in range(num_drafts):
        for j in range(draft_length):
            node = 1 + k * draft_length + j
            visible[node, 1 + k * draft_length : node + 1] = True
    tokens = torch.cat([torch.tensor([[p[-1]] for p in prompts]), branches.reshape(2, -1)], 1)  # [B, T]
    slots = lengths[:, None] + torch.arange(nodes)
    allowed = tree_attention(lengths, visible, int(lengths.max()) + nodes)
    logits = model.forward(tokens, lengths[:, None] + depth, allowed, cache, slots)  # [B, T, V]
    for b, prompt in enumerate(prompts):
        sequences = [prompt]
        node_index = [0]
        for k in range(num_drafts):
            for j in range(draft_length):
                sequences.append(prompt + branches[b, k, : j + 1].tolist())
                node_index.append(1 + k * draft_length + j)
        torch.testing.assert_close(logits[b, node_index], full_last_logits(target, sequences), atol=1e-4, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equals_hugging_face_greedy(arch_pair, method):
    arch, target, draft = arch_pair
    out = spectr.generate(target, draft, PROMPTS, method=method, num_drafts=3, draft_length=3,
                          max_new_tokens=12, temperature=0.0, seed=[1, 2, 3])
    expected = [hf_greedy(target, prompt, 12) for prompt in PROMPTS]
    assert out.tokens == expected, arch
    if method != "autoregressive":
        # the noisy draft is right often enough that some iterations yield several tokens
        assert out.stats.block_efficiency > 1.0
        assert out.stats.acceptance_rate < 1.0


def test_unequal_vocabularies_name_both_sizes():
    target = tiny_model(vocab_size=64)
    draft = tiny_model(vocab_size=48, seed=1)
    with pytest.raises(ValueError, match=r"target vocab size 64.*draft vocab size 48"):
        spectr.generate(target, draft, [[1, 2]], method="spectr", max_new_tokens=2)


def test_model_without_attention_mask_support_names_the_model_type():
    config = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4)
    mamba = transformers.MambaForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"draft model type 'mamba'.*position_ids"):
        spectr.generate(tiny_model(), mamba, [[1, 2]], method="spectr", max_new_tokens=2)
    with pytest.raises(ValueError, match=r"target model type 'mamba'"):
        spectr.generate(mamba, None, [[1, 2]], method="autoregressive", max_new_tokens=2)


def test_attention_implementation_that_cannot_take_the_mask_names_model_type_and_implementation():
    llama = tiny_model()
    llama.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"target model type 'llama'.*'flex_attention'.*sdpa"):
        spectr.generate(llama, tiny_model(), [[1, 2]], method="spectr", max_new_tokens=2)


def test_eager_attention_works_like_sdpa():
    eager = tiny_model("llama", init_std=0.2, seed=3, attn_implementation="eager")
    sdpa = tiny_model("llama", init_std=0.2, seed=3)
    kwargs = dict(method="spectr", num_drafts=2, draft_length=2, max_new_tokens=8, temperature=0.0)
    assert (spectr.generate(eager, noisy_copy(eager, 0.05, 4), PROMPTS, **kwargs).tokens
            == spectr.generate(sdpa, noisy_copy(sdpa, 0.05, 4), PROMPTS, **kwargs).tokens)


def test_sequences_beyond_a_sliding_window_are_refused():
    mistral = tiny_model("mistral")
    mistral.config.sliding_window = 8
    with pytest.raises(ValueError, match=r"prompt 1: 10 tokens exceed.*sliding window 8.*mistral"):
        spectr.generate(mistral, None, [[1], [1, 2, 3, 4]], method="autoregressive", max_new_tokens=6)
    # within the window it runs
    out = spectr.generate(mistral, None, [[1, 2]], method="autoregressive", max_new_tokens=6, temperature=0)
    assert out.tokens == [hf_greedy(mistral, [1, 2], 6)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", METHODS)
def test_half_precision_models_run_every_method_and_keep_consistent_caches(method, dtype):
    from spectr.generate import Generation

    target = tiny_model("llama", init_std=0.2, seed=3, dtype=dtype)
    draft = noisy_copy(target, 0.05, 4)
    generation = Generation(target, draft, PROMPTS, method=method, num_drafts=2, draft_length=3,
                            max_new_tokens=30, seed=[7, 8, 9])
    with torch.inference_mode():
        generation.start()
        for _ in range(3):
            generation.step()
        lengths = generation.rows.target_cache.rows.lengths
        slots = lengths[:, None]
        allowed = tree_attention(lengths, torch.ones(1, 1, dtype=torch.bool), int(lengths.max()) + 1)
        cached = generation.target.forward(generation.rows.pending[:, None], slots, allowed,
                                           generation.rows.target_cache, slots)[:, 0]
    sequences = generation.row_sequences()
    assert cached.dtype == dtype
    full = full_last_logits(target, sequences)
    # bf16 keeps ~3 significant digits (fp16 ~4): compare at that precision
    torch.testing.assert_close(cached.float(), full.float(), atol=0.05 * float(full.abs().max()), rtol=0)
    out = spectr.generate(target, draft, PROMPTS, method=method, num_drafts=2, draft_length=3,
                          max_new_tokens=10, seed=[7, 8, 9])
    assert [len(t) for t in out.tokens] == [10, 10, 10]
    assert all(0 <= t < 64 for row in out.tokens for t in row)


# --- grouped-query attention without repeating K/V ----------------------------------------------


class _Attention(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("groups,new", [(1, 5), (2, 1), (4, 7), (3, 6)])
def test_grouped_attention_equals_the_stock_sdpa_path(groups, new):
    """Folding query groups into the query axis equals transformers' repeat-K/V sdpa to float tolerance."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from spectr.hf import grouped_query_attention

    g = torch.Generator().manual_seed(groups * 10 + new)
    batch, kv_heads, slots, dim = 3, 2, 11, 8
    query = torch.randn(batch, kv_heads * groups, new, dim, generator=g)
    key = torch.randn(batch, kv_heads, slots, dim, generator=g)
    value = torch.randn(batch, kv_heads, slots, dim, generator=g)
    allowed = torch.rand(batch, new, slots, generator=g) < 0.6
    allowed[..., 0] = True  # every query sees something
    mask = torch.zeros(batch, 1, new, slots).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    module = _Attention(groups)
    ours, _ = grouped_query_attention(module, query, key, value, mask, scaling=0.3)
    stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.shape == stock.shape == (batch, new, kv_heads * groups, dim)
    torch.testing.assert_close(ours, stock, atol=1e-6, rtol=1e-5)
    # a wrong fold (query heads of different KV heads interleaved) is not close: the check can fail
    interleaved = query.view(batch, groups, kv_heads, new, dim).transpose(1, 2).reshape(query.shape)
    wrong, _ = grouped_query_attention(module, interleaved, key, value, mask, scaling=0.3)
    if groups > 1:
        assert not torch.allclose(wrong, stock, atol=1e-3)


@torch.inference_mode()
def test_engine_forwards_use_the_grouped_attention_and_match_eager():
    """A GQA model's tree forward through HFCausalLM runs spectr_sdpa, equals the eager model, and
    leaves the model's own attention setting as it was."""
    from spectr.generate import prefill
    from spectr.hf import GROUPED_ATTENTION

    sdpa = tiny_model("llama", num_heads=4, num_kv_heads=1, init_std=0.2, seed=3)
    eager = tiny_model("llama", num_heads=4, num_kv_heads=1, init_std=0.2, seed=3, attn_implementation="eager")
    calls = []
    import spectr.hf as hf

    original = hf.grouped_query_attention
    from transformers.modeling_utils import AttentionInterface

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    AttentionInterface.register(GROUPED_ATTENTION, counting)
    try:
        outputs = []
        for model in (sdpa, eager):
            lm = HFCausalLM(model)
            cache = lm.new_cache(2, 16)
            prefill(lm, cache, [[3, 4, 5, 6], [7, 8]], torch.device("cpu"))
            lengths = cache.rows.lengths
            visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
            slots = lengths[:, None] + torch.arange(3)
            allowed = tree_attention(lengths, visible, int(lengths.max()) + 3)
            outputs.append(lm.forward(torch.tensor([[6, 1, 2], [8, 9, 9]]), lengths[:, None] + torch.tensor([0, 1, 1]),
                                      allowed, cache, slots))
    finally:
        AttentionInterface.register(GROUPED_ATTENTION, original)
    assert len(calls) == 2 * 2  # prefill + tree forward, 2 layers each, sdpa model only
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
