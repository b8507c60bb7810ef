"""`batchprefill-eval` against lm-eval's own `hf` backend on the same tiny model folder, on local tasks: a 5-shot
multiple-choice task (loglikelihood through task=score), a perplexity task (loglikelihood_rolling, three
windows of a 256-position model) and a generate_until task. transformers is the reference."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tests.conftest import run_cli

TASKS = ["tiny_mc", "tiny_ppl", "tiny_gen"]
SUBJECTS = {"geography": [("What is the capital of France?", ["Paris", "Rome", "Madrid", "Oslo"], 0),
                          ("Which river flows through Cairo?", ["Thames", "Nile", "Seine", "Volga"], 1),
                          ("Which continent is Kenya in?", ["Asia", "Europe", "Africa", "Oceania"], 2),
                          ("What is the largest ocean?", ["Pacific", "Atlantic", "Indian", "Arctic"], 0),
                          ("Which country has Lima as capital?", ["Chile", "Peru", "Bolivia", "Ecuador"], 1),
                          ("Mount Fuji is in", ["China", "Korea", "Japan", "Nepal"], 2),
                          ("The Sahara is a", ["forest", "desert", "lake", "glacier"], 1),
                          ("Greenland belongs to", ["Denmark", "Norway", "Canada", "Iceland"], 0)]}
MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    train: {folder}/mc.jsonl
    test: {folder}/mc.jsonl
output_type: multiple_choice
training_split: train
fewshot_split: train
test_split: test
num_fewshot: 5
fewshot_config:
  sampler: first_n
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PPL_YAML = """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder}/ppl.jsonl
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
GEN_YAML = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder}/gen.jsonl
output_type: generate_until
test_split: test
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n", "Q:"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""
LONG_TEXT = " ".join(f"Sentence {i} tells of rivers, hills and the {i % 7}th town by the sea." for i in range(40))


@pytest.fixture(scope="module")
def tasks_and_model(tmp_path_factory, model_folder) -> tuple[Path, Path]:
    """Local task YAMLs with their JSONL data, and a tiny random Llama saved with the shipped tokenizer."""
    folder = tmp_path_factory.mktemp("tasks")
    rows = [{"question": q, "choices": c, "answer": a} for q, c, a in SUBJECTS["geography"]]
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "ppl.jsonl").write_text(json.dumps({"text": LONG_TEXT}) + "\n" + json.dumps({"text": "A short one."})
                                      + "\n")
    (folder / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": c[a]}) + "\n"
                                              for q, c, a in SUBJECTS["geography"][:3]))
    for name, text in (("mc", MC_YAML), ("ppl", PPL_YAML), ("gen", GEN_YAML)):
        (folder / f"tiny_{name}.yaml").write_text(text.format(folder=folder))
    model = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    reference = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # logits spread wide enough that choices differ clearly
        reference.model.embed_tokens.weight.mul_(40)
    reference.save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_folder / name, model / name)
    return folder, model


def samples(output: Path, task: str) -> list[dict]:
    (path,) = output.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


def loglikelihood(response: list) -> float:
    """A logged response: [[logprob, is_greedy]] for loglikelihood, [logprob] for rolling; numbers as strings."""
    first = response[0]
    return float(first[0] if isinstance(first, list) else first)


