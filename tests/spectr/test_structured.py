"""Structured outputs in the engine (`spectr.structured`, `RowWarps` with grammars), on tiny HF models.

- The row setting, in vLLM's names: `parse_structured` reads json / json_object / regex / choice / grammar (+
  whitespace_pattern), refuses unknown keys with the list of known ones and names an invalid schema, regex or
  grammar; a spec is compiled once per compiler, whatever the number of rows.
- The batched engine follows the masked target law: chi-square of the first 3 tokens of 3000 rows against an
  enumeration that masks every prefix with its own grammar state (spectr K = 2 in the default suite, every method
  under `slow`); negative control: the engine's masks computed from the committed tokens only (each node's path
  ignored) is rejected by the same test.
- Greedy rows under every method equal a slow reference loop (full forwards, argmax of the masked logits), and the
  sampled rows that end on EOS fullmatch their regex / equal a choice.
- A grammar with no allowed token is the row's error, not a crash of the batch; rows without a grammar build no
  grammar state.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch
from hf_tiny import tiny_model
from scipy.stats import chi2

from spectr.batching import ContinuousBatcher
from spectr.generate import generate
from spectr.structured import NO_STOP, RowGrammars, StructuredCompiler, StructuredSpec, parse_structured
from spectr.warps import SamplingWarp

VOCAB = 8
EOS = 7
PROMPT = [1, 2, 3]
LENGTH = 3
SAMPLES = 3000
ACCEPT_P = 1e-3
REJECT_P = 1e-6
PROJECT_ROOT = Path(__file__).resolve().parents[2]
ENDLESS = {"regex": "(ab|ba|c)*"}  # never completes: every row runs its 3 tokens (no EOS needed)


class TinyTokenizer:
    eos_token_id = EOS
    bos_token_id = None
    tokens = [b"a", b"b", b"c", b"ab", b"ba", b"x", b"y", b"<eos>"]
    special_token_ids = [EOS]

    def __call__(self, text):
        data = text if isinstance(text, bytes) else text.encode()
        return [self.tokens.index(bytes([c])) for c in data]


def text_of(tokens):
    return b"".join(TinyTokenizer.tokens[t] for t in tokens if t != EOS).decode()


@pytest.fixture(scope="module")
def compiler():
    return StructuredCompiler(TinyTokenizer(), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, init_std=0.5,
                        seed=1)
    draft = tiny_model(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, init_std=0.5,
                       seed=2)
    return target, draft


# --- the setting -----------------------------------------------------------------------------------------------


def test_parse_reads_vllms_keys():
    assert parse_structured(None) is None and parse_structured({}) is None
    assert parse_structured({"regex": "a+"}) == StructuredSpec("regex", "a+")
    assert parse_structured('{"choice": ["x", "y"]}') == StructuredSpec("choice", '["x", "y"]')
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert parse_structured({"json": schema}) == parse_structured({"json": '{"properties": {"n": {"type": '
                                                                            '"integer"}}, "type": "object"}'})
    assert parse_structured({"json_object": True}).kind == "json_object"
    assert parse_structured({"grammar": 'start: "yes" | "no"'}).kind == "grammar"
    assert parse_structured({"grammar": 'root ::= "yes" | "no"'}).kind == "grammar"  # GBNF, converted
    assert parse_structured({"json": schema, "whitespace_pattern": " ?"}).whitespace_pattern == " ?"


@pytest.mark.parametrize(("value", "message"), [
    ({"regexp": "a"}, "unknown key(s) regexp; known: json, json_object, regex, choice, grammar"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({"regex": "(ab"}, "invalid regex"),
    ({"json": '{"type": "object"'}, "json is not a JSON schema"),
    ({"json": {"type": "objekt"}}, "invalid json"),
    ({"grammar": "start: undefined_rule"}, "invalid grammar"),
    ({"grammar": 'root ::= ("a"'}, "invalid grammar"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"json_object": "yes"}, "json_object must be true"),
    (["regex"], "expected an object"),
])
def test_parse_refuses_bad_input_naming_the_problem(value, message):
    with pytest.raises(ValueError, match="where: ") as error:
        parse_structured(value, "where")
    assert message in str(error.value)


def test_a_spec_is_compiled_once_for_many_rows(pair, compiler):
    fresh = StructuredCompiler(TinyTokenizer(), vocab_size=VOCAB)
    generate(pair[0], pair[1], [PROMPT] * 40, method="spectr", num_drafts=2, draft_length=2, max_new_tokens=2,
             structured_outputs=ENDLESS, tokenizer=fresh)
    assert fresh.compiled == 1


def test_generate_needs_the_tokenizer_and_names_the_bad_prompt(pair):
    with pytest.raises(ValueError, match="need the tokenizer"):
        generate(pair[0], pair[1], [PROMPT], structured_outputs=ENDLESS)
    with pytest.raises(ValueError, match=r"prompt 1: structured_outputs: invalid regex"):
        generate(pair[0], pair[1], [PROMPT] * 2, structured_outputs=[ENDLESS, {"regex": "(("}],
                 tokenizer=TinyTokenizer())


# --- the law ---------------------------------------------------------------------------------------------------


@torch.inference_mode()
def masked_joint_distribution(model, compiler, spec, length=LENGTH, temperature=1.0) -> torch.Tensor:
    """P(first `length` tokens) by enumeration, each prefix's logits masked by its own grammar state: [V^length]."""
    grammars = RowGrammars(1, VOCAB)
    grammars.set([0], [spec.with_compiler(compiler)], [[]])
    joint = torch.ones((), dtype=torch.float64)
    for depth in range(length):
        prefixes = list(itertools.product(range(VOCAB), repeat=depth))
        ids = torch.tensor([PROMPT + list(p) for p in prefixes])
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()  # [V^depth, V]
        masks = [grammars._node_mask(0, p) for p in prefixes]  # None: a prefix the grammar refuses (no mass)
        allowed = torch.stack([torch.ones(VOCAB, dtype=torch.bool) if m is None else m for m in masks])
        probs = SamplingWarp(temperature).probs(logits.masked_fill(~allowed, -float("inf")))
        joint = joint.unsqueeze(-1) * probs.to(torch.float64).reshape([VOCAB] * (depth + 1))
    return joint.reshape(-1)


