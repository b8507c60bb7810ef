"""The paged KV pool: how many blocks a job gets, and the per-layer tensors that hold them."""

from __future__ import annotations

import torch

from batchprefill.errors import JobError
from batchprefill.intmath import cdiv
from batchprefill.model.config import ModelConfig
from batchprefill.units import readable_bytes

CPU_KV_MEMORY_FRACTION = 0.25
GPU_KV_MEMORY_FRACTION = 0.8


def pool_blocks(config: ModelConfig, kv_dtype: torch.dtype, device: torch.device, block_size: int,
                max_num_seqs: int, requested_tokens: int | None, tokens_needed: int) -> int:
    """The pool from `requested_tokens` (engine.kv_cache_tokens), else from free memory; either way capped at
    what the job can use (`tokens_needed`: every prompt and output at once, plus a partial block per sequence
    that may run), so a generous setting costs no memory, and no time zeroing it, on a small job."""
    usable = cdiv(tokens_needed, block_size) + max_num_seqs
    if requested_tokens is not None:
        return max(1, min(requested_tokens // block_size, usable))
    per_block = config.kv_bytes_per_token(torch.finfo(kv_dtype).bits // 8) * block_size
    room = int(_free_memory(device) // per_block)
    smallest = min(usable, max_num_seqs)  # a block per sequence that may run: less would only ever preempt
    if device.type == "cuda" and room < smallest:
        raise JobError(f"the KV pool needs at least {readable_bytes(smallest * per_block)} ({smallest} blocks of "
                       f"{block_size} tokens) but {readable_bytes(room * per_block)} of {device} is left after the "
                       "model: lower engine.max_num_seqs, set engine.kv_cache_tokens, or use a GPU with more memory")
    return max(1, min(room, usable))


def _free_memory(device: torch.device) -> float:
    """Memory the pool may take: on a GPU, after returning what loading freed (fusing QKV and gate/up leaves
    the unfused copies in torch's cache: about 7 GiB on an 8B model), a share of what the device has free."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0] * GPU_KV_MEMORY_FRACTION
    return _available_host_memory() * CPU_KV_MEMORY_FRACTION


def _available_host_memory() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 << 30


def allocate_kv_caches(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, `[num_blocks, block_size, kv_heads, head_dim]`, allocated once for the job."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)]
