"""On the CPU: a small mixture-of-experts model against a dense model of the same active parameter count.

    python benchmarks/cpu/moe.py                       # 2 threads, about 2 minutes on a quiet machine
    python benchmarks/cpu/moe.py --out benchmarks/results/moe.json

Both models are Llama-shaped with random weights and identical attention; the MoE model (Mixtral-style, 8
experts, top-2, expert width I) replaces each dense MLP of width 2I, so a token computes the same number of
multiply-adds in both, plus the MoE router's 8 columns. The engine runs the same unrelated prompts (no prefix
reuse) through each model in turn, alternated and repeated, 16 sequences at once and one at a time; each figure
is the best repeat's prefill tokens/s (steps that carry prefill) and decode tokens/s (decode-only steps), from
the engine's own step timings. Then the layer alone: one MoE layer against the dense MLP at a few step sizes,
median CPU time of the process (steadier than wall time on a shared machine) over repeated calls.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from batchprefill import malloc
from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.engine import Engine
from batchprefill.engine.request import Request
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.config import ModelConfig
from batchprefill.model.decoder import DecoderModel
from batchprefill.model.moe import MoeConfig, SparseMoe
from batchprefill.sampling_params import SamplingParams

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 8, 512, 8, 4, 8192
EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 768
PROMPT_TOKENS, MAX_TOKENS = 256, 32
BATCHES = (16, 1)  # sequences at once: at 16 every expert is hit each decode step, at 1 only two are


def shape(architecture: str, intermediate: int) -> dict:
    return dict(architecture=architecture, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=intermediate,
                num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_positions=4096,
                tie_word_embeddings=False, qkv_bias=False, eos_token_ids=(0,))


def random_weights(moe: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def weight(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=gen) * dims[-1] ** -0.5

    kv = KV_HEADS * HIDDEN // HEADS
    weights = {"model.embed_tokens.weight": weight(VOCAB, HIDDEN), "lm_head.weight": weight(VOCAB, HIDDEN),
               "model.norm.weight": torch.ones(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": torch.ones(HIDDEN),
                    p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
                    p + "self_attn.q_proj.weight": weight(HIDDEN, HIDDEN),
                    p + "self_attn.k_proj.weight": weight(kv, HIDDEN),
                    p + "self_attn.v_proj.weight": weight(kv, HIDDEN),
                    p + "self_attn.o_proj.weight": weight(HIDDEN, HIDDEN)}
        if moe:
            block = p + "block_sparse_moe."
            weights[block + "gate.weight"] = weight(EXPERTS, HIDDEN)
            for e in range(EXPERTS):
                weights |= {block + f"experts.{e}.w1.weight": weight(EXPERT_WIDTH, HIDDEN),
                            block + f"experts.{e}.w3.weight": weight(EXPERT_WIDTH, HIDDEN),
                            block + f"experts.{e}.w2.weight": weight(HIDDEN, EXPERT_WIDTH)}
        else:
            weights |= {p + "mlp.gate_proj.weight": weight(TOP_K * EXPERT_WIDTH, HIDDEN),
                        p + "mlp.up_proj.weight": weight(TOP_K * EXPERT_WIDTH, HIDDEN),
                        p + "mlp.down_proj.weight": weight(HIDDEN, TOP_K * EXPERT_WIDTH)}
    return weights


def models() -> dict[str, DecoderModel]:
    moe_config = MoeConfig(**shape("MixtralForCausalLM", EXPERT_WIDTH), num_experts=EXPERTS, experts_per_token=TOP_K,
                           moe_intermediate_size=EXPERT_WIDTH, normalize_topk=True, sparse_layers=(True,) * LAYERS)
    dense_config = ModelConfig(**shape("LlamaForCausalLM", TOP_K * EXPERT_WIDTH))
    return {"moe": DecoderModel(moe_config, random_weights(True), TorchOps()),
            "dense": DecoderModel(dense_config, random_weights(False), TorchOps())}


def run_once(model: DecoderModel, prompts: list[list[int]], batch: int) -> dict[str, float]:
    config = EngineConfig(EngineSettings(block_size=16, max_batched_tokens=2048, max_num_seqs=batch),
                          num_blocks=len(prompts) * (PROMPT_TOKENS + MAX_TOKENS) // 16 + len(prompts))
    engine = Engine(model, config, lambda ids: "", ("random",), torch.float32, torch.device("cpu"))
    requests = [Request(i, p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)) for i, p in enumerate(prompts)]
    assert len(list(engine.generate(requests))) == len(prompts)
    steps = engine.counters.steps
    prefill = [s for s in steps if s.num_prefill_tokens]
    decode = [s for s in steps if not s.num_prefill_tokens and s.num_decode_tokens]
    return {"prefill_tokens_per_s": sum(s.num_prefill_tokens for s in prefill) / sum(s.duration_ms for s in prefill)
            * 1e3,
            "decode_tokens_per_s": sum(s.num_decode_tokens for s in decode) / sum(s.duration_ms for s in decode) * 1e3}


def layer_ms(built: dict[str, DecoderModel], tokens: int, repeat: int = 7) -> dict[str, float]:
    """Median process CPU ms of layer 0's MLP (experts or dense) on `tokens` random rows, alternating."""
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    mlps = {name: model.layers[0].mlp for name, model in built.items()}
    assert isinstance(mlps["moe"], SparseMoe)
    times: dict[str, list[float]] = {name: [] for name in mlps}
    for _ in range(repeat):
        for name, mlp in mlps.items():
            start = time.process_time()
            mlp(x, built[name].ops)
            times[name].append((time.process_time() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    malloc.keep_freed_memory()
    rng = random.Random(0)
    built = models()
    active = {name: model.config.num_parameters() for name, model in built.items()}
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):
        for batch in BATCHES:
            prompts = [[rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
            for name, model in built.items():
                result = run_once(model, prompts, batch)
                kept = best.setdefault(f"{name}, {batch} seqs", result)
                for key, value in result.items():
                    kept[key] = max(kept[key], value)
    print(f"{LAYERS} layers, hidden {HIDDEN}; MoE {EXPERTS} experts top-{TOP_K} of width {EXPERT_WIDTH} against "
          f"dense width {TOP_K * EXPERT_WIDTH}; prompts of {PROMPT_TOKENS} tokens, {MAX_TOKENS} out; "
          f"{torch.get_num_threads()} threads, best of {args.repeats}")
    print(f"{'run':>15} {'active params':>14} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, result in best.items():
        prefill, decode = result["prefill_tokens_per_s"], result["decode_tokens_per_s"]
        print(f"{name:>15} {active[name.split(',')[0]]:>14,} {prefill:>14.0f} {decode:>13.0f}")
    for batch in BATCHES:
        moe, dense = best[f"moe, {batch} seqs"], best[f"dense, {batch} seqs"]
        ratios = {key: moe[key] / dense[key] for key in moe}
        print(f"moe / dense at {batch} seqs: prefill {ratios['prefill_tokens_per_s']:.2f}, "
              f"decode {ratios['decode_tokens_per_s']:.2f}")
    layers = {tokens: layer_ms(built, tokens) for tokens in (2048, 64, 16, 1)}
    print(f"{'tokens':>6} {'moe layer ms':>13} {'dense mlp ms':>13} {'moe / dense':>12}")
    for tokens, ms in layers.items():
        print(f"{tokens:>6} {ms['moe']:>13.2f} {ms['dense']:>13.2f} {ms['moe'] / ms['dense']:>12.2f}")
    if args.out:
        args.out.write_text(json.dumps({"active_parameters": active, "best": best, "layer_ms": layers}, indent=2))


if __name__ == "__main__":
    main()
