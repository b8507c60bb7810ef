"""engine.batch_invariant: a row's bits do not depend on what shares its steps (the CPU path; the Triton kernels'
counterpart is test_batch_invariance_triton.py).

Each layer is checked on its own first (a linear over any row count, attention over any chunking and company),
then whole engines on a tiny random Llama in float32 and bfloat16 under budgets, sequence caps, orders and a pool
small enough to preempt, then jobs: 1 shard against 3 merged, and a run killed at its first commit and resumed.
"""

from __future__ import annotations

import functools
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.engine import Engine
from batchprefill.engine.request import Request
from batchprefill.intmath import cdiv
from batchprefill.io.atomic import KILL_AT_ENV
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.linear import INVARIANT_ROWS, Linear
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.loader import load_model
from batchprefill.sampling_params import SamplingParams
from tests.conftest import run_cli

DTYPES = [torch.float32, torch.bfloat16]


# ---- linears ---------------------------------------------------------------------------------------------------

_X = torch.randn(300, 576, generator=torch.Generator().manual_seed(0))
_WEIGHT = torch.randn(1536, 576, generator=torch.Generator().manual_seed(1)) / 24  # SmolLM2's fused QKV shape
_LINEARS = {dtype: Linear(_WEIGHT.to(dtype), batch_invariant=True) for dtype in DTYPES}


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(DTYPES), rows=st.lists(st.integers(0, 299), min_size=1, max_size=300))
def test_an_invariant_linear_gives_each_row_the_bits_it_gets_among_all_300_rows(dtype, rows):
    """Any subset, in any order, of 1 to 300 rows (oneDNN's bfloat16 products of this shape differ in their last
    bits between 1-32 rows and 33-200 rows when multiplied in one call)."""
    x = _X.to(dtype)
    layer = _LINEARS[dtype]
    assert torch.equal(layer(x[rows]), layer(x)[rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_invariant_linear_computes_what_f_linear_does_over_301_rows(dtype):
    """Three slices of 128 rows, the last one padded with 83 rows of zeros."""
    x = torch.cat([_X, _X[:1]]).to(dtype)
    got = _LINEARS[dtype](x)
    want = F.linear(x.float(), _WEIGHT.to(dtype).float())
    assert got.shape == (301, 1536) and cdiv(301, INVARIANT_ROWS) == 3
    assert torch.allclose(got.float(), want, atol=0.05 if dtype == torch.bfloat16 else 1e-4, rtol=0.02)


# ---- attention ---------------------------------------------------------------------------------------------------

BLOCK, KV_HEADS, Q_HEADS = 16, 2, 6
# 64: on a CPU with AMX the bfloat16 walks are tile products; 48 is no multiple of 32, so they are vector walks
HEAD_DIMS = [64, 48]
SEQ_LENS = [150, 45, 97, 33]  # keys of four sequences, laid in random pool blocks


@functools.cache
def _pool(dtype: torch.dtype, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], list[torch.Tensor]]:
    """The four sequences' keys and values in shuffled blocks, and a query for every position of each."""
    generator = torch.Generator().manual_seed(2)
    needed = [cdiv(n, BLOCK) for n in SEQ_LENS]
    order = torch.randperm(sum(needed) + 2, generator=generator).tolist()
    tables, start = [], 0
    for count in needed:
        tables.append(order[start : start + count])
        start += count
    shape = (sum(needed) + 2, BLOCK, KV_HEADS, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    queries = [torch.randn(n, Q_HEADS, head_dim, generator=generator).to(dtype) for n in SEQ_LENS]
    return k_cache, v_cache, tables, queries


def _attend(ops: TorchOps, dtype: torch.dtype, step: list[tuple[int, int, int]], head_dim: int = 64,
            window: int | None = None) -> dict[tuple[int, int], torch.Tensor]:
    """One step of (sequence, first query position, query count): each queried position's output."""
    k_cache, v_cache, tables, queries = _pool(dtype, head_dim)
    width = max(len(tables[s]) for s, _, _ in step) + 1
    block_tables = torch.zeros(len(step), width, dtype=torch.int32)
    for i, (s, _, _) in enumerate(step):
        block_tables[i, : len(tables[s])] = torch.tensor(tables[s])
    q_lens = [count for _, _, count in step]
    seq_lens = [first + count for _, first, count in step]
    meta = AttentionMetadata(
        query_start=torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64), query_lens_host=q_lens, seq_lens_host=seq_lens)
    query = torch.cat([queries[s][first : first + count] for s, first, count in step])
    out = ops.attention(query, k_cache, v_cache, meta, head_dim**-0.5, window)
    rows = [(s, first + j) for s, first, count in step for j in range(count)]
    return dict(zip(rows, out.unbind(0), strict=True))


@functools.cache
def _invariant() -> TorchOps:
    return TorchOps(batch_invariant=True)


@functools.cache
def _whole(dtype: torch.dtype, head_dim: int = 64, window: int | None = None) -> dict[tuple[int, int], torch.Tensor]:
    """Every position's output from its whole prompt in one step, alone."""
    return {key: row for s, n in enumerate(SEQ_LENS)
            for key, row in _attend(_invariant(), dtype, [(s, 0, n)], head_dim, window).items()}


WINDOWS = [None, 40, 7]  # none; a window over blocks; one inside a block


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_invariant_attention_of_whole_prompts_matches_the_fused_path(dtype, head_dim, window):
    """The reference the next test holds every step to is itself right: within rounding of torch's fused
    attention over the same prompts (under a sliding window of 40 or 7 keys too)."""
    fused = {key: row for s, n in enumerate(SEQ_LENS)
             for key, row in _attend(TorchOps(), dtype, [(s, 0, n)], head_dim, window).items()}
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    whole = _whole(dtype, head_dim, window)
    assert all(torch.allclose(whole[key].float(), row.float(), atol=tolerance) for key, row in fused.items())


@st.composite
def steps(draw) -> list[tuple[int, int, int]]:
    """Some of the sequences, each with a run of queries ending anywhere: decodes (one query), chunks after a
    cached part, whole prompts."""
    chosen = draw(st.lists(st.sampled_from(range(len(SEQ_LENS))), min_size=1, max_size=4, unique=True))
    step = []
    for s in chosen:
        end = draw(st.integers(1, SEQ_LENS[s]))
        count = draw(st.one_of(st.just(1), st.integers(1, end)))
        step.append((s, end - count, count))
    return step


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(DTYPES), head_dim=st.sampled_from(HEAD_DIMS), window=st.sampled_from(WINDOWS),
       step=steps())
