"""Read a folder's safetensors: one file, or the shards a `model.safetensors.index.json` names; FP8 weights with
their scales (model/quantization.py says which format), held in FP8 where the GPU multiplies them so, else
dequantized to the compute dtype once, here."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from batchprefill.intmath import cdiv
from batchprefill.kernels.fp8 import FP8, Fp8Weight, multiplies_fp8, quantize_per_channel
from batchprefill.model.quantization import DENSE_LINEAR, EXPERT_LINEAR, Quantization

INDEX = "model.safetensors.index.json"
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Where an FP8 checkpoint keeps the scale of `X.weight`: `X.weight_scale_inv` (the block-wise fp8 format) or
# `X.weight_scale` (compressed-tensors, per-tensor fp8).
SCALE_SUFFIXES = ("_scale_inv", "_scale")
# Scales read beside their weights, never as weights of their own (`input_scale`: static activation scales, which
# the config check refuses before any tensor is read).
SCALES = ("weight_scale", "weight_scale_inv", "input_scale")


def weight_files(folder: Path) -> list[Path]:
    """The files that hold the weights: the index's shards when there is an index (a folder may keep stray
    files beside them), else every `*.safetensors`."""
    folder = Path(folder)
    index = folder / INDEX
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in names if not (folder / name).exists()]
        if missing:
            raise FileNotFoundError(f"{folder}: {INDEX} names shards that are missing: {', '.join(missing)}")
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return files


def load_weights(folder: Path, dtype: torch.dtype, device: torch.device, quantization: Quantization | None = None,
                 fp8_matmul: bool = False) -> dict[str, torch.Tensor | Fp8Weight]:
    """Every tensor by name in `dtype` on `device`. With a `quantization`, an FP8 weight is read with its scale
    (which may sit in another shard) and becomes an `Fp8Weight` where `fp8_matmul` and the layer allow it, else
    the weight it stands for in `dtype`; `at_load` quantizes the dense linears of a 16-bit checkpoint."""
    with ExitStack() as files:
        handles = {}
        for file in weight_files(folder):
            handle = files.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            handles.update(dict.fromkeys(handle.keys(), handle))
        weights = {}
        for name, handle in handles.items():
            if quantization is not None and name.endswith(SCALES):
                continue
            tensor = handle.get_tensor(name)
            if tensor.dtype in FLOAT8:
                if quantization is None:
                    raise ValueError(f"{name} is stored in {str(tensor.dtype).removeprefix('torch.')} but config.json "
                                     "has no quantization_config that says how to scale it")
                scale_names = [name + suffix for suffix in SCALE_SUFFIXES if name + suffix in handles]
                if not scale_names:
                    raise ValueError(f"{name} is FP8 but the folder has no {name}_scale or {name}_scale_inv")
                scale = handles[scale_names[0]].get_tensor(scale_names[0])
                weights[name] = fp8_weight(name, tensor.to(device), scale.to(device), quantization, dtype, fp8_matmul)
            elif quantization is not None and quantization.at_load and DENSE_LINEAR.match(name):
                quantized = quantize_per_channel(tensor.to(device))
                weights[name] = quantized if fp8_matmul and multiplies_fp8(quantized) else quantized.dequantize(dtype)
            else:
                weights[name] = tensor.to(device=device, dtype=dtype)
    return weights


def fp8_weight(name: str, data: torch.Tensor, scale: torch.Tensor, quantization: Quantization, dtype: torch.dtype,
               fp8_matmul: bool) -> torch.Tensor | Fp8Weight:
    """One FP8 checkpoint weight: kept in FP8 with its scales (per output channel, or per block) where the GPU
    multiplies it so (a dense decoder linear, or an expert's projection), else dequantized to `dtype`: FP8 value
    times its scale in float32, rounded once."""
    scale = scale.float()
    out_features, in_features = data.shape
    if quantization.block is None:
        if scale.numel() not in (1, out_features):
            raise ValueError(f"{name}: a scale of shape {tuple(scale.shape)} is neither one per tensor nor one per "
                             f"output channel of {tuple(data.shape)}")
        weight = Fp8Weight(data, scale.reshape(-1).expand(out_features).contiguous())
    else:
        rows, cols = quantization.block
        grid = (cdiv(out_features, rows), cdiv(in_features, cols))
        if tuple(scale.shape) != grid:
            raise ValueError(f"{name}: block scales of shape {tuple(scale.shape)}, but {rows}x{cols} blocks of "
                             f"{tuple(data.shape)} need {grid}")
        weight = Fp8Weight(data.contiguous(), scale.contiguous(), (rows, cols))
    linear = DENSE_LINEAR.match(name) or EXPERT_LINEAR.match(name)
    held = fp8_matmul and data.dtype == FP8 and linear and multiplies_fp8(weight)
    return weight if held else weight.dequantize(dtype)
