"""Structured outputs through the engine on the real model: greedy JSON-Schema labelling validates, choices are
exactly one choice, regexes fullmatch, a bad schema is that request's error, and prefix sharing is unchanged."""

import json
import re

import jsonschema
import pytest

from batchprefill.constraint import Constraint
from batchprefill.engine.grammar import Grammars
from batchprefill.engine.request import Request, with_samples
from batchprefill.engine.structured import StructuredOutputs
from batchprefill.sampling_params import SamplingParams

LABEL_SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "enum": ["geography", "science", "literature", "other"]},
                   "difficulty": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["topic", "difficulty"],
}


@pytest.fixture(scope="module")
def grammars(tokenizer, loaded_model) -> Grammars:
    config = loaded_model.model.config
    return Grammars(tokenizer, config.vocab_size, config.eos_token_ids, threads=2)


def generate(make_engine, grammars, prompts, constraints, **params) -> list[Request]:
    """One engine run, request i under constraints[i] (None: free), all in the same steps."""
    engine = make_engine(structured=StructuredOutputs(grammars, 256, threads=2))
    requests = [Request(i, list(p), SamplingParams(constraint=c, **params))
                for i, (p, c) in enumerate(zip(prompts, constraints))]
    done = {r.request_id: r for r in engine.generate(requests)}
    return [done[i] for i in range(len(prompts))]


def test_greedy_json_schema_labels_of_six_chats_all_parse_validate_and_keep_the_schemas_key_order(
        make_engine, grammars, chat_prompts):
    schema = Constraint.json_schema(LABEL_SCHEMA)
    outputs = generate(make_engine, grammars, chat_prompts[:6], [schema] * 6, max_tokens=60)
    for request in outputs:
        assert request.finish_reason == "stop", request.output_text
        document = json.loads(request.output_text)
        jsonschema.validate(document, LABEL_SCHEMA)
        assert list(document) == ["topic", "difficulty"]


def test_choice_outputs_are_exactly_one_of_three_choices_and_two_free_rows_beside_them_stay_free(
        make_engine, grammars, chat_prompts):
    choices = ["yes", "no", "maybe"]
    constraints = [Constraint.choice(choices), None] * 2
    outputs = generate(make_engine, grammars, chat_prompts[:4], constraints, max_tokens=8)
    free = generate(make_engine, grammars, chat_prompts[:4], [None] * 4, max_tokens=8)
    for index, request in enumerate(outputs):
        if constraints[index] is None:  # the same greedy tokens as in a run without any constraint
            assert request.output_token_ids == free[index].output_token_ids
        else:
            assert request.output_text in choices and request.finish_reason == "stop"


def test_regex_outputs_fullmatch_a_code_like_ab_123_and_sharing_is_as_without_constraints(
        make_engine, grammars, chat_prompts):
    pattern = r"[A-Z]{2}-[0-9]{3}"
    outputs = generate(make_engine, grammars, chat_prompts[:4], [Constraint.regex(pattern)] * 4, max_tokens=10)
    free = generate(make_engine, grammars, chat_prompts[:4], [None] * 4, max_tokens=1)
    assert all(re.fullmatch(pattern, request.output_text) for request in outputs)
    assert [r.num_cached_tokens for r in outputs] == [r.num_cached_tokens for r in free]
    assert sum(r.num_cached_tokens for r in outputs) > 0  # the shared system prompt was reused


def test_a_schema_that_cannot_compile_is_its_requests_error_and_the_others_run(make_engine, grammars, chat_prompts):
    bad = Constraint.json_schema({"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}})
    outputs = generate(make_engine, grammars, chat_prompts[:3], [bad, Constraint.json_object(), None],
                       max_tokens=8)
    assert outputs[0].finish_reason == "error" and "cannot be compiled" in outputs[0].error
    assert outputs[0].output_token_ids == []
    assert outputs[1].error is None and outputs[1].output_text.startswith("{")  # cut at 8 tokens: unfinished
    assert outputs[2].error is None and outputs[2].output_token_ids


def test_constrained_samples_report_the_raw_distribution_of_their_first_token_like_the_first_sample(
        make_engine, grammars, chat_prompts):
    # the unconstrained first step's top 5 is the raw distribution every sample's first entry must show, the
    # forked samples 1 and 2 included (they draw from the masked row, but report the raw one)
    free = make_engine().generate([Request(0, list(chat_prompts[0]), SamplingParams(max_tokens=1, logprobs=5))])
    (reference,) = [r.output_top_logprobs[0] for r in free]
    engine = make_engine(structured=StructuredOutputs(grammars, 256, threads=2))
    params = SamplingParams(max_tokens=3, logprobs=5, n=3, temperature=1.0, seed=3,
                            constraint=Constraint.choice(["yes", "no"]))
    samples = list(engine.generate([with_samples(Request(0, list(chat_prompts[0]), params))]))
    assert sorted(r.sample_index for r in samples) == [0, 1, 2]
    for request in samples:
        assert request.output_text in ("yes", "no")
        first = request.output_top_logprobs[0]
        assert [t for t, _ in first] == [t for t, _ in reference]
        assert max(abs(v - w) for (_, v), (_, w) in zip(first, reference)) < 1e-5