def test_invariant_attention_gives_every_position_its_whole_prompt_bits_in_any_step(dtype, head_dim, window, step):
    """Whatever shares the step, however the prompt was chunked, decode or prefill, under a window or not: the
    bits of the position computed in one pass over its whole prompt, alone."""
    got = _attend(_invariant(), dtype, step, head_dim, window)
    differ = [key for key, row in got.items() if not torch.equal(row, _whole(dtype, head_dim, window)[key])]
    assert not differ, f"{len(differ)} of {len(got)} positions differ, first {differ[0]}"


# ---- engines -----------------------------------------------------------------------------------------------------

TINY = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False)


def _random_folder(folder: Path, config: transformers.PretrainedConfig, model_folder: Path) -> Path:
    """A random causal LM of `config` saved in `folder`, with the shipped tokenizer beside it."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_folder / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, model_folder) -> Path:
    """A random Llama with 4 query heads per KV head (a set of 4 decodes fills a 16-row lane group)."""
    return _random_folder(tmp_path_factory.mktemp("tiny-llama"), transformers.LlamaConfig(**TINY), model_folder)


SMOL_SHAPED = dict(TINY, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                   head_dim=64)


@pytest.fixture(scope="module")
def smol_shaped_folder(tmp_path_factory, model_folder) -> Path:
    """Two random layers of SmolLM2-135M's shapes: where oneDNN's bfloat16 products change their bits with the
    row count, so the default path really does move (the jobs below are checked to differ without the setting)."""
    return _random_folder(tmp_path_factory.mktemp("smol-shaped"), transformers.LlamaConfig(**SMOL_SHAPED),
                          model_folder)


def _prompts() -> list[list[int]]:
    """14 prompts over 3 shared prefixes of 5-150 tokens, with 1-100 tokens of their own (chunks over 128 rows)."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(49152) for _ in range(rng.randrange(5, 150))] for _ in range(3)]
    return [prefixes[i % 3] + [rng.randrange(49152) for _ in range(rng.randrange(1, 100))] for i in range(14)]


def _generate(folder: Path, dtype: torch.dtype, invariant: bool, order: list[int], num_blocks: int = 256,
              **engine_settings) -> dict[int, tuple]:
    """Each prompt's tokens and logprobs (its own and the top 2 at each step): even rows greedy, odd rows
    sampled at temperature 1."""
    loaded = load_model(folder, dtype, torch.device("cpu"), TorchOps(batch_invariant=invariant))
    config = EngineConfig(EngineSettings(**engine_settings), num_blocks)
    engine = Engine(loaded.model, config, lambda ids: "", (loaded.identity, str(dtype)), dtype, torch.device("cpu"))
    prompts = _prompts()
    requests = [Request(i, prompts[i], SamplingParams(max_tokens=10, temperature=float(i % 2), seed=i,
                                                      ignore_eos=True, logprobs=2)) for i in order]
    return {r.request_id: (r.output_token_ids, r.output_logprobs, r.output_top_logprobs)
            for r in engine.generate(requests)}


