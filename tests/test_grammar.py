"""Structured outputs on SmolLM2's real tokenizer: argmax loops over random logits, masked by the grammar, must
produce documents that parse and validate, choices that are exactly one choice, and regex full matches."""

import json
import re

import jsonschema
import pytest
import torch

from batchprefill.constraint import Constraint, GrammarError, job_constraint
from batchprefill.engine.grammar import GrammarBatch, Grammars

VOCAB, EOS = 49152, 2
LABEL_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "spam": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["label", "stars", "spam", "note"],
}


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, VOCAB, [EOS], threads=2)


def argmax_loop(batch: GrammarBatch, rows: list[int], steps: int, seed: int) -> dict[int, list[int]]:
    """Greedy decoding of random logits under the masks, as the engine's step would do it; rows stop on EOS."""
    generator = torch.Generator().manual_seed(seed)
    outputs = {row: [] for row in rows}
    live = list(rows)
    for _ in range(steps):
        if not live:
            break
        logits = torch.randn(len(live), VOCAB, generator=generator)
        bitmask = batch.fill_bitmask(live)
        batch.apply(logits, bitmask)
        for row, token in zip(live, logits.argmax(dim=-1).tolist()):
            assert batch.advance(row, token)
            outputs[row].append(token)
        live = [row for row in live if outputs[row][-1] != EOS]
    assert not live, f"rows {live} never reached EOS in {steps} steps"
    return outputs


def texts(tokenizer, outputs: dict[int, list[int]]) -> dict[int, str]:
    return {row: tokenizer.decode(tokens[:-1]) for row, tokens in outputs.items()}


def test_64_rows_of_greedy_labelling_json_all_parse_and_validate(grammars, tokenizer):
    batch = GrammarBatch(grammars, max_rows=64, threads=2)
    for row in range(64):
        batch.set(row, Constraint.json_schema(json.dumps(LABEL_SCHEMA)))
    outputs = argmax_loop(batch, list(range(64)), steps=120, seed=0)
    assert all(batch.is_finished(row) for row in range(64))
    documents = [json.loads(text) for text in texts(tokenizer, outputs).values()]
    for document in documents:
        jsonschema.validate(document, LABEL_SCHEMA)
    assert len({json.dumps(d, sort_keys=True) for d in documents}) > 1  # random logits: not one fixed answer
    assert len(grammars.compiled) == 1  # 64 rows, one schema: one compile


def test_a_schema_given_with_other_formatting_reuses_the_compiled_grammar(grammars):
    grammars.compile(Constraint.json_schema(LABEL_SCHEMA))
    before = len(grammars.compiled)
    grammars.compile(Constraint.json_schema(json.dumps(LABEL_SCHEMA, indent=4)))
    assert len(grammars.compiled) == before


def test_choice_outputs_are_exactly_one_of_three_choices(grammars, tokenizer):
    choices = ["yes", "no", "not sure (maybe)"]
    batch = GrammarBatch(grammars, max_rows=16, threads=2)
    for row in range(16):
        batch.set(row, Constraint.choice(choices))
    outputs = texts(tokenizer, argmax_loop(batch, list(range(16)), steps=30, seed=1))
    assert set(outputs.values()) <= set(choices)
    assert len(set(outputs.values())) > 1


def test_regex_outputs_fullmatch_an_order_number_pattern(grammars, tokenizer):
    pattern = r"ORD-\d{4}-[A-Z]{2}"
    batch = GrammarBatch(grammars, max_rows=16, threads=2)
    for row in range(16):
        batch.set(row, Constraint.regex(pattern))
    outputs = texts(tokenizer, argmax_loop(batch, list(range(16)), steps=40, seed=2))
    assert all(re.fullmatch(pattern, text) for text in outputs.values()), outputs


def test_json_object_allows_only_tokens_opening_an_object_and_accepts_a_nested_one(grammars, tokenizer):
    batch = GrammarBatch(grammars, max_rows=1, threads=2)
    batch.set(0, Constraint.from_response_format({"type": "json_object"}))
    logits = torch.zeros(1, VOCAB)
    batch.apply(logits, batch.fill_bitmask([0]))
    first = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert first and all(tokenizer.decode([token]).startswith("{") for token in first)
    assert tokenizer.encode_batch(["["])[0][0] not in first
    for token in tokenizer.encode_batch(['{"a": [1, {"b": null}], "c": "}"}'])[0] + [EOS]:
        assert batch.advance(0, token)
    assert batch.is_finished(0)


