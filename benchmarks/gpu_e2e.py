"""End-to-end engine throughput on a random-weight model of Llama-3-8B's shape, prefix caching on and off.

The weights are random, so the text is noise, but every matmul, kernel, scheduler step and CUDA graph is
the real one. The workload is shared-prefix: a few long system prompts, each with many short questions.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from batchprefill.engine.config import EngineConfig
from batchprefill.engine.engine import Engine
from batchprefill.engine.request import Request, SamplingParams
from batchprefill.kernels.triton_ops import TritonOps
from batchprefill.model.config import ModelConfig
from batchprefill.model.decoder import DecoderModel


@dataclass(frozen=True)
class Workload:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    prefixes: int
    questions: int
    prefix_tokens: int
    question_tokens: int
    max_tokens: int
    budget: int
    max_num_seqs: int


LLAMA3_8B = Workload(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, prefixes=4,
                     questions=64, prefix_tokens=2048, question_tokens=64, max_tokens=32, budget=8192,
                     max_num_seqs=256)
SMOKE = Workload(layers=1, hidden=128, ffn=256, heads=4, kv_heads=2, vocab=512, prefixes=2, questions=2,
                 prefix_tokens=32, question_tokens=5, max_tokens=2, budget=48, max_num_seqs=4)


def random_model(w: Workload, dtype: torch.dtype, device: torch.device) -> DecoderModel:
    head_dim = w.hidden // w.heads
    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.ffn,
        num_layers=w.layers, num_heads=w.heads, num_kv_heads=w.kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=None, max_positions=8192, tie_word_embeddings=False, qkv_bias=False,
        eos_token_ids=(0,),
    )
    generator = torch.Generator(device=device).manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device, dtype=torch.float32) * 0.02).to(dtype)

    kv = w.kv_heads * head_dim
    weights = {"model.embed_tokens.weight": weight(w.vocab, w.hidden), "lm_head.weight": weight(w.vocab, w.hidden),
               "model.norm.weight": torch.ones(w.hidden, device=device, dtype=dtype)}
    for i in range(w.layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(w.hidden, device=device, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(w.hidden, device=device, dtype=dtype),
            p + "self_attn.q_proj.weight": weight(w.hidden, w.hidden),
            p + "self_attn.k_proj.weight": weight(kv, w.hidden),
            p + "self_attn.v_proj.weight": weight(kv, w.hidden),
            p + "self_attn.o_proj.weight": weight(w.hidden, w.hidden),
            p + "mlp.gate_proj.weight": weight(w.ffn, w.hidden),
            p + "mlp.up_proj.weight": weight(w.ffn, w.hidden),
            p + "mlp.down_proj.weight": weight(w.hidden, w.ffn),
        }
    return DecoderModel(config, weights, TritonOps())


def prompts(w: Workload) -> list[list[int]]:
    """System prompts x questions, shuffled: the engine sees them in prefix order, as a job would run them."""
    rng = random.Random(0)
    systems = [[rng.randrange(1, w.vocab) for _ in range(w.prefix_tokens)] for _ in range(w.prefixes)]
    rows = [s + [rng.randrange(1, w.vocab) for _ in range(w.question_tokens)]
            for s in systems for _ in range(w.questions)]
    return sorted(rows)


def run(smoke: bool, device: torch.device) -> list[dict]:
    w = SMOKE if smoke else LLAMA3_8B
    dtype = torch.float32 if smoke else torch.bfloat16
    model = random_model(w, dtype, device)
    rows = prompts(w)
    tokens_needed = sum(len(r) + w.max_tokens for r in rows)
    results = []
    for caching in (True, False):
        config = EngineConfig(block_size=16, max_batched_tokens=w.budget, max_num_seqs=w.max_num_seqs,
                              num_blocks=tokens_needed // 16 + w.max_num_seqs, prefix_caching=caching,
                              padded_decode="eager" if smoke else "graphs")
        engine = Engine(model, config, lambda ids: "", ("random", str(dtype)), dtype, device)
        requests = [Request(i, r, SamplingParams(max_tokens=w.max_tokens, ignore_eos=True)) for i, r in enumerate(rows)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        finished = list(engine.generate(requests))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
        assert len(finished) == len(rows)
        prefill = engine.counters.prefill_tokens
        output = sum(len(r.output_token_ids) for r in finished)
        results.append({"prefix_caching": caching, "requests": len(rows), "prompt_tokens": sum(map(len, rows)),
                        "computed_prompt_tokens": prefill, "output_tokens": output, "wall_s": round(wall, 3),
                        "prefill_tokens_per_s": round(prefill / wall), "output_tokens_per_s": round(output / wall),
                        "steps": len(engine.counters.steps)})
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    on, off = results
    print(f"end to end ({'smoke' if smoke else 'Llama-3-8B shape, random weights, bf16'}; "
          f"{w.prefixes} prefixes x {w.questions} questions, {w.prefix_tokens}+{w.question_tokens} prompt tokens, "
          f"{w.max_tokens} output tokens):")
    for r in results:
        print(f"  prefix caching {'on ' if r['prefix_caching'] else 'off'}: {r['wall_s']:8.2f} s, "
              f"computed {r['computed_prompt_tokens']:>8} prompt tokens, {r['prefill_tokens_per_s']:>8} prefill tok/s, "
              f"{r['output_tokens_per_s']:>7} output tok/s")
    print(f"  wall time ratio off/on: {off['wall_s'] / on['wall_s']:.2f}x")
    return results