VARIANTS = {
    "shuffled": dict(shuffle=True),
    "3 sequences, 37 tokens a step": dict(max_num_seqs=3, max_batched_tokens=37),
    "1 sequence, 16 tokens a step, shuffled": dict(shuffle=True, max_num_seqs=1, max_batched_tokens=16),
    "a pool of 24 blocks that preempts": dict(num_blocks=24, reserve_output_blocks=False, max_batched_tokens=64),
}


@functools.cache
def _baseline(folder: Path, dtype: torch.dtype) -> dict[int, tuple]:
    return _generate(folder, dtype, True, list(range(14)))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), max_num_seqs=st.integers(1, 16), max_batched_tokens=st.integers(8, 300),
       order_seed=st.integers(0, 1000), prefix_caching=st.booleans())
def test_any_cap_budget_order_and_caching_give_an_invariant_engine_the_same_bits(
        tiny_folder, dtype, max_num_seqs, max_batched_tokens, order_seed, prefix_caching):
    order = list(range(14))
    random.Random(order_seed).shuffle(order)
    got = _generate(tiny_folder, dtype, True, order, max_num_seqs=max_num_seqs,
                    max_batched_tokens=max_batched_tokens, prefix_caching=prefix_caching)
    baseline = _baseline(tiny_folder, dtype)
    assert [i for i in range(14) if got[i] != baseline[i]] == []


@pytest.fixture(scope="module")
def windowed_folder(tmp_path_factory, model_folder) -> Path:
    """The tiny model as Mistral with a 24-token sliding window: shorter than every prompt."""
    config = transformers.MistralConfig(**TINY, sliding_window=24)
    return _random_folder(tmp_path_factory.mktemp("tiny-mistral"), config, model_folder)


