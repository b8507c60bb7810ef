"""task=embed and task=classify: prefill-only jobs over tiny random folders of several families, checked against
transformers (`AutoModel` hidden states pooled the same way, `AutoModelForSequenceClassification` logits), with
chunked prefill (8-token steps, 4-token blocks) and prompts that share a prefix, so cached blocks and chunk
boundaries are both in play; a best-of-4 reward job computes each prompt once."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir

from batchprefill.errors import JobError
from batchprefill.pipeline.plan import plan_job
from batchprefill.pipeline.run import run_job
from batchprefill.settings import CONFIG_DIR, JobSettings
from tests.conftest import run_cli

TINY = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-5,
            tie_word_embeddings=False)
CONFIGS = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "mistral": transformers.MistralConfig, "gemma3": transformers.Gemma3TextConfig}
BASE = {"llama": transformers.LlamaModel, "qwen3": transformers.Qwen3Model, "gemma3": transformers.Gemma3TextModel}
CLASSIFIER = {"llama": transformers.LlamaForSequenceClassification,
              "qwen2": transformers.Qwen2ForSequenceClassification,
              "qwen3": transformers.Qwen3ForSequenceClassification,
              "mistral": transformers.MistralForSequenceClassification,
              "gemma3": transformers.Gemma3TextForSequenceClassification}
SMALL = ["engine.block_size=4", "engine.max_batched_tokens=8", "engine.kv_cache_tokens=512", "engine.device=cpu",
         "model.dtype=float32", "output.progress=false", "output.plot=false"]
SHARED = "Represent this sentence for searching relevant passages about the weather and the sea:"
TEXTS = [f"{SHARED} {tail}" for tail in ("storms at night", "calm mornings", "a foggy harbour in winter")] + [
    "An unrelated short line", "Q"]


def save(model_class, kind: str, folder: Path, model_folder: Path, **config) -> transformers.PreTrainedModel:
    """A random model of this class saved with the shipped tokenizer; norms moved off 1 so a missing one shows."""
    torch.manual_seed(0)
    model = model_class(CONFIGS[kind](**TINY, **config)).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.add_(0.3 * torch.randn_like(weight))
    model.save_pretrained(folder)
    shutil.copy(model_folder / "tokenizer.json", folder / "tokenizer.json")
    return model


def settings(*overrides: str) -> JobSettings:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return JobSettings.from_config(compose("config", overrides=list(overrides)))


def run(folder: Path, data: Path, out: Path, *overrides: str) -> dict:
    sigterm = signal.getsignal(signal.SIGTERM)  # the run traps SIGTERM: give it back
    try:
        return run_job(settings("model=hf", f"model.path={folder}", f"data.input={data}", f"output.dir={out}",
                                *SMALL, *overrides))
    finally:
        signal.signal(signal.SIGTERM, sigterm)


def results(out: Path) -> list[dict]:
    return sorted(pq.read_table(out / "results").to_pylist(), key=lambda row: row["id"])


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("in") / "prompts.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(TEXTS))], "prompt": TEXTS}), path)
    return path


def hidden_states(model: transformers.PreTrainedModel, ids: list[int]) -> np.ndarray:
    """transformers' final-norm hidden states `[len(ids), hidden]` (the base model inside a classifier)."""
    base = model if isinstance(model, tuple(BASE.values())) else model.model
    with torch.no_grad():
        return base(torch.tensor([ids])).last_hidden_state[0].double().numpy()


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


@pytest.mark.parametrize("kind", ["qwen3", "llama", "gemma3"])
def test_embeddings_of_a_base_model_folder_match_transformers_last_and_mean_pooled_within_1e_4(
        kind, prompts, model_folder, tokenizer, tmp_path):
    """Five prompts, three of them sharing a 16-token instruction: `last` takes that prefix from the cache (its
    rows report cached tokens), `mean` computes every token (it reports none)."""
    folder = tmp_path / "model"
    reference = save(BASE[kind], kind, folder, model_folder)
    for pooling in ("last", "mean"):
        run(folder, prompts, tmp_path / pooling, "task=embed", f"model.pooling={pooling}")
        rows = results(tmp_path / pooling)
        for row in rows:
            states = hidden_states(reference, tokenizer.encode_batch([row["prompt"]])[0])
            want = unit(states[-1] if pooling == "last" else states.mean(0))
            got = np.array(row["embedding"])
            assert got.shape == (TINY["hidden_size"],) and row["error"] is None
            assert np.abs(got - want).max() < 1e-4, (pooling, row["id"])
        cached = sum(row["num_cached_tokens"] for row in rows)
        assert cached > 0 if pooling == "last" else cached == 0


@pytest.mark.parametrize(("kind", "labels"), [("qwen3", 3), ("llama", 1), ("qwen2", 2), ("mistral", 4),
                                              ("gemma3", 3)])
