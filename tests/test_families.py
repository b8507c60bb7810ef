"""The dense families (Qwen3, Mistral, Gemma 3, Phi-3) load from HF folders and run as transformers runs them.

Each family is a tiny random model built by transformers from a config, with sliding windows (8 or 12
tokens) shorter than the prompts, norms moved off their initial values (so a missing or misplaced norm
shows), saved to a folder and loaded by batchprefill. transformers is the independent reference.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchprefill.errors import JobError
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.families import read_config
from batchprefill.model.loader import load_model, resolve_folder
from batchprefill.model.rope import rope_cos_sin
from batchprefill.model.tokenizer import PromptTokenizer
from tests.conftest import run_cli
from tests.test_numerics import prefill_logits

WINDOW = 8
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0]}


def family_config(kind: str) -> transformers.PretrainedConfig:
    if kind == "qwen3":  # layer 0 full, layer 1 sliding (max_window_layers=1)
        return transformers.Qwen3Config(**TINY, head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1)
    if kind == "mistral":
        return transformers.MistralConfig(**TINY, head_dim=16, sliding_window=WINDOW)
    if kind == "gemma3":  # sliding layer with its own RoPE base, full layer with linear scaling, soft-capped logits
        return transformers.Gemma3TextConfig(
            **{**TINY, "tie_word_embeddings": True}, head_dim=16, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
            final_logit_softcapping=5.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})
    if kind == "phi3":  # partial rotary (8 of 16 dims), longrope from position 64 on, a 12-token window
        return transformers.Phi3Config(**TINY, sliding_window=12, original_max_position_embeddings=64,
                                       rope_parameters=dict(LONGROPE))
    raise ValueError(kind)


FAMILIES = ["qwen3", "mistral", "gemma3", "phi3"]


def save_family(kind: str, folder: Path, model_folder: Path, max_shard_size: str | None = None
                ) -> transformers.PreTrainedModel:
    """A random tiny model of this family saved as an HF folder, with the shipped tokenizer beside it."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(family_config(kind)).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.add_(0.3 * torch.randn_like(weight))
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    shutil.copy(model_folder / "tokenizer.json", folder / "tokenizer.json")
    return model


@pytest.fixture(scope="module")
def family(tmp_path_factory, model_folder):
    """kind -> (folder, transformers model), each built once per module."""
    built: dict[str, tuple[Path, transformers.PreTrainedModel]] = {}

    def get(kind: str) -> tuple[Path, transformers.PreTrainedModel]:
        if kind not in built:
            folder = tmp_path_factory.mktemp(kind)
            built[kind] = folder, save_family(kind, folder, model_folder)
        return built[kind]

    return get


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_45_token_prompt_matches_transformers_at_every_position_in_chunks_of_5_and_24(kind, family):
    """Chunks of 5 are smaller than the window, chunks of 24 larger; both must match the whole-prompt reference."""
    folder, reference = family(kind)
    loaded = load_model(resolve_folder(str(folder)), torch.float32, torch.device("cpu"), TorchOps())
    assert any(loaded.model.config.layer_windows)  # the window was read, so the test exercises it
    ids = random_prompt(45, seed=1)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    for chunk in (5, 24):
        ours = prefill_logits(loaded.model, ids, chunk=chunk, block_size=4)
        assert (ours - theirs).abs().max().item() < 1e-4, f"chunk {chunk}"
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("kind", ["gemma3", "phi3"])
def test_the_triton_kernels_give_the_torch_logits_on_q_k_norms_windows_and_partial_rotary(kind, family):
    from batchprefill.kernels.triton.ops import TritonOps

    folder, _ = family(kind)
    ids = random_prompt(30, seed=2)
    logits = {}
    for name, ops in (("torch", TorchOps()), ("triton", TritonOps())):
        loaded = load_model(resolve_folder(str(folder)), torch.float32, torch.device("cpu"), ops)
        logits[name] = prefill_logits(loaded.model, ids, chunk=6, block_size=4)
    assert (logits["triton"] - logits["torch"]).abs().max().item() < 1e-4


