"""Deterministic benchmark workloads, written as Parquet files with columns `id` and `prompt`.

    python benchmarks/workloads.py --dir /tmp/bp-workloads      # writes the files, prints their sizes

Every engine reads the same files, so every engine sees the same prompts in the same (shuffled) input
order. The text is pseudo-English drawn from a fixed word list with a seeded generator: it tokenizes like
prose (about one token per word) and is identical on every machine. Sizes are chosen so that one engine's
run on a 2-core CPU takes roughly 10 to 90 seconds.

This module imports batchprefill only inside `ideal_computed_tokens`, so the peer scripts (which run in
other virtual environments) never need it.
"""

from __future__ import annotations

import argparse
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

# The peers' vLLM environment, as benchmarks/peers/setup_peers.sh makes it (git-ignored); --vllm-python elsewhere.
VLLM_PYTHON = Path(__file__).resolve().parent / ".venv-vllm" / "bin" / "python"

WORDS = """
the of and to in is that for it as was with be by on not he this are or his from at which but have an they
you were her she there been one all we their has would when if so no will more can who out about up them
some could what into than other time only new very these two may first then do any like my now over such
our man me even most made after also did many before must through back years where much your way well down
should because each just those people how too little state good very make world still own see men work long
get here between both life being under never day same another know while last might us great old year off
come since against go came right used take three states himself few house use during without again place
around however home small found thought went say part once general high upon school every does got united
left number course war until always away something fact though water less public put think almost hand
enough far took head yet government system better set told nothing night end why called didn eyes find
going look asked later knew point next program city business give group toward young days let room
president side social given present several order national possible rather second face per among form
important often things looked early white case john become large big need four within felt children along
saw best church ever least power development light thing seemed family interest want members mind country
area others done turned although open problem sense service certain kind began law real whole hands
question river garden market letter engine harvest lantern copper village signal winter valley machine
""".split()  # noqa: SIM905 (a word list reads better as prose)

QUESTIONS = [
    "What is the main point of the passage?", "Who is mentioned first, and why?",
    "Summarize the passage in one sentence.", "What happens at the end?", "Which place is described?",
    "List three facts from the text.", "What problem does the text raise?", "Is the tone hopeful or grim?",
    "What would be a good title?", "Which word appears most often?", "What does the author want?",
    "Name one person and one place.",
]


def cpu_model() -> str:
    """`lscpu`'s model name and the widest of its vector features, recorded beside each figure: sessions run on
    different machines, and a virtual machine may name only the vendor ("AMD EPYC" was a Zen 3 one day, a Zen 4 the
    next), where the features tell them apart: "AMD EPYC (avx512_bf16)"."""
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("Flags")), [])
    widest = next((flag for flag in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if flag in flags), None)
    return f"{name} ({widest})" if widest else name


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 18))]
    return " ".join(words).capitalize() + "."


def text(rng: random.Random, words: int) -> str:
    """About `words` words of prose (whole sentences)."""
    out: list[str] = []
    count = 0
    while count < words:
        out.append(sentence(rng))
        count += len(out[-1].split())
    return " ".join(out)


def prompt(system: str, document: str, question: str) -> str:
    return f"{system}\n\nDocument:\n{document}\n\nQuestion: {question}\nAnswer:"


@dataclass
class Workload:
    """One benchmark case: prompts in input order, the output length, and an optional KV pool size."""

    name: str
    description: str
    prompts: list[str]
    max_tokens: int
    kv_pool_tokens: int | None = None  # None: every engine gets a pool far above the working set

    def write(self, directory: Path) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = directory / f"{self.name}.parquet"
        table = pa.table({"id": [f"{self.name}-{i:05d}" for i in range(len(self.prompts))], "prompt": self.prompts})
        pq.write_table(table, path)
        return path


def shared_prefix(seed: int = 1) -> Workload:
    """3 system prompts x 8 documents x 4 questions, shuffled: deep sharing at two levels."""
    rng = random.Random(seed)
    systems = [f"You are assistant number {i}. " + text(rng, 60) for i in range(3)]
    documents = [text(rng, 300) for _ in range(8)]
    prompts = [prompt(s, d, q) for s in systems for d in documents for q in rng.sample(QUESTIONS, 4)]
    rng.shuffle(prompts)
    return Workload("shared", "3 system prompts x 8 documents x 4 questions, shuffled", prompts, max_tokens=16)


def corpus_over_pool(seed: int = 2, documents: int = 120, words: int = 110, pool_fraction: float = 0.25) -> Workload:
    """Many documents x 3 questions, shuffled, with a KV pool of a quarter of the corpus's unique tokens.

    In input order the three questions on one document arrive far apart, so an LRU pool this small has
    evicted the document before its next question: every prompt is computed in full. In prefix order the
    three sit together and the document is computed once.
    """
    rng = random.Random(seed)
    system = "Read the document and answer the question briefly."
    docs = [text(rng, words) for _ in range(documents)]
    prompts = [prompt(system, d, q) for d in docs for q in rng.sample(QUESTIONS, 3)]
    rng.shuffle(prompts)
    # The pool is set in `finalize` from the tokenized corpus (it depends on the tokenizer).
    return Workload("corpus", f"{documents} documents x 3 questions, shuffled, KV pool ~{pool_fraction:.0%} of "
                    "the corpus", prompts, max_tokens=16, kv_pool_tokens=-1)


