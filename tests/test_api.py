"""batchprefill.run, Runner and plan from Python, checked against the command line on the same data."""

import ast
import errno
import re
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset
from hypothesis import given, settings
from hypothesis import strategies as st

import batchprefill
import batchprefill.cli.plan
import batchprefill.cli.run
import batchprefill.pipeline.build_engine
import batchprefill.pipeline.plan
import batchprefill.pipeline.run
from batchprefill import JobError, api
from tests.conftest import REPO, run_cli

# Two system prompts, alternating, so prefix order (all of A, then all of B) is not input order; row 6 is empty: an
# error row that must keep its place too.
A = "You are a terse assistant who answers in one word. Question: "
B = "You are a poet. Reply with a short rhyme about the following topic: "
PROMPTS = [
    A + "capital of France?",
    B + "the sea",
    A + "2+2?",
    B + "a cat",
    A + "colour of the sky?",
    B + "the moon",
    "",
    A + "largest planet?",
]
FAST = {"sampling.max_tokens": 2, "engine.kv_cache_tokens": 4096, "output.plot": False}
CLI_FAST = [f"{key}={value}" for key, value in FAST.items()] + ["output.progress=false"]
ERROR_LINE = re.compile(r"^batchprefill: error: (.*)$", re.MULTILINE)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.parquet"
    pq.write_table(pa.table({"prompt": PROMPTS}), path)
    return path


@pytest.fixture(scope="module")
def cli_out(prompts_file, tmp_path_factory) -> Path:
    """batchprefill-run and batchprefill-plan on the prompts, as a user runs them."""
    out = tmp_path_factory.mktemp("cli")
    for command in ("batchprefill-run", "batchprefill-plan"):
        done = run_cli([command, f"data.input={prompts_file}", f"output.dir={out}", *CLI_FAST])
        assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def cli_rows(cli_out) -> list[dict]:
    """The command line's results, by id: with no id column the id is the row's position, so this is input order."""
    return pl.from_arrow(pq.read_table(cli_out / "results")).sort("id").to_dicts()


@pytest.fixture(scope="module")
def path_run(prompts_file, tmp_path_factory) -> tuple[api.Result, dict]:
    """batchprefill.run on the prompts' file into an explicit output dir, committing parts of 3 rows; and its config."""
    out = tmp_path_factory.mktemp("path_run")
    config = {"output": {"dir": str(out), "commit_every_rows": 3}, "progress": False, **FAST}
    return batchprefill.run(prompts_file, **config), config


@pytest.fixture
def loads(monkeypatch) -> list[Path]:
    """A spy on the weight loader every job and Runner goes through: it records each load and does it."""
    calls, real = [], batchprefill.pipeline.build_engine.load_model

    def counted(folder, *args, **kwargs):
        calls.append(folder)
        return real(folder, *args, **kwargs)

    monkeypatch.setattr(batchprefill.pipeline.build_engine, "load_model", counted)
    return calls


def test_run_on_a_polars_frame_a_list_and_a_path_gives_the_command_lines_8_rows_in_input_order(
    path_run, cli_rows, loads, capfd
):
    handler = signal.getsignal(signal.SIGTERM)
    fresh = [batchprefill.run(data, progress=False, **FAST) for data in (pl.DataFrame({"prompt": PROMPTS}), PROMPTS)]
    assert len(loads) == 2  # a fresh run loads the model for itself
    assert signal.getsignal(signal.SIGTERM) is handler  # the caller's process handles SIGTERM as before
    for result in [*fresh, path_run[0]]:
        assert result.table["id"].to_list() == list(range(8))
        assert result.table["prompt"].to_list() == PROMPTS
        assert result.table.to_dicts() == cli_rows
        assert result.table["finish_reason"][6] == "error" and result.table["error"][6]
        assert result.stats["num_requests"] == 8 and result.stats["num_errors"] == 1
        assert result.stats["cached_tokens"] > 0  # the shared system prompts were computed once
    assert path_run[0].output_dir == Path(path_run[1]["output"]["dir"])
    assert all(result.output_dir is None for result in fresh)
    summaries = capfd.readouterr().err
    assert summaries.count("The results are returned; their temporary folder is removed.") == 2
    assert "Results and statistics are in" not in summaries  # no line names a folder gone when run returned


def test_a_runner_loads_once_and_its_second_call_gives_the_fresh_command_lines_rows(cli_rows, loads):
    from batchprefill.model.loader import shipped_gguf

    runner = batchprefill.Runner(model=shipped_gguf(), progress=False, **FAST)  # the default model, by its path
    assert len(loads) == 1
    sampled = runner.run(Dataset.from_dict({"prompt": PROMPTS}), sampling={"n": 2, "temperature": 0.8, "seed": 3})
    assert sampled.table["id"].to_list() == [i for i in range(8) for _ in range(2)]
    assert sampled.table["sample_index"].to_list() == [0, 1] * 8
    assert sampled.table["output_text"].to_list() != [row["output_text"] for row in cli_rows for _ in range(2)]
    # from a worker thread, as a pipeline's map would call it: no signal handler can be set there
    with ThreadPoolExecutor(1) as pool:
        greedy = pool.submit(runner.run, pd.DataFrame({"prompt": PROMPTS})).result()
    assert len(loads) == 1  # neither call loaded the model again
    assert greedy.table.to_dicts() == cli_rows  # the per-call sampling keys did not outlive their call
    with pytest.raises(JobError, match=r"^engine\.block_size: a Runner keeps the model and engine it was made with"):
        runner.run(PROMPTS, engine={"block_size": 32})
    with pytest.raises(JobError, match=r"^model\.dtype: a Runner keeps"):
        runner.run(PROMPTS, model={"dtype": "float16"})


