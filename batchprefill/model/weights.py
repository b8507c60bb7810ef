"""Read a folder's safetensors: one file, or the shards a `model.safetensors.index.json` names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"


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


def load_weights(folder: Path, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    weights = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is no dict
                weights[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
    return weights
