"""Every config key takes one type, checked once at parse time (config_keys.py): a value of another type stops
the job with one line naming the key and what it accepts, from the command line (exit 2, never 70) and from
Python (JobError), before anything is read or run."""

from __future__ import annotations

import re
import sys

import pytest
from omegaconf import OmegaConf

import batchprefill
import batchprefill.cli.merge
import batchprefill.cli.plan
import batchprefill.cli.run
from batchprefill import JobError, api
from batchprefill.cli.app import checked_job
from batchprefill.config_keys import KEYS
from tests.conftest import REPO, run_cli

COMMANDS = {"run": batchprefill.cli.run.command, "plan": batchprefill.cli.plan.command,
            "merge": batchprefill.cli.merge.command}


def cli_in_process(command: str, overrides: list[str], capsys, monkeypatch, cwd) -> tuple[int, list[str]]:
    """A console script's command (Hydra's command-line parsing, the config check, the one-line report: what its
    `main` runs before it ends the process) run in this process from `cwd`: its exit status and stderr lines. Hydra
    makes its run folder under output.dir before the check (`output.dir=5` makes `5/.hydra-runs` in the working
    folder)."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [f"batchprefill-{command}", *overrides])
    with pytest.raises(SystemExit) as exited:
        COMMANDS[command]()
    return exited.value.code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def leaf_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for name, value in node.items():
        key = f"{prefix}{name}"
        keys += leaf_keys(value, f"{key}.") if isinstance(value, dict) and key != "model.adapters" else [key]
    return keys


def test_the_schema_names_exactly_the_keys_of_the_composed_config_and_every_key_the_readme_lists(tmp_path):
    cfg = api._composed([f"output.dir={tmp_path}"])
    assert sorted(leaf_keys(OmegaConf.to_container(cfg))) == sorted(KEYS)
    readme_table = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `")]
    named = {key for line in readme_table for key in re.findall(r"`((?:data|model|engine|sampling|output|plan)\.\w+)",
                                                                line.split("|")[1])}
    assert named and named <= set(KEYS), named - set(KEYS)


def assert_each_key_exits_2_with_its_line(command: str, keys: list[str], tmp_path, capsys, monkeypatch) -> None:
    for key in keys:
        kind = KEYS[key]
        written = f"{key}={kind.wrong}"
        overrides = [f"output.dir={tmp_path / 'out'}", written] if key != "output.dir" else [written]
        status, lines = cli_in_process(command, overrides, capsys, monkeypatch, tmp_path)
        assert status == 2, (key, lines)
        assert len(lines) == 1 and lines[0].startswith("batchprefill"), (key, lines)
        assert f": error: {written} is " in lines[0] and f": give {kind.words()}" in lines[0], lines[0]
    assert not (tmp_path / "out" / "partitions").exists()


def test_every_key_of_the_schema_given_a_value_of_another_type_exits_batchprefill_run_2_with_one_line_naming_it(
    tmp_path, capsys, monkeypatch
):
    assert_each_key_exits_2_with_its_line("run", list(KEYS), tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("command", ["plan", "merge"])
def test_plan_and_merge_check_the_same_schema_on_an_integer_a_number_a_boolean_a_list_and_a_choice(
    command, tmp_path, capsys, monkeypatch
):
    keys = ["sampling.max_tokens", "plan.link_gbps", "output.plot", "sampling.stop", "engine.kv_cache_dtype"]
    assert_each_key_exits_2_with_its_line(command, keys, tmp_path, capsys, monkeypatch)


def test_every_key_given_a_value_of_another_type_from_python_raises_a_job_error_naming_it(tmp_path):
    for key, kind in KEYS.items():
        config = {key: kind.wrong} if key == "output.dir" else {key: kind.wrong, "output.dir": str(tmp_path)}
        with pytest.raises(JobError, match=rf"^{re.escape(key)}={re.escape(str(kind.wrong))} is .*: give "):
            batchprefill.plan(**config)


@pytest.mark.parametrize(("command", "override", "line"), [
    ("batchprefill-run", "sampling.max_tokens=four",
     "batchprefill: error: sampling.max_tokens=four is a string: give an integer"),
    ("batchprefill-merge", "data.chat_template=no",
     "batchprefill-merge: error: data.chat_template=no is a string: give true or false"),
])
def test_a_console_script_given_a_word_for_a_number_or_a_boolean_exits_2_with_that_line(command, override, line,
                                                                                         tmp_path):
    done = run_cli([command, override, f"output.dir={tmp_path}"])
    assert (done.returncode, done.stderr.strip()) == (2, line)


@pytest.mark.parametrize("key", [key for key, kind in KEYS.items() if kind.accepts == "true or false"])
def test_a_boolean_key_takes_only_true_or_false_so_the_string_false_from_python_is_refused(key, tmp_path):
    with pytest.raises(JobError, match=rf"^{re.escape(key)}=false is a string: give true or false$"):
        batchprefill.plan(**{key: "false", "output.dir": str(tmp_path)})


def test_booleans_as_yaml_writes_them_are_read_as_written(tmp_path):
    job = checked_job(api._composed([f"output.dir={tmp_path}", "model.normalize=false", "output.plot=False",
                                     "data.chat_template=TRUE"]))
    assert (job.model.pooling.normalize, job.output.plot, job.data.chat_template) == (False, False, True)


def test_one_string_is_one_choice_and_one_stop_string(tmp_path):
    job = checked_job(api._composed([f"output.dir={tmp_path}", "sampling.choice=positive", "sampling.stop=END"]))
    assert job.sampling.constraint.spec == '["positive"]'
    assert job.sampling.stop == ("END",)


def test_auto_and_an_integer_both_reach_the_engine_settings_of_max_num_seqs_and_max_batched_tokens(tmp_path):
    job = checked_job(api._composed([f"output.dir={tmp_path}", "engine.max_num_seqs=auto",
                                     "engine.max_batched_tokens=512"]))
    assert (job.engine.max_num_seqs, job.engine.max_batched_tokens) == ("auto", 512)
    with pytest.raises(JobError, match=r"^engine\.max_num_seqs=0: must be >= 1 or auto$"):
        checked_job(api._composed([f"output.dir={tmp_path}", "engine.max_num_seqs=0"]))


@pytest.mark.parametrize(("override", "line"), [
    ("sampling.max_tokenz=4", "sampling.max_tokenz is not a config key: did you mean sampling.max_tokens?"),
    ("+sampling.max_tokenz=4", "sampling.max_tokenz is not a config key: did you mean sampling.max_tokens?"),
    ("engine.blok_size=16", "engine.blok_size is not a config key: did you mean engine.block_size?"),
    ("+engine.frobnicate=1", "engine.frobnicate is not a config key: the engine keys are engine.device, "
                             "engine.attention_backend, engine.block_size"),
    ("sampling=5", "sampling is a section, not a key: give its keys, e.g. sampling.max_tokens=..."),
    ("sampling.stop={a:1}", "Error merging override sampling.stop={a:1}: sampling.stop takes a string or a list"),
])
def test_a_mistyped_key_names_the_keys_nearest_to_it_not_hydras_advice_to_add_it(override, line, tmp_path,
                                                                                  capsys, monkeypatch):
    status, lines = cli_in_process("plan", [override, f"output.dir={tmp_path}"], capsys, monkeypatch, tmp_path)
    assert status == 2 and len(lines) == 1 and lines[0].startswith(f"batchprefill: error: {line}"), lines
    assert "+sampling" not in lines[0]
    dotted = override.lstrip("+").split("=")[0]
    if "{" not in override and dotted != "sampling":
        with pytest.raises(JobError, match=rf"^{re.escape(line)}"):
            batchprefill.plan(**{dotted: 4, "output.dir": str(tmp_path)})


def test_a_model_group_that_needs_a_path_names_the_unset_key(tmp_path):
    with pytest.raises(JobError, match=r"^model\.path is not set: give it a value \(model\.path=\.\.\.\)"):
        checked_job(api._composed([f"output.dir={tmp_path}", "model=hf"]))


def test_a_runner_given_a_word_for_a_number_raises_before_loading_the_model(monkeypatch):
    import batchprefill.pipeline.build_engine

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(batchprefill.pipeline.build_engine, "load_model", no_load)
    with pytest.raises(JobError, match=r"^sampling\.max_tokens=four is a string: give an integer$"):
        batchprefill.Runner(sampling={"max_tokens": "four"})
