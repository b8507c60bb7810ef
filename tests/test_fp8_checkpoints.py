"""FP8 checkpoints as HF folders hold them (compressed-tensors float-quantized, block-wise `quant_method: fp8`)
and `model.quantization=fp8` load and run as transformers runs their dequantized weights.

Each folder is a tiny random Llama whose dense linears this file quantizes itself (its own code, not ours), saved
with safetensors beside a config.json carrying the quantization_config. The reference is transformers in float32
on the weights the checkpoint stands for (FP8 values times their scales), so the only difference left is our
arithmetic, held to 1e-3 in the logits.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from batchprefill.errors import JobError
from batchprefill.kernels.fp8 import (
    WIDENED_ROWS,
    Fp8Weight,
    concat_weights,
    fp8_product,
    quantize_groups,
    quantize_per_channel,
    quantize_rows,
    widens,
)
from batchprefill.kernels.linear import Linear
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.loader import load_model, quantization_choice, read_model_config
from batchprefill.model.tokenizer import PromptTokenizer
from batchprefill.model.weights import load_weights
from tests.conftest import run_cli
from tests.test_numerics import prefill_logits

E4M3_MAX = 448.0
# hidden 256 and intermediate 320: the 128x128 blocks of the block-wise format tile them with ragged edges.
TINY = dict(vocab_size=49152, hidden_size=256, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5,
            tie_word_embeddings=False, rope_theta=50000.0)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
LEFT_UNQUANTIZED = "model.layers.1.mlp.down_proj"  # in the checkpoint's ignore list, with lm_head
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head", LEFT_UNQUANTIZED], "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "block_structure": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True, "observer": None},
    }},
}
BLOCK_WISE = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head", LEFT_UNQUANTIZED]}


def quantize_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own per-channel FP8: (FP8 values, bfloat16 scales [out, 1]) as llm-compressor saves them."""
    scale = (weight.abs().amax(dim=1, keepdim=True) / E4M3_MAX).to(torch.bfloat16)
    return (weight / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def quantize_blocks(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own block-wise FP8: (FP8 values, float32 `weight_scale_inv` [ceil(out/128), ceil(in/128)])."""
    rows, cols = weight.shape
    scale = torch.empty((rows + block - 1) // block, (cols + block - 1) // block)
    values = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max() / E4M3_MAX
            values[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return values, scale


def dequantize_blocks(values: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = values.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] *= scale[i, j]
    return out


def save_fp8_folder(kind: str, folder: Path, model_folder: Path) -> transformers.PreTrainedModel:
    """A random tiny Llama saved with its dense linears in FP8 (`kind`: compressed-tensors or block-wise), all but
    lm_head and LEFT_UNQUANTIZED; returns transformers' model holding the dequantized weights, in float32."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.add_(0.3 * torch.randn_like(weight))
    tensors = {name: weight.detach().clone().contiguous() for name, weight in model.state_dict().items()}
    for layer in range(TINY["num_hidden_layers"]):
        for linear in LINEARS:
            prefix = f"model.layers.{layer}.{linear}"
            if prefix == LEFT_UNQUANTIZED:
                continue
            weight = tensors[prefix + ".weight"]
            if kind == "compressed-tensors":
                values, scale = quantize_channels(weight)
                tensors[prefix + ".weight_scale"] = scale
                dequantized = values.float() * scale.float()
            else:
                values, scale = quantize_blocks(weight)
                tensors[prefix + ".weight_scale_inv"] = scale
                dequantized = dequantize_blocks(values, scale)
            tensors[prefix + ".weight"] = values
            model.get_parameter(prefix + ".weight").data.copy_(dequantized)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = COMPRESSED_TENSORS if kind == "compressed-tensors" else BLOCK_WISE
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(model_folder / "tokenizer.json", folder / "tokenizer.json")
    return model


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory, model_folder):
    """kind -> (folder, transformers model on the dequantized weights), each built once per module."""
    built: dict[str, tuple[Path, transformers.PreTrainedModel]] = {}

    def get(kind: str) -> tuple[Path, transformers.PreTrainedModel]:
        if kind not in built:
            folder = tmp_path_factory.mktemp(kind)
            built[kind] = folder, save_fp8_folder(kind, folder, model_folder)
        return built[kind]

    return get


PROMPT = list(range(300, 345))  # 45 tokens


@pytest.mark.parametrize("kind", ["compressed-tensors", "block-wise"])
def test_an_fp8_folder_gives_transformers_logits_on_its_dequantized_weights_within_1e_3(kind, fp8_folder):
    folder, reference = fp8_folder(kind)
    loaded = load_model(folder, torch.float32, torch.device("cpu"), TorchOps())
    assert loaded.quantization is not None and not loaded.fp8_matmul  # read as FP8, dequantized on the CPU
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    ours = prefill_logits(loaded.model, PROMPT, chunk=16)
    assert (ours - theirs).abs().max().item() < 1e-3
    # The scales matter: the FP8 values read as plain numbers (what happened before) are far from the reference.
    assert theirs.abs().max().item() > 0.1


def test_the_block_wise_folder_that_ran_silently_wrong_gives_transformers_greedy_tokens_on_6_rows(
        fp8_folder, tmp_path):
    """The issue's case: before, `weight_scale_inv` was ignored, exit 0, and 0 of 6 greedy rows were right."""
    folder, reference = fp8_folder("block-wise")
    prompts = ["The capital of France is", "Name three colors:", "Who wrote Hamlet?", "Bees make",
               "One, two, three,", "The quick brown fox"]
    pq.write_table(pa.table({"id": list(range(6)), "prompt": prompts}), tmp_path / "in.parquet")
    done = run_cli([sys.executable, "-m", "batchprefill.run", "model=hf", f"model.path={folder}",
                    f"data.input={tmp_path / 'in.parquet'}", f"output.dir={tmp_path / 'out'}", "engine.device=cpu",
                    "model.dtype=float32", "sampling.max_tokens=6", "sampling.ignore_eos=true",
                    "output.progress=false", "output.plot=false"])
    assert done.returncode == 0, done.stderr
    assert "FP8 weights (fp8, 128x128 blocks), dequantized at load" in done.stderr
    rows = sorted(pq.read_table(tmp_path / "out" / "results").to_pylist(), key=lambda r: r["id"])
    for row, prompt in zip(rows, PromptTokenizer(folder).encode_batch(prompts), strict=True):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                     pad_token_id=0)
        assert row["output_token_ids"] == out[0, len(prompt):].tolist(), f"row {row['id']}"


