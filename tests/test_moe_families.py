"""Qwen3-MoE and Mixtral folders saved by transformers load and run as transformers runs them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers

from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.engine import Engine
from batchprefill.engine.request import Request
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.decoder import DecoderModel
from batchprefill.model.families import read_config
from batchprefill.model.loader import load_model, resolve_folder
from batchprefill.model.moe import SparseMoe
from batchprefill.model.tokenizer import PromptTokenizer
from batchprefill.model.weights import load_weights
from batchprefill.sampling_params import SamplingParams
from tests.conftest import REPO
from tests.test_numerics import prefill_logits

SHAPE = dict(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, tie_word_embeddings=False)
CONFIGS = {
    # layer 0 is in mlp_only_layers and step 2 makes layer 2 dense: experts in layers 1 and 3 only
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=2),
    "qwen3_moe_raw_topk": lambda: transformers.Qwen3MoeConfig(
        **SHAPE, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, head_dim=16, num_experts=4,
        num_experts_per_tok=3, norm_topk_prob=False),
    # a 32-token window, shorter than the prompts
    "mixtral": lambda: transformers.MixtralConfig(
        **SHAPE, intermediate_size=48, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=32),
}
PROMPT = [(7 * i) % 900 + 100 for i in range(48)]  # longer than Mixtral's window


def save_tiny_moe(kind: str, folder, model_folder) -> transformers.PreTrainedModel:
    """A random tiny MoE model saved as an HF folder with the shipped tokenizer. Router weights are drawn wide,
    so tokens really spread over the experts and a wrong routing changes the logits."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("gate.weight") and parameter.dim() == 2 and parameter.shape[0] < 16:
                parameter.normal_(std=1.0)
            elif "experts" in name:
                parameter.normal_(std=0.1)
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(model_folder / "tokenizer.json", folder / "tokenizer.json")
    return model


