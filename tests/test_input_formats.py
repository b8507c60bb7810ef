"""Input formats as users hand them over: JSON Lines and CSV, chosen by data.format or by the file's suffix, give
the results of the same rows in Parquet; a damaged line or row is one error line naming its file; pre-tokenized
prompts give the output of the text they came from; a polars-written file's large_string and large_list columns
serve every column key."""

import csv
import json
import re
import sys
from pathlib import Path

import jsonschema
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchprefill.errors import JobError
from batchprefill.io.formats import open_dataset, resolve_input
from batchprefill.io.input_format import record_batches
from batchprefill.model.loader import read_model_config
from tests.conftest import REPO, run_cli

FAST = ["sampling.max_tokens=8", "engine.kv_cache_tokens=4096", "output.progress=false", "output.plot=false"]
ROWS = [{"id": 0, "prompt": "What is the capital of France?"},
        {"id": 1, "prompt": 'Name three colors, please.\nOne "word" each.'},  # a comma, quotes and a newline
        {"id": 2, "prompt": "What is 2+2?"},
        {"id": 3, "prompt": "Who wrote Hamlet?"}]
OUTPUT = ["id", "output_text", "output_token_ids", "num_prompt_tokens", "finish_reason", "error"]
RATING = {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["stars"]}


def command(name: str, *overrides: str):
    """`python -m batchprefill.<name>` on this checkout's code, as a user runs it."""
    return run_cli([sys.executable, "-m", f"batchprefill.{name}", *FAST, *overrides], env={"PYTHONPATH": str(REPO)})


def results(out: Path, *overrides: str, columns: list[str] = OUTPUT) -> list[dict]:
    done = command("run", f"output.dir={out}", *overrides)
    assert done.returncode == 0, done.stderr
    return sorted(pq.read_table(out / "results", columns=columns).to_pylist(), key=lambda row: row[columns[0]])


def the_error_line(done) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("batchprefill: error: "), done.stderr
    return lines[0]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


@pytest.fixture(scope="module")
def from_parquet(tmp_path_factory) -> list[dict]:
    """The 4 rows' results read from Parquet: what every other format must give."""
    folder = tmp_path_factory.mktemp("parquet")
    pq.write_table(pa.Table.from_pylist(ROWS), folder / "rows.parquet")
    rows = results(folder / "out", f"data.input={folder / 'rows.parquet'}")
    assert [row["error"] for row in rows] == [None] * 4 and all(row["output_token_ids"] for row in rows)
    return rows


# --- JSON Lines and CSV ------------------------------------------------------------------------------------------


def test_4_rows_from_a_jsonl_and_a_csv_file_read_by_their_suffix_give_the_parquet_results(from_parquet, tmp_path):
    jsonl = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    table = write_csv(tmp_path / "rows.csv", ROWS)
    assert results(tmp_path / "from-jsonl", f"data.input={jsonl}") == from_parquet
    assert results(tmp_path / "from-csv", f"data.input={table}") == from_parquet


def test_a_folder_of_2_jsonl_files_and_a_glob_of_2_txt_files_as_csv_by_data_format_give_the_parquet_results(
        from_parquet, tmp_path):
    (tmp_path / "lines").mkdir()
    write_jsonl(tmp_path / "lines" / "a.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "lines" / "b.jsonl", ROWS[2:])
    write_csv(tmp_path / "part-0.txt", ROWS[:3])
    write_csv(tmp_path / "part-1.txt", ROWS[3:])
    assert results(tmp_path / "from-jsonl", f"data.input={tmp_path / 'lines'}", "data.format=jsonl") == from_parquet
    assert results(tmp_path / "from-csv", f"data.input={tmp_path}/part-*.txt", "data.format=csv") == from_parquet


def test_the_default_format_reads_jsonl_and_csv_by_suffix_and_a_folder_holding_parquet_stays_parquet(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS)
    write_csv(tmp_path / "b.csv", ROWS)
    assert resolve_input(str(tmp_path / "a.jsonl"), "parquet") == ([tmp_path / "a.jsonl"], "jsonl")
    assert resolve_input(f"{tmp_path}/*.csv", "parquet") == ([tmp_path / "b.csv"], "csv")
    (tmp_path / "lines").mkdir()
    write_jsonl(tmp_path / "lines" / "c.jsonl", ROWS)
    assert resolve_input(str(tmp_path / "lines"), "parquet") == ([tmp_path / "lines" / "c.jsonl"], "jsonl")
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "lines" / "d.parquet")
    assert resolve_input(str(tmp_path / "lines"), "parquet") == ([tmp_path / "lines" / "d.parquet"], "parquet")
    with pytest.raises(JobError, match=re.escape("data.format='tsv': choose parquet, datasets, jsonl, csv or "
                                                 "openai_batch")):
        resolve_input(str(tmp_path / "b.csv"), "tsv")


