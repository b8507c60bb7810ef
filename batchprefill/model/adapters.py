"""PEFT LoRA adapters (`model.adapters`): read, checked against the model, and held on its device for the job.

A PEFT folder holds `adapter_config.json` and `adapter_model.safetensors` with one `lora_A` `[r, in]` and one
`lora_B` `[out, r]` per targeted module. The decoder runs Q, K and V as one fused projection, and gate and up as
another (`families/base.py`), so an adapter's q/k/v (or gate/up) become parts of that fused projection: one
shrink with their A's stacked, one expand per part into its own output columns. Phi-3's `qkv_proj` and
`gate_up_proj` are already fused in the same order, so their B is one part spanning the whole output.

Anything an adapter asks that this engine would get wrong (DoRA, embedding or LM-head LoRA, LoRA biases, fully
trained modules, unknown modules, shapes that do not fit) stops the job before any prompt runs, with one line
naming the adapter and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from batchprefill.errors import JobError
from batchprefill.kernels.lora import AdapterDelta, LoraPart, LoraWeights
from batchprefill.model.config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_RANK = 256
KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Options that change what a LoRA layer computes beyond `x A B * scale`: (config key, what it is).
UNSUPPORTED_OPTIONS = (
    ("use_dora", "DoRA (use_dora)"),
    ("lora_bias", "LoRA biases (lora_bias)"),
    ("modules_to_save", "fully trained modules (modules_to_save)"),
    ("trainable_token_indices", "trained token embeddings (trainable_token_indices)"),
    ("use_qalora", "QA-LoRA (use_qalora)"),
    ("layer_replication", "layer_replication"),
)


def adapter_index(names: list[str] | tuple[str, ...]) -> dict[str, int]:
    """Each adapter's index in a step's per-token adapter column: 1, 2, ... in name order; 0 is the base model."""
    return {name: index for index, name in enumerate(sorted(names), start=1)}


@dataclass(frozen=True)
class Slot:
    """Where a PEFT module lands in the decoder: a fused projection and the span of its outputs."""

    projection: str  # qkv, o, gate_up or down
    out_start: int
    out_stop: int
    in_features: int


def slots(config: ModelConfig) -> dict[tuple[str, str], Slot]:
    """(self_attn | mlp, PEFT module name) -> its slot, for every module the decoder can add a delta to."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        ("self_attn", "q_proj"): Slot("qkv", 0, q, hidden),
        ("self_attn", "k_proj"): Slot("qkv", q, q + kv, hidden),
        ("self_attn", "v_proj"): Slot("qkv", q + kv, q + 2 * kv, hidden),
        ("self_attn", "qkv_proj"): Slot("qkv", 0, q + 2 * kv, hidden),  # Phi-3
        ("self_attn", "o_proj"): Slot("o", 0, hidden, q),
        ("mlp", "gate_proj"): Slot("gate_up", 0, inter, hidden),
        ("mlp", "up_proj"): Slot("gate_up", inter, 2 * inter, hidden),
        ("mlp", "gate_up_proj"): Slot("gate_up", 0, 2 * inter, hidden),  # Phi-3
        ("mlp", "down_proj"): Slot("down", 0, hidden, inter),
    }


def out_features(config: ModelConfig) -> dict[str, int]:
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "qkv": q + 2 * kv,
        "o": config.hidden_size,
        "gate_up": 2 * config.intermediate_size,
        "down": config.hidden_size,
    }


class AdapterError(ValueError):
    pass


