"""`results.jsonl` in the OpenAI Batch output format, built from the Parquet results once a job is complete.

It is made from `results/*.parquet` rather than while the engine runs, so a resumed run or a merge of Slurm
shards writes the whole file from whatever runs committed the rows. One line per input line, in input-line
order: a good line gets `response` (status 200, a `chat.completion` or `text_completion` body with all of its
`n` choices and usage, or an embeddings `list` for a /v1/embeddings line), a bad line or a row that failed gets
`response` null and `error` {code, message}.

Memory: the result columns it needs (texts, counts, logprobs when asked) of the whole job; token ids only
where logprobs name them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchprefill.io.atomic import replace_atomic
from batchprefill.io.openai_lines import CHAT_URL, EMBEDDINGS_URL, ERROR_CODE, ERROR_MESSAGE, ID, LINE, URL

SAMPLE_INDEX = "sample_index"
OUTPUT_COUNT = "_completion_tokens"
NEEDED = [ID, LINE, URL, ERROR_CODE, ERROR_MESSAGE, "logprobs", "output_text", "num_prompt_tokens",
          "num_cached_tokens", "finish_reason", "error"]
OPTIONAL = [SAMPLE_INDEX, "output_logprobs", "output_top_logprobs", "embedding"]


def write_results_jsonl(results_dir: Path, path: Path, model: str, token_text: Callable[[int], str]) -> int:
    """Write `path` atomically from the Parquet parts in `results_dir`; returns the number of lines."""
    table = _results(results_dir)
    created = int(time.time())
    count = 0

    def write(staging: Path) -> None:
        nonlocal count
        with open(staging, "w") as handle:
            for rows in _by_line(table):
                handle.write(json.dumps(result_line(rows, model, created, token_text), ensure_ascii=False) + "\n")
                count += 1

    replace_atomic(path, write)
    return count


def _results(results_dir: Path) -> pa.Table:
    pieces = []
    for part in sorted(results_dir.glob("part-*.parquet")):
        names = set(pq.read_schema(part).names)
        table = pq.read_table(part, columns=NEEDED + [c for c in OPTIONAL if c in names] + ["output_token_ids"])
        counts = pc.list_value_length(table["output_token_ids"]).fill_null(0)
        if "output_logprobs" not in names:  # token ids are needed only to name the tokens of logprobs
            table = table.drop_columns(["output_token_ids"])
        pieces.append(table.append_column(OUTPUT_COUNT, counts))
    if not pieces:
        return pa.table({name: pa.array([], pa.int64()) for name in (LINE,)})
    table = pa.concat_tables(pieces, promote_options="default")
    keys = [(LINE, "ascending")] + ([(SAMPLE_INDEX, "ascending")] if SAMPLE_INDEX in table.column_names else [])
    return table.sort_by(keys)


def _by_line(table: pa.Table, chunk: int = 4096) -> Iterator[list[dict]]:
    """The rows of each input line (one per sample), converted to Python a chunk at a time."""
    current: list[dict] = []
    for batch in table.to_batches(max_chunksize=chunk):
        for row in batch.to_pylist():
            if current and row[LINE] != current[0][LINE]:
                yield current
                current = []
            current.append(row)
    if current:
        yield current


def result_line(rows: list[dict], model: str, created: int, token_text: Callable[[int], str]) -> dict:
    """One output line for one input line: `rows` are its samples, in sample order."""
    first = rows[0]
    custom_id = first[ID]
    key = hashlib.sha256(custom_id.encode()).hexdigest()[:24]
    line = {"id": f"batch_req_{key}", "custom_id": custom_id, "response": None, "error": None}
    if first[ERROR_CODE] is not None:
        line["error"] = {"code": first[ERROR_CODE], "message": first[ERROR_MESSAGE]}
        return line
    failed = next((row for row in rows if row["finish_reason"] == "error"), None)
    if failed is not None:  # a good line the job could not run: too long, a schema that does not compile
        line["error"] = {"code": "request_failed", "message": failed["error"]}
        return line
    if first[URL] == EMBEDDINGS_URL:
        line["response"] = {"status_code": 200, "request_id": f"req_{key}", "body": embeddings_body(first, model)}
        return line
    chat = first[URL] == CHAT_URL
    choices = [_choice(row, index, chat, token_text) for index, row in enumerate(rows)]
    completion_tokens = sum(row[OUTPUT_COUNT] for row in rows)
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{key}", "object": "chat.completion" if chat else "text_completion",
        "created": created, "model": model, "choices": choices,
        "usage": {"prompt_tokens": first["num_prompt_tokens"], "completion_tokens": completion_tokens,
                  "total_tokens": first["num_prompt_tokens"] + completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": first["num_cached_tokens"]}},
    }
    line["response"] = {"status_code": 200, "request_id": f"req_{key}", "body": body}
    return line


def embeddings_body(row: dict, model: str) -> dict:
    """OpenAI's embeddings object for a line of one input string."""
    return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": row["embedding"]}],
            "model": model, "usage": {"prompt_tokens": row["num_prompt_tokens"],
                                      "total_tokens": row["num_prompt_tokens"]}}


def _choice(row: dict, index: int, chat: bool, token_text: Callable[[int], str]) -> dict:
    logprobs = _logprobs(row, chat, token_text) if row["logprobs"] else None
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": row["output_text"]},
                "logprobs": logprobs, "finish_reason": row["finish_reason"]}
    return {"index": index, "text": row["output_text"], "logprobs": logprobs, "finish_reason": row["finish_reason"]}


def _logprobs(row: dict, chat: bool, token_text: Callable[[int], str]) -> dict | None:
    """OpenAI's logprobs object from `output_logprobs` / `output_top_logprobs` (None if the run made none)."""
    sampled, tops = row.get("output_logprobs"), row.get("output_top_logprobs")
    ids = row.get("output_token_ids")
    if sampled is None or ids is None:
        return None
    tops = tops or [[] for _ in sampled]
    if chat:
        return {"content": [
            {"token": token_text(token), "logprob": logprob, "bytes": list(token_text(token).encode()),
             "top_logprobs": [{"token": token_text(t["token_id"]), "logprob": t["logprob"],
                               "bytes": list(token_text(t["token_id"]).encode())} for t in top]}
            for token, logprob, top in zip(ids, sampled, tops)]}
    texts = [token_text(token) for token in ids]
    offsets = [0, *itertools.accumulate(len(text) for text in texts)][:-1]
    return {"tokens": texts, "token_logprobs": sampled,
            "top_logprobs": [{token_text(t["token_id"]): t["logprob"] for t in top} for top in tops],
            "text_offset": offsets}
