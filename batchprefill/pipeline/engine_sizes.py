"""`engine.max_num_seqs=auto` and `engine.max_batched_tokens=auto`: the step sizes picked from the card, the pool
and the job, before any engine is built (the engine only ever sees numbers).

On the CPU, auto keeps the sizes the CPU figures were measured at (256 sequences, 2,048 tokens a step). On a GPU the
CPU's sizes starve the card: on an H200, a 1B model's job of 16 prompts x 256 questions ran 963 decode steps that
used 16.5% of a 2,048-token budget, and the engine loop took 15-21 s at the defaults against 9.1 s at 512
sequences and 8,192 tokens (issue 38). So a GPU gets what vLLM's offline `LLM` takes (vllm/engine/arg_utils.py):
1,024 sequences and 16,384 tokens on cards of 70 GiB or more (H100, H200, MI300; not the A100), 256 and 8,192 on
smaller ones; the sequences are then capped at what the KV pool holds of the job's typical request (its mean prompt
plus outputs), so the persistent batch and the captured graphs are not sized for sequences that could never run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from batchprefill.engine.config import EngineSettings
from batchprefill.intmath import cdiv

AUTO = "auto"
CPU_SIZES = (256, 2048)  # (max_num_seqs, max_batched_tokens): the values the CPU benchmarks ran at
LARGE_GPU_SIZES = (1024, 16384)
SMALL_GPU_SIZES = (256, 8192)
LARGE_GPU_BYTES = 70 * 2**30


@dataclass(frozen=True)
class CardSizes:
    """What auto starts from on a device, and the words the run's summary gives for it."""

    max_num_seqs: int
    max_batched_tokens: int
    why: str


def card_sizes(device: torch.device) -> CardSizes:
    if device.type != "cuda":
        return CardSizes(*CPU_SIZES, "on the CPU")
    properties = torch.cuda.get_device_properties(device)
    memory, name = properties.total_memory, properties.name
    large = memory >= LARGE_GPU_BYTES and "a100" not in name.lower()
    sizes = LARGE_GPU_SIZES if large else SMALL_GPU_SIZES
    return CardSizes(*sizes, f"on {name}, {memory / 2**30:.0f} GiB")


def ceiling_num_seqs(settings: EngineSettings, device: torch.device) -> int:
    """The most sequences the engine may get: what is set, or what auto starts from (the pool may lower it).
    Sizes what must exist before the pool does (the grammar rows of structured outputs)."""
    if settings.max_num_seqs != AUTO:
        return int(settings.max_num_seqs)
    return card_sizes(device).max_num_seqs


@dataclass(frozen=True)
class ResolvedSizes:
    settings: EngineSettings  # every auto key replaced by its number
    summary: str  # for the run's summary: "" when nothing was auto


def resolve_sizes(settings: EngineSettings, device: torch.device, pool_blocks: int,
                  typical_request_tokens: int | None) -> ResolvedSizes:
    """The settings with numbers for the auto keys. `pool_blocks`: the KV pool sized for `ceiling_num_seqs`;
    `typical_request_tokens`: a request's mean KV need (prompt plus outputs), None when unknown (no cap)."""
    seqs_auto, tokens_auto = settings.max_num_seqs == AUTO, settings.max_batched_tokens == AUTO
    if not (seqs_auto or tokens_auto):
        return ResolvedSizes(settings, "")
    card = card_sizes(device)
    seqs, tokens = settings.max_num_seqs, settings.max_batched_tokens
    capped = ""
    if seqs_auto:
        seqs = card.max_num_seqs
        if device.type == "cuda" and typical_request_tokens:
            fit = max(1, pool_blocks // cdiv(typical_request_tokens, settings.block_size))
            if fit < seqs:
                seqs, capped = fit, f", as many as the KV pool holds of {typical_request_tokens}-token requests"
    if tokens_auto:
        tokens = card.max_batched_tokens
    chosen = [f"engine.max_num_seqs={seqs}"] * seqs_auto + [f"engine.max_batched_tokens={tokens}"] * tokens_auto
    summary = f"{' and '.join(chosen)} (auto {card.why}{capped})"
    return ResolvedSizes(replace(settings, max_num_seqs=int(seqs), max_batched_tokens=int(tokens)), summary)