@pytest.mark.parametrize("quantization_config, named", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({**BLOCK_WISE, "activation_scheme": "static"}, "static activation scales"),
    ({**COMPRESSED_TENSORS, "format": "pack-quantized", "config_groups": {"group_0": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}},
     "int 4-bit weights, format pack-quantized"),
])
def test_a_quantization_we_do_not_read_is_refused_naming_it(quantization_config, named, tmp_path):
    config = transformers.LlamaConfig(**TINY).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(JobError, match=named):
        read_model_config(tmp_path)


def test_a_job_on_an_awq_folder_exits_2_with_one_line_naming_awq(tmp_path, model_folder):
    folder = tmp_path / "awq"
    folder.mkdir()
    config = transformers.LlamaConfig(**TINY).to_dict()
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    shutil.copy(model_folder / "tokenizer.json", folder / "tokenizer.json")
    pq.write_table(pa.table({"id": [0], "prompt": ["Hello"]}), tmp_path / "in.parquet")
    done = run_cli([sys.executable, "-m", "batchprefill.run", "model=hf", f"model.path={folder}",
                    f"data.input={tmp_path / 'in.parquet'}", f"output.dir={tmp_path / 'out'}",
                    "output.progress=false"])
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'awq' is not supported" in lines[0], done.stderr


