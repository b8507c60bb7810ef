"""Bad input a real pipeline produces by mistake ends each command with one stderr line, before anything runs.

Every command test asserts the exit status, the single `batchprefill...: error: ...` line (no traceback, no
Hydra "HYDRA_FULL_ERROR" hint) and that nothing ran: no partitions, results or statistics were written, so
no model was loaded either (a run writes stats/partitions.parquet before it loads the weights).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchprefill.cli.app import BUG_EXIT_STATUS, reported_errors
from batchprefill.errors import JobError
from batchprefill.io.formats import open_dataset, resolve_input
from batchprefill.io.input_format import record_batches
from batchprefill.io.unique_ids import FIRST_ROW, ID, ROW, IdBuckets, check_unique_ids
from tests.conftest import REPO, run_cli

PROMPTS = ["What is the capital of France?", "Name three colors.", "What is 2+2?", "Who wrote Hamlet?"]


def command(name: str, *overrides: str):
    """`python -m batchprefill.<name>` on this checkout's code, as a user runs it."""
    return run_cli([sys.executable, "-m", f"batchprefill.{name}", "output.progress=false", *overrides],
                   env={"PYTHONPATH": str(REPO)})


def the_error_line(done, prefix: str = "batchprefill") -> str:
    """The one line a failed command printed; fails unless stderr holds exactly that line."""
    assert "Traceback" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{prefix}: error: "), done.stderr
    return lines[0]


def nothing_ran(out: Path) -> bool:
    return not any((out / name).exists() for name in ("partitions", "results", "stats", "plan.parquet"))


def write_prompts(path: Path, ids: list) -> Path:
    pq.write_table(pa.table({"id": ids, "prompt": [PROMPTS[i % len(PROMPTS)] for i in range(len(ids))]}), path)
    return path


# --- ids ---------------------------------------------------------------------------------------------------------


def test_a_run_with_id_b_three_times_and_c_twice_names_b_at_row_3_and_3_repeats(tmp_path):
    data = write_prompts(tmp_path / "dup.parquet", ["a", "b", "b", "c", "b", "c", "d"])
    done = command("run", f"data.input={data}", f"output.dir={tmp_path / 'out'}")
    assert done.returncode == 2
    line = the_error_line(done)
    assert "data.id_column='id'" in line
    assert "3 rows repeat an earlier row's id (2 distinct ids; first: 'b' at row 3, also at row 2)" in line
    assert nothing_ran(tmp_path / "out")


def test_a_plan_with_2_null_ids_names_row_2_and_counts_2(tmp_path):
    data = write_prompts(tmp_path / "nulls.parquet", [10, None, 12, None, 14])
    done = command("plan", f"data.input={data}", f"output.dir={tmp_path / 'out'}")
    assert done.returncode == 2
    assert "2 rows have a null id (first: row 2)" in the_error_line(done)
    assert nothing_ran(tmp_path / "out")


def test_a_repeated_id_across_two_input_files_is_found_at_row_5(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_prompts(folder / "a.parquet", ["x1", "x2", "x3"])
    write_prompts(folder / "b.parquet", ["y1", "x2"])
    dataset = open_dataset(*resolve_input(str(folder), "parquet"))
    with pytest.raises(JobError, match=r"1 row repeats an earlier row's id \(1 distinct id; first: 'x2' at row 5, "
                                       r"also at row 2\)"):
        check_unique_ids((b.column(0) for b in record_batches(dataset, 2, ["id"])), "id", tmp_path / "ids", 5)


def test_an_input_without_the_id_column_keys_its_4_rows_by_position_and_plans(tmp_path):
    data = tmp_path / "no_ids.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), data)
    done = command("plan", f"data.input={data}", f"output.dir={tmp_path / 'out'}")
    assert done.returncode == 0, done.stderr
    assert pq.read_table(tmp_path / "out" / "plan.parquet")["requests"].to_pylist() == [4]


def reference_repeats(ids: list) -> set[tuple]:
    """(id, row, first row) of every row whose id an earlier row had, the slow and obvious way."""
    first: dict = {}
    repeats = set()
    for row, value in enumerate(ids):
        if value is None:
            continue
        if value in first:
            repeats.add((value, row, first[value]))
        first.setdefault(value, row)
    return repeats


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 30)), max_size=300), st.integers(1, 50))
def test_spilled_buckets_find_the_same_repeats_and_nulls_as_a_set(tmp_path_factory, ids, batch_rows):
    folder = tmp_path_factory.mktemp("ids") / "buckets"
    buckets = IdBuckets(folder, len(ids), bucket_bytes=256, pending_bytes=64)
    for start in range(0, len(ids), batch_rows):
        buckets.add(pa.array(ids[start : start + batch_rows], pa.int64()))
    found = {(r[ID], r[ROW], r[FIRST_ROW]) for table in buckets.repeats() for r in table.to_pylist()}
    buckets.close()
    assert found == reference_repeats(ids)
    assert buckets.nulls == ids.count(None)
    assert buckets.first_null == (ids.index(None) if None in ids else None)
    assert not folder.exists()


