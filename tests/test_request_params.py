"""Per-request sampling parameters: each row's settings from its partition's columns, the job's where a row sets
none, shared between rows that agree; and on the real model, two requests with different max_tokens and
temperatures in the same steps really get their own."""

import json
from dataclasses import replace

import pyarrow as pa

from batchprefill.constraint import Constraint
from batchprefill.engine.request import Request
from batchprefill.io.columns import ERROR, TOKENS, Columns
from batchprefill.io.openai_batch import SAMPLING_COLUMNS
from batchprefill.pipeline.request_params import max_output_tokens, may_be_constrained, partition_sampling
from batchprefill.sampling_params import SamplingParams

COLUMNS = Columns(prompt="prompt", id="id", system=None, namespace=None, schema="schema",
                  sampling=tuple(field.name for field in SAMPLING_COLUMNS))
DEFAULT = SamplingParams(max_tokens=64, temperature=0.0, stop=("END",), seed=5)
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def partition(rows: list[dict], tokens: list[int] | None = None) -> pa.Table:
    """A partition's columns as the OpenAI batch reader leaves them; 10 prompt tokens a row unless given."""
    fields = [*SAMPLING_COLUMNS, pa.field("schema", pa.string())]
    table = pa.Table.from_pylist([{f.name: row.get(f.name) for f in fields} for row in rows], pa.schema(fields))
    lengths = tokens or [10] * len(rows)
    return (table.append_column(TOKENS, pa.array([[1] * n for n in lengths], pa.list_(pa.int32())))
            .append_column(ERROR, pa.array([None if n else "earlier error" for n in lengths], pa.string())))


def params_of(table: pa.Table, max_positions: int = 8192) -> tuple[list[SamplingParams], list[str | None]]:
    sampling = partition_sampling(table, COLUMNS, DEFAULT, max_positions)
    return [sampling.settings[i] for i in sampling.index.tolist()], sampling.errors


def test_1000_rows_in_two_settings_share_two_objects_and_nulls_take_the_jobs_values():
    rows = [{"max_tokens": 5, "temperature": 0.7} if i % 2 else {} for i in range(1000)]
    params, errors = params_of(partition(rows))
    assert errors == [None] * 1000
    assert len({id(p) for p in params}) == 2
    assert params[0] == DEFAULT
    assert params[1] == SamplingParams(max_tokens=5, temperature=0.7, stop=("END",), seed=5)


def test_each_column_lands_in_its_field():
    rows = [{"top_p": 0.9, "n": 3, "stop": ["\n", "###"], "seed": 11, "logprobs": True, "top_logprobs": 4},
            {"stop": [], "logprobs": True},  # stop: [] clears the job's stops; logprobs alone: 0 alternatives
            {"logprobs": False},
            {"response_format": json.dumps({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})},
            {"schema": json.dumps(SCHEMA)},
            {"response_format": json.dumps({"type": "json_object"})}]
    first, second, third, fourth, fifth, sixth = params_of(partition(rows))[0]
    assert (first.top_p, first.n, first.stop, first.seed, first.logprobs) == (0.9, 3, ("\n", "###"), 11, 4)
    assert (second.stop, second.logprobs) == ((), 0)
    assert third.logprobs is None
    assert fourth.constraint == fifth.constraint == Constraint.json_schema(SCHEMA)
    assert sixth.constraint == Constraint.json_object()


def test_a_bad_schema_and_a_prompt_that_leaves_no_room_for_its_max_tokens_are_error_rows():
    rows = [{"schema": "{not json"}, {"max_tokens": 95}, {"max_tokens": 90}, {}, {"max_tokens": 200}]
    params, errors = params_of(partition(rows, tokens=[10, 10, 10, 10, 0]), max_positions=100)
    assert "json_schema is not valid JSON" in errors[0]
    assert "plus max_tokens=95 exceeds the model's context of 100" in errors[1]
    assert errors[2] is None and params[2].max_tokens == 90
    assert "max_tokens=64" not in (errors[3] or "")  # 10 + the job's 64 fit in 100
    assert errors[4] == "earlier error"  # a row already in error keeps its own message


def test_the_pool_and_the_grammar_see_each_rows_own_max_tokens_and_constraints():
    rows = [{"max_tokens": 5}, {}, {"response_format": json.dumps({"type": "text"})}]
    table = partition(rows)
    assert max_output_tokens(table, DEFAULT) == 5 + 64 + 64
    assert not may_be_constrained(table, COLUMNS)  # type text is no constraint
    assert may_be_constrained(partition([{}, {"schema": json.dumps(SCHEMA)}]), COLUMNS)


def test_two_requests_with_different_max_tokens_and_temperatures_in_one_step_get_their_own(
        make_engine, chat_prompts):
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    hot = SamplingParams(max_tokens=7, temperature=1.5, seed=3, ignore_eos=True)
    engine = make_engine()
    together = {r.request_id: r for r in engine.generate([Request(0, list(chat_prompts[0]), greedy),
                                                          Request(1, list(chat_prompts[1]), hot)])}
    assert any(step.num_decode_tokens == 2 for step in engine.counters.steps)  # both decoded in one step
    assert len(together[0].output_token_ids) == 3 and len(together[1].output_token_ids) == 7
    alone_greedy = next(make_engine().generate([Request(0, list(chat_prompts[0]), greedy)]))
    alone_hot = next(make_engine().generate([Request(1, list(chat_prompts[1]), hot)]))
    cold = next(make_engine().generate([Request(1, list(chat_prompts[1]), replace(hot, temperature=0.0))]))
    assert together[0].output_token_ids == alone_greedy.output_token_ids
    assert together[1].output_token_ids == alone_hot.output_token_ids
    assert together[1].output_token_ids != cold.output_token_ids  # temperature 1.5 drew off the greedy path