def test_fp8_tensors_in_a_folder_whose_config_names_no_quantization_are_refused(fp8_folder, tmp_path):
    folder, _ = fp8_folder("compressed-tensors")
    shutil.copy(folder / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    refusal = r"model\.layers\.\d\.\S+_proj\.weight is stored in float8_e4m3fn but config.json has no quantization"
    with pytest.raises(JobError, match=refusal):
        load_model(tmp_path, torch.float32, torch.device("cpu"), TorchOps())


def test_model_quantization_fp8_rounds_each_weight_to_its_channels_fp8_grid_and_moves_logits_by_under_10_percent(
        fp8_folder, tmp_path):
    """The unquantized model (the block-wise folder's reference, saved in float32) against itself quantized at
    load. Each weight moves by at most 1/16 of itself (e4m3 keeps 3 mantissa bits, so rounding to the nearest is
    within half a step, 2^-4 relative), or by half the subnormal step (2^-10 of its channel's scale) for the values
    below 2^-6 of it; the rounding errors, about 2.5% of each weight (RMS), add up over the 14 products of these
    two random layers to a relative RMS change of the logits of 6.2% (measured; 4.8% on another prompt), bounded
    here at 10%, with the argmax unchanged at 37 of 45 positions (bounded at 3 in 4: these random logits are
    nearly flat, a spread of 0.32)."""
    _, reference = fp8_folder("block-wise")
    reference.save_pretrained(tmp_path)
    plain = load_model(tmp_path, torch.float32, torch.device("cpu"), TorchOps())
    quantized = load_model(tmp_path, torch.float32, torch.device("cpu"), TorchOps(), quantize="fp8")
    assert quantization_choice(quantized.quantization, torch.float32, torch.device("cpu")) == (
        "FP8 weights (fp8 at load, per channel), dequantized at load")
    assert quantization_choice(plain.quantization, torch.float32, torch.device("cpu")) is None
    saved = load_file(str(tmp_path / "model.safetensors"))
    held = load_weights(tmp_path, torch.float32, torch.device("cpu"), quantized.quantization)
    o_proj = saved["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(held["model.layers.0.self_attn.o_proj.weight"], quantize_per_channel(o_proj).dequantize(
        torch.float32))
    moved = (held["model.layers.0.self_attn.o_proj.weight"] - o_proj).abs()
    step = o_proj.abs().amax(dim=1, keepdim=True) / E4M3_MAX  # the channel's scale: 448 FP8 units to its largest
    assert moved.max().item() > 0 and (moved <= torch.maximum(o_proj.abs() / 16, step * 2**-10) * 1.000001).all()
    for unquantized in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"):
        assert torch.equal(held[unquantized], saved[unquantized])
    ours, base = prefill_logits(quantized.model, PROMPT, chunk=16), prefill_logits(plain.model, PROMPT, chunk=16)
    relative = ((ours - base).pow(2).mean() / base.pow(2).mean()).sqrt().item()
    assert 0.005 < relative < 0.1
    assert (ours.argmax(-1) == base.argmax(-1)).sum().item() >= 34


def test_a_fused_qkv_of_fp8_parts_keeps_each_rows_scale():
    """Q (32 rows), K and V (16 each) with scales 1, 10 and 100 times apart: the fused matrix dequantizes to the
    three stacked, and a partly quantized fusion is dequantized whole."""
    torch.manual_seed(1)
    parts = [quantize_per_channel(torch.randn(rows, 64) * size) for rows, size in ((32, 1.0), (16, 10.0), (16, 100.0))]
    fused = concat_weights(parts)
    assert isinstance(fused, Fp8Weight) and fused.scale.shape == (64,)
    assert torch.equal(fused.dequantize(torch.float32), torch.cat([p.dequantize(torch.float32) for p in parts]))
    mixed = concat_weights([parts[0], parts[1].dequantize(torch.float32)])
    assert torch.equal(mixed, torch.cat([parts[0].dequantize(torch.float32), parts[1].dequantize(torch.float32)]))