def test_qwen3_moe_config_keeps_mlp_only_and_off_step_layers_dense_and_counts_active_parameters(tmp_path,
                                                                                                 model_folder):
    reference = save_tiny_moe("qwen3_moe", tmp_path, model_folder)
    config = read_config(tmp_path)
    assert config.sparse_layers == (False, True, False, True)
    stored = sum(p.numel() for name, p in reference.named_parameters() if "norm" not in name)
    # every expert, as the plan counts
    assert config.dense_linear_parameters() + config.expert_parameters() + config.other_parameters() == stored
    assert config.expert_parameters() == 2 * 8 * 3 * 64 * 32
    assert (config.num_experts, config.experts_per_token, config.normalize_topk) == (8, 2, True)
    attention = 64 * (64 + 2 * 32) + 64 * 64
    dense, sparse = 3 * 64 * 96, 64 * 8 + 2 * 3 * 64 * 32  # a sparse layer: router + two active experts
    assert config.num_parameters() == 4 * attention + 2 * dense + 2 * sparse + 49152 * 64


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_moe_folder_matches_transformers_logits_at_every_position_in_16_token_chunks(kind, tmp_path, model_folder):
    reference = save_tiny_moe(kind, tmp_path, model_folder)
    loaded = load_model(resolve_folder(str(tmp_path)), torch.float32, torch.device("cpu"), TorchOps())
    assert sum(isinstance(layer.mlp, SparseMoe) for layer in loaded.model.layers) == sum(
        loaded.model.config.sparse_layers)
    ours = prefill_logits(loaded.model, PROMPT, chunk=16)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_greedy_tokens_equal_transformers_generate_on_both_backends(kind, tmp_path, model_folder):
    """12 greedy tokens after a 48-token prompt (past Mixtral's 32-token window), on the torch path and on
    the Triton kernels under the interpreter, against transformers' own generate."""
    from batchprefill.kernels.triton.ops import TritonOps

    reference = save_tiny_moe(kind, tmp_path, model_folder)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(PROMPT):].tolist()
    config = read_config(tmp_path)
    for ops in (TorchOps(), TritonOps()):
        model = DecoderModel(config, load_weights(tmp_path, torch.float32, torch.device("cpu")), ops)
        engine_config = EngineConfig(EngineSettings(block_size=8, max_batched_tokens=16, max_num_seqs=2), num_blocks=32)
        engine = Engine(model, engine_config, lambda ids: "", ("tiny",), torch.float32, torch.device("cpu"))
        [done] = engine.generate([Request(0, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))])
        assert done.output_token_ids == expected, type(ops).__name__


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_moe_job_with_prefix_caching_reuses_the_shared_prefix_and_gives_transformers_tokens(kind, tmp_path,
                                                                                             model_folder):
    """Three prompts sharing a long prefix, 8-token blocks, 16-token chunks (smaller than Mixtral's window)."""
    reference = save_tiny_moe(kind, tmp_path / "model", model_folder)
    shared = "The committee reviewed every proposal in detail before the vote. " * 3
    prompts = [shared + ending for ending in ("Summarise it.", "Who voted?", "When was it?")]
    pq.write_table(pa.table({"prompt": prompts}), tmp_path / "in.parquet")
    done = subprocess.run(
        [sys.executable, "-m", "batchprefill.run", f"model.path={tmp_path / 'model'}",
         f"data.input={tmp_path / 'in.parquet'}", f"output.dir={tmp_path / 'out'}", "engine.block_size=8",
         "engine.max_batched_tokens=16", "engine.kv_cache_tokens=1024", "engine.prefix_caching=true",
         "sampling.max_tokens=5", "sampling.ignore_eos=true", "output.progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    rows = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "results").to_pylist()}
    assert [rows[i]["error"] for i in range(3)] == [None] * 3
    assert sum(rows[i]["num_cached_tokens"] for i in range(3)) >= 2 * 8  # the later two reuse shared blocks
    tokenizer = PromptTokenizer(tmp_path / "model")
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode_batch([prompt])[0]
        with torch.no_grad():
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=None,
                                          pad_token_id=0)[0, len(ids):].tolist()
        assert list(rows[i]["output_token_ids"]) == expected


def test_an_fp8_moe_checkpoints_experts_stay_fp8_on_the_fused_kernels_and_give_the_dequantized_bits(tmp_path,
                                                                                                   model_folder):
    """A Qwen3-MoE folder whose experts are saved in the block-wise FP8 format (16 x 16 blocks; the test's own
    quantization), loaded in bfloat16 with the GPU's FP8 matmuls asked for (here on the CPU, Triton under the
    interpreter): each sparse layer holds its experts in FP8, one byte a weight, and the fused kernels widen them
    in registers to the bits dequantizing at load gives, so the logits at all 48 positions are the same bits as
    the same folder's loaded with its experts dequantized."""
    from safetensors.torch import load_file, save_file

    from batchprefill.kernels.fp8 import Fp8Weight
    from batchprefill.kernels.triton.ops import TritonOps
    from batchprefill.model.quantization import read_quantization
    from tests.test_fp8_checkpoints import quantize_blocks

    save_tiny_moe("qwen3_moe", tmp_path, model_folder)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in [name for name in tensors if ".experts." in name]:
        tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(tensors[name].float(), block=16)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    quantization = read_quantization(config)
    logits = {}
    for fp8 in (True, False):
        weights = load_weights(tmp_path, torch.bfloat16, torch.device("cpu"), quantization, fp8_matmul=fp8)
        model = DecoderModel(read_config(tmp_path), weights, TritonOps())
        sparse = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoe)]
        assert len(sparse) == 2
        for mlp in sparse:
            for stack in mlp.experts.stacked():
                assert isinstance(stack, Fp8Weight) == fp8
                assert not fp8 or (stack.data.dtype == torch.float8_e4m3fn and stack.block == (16, 16))
        logits[fp8] = prefill_logits(model, PROMPT, chunk=16)
    assert torch.equal(logits[True], logits[False])
