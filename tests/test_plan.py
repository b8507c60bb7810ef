"""`batchprefill-plan`: the cost model on worked numbers (a 40-layer, 8-KV-head model in fp16), and the command
end to end.

The end-to-end checks recompute the ideal token count by brute force from the tokenizer, independently of
`batchprefill.pipeline.order`, so a slip in ordering, grouping or the one-token rule shows up as a wrong count.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchprefill.io.columns import ERROR, NAMESPACE, ROW, TOKENS
from batchprefill.model.config import kv_bytes_per_token
from batchprefill.model.families import read_config
from batchprefill.pipeline.plan import (
    PLAN_SCHEMA,
    MemoryFit,
    Tally,
    attention_pairs,
    prefill_flops,
    transfer_seconds,
    weight_bytes,
)
from batchprefill.report.summary import print_plan_summary
from batchprefill.units import readable_bytes
from tests.conftest import run_cli

BLOCK = 16
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SYSTEMS = [
    "Alpha desk: you are a patient tutor who answers in plain words, citing the passage below and nothing else.",
    "Beta desk: you are a terse analyst; reply with a single line taken from the text that follows, or 'none'.",
]
DOCUMENTS = [
    "The river town grew around a stone bridge built in 1320, and its market still opens every Thursday.",
    "Glaciers store about two thirds of the fresh water on Earth and move a few metres each day downhill.",
    "The first public library of the city opened in 1851 with four thousand books and a single reading room.",
]
QUESTIONS = ["When was it built or opened?", "Give one number from the text."]


def test_kv_bytes_per_token_is_160_kib_at_40_layers_and_128_kib_at_32() -> None:
    assert kv_bytes_per_token(40, 8, 128, 2) == 163_840
    assert kv_bytes_per_token(32, 8, 128, 2) == 128 * 1024


def test_kv_transfer_of_a_4096_token_prompt() -> None:
    total = 4096 * kv_bytes_per_token(40, 8, 128, 2)
    assert total == 671_088_640 == 640 * 2**20
    assert transfer_seconds(total, 200) == pytest.approx(0.02684, abs=1e-5)


def test_attention_pairs_with_and_without_a_cached_prefix() -> None:
    assert attention_pairs(2496, 3000 - 2496) == 1_385_244
    assert attention_pairs(0, 3000) == 3000 * 3001 // 2 == 4_501_500


def test_prefill_flops_adds_linear_and_attention_terms() -> None:
    assert prefill_flops(10, 1000, 2, 4, 8, 55) == 2 * 10 * 1000 + 4 * 2 * 4 * 55 * 8
    assert prefill_flops(0, 1000, 2, 4, 8, 0) == 0


def test_sizes_read_in_the_largest_unit_they_fill() -> None:
    assert [readable_bytes(n) for n in (0, 1023, 1024, 1536, 46_080, 5 * 2**20, 2**30 - 2**19)] == [
        "0 B", "1,023 B", "1.00 KiB", "1.50 KiB", "45.0 KiB", "5.00 MiB", "1.00 GiB"]
    assert readable_bytes(2_280_201_597_747) == "2.07 TiB"  # the "2,174,569.7 MiB"
    assert readable_bytes(10**15) == "909 TiB"  # no unit past TiB


def test_counts_agree_with_their_nouns_and_types_take_their_article() -> None:
    from batchprefill.units import a_type, counted

    assert [counted(n, "error") for n in (0, 1, 2, 1500)] == ["0 errors", "1 error", "2 errors", "1,500 errors"]
    assert [a_type(v) for v in (3, "x", [], None, 1.5)] == ["an int", "a str", "a list", "a NoneType", "a float"]


def test_a_run_summary_says_1_request_1_error_and_names_no_folder_a_temporary_job_removes(capsys, tmp_path) -> None:
    from batchprefill.report.summary import print_run_summary

    job = {"num_requests": 1, "num_errors": 1, "wall_seconds": 0.5, "prompt_tokens": 0, "cached_tokens": 0,
           "cache_hit_rate": 0.0, "computed_prompt_tokens": 0, "prefill_tokens_per_second": 0.0, "output_tokens": 0,
           "output_tokens_per_second": 0.0, "evicted_blocks": 0, "preemptions": 0}
    pool = "a KV pool of 16 tokens in float32, 4 bytes a token"
    print_run_summary(job, tmp_path, None, "float32", pool, temporary=True)
    line = capsys.readouterr().err
    assert line.startswith("batchprefill: 1 request (1 error) in 0.5 s")
    assert str(tmp_path) not in line and line.rstrip().endswith("their temporary folder is removed.")


def test_the_report_prints_a_2_tb_kv_cache_in_tib(capsys, tmp_path) -> None:
    row = {"requests": 10, "error_rows": 0, "groups": 2, "largest_group": 6, "ideal_computed_tokens": 50,
           "computed_tokens_without_reuse": 100, "prefill_flops_with_reuse": 1e12, "prefill_flops_without_reuse": 2e12,
           "kv_bytes_per_token": 46_080, "kv_bytes_total": 2_280_201_597_747, "kv_transfer_seconds_mean": 1e-3}
    print_plan_summary(row, 100.0, tmp_path)
    assert "46,080 bytes per token, 2.07 TiB for all prompts" in capsys.readouterr().out


def _partition() -> pa.Table:
    """Five rows, block size 2: [1,2,3,4], [7,7], [1,2,3,5], an error row and [1,2,9]."""
    return pa.table({ROW: [0, 1, 2, 3, 4],
                     TOKENS: pa.array([[1, 2, 3, 4], [7, 7], [1, 2, 3, 5], [], [1, 2, 9]], pa.list_(pa.int32())),
                     ERROR: [None, None, None, "prompt is null", None], NAMESPACE: [""] * 5})


def test_a_partition_in_prefix_order_reuses_4_of_13_tokens_in_a_group_of_3() -> None:
    """Prefix order [1,2,3,4] [1,2,3,5] [1,2,9] [7,7]: the middle two reuse the block [1,2] (2 tokens each), so
    9 tokens are computed; attention pairs 10 + (2*2 + 3) + (1*2 + 1) + 3 = 23 with reuse, 10+10+6+3 = 29 without.
    The first three share one full block with a neighbour, [7,7] none."""
    tally = Tally()
    tally.add_partition(_partition(), "prefix", 2)
    assert (tally.requests, tally.error_rows, tally.prompt_tokens, tally.computed_tokens) == (4, 1, 13, 9)
    assert (tally.pairs_with_reuse, tally.pairs_without_reuse) == (23, 29)
    assert tally.group_sizes == {3: 1, 1: 1} and tally.depths == {1: 3, 0: 1}


def test_the_same_partition_in_input_order_reuses_only_the_last_rows_2_tokens() -> None:
    """Input order [1,2,3,4] [7,7] [1,2,3,5] [1,2,9]: only [1,2,9] follows a prompt it shares [1,2] with, so
    11 tokens are computed and 10 + 3 + 10 + (1*2 + 1) = 26 pairs scored."""
    tally = Tally()
    tally.add_partition(_partition(), "input", 2)
    assert (tally.requests, tally.prompt_tokens, tally.computed_tokens, tally.pairs_with_reuse) == (4, 13, 11, 26)
    assert tally.group_sizes == {1: 2, 2: 1} and tally.depths == {1: 3, 0: 1}


def _prompts() -> list[str]:
    """Systems innermost, so neighbours in input order never share a block; one empty prompt at the end."""
    return [f"{system}\n\n{document}\n\nQuestion: {question}" for question in QUESTIONS for document in DOCUMENTS
            for system in SYSTEMS] + [""]


def _brute_force_ideal(token_ids: list[list[int]]) -> int:
    """In sorted order: each prompt computes all but the full blocks it shares with any earlier prompt."""
    ordered = sorted(token_ids)
    computed = 0
    for i, ids in enumerate(ordered):
        common = max((_common_prefix(ids, earlier) for earlier in ordered[:i]), default=0)
        reused = min(common // BLOCK, (len(ids) - 1) // BLOCK) * BLOCK
        computed += len(ids) - reused
    return computed


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


def _plan(tmp_path: Path, name: str, *overrides: str) -> dict:
    data = tmp_path / "prompts.parquet"
    if not data.exists():
        pq.write_table(pa.table({"prompt": _prompts()}), data)
    out = tmp_path / name
    result = run_cli(["batchprefill-plan", f"data.input={data}", f"output.dir={out}", "output.progress=false",
                      "engine.kv_cache_dtype=float16", *overrides], timeout=120)
    assert result.returncode == 0, result.stderr
    assert "prompt tokens to compute" in result.stdout
    table = pq.read_table(out / "plan.parquet")
    assert table.schema.names == PLAN_SCHEMA.names
    assert table.num_rows == 1
    png = (out / "plan.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    return table.to_pylist()[0]


@pytest.fixture(scope="module")
def plans(tmp_path_factory, model_folder) -> tuple[dict, dict]:
    """One plan in prefix order and one in input order over the same small dataset."""
    tmp_path = tmp_path_factory.mktemp("plan")
    return _plan(tmp_path, "prefix"), _plan(tmp_path, "input", "data.order=input")


def test_plan_counts_requests_groups_and_ideal_tokens(plans, tokenizer) -> None:
    prefix, _ = plans
    token_ids = tokenizer.encode_batch(_prompts()[:-1])
    assert min(len(ids) for ids in token_ids) > 3 * BLOCK  # every system prompt spans full blocks
    assert prefix["requests"] == 12 and prefix["error_rows"] == 1
    assert prefix["prompt_tokens"] == prefix["computed_tokens_without_reuse"] == sum(map(len, token_ids))
    assert prefix["groups"] == 2 and prefix["largest_group"] == 6
    assert prefix["ideal_computed_tokens"] == _brute_force_ideal(token_ids)
    assert prefix["ideal_computed_tokens"] < prefix["prompt_tokens"]


def test_plan_costs_follow_the_model(plans, tokenizer, model_folder) -> None:
    prefix, _ = plans
    model = read_config(model_folder)
    lengths = [len(ids) for ids in tokenizer.encode_batch(_prompts()[:-1])]
    without = prefill_flops(sum(lengths), model.num_parameters(), model.num_layers, model.num_heads,
                            model.head_dim, sum(attention_pairs(0, n) for n in lengths))
    assert prefix["prefill_flops_without_reuse"] == pytest.approx(without, rel=1e-12)
    assert prefix["prefill_flops_with_reuse"] < prefix["prefill_flops_without_reuse"]
    per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, 2)
    assert prefix["kv_bytes_per_token"] == per_token
    assert prefix["kv_bytes_total"] == sum(lengths) * per_token
    assert prefix["kv_transfer_seconds_mean"] == pytest.approx(sum(lengths) * per_token / 12 / 12.5e9)


def test_input_order_reuses_only_what_neighbours_share(plans) -> None:
    prefix, baseline = plans
    assert baseline["requests"] == prefix["requests"]
    assert baseline["ideal_computed_tokens"] == baseline["prompt_tokens"] > prefix["ideal_computed_tokens"]
    assert baseline["groups"] == 12 and baseline["largest_group"] == 1


def test_missing_input_is_one_line_naming_data_input(tmp_path) -> None:
    result = run_cli(["batchprefill-plan", f"data.input={tmp_path / 'absent.parquet'}",
                      f"output.dir={tmp_path / 'out'}"], timeout=120)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.input" in lines[0], result.stderr
    assert not (tmp_path / "out" / "plan.parquet").exists()


# Llama-3.1-70B's config.json shapes (no weights: the plan reads the config and the tokenizer only).
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
             "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# 80 x (8192 x (8192 + 2 x 1024) + 8192 x 8192 + 3 x 8192 x 28672) dense linear parameters; the embedding and
# the untied LM head 2 x 128,256 x 8192.
LLAMA_70B_LINEARS, LLAMA_70B_OTHERS = 68_451_041_280, 2_101_346_304


def test_llama_3_1_70b_fits_one_141_gb_card_in_fp8_with_an_8k_token_pool_but_not_in_bfloat16(tmp_path) -> None:
    import json

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    model = read_config(tmp_path)
    assert (model.dense_linear_parameters(), model.other_parameters()) == (LLAMA_70B_LINEARS, LLAMA_70B_OTHERS)
    pool = 8192 * model.kv_bytes_per_token(2)  # 8,192 tokens x 320 KiB in bfloat16
    fp8 = MemoryFit(weight_bytes(model, 2, fp8_linears=True), pool, 141 * 10**9, 0.8, "FP8 linears")
    bf16 = MemoryFit(weight_bytes(model, 2, fp8_linears=False), pool, 141 * 10**9, 0.8, "bfloat16")
    assert fp8.weight_bytes == LLAMA_70B_LINEARS + 2 * LLAMA_70B_OTHERS == 72_653_733_888  # "about 70 GB"
    assert bf16.weight_bytes == 2 * (LLAMA_70B_LINEARS + LLAMA_70B_OTHERS) == 141_104_775_168  # more than the card
    assert fp8.fits is True and bf16.fits is False
    assert MemoryFit(fp8.weight_bytes, pool, None, 0.8, "FP8 linears").fits is None


QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
                 "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}


def test_qwen3_30b_a3b_fp8_checkpoint_fits_a_48_gb_card_with_its_experts_in_fp8_not_dequantized(tmp_path) -> None:
    """30.5 B parameters, 29.0 B of them in the 48 layers x 128 experts: in FP8 the weights are 31.2 GB (the
    embedding, head and routers in bfloat16), with the experts dequantized at load 60.2 GB. With 8,192 tokens of
    96 KiB: one 48 GB card holds the first and not the second."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    model = read_config(tmp_path)
    assert model.expert_parameters() == 48 * 128 * 3 * 2048 * 768 == 28_991_029_248
    assert model.dense_linear_parameters() + model.expert_parameters() + model.other_parameters() == 30_531_911_680
    pool = 8192 * model.kv_bytes_per_token(2)
    held = MemoryFit(weight_bytes(model, 2, fp8_linears=True, fp8_experts=True), pool, 48 * 10**9, 0.8, "FP8")
    dequantized = MemoryFit(weight_bytes(model, 2, fp8_linears=True), pool, 48 * 10**9, 0.8, "FP8 linears")
    assert (held.weight_bytes, dequantized.weight_bytes) == (31_166_824_448, 60_157_853_696)
    assert held.fits is True and dequantized.fits is False