def test_past_64_rows_an_fp8_linear_equals_the_dequantized_product_of_its_per_token_quantized_rows():
    """The GPU's W8A8 path (Triton's row quantizer and `_scaled_mm`), here on the CPU under the interpreter, over 67
    rows (past WIDENED_ROWS) whose ranges differ 10^4-fold: each output row is the float32 product of its FP8 row
    and the FP8 weights times their scales, rounded to bfloat16 (within 1% of the row's largest value; measured
    0.2-0.4%), and within 5% of the product of the unquantized rows (the activations' own FP8 rounding; measured
    0.3-2.5%)."""
    torch.manual_seed(2)
    weight = concat_weights([quantize_per_channel(torch.randn(rows, 96)) for rows in (64, 32, 32)])
    bias = torch.randn(128, dtype=torch.bfloat16)
    x = (torch.randn(WIDENED_ROWS + 3, 96) * torch.logspace(-2, 2, WIDENED_ROWS + 3)[:, None]).to(torch.bfloat16)
    out = Linear(weight, bias)(x)
    assert out.dtype == torch.bfloat16
    rows, scale = quantize_rows(x)
    want = (rows.float() * scale) @ weight.dequantize(torch.float32).T + bias.float()
    assert ((out.float() - want).abs().amax(dim=1) / want.abs().amax(dim=1)).max().item() < 0.01
    exact = x.float() @ weight.dequantize(torch.float32).T + bias.float()
    assert ((out.float() - exact).norm(dim=1) / exact.norm(dim=1)).max().item() < 0.05


def channel_weight(out_features: int, in_features: int, seed: int) -> Fp8Weight:
    """A random weight quantized per channel whose channels' ranges differ 10^4-fold, so a product scaled by a
    neighbouring channel's scale would be off by the order of its value."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    return quantize_per_channel(weight * torch.logspace(-2, 2, out_features)[torch.randperm(out_features,
                                                                                           generator=generator), None])


@pytest.mark.parametrize("rows", [1, 7, 40, WIDENED_ROWS])
@pytest.mark.parametrize("scales", ["per channel", "128 x 128 blocks"])
def test_up_to_64_rows_an_fp8_linear_widens_its_weights_and_equals_the_product_of_the_unquantized_rows(rows, scales):
    """The GPU's W8A16 path (`widened_fp8_matmul`) under the interpreter: 200 outputs of 300 inputs (ragged against
    every tile and 128 x 128 block), rows whose ranges differ 10^4-fold, weights whose channels or blocks differ
    10^4- or 10^3-fold.
    - With tiles of 16, 32 and 64 output columns and inner steps of 128 and 256, the float32 sums equal the product
      of the unquantized rows and the FP8 weights times their scales within 1e-5 of each row's largest value
      (measured 2e-7 to 7e-7): widening an e4m3 weight to bfloat16 is exact, and the rows are not quantized.
    - `Linear` with a bias takes this path up to WIDENED_ROWS rows: the same bits as the kernel's bfloat16 output
      plus the bias, and within 1.5% of the exact product (the interpreter truncates to bfloat16, at most 2^-7 of a
      value, and the bias add rounds again; measured 0.4-0.8% without the bias)."""
    from batchprefill.kernels.triton.fp8 import widened_fp8_matmul

    weight = channel_weight(200, 300, seed=9) if scales == "per channel" else block_weight(200, 300, seed=4)
    generator = torch.Generator().manual_seed(10)
    bias = torch.randn(200, generator=generator).to(torch.bfloat16)
    x = (torch.randn(rows, 300, generator=generator) * torch.logspace(-2, 2, rows)[:, None]).to(torch.bfloat16)
    exact = x.float() @ weight.dequantize(torch.float32).T
    for columns in (16, 32, 64):
        for inner in (128, 256):
            sums = widened_fp8_matmul(x, weight, torch.float32, block_n=columns, block_k=inner)
            assert ((sums - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)).max().item() < 1e-5
    out = Linear(weight, bias)(x)
    assert torch.equal(out, widened_fp8_matmul(x, weight).add_(bias))
    exact += bias.float()
    assert ((out.float() - exact).abs().amax(dim=1) / exact.abs().amax(dim=1)).max().item() < 0.015


def test_an_fp8_linear_widens_at_64_rows_and_multiplies_in_fp8_at_65():
    """The dispatch at WIDENED_ROWS, per channel and per block: 64 rows give the widened kernel's bits, 65 rows
    (the same 64 and one more) the W8A8 product's, whose rows were quantized (so the first 64 differ)."""
    from batchprefill.kernels.triton.fp8 import widened_fp8_matmul

    generator = torch.Generator().manual_seed(11)
    x = torch.randn(WIDENED_ROWS + 1, 256, generator=generator).to(torch.bfloat16)
    for weight in (channel_weight(128, 256, seed=12), block_weight(128, 256, seed=13)):
        layer = Linear(weight)
        assert widens(WIDENED_ROWS) and not widens(WIDENED_ROWS + 1)
        assert torch.equal(layer(x[:WIDENED_ROWS]), widened_fp8_matmul(x[:WIDENED_ROWS], weight))
        past = layer(x)
        assert torch.equal(past, fp8_product(x, weight))
        assert not torch.equal(past[:WIDENED_ROWS], layer(x[:WIDENED_ROWS]))


