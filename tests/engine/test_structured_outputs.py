"""Structured outputs in the engine (engine/structured): every constrained output follows its
constraint whatever the model (the tiny random one here), in the batch with unconstrained rows
that stay exactly as they are alone; a request resumed from its tokens (a migration, the decode
side of a hand-off) continues exactly; speculative drafts are cut to what the grammar allows and
verified under the mask, the output unchanged; bad constraints are refused naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pdserve.engine import LLM, SamplingParams, StructuredOutputsParams
from pdserve.engine.structured import GrammarState, StructuredError, check_structured
from pdserve.engine.structured.bitmask import allocate, allowed, apply
from pdserve.engine.structured.grammars import special_tokens_cleared
from pdserve.engine.tokenizer import load_tokenizer
from tests.conftest import assert_no_leak, random_prompts

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
                         "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                  "required": ["city"]}},
          "required": ["name", "age", "tags", "home"]}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe not"]
SPECS = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
         StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(json_object=True),
         StructuredOutputsParams(grammar='root ::= "(" [a-c] [a-c]? [a-c]? ")"')]


def follows(spec: StructuredOutputsParams, text: str) -> bool:
    kind, _ = spec.kind()
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), json.loads(spec.json))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "json_object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\([a-c]{1,3}\)", text) is not None


@pytest.fixture(scope="module")
def llm(tiny_qwen3: str) -> LLM:
    return LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=512)


def test_every_constrained_output_follows_its_constraint_greedy_and_sampled(llm: LLM) -> None:
    prompts = random_prompts(len(SPECS) * 2, 4, 30, seed=1)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=80,
                             structured_outputs=SPECS[i // 2]) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    special = set(load_tokenizer(llm.config.model).all_special_ids)
    for p, out in zip(params, outs):
        assert out.finish_reason == "stop", (p.structured_outputs.kind(), out.text)
        assert follows(p.structured_outputs, out.text), (p.structured_outputs.kind(), out.text)
        assert not special & set(out.token_ids[:-1]), out.token_ids   # no special token inside the text
    assert_no_leak(llm)


def test_json_strings_never_hold_a_raw_control_character(llm: LLM) -> None:
    """xgrammar's bounded-length strings (maxLength) allow control characters; JSON does not, and
    compact JSON never needs one: the engine keeps such tokens out of JSON grammars. (This prompt's
    greedy answer wrote \x1f into the string before.)"""
    spec = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 25,
              "maxItems": 40}, "b": {"type": "string", "maxLength": 30}}, "required": ["a", "b"]})
    outs = llm.generate(random_prompts(3, 5, 20, seed=45), SamplingParams(temperature=0.0, max_tokens=300,
                                                                          structured_outputs=spec))
    for out in outs:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


def test_each_constrained_row_keeps_out_only_what_its_own_grammar_does(llm: LLM) -> None:
    """A JSON row and a regex row that needs a newline, in one batch, either first: the JSON row's
    control-character exclusion does not reach the regex row (nor the other way round)."""
    json_spec = StructuredOutputsParams(json={"type": "object", "properties": {"b": {"type": "string", "maxLength": 30}},
                                              "required": ["b"]})
    lines = StructuredOutputsParams(regex=r"[a-c]\n[a-c]")
    short, long = random_prompts(2, 4, 4, seed=7)[0], random_prompts(1, 30, 30, seed=8)[0]
    for prompts, params in (([short, long], [json_spec, lines]), ([long, short], [json_spec, lines])):
        outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=p)
                                      for p in params])
        assert isinstance(json.loads(outs[0].text), dict), outs[0].text
        assert re.fullmatch(r"[a-c]\n[a-c]", outs[1].text), outs[1].text


def test_special_tokens_are_kept_out_of_every_grammar_but_the_stop_tokens(llm: LLM) -> None:
    tok = load_tokenizer(llm.config.model)
    vocab = llm.engine.model_config.vocab_size
    stops = sorted(llm.engine.eos_token_ids)
    keep = allowed(special_tokens_cleared(tok, vocab, stops), vocab)[0]
    special = set(tok.all_special_ids) - set(stops)
    assert special and not any(keep[t] for t in special) and all(keep[t] for t in stops)
    assert int(keep.sum()) == vocab - len({t for t in special if t < vocab})


def test_unconstrained_rows_are_untouched_by_constrained_ones_in_their_batch(llm: LLM) -> None:
    prompts = random_prompts(4, 5, 20, seed=2)
    plain = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.8, seed=5, max_tokens=12)]
    alone = llm.generate(prompts[:2], plain)
    mixed = llm.generate(prompts, plain + [SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=s)
                                           for s in SPECS[:2]])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]


def test_a_request_resumed_from_its_tokens_continues_exactly(llm: LLM) -> None:
    """A migrated request (and the decode side of a hand-off) rebuilds the grammar's state from
    the tokens it already has: the rest is what the uninterrupted request generates."""
    prompt = random_prompts(1, 12, 12, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=SPECS[0])
    whole = llm.generate([prompt], params)[0].token_ids
    engine = llm.engine
    for cut in (1, 5, len(whole) // 2):
        engine.add_request(f"resume-{cut}", prompt, params, output_token_ids=whole[:cut])
        rest = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                rest += out.new_token_ids
        assert whole[:cut] + rest == whole
    assert_no_leak(llm)


def test_tokens_outside_the_grammar_are_refused_when_resuming(llm: LLM) -> None:
    tok = load_tokenizer(llm.config.model)
    bad = tok.encode("xyz", add_special_tokens=False)
    with pytest.raises(ValueError, match="does not follow the request's structured_outputs"):
        llm.engine.add_request("bad-resume", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=10,
                                                                        structured_outputs=SPECS[1]),
                               output_token_ids=bad)
    assert not llm.engine.has_unfinished_requests()


def test_speculative_decoding_verifies_under_the_mask_with_the_same_output(tiny_qwen3: str, llm: LLM) -> None:
    spec_llm = LLM(tiny_qwen3, dtype="float32", block_size=8, num_kv_blocks=512,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                       "prompt_lookup_min": 1, "adaptive_depth": False})
    tok = load_tokenizer(tiny_qwen3)
    # prompts that hold JSON like the answer: the n-gram proposer drafts from them
    prefix = tok.encode('{"name": "ab", "age": 7, "tags": ["red"], "home": {"city": "x"}} ' * 2,
                        add_special_tokens=False)
    prompts = [prefix + p for p in random_prompts(3, 3, 8, seed=4)]
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=SPECS[0]),
              SamplingParams(temperature=0.9, seed=11, max_tokens=80, structured_outputs=SPECS[0]),
              SamplingParams(temperature=0.0, max_tokens=30),
              # penalties see row j's draft prefix as output: the same tokens as plain decoding
              SamplingParams(temperature=0.0, max_tokens=40, presence_penalty=0.3, frequency_penalty=0.2,
                             repetition_penalty=1.2, ignore_eos=True)]
    prompts.append(prefix + random_prompts(1, 3, 8, seed=5)[0])
    plain = llm.generate(prompts, params)
    fast = spec_llm.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert spec_llm.engine.speculator.stats.num_draft_tokens > 0
    assert_no_leak(spec_llm)


def test_a_draft_is_cut_where_the_grammar_forbids_and_rows_are_masked_after_each_prefix(llm: LLM) -> None:
    tok = load_tokenizer(llm.config.model)
    compiled = llm.engine.grammars.compile(SPECS[1])   # [0-9]{3}-[a-z]{2,4}
    state = GrammarState(compiled)
    draft = tok.encode("12a", add_special_tokens=False)
    valid = state.valid_prefix(draft)
    assert tok.decode(valid) in ("12", "1", "")    # "a" cannot follow two digits
    assert len(valid) < len(draft)
    digits = tok.encode("123", add_special_tokens=False)
    rows = list(range(len(digits) + 1))
    mask = allocate(len(rows), llm.engine.model_config.vocab_size)
    state.fill(mask, rows, digits)
    ok = allowed(mask, llm.engine.model_config.vocab_size)
    dash = tok.encode("-", add_special_tokens=False)
    assert len(dash) == 1
    assert not ok[0, dash[0]] and ok[-1, dash[0]] == (len(tok.decode(digits)) == 3)
    assert state.accept(digits[0])   # fill left the state where it was


def test_the_grammar_wins_over_min_tokens_and_ends_the_request(llm: LLM) -> None:
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30,
                                                   structured_outputs=SPECS[2]))[0]
    assert out.text in CHOICES and out.finish_reason == "stop"
    assert_no_leak(llm)


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputsParams(json='{"type": "objx"}'), "structured_outputs.json"),
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputsParams(choice=[]), "structured_outputs.choice"),
    (StructuredOutputsParams(regex="a", choice=["b"]), "structured_outputs must set exactly one"),
    (StructuredOutputsParams(regex="x" * (65 << 10)), "structured_outputs.regex is"),
])
def test_bad_constraints_are_refused_naming_the_field(llm: LLM, spec: StructuredOutputsParams, field: str) -> None:
    with pytest.raises(ValueError) as info:
        check_structured(spec)
    assert str(info.value).startswith(field) and len(str(info.value)) < 300
    with pytest.raises(ValueError, match=re.escape(field.split(" ")[0])):
        llm.generate([[1, 2]], SamplingParams(max_tokens=4, structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


def test_compile_errors_are_structured_errors_without_the_library_s_source_location(llm: LLM) -> None:
    with pytest.raises(StructuredError) as info:
        llm.engine.grammars.compile(StructuredOutputsParams(regex="a(b"))
    assert ".cc:" not in str(info.value) and "not closed" in str(info.value)


def test_bitmask_unpack_matches_xgrammar_s_own_apply() -> None:
    xgr = pytest.importorskip("xgrammar")
    vocab = 1000
    g = torch.Generator().manual_seed(0)
    mask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(3, vocab, generator=g)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, mask)
    ours = logits.masked_fill(~allowed(mask, vocab), float("-inf"))
    assert torch.equal(ours, theirs)
    for dtype in (torch.float32, torch.bfloat16):
        added = logits.to(dtype)
        apply(added, mask)
        assert torch.equal(added, logits.to(dtype).masked_fill(~allowed(mask, vocab), float("-inf")))