# A block-wise FP8 checkpoint's config (Qwen3's and DeepSeek-V3's FP8 releases): its linears multiply in FP8 on a GPU
# (the block kernel), so they count one byte each, as a 16-bit checkpoint quantized at load does.
BLOCK_WISE_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}


@pytest.mark.parametrize("fp8", ["model.quantization=fp8", "a block-wise FP8 checkpoint"])
def test_the_plan_of_a_70b_fp8_gpu_job_says_it_fits_a_141_gb_card_from_the_config_alone(fp8, tmp_path, model_folder,
                                                                                         tokenizer):
    """engine.device=cuda is taken at its word here (no GPU): the folder holds config.json and a tokenizer. The
    least pool holds the longest prompt and its 100 answer tokens, in whole 16-token blocks of 320 KiB a token."""
    import json
    import shutil

    folder = tmp_path / "llama-70b"
    folder.mkdir()
    checkpoint = fp8 == "a block-wise FP8 checkpoint"
    (folder / "config.json").write_text(json.dumps(
        dict(LLAMA_70B, quantization_config=BLOCK_WISE_FP8) if checkpoint else LLAMA_70B))
    shutil.copy(model_folder / "tokenizer.json", folder / "tokenizer.json")
    pq.write_table(pa.table({"prompt": _prompts()[:4]}), tmp_path / "in.parquet")
    out = tmp_path / "out"
    result = run_cli(["batchprefill-plan", "model=hf", f"model.path={folder}", *([] if checkpoint else [fp8]),
                      "model.dtype=bfloat16", "engine.device=cuda", "plan.device_memory_gb=141",
                      "sampling.max_tokens=100", f"data.input={tmp_path / 'in.parquet'}", f"output.dir={out}",
                      "output.progress=false"], timeout=120)
    assert result.returncode == 0, result.stderr
    row = pq.read_table(out / "plan.parquet").to_pylist()[0]
    assert row["weight_bytes"] == 72_653_733_888 and row["device_memory_bytes"] == 141 * 10**9
    assert row["fits_device"] is True
    longest = max(len(ids) for ids in tokenizer.encode_batch(_prompts()[:4]))
    assert row["min_pool_bytes"] == -(-(longest + 100) // 16) * 16 * 327_680
    assert "67.7 GiB of weights (FP8 linears, bfloat16 otherwise)" in result.stdout
    assert "on a 131 GiB device: fits" in result.stdout
def _small_input(tmp_path: Path) -> Path:
    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["The capital of France is", "Two plus two is"]}), data)
    return data


