"""task=score, sampling.n and sampling.logprobs through `batchprefill-run`, as INTERFACE.md describes them."""

import pyarrow as pa
import pyarrow.parquet as pq

from tests.conftest import run_cli
from tests.test_score import TOLERANCE, hf_loglikelihood

FAST = ["engine.kv_cache_tokens=4096", "output.progress=false", "output.plot=false"]
HEADER = "Answer each question.\n\nQ: What colour is the sky? A: blue\n\nQ: "
ROWS = [
    ("a", HEADER + "The capital of France is", [" Paris", " Berlin", " a big city"]),
    ("b", HEADER + "Bees make", [" honey", " cars"]),
    ("c", HEADER + "Two plus two equals ", ["four", "five"]),  # the trailing space moves to the choices
    ("d", HEADER + "Nothing to choose", []),
    ("e", HEADER + "An empty choice", [" yes", ""]),
    ("f", HEADER + "A null choice", [" yes", None]),
    ("g", HEADER + "No choices at all", None),
]


def lm_eval_split(tokenizer, context: str, choice: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's `_encode_pair`: trailing whitespace to the choice, choice tokens after the context's."""
    spaces = len(context) - len(context.rstrip())
    context, choice = context[: len(context) - spaces], context[len(context) - spaces :] + choice
    whole, alone = tokenizer.encode_batch([context + choice, context])
    return alone, whole[len(alone):]


def test_score_job_matches_transformers_and_gives_bad_rows_their_own_errors(tmp_path, tokenizer, hf_reference):
    data = tmp_path / "mc.parquet"
    pq.write_table(pa.table({"id": [r[0] for r in ROWS], "prompt": [r[1] for r in ROWS],
                             "choices": pa.array([r[2] for r in ROWS], pa.list_(pa.string()))}), data)
    done = run_cli(["batchprefill-run", "task=score", f"data.input={data}", f"output.dir={tmp_path / 'out'}", *FAST])
    assert done.returncode == 0, done.stderr
    table = pq.read_table(tmp_path / "out" / "results")
    assert not {"output_text", "output_token_ids"} & set(table.column_names)
    assert table.schema.field("choice_logprobs").type == pa.list_(pa.float64())
    assert table.schema.field("best_choice").type == pa.int32()
    rows = {r["id"]: r for r in table.to_pylist()}
    assert sorted(rows) == list("abcdefg")
    assert "choices is empty" in rows["d"]["error"] and "choices[1] is empty" in rows["e"]["error"]
    assert "choices[1] is null" in rows["f"]["error"] and "choices is null" in rows["g"]["error"]
    assert all(rows[i]["finish_reason"] == "error" and rows[i]["choice_logprobs"] is None for i in "defg")
    for key, prompt, choices in ROWS[:3]:
        row = rows[key]
        pairs = [lm_eval_split(tokenizer, prompt, c) for c in choices]
        reference = [hf_loglikelihood(hf_reference, ctx, ids) for ctx, ids in pairs]
        assert row["error"] is None and row["finish_reason"] == "stop"
        assert max(abs(a - b) for a, (b, _) in zip(row["choice_logprobs"], reference)) < TOLERANCE
        assert row["choice_is_greedy"] == [g for _, g in reference]
        assert row["choice_num_tokens"] == [len(ids) for _, ids in pairs]
        assert row["best_choice"] == max(range(len(choices)), key=lambda j: reference[j][0])
        assert row["num_prompt_tokens"] == len(pairs[0][0]) + sum(map(len, (ids for _, ids in pairs)))
    assert rows["b"]["num_cached_tokens"] >= 16  # the shared header came from the prefix cache
    job = pq.read_table(tmp_path / "out" / "stats" / "job.parquet").to_pylist()[0]
    assert job["num_errors"] == 4 and job["num_requests"] == 7


def test_n_samples_with_logprobs_write_a_row_per_sample_and_resume_exactly_once(tmp_path):
    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"id": [10, 11, 12], "prompt": ["Name a colour.", "Name a fruit.", ""]}), data)
    out = tmp_path / "out"
    args = ["batchprefill-run", f"data.input={data}", f"output.dir={out}", *FAST, "sampling.n=3",
            "sampling.logprobs=2", "sampling.temperature=1.0", "sampling.max_tokens=4", "sampling.ignore_eos=true",
            "output.commit_every_rows=1"]
    assert (done := run_cli(args)).returncode == 0, done.stderr
    first = pq.read_table(out / "results")
    assert first.schema.field("sample_index").type == pa.int32()
    assert first.schema.field("output_top_logprobs").type == pa.list_(pa.list_(pa.struct(
        [("token_id", pa.int32()), ("logprob", pa.float64())])))
    keys = sorted(zip(first["id"].to_pylist(), first["sample_index"].to_pylist()))
    assert keys == [(i, s) for i in (10, 11, 12) for s in range(3)]  # the empty prompt: an error row per sample
    rows = {(r["id"], r["sample_index"]): r for r in first.to_pylist()}
    assert all(rows[12, s]["finish_reason"] == "error" for s in range(3))
    assert len({tuple(rows[10, s]["output_token_ids"]) for s in range(3)}) > 1
    for s in range(3):
        row = rows[10, s]
        assert len(row["output_logprobs"]) == len(row["output_top_logprobs"]) == 4
        assert all(len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"] for top in row["output_top_logprobs"])
    parts = sorted((out / "results").glob("part-*.parquet"))
    lost = next(p for p in parts if (11, 1) in zip(*pq.read_table(p, columns=["id", "sample_index"]).to_pydict()
                                                          .values()))
    lost.unlink()  # as if the run had died before committing sample 1 of row 11
    assert (again := run_cli(args)).returncode == 0, again.stderr
    second = pq.read_table(out / "results")
    assert sorted(zip(second["id"].to_pylist(), second["sample_index"].to_pylist())) == keys
    rerun = {(r["id"], r["sample_index"]): r["output_token_ids"] for r in second.to_pylist()}
    assert rerun == {k: r["output_token_ids"] for k, r in rows.items()}  # same seeds, same samples
    merged = run_cli(["batchprefill-merge", f"output.dir={out}", "sampling.n=3", "output.plot=false"])
    assert merged.returncode == 0, merged.stderr
    next(iter(sorted((out / "results").glob("part-*.parquet")))).unlink()
    merged = run_cli(["batchprefill-merge", f"output.dir={out}", "sampling.n=3", "output.plot=false"])
    assert merged.returncode == 1 and "1 of 9 rows have no result" in merged.stderr


def test_a_context_plus_choice_past_the_model_context_is_that_rows_error(tokenizer):
    from batchprefill.tasks.score import choice_tokens

    contexts = ["The sky is", "Grass is"]
    tokens = tokenizer.encode_batch(contexts)  # 3 and 2 tokens
    errors = [None, None]
    choices = choice_tokens([[" blue", " a very long and winding answer"], [" green"]], contexts, ["", ""], tokens,
                            errors, 6, tokenizer)
    assert errors[0].startswith("prompt plus choices[1] have") and "at most 6 fit" in errors[0]
    assert choices[0] is None and errors[1] is None
    assert choices[1] == [tokenizer.encode_batch(["Grass is green"])[0][len(tokens[1]):]]