@pytest.fixture(scope="module")
def endless_law(pair, compiler):
    return masked_joint_distribution(pair[0], compiler, parse_structured(ENDLESS))


def chi_square_pvalue(tokens, exact: torch.Tensor) -> float:
    samples = torch.tensor(tokens)  # [N, 3]
    codes = (samples[:, 0] * VOCAB + samples[:, 1]) * VOCAB + samples[:, 2]
    counts = torch.bincount(codes, minlength=VOCAB**LENGTH).to(torch.float64)
    if counts[exact == 0].sum() > 0:
        return 0.0  # a continuation the masked target can never produce
    expected = exact * samples.shape[0]
    large = expected >= 5
    observed = torch.cat([counts[large], counts[~large].sum().reshape(1)])
    cells = torch.cat([expected[large], expected[~large].sum().reshape(1)])
    keep = cells > 0
    statistic = float(((observed[keep] - cells[keep]) ** 2 / cells[keep]).sum())
    return float(chi2.sf(statistic, int(keep.sum()) - 1))


def sample(pair, compiler, method, num_drafts, draft_length, samples=SAMPLES):
    spec = parse_structured(ENDLESS).with_compiler(compiler)
    batcher = ContinuousBatcher(*pair, batch_size=samples, max_length=len(PROMPT) + LENGTH, method=method,
                                num_drafts=num_drafts, draft_length=draft_length)
    batcher.admit([PROMPT] * samples, max_new_tokens=LENGTH, seed=list(range(samples)),
                  warps=[SamplingWarp(1.0, structured=spec)] * samples)
    return [row.tokens for row in sorted(batcher.finished(), key=lambda row: row.request)]