def test_the_triton_row_quantizer_equals_torchs_cast_bit_for_bit_where_rounding_crosses_a_power_of_two():
    """Values that round up into the next power of two (124.6 -> 128, 7.81 -> 8), subnormals, signed zeros, a
    zero row, rows wider than one 4,096-wide tile and a strided view: the same FP8 bytes and scales as torch."""
    from batchprefill.kernels.triton.fp8 import quantize_rows_triton

    torch.manual_seed(3)
    x = torch.randn(4, 5000) * 3
    x[0, :8] = torch.tensor([124.6 / 448 * 3136, 0.0, -1e-6, 3136.0, 1e-3, -2.5, 7.81 / 448 * 3136, -0.0])
    x[3] = 0.0
    for rows in (x, x.to(torch.bfloat16), x[:, ::2]):
        values, scales = quantize_rows_triton(rows)
        want_values, want_scales = quantize_rows(rows)
        assert torch.equal(scales, want_scales)
        assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert quantize_rows(x)[0][0, 0].item() == 128.0 and quantize_rows(x)[0][0, 6].item() == 8.0


def block_weight(out_features: int, in_features: int, seed: int) -> Fp8Weight:
    """A random weight in the test's own block-wise FP8 whose blocks' ranges differ up to 10^3-fold, so a product
    that took a neighbouring block's scale would be off by the order of its value."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    ranges = torch.logspace(-1.5, 1.5, 7)[torch.randint(0, 7, (-(-out_features // 128), -(-in_features // 128)),
                                                        generator=generator)]
    weight *= ranges.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out_features, :in_features]
    values, scale = quantize_blocks(weight)
    return Fp8Weight(values, scale, (128, 128))


def group_quantized_product(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """The float32 product of `x`'s FP8 rows (one scale per row and 128 columns, the test's own arithmetic) and
    the dequantized weight: what the block kernel computes before its bfloat16 rounding."""
    values, scale = quantize_groups(x, 128)
    rows = values.float() * scale.repeat_interleave(128, 1)[:, : x.shape[1]]
    return rows @ dequantize_blocks(weight.data, weight.scale).T


@pytest.mark.parametrize("rows", [7, 130])
def test_a_block_scaled_fp8_linear_equals_the_dequantized_product_of_its_group_quantized_rows(rows):
    """The GPU's path for block-wise checkpoints (Triton's group quantizer and block kernel), here under the
    interpreter: 200 outputs of 300 inputs (both ragged against 128 x 128 blocks), rows whose ranges differ
    10^4-fold, 7 rows and 130 (a ragged second row tile).
    - With tiles of 32, 64 and 128 output columns, the kernel's float32 sums equal the float32 product of the
      rows' FP8 groups and the FP8 weights times their scales within 1e-5 of each row's largest value (measured
      6e-7).
    - The linear's bfloat16 output with a bias is within 1.5% of the product it computes: of the group-quantized
      rows past WIDENED_ROWS rows (130), of the unquantized rows up to it (7; the widened weights). The interpreter
      truncates float32 to bfloat16 (at most 2^-7 of a value; a GPU rounds to nearest) and the bias add rounds
      again (measured 0.6-1.0%).
    - It is within 5% of the product of the unquantized rows (the activations' own FP8 rounding)."""
    from batchprefill.kernels.triton.fp8 import block_fp8_matmul, quantize_groups_triton

    weight = block_weight(200, 300, seed=4)
    generator = torch.Generator().manual_seed(5)
    bias = torch.randn(200, generator=generator).to(torch.bfloat16)
    x = (torch.randn(rows, 300, generator=generator) * torch.logspace(-2, 2, rows)[:, None]).to(torch.bfloat16)
    want = group_quantized_product(x, weight)
    for columns in (32, 64, 128):  # every tile width the kernel picks from
        sums = block_fp8_matmul(*quantize_groups_triton(x, 128), weight.data, weight.scale, (128, 128), torch.float32,
                                block_n=columns)
        assert ((sums - want).abs().amax(dim=1) / want.abs().amax(dim=1)).max().item() < 1e-5
    out = Linear(weight, bias)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 200)
    exact = x.float() @ weight.dequantize(torch.float32).T + bias.float()
    want = exact if widens(rows) else want + bias.float()
    assert ((out.float() - want).abs().amax(dim=1) / want.abs().amax(dim=1)).max().item() < 0.015
    assert ((out.float() - exact).norm(dim=1) / exact.norm(dim=1)).max().item() < 0.05