def test_class_logits_match_transformers_sequence_classification_within_1e_4(kind, labels, prompts, model_folder,
                                                                              tokenizer, tmp_path):
    """The score head at each row's last token; probabilities are the softmax of the logits, null for a one-label
    reward head; the same folder also embeds (its base model's last state)."""
    folder = tmp_path / "model"
    reference = save(CLASSIFIER[kind], kind, folder, model_folder, num_labels=labels)
    run(folder, prompts, tmp_path / "classify", "task=classify")
    run(folder, prompts, tmp_path / "embed", "task=embed", "model.normalize=false")
    for row, embedded in zip(results(tmp_path / "classify"), results(tmp_path / "embed")):
        ids = tokenizer.encode_batch([row["prompt"]])[0]
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0].double().numpy()
        got = np.array(row["class_logits"])
        assert got.shape == (labels,) and np.abs(got - want).max() < 1e-4, row["id"]
        assert row["best_class"] == int(np.argmax(want))
        if labels == 1:
            assert row["class_probs"] is None
        else:
            probs = np.exp(want - want.max()) / np.exp(want - want.max()).sum()
            assert np.abs(np.array(row["class_probs"]) - probs).max() < 1e-5
        assert np.abs(np.array(embedded["embedding"]) - hidden_states(reference, ids)[-1]).max() < 1e-4


def test_a_best_of_4_reward_job_computes_each_of_its_6_prompts_once(model_folder, tmp_path):
    """6 prompts of about 40 tokens, 4 responses each, rows shuffled: computed prompt tokens are within 1.05x of the
    plan's ideal (each prompt's blocks once, every response's own tokens), about a third of computing every row."""
    folder = tmp_path / "reward"
    save(CLASSIFIER["llama"], "llama", folder, model_folder, num_labels=1)
    rng = np.random.default_rng(0)
    rows = [{"id": f"p{p}-r{r}", "prompt": f"Question {p}: " + " ".join(["why is the sky blue"] * 6)
             + f" and what about {p}?\nAnswer: response number {r} says {'yes' * (r + 1)}"}
            for p in range(6) for r in range(4)]
    data = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist([rows[i] for i in rng.permutation(len(rows))]), data)
    common = ["model=hf", f"model.path={folder}", f"data.input={data}", *SMALL, "engine.max_batched_tokens=64",
              "task=classify"]
    ideal = plan_job(settings(*common, f"output.dir={tmp_path / 'plan'}"))
    stats = run(folder, data, tmp_path / "run", "task=classify", "engine.max_batched_tokens=64")
    assert stats["computed_prompt_tokens"] <= 1.05 * ideal["ideal_computed_tokens"]
    assert stats["computed_prompt_tokens"] < 0.5 * ideal["computed_tokens_without_reuse"]
    assert all(row["error"] is None for row in results(tmp_path / "run"))


def test_bad_heads_and_poolings_stop_the_job_with_one_line_and_bad_rows_get_error_rows(prompts, model_folder,
                                                                                       tmp_path):
    folder = tmp_path / "base"
    save(BASE["qwen3"], "qwen3", folder, model_folder)
    with pytest.raises(JobError, match=r"^task=classify needs a sequence-classification head .*has no head"):
        run(folder, prompts, tmp_path / "a", "task=classify")
    with pytest.raises(JobError, match=r"^task=generate needs an LM head"):
        run(folder, prompts, tmp_path / "b", "task=generate")
    with pytest.raises(JobError, match=r"^model.pooling=max: choose last or mean$"):
        run(folder, prompts, tmp_path / "c", "task=embed", "model.pooling=max")
    with pytest.raises(JobError, match=r"^task=embed reads each row once: set sampling.n=1, not 2$"):
        run(folder, prompts, tmp_path / "c", "task=embed", "sampling.n=2")
    data = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": ["ok", "empty", "long"], "prompt": ["fine", "", "word " * 200]}), data)
    run(folder, data, tmp_path / "d", "task=embed")
    rows = {row["id"]: row for row in results(tmp_path / "d")}
    assert rows["ok"]["error"] is None and len(rows["ok"]["embedding"]) == TINY["hidden_size"]
    for name in ("empty", "long"):
        assert rows[name]["finish_reason"] == "error" and rows[name]["embedding"] is None
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3Model"]


def embed_rows(path: Path, count: int = 40) -> Path:
    """`count` rows in 8 groups sharing a 30-token instruction each."""
    pq.write_table(pa.table({"id": [f"e{i:03d}" for i in range(count)],
                             "prompt": [f"Instruction {i % 8}: " + "represent the passage for retrieval " * 5
                                        + f"passage {i}" for i in range(count)]}), path)
    return path


def by_id(out: Path) -> dict[str, list[float]]:
    rows = pq.read_table(out / "results", columns=["id", "embedding"]).to_pylist()
    assert len(rows) == len({row["id"] for row in rows}), "a row was written twice"
    return {row["id"]: row["embedding"] for row in rows}