def no_sharing(seed: int = 3, count: int = 48) -> Workload:
    """Unrelated prompts: nothing to reuse, so this measures raw prefill and decode speed."""
    rng = random.Random(seed)
    prompts = [f"Note {i} ({rng.choice(WORDS)}): " + text(rng, rng.randint(150, 250)) + "\nReply:"
               for i in range(count)]
    return Workload("unshared", f"{count} unrelated prompts of ~200 tokens", prompts, max_tokens=32)


def long_prompts(seed: int = 4, count: int = 16) -> Workload:
    """Long unrelated prompts with short outputs: prefill dominates."""
    rng = random.Random(seed)
    prompts = [f"Report {i}. " + text(rng, 1400) + "\nOne-word verdict:" for i in range(count)]
    return Workload("long", f"{count} unrelated prompts of ~1500 tokens, 4 output tokens", prompts, max_tokens=4)


def decode_heavy(max_tokens: int, seed: int = 5) -> Workload:
    """80 rows over 3 system prompts x 3 documents, shuffled, with long outputs: decode steps are nearly all of
    the job (synthetic data, long answers)."""
    rng = random.Random(seed)
    systems = [f"You are assistant number {i}. " + text(rng, 60) for i in range(3)]
    documents = [text(rng, 300) for _ in range(3)]
    prompts = [prompt(s, d, q) for s in systems for d in documents for q in rng.sample(QUESTIONS, 9)][:80]
    rng.shuffle(prompts)
    return Workload(f"decode{max_tokens}", f"80 rows over 3 system prompts x 3 documents, shuffled, {max_tokens} "
                    "output tokens each", prompts, max_tokens=max_tokens)


def all_workloads() -> list[Workload]:
    return [shared_prefix(), corpus_over_pool(), no_sharing(), long_prompts(), decode_heavy(128), decode_heavy(512)]


def token_ids(prompts: list[str], folder: Path) -> list[list[int]]:
    from batchprefill.model.tokenizer import PromptTokenizer

    return PromptTokenizer(folder).encode_batch(prompts)


def ideal_computed_tokens(ids: list[list[int]], block_size: int) -> int:
    """Prompt tokens an ideal prefix cache must compute at `block_size`: in prefix order, each prompt reuses
    the full blocks it shares with its predecessor, and computes at least one token. No order and no cache
    of any size does better, so this is the floor every engine is compared with."""
    try:
        from batchprefill.pipeline.order import prefix_order, reusable_tokens
    except ImportError:  # a checkout before the pipeline folder, measured with this harness
        from batchprefill.order import prefix_order, reusable_tokens

    order = prefix_order(ids, [""] * len(ids))
    ordered = [ids[i] for i in order]
    return sum(len(x) for x in ids) - sum(reusable_tokens(ordered, [""] * len(ids), block_size))


def unique_prefix_tokens(ids: list[list[int]]) -> int:
    """Distinct token-prefix nodes: the size of the prompts' prefix trie (what a cache would hold at best)."""
    return ideal_computed_tokens(ids, 1)


def finalize(workload: Workload, ids: list[list[int]], pool_fraction: float = 0.25, block: int = 32) -> Workload:
    """Fix the corpus workload's KV pool to a fraction of the trie's size, rounded to whole 32-token blocks
    (a size every engine can hold exactly), and never below 4 of its longest prompts."""
    from batchprefill.intmath import cdiv

    if workload.kv_pool_tokens == -1:
        pool = int(unique_prefix_tokens(ids) * pool_fraction)
        pool = max(pool, 4 * max(len(x) for x in ids))
        workload.kv_pool_tokens = cdiv(pool, block) * block
    return workload


def main() -> None:
    from batchprefill.model.loader import resolve_folder

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bp-workloads"))
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    folder = resolve_folder(None)
    for workload in all_workloads():
        ids = token_ids(workload.prompts, folder)
        finalize(workload, ids)
        path = workload.write(args.dir)
        lengths = [len(x) for x in ids]
        print(f"{workload.name:9s} {len(ids):4d} prompts, {sum(lengths):7d} tokens (min {min(lengths)}, max "
              f"{max(lengths)}), ideal@16 {ideal_computed_tokens(ids, 16)}, ideal@32 {ideal_computed_tokens(ids, 32)},"
              f" unique {unique_prefix_tokens(ids)}, pool {workload.kv_pool_tokens} -> {path}")


if __name__ == "__main__":
    main()
