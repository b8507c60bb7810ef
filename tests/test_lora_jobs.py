"""Jobs whose rows run with many LoRA adapters: each row gets what PEFT computes for its adapter, rows of different
adapters never share KV, an unknown adapter is an error row, a bad adapter folder stops the job with one line, and
resume, shards and OpenAI batch files carry each row's adapter."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchprefill.model.tokenizer import PromptTokenizer
from tests.conftest import run_cli
from tests.lora_helpers import ALL_PHI3, ALL_SEPARATE, save_adapter, save_base

SYSTEM = "You are a careful assistant who answers in one short sentence and never repeats the question. "
PROMPTS = [SYSTEM + "What is the capital of France?", SYSTEM + "Name three colors of the rainbow."]
MAX_TOKENS = 6
TARGETS = {
    "llama": [ALL_SEPARATE, ["q_proj", "v_proj"], ["o_proj", "down_proj", "up_proj"]],
    "phi3": [ALL_PHI3, ["qkv_proj"], ["gate_up_proj", "o_proj"]],
}
FAST = [
    "engine.device=cpu",
    "engine.num_threads=1",
    "engine.block_size=4",
    "engine.kv_cache_tokens=2048",
    "engine.max_batched_tokens=48",
    f"sampling.max_tokens={MAX_TOKENS}",
    "sampling.ignore_eos=true",
    "output.progress=false",
    "output.plot=false",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, model_folder):
    """kind -> (base folder, {adapter name: folder}, {adapter name or None: the reference model})."""
    built = {}

    def get(kind: str):
        if kind not in built:
            root = tmp_path_factory.mktemp(f"lora-job-{kind}")
            base = save_base(kind, root / "base", model_folder)
            folders, references = {}, {None: base}
            for i, targets in enumerate(TARGETS[kind], start=1):
                folders[f"a{i}"] = root / f"a{i}"
                references[f"a{i}"] = save_adapter(
                    base, folders[f"a{i}"], seed=20 + i, targets=targets, rank=4 * i, alpha=8, use_rslora=i == 3
                )
            built[kind] = root / "base", folders, references
        return built[kind]

    return get


def adapter_args(folders: dict[str, Path]) -> list[str]:
    return [f"+model.adapters.{name}={folder}" for name, folder in folders.items()]


def mixed_rows() -> list[dict]:
    """Both prompts under the base model and each adapter (ids 0-7), then the first prompt under an adapter the
    job does not have (8) and under an empty name (9, the base model)."""
    rows = [
        {"id": len(PROMPTS) * a + p, "prompt": prompt, "adapter": adapter}
        for a, adapter in enumerate([None, "a1", "a2", "a3"])
        for p, prompt in enumerate(PROMPTS)
    ]
    return [*rows, {"id": 8, "prompt": PROMPTS[0], "adapter": "nope"}, {"id": 9, "prompt": PROMPTS[0], "adapter": ""}]


def run_job(base: Path, folders: dict[str, Path], data: Path, out: Path, *extra: str, check: bool = True):
    """`batchprefill-run` on the tiny model with these adapters and the rows' `adapter` column; with `check`, it
    must succeed."""
    done = run_cli([sys.executable, "-m", "batchprefill.run", "model=hf", f"model.path={base}", f"data.input={data}",
                    "data.adapter_column=adapter", f"output.dir={out}", *FAST, *adapter_args(folders), *extra])
    assert not check or done.returncode == 0, done.stderr
    return done


def results(out: Path) -> dict:
    return {row["id"]: row for row in pq.read_table(out / "results").to_pylist()}


def peft_greedy(reference, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["llama", "phi3"])
def test_rows_of_three_adapters_and_the_base_in_one_job_get_pefts_greedy_tokens_and_share_kv_only_within_one(
    kind, setup, tmp_path
):
    """Ten rows, two prompts sharing a 19-token system prompt under the base and adapters a1-a3 in the same steps
    (a 48-token budget): each row's 6 greedy tokens are PEFT's for its adapter. Within an adapter the second
    prompt reuses the first one's blocks; across adapters the same prompt reuses nothing (each adapter's first
    row caches 0 tokens), and the row naming adapter `nope` is an error row while the job goes on."""
    base, folders, references = setup(kind)
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(mixed_rows()), data)
    run_job(base, folders, data, tmp_path / "out")
    rows = results(tmp_path / "out")
    assert len(rows) == 10
    assert rows[8]["finish_reason"] == "error" and "'nope'" in rows[8]["error"], rows[8]
    assert rows[8]["adapter"] == "nope"  # the input column comes back as given
    ids = PromptTokenizer(base).encode_batch(PROMPTS)
    for a, adapter in enumerate([None, "a1", "a2", "a3"]):
        mine = [rows[2 * a], rows[2 * a + 1]]
        for row, prompt in zip(mine, ids):
            assert row["error"] is None
            assert row["output_token_ids"] == peft_greedy(references[adapter], prompt), f"row {row['id']}"
        assert min(r["num_cached_tokens"] for r in mine) == 0, f"{adapter}: KV came from another adapter"
        assert max(r["num_cached_tokens"] for r in mine) >= 16, f"{adapter}: the shared prompt was not reused"
    assert rows[9]["error"] is None and rows[9]["output_token_ids"] == rows[0]["output_token_ids"]
    assert rows[9]["num_cached_tokens"] + rows[0]["num_cached_tokens"] >= len(ids[0]) - 4  # base rows share
    groups = pq.read_table(tmp_path / "out" / "stats" / "groups.parquet").to_pylist()
    assert sorted((g["adapter"] or "", g["num_requests"]) for g in groups) == [("", 3), ("a1", 2), ("a2", 2), ("a3", 2)]
    per_adapter = pq.read_table(tmp_path / "out" / "stats" / "adapters.parquet").to_pylist()
    assert [(a["adapter"], a["num_requests"], a["output_tokens"]) for a in per_adapter] == [
        (None, 3, 3 * MAX_TOKENS), ("a1", 2, 2 * MAX_TOKENS), ("a2", 2, 2 * MAX_TOKENS), ("a3", 2, 2 * MAX_TOKENS)]
    assert all(a["cached_tokens"] == max(rows[i]["num_cached_tokens"] for i in (2 * n, 2 * n + 1))
               for n, a in enumerate(per_adapter[1:], start=1))
    if kind == "llama":  # the same adapters make every output differ from the base model's somewhere
        assert len({tuple(rows[i]["output_token_ids"]) for i in (0, 2, 4, 6)}) > 1


def test_a_resumed_run_and_two_shards_with_a_merge_give_the_uninterrupted_runs_rows(setup, tmp_path):
    """The mixed job of the test above, committed two rows per part: with its last parts removed and rerun, and as
    two shards merged, every row comes back once with the same tokens."""
    base, folders, _ = setup("llama")
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(mixed_rows()), data)
    run_job(base, folders, data, tmp_path / "whole", "output.commit_every_rows=2")
    want = results(tmp_path / "whole")
    parts = sorted((tmp_path / "whole" / "results").glob("part-*.parquet"))
    assert len(parts) >= 4
    for part in parts[len(parts) // 2 :]:
        part.unlink()
    run_job(base, folders, data, tmp_path / "whole", "output.commit_every_rows=2")
    for index in (0, 1):
        run_job(base, folders, data, tmp_path / "sharded", "data.num_shards=2", f"data.shard_index={index}")
    merged = run_cli(
        [
            sys.executable,
            "-m",
            "batchprefill.merge",
            f"output.dir={tmp_path / 'sharded'}",
            "data.num_shards=2",
            "output.plot=false",
        ]
    )
    assert merged.returncode == 0, merged.stderr
    merged_adapters = pq.read_table(tmp_path / "sharded" / "stats" / "adapters.parquet").to_pylist()
    assert [(a["adapter"], a["num_requests"]) for a in merged_adapters] == [
        ("a1", 2), ("a2", 2), ("a3", 2), (None, 3)]  # summed over both shards (sorted, nulls last)
    for got in (results(tmp_path / "whole"), results(tmp_path / "sharded")):
        assert sorted(got) == list(range(10))
        assert {i: r["output_token_ids"] for i, r in got.items()} == {i: r["output_token_ids"] for i, r in want.items()}


def test_an_adapter_folder_with_dora_stops_the_job_with_one_line_naming_it(setup, tmp_path):
    base, folders, _ = setup("llama")
    dora = tmp_path / "dora"
    dora.mkdir()
    options = json.loads((folders["a1"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**options, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((folders["a1"] / "adapter_model.safetensors").read_bytes())
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(mixed_rows()), data)
    done = run_job(base, {"a1": dora}, data, tmp_path / "out", check=False)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.adapters.a1" in lines[0] and "DoRA" in lines[0], done.stderr
    assert not list((tmp_path / "out").glob("results/part-*.parquet"))


def test_an_openai_batch_line_whose_model_names_an_adapter_runs_with_it_and_any_other_name_with_the_base(
    setup, tmp_path
):
    base, folders, references = setup("llama")
    lines = [
        {
            "custom_id": name,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS},
        }
        for name, model in (("tuned", "a2"), ("plain", "smollm2"), ("other", "a1"))
    ]
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_job(base, {"a2": folders["a2"]}, data, tmp_path / "out", "data.format=openai_batch")
    rows = {row["custom_id"]: row for row in pq.read_table(tmp_path / "out" / "results").to_pylist()}
    prompt = PromptTokenizer(base).encode_batch(PROMPTS[:1])[0]
    assert rows["tuned"]["output_token_ids"] == peft_greedy(references["a2"], prompt)
    assert rows["plain"]["output_token_ids"] == peft_greedy(references[None], prompt)
    assert rows["other"]["output_token_ids"] == rows["plain"]["output_token_ids"]  # a1 is not this job's


def test_the_plan_groups_each_adapters_rows_apart_and_counts_the_adapters(setup, tmp_path):
    """The ten mixed rows: the same two prompts under the base and three adapters make 4 groups (one per adapter,
    the base's three rows in one), 9 requests, 1 error row (`nope`), and 3 adapters."""
    base, folders, _ = setup("llama")
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(mixed_rows()), data)
    done = run_cli(
        [
            sys.executable,
            "-m",
            "batchprefill.plan",
            "model=hf",
            f"model.path={base}",
            f"data.input={data}",
            "data.adapter_column=adapter",
            f"output.dir={tmp_path / 'out'}",
            "engine.block_size=4",
            *adapter_args(folders),
        ]
    )
    assert done.returncode == 0, done.stderr
    row = pq.read_table(tmp_path / "out" / "plan.parquet").to_pylist()[0]
    assert (row["groups"], row["largest_group"], row["requests"], row["error_rows"], row["adapters"]) == (4, 3, 9, 1, 3)