def test_a_runner_takes_no_output_dir_for_all_its_calls(tmp_path):
    with pytest.raises(JobError, match=r"^output\.dir: give it to each runner\.run"):
        batchprefill.Runner(output={"dir": str(tmp_path)})


@pytest.mark.parametrize(
    ("override", "config"),
    [
        ("sampling.max_tokenz=3", {"sampling.max_tokenz": 3}),
        ("sampling.top_p=1.5", {"sampling": {"top_p": 1.5}}),
        ("data.input=/no/such/prompts.parquet", {"data": {"input": "/no/such/prompts.parquet"}}),
    ],
)
def test_a_bad_key_or_value_raises_the_line_the_command_line_prints(override, config, tmp_path):
    done = run_cli(["batchprefill-run", override, f"output.dir={tmp_path / 'cli'}", *CLI_FAST])
    assert done.returncode == 2
    lines = ERROR_LINE.findall(done.stderr)
    assert len(lines) == 1
    with pytest.raises(JobError) as raised:
        batchprefill.run(output={"dir": str(tmp_path / "api")}, progress=False, **config, **FAST)
    assert str(raised.value) == lines[0]


def test_faults_of_the_python_call_itself_are_one_line_job_errors(prompts_file):
    with pytest.raises(JobError, match=r"^data: a list is taken as prompts, but item 1 is an int, not a string$"):
        batchprefill.run(["a", 2])
    with pytest.raises(JobError, match=r"^data\.input: give the data once"):
        batchprefill.run(PROMPTS, data={"input": str(prompts_file)})
    with pytest.raises(JobError, match=r"^sampling\.max_tokens is given twice"):
        batchprefill.run(PROMPTS, sampling={"max_tokens": 3}, **{"sampling.max_tokens": 4})
    with pytest.raises(JobError, match=r"^data: a dict is none of a path"):
        batchprefill.run({"prompt": PROMPTS})


def test_a_rerun_into_an_explicit_output_dir_runs_only_the_2_rows_of_a_deleted_part(path_run, prompts_file):
    first, config = path_run
    parts = sorted((first.output_dir / "results").glob("part-*.parquet"))
    assert [pq.read_metadata(part).num_rows for part in parts] == [3, 3, 2]
    parts[-1].unlink()  # as if the job had been killed before its last commit
    again = batchprefill.run(prompts_file, **config)
    assert again.stats["num_requests"] == 2
    # the same rows; only num_cached_tokens may differ: a row rerun alone finds less of its prefix cached
    assert again.table.drop("num_cached_tokens").to_dicts() == first.table.drop("num_cached_tokens").to_dicts()
    assert pq.read_table(first.output_dir / "results").num_rows == 8  # each row once


def test_plan_on_an_arrow_table_gives_the_row_batchprefill_plan_wrote(cli_out):
    row = batchprefill.plan(pa.table({"prompt": PROMPTS}), progress=False, **FAST)
    assert row == pq.read_table(cli_out / "plan.parquet").to_pylist()[0]
    assert row["requests"] == 7 and row["error_rows"] == 1
    assert row["ideal_computed_tokens"] < row["computed_tokens_without_reuse"]


def test_batchprefill_run_stays_the_function_and_the_shims_still_run_as_modules():
    assert batchprefill.run is api.run and batchprefill.plan is api.plan  # after importing cli.run, pipeline.run...
    shims = {"batchprefill.run", "batchprefill.plan"}
    for file in [*REPO.glob("batchprefill/**/*.py"), *REPO.glob("tests/*.py"), *REPO.glob("benchmarks/**/*.py")]:
        for node in ast.walk(ast.parse(file.read_text())):
            names = (
                [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not shims & set(names), f"{file} imports a shim, which would rebind batchprefill.run"
    for command in ("run", "plan"):
        done = run_cli([sys.executable, "-m", f"batchprefill.{command}", "--help"])
        assert done.returncode == 0 and "Powered by Hydra" in done.stdout, done.stderr
    cheap = run_cli(
        [
            sys.executable,
            "-c",
            "import sys, batchprefill; print(sorted(m for m in ('torch', 'polars', 'hydra') if m in sys.modules))",
        ]
    )
    assert cheap.stdout.strip() == "[]", cheap.stderr


@settings(max_examples=30, deadline=None)
@given(
    text=st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=20),
    number=st.floats(allow_nan=False, allow_infinity=False),
)
def test_any_string_or_float_reaches_the_config_as_the_python_value(text, number):
    cfg = api._composed(
        api._overrides(
            {
                "sampling.regex": text,
                "sampling.stop": [text, "it's"],
                "sampling.temperature": number,
                "data.input": None,
            }
        )
    )
    assert cfg.sampling.regex == text and list(cfg.sampling.stop) == [text, "it's"]
    assert cfg.sampling.temperature == number and cfg.data.input is None


def test_a_full_disk_while_staging_a_frame_raises_disk_full_with_the_line_the_command_line_prints(
    tmp_path, monkeypatch, capsys
):
    from batchprefill.cli.app import reported_errors
    from batchprefill.errors import DiskFull

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "input.parquet"))

    def no_room(*args, **kwargs):  # the write fails as on a full file system, before a byte lands
        raise full

    monkeypatch.setattr(api.pq, "write_table", no_room)
    with pytest.raises(DiskFull) as raised:
        batchprefill.run(pl.DataFrame({"prompt": PROMPTS}), output={"dir": str(tmp_path)})
    with pytest.raises(SystemExit) as exited, reported_errors("batchprefill"):
        raise full
    assert exited.value.code == 2
    assert ERROR_LINE.findall(capsys.readouterr().err) == [str(raised.value)]
    assert str(raised.value).startswith(f"the disk is full (No space left on device) writing {tmp_path}/input.parquet")
