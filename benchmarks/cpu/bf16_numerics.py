"""bfloat16 numerics of the shipped model, reported: logits against transformers in bfloat16 and float32, and the
greedy agreement of a bfloat16 engine with our float32 one and with transformers in bfloat16, on the ten test prompts.

    PYTHONPATH=. python benchmarks/cpu/bf16_numerics.py

`tests/test_bfloat16.py` asserts bounds on the same quantities; this prints the figures BENCHMARKS.md quotes.
"""

from __future__ import annotations

import copy

import torch
import transformers

from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.engine import Engine
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.gguf_convert import converted_folder
from batchprefill.model.loader import load_model, shipped_gguf
from batchprefill.model.tokenizer import PromptTokenizer
from tests.conftest import CHAT, QUESTIONS
from tests.test_numerics import generate, prefill_logits

TOKENS = 32


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    torch.set_num_threads(2)
    gguf = shipped_gguf()
    folder = converted_folder(gguf)
    tokenizer = PromptTokenizer(folder)
    prompts = tokenizer.encode_batch([f"{CHAT}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
                                      for q in QUESTIONS])
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             dtype=torch.float32).eval()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    ours = {dtype: load_model(folder, dtype, torch.device("cpu"), TorchOps()) for dtype in (torch.float32,
                                                                                             torch.bfloat16)}
    ids = prompts[4] + prompts[5][30:]
    with torch.no_grad():
        truth, theirs = (m(torch.tensor([ids])).logits[0].float() for m in (hf32, hf16))
    mine = prefill_logits(ours[torch.bfloat16].model, ids, chunk=len(ids)).float()
    print(f"logits, {len(ids)} positions: ours bf16 - hf bf16 max {(mine - theirs).abs().max():.3f} "
          f"mean {(mine - theirs).abs().mean():.3f}; ours bf16 - hf f32 max {(mine - truth).abs().max():.3f} "
          f"mean {(mine - truth).abs().mean():.3f}; hf bf16 - hf f32 max {(theirs - truth).abs().max():.3f} "
          f"mean {(theirs - truth).abs().mean():.3f}")
    print(f"next-token argmax equal to hf f32: ours bf16 {(mine.argmax(-1) == truth.argmax(-1)).float().mean():.3f}, "
          f"hf bf16 {(theirs.argmax(-1) == truth.argmax(-1)).float().mean():.3f}")
    outputs = {}
    for dtype, loaded in ours.items():
        config = EngineConfig(EngineSettings(block_size=16, max_batched_tokens=64), 512, "off")
        engine = Engine(loaded.model, config, tokenizer.decode, (loaded.identity, str(dtype)), dtype,
                        torch.device("cpu"), None)
        outputs[dtype] = generate(engine, prompts, TOKENS)
    with torch.no_grad():
        hf_greedy = [hf16.generate(torch.tensor([p]), max_new_tokens=TOKENS, do_sample=False, eos_token_id=2,
                                   pad_token_id=2)[0, len(p):].tolist() for p in prompts]
    bf16, f32 = outputs[torch.bfloat16], outputs[torch.float32]
    same = sum(bf16[i].output_token_ids == f32[i].output_token_ids for i in bf16)
    parted = [common_prefix(bf16[i].output_token_ids, f32[i].output_token_ids) for i in bf16]
    like_hf = sum(bf16[i].output_token_ids == hf_greedy[i] for i in bf16)
    print(f"greedy, {TOKENS} tokens: ours bf16 = ours f32 on {same}/10 prompts (first difference after {parted} "
          f"tokens); ours bf16 = hf bf16 on {like_hf}/10")


if __name__ == "__main__":
    main()