def test_longrope_takes_short_factors_below_the_original_context_and_long_ones_from_it(family):
    """Rows below 64 match transformers' short-factor frequencies, rows from 64 its long-factor ones, both times
    the attention factor sqrt(1 + ln(256 / 64) / ln(64))."""
    config = family_config("phi3")
    ours = rope_cos_sin(8, 256, 10000.0, read_config(family("phi3")[0]).rope_scaling)
    positions = torch.arange(256, dtype=torch.float32)
    for rows, seq_len in ((slice(0, 64), 64), (slice(64, 256), 65)):
        inv_freq, attention = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
        assert attention == pytest.approx((1 + torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(64.0))
                                           .item()) ** 0.5)
        angles = torch.outer(positions[rows], inv_freq)
        want = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention
        torch.testing.assert_close(ours[rows], want, atol=1e-4, rtol=1e-4)


def test_a_sharded_folder_with_an_index_loads_every_shard(tmp_path, model_folder):
    reference = save_family("mistral", tmp_path, model_folder, max_shard_size="2MB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    (tmp_path / "stray.safetensors").write_bytes(b"not a shard")  # not in the index: never opened
    loaded = load_model(resolve_folder(str(tmp_path)), torch.float32, torch.device("cpu"), TorchOps())
    ids = random_prompt(20, seed=3)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert (prefill_logits(loaded.model, ids, chunk=20, block_size=4) - theirs).abs().max().item() < 1e-4
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / shard).unlink()
    with pytest.raises(JobError, match=shard):
        load_model(tmp_path, torch.float32, torch.device("cpu"), TorchOps())


SYSTEM = "You are a careful assistant. Answer in one short sentence, and never repeat the question back. "
QUESTIONS = ["What is the capital of France?", "Name three colors.", "Who wrote Hamlet?", "What do bees make?"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_job_with_prefix_caching_and_4_token_chunks_gives_transformers_greedy_tokens(kind, family, tmp_path):
    """Four prompts of about 30 tokens share a system prompt longer than the window; a 6-token step budget
    makes chunks smaller than the window. The shared blocks are reused and every row gets transformers'
    greedy continuation."""
    folder, reference = family(kind)
    pq.write_table(pa.table({"id": list(range(4)), "prompt": [SYSTEM + q for q in QUESTIONS]}), tmp_path / "in.parquet")
    done = run_cli([sys.executable, "-m", "batchprefill.run", "model=hf", f"model.path={folder}",
                    f"data.input={tmp_path / 'in.parquet'}", f"output.dir={tmp_path / 'out'}", "engine.device=cpu",
                    "engine.block_size=4", "engine.max_batched_tokens=6", "engine.kv_cache_tokens=1024",
                    "sampling.max_tokens=6", "sampling.ignore_eos=true", "output.progress=false"])
    assert done.returncode == 0, done.stderr
    rows = sorted(pq.read_table(tmp_path / "out" / "results").to_pylist(), key=lambda r: r["id"])
    assert all(r["error"] is None for r in rows)
    assert sum(r["num_cached_tokens"] for r in rows) >= 3 * 16  # the system prompt's blocks, reused by three rows
    prompts = PromptTokenizer(folder).encode_batch([SYSTEM + q for q in QUESTIONS])
    assert min(len(p) for p in prompts) > 2 * WINDOW
    for row, prompt in zip(rows, prompts):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                     pad_token_id=0)
        assert row["output_token_ids"] == out[0, len(prompt):].tolist(), f"row {row['id']}"


