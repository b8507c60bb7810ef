"""Chat conversations (`data.messages_column`): rendered with SmolLM2's chat template and a generation prompt in
prepare; a bad conversation is an error row of its own; a shared system message is a shared prefix."""

import pyarrow as pa
import pyarrow.parquet as pq

from batchprefill.io.columns import ERROR, ROW, TOKENS, Columns
from batchprefill.pipeline.manifest import PrepareSettings, partition_path
from batchprefill.pipeline.partitions import make_partitions
from tests.conftest import run_cli

SYSTEM = "You label customer reviews as positive, negative or neutral. Answer with the label alone."
MESSAGE_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def conversation(review: str, system: str = SYSTEM) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": review}]


def settings_for(column: str = "messages") -> PrepareSettings:
    return PrepareSettings(columns=Columns(prompt=None, id="id", system=None, namespace=None, messages=column),
                           chat_template=False, order="prefix", block_size=16, max_prompt_tokens=4096,
                           tokenizer_id="smollm2", read_batch_rows=3, buffer_mb=16)


def prepared_rows(tokenizer, conversations: list, folder) -> dict[int, dict]:
    source = folder / "chats.parquet"
    pq.write_table(pa.table({"id": list(range(len(conversations))),
                             "messages": pa.array(conversations, MESSAGE_TYPE)}), source)
    manifest = make_partitions([source], "parquet", settings_for(), tokenizer, folder / "parts", progress=False)
    tables = [pq.read_table(partition_path(folder / "parts", p)) for p in range(manifest.num_partitions)]
    return {row[ROW]: row for table in tables for row in table.select([ROW, TOKENS, ERROR]).to_pylist()}


def test_a_conversation_is_rendered_with_the_chat_template_and_a_generation_prompt(tokenizer, tmp_path):
    chats = [conversation("Arrived broken."),
             [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "Thanks"}]]
    rows = prepared_rows(tokenizer, chats, tmp_path)
    expected = [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nArrived broken.<|im_end|>\n"
                "<|im_start|>assistant\n",
                # no system message: SmolLM2's template puts its own default one first
                "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n"]
    assert [rows[i][TOKENS] for i in range(2)] == tokenizer.encode_batch(expected)
    assert rows[0][ERROR] is None and rows[1][ERROR] is None


def test_five_reviews_under_one_system_message_share_its_blocks(tokenizer, tmp_path):
    reviews = ["Great value.", "Arrived late and broken.", "It is fine.", "Love it!", "Would not buy again."]
    rows = prepared_rows(tokenizer, [conversation(r) for r in reviews], tmp_path)
    shared = len(tokenizer.encode_batch([f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"])[0])
    assert shared >= 16  # at least one full KV block of 16 tokens
    heads = {tuple(rows[i][TOKENS][:shared]) for i in range(5)}
    assert len(heads) == 1


def test_bad_conversations_become_error_rows_and_the_good_one_still_runs(tokenizer, tmp_path):
    chats = [None, [], [{"role": "user", "content": None}], [{"role": None, "content": "hi"}],
             [{"role": "user", "content": "  "}], conversation("Fine.")]
    rows = prepared_rows(tokenizer, chats, tmp_path)
    assert [rows[i][ERROR] for i in range(6)] == [
        "messages is null", "messages is empty", "messages[0] (user) has no text content", "messages[0] has no role",
        "messages hold no text", None]
    assert [len(rows[i][TOKENS]) > 0 for i in range(6)] == [False] * 5 + [True]


def test_a_job_with_a_messages_column_answers_each_chat_and_needs_no_prompt_column(tmp_path):
    source = tmp_path / "chats.parquet"
    chats = [[{"role": "user", "content": "What is the capital of France?"}], None]
    pq.write_table(pa.table({"id": ["france", "empty"], "messages": pa.array(chats, MESSAGE_TYPE)}), source)
    out = tmp_path / "out"
    done = run_cli(["batchprefill-run", f"data.input={source}", "data.messages_column=messages",
                    f"output.dir={out}", "sampling.max_tokens=12", "engine.kv_cache_tokens=4096",
                    "output.progress=false"])
    assert done.returncode == 0, done.stderr
    rows = {row["id"]: row for row in pq.read_table(out / "results").to_pylist()}
    assert "Paris" in rows["france"]["output_text"] and rows["france"]["messages"] == chats[0]
    assert rows["empty"]["finish_reason"] == "error" and rows["empty"]["error"] == "messages is null"