def test_the_enumeration_sees_the_mask(pair, compiler, endless_law):
    """The masked law differs from the plain one, puts no mass on refused sequences, and the mask depends on the
    path (after "a" only "b" / "ba" may follow)."""
    law = endless_law.reshape([VOCAB] * LENGTH)
    assert law[5].sum() == 0 and law[:, 5].sum() == 0 and law[0, 0].sum() == 0 and law[0, 1].sum() > 0
    plain = masked_joint_distribution(pair[0], compiler, parse_structured({"regex": "[abcxy]*"}))
    assert (plain - endless_law).abs().sum() > 0.5


CASES = [("autoregressive", 1, 1), ("speculative", 1, 3), ("block", 1, 3), ("spectr", 3, 2), ("specinfer", 3, 2),
         ("traversal", 3, 2)]
# the default suite runs block and spectr on the tiny models; every method under `slow` (the enumeration tests
# cover every method in the default suite)
GRID = [case if case[0] in ("block", "spectr") else pytest.param(*case, marks=pytest.mark.slow) for case in CASES]


def test_rows_with_a_grammar_follow_the_masked_target_law(pair, compiler, endless_law):
    assert chi_square_pvalue(sample(pair, compiler, "spectr", 2, 2), endless_law) > ACCEPT_P


@pytest.mark.slow
@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), CASES)
def test_every_method_follows_the_masked_target_law(pair, compiler, endless_law, method, num_drafts, draft_length):
    assert chi_square_pvalue(sample(pair, compiler, method, num_drafts, draft_length), endless_law) > ACCEPT_P


@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), [("spectr", 2, 2), ("block", 1, 3)])
def test_negative_control_masks_from_the_committed_tokens_only_are_rejected(pair, compiler, endless_law,
                                                                          monkeypatch, method, num_drafts,
                                                                          draft_length):
    committed_only = RowGrammars._node_bits
    monkeypatch.setattr(RowGrammars, "_node_bits", lambda self, slot, path: committed_only(self, slot, ()))
    assert chi_square_pvalue(sample(pair, compiler, method, num_drafts, draft_length), endless_law) < REJECT_P


# --- greedy and the outputs ------------------------------------------------------------------------------------


@torch.inference_mode()
def greedy_reference(model, compiler, spec, prompt, steps, stops=(EOS,)):
    grammars = RowGrammars(1, VOCAB)
    grammars.set([0], [spec.with_compiler(compiler)], [list(stops)])
    out = []
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([prompt + out]), use_cache=False).logits[0, -1].float()
        mask = grammars._node_mask(0, tuple(out))
        token = int(logits.masked_fill(~mask, -float("inf")).argmax())
        out.append(token)
        if token in stops:
            break
    return out


PROMPTS = [[1, 2, 3], [4], [6, 6, 0, 1], [3, 2]]
GRAMMARS = [{"regex": "(ab|b)+c"}, {"choice": ["abc", "ba", "cab"]}, {"regex": "c(a|b)*x"}, {"regex": "b+y?"}]


@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), GRID)
def test_greedy_rows_equal_a_slow_masked_reference(pair, compiler, method, num_drafts, draft_length):
    out = generate(pair[0], None if method == "autoregressive" else pair[1], PROMPTS, method=method,
                   num_drafts=num_drafts, draft_length=draft_length, max_new_tokens=8, temperature=0.0,
                   eos_token_id=EOS, structured_outputs=GRAMMARS, tokenizer=compiler)
    for prompt, grammar, tokens in zip(PROMPTS, GRAMMARS, out.tokens):
        assert tokens == greedy_reference(pair[0], compiler, parse_structured(grammar), prompt, 8)