def read_rows(path: str) -> tuple[str, list[dict]]:
    """The format the default data.format reads `path` in, and its rows."""
    files, fmt = resolve_input(path, "parquet")
    return fmt, [row for batch in record_batches(open_dataset(files, fmt), 3) for row in batch.to_pylist()]


def test_gzip_and_bzip2_jsonl_and_csv_files_a_glob_and_a_folder_of_them_read_the_same_4_rows(tmp_path):
    import bz2
    import gzip

    plain_jsonl, plain_csv = write_jsonl(tmp_path / "rows.jsonl", ROWS), write_csv(tmp_path / "rows.csv", ROWS)
    folder = tmp_path / "compressed"
    folder.mkdir()
    for plain, packer, ending in ((plain_jsonl, gzip, ".gz"), (plain_csv, gzip, ".gz"), (plain_jsonl, bz2, ".bz2"),
                                  (plain_csv, bz2, ".bz2")):
        (folder / f"{plain.suffix[1:]}{ending}").mkdir(exist_ok=True)
        (folder / f"{plain.suffix[1:]}{ending}" / f"{plain.name}{ending}").write_bytes(packer.compress(
            plain.read_bytes()))
    for kind in ("jsonl", "csv"):
        for ending in (".gz", ".bz2"):
            sub = folder / f"{kind}{ending}"
            for given in (str(sub / f"rows.{kind}{ending}"), str(sub / "*"), str(sub)):
                assert read_rows(given) == (kind, ROWS), given


def test_a_json_array_a_tsv_file_and_gzip_under_a_parquet_name_are_named_for_what_they_look_like(tmp_path):
    import gzip

    (tmp_path / "rows.json").write_text(json.dumps(ROWS))
    (tmp_path / "rows.tsv").write_text("id\tprompt\n0\tWhat is 2+2?\n")
    (tmp_path / "rows.parquet").write_bytes(gzip.compress(b'{"id": 0}\n'))
    for name, looks in (("rows.json", "a JSON array: write one JSON object a line"),
                        ("rows.tsv", "tab-separated text: CSV input is comma-separated"),
                        ("rows.parquet", "gzip-compressed data: name it .jsonl.gz or .csv.gz")):
        with pytest.raises(JobError, match=rf"{name} is not Parquet: it starts with .*, which looks like {looks}"):
            read_rows(str(tmp_path / name))


def test_an_empty_jsonl_file_is_said_to_be_empty_not_to_lack_a_prompt_column(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(JobError, match=r"^data\.input: .*empty\.jsonl holds no JSON lines \(empty\)"):
        read_rows(str(tmp_path / "empty.jsonl"))


def test_a_jsonl_column_null_on_its_first_12000_lines_and_text_after_them_reads_as_text(tmp_path):
    """12,000 lines of about 100 bytes fill more than the first megabyte, which fixes pyarrow's types."""
    rows = [{"id": i, "prompt": "p" * 80, "system": None if i < 12_000 else "Be brief."} for i in range(12_010)]
    dataset = open_dataset(*resolve_input(str(write_jsonl(tmp_path / "rows.jsonl", rows)), "parquet"))
    assert dataset.schema.field("system").type == pa.string() and dataset.count_rows() == 12_010
    systems = [value for batch in record_batches(dataset, 4096, ["system"]) for value in batch.column(0).to_pylist()]
    assert systems == [row["system"] for row in rows]


def test_a_jsonl_file_whose_line_3_is_cut_short_stops_the_plan_with_one_line_naming_file_and_line(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1])[:20] + "\n" + json.dumps(ROWS[2]) + "\n")
    done = command("plan", f"data.input={data}", f"output.dir={tmp_path / 'out'}")
    assert f"data.input: {data} line 3 is not JSON: " in the_error_line(done)
    assert not (tmp_path / "out" / "partitions").exists()


def test_a_broken_line_20001_beyond_the_first_megabyte_is_named_before_any_row_is_tokenized(tmp_path):
    data = tmp_path / "rows.jsonl"
    lines = [json.dumps({"id": i, "prompt": "p" * 80}) for i in range(20_000)] + ['{"id": 20000, "prompt": [1,']
    data.write_text("\n".join(lines) + "\n")
    done = command("plan", f"data.input={data}", f"output.dir={tmp_path / 'out'}")
    assert f"data.input: {data} line 20001 is not JSON: " in the_error_line(done)
    assert not (tmp_path / "out" / "partitions").exists()


def test_a_csv_row_with_3_fields_under_a_2_column_header_stops_the_plan_with_one_line_naming_the_file(tmp_path):
    data = tmp_path / "rows.csv"
    data.write_text("id,prompt\n0,What is 2+2?\n1,Who wrote Hamlet?,extra\n")
    done = command("plan", f"data.input={data}", f"output.dir={tmp_path / 'out'}")
    line = the_error_line(done)
    assert f"data.input: {data} cannot be read as CSV with a header line (" in line and "Expected 2 columns, got 3" \
        in line


