"""Structured outputs and per-request parameters as users run them: an OpenAI batch file whose lines carry their
own response_format and max_tokens, a Parquet column of per-row schemas, and a job-wide schema that cannot
compile."""

import json

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import run_cli
from tests.test_openai_batch import QUESTIONS, SYSTEMS, chat_line, write_jsonl

LABEL = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                          "sure": {"type": "boolean"}}, "required": ["answer", "sure"]}
RATING = {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["stars"]}
UNCOMPILABLE = {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}
FAST = ["engine.kv_cache_tokens=4096", "output.progress=false", "output.plot=false"]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "label", "schema": schema}}


@pytest.fixture(scope="module")
def batch_answers(tmp_path_factory) -> dict[str, dict]:
    """Six lines: four under a schema, one whose schema cannot compile, free lines with max_tokens 2 and 5, and
    one whose max_tokens cannot fit the model's 8192-token context. sampling.ignore_eos=true, so free lines run
    to their max_tokens and constrained ones end when their grammar does."""
    folder = tmp_path_factory.mktemp("structured-batch")
    lines = [chat_line(f"label-{q}", SYSTEMS[0], QUESTIONS[q], response_format=schema_format(LABEL),
                       max_tokens=60) for q in range(3)]
    lines += [chat_line("object", SYSTEMS[1], QUESTIONS[0], response_format={"type": "json_object"}, max_tokens=3),
              chat_line("bad-schema", SYSTEMS[1], QUESTIONS[1], response_format=schema_format(UNCOMPILABLE)),
              chat_line("two", SYSTEMS[1], QUESTIONS[2], max_tokens=2, temperature=0.9, seed=4),
              chat_line("five", SYSTEMS[0], QUESTIONS[0], max_tokens=5),
              chat_line("huge", SYSTEMS[0], QUESTIONS[1], max_tokens=9000)]
    source = folder / "batch.jsonl"
    write_jsonl(source, lines)
    done = run_cli(["batchprefill-run", "data.format=openai_batch", f"data.input={source}",
                    f"output.dir={folder / 'out'}", "sampling.max_tokens=16", "sampling.ignore_eos=true", *FAST])
    assert done.returncode == 0, done.stderr
    return {line["custom_id"]: line for line in map(json.loads, (folder / "out" / "results.jsonl").open())}


def test_batch_lines_with_a_json_schema_response_format_answer_valid_documents(batch_answers):
    for q in range(3):
        body = batch_answers[f"label-{q}"]["response"]["body"]
        assert body["choices"][0]["finish_reason"] == "stop"  # the grammar ended it, though EOS is ignored
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), LABEL)
    content = batch_answers["object"]["response"]["body"]["choices"][0]["message"]["content"]
    assert content.startswith("{")  # json_object, cut at its own max_tokens=3
    assert batch_answers["object"]["response"]["body"]["usage"]["completion_tokens"] == 3


def test_batch_lines_get_their_own_max_tokens_and_unfit_or_uncompilable_lines_get_error_lines(batch_answers):
    usage = {key: batch_answers[key]["response"]["body"]["usage"]["completion_tokens"] for key in ("two", "five")}
    assert usage == {"two": 2, "five": 5}  # not the job's sampling.max_tokens=16
    bad, huge = batch_answers["bad-schema"], batch_answers["huge"]
    assert bad["response"] is None and "cannot be compiled" in bad["error"]["message"]
    assert huge["response"] is None and "max_tokens=9000 exceeds the model's context of 8192" in huge["error"][
        "message"]
    assert len(batch_answers) == 8


def test_a_parquet_schema_column_constrains_each_row_and_a_bad_schema_is_that_rows_error(tmp_path):
    schemas = [json.dumps(RATING), json.dumps(LABEL), "{oops", None]
    source = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": list(range(4)), "prompt": [f"Review {i}: the food was fine." for i in range(4)],
                             "schema": schemas}), source)
    done = run_cli(["batchprefill-run", f"data.input={source}", "data.schema_column=schema",
                    f"output.dir={tmp_path / 'out'}", "sampling.max_tokens=40", *FAST])
    assert done.returncode == 0, done.stderr
    rows = {row["id"]: row for row in pq.read_table(tmp_path / "out" / "results").to_pylist()}
    jsonschema.validate(json.loads(rows[0]["output_text"]), RATING)
    jsonschema.validate(json.loads(rows[1]["output_text"]), LABEL)
    assert rows[2]["finish_reason"] == "error" and "not valid JSON" in rows[2]["error"]
    assert rows[3]["error"] is None and rows[3]["output_token_ids"]  # no schema: free text


def test_a_job_wide_schema_that_cannot_compile_fails_before_the_model_loads_with_one_line(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(UNCOMPILABLE))
    done = run_cli(["batchprefill-run", f"sampling.json_schema={schema}", f"output.dir={tmp_path}", *FAST])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert lines[0].startswith("batchprefill: error: sampling.json_schema") and "cannot be compiled" in lines[0]
    assert not (tmp_path / "results").exists()