@pytest.mark.parametrize(("method", "num_drafts", "draft_length"), GRID[1:])
def test_sampled_rows_that_end_match_their_grammar(pair, compiler, method, num_drafts, draft_length):
    count = 48
    out = generate(pair[0], pair[1], PROMPTS * (count // len(PROMPTS)), method=method, num_drafts=num_drafts,
                   draft_length=draft_length, max_new_tokens=10, eos_token_id=EOS, seed=3,
                   structured_outputs=GRAMMARS * (count // len(GRAMMARS)), tokenizer=compiler)
    ended = 0
    for row, tokens in enumerate(out.tokens):
        text = text_of(tokens)
        grammar = GRAMMARS[row % len(GRAMMARS)]
        if tokens and tokens[-1] == EOS:
            ended += 1
            assert (text in grammar["choice"]) if "choice" in grammar else re.fullmatch(grammar["regex"], text)
        else:  # the budget: a prefix of a match (no refused token)
            assert len(tokens) == 10 and EOS not in tokens
    assert ended >= count // 4


def test_a_dead_end_is_the_rows_error_not_a_crash(pair, compiler):
    """"cx" then nothing but a stop token: a row without stop tokens (ignore_eos) has no allowed token there. The
    pool runs on; the row's error says why (the other row is untouched)."""
    spec = parse_structured({"regex": "cx"}).with_compiler(compiler)
    batcher = ContinuousBatcher(*pair, batch_size=2, max_length=len(PROMPT) + 6, method="spectr", num_drafts=2,
                                draft_length=2)
    batcher.admit([PROMPT, PROMPT], max_new_tokens=6, seed=[0, 1], stop_token_ids=[[], None],
                  warps=[SamplingWarp(1.0, structured=spec), SamplingWarp(1.0)])
    rows = list(batcher.finished())
    assert len(rows) == 2
    assert batcher.row_warps.grammar_error(0) == NO_STOP and batcher.row_warps.grammar_error(1) is None
    assert [text_of(row.tokens)[:2] for row in sorted(rows, key=lambda r: r.request)][0] == "cx"
    first, second = sorted(rows, key=lambda r: r.request)
    assert first.finish_reason == "error" and NO_STOP in first.error and second.error is None


def test_rows_without_a_grammar_build_no_grammar_state(pair):
    batcher = ContinuousBatcher(*pair, batch_size=2, max_length=8, method="spectr", num_drafts=2, draft_length=2)
    batcher.admit([PROMPT, PROMPT], max_new_tokens=3, warps=[SamplingWarp(0.7), SamplingWarp(1.0, top_k=3)])
    list(batcher.finished())
    assert batcher.row_warps.grammars is None and batcher.row_warps.penalties is None


# --- the other kinds, on the embedded pair's tokenizer ---------------------------------------------------------


@pytest.mark.skipif(not (PROJECT_ROOT / "assets/models/target/config.json").exists(), reason="no embedded pair")
def test_json_object_lark_and_gbnf_rows_on_the_embedded_pair():
    """json_object (any JSON object, compact), a Lark grammar and a GBNF one (converted): every row that stops is
    valid; the kinds share one compiler (one compilation each)."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = PROJECT_ROOT / "assets/models"
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    target, draft = (AutoModelForCausalLM.from_pretrained(root / name) for name in ("target", "draft"))
    kinds = [{"json_object": True, "disable_any_whitespace": True}, {"grammar": 'start: "yes" | "no" | "maybe"'},
             {"grammar": 'root ::= "red" | "green" ("ish")?'}]
    compiler = StructuredCompiler(tokenizer, vocab_size=target.config.vocab_size)
    prompts = [tokenizer(text)["input_ids"] for text in ("def f(x):", "import os", "class A:")]
    out = generate(target, draft, prompts * 2, method="spectr", num_drafts=2, draft_length=3, max_new_tokens=40,
                   eos_token_id=tokenizer.eos_token_id, seed=1, structured_outputs=kinds * 2, tokenizer=compiler)
    checks = [lambda t: isinstance(json.loads(t), dict), lambda t: t in ("yes", "no", "maybe"),
              lambda t: t in ("red", "green", "greenish")]
    stopped = 0
    for row, tokens in enumerate(out.tokens):
        if tokens and tokens[-1] == tokenizer.eos_token_id:
            stopped += 1
            assert checks[row % 3](tokenizer.decode(tokens[:-1])), tokenizer.decode(tokens)
    assert stopped >= 4 and compiler.compiled == 3