def test_text_in_a_csv_column_of_numbers_after_its_first_megabyte_is_named_with_the_file(tmp_path):
    data = tmp_path / "rows.csv"
    data.write_text("id,prompt\n" + "".join(f"{i},{'p' * 80}\n" for i in range(20_000)) + "x7,last\n")
    dataset = open_dataset(*resolve_input(str(data), "parquet"))
    with pytest.raises(JobError, match=re.escape(f"data.input: {data} cannot be read as CSV (") + ".*'x7'"):
        sum(batch.num_rows for batch in record_batches(dataset, 8192))


# --- pre-tokenized prompts ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocab_size(model_folder) -> int:
    return read_model_config(model_folder).vocab_size


def test_token_id_prompts_give_the_output_of_their_text_and_4_bad_lists_get_their_own_error_rows(
        from_parquet, tokenizer, vocab_size, tmp_path):
    ids = tokenizer.encode_batch([row["prompt"] for row in ROWS])
    bad = [[], [5, -1, 7], [3, vocab_size], None]
    data = tmp_path / "ids.parquet"
    pl.DataFrame({"id": list(range(8)), "prompt": ids + bad}).write_parquet(data)
    assert pq.read_schema(data).field("prompt").type == pa.large_list(pa.int64())  # as polars writes it
    rows = results(tmp_path / "out", f"data.input={data}")
    assert rows[:4] == from_parquet
    assert [row["finish_reason"] for row in rows[4:]] == ["error"] * 4
    assert [row["error"] for row in rows[4:]] == [
        "prompt is an empty list of token ids",
        f"prompt token 1 is -1, not an id of the model's vocabulary [0, {vocab_size})",
        f"prompt token 1 is {vocab_size}, not an id of the model's vocabulary [0, {vocab_size})",
        "prompt is null"]


def test_token_id_prompts_with_data_chat_template_true_stop_the_plan_before_anything_runs(tokenizer, tmp_path):
    data = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"prompt": pa.array(tokenizer.encode_batch(["Hi"]), pa.list_(pa.int32()))}), data)
    done = command("plan", f"data.input={data}", "data.chat_template=true", f"output.dir={tmp_path / 'out'}")
    assert ("data.chat_template=true renders text, but data.prompt_column='prompt' holds token ids "
            "(list<element: int32>): set data.chat_template=false") in the_error_line(done)


# --- a polars-written file ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def polars_file(tmp_path_factory) -> Path:
    """Three rows with a column for every column key, written by polars: large_string and large_list columns."""
    path = tmp_path_factory.mktemp("polars") / "rows.parquet"
    questions = ["Rate the food at a quiet bistro.", "Rate a film you liked.", "Rate a long train ride."]
    pl.DataFrame({
        "key": ["a", "b", "c"], "question": questions, "persona": ["You are a critic."] * 3,
        "tenant": ["x", "y", "x"], "rating_schema": [json.dumps(RATING)] * 3,
        "chat": [[{"role": "user", "content": question}] for question in questions],
        "answers": [[" Paris", " Rome"], [" yes", " no"], [" one"]],
    }).write_parquet(path)
    types = {field.name: field.type for field in pq.read_schema(path)}
    assert types["key"] == types["rating_schema"] == pa.large_string()
    assert types["answers"] == pa.large_list(pa.large_string())
    return path


def test_a_polars_file_serves_the_prompt_system_namespace_schema_and_id_keys(polars_file, tmp_path):
    rows = results(tmp_path / "out", f"data.input={polars_file}", "data.id_column=key",
                   "data.prompt_column=question", "data.system_column=persona", "data.chat_template=true",
                   "data.namespace_column=tenant", "data.schema_column=rating_schema", "sampling.max_tokens=40",
                   columns=["key", "output_text", "error"])
    assert [row["key"] for row in rows] == ["a", "b", "c"]
    for row in rows:
        assert row["error"] is None
        jsonschema.validate(json.loads(row["output_text"]), RATING)


def test_a_polars_file_serves_the_messages_key(polars_file, tmp_path):
    rows = results(tmp_path / "out", f"data.input={polars_file}", "data.id_column=key",
                   "data.messages_column=chat", columns=["key", "output_token_ids", "error"])
    assert [(row["key"], row["error"]) for row in rows] == [("a", None), ("b", None), ("c", None)]
    assert all(row["output_token_ids"] for row in rows)


def test_a_polars_file_serves_the_choices_key_of_task_score(polars_file, tmp_path):
    rows = results(tmp_path / "out", f"data.input={polars_file}", "task=score", "data.id_column=key",
                   "data.prompt_column=question", "data.choices_column=answers",
                   columns=["key", "choice_num_tokens", "best_choice", "error"])
    assert [(row["key"], row["error"]) for row in rows] == [("a", None), ("b", None), ("c", None)]
    assert [len(row["choice_num_tokens"]) for row in rows] == [2, 2, 1]
    assert [row["best_choice"] is not None for row in rows] == [True] * 3
