"""LoRA adapters on the model: logits and greedy tokens as PEFT on transformers computes them, many adapters in one
forward pass, and the adapters the engine cannot serve refused with one line naming them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from batchprefill.errors import JobError
from batchprefill.kernels.lora import AdapterDelta, LoraPart, LoraStep, LoraWeights, torch_lora
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.adapters import load_adapters
from batchprefill.model.families.base import GatedMLP
from batchprefill.model.loader import load_model
from tests.lora_helpers import ALL_PHI3, ALL_SEPARATE, batch_logits, save_adapter, save_base

ADAPTERS: dict[str, list[dict]] = {  # per family: three adapters on different subsets, ranks, scalings
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
for _kind in ("qwen2", "mistral", "gemma3"):  # the other dense families: Llama's adapters
    ADAPTERS[_kind] = ADAPTERS["llama"]


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


@pytest.mark.parametrize("kind", ["llama", "qwen3", "phi3", "qwen2", "mistral", "gemma3"])
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


def random_weights(dtype: torch.dtype, seed: int = 0) -> LoraWeights:
    """A QKV-shaped projection (64 in, 32 + 16 + 16 out) under adapters 1 (q, k and v, ranks 4, 8, 16), 2 (v only,
    rank 8) and 4 (all outputs as one fused part, rank 32); adapter 3 does not target it."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (0.3 * torch.randn(*shape, generator=g)).to(dtype)

    def delta(parts: list[tuple[int, int, int]]) -> AdapterDelta:
        ranks = [r for _, _, r in parts]
        offsets = [sum(ranks[:i]) for i in range(len(ranks))]
        return AdapterDelta(
            rand(sum(ranks), 64),
            [LoraPart(lo, hi, off, off + r, rand(hi - lo, r)) for (lo, hi, r), off in zip(parts, offsets)],
        )

    return LoraWeights(
        64, 64, {1: delta([(0, 32, 4), (32, 48, 8), (48, 64, 16)]), 2: delta([(48, 64, 8)]), 4: delta([(0, 64, 32)])}
    )


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_segmented_triton_kernel_adds_what_the_torch_path_adds_on_37_tokens_of_five_runs(dtype, tolerance):
    """Runs of 9 tokens of adapter 1, 5 of the base, 11 of adapter 3 (no delta here), 7 of adapter 2 and 5 more of
    adapter 1: one launch gives the torch path's sums, and the base and adapter-3 rows stay as they were."""
    from batchprefill.kernels.triton.lora import segmented_lora

    weights = random_weights(dtype)
    adapters = np.repeat(np.array([1, 0, 3, 2, 1], dtype=np.int32), [9, 5, 11, 7, 5])
    step = LoraStep.of(adapters, torch.device("cpu"))
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    base = torch.randn(37, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    want, got = base.clone(), base.clone()
    torch_lora(want, x, weights, step)
    segmented_lora(got, x, weights, step)
    untouched = torch.from_numpy((adapters == 0) | (adapters == 3))
    assert torch.equal(got[untouched], base[untouched])
    assert (want[~untouched] - base[~untouched]).abs().max().item() > 0.5  # the deltas are not small
    assert (got.float() - want.float()).abs().max().item() < tolerance * max(1.0, want.abs().max().item())


def test_the_triton_backend_gives_the_torch_logits_for_a_batch_mixing_adapters(families):
    from batchprefill.kernels.triton.ops import TritonOps

    model, _, _ = families("phi3")
    prompts = [prompt(n, seed) for n, seed in ((7, 8), (3, 9), (5, 10))]
    want = batch_logits(model, prompts, [3, 0, 1])
    model.ops = TritonOps()
    try:
        got = batch_logits(model, prompts, [3, 0, 1])
    finally:
        model.ops = TorchOps()
    for ours, theirs in zip(got, want):
        assert (ours - theirs).abs().max().item() < 1e-4