def test_4000_string_ids_spill_into_about_40_bucket_files_and_one_repeat_is_found(tmp_path):
    ids = [f"id-{i:06d}" for i in range(4000)]
    ids[3999] = ids[17]
    folder = tmp_path / "buckets"
    buckets = IdBuckets(folder, len(ids), bucket_bytes=2000, pending_bytes=4000)
    for start in range(0, len(ids), 500):
        buckets.add(pa.chunked_array([ids[start : start + 500]]))
    assert 30 <= buckets.num_buckets <= 50
    assert len(list(folder.glob("ids-*.arrow"))) > buckets.num_buckets // 2  # spilled, not held in memory
    repeats = pa.concat_tables(buckets.repeats())
    buckets.close()
    assert repeats.to_pylist() == [{ID: "id-000017", ROW: 3999, FIRST_ROW: 17}]


def test_dictionary_encoded_ids_a_b_a_repeat_a_at_row_3_counted_from_1_as_lines_are(tmp_path):
    with pytest.raises(JobError, match="first: 'a' at row 3, also at row 1"):
        check_unique_ids([pa.array(["a", "b", "a"]).dictionary_encode()], "id", tmp_path / "ids", 3)


def test_list_ids_are_refused_with_their_type(tmp_path):
    with pytest.raises(JobError, match=r"data.id_column='id': ids must be strings or numbers, not list<item: int64>"):
        check_unique_ids([pa.array([[1], [2]])], "id", tmp_path / "ids", 2)


# --- unreadable input files ----------------------------------------------------------------------------------------


def test_json_under_a_parquet_name_is_named_with_its_first_bytes(tmp_path):
    data = tmp_path / "prompts.parquet"
    data.write_text('{"id": 1, "prompt": "hi"}\n')
    done = command("run", f"data.input={data}", f"output.dir={tmp_path / 'out'}")
    assert done.returncode == 2
    assert (f"{data} is not Parquet: it starts with {data.read_bytes()[:16]!r}, which looks like JSON Lines: name it "
            ".jsonl or set data.format=jsonl; replace the file") in the_error_line(done)
    assert nothing_ran(tmp_path / "out")


def test_a_parquet_file_cut_to_its_first_100_bytes_is_named_in_a_folder_of_two(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_prompts(folder / "a.parquet", ["a", "b"])
    whole = write_prompts(tmp_path / "whole.parquet", ["c", "d"]).read_bytes()
    (folder / "b.parquet").write_bytes(whole[:100])
    done = command("plan", f"data.input={folder}", f"output.dir={tmp_path / 'out'}")
    assert done.returncode == 2
    assert f"{folder / 'b.parquet'} is cut short: it starts as Parquet but has no footer" in the_error_line(done)
    assert nothing_ran(tmp_path / "out")


def test_an_empty_file_in_a_glob_is_named_as_0_bytes(tmp_path):
    write_prompts(tmp_path / "a.parquet", ["a"])
    (tmp_path / "b.parquet").touch()
    with pytest.raises(JobError, match=re.escape(f"{tmp_path / 'b.parquet'} is empty (0 bytes)")):
        resolve_input(f"{tmp_path}/*.parquet", "parquet")


def test_a_folder_named_like_a_parquet_file_is_not_taken_for_one(tmp_path):
    write_prompts(tmp_path / "a.parquet", ["a"])
    (tmp_path / "spark.parquet").mkdir()
    assert resolve_input(str(tmp_path), "parquet") == ([tmp_path / "a.parquet"], "parquet")


def saved_dataset(folder: Path) -> Path:
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"id": ["a", "b", "c"], "prompt": PROMPTS[:3]}).save_to_disk(str(folder))
    return folder