@pytest.mark.parametrize("windowed", [False, True], ids=["llama", "mistral-window-24"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_invariant_engine_gives_every_row_the_same_bits_under_any_budget_order_and_pool(
        tiny_folder, windowed_folder, dtype, windowed):
    folder = windowed_folder if windowed else tiny_folder
    order = list(range(14))
    baseline = _generate(folder, dtype, True, order)
    for name, variant in VARIANTS.items():
        variant = dict(variant)
        shuffled = order[:]
        if variant.pop("shuffle", False):
            random.Random(1).shuffle(shuffled)
        got = _generate(folder, dtype, True, shuffled, **variant)
        differ = [i for i in order if got[i] != baseline[i]]
        assert not differ, f"{name}: rows {differ} differ"


# ---- jobs --------------------------------------------------------------------------------------------------------

JOB = ["engine.device=cpu", "model.dtype=bfloat16", "engine.batch_invariant=true", "sampling.max_tokens=8",
       "sampling.ignore_eos=true", "sampling.logprobs=1", "output.progress=false", "output.commit_every_rows=4"]


@pytest.fixture(scope="module")
def job_data(tmp_path_factory) -> Path:
    """24 prompts: 6 system prompts x 4 questions."""
    rows = []
    for subject in ("rivers", "honey bees", "comets", "glaciers", "deserts", "telescopes"):
        system = f"You are an expert on {subject}. Answer in one short sentence, plainly, for a curious child."
        for question in ("What is it?", "Where is it found?", "Why does it matter?", "Who studies it?"):
            rows.append({"id": f"row-{len(rows):02d}", "prompt": f"{system}\nQuestion: {question}\nAnswer:"})
    path = tmp_path_factory.mktemp("input") / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _results(out: Path) -> dict[str, tuple]:
    rows = [row for part in sorted((out / "results").glob("part-*.parquet"))
            for row in pq.read_table(part, columns=["id", "output_token_ids", "output_logprobs"]).to_pylist()]
    assert len(rows) == len({row["id"] for row in rows}), "a row was written twice"
    return {row["id"]: (row["output_token_ids"], row["output_logprobs"]) for row in rows}


def _job(data: Path, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli(["batchprefill-run", f"data.input={data}", f"output.dir={out}", *JOB, *extra], env=env)


def test_bfloat16_jobs_as_1_shard_as_3_merged_and_killed_then_resumed_give_the_same_bits(
        smol_shaped_folder, job_data, tmp_path):
    model = f"model.path={smol_shaped_folder}"
    whole = _job(job_data, tmp_path / "whole", model)
    assert whole.returncode == 0, whole.stderr[-2000:]
    reference = _results(tmp_path / "whole")
    assert len(reference) == 24
    for index in range(3):  # each shard with its own cap: other rows share its steps
        shard = _job(job_data, tmp_path / "sharded", model, "data.num_shards=3", f"data.shard_index={index}",
                     f"engine.max_num_seqs={index + 2}", "engine.max_batched_tokens=48")
        assert shard.returncode == 0, shard.stderr[-2000:]
    merged = run_cli(["batchprefill-merge", f"output.dir={tmp_path / 'sharded'}", model])
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert _results(tmp_path / "sharded") == reference
    killed = _job(job_data, tmp_path / "resumed", model, "engine.max_num_seqs=5",
                  env={KILL_AT_ENV: "written:part-*-00001.parquet"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert len(_results(tmp_path / "resumed")) < 24
    resumed = _job(job_data, tmp_path / "resumed", model, "engine.max_num_seqs=7")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _results(tmp_path / "resumed") == reference



# ---- tasks, adapters and experts through the Python API -------------------------------------------------------------

BUSY = {"engine.max_batched_tokens": 2048, "engine.max_num_seqs": 256}
STARVED = {"engine.max_batched_tokens": 16, "engine.max_num_seqs": 2, "data.order": "input"}


def _api_twice(data: pa.Table, columns: list[str], **config) -> tuple[list, list]:
    """The job's `columns` in bfloat16 under batch invariance, with a full budget in prefix order and with 16
    tokens and 2 sequences a step in input order."""
    import batchprefill

    common = {"engine.device": "cpu", "model.dtype": "bfloat16", "engine.batch_invariant": True,
              "sampling.max_tokens": 6, "sampling.ignore_eos": True, **config}
    return tuple(batchprefill.run(data, progress=False, **common, **budget).table.select(columns).rows()
                 for budget in (BUSY, STARVED))


def _shared_prompts(count: int = 12) -> list[str]:
    systems = ["You sort rocks by colour and answer in one word. " * 6,
               "You are a terse librarian who names one book. " * 6]
    rocks = ["pebble", "granite", "basalt"]
    return [f"{systems[i % 2]}\nItem {i}: {rocks[i % 3]} number {i * 7}" for i in range(count)]


def test_invariant_lora_rows_keep_their_bits_under_any_budget(smol_shaped_folder, tmp_path):
    from tests.lora_helpers import ALL_SEPARATE, save_adapter

    base = transformers.AutoModelForCausalLM.from_pretrained(smol_shaped_folder)
    folders = {name: tmp_path / name for name in ("a1", "a2")}
    for seed, folder in enumerate(folders.values()):
        save_adapter(base, folder, seed, ALL_SEPARATE)
    prompts = _shared_prompts()
    data = pa.table({"prompt": prompts, "adapter": [[None, "a1", "a2"][i % 3] for i in range(len(prompts))]})
    adapters = {f"+model.adapters.{name}": str(folder) for name, folder in folders.items()}
    busy, starved = _api_twice(data, ["output_token_ids", "output_logprobs"], model="hf",
                               **{"model.path": str(smol_shaped_folder), "data.adapter_column": "adapter",
                                  "sampling.logprobs": 1, **adapters})
    assert busy == starved


def test_invariant_expert_rows_keep_their_bits_under_any_budget(tmp_path, model_folder):
    """Qwen3-MoE with SmolLM2's attention shapes and 8 experts of width 256, top 2: each expert's rows change in
    number with the budget."""
    config = transformers.Qwen3MoeConfig(**{**SMOL_SHAPED, "intermediate_size": 512}, moe_intermediate_size=256,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    _random_folder(tmp_path, config, model_folder)
    busy, starved = _api_twice(pa.table({"prompt": _shared_prompts()}), ["output_token_ids", "output_logprobs"],
                               model="hf", **{"model.path": str(tmp_path), "sampling.logprobs": 1})
    assert busy == starved


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_invariant_embeddings_keep_their_bits_under_any_budget(smol_shaped_folder, pooling):
    busy, starved = _api_twice(pa.table({"prompt": _shared_prompts()}), ["embedding"], model="hf", task="embed",
                               **{"model.path": str(smol_shaped_folder), "model.pooling": pooling})
    assert busy == starved and len(busy[0][0]) == SMOL_SHAPED["hidden_size"]


def test_invariant_choice_scores_keep_their_bits_under_any_budget(smol_shaped_folder):
    data = pa.table({"prompt": _shared_prompts(), "choices": [[" yes", " no", " maybe so"]] * 12})
    busy, starved = _api_twice(data, ["choice_logprobs"], model="hf", task="score",
                               **{"model.path": str(smol_shaped_folder)})
    assert busy == starved