def _scale(options: dict, module: str, rank: int) -> float:
    """PEFT's scaling for one module: lora_alpha (or its alpha_pattern entry) over r, or over sqrt(r) with rsLoRA;
    r is the module's own (rank_pattern shows in its shapes)."""
    alpha = options.get("lora_alpha", 8)
    for pattern, value in (options.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / math.sqrt(rank) if options.get("use_rslora") else alpha / rank


def read_adapter(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The adapter's options and tensors, checked for what this engine serves; AdapterError names what it lacks."""
    if not folder.is_dir():
        raise AdapterError(f"{folder} does not exist" if not folder.exists() else f"{folder} is a file, not a folder")
    if not (folder / CONFIG_FILE).is_file():
        raise AdapterError(f"{folder} has no {CONFIG_FILE}: it is not a PEFT adapter folder")
    if not (folder / WEIGHTS_FILE).is_file():
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE} (save it with safe_serialization=True)")
    try:
        options = json.loads((folder / CONFIG_FILE).read_text())
    except ValueError as error:
        raise AdapterError(f"{folder / CONFIG_FILE} is not JSON: {error}") from None
    if options.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {options['peft_type']} is not LoRA")
    for key, what in UNSUPPORTED_OPTIONS:
        if options.get(key):
            raise AdapterError(f"{what} is not supported")
    if options.get("bias", "none") != "none":
        raise AdapterError(f"bias={options['bias']!r} (trained biases) is not supported")
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt", device="cpu") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - safe_open is no dict
    if not tensors:
        raise AdapterError(f"{folder / WEIGHTS_FILE} holds no tensors")
    for name in tensors:
        if "lora_magnitude_vector" in name:
            raise AdapterError("DoRA (a lora_magnitude_vector) is not supported")
        if "embed_tokens" in name or "lora_embedding" in name:
            raise AdapterError("LoRA on the token embedding is not supported")
        if "lm_head" in name:
            raise AdapterError("LoRA on the LM head is not supported")
    return options, tensors


def adapter_deltas(
    options: dict, tensors: dict[str, torch.Tensor], config: ModelConfig, dense_mlp: list[bool]
) -> dict[tuple[int, str], AdapterDelta]:
    """(layer, projection) -> the adapter's delta there, its B's scaled; `dense_mlp[i]`: layer i's MLP is gated
    and dense (a mixture of experts takes no MLP LoRA)."""
    known = slots(config)
    modules: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = KEY.match(name)
        if match is None:
            raise AdapterError(
                f"target {name} is not a module this engine applies LoRA to (supported: "
                f"{', '.join(sorted({m for _, m in known}))})"
            )
        layer, block, module, side = int(match[1]), match[2], match[3], match[4]
        if (block, module) not in known:
            raise AdapterError(
                f"target module {block}.{module} is not one this model has (supported: "
                f"{', '.join(sorted({m for _, m in known}))})"
            )
        if layer >= config.num_layers:
            raise AdapterError(f"{name}: the model has {config.num_layers} layers")
        if block == "mlp" and not dense_mlp[layer]:
            raise AdapterError(f"{name}: LoRA on a mixture-of-experts MLP is not supported")
        modules.setdefault((layer, block, module), {})[side] = tensor
    grouped: dict[tuple[int, str], list[tuple[Slot, torch.Tensor, torch.Tensor, float]]] = {}
    for (layer, block, module), pair in sorted(modules.items()):
        where = f"layers.{layer}.{block}.{module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{where} has lora_{next(iter(pair))} without its pair")
        slot, a, b = known[block, module], pair["A"], pair["B"]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
            raise AdapterError(f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not pair")
        if a.shape[1] != slot.in_features or b.shape[0] != slot.out_stop - slot.out_start:
            raise AdapterError(
                f"{where}: lora_A {list(a.shape)}, lora_B {list(b.shape)} do not fit the model's "
                f"projection ({slot.in_features} in, {slot.out_stop - slot.out_start} out)"
            )
        if rank > MAX_RANK:
            raise AdapterError(f"{where}: rank {rank}; ranks up to {MAX_RANK} are supported")
        grouped.setdefault((layer, slot.projection), []).append(
            (slot, a, b, _scale(options, f"model.layers.{layer}.{block}.{module}", rank))
        )
    deltas = {}
    for key, parts in grouped.items():
        spans = sorted((slot.out_start, slot.out_stop) for slot, *_ in parts)
        if any(stop > start for (_, stop), (start, _) in zip(spans, spans[1:])):
            raise AdapterError(f"layer {key[0]}: both a fused {key[1]} module and its parts are targeted")
        ranks, offset = [], 0
        for slot, a, b, scale in parts:
            ranks.append(LoraPart(slot.out_start, slot.out_stop, offset, offset + a.shape[0], b * scale))
            offset += a.shape[0]
        deltas[key] = AdapterDelta(torch.cat([a for _, a, _, _ in parts]), ranks)
    return deltas


def adapter_identity(folder: Path) -> str:
    """A fingerprint of the adapter's files: part of every block's cache scope."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        digest.update((folder / name).read_bytes())
    return digest.hexdigest()[:32]


def checked_deltas(name: str, folder: Path, config: ModelConfig,
                   dense_mlp: list[bool]) -> dict[tuple[int, str], AdapterDelta]:
    """One adapter's deltas on the CPU, read and fitted to the model; a JobError naming it when it cannot be."""
    try:
        options, tensors = read_adapter(folder)
        return adapter_deltas(options, tensors, config, dense_mlp)
    except AdapterError as error:
        raise JobError(f"model.adapters.{name} ({folder}): {error}") from None


def check_adapters(adapters: dict[str, str], config: ModelConfig) -> None:
    """What `load_adapters` would refuse, refused without loading the model (the plan command): every adapter
    read and fitted to the model's config; a layer of experts takes no MLP LoRA."""
    sparse = getattr(config, "sparse_layers", ()) or (False,) * config.num_layers
    for name, folder in sorted(adapters.items()):
        checked_deltas(name, Path(folder).expanduser(), config, [not layer for layer in sparse])


def load_adapters(
    adapters: dict[str, Path], config: ModelConfig, dense_mlp: list[bool], dtype: torch.dtype, device: torch.device
) -> list[dict[str, LoraWeights]]:
    """Per layer, projection -> LoraWeights over all the job's adapters, on `device` in `dtype`, loaded once.

    Raises JobError naming the first adapter that cannot be served and why."""
    index = adapter_index(list(adapters))
    sizes = out_features(config)
    inputs = {
        "qkv": config.hidden_size,
        "o": config.num_heads * config.head_dim,
        "gate_up": config.hidden_size,
        "down": config.intermediate_size,
    }
    layers: list[dict[str, LoraWeights]] = [{} for _ in range(config.num_layers)]
    for name, folder in sorted(adapters.items()):
        for (layer, projection), delta in checked_deltas(name, Path(folder), config, dense_mlp).items():
            delta.a = delta.a.to(device=device, dtype=dtype).contiguous()
            for part in delta.parts:
                part.b = part.b.to(device=device, dtype=dtype).contiguous()
            weights = layers[layer].setdefault(projection, LoraWeights(inputs[projection], sizes[projection], {}))
            weights.adapters[index[name]] = delta
    return layers
