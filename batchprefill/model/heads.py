"""What sits on the decoder's final norm, for every family alike: the LM head of a causal-LM folder, nothing in a
base-model folder (`LlamaModel`, `Qwen3Model`: an embedding model's weights), or the score head of a
`*ForSequenceClassification` folder (a classifier, or a reward model with one label).

A folder's architecture is its family's causal LM with another suffix, so the family is found from the stem and no
family file changes per head. transformers saves a base model's weights without the `model.` prefix
(`embed_tokens.weight`, `layers.0...`) and a classifier's score head as `score.weight` `[num_labels, hidden]` next
to the usual `model.*` names; `decoder_weights` puts the former under the names the decoder reads.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch

from batchprefill.errors import JobError
from batchprefill.kernels.linear import Linear
from batchprefill.model.config import ModelConfig

LM, SCORE, NONE = "lm", "score", "none"  # ModelConfig.head
# Architecture suffix -> head, longest first so `TextModel` wins over `Model` (Gemma 3's text-only classes).
SUFFIXES = (("ForSequenceClassification", SCORE), ("ForCausalLM", LM), ("TextModel", NONE), ("Model", NONE))
DESCRIPTION = {LM: "an LM head (a *ForCausalLM folder)", SCORE: "a sequence-classification head "
               "(a *ForSequenceClassification folder)", NONE: "no head (a base-model folder: hidden states only)"}


def split_architecture(architecture: str, causal: Collection[str]) -> tuple[str, str]:
    """The causal-LM architecture of the folder's family and the folder's head; `causal` lists those supported.
    `Gemma3TextForSequenceClassification` is Gemma 3's text model (`Gemma3ForCausalLM`) with a score head."""
    for suffix, head in SUFFIXES:
        if architecture.endswith(suffix) and architecture != suffix:
            stem = architecture[: -len(suffix)]
            for name in (stem + "ForCausalLM", stem.removesuffix("Text") + "ForCausalLM"):
                if name in causal:
                    return name, head
    return architecture, LM  # not a variant of a supported family: family_for names what is supported


def num_labels(raw: dict) -> int:
    """A classifier's label count, as transformers reads it: `id2label`'s size, else `num_labels`, else 2."""
    labels = raw.get("id2label")
    return len(labels) if labels else int(raw.get("num_labels", 2))


def decoder_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights under the decoder's `model.*` names: a base-model folder's get the prefix they lack."""
    if "model.embed_tokens.weight" in weights or "embed_tokens.weight" not in weights:
        return weights
    return {f"model.{name}": tensor for name, tensor in weights.items()}


class ScoreHead:
    """A sequence-classification head on final-norm hidden rows: float32 `[E, num_labels]` (raw logits; a reward
    model's single column is its reward). Applied only to the rows a readout asks for, never to every position."""

    def __init__(self, weights: dict[str, torch.Tensor]):
        self.linear = Linear(weights["score.weight"], weights.get("score.bias"))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden).float()


def head_mismatch(task: str, needed: str | None, head: str) -> str | None:
    """Why a model of head `head` cannot run task `task`, which needs head `needed` (None: any head), or None."""
    if needed is None or needed == head:
        return None
    return f"task={task} needs {DESCRIPTION[needed]}; the model has {DESCRIPTION[head]}"


def check_head(task: str, needed: str | None, config: ModelConfig, folder: Path) -> None:
    """A one-line JobError when the folder's head is not the one task `task` needs."""
    problem = head_mismatch(task, needed, config.head)
    if problem is not None:
        raise JobError(problem.replace("the model", str(folder)))