def test_unconstrained_rows_in_a_mixed_batch_keep_every_token(grammars):
    batch = GrammarBatch(grammars, max_rows=4, threads=2)
    batch.set(1, Constraint.choice(["A", "B"]))
    batch.set(3, Constraint.choice(["A", "B"]))
    logits = torch.zeros(4, VOCAB)
    batch.apply(logits, batch.fill_bitmask([0, 1, 2, 3]))
    allowed = torch.isfinite(logits).sum(dim=-1).tolist()
    assert allowed[0] == allowed[2] == VOCAB
    assert 2 <= allowed[1] == allowed[3] < 10  # "A", "B" and tokens starting them; never the whole vocabulary


def test_a_step_with_no_constrained_row_gets_no_bitmask(grammars):
    batch = GrammarBatch(grammars, max_rows=4, threads=2)
    batch.set(0, Constraint.choice(["A"]))
    batch.clear(0)
    assert batch.fill_bitmask([0, 1]) is None


def test_a_completed_grammar_allows_only_eos_and_then_is_finished(grammars, tokenizer):
    batch = GrammarBatch(grammars, max_rows=1, threads=2)
    batch.set(0, Constraint.choice(["Paris"]))
    for token in tokenizer.encode_batch(["Paris"])[0]:
        assert batch.advance(0, token)
    logits = torch.zeros(1, VOCAB)
    batch.apply(logits, batch.fill_bitmask([0]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    assert not batch.is_finished(0)
    assert batch.advance(0, EOS) and batch.is_finished(0)


def test_a_token_the_grammar_rejects_is_reported(grammars, tokenizer):
    batch = GrammarBatch(grammars, max_rows=1, threads=2)
    batch.set(0, Constraint.choice(["yes", "no"]))
    assert not batch.advance(0, tokenizer.encode_batch(["maybe"])[0][0])


def test_one_batched_advance_moves_every_constrained_row_and_reports_each_rejection(grammars, tokenizer):
    batch = GrammarBatch(grammars, max_rows=4, threads=2)
    for row in (0, 1, 3):
        batch.set(row, Constraint.choice(["yes", "no"]))
    yes, maybe = tokenizer.encode_batch(["yes"])[0][0], tokenizer.encode_batch(["maybe"])[0][0]
    # rows 0 and 3 take "yes", row 1 is handed "maybe", row 2 is unconstrained and takes anything
    assert batch.advance_rows([0, 1, 2, 3], [yes, maybe, maybe, yes]) == [True, False, True, True]
    logits = torch.zeros(3, VOCAB)
    batch.apply(logits, batch.fill_bitmask([0, 2, 3]))
    # the advanced rows now allow only what completes "yes" (EOS once it is done), row 2 still everything
    allowed = torch.isfinite(logits).sum(dim=-1).tolist()
    assert allowed[1] == VOCAB and 1 <= allowed[0] == allowed[2] < 10


@pytest.mark.parametrize(("constraint", "message"), [
    (lambda: Constraint.json_schema('{"type": "nonsense"}'), "json_schema cannot be compiled: Unsupported type"),
    (lambda: Constraint.json_schema("{not json"), "json_schema is not valid JSON"),
    (lambda: Constraint.regex("(unclosed"), "regex cannot be compiled: Regex parsing error"),
    (lambda: Constraint.choice([]), "choice must be a non-empty list"),
    (lambda: Constraint.from_response_format({"type": "xml"}), "response_format type 'xml'"),
])
def test_a_constraint_that_cannot_compile_raises_a_one_line_grammar_error(grammars, constraint, message):
    with pytest.raises(GrammarError, match=re.escape(message)) as raised:
        GrammarBatch(grammars, max_rows=1, threads=2).set(0, constraint())
    assert "\n" not in str(raised.value) and "/project/" not in str(raised.value)


def test_a_bad_schema_on_1000_rows_fails_to_compile_once(grammars):
    bad = Constraint.json_schema({"type": "object", "properties": {"x": {"$ref": "#/missing"}}})
    batch = GrammarBatch(grammars, max_rows=1, threads=2)
    for _ in range(1000):
        with pytest.raises(GrammarError):
            batch.set(0, bad)
    assert isinstance(grammars.compiled[bad], GrammarError)


def test_job_constraint_reads_a_schema_file_and_refuses_two_constraints(tmp_path):
    path = tmp_path / "label.json"
    path.write_text(json.dumps(LABEL_SCHEMA))
    assert job_constraint(str(path), None, None) == Constraint.json_schema(LABEL_SCHEMA)
    assert job_constraint('{"type": "integer"}', None, None) == Constraint("json_schema", '{"type":"integer"}')
    assert job_constraint(None, None, ["a", "b"]) == Constraint.choice(["a", "b"])
    assert job_constraint(None, None, None) is None
    with pytest.raises(GrammarError, match="choose one constraint"):
        job_constraint(None, "a+", ["a"])
    with pytest.raises(GrammarError, match="does not exist"):
        job_constraint(str(tmp_path / "missing.json"), None, None)