def test_an_embed_job_killed_with_sigkill_resumes_to_every_row_once_with_the_uninterrupted_vectors(tmp_path):
    """The shipped causal LM embeds (no LM head runs); one sequence at a time and a part per 2 rows, so the kill
    lands part-way; the rerun writes only the rest, and every vector is within 1e-5 of an uninterrupted run's."""
    data = embed_rows(tmp_path / "in.parquet")
    slow = ["task=embed", "engine.max_num_seqs=1", "engine.max_batched_tokens=16", "output.commit_every_rows=2",
            "engine.device=cpu", "engine.num_threads=1", "engine.kv_cache_tokens=2048", "output.progress=false",
            "output.plot=false", "model.dtype=float32", f"data.input={data}"]
    command = [str(Path(sys.executable).parent / "batchprefill-run"), *slow]
    reference = run_cli([*command[:1], *slow, f"output.dir={tmp_path / 'reference'}"])
    assert reference.returncode == 0, reference.stderr[-2000:]
    job = subprocess.Popen([*command, f"output.dir={tmp_path / 'out'}"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not any((tmp_path / "out" / "results").glob("part-*.parquet")):
        assert job.poll() is None and time.monotonic() < deadline, "the job ended before committing a part"
        time.sleep(0.05)
    job.kill()
    job.communicate()
    assert 0 < len(by_id(tmp_path / "out")) < 40, "the kill did not land part-way"
    rerun = run_cli([*command[:1], *slow, f"output.dir={tmp_path / 'out'}"])
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    got, want = by_id(tmp_path / "out"), by_id(tmp_path / "reference")
    assert sorted(got) == sorted(want) and len(got) == 40
    assert max(np.abs(np.array(got[i]) - np.array(want[i])).max() for i in want) < 1e-5


def test_two_shards_of_a_classify_job_merge_to_every_row_once(model_folder, tmp_path):
    folder = tmp_path / "model"
    save(CLASSIFIER["qwen3"], "qwen3", folder, model_folder, num_labels=2)
    data = embed_rows(tmp_path / "in.parquet", 24)
    out = tmp_path / "out"
    for shard in (0, 1):
        run(folder, data, out, "task=classify", "data.num_shards=2", f"data.shard_index={shard}")
    merged = run_cli(["batchprefill-merge", f"output.dir={out}", "data.num_shards=2"])
    assert merged.returncode == 0, merged.stderr[-2000:]
    rows = pq.read_table(out / "results", columns=["id", "class_logits"]).to_pylist()
    assert sorted(row["id"] for row in rows) == [f"e{i:03d}" for i in range(24)]
    assert all(len(row["class_logits"]) == 2 for row in rows)


def openai_lines(path: Path) -> Path:
    lines = [{"custom_id": "chat", "url": "/v1/chat/completions",
              "body": {"model": "m", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}},
             {"custom_id": "vec", "url": "/v1/embeddings", "body": {"model": "m", "input": "Embed this sentence"}},
             {"custom_id": "vec2", "url": "/v1/embeddings", "body": {"model": "m", "input": ["Embed this one"]}},
             {"custom_id": "nothing", "url": "/v1/embeddings", "body": {"model": "m"}}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_openai_embeddings_lines_beside_chat_lines_get_embeddings_objects_and_a_base_model_errs_on_chat_only(
        model_folder, tokenizer, tmp_path):
    """A causal LM serves both kinds of line; a base-model folder answers the embeddings lines and gives the chat
    line its own error. A body without input is a bad line either way."""
    data = openai_lines(tmp_path / "batch.jsonl")
    base, causal = tmp_path / "base", tmp_path / "causal"
    reference = save(BASE["qwen3"], "qwen3", base, model_folder)
    save(transformers.LlamaForCausalLM, "llama", causal, model_folder)
    for folder in (base, causal):
        shutil.copy(model_folder / "tokenizer_config.json", folder / "tokenizer_config.json")
    answers = {}
    for name, folder in (("both", causal), ("base", base)):
        run(folder, data, tmp_path / name, "data.format=openai_batch")
        answers[name] = {line["custom_id"]: line for line in map(json.loads, (tmp_path / name / "results.jsonl")
                                                                .read_text().splitlines())}
    both, only = answers["both"], answers["base"]
    assert both["chat"]["response"]["body"]["object"] == "chat.completion"
    assert only["chat"]["response"] is None and "needs an LM head" in only["chat"]["error"]["message"]
    for answer in (both, only):
        assert answer["nothing"]["error"]["code"] == "missing_input"
        for key, text in (("vec", "Embed this sentence"), ("vec2", "Embed this one")):
            body = answer[key]["response"]["body"]
            assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
            assert body["usage"]["prompt_tokens"] == len(tokenizer.encode_batch([text])[0])
    ids = tokenizer.encode_batch(["Embed this sentence"])[0]
    want = unit(hidden_states(reference, ids)[-1])
    assert np.abs(np.array(only["vec"]["response"]["body"]["data"][0]["embedding"]) - want).max() < 1e-4
    assert len(both["vec"]["response"]["body"]["data"][0]["embedding"]) == TINY["hidden_size"]