def test_an_unsupported_architecture_fails_with_one_line_naming_it_and_the_supported_ones(tmp_path, model_folder):
    folder = tmp_path / "falcon"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"]}))
    shutil.copy(model_folder / "tokenizer.json", folder / "tokenizer.json")
    done = run_cli([sys.executable, "-m", "batchprefill.run", "model=hf", f"model.path={folder}",
                    f"output.dir={tmp_path / 'out'}", "output.progress=false"])
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for name in ("FalconForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "MistralForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM"):
        assert name in lines[0]


def test_triton_and_the_padded_decode_buffers_give_torch_greedy_tokens_past_a_window(family):
    """Mistral's 8-token window under the Triton kernels, also through the fixed padded buffers CUDA graphs
    replay (run eagerly here), whose decode launches are planned for the longest context, not the window."""
    from batchprefill.engine.config import EngineConfig, EngineSettings
    from batchprefill.engine.engine import Engine
    from batchprefill.engine.request import Request
    from batchprefill.kernels.triton.ops import TritonOps
    from batchprefill.sampling_params import SamplingParams

    folder, _ = family("mistral")
    prompts = [random_prompt(19, seed=5), random_prompt(12, seed=5) + random_prompt(5, seed=6)]
    outputs = {}
    for name, ops, padded in (("torch", TorchOps(), "off"), ("triton", TritonOps(), "off"),
                              ("padded", TritonOps(), "eager")):
        loaded = load_model(resolve_folder(str(folder)), torch.float32, torch.device("cpu"), ops)
        config = EngineConfig(EngineSettings(block_size=4, max_batched_tokens=10, max_num_seqs=2), num_blocks=32,
                              padded_decode=padded)
        engine = Engine(loaded.model, config, lambda ids: "", ("tiny",), torch.float32, torch.device("cpu"))
        requests = [Request(i, p, SamplingParams(max_tokens=4, ignore_eos=True)) for i, p in enumerate(prompts)]
        outputs[name] = {r.request_id: r.output_token_ids for r in engine.generate(requests)}
        assert sum(r.num_cached_tokens for r in requests) == 12  # the second prompt reuses three blocks
    assert outputs["triton"] == outputs["torch"]
    assert outputs["padded"] == outputs["torch"]


OLDER_LAYOUTS = {  # config.json as published before transformers 5 nested RoPE settings and wrote layer_types
    "gemma-3-1b-it": ("Gemma3TextConfig", {
        "architectures": ["Gemma3ForCausalLM"], "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4,
        "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "vocab_size": 262144, "final_logit_softcapping": None}),
    "qwen2.5-with-a-window-switched-off": ("Qwen2Config", {
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "max_window_layers": 21, "sliding_window": 131072,
        "use_sliding_window": False, "rope_theta": 1000000.0, "vocab_size": 151936}),
    "qwen3-with-a-window-on-the-top-layers": ("Qwen3Config", {
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
        "num_attention_heads": 16, "num_hidden_layers": 6, "num_key_value_heads": 8, "head_dim": 128,
        "max_window_layers": 4, "sliding_window": 4096, "use_sliding_window": True, "rope_theta": 1000000,
        "vocab_size": 151936}),
    "phi-3-mini-4k": ("Phi3Config", {
        "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "sliding_window": 2047,
        "rope_scaling": None, "rope_theta": 10000.0, "vocab_size": 32064, "max_position_embeddings": 4096}),
}


@pytest.mark.parametrize("name", list(OLDER_LAYOUTS))
def test_older_config_layouts_give_the_windows_and_rope_bases_transformers_reads(name, tmp_path):
    class_name, raw = OLDER_LAYOUTS[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = read_config(tmp_path)
    theirs = getattr(transformers, class_name)(**{k: v for k, v in raw.items() if k != "architectures"})
    types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * theirs.num_hidden_layers
    window = theirs.sliding_window
    expected = tuple(window if t == "sliding_attention" and window else None for t in types)
    assert (ours.layer_windows or (None,) * ours.num_layers) == expected
    rope = theirs.rope_parameters
    if "full_attention" in rope:  # Gemma 3: a base per layer type
        assert (ours.rope_theta, ours.local_rope_theta) == (rope["full_attention"]["rope_theta"],
                                                            rope["sliding_attention"]["rope_theta"])
        assert ours.query_scale == theirs.query_pre_attn_scalar**-0.5
    else:
        assert ours.rope_theta == rope["rope_theta"] and ours.local_rope_theta is None