def test_a_plan_into_an_output_dir_a_live_run_writes_refuses_naming_it_and_leaves_its_partitions(tmp_path) -> None:
    import os

    import batchprefill
    from batchprefill import JobError
    from batchprefill.pipeline.shard_lock import LEASE_FOLDER, ShardLock
    from batchprefill.settings import Sharding

    out = tmp_path / "out"
    (out / "partitions").mkdir(parents=True)
    (out / "partitions" / "manifest.json").write_text("{}")  # what the live run reads
    live = ShardLock(out / LEASE_FOLDER, Sharding(1, 0), "live run", 120)
    live.acquire()  # this test's process: alive, so its lease holds
    try:
        with pytest.raises(JobError, match=rf"^output\.dir={out} is being written by a live run: host .*, process "
                                           rf"{os.getpid()}, .*batchprefill-plan would remake the partitions it reads"):
            batchprefill.plan(_small_input(tmp_path), output={"dir": str(out)}, progress=False)
    finally:
        live.release()
    assert (out / "partitions" / "manifest.json").read_text() == "{}" and not (out / "plan.parquet").exists()


def test_a_plan_refuses_a_missing_adapter_folder_and_an_adapter_of_another_base_as_the_run_would(
    tmp_path, model_folder
) -> None:
    import batchprefill
    from batchprefill import JobError
    from tests.lora_helpers import ALL_SEPARATE, save_adapter, save_base

    data = _small_input(tmp_path)
    missing = tmp_path / "no-such-adapter"
    with pytest.raises(JobError, match=rf"^model\.adapters\.math \({missing}\): {missing} does not exist$"):
        batchprefill.plan(data, model={"adapters": {"math": str(missing)}}, output={"dir": str(tmp_path / "a")})
    other = tmp_path / "tiny-adapter"
    save_adapter(save_base("llama", tmp_path / "tiny-base", model_folder), other, seed=1, targets=ALL_SEPARATE)
    with pytest.raises(JobError, match=rf"^model\.adapters\.tiny \({other}\): .* do not fit the model's projection"):
        batchprefill.plan(data, model={"adapters": {"tiny": str(other)}}, output={"dir": str(tmp_path / "b")})
    assert not (tmp_path / "b" / "plan.parquet").exists()
