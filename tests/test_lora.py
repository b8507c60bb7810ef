"""LoRA adapters on the model: logits and greedy tokens as PEFT on transformers computes them, many adapters in one
forward pass, and the adapters the engine cannot serve refused with one line naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchprefill.errors import JobError
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.adapters import load_adapters
from batchprefill.model.families.base import GatedMLP
from batchprefill.model.loader import load_model
from tests.lora_helpers import ALL_PHI3, ALL_SEPARATE, batch_logits, save_adapter, save_base

ADAPTERS = {  # per family: three adapters on different subsets, ranks, scalings
    "llama": [
        dict(targets=ALL_SEPARATE, rank=8, alpha=16),
        dict(targets=["q_proj", "v_proj"], rank=4, alpha=8),
        dict(targets=["k_proj", "o_proj", "down_proj"], rank=16, alpha=4, use_rslora=True),
    ],
    "qwen3": [
        dict(targets=ALL_SEPARATE, rank=8, alpha=16, use_rslora=True),
        dict(targets=["gate_proj", "up_proj"], rank=2, alpha=2),
        dict(targets=["q_proj", "o_proj"], rank=4, alpha=32, rank_pattern={"o_proj": 12}, alpha_pattern={"o_proj": 6}),
    ],
    "phi3": [
        dict(targets=ALL_PHI3, rank=8, alpha=16),
        dict(targets=["qkv_proj"], rank=4, alpha=8),
        dict(targets=["gate_up_proj", "down_proj"], rank=16, alpha=8, use_rslora=True),
    ],
}


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def families(tmp_path_factory, model_folder):
    """kind -> (our model with the three adapters attached, base transformers model, [PEFT model per adapter])."""
    built = {}

    def get(kind: str):
        if kind not in built:
            root = tmp_path_factory.mktemp(f"lora-{kind}")
            base = save_base(kind, root / "base", model_folder)
            peft_models, folders = [], {}
            for i, options in enumerate(ADAPTERS[kind]):
                folders[f"a{i}"] = root / f"a{i}"
                peft_models.append(save_adapter(base, folders[f"a{i}"], seed=10 + i, **options))
            model = load_model(root / "base", torch.float32, torch.device("cpu"), TorchOps()).model
            model.attach_adapters(
                load_adapters(folders, model.config, dense_mlp(model), torch.float32, torch.device("cpu"))
            )
            built[kind] = model, base, peft_models
        return built[kind]

    return get


def dense_mlp(model) -> list[bool]:
    return [isinstance(layer.mlp, GatedMLP) for layer in model.layers]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "phi3"])
def test_four_prompts_under_three_adapters_and_the_base_in_one_pass_match_peft_within_1e_4(kind, families):
    """Prompts of 23, 17, 30 and 9 tokens run in one flat batch, under adapters 1, 2, 3 and the base model: every
    position's logits are within 1e-4 of PEFT's (of transformers' for the base) and the argmax is the same."""
    model, base, peft_models = families(kind)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (17, 2), (30, 3), (9, 4))]
    ours = batch_logits(model, prompts, [1, 2, 3, 0])
    references = [*peft_models, base]
    for i, (logits, reference, ids) in enumerate(zip(ours, references, prompts)):
        with torch.no_grad():
            theirs = reference(torch.tensor([ids])).logits[0]
        assert (logits - theirs).abs().max().item() < 1e-4, f"prompt {i}"
        assert torch.equal(logits.argmax(-1), theirs.argmax(-1)), f"prompt {i}"
    with torch.no_grad():  # the adapters change the logits: the test would see one that was not applied
        assert (
            peft_models[1](torch.tensor([prompts[1]])).logits[0] - base(torch.tensor([prompts[1]])).logits[0]
        ).abs().max().item() > 1e-2


def test_one_adapters_tokens_split_into_two_runs_of_the_batch_give_the_same_logits(families):
    """Adapter 1 on prompts 0 and 2 with adapter 2 between them: its rows are gathered, not one slice."""
    model, _, _ = families("llama")
    prompts = [prompt(n, seed) for n, seed in ((11, 5), (13, 6), (7, 7))]
    mixed = batch_logits(model, prompts, [1, 2, 1])
    alone = [batch_logits(model, [p], [a])[0] for p, a in zip(prompts, [1, 2, 1])]
    for got, want in zip(mixed, alone):
        assert (got - want).abs().max().item() < 1e-5


def broken(tmp_path: Path, source: Path, name: str, config: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of adapter `source` with its config updated and tensors added (None values remove a key)."""
    folder = tmp_path / name
    folder.mkdir()
    options = {**json.loads((source / "adapter_config.json").read_text()), **(config or {})}
    (folder / "adapter_config.json").write_text(json.dumps(options))
    weights = {**load_file(source / "adapter_model.safetensors"), **(tensors or {})}
    save_file({k: v for k, v in weights.items() if v is not None}, folder / "adapter_model.safetensors")
    return folder


LAYER0 = "base_model.model.model.layers.0."


@pytest.mark.parametrize(
    ("name", "config", "tensors", "reason"),
    [
        ("dora", {"use_dora": True}, None, "DoRA"),
        (
            "embed",
            None,
            {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 49152)},
            "token embedding",
        ),
        ("head", None, {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}, "LM head"),
        ("unknown", None, {LAYER0 + "self_attn.rotary.lora_A.weight": torch.zeros(8, 64)}, "rotary"),
        ("shape", None, {LAYER0 + "self_attn.q_proj.lora_A.weight": torch.zeros(8, 48)}, "do not fit"),
        (
            "rank",
            None,
            {
                LAYER0 + "self_attn.q_proj.lora_A.weight": torch.zeros(300, 64),
                LAYER0 + "self_attn.q_proj.lora_B.weight": torch.zeros(64, 300),
            },
            "rank 300",
        ),
        ("bias", {"bias": "lora_only"}, None, "bias"),
    ],
)
def test_an_adapter_the_engine_cannot_serve_fails_with_one_line_naming_it_and_why(
    tmp_path, families, name, config, tensors, reason
):
    model, base, _ = families("llama")
    good = tmp_path / "good"
    save_adapter(base, good, seed=1, targets=["q_proj"])
    folder = broken(tmp_path, good, name, config, tensors)
    with pytest.raises(JobError) as caught:
        load_adapters({"ok": good, name: folder}, model.config, dense_mlp(model), torch.float32, torch.device("cpu"))
    message = str(caught.value)
    assert "\n" not in message and f"model.adapters.{name}" in message and reason in message, message