def test_a_saved_dataset_whose_arrow_file_lost_half_its_bytes_is_named(tmp_path):
    folder = saved_dataset(tmp_path / "ds")
    arrow = next(folder.glob("data-*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    done = command("run", "data.format=datasets", f"data.input={folder}", f"output.dir={tmp_path / 'out'}")
    assert done.returncode == 2
    assert f"{arrow} is cut short: its Arrow stream has no end marker; save the dataset again" in \
        the_error_line(done)
    assert nothing_ran(tmp_path / "out")


def test_a_saved_dataset_dict_with_splits_test_and_train_asks_for_one_split(tmp_path):
    import datasets

    datasets.disable_progress_bars()
    split = datasets.Dataset.from_dict({"prompt": PROMPTS[:2]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dsd"))
    with pytest.raises(JobError, match=r"holds a DatasetDict \(splits: test, train\): point data.input at one split"):
        resolve_input(str(tmp_path / "dsd"), "datasets")


def test_a_saved_dataset_whose_arrow_file_ends_with_its_marker_passes(tmp_path):
    folder = saved_dataset(tmp_path / "ds")
    assert resolve_input(str(folder), "datasets") == (sorted(folder.glob("data-*.arrow")), "datasets")


# --- output.dir ----------------------------------------------------------------------------------------------------


def test_an_output_dir_under_a_regular_file_names_the_file(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    data = write_prompts(tmp_path / "ok.parquet", ["a", "b"])
    done = command("run", f"data.input={data}", f"output.dir={blocker / 'out'}")
    assert done.returncode == 2
    assert f"{blocker} is a file, not a folder; choose an output.dir you can write" in the_error_line(done)


def test_an_output_dir_that_is_a_file_is_found_before_preparing_when_hydra_runs_elsewhere(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    data = write_prompts(tmp_path / "ok.parquet", ["a", "b"])
    done = command("run", f"data.input={data}", f"output.dir={blocker}", f"hydra.run.dir={tmp_path / 'hydra'}")
    assert done.returncode == 2
    assert f"output.dir={blocker} cannot be created: {blocker} is a file, not a folder" in the_error_line(done)
    assert blocker.read_text() == ""


# --- merge and resume read the job's own files -------------------------------------------------------------------


@pytest.fixture(scope="module")
def planned_once(tmp_path_factory) -> Path:
    """An output.dir whose 4 rows are prepared (by the plan, which loads no weights) but have no results yet."""
    folder = tmp_path_factory.mktemp("planned")
    data = write_prompts(folder / "ok.parquet", ["a", "b", "c", "d"])
    out = folder / "out"
    done = command("plan", f"data.input={data}", f"output.dir={out}")
    assert done.returncode == 0, done.stderr
    (out / "results").mkdir()
    return out


@pytest.fixture
def planned(planned_once, tmp_path) -> Path:
    """A copy of `planned_once` to damage; its partitions still match the input, so a run reuses them."""
    return Path(shutil.copytree(planned_once, tmp_path / "out"))


def test_merge_names_a_damaged_results_part_and_shard_3_to_rerun(planned):
    part = planned / "results" / "part-0003-18c2f-00000.parquet"
    part.write_bytes(b"PAR1 this part was cut short")
    done = command("merge", f"output.dir={planned}")
    assert done.returncode == 2
    line = the_error_line(done, "batchprefill-merge")
    assert f"{part} cannot be read" in line and "rerun shard 3 with the same output.dir" in line
    assert not (planned / "stats" / "job.parquet").exists()


def test_merge_with_the_wrong_id_column_names_the_column_the_part_lacks(planned):
    pq.write_table(pa.table({"id": ["a"], "output_text": ["x"]}), planned / "results" / "part-0000-1-00000.parquet")
    done = command("merge", f"output.dir={planned}", "data.id_column=key")
    assert done.returncode == 2
    line = the_error_line(done, "batchprefill-merge")
    assert f"{planned / 'partitions'}" in line and "has no column 'key' (it has: id, prompt," in line
    assert "give this command the data.id_column" in line


def test_merge_names_a_manifest_that_is_not_json(planned):
    (planned / "partitions" / "manifest.json").write_text("{not json")
    done = command("merge", f"output.dir={planned}")
    assert done.returncode == 2
    assert "manifest.json cannot be read" in the_error_line(done, "batchprefill-merge")


def test_a_resumed_run_names_another_shards_damaged_results_part_before_loading_the_model(planned_once, planned):
    part = planned / "results" / "part-0003-1-00000.parquet"  # its own shard's are set aside (test_commit_faults)
    part.write_bytes(b"not parquet")
    done = command("run", f"data.input={planned_once.parent / 'ok.parquet'}", f"output.dir={planned}")
    assert done.returncode == 2
    assert f"{part} cannot be read" in the_error_line(done)
    assert not (planned / "stats").exists()


# --- the entry point ---------------------------------------------------------------------------------------------


def test_a_misspelt_key_is_one_line_naming_it(tmp_path):
    done = command("plan", "engine.blok_size=16", f"output.dir={tmp_path / 'out'}")
    assert done.returncode == 2
    assert the_error_line(done) == ("batchprefill: error: engine.blok_size is not a config key: did you mean "
                                    "engine.block_size?")


ENDS = """
import atexit, sys
from pathlib import Path
from batchprefill.cli.app import exit_without_teardown

with exit_without_teardown():
    atexit.register(lambda: Path(sys.argv[1]).write_text("the atexit handler ran"))
    print("unflushed", end="")
    sys.exit(int(sys.argv[2]) if sys.argv[2].isdigit() else sys.argv[2])
"""


@pytest.mark.parametrize(("status", "code", "stderr"), [("0", 0, ""), ("3", 3, ""), ("no model", 1, "no model\n")])
def test_a_console_script_ends_with_its_status_its_atexit_handlers_run_and_its_output_flushed(status, code, stderr,
                                                                                               tmp_path):
    script, mark = tmp_path / "ends.py", tmp_path / "mark.txt"
    script.write_text(ENDS)
    done = run_cli([sys.executable, str(script), str(mark), status], env={"PYTHONPATH": str(REPO)})
    assert (done.returncode, done.stdout, done.stderr) == (code, "unflushed", stderr)
    assert mark.read_text() == "the atexit handler ran"


BOOM = """
from batchprefill.cli.app import hydra_app

def task(cfg):
    raise ZeroDivisionError("the bug under test")

hydra_app("batchprefill-boom", task)()
"""


def test_an_unexpected_error_is_one_line_exit_70_and_a_log_under_output_dir_with_the_traceback(tmp_path):
    out = tmp_path / "out"
    script = tmp_path / "boom.py"
    script.write_text(BOOM)
    done = run_cli([sys.executable, str(script), f"output.dir={out}"], env={"PYTHONPATH": str(REPO)})
    assert done.returncode == BUG_EXIT_STATUS == 70
    line = the_error_line(done, "batchprefill-boom")
    assert "unexpected ZeroDivisionError: the bug under test; this is a bug, the full traceback is in " in line
    log = Path(line.rsplit(" ", 1)[1])
    assert log.is_relative_to(out) and log.name.startswith("batchprefill-boom-error-")
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and 'raise ZeroDivisionError("the bug under test")' in text


def test_reported_errors_falls_back_to_the_temp_folder_when_the_log_folder_cannot_be_made(tmp_path, capsys,
                                                                                          monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(SystemExit) as stopped, reported_errors("batchprefill-eval", blocker / "logs"):
        json.loads("{")
    assert stopped.value.code == 70
    line = capsys.readouterr().err.strip()
    log = Path(line.rsplit(" ", 1)[1])
    assert log.parent == tmp_path / "tmp" and "JSONDecodeError" in log.read_text()


def test_reported_errors_prints_a_job_error_as_its_own_line_and_status(capsys):
    with pytest.raises(SystemExit) as stopped, reported_errors("batchprefill-eval"):
        raise JobError("data.input x: no Parquet files found\n(second line)")
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "batchprefill-eval: error: data.input x: no Parquet files found (second line)\n"


def test_3_distinct_ids_in_2_batches_pass_and_leave_no_files(tmp_path):
    check_unique_ids([pa.array(["a", "b"]), pa.array(["c"])], "id", tmp_path / "ids", 3)
    assert list(tmp_path.iterdir()) == []