def lm_eval_run(command: list[str], model: str, model_folder: Path, tasks: Path, output: Path,
                extra_model_args: str = "", task_names: list[str] = TASKS) -> tuple[dict, str]:
    """lm-eval's results for `task_names`, and the run's stderr."""
    done = run_cli([*command, "--model", model, "--model_args", f"pretrained={model_folder},dtype=float32"
                    + extra_model_args, "--tasks", ",".join(task_names), "--include_path", str(tasks),
                    "--output_path", str(output), "--log_samples", "--device", "cpu", "--batch_size", "4"],
                   timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = output.rglob("results_*.json")
    return json.loads(path.read_text())["results"], done.stderr


BATCHPREFILL_EVAL = [sys.executable, "-m", "batchprefill.cli.eval"]


@pytest.fixture(scope="module")
def float32_kv_run(tasks_and_model, tmp_path_factory) -> tuple[Path, dict, str]:
    """batchprefill-eval on the three tasks with the model's own float32 KV: (output folder, results, stderr),
    shared by the test against the hf backend and the FP8 KV test."""
    tasks, model = tasks_and_model
    output = tmp_path_factory.mktemp("bp-float32-kv")
    return output, *lm_eval_run(BATCHPREFILL_EVAL, "batchprefill", model, tasks, output)


def test_batchprefill_eval_equals_the_hf_backend_on_three_local_tasks(tasks_and_model, float32_kv_run, tmp_path):
    tasks, model = tasks_and_model
    ours_folder, ours, _ = float32_kv_run
    theirs, _ = lm_eval_run([sys.executable, "-m", "lm_eval"], "hf", model, tasks, tmp_path / "hf")
    assert ours["tiny_mc"]["acc,none"] == theirs["tiny_mc"]["acc,none"]
    assert ours["tiny_mc"]["acc_norm,none"] == theirs["tiny_mc"]["acc_norm,none"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["tiny_ppl"][metric] == pytest.approx(theirs["tiny_ppl"][metric], rel=1e-4)
    assert ours["tiny_gen"]["exact_match,none"] == theirs["tiny_gen"]["exact_match,none"]
    for task in TASKS:  # sample by sample: every log-likelihood within 2e-3, every generation the same text
        mine, reference = samples(ours_folder, task), samples(tmp_path / "hf", task)
        assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in reference] and mine
        for a, b in zip(mine, reference):
            if task == "tiny_gen":
                assert a["filtered_resps"] == b["filtered_resps"]
                continue
            ours_ll, their_ll = (list(map(loglikelihood, s["resps"])) for s in (a, b))
            assert max(abs(x - y) for x, y in zip(ours_ll, their_ll)) < 2e-3, task
    assert len(samples(ours_folder, "tiny_ppl")) == 2
    assert len(LONG_TEXT) > 2000  # over 500 tokens: three windows of the 256-position model


def test_a_request_the_engine_cannot_serve_fails_the_run_in_one_line(tasks_and_model, tmp_path):
    tasks, model = tasks_and_model
    done = run_cli([sys.executable, "-m", "batchprefill.cli.eval", "--model", "batchprefill", "--model_args",
                    f"pretrained={model},dtype=float32,engine.kv_cache_tokens=64", "--tasks", "tiny_ppl",
                    "--include_path", str(tasks), "--output_path", str(tmp_path)], timeout=600)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("batchprefill-eval: error: loglikelihood request") and "kv_cache_tokens" in last


def test_python_api_runs_the_registered_model(tasks_and_model):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from batchprefill.integrations.lm_eval import BatchprefillLM

    tasks, model = tasks_and_model
    results = lm_eval.simple_evaluate(model=BatchprefillLM(pretrained=str(model), dtype="float32"),
                                      tasks=["tiny_gen"], task_manager=TaskManager(include_path=str(tasks)))
    assert "exact_match,none" in results["results"]["tiny_gen"]


def test_engine_kv_cache_dtype_in_model_args_runs_the_multiple_choice_task_on_an_fp8_e5m2_pool(
        tasks_and_model, float32_kv_run, tmp_path):
    """`engine.kv_cache_dtype=fp8_e5m2` in --model_args reaches the engine: the run's log names a float8_e5m2 pool,
    and the 32 log-likelihoods (8 questions x 4 choices) move off the float32 pool's (measured: by 1.1e-4 to 0.012)
    while every question keeps its best choice, so acc (0.75) and acc_norm (0.5) are the float32 pool's."""
    tasks, model = tasks_and_model
    float32_folder, float32_results, float32_log = float32_kv_run
    results, log = lm_eval_run(BATCHPREFILL_EVAL, "batchprefill", model, tasks, tmp_path / "fp8",
                               ",engine.kv_cache_dtype=fp8_e5m2", ["tiny_mc"])
    assert "tokens in float8_e5m2, " in log and "tokens in float32, " in float32_log
    mine, reference = samples(tmp_path / "fp8", "tiny_mc"), samples(float32_folder, "tiny_mc")
    assert [s["doc_id"] for s in mine] == [s["doc_id"] for s in reference] == list(range(8))
    fp8_scores = [list(map(loglikelihood, s["resps"])) for s in mine]
    float32_scores = [list(map(loglikelihood, s["resps"])) for s in reference]
    gaps = [abs(a - b) for x, y in zip(fp8_scores, float32_scores) for a, b in zip(x, y)]
    assert len(gaps) == 32 and 1e-3 < max(gaps) < 0.05  # 8-bit KV rounds: not the float32 pool's exact scores
    assert [max(range(4), key=row.__getitem__) for row in fp8_scores] == \
        [max(range(4), key=row.__getitem__) for row in float32_scores]
    for metric in ("acc,none", "acc_norm,none"):
        assert results["tiny_mc"][metric] == float32_results["tiny_mc"][metric]
