"""Grammar engines side by side: xgrammar against llguidance, per-step token-mask time at our batch sizes.

    pip install llguidance                             # xgrammar is a dependency of the project; llguidance is not
    python benchmarks/cpu/grammar.py                       # batches 64, 128, 256; SmolLM2's 49,152-token vocab
    python benchmarks/cpu/grammar.py --batches 64 --steps 32 --threads 2

For each library and batch size: one compile of a labelling JSON Schema, then `--steps` decode steps. Each step
fills the whole batch's bitmask with the library's own parallel batch call (xgrammar's BatchGrammarMatcher,
llguidance's LLExecutor), applies it to the logits in one op, and advances every row by the next token of a
labelling answer valid under the schema (random labels, topics and summaries, tokenized as the model would
write them), then EOS; a finished row starts its next answer, so the batch stays full. Both libraries walk the
same token sequences, so they do the same work. Reported: the mask fill alone (the part on the decode step's
critical path), median over `--repeats` runs of the mean over steps, with its per-row cost, and the advance time
beside it. Both libraries run in one process, alternating, with the same thread count, so a loaded machine
slows both.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from batchprefill.model.loader import resolve_folder
from batchprefill.model.tokenizer import PromptTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["label", "confidence", "topics", "summary"],
    "additionalProperties": False,
}
VOCAB = 49152
EOS = 2


class XGrammarSide:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, threads: int):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, eos_token="<|im_end|>")
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[EOS])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self):
        return self.compiler.compile_json_schema(json.dumps(SCHEMA))

    def matchers(self, compiled, count: int) -> list:
        return [self.xgr.GrammarMatcher(compiled) for _ in range(count)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def advance(self, matchers: list, tokens: list[int]) -> None:
        for token in tokens:
            matchers[0].accept_token(token)

    def advance_batch(self, matchers: list, tokens: list[int]) -> None:
        accepted = self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        assert all(accepted), f"{self.name} rejected a valid answer"
        for matcher, token in zip(matchers, tokens):
            if token == EOS:
                matcher.reset()


class LLGuidanceSide:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, threads: int):
        import llguidance
        import llguidance.torch

        self.ll = llguidance
        self.torch_api = llguidance.torch
        with open(tokenizer_json) as handle:
            self.tokenizer = llguidance.LLTokenizer(handle.read(), n_vocab=VOCAB, eos_token=EOS)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
        return self.ll.LLMatcher(self.tokenizer, grammar)  # compiling is building the first matcher

    def matchers(self, compiled, count: int) -> list:
        return [compiled.deep_copy() for _ in range(count)]

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.torch_api.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        # llguidance's own apply is torch.compile'd (a minutes-long first call on the CPU); xgrammar's CPU
        # kernel does the same job, and the choice of library does not hinge on it
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask)

    def advance(self, matchers: list, tokens: list[int]) -> None:
        matchers[0].consume_tokens(tokens)

    def advance_batch(self, matchers: list, tokens: list[int]) -> None:
        accepted = self.torch_api.consume_token_par(self.executor, list(zip(matchers, tokens)))
        assert all(accepted), f"{self.name} rejected a valid answer"
        for matcher, token in zip(matchers, tokens):
            if token == EOS:
                matcher.reset()


WORDS = ["refund", "delivery", "late", "broken", "great", "price", "support", "battery", "screen", "quality",
         "shipping", "color", "size", "slow", "fast", "friendly", "rude", "manual", "warranty", "box"]


def answers(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Token ids of `count` labelling answers valid under SCHEMA, each followed by EOS."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        answer = {"label": rng.choice(["positive", "negative", "neutral"]), "confidence": round(rng.random(), 2),
                  "topics": rng.sample(WORDS, rng.randint(0, 3)),
                  "summary": " ".join(rng.choices(WORDS, k=rng.randint(3, 10)))[:80]}
        texts.append(json.dumps(answer, separators=(",", ":")))
    return [ids + [EOS] for ids in tokenizer.encode_batch(texts)]


def run_side(side, batch: int, steps: int, token_rows: list[list[int]]) -> dict:
    started = time.perf_counter()
    compiled = side.compile()
    compile_ms = (time.perf_counter() - started) * 1e3
    matchers = side.matchers(compiled, batch)
    bitmask = torch.full((batch, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    logits = torch.zeros(batch, VOCAB)
    positions = [(row * 7) % len(token_rows[row]) for row in range(batch)]  # rows at different depths
    for row, matcher in enumerate(matchers):
        side.advance([matcher], token_rows[row][: positions[row]])
    fill_ms, advance_ms = [], []
    for _ in range(steps):
        start = time.perf_counter()
        side.fill(matchers, bitmask)
        fill_ms.append((time.perf_counter() - start) * 1e3)
        side.apply(logits, bitmask)
        tokens = []
        for row in range(batch):
            tokens.append(token_rows[row][positions[row]])
            positions[row] = (positions[row] + 1) % len(token_rows[row])
        start = time.perf_counter()
        side.advance_batch(matchers, tokens)
        advance_ms.append((time.perf_counter() - start) * 1e3)
    return {"compile_ms": compile_ms, "fill_ms": statistics.mean(fill_ms), "advance_ms": statistics.mean(advance_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    folder = resolve_folder(None)
    tokenizer_json = str(folder / "tokenizer.json")
    token_rows = answers(PromptTokenizer(folder), max(args.batches), args.seed)
    sides = [XGrammarSide(tokenizer_json, args.threads), LLGuidanceSide(tokenizer_json, args.threads)]
    print(f"answers of {statistics.mean(map(len, token_rows)):.0f} tokens on average; {args.threads} threads")
    print(f"{'library':<11} {'batch':>5} {'compile ms':>10} {'fill ms':>8} {'us/row':>7} {'advance ms':>10}")
    for batch in args.batches:
        runs: dict[str, list[dict]] = {side.name: [] for side in sides}
        for _ in range(args.repeats):
            for side in sides:
                runs[side.name].append(run_side(side, batch, args.steps, token_rows))
        for name, results in runs.items():
            fill = statistics.median(r["fill_ms"] for r in results)
            print(f"{name:<11} {batch:>5} {statistics.median(r['compile_ms'] for r in results):>10.1f} "
                  f"{fill:>8.2f} {fill * 1e3 / batch:>7.1f} "
                  f"{statistics.median(r['advance_ms'] for r in results):>10.2f}", flush=True)


if __name__ == "__main__":
    main()