def test_the_triton_group_quantizer_equals_torchs_cast_bit_for_bit_with_a_scale_per_128_columns():
    """Values that round up into the next power of two, a zero group beside a full one, a ragged last group (300
    columns: groups of 128, 128 and 44), bfloat16 rows and a strided view: the same FP8 bytes and scales as the
    torch reference, and each group's largest magnitude maps to 448."""
    from batchprefill.kernels.triton.fp8 import quantize_groups_triton

    torch.manual_seed(6)
    x = torch.randn(3, 300) * 5
    x[0, :3] = torch.tensor([124.6 / 448 * 3136, 3136.0, -0.0])
    x[1, 128:256] = 0.0
    for rows in (x, x.to(torch.bfloat16), x[:, ::2]):
        values, scales = quantize_groups_triton(rows, 128)
        want_values, want_scales = quantize_groups(rows, 128)
        assert scales.shape == (3, -(-rows.shape[1] // 128))
        assert torch.equal(scales, want_scales)
        assert torch.equal(values.view(torch.uint8), want_values.contiguous().view(torch.uint8))
    values, scales = quantize_groups(x, 128)
    assert values[0, 0].item() == 128.0 and values[0, 1].item() == 448.0
    assert scales[1, 1].item() == pytest.approx(1e-12 / 448) and not values[1, 128:256].float().any()


def test_block_scaled_parts_fuse_where_they_fill_whole_blocks_and_are_dequantized_to_bfloat16_where_not():
    """A QKV of 256, 128 and 128 rows fuses into one block weight whose scale rows are the parts' in order; a
    gate/up of 320 rows each (the first ends inside a block) would pair its second part's rows with the first's
    last scale row, so it is dequantized instead, to bfloat16, the dtype FP8 weights are held in."""
    parts = [block_weight(rows, 256, seed) for seed, rows in enumerate((256, 128, 128))]
    fused = concat_weights(parts)
    assert isinstance(fused, Fp8Weight) and fused.block == (128, 128) and fused.scale.shape == (4, 2)
    assert torch.equal(fused.dequantize(torch.float32), torch.cat([p.dequantize(torch.float32) for p in parts]))
    ragged = [block_weight(320, 256, seed) for seed in (7, 8)]
    gate_up = concat_weights(ragged)
    assert isinstance(gate_up, torch.Tensor) and gate_up.dtype == torch.bfloat16
    assert torch.equal(gate_up, torch.cat([p.dequantize(torch.bfloat16) for p in ragged]))


def test_a_block_wise_folder_multiplied_in_fp8_holds_its_linears_in_fp8_and_keeps_transformers_argmax(fp8_folder):
    """The GPU's load of a block-wise checkpoint, here on the CPU under the interpreter: bfloat16, the FP8
    matmuls asked for. The fused QKV (256 + 128 + 128 rows) and O stay FP8 with their block scales, as do the
    down projections (320 inputs: a ragged last block) where the checkpoint quantized them; the gate/up pairs (320
    rows each) are dequantized. Chunks of 16 tokens are at most WIDENED_ROWS rows, so every FP8 linear widens its
    weights and the rows are not quantized: the logits against transformers on the dequantized weights in float32
    are within 2% relative RMS with the same argmax at 40 of 45 positions (measured 0.82% and 43, which is
    bfloat16's own 0.8%; the rows quantized, W8A8, measured 4.8% and 42, and a block read with a neighbour's scale
    would be off by the order of the logits)."""
    from batchprefill.model.decoder import DecoderModel
    from batchprefill.model.families import read_config as read_shape
    from batchprefill.model.quantization import read_quantization

    folder, reference = fp8_folder("block-wise")
    quantization = read_quantization(json.loads((folder / "config.json").read_text()))
    weights = load_weights(folder, torch.bfloat16, torch.device("cpu"), quantization, fp8_matmul=True)
    model = DecoderModel(read_shape(folder), weights, TorchOps())
    first, second = model.layers
    for linear in (first.qkv, first.o, first.mlp.down, second.qkv):
        assert isinstance(linear.weight, Fp8Weight) and linear.weight.block == (128, 128)
    assert isinstance(first.mlp.gate_up.weight, torch.Tensor) and not isinstance(second.mlp.down.weight, Fp8Weight)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
    ours = prefill_logits(model, PROMPT, chunk=16)
    relative = ((ours - theirs).pow(2).mean() / theirs.pow(2).mean()).sqrt().item()
    assert relative < 0.02
    assert (ours.argmax(-1) == theirs.argmax(-1)).sum().item() >= 40


def test_a_job_with_model_quantization_fp8_runs_the_quantized_weights_and_says_so(fp8_folder, tmp_path):
    """Through the command line: every row's first token is the argmax of the model quantized at load (in this
    process), and the summary names the quantization; `model.quantization=int4` is one line naming the choices."""
    _, reference = fp8_folder("block-wise")
    folder = tmp_path / "bf16"
    copy.deepcopy(reference).to(torch.bfloat16).save_pretrained(folder)  # a bfloat16 checkpoint
    shutil.copy(fp8_folder("block-wise")[0] / "tokenizer.json", folder / "tokenizer.json")
    prompts = ["The capital of France is", "Name three colors:", "Bees make"]
    pq.write_table(pa.table({"id": list(range(3)), "prompt": prompts}), tmp_path / "in.parquet")
    common = ["model=hf", f"model.path={folder}", f"data.input={tmp_path / 'in.parquet'}", "engine.device=cpu",
              "model.dtype=float32", "sampling.max_tokens=1", "output.progress=false", "output.plot=false"]
    done = run_cli([sys.executable, "-m", "batchprefill.run", *common, "model.quantization=fp8",
                    f"output.dir={tmp_path / 'out'}"])
    assert done.returncode == 0, done.stderr
    assert "float32 (model.dtype=float32), FP8 weights (fp8 at load, per channel), dequantized at load" in done.stderr
    quantized = load_model(folder, torch.float32, torch.device("cpu"), TorchOps(), quantize="fp8").model
    rows = sorted(pq.read_table(tmp_path / "out" / "results").to_pylist(), key=lambda r: r["id"])
    for row, prompt in zip(rows, PromptTokenizer(folder).encode_batch(prompts), strict=True):
        assert row["output_token_ids"] == [prefill_logits(quantized, prompt, chunk=len(prompt))[-1].argmax().item()]
    refused = run_cli([sys.executable, "-m", "batchprefill.run", *common, "model.quantization=int4",
                       f"output.dir={tmp_path / 'refused'}"])
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "model.quantization=int4: choose fp8 or null" in lines[0]
