"""OpenAI Batch API files in: a JSONL file of request lines, streamed as Arrow record batches.

Every non-blank line becomes one row, a bad line included: its row carries `error_code` and `error_message`,
never runs, and gets an error line in `results.jsonl` (`batchprefill.io.openai_results`). A row's `custom_id` is
its id; a line without a usable one (not JSON, no custom_id, or one an earlier line already used) gets
`#line-<n>` (n counts lines from 1), so ids stay unique and a rerun gives the same ids.

Memory is bounded by one batch of lines plus 8 bytes per line for duplicate detection: the custom_ids seen so
far are kept as sorted arrays of 64-bit hashes (two different ids collide with odds of about n^2 / 2^65,
3e-8 for a million lines). Measured on a million lines (a 197 MB file): peak RSS 167 MB, of which 44 MB came
after the first batch (the hashes and the temporaries of merging them).

Each body's sampling parameters stay in columns of their own (null where the line did not set one), so the
engine applies them to that request alone; see SAMPLING_COLUMNS.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

ID, LINE, URL, PROMPT, MESSAGES = "custom_id", "line", "url", "prompt", "messages"
ERROR_CODE, ERROR_MESSAGE = "error_code", "error_message"
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
MESSAGE_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
# The per-request sampling columns, and what each means for the engine (null: the job's sampling.* value).
SAMPLING_COLUMNS = [
    pa.field("max_tokens", pa.int64()),  # max_tokens, or max_completion_tokens on chat lines
    pa.field("temperature", pa.float64()),
    pa.field("top_p", pa.float64()),
    pa.field("n", pa.int64()),
    pa.field("stop", pa.list_(pa.string())),  # a single string becomes a list of one
    pa.field("seed", pa.int64()),
    pa.field("logprobs", pa.bool_()),  # return the sampled tokens' logprobs
    pa.field("top_logprobs", pa.int64()),  # and this many most likely tokens per step (completions' logprobs=k)
    pa.field("response_format", pa.string()),  # the response_format object as JSON text (see engine/grammar)
]
SCHEMA = pa.schema([pa.field(ID, pa.string()), pa.field(LINE, pa.int64()), pa.field(URL, pa.string()),
                    pa.field(PROMPT, pa.string()), pa.field(MESSAGES, MESSAGE_TYPE), *SAMPLING_COLUMNS,
                    pa.field(ERROR_CODE, pa.string()), pa.field(ERROR_MESSAGE, pa.string())])
ROLES = {"system", "user", "assistant", "tool", "developer"}
# body key: (type, lowest, highest) as OpenAI's API accepts them
NUMBERS = {"max_tokens": (int, 1, None), "max_completion_tokens": (int, 1, None), "temperature": (float, 0, 2),
           "top_p": (float, 0, 1), "n": (int, 1, None), "seed": (int, None, None)}
SAMPLING_KEYS = set(NUMBERS) | {"stop", "logprobs", "top_logprobs", "response_format"}
TOP_LOGPROBS_LIMIT = {CHAT_URL: 20, COMPLETIONS_URL: 5}  # OpenAI's own limits


class BadLine(ValueError):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class OpenAIBatchFile:
    """The part of a pyarrow dataset's interface that preparing the input uses: a fixed schema, a row count
    and a stream of record batches, read from JSONL files one batch of lines at a time."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.schema = SCHEMA

    def count_rows(self) -> int:
        count = 0
        for file in self.files:
            with open(file, "rb") as handle:
                count += sum(1 for line in handle if line.strip())
        return count

    def to_batches(self, columns: list[str] | None = None, batch_size: int = 8192, **_) -> Iterator[pa.RecordBatch]:
        seen = _SeenIds()
        number = 0
        pending: list[tuple[int, bytes]] = []
        for file in self.files:
            with open(file, "rb") as handle:
                for line in handle:
                    number += 1
                    if line.strip():
                        pending.append((number, line))
                    if len(pending) == batch_size:
                        yield _batch(pending, seen, columns)
                        pending = []
        if pending:
            yield _batch(pending, seen, columns)


def _batch(lines: list[tuple[int, bytes]], seen: _SeenIds, columns: list[str] | None) -> pa.RecordBatch:
    rows = [_row(number, line) for number, line in lines]
    for row, duplicate_of in zip(rows, seen.check([row[ID] for row in rows])):
        if duplicate_of:
            row.update({ERROR_CODE: "duplicate_custom_id",
                        ERROR_MESSAGE: f"custom_id {row[ID]!r} is used by an earlier line",
                        ID: f"#line-{row[LINE]}"})
    batch = pa.RecordBatch.from_pylist(rows, schema=SCHEMA)
    return batch.select(columns) if columns is not None else batch


def _row(number: int, line: bytes) -> dict:
    row = {LINE: number, ID: f"#line-{number}"}
    try:
        request = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return {**row, ERROR_CODE: "invalid_json", ERROR_MESSAGE: f"line {number} is not JSON: {error}"}
    if not isinstance(request, dict):
        return {**row, ERROR_CODE: "invalid_json", ERROR_MESSAGE: f"line {number} is not a JSON object"}
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return {**row, ERROR_CODE: "missing_custom_id",
                ERROR_MESSAGE: f"line {number} has no custom_id (a non-empty string)"}
    row[ID] = custom_id
    try:
        row.update(_request(request))
    except BadLine as bad:
        row.update({ERROR_CODE: bad.code, ERROR_MESSAGE: str(bad)})
    return row


def _request(request: dict) -> dict:
    url = request.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise BadLine("invalid_url", f"url {url!r}: only {CHAT_URL} and {COMPLETIONS_URL} are served")
    method = request.get("method", "POST")
    if method != "POST":
        raise BadLine("invalid_method", f"method {method!r}: only POST is served")
    body = request.get("body")
    if not isinstance(body, dict):
        raise BadLine("missing_body", "the line has no body object")
    row: dict = {URL: url}
    if url == CHAT_URL:
        row[MESSAGES] = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise BadLine("missing_input", "a /v1/completions body needs prompt (one string)")
        row[PROMPT] = prompt
    row.update(_sampling(url, body))
    return row


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise BadLine("missing_input", "a /v1/chat/completions body needs messages (a non-empty list)")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadLine("invalid_messages", f"messages[{index}] needs a role ({', '.join(sorted(ROLES))})")
        role = "system" if message["role"] == "developer" else message["role"]  # OpenAI's newer name
        out.append({"role": role, "content": _text(message.get("content"), index)})
    return out


def _text(content, index: int) -> str:
    """A message's text: a string, or the text parts of a list of content parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in content):
        return "\n".join(part["text"] for part in content)
    raise BadLine("invalid_messages", f"messages[{index}].content must be text (a string or text parts)")


def _sampling(url: str, body: dict) -> dict:
    """The body's sampling parameters, checked; only the keys the body has are looked at (most set a few)."""
    row: dict = {}
    given = body.keys() & SAMPLING_KEYS
    if not given:
        return row
    for key in given & NUMBERS.keys():
        kind, low, high = NUMBERS[key]
        row[key] = _number(body[key], key, kind, low, high)
    if "max_completion_tokens" in given:
        row["max_tokens"] = row.pop("max_completion_tokens")
    if row.get("top_p") == 0:
        raise BadLine("invalid_parameter", "top_p must be above 0")
    if "stop" in given:
        row["stop"] = _stop(body["stop"])
    limit = TOP_LOGPROBS_LIMIT[url]
    if url == CHAT_URL:
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise BadLine("invalid_parameter", "logprobs must be true or false")
        row["logprobs"] = logprobs
        row["top_logprobs"] = _number(body.get("top_logprobs"), "top_logprobs", int, low=0, high=limit)
    else:  # completions: logprobs=k asks for the sampled token and the k most likely
        k = _number(body.get("logprobs"), "logprobs", int, low=0, high=limit)
        row["logprobs"], row["top_logprobs"] = (None, None) if k is None else (True, k)
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in (
                "text", "json_object", "json_schema"):
            raise BadLine("invalid_parameter", "response_format must be an object with type text, json_object "
                                               "or json_schema")
        row["response_format"] = json.dumps(response_format)
    return row


def _number(value, name: str, kind: type, low: float | None = None, high: float | None = None):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise BadLine("invalid_parameter", f"{name} must be {'an integer' if kind is int else 'a number'}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"in [{low}, {high}]"
        raise BadLine("invalid_parameter", f"{name}={value}: must be {bounds}")
    return kind(value)


def _stop(stop) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise BadLine("invalid_parameter", "stop must be a string or a list of up to 4 non-empty strings")
    return stops


class _SeenIds:
    """custom_ids seen so far, as 64-bit hashes in sorted runs of doubling size (8 bytes per line; a batch is
    checked with one binary search per run, and merging runs costs O(n log n) over the whole file)."""

    def __init__(self):
        self.runs: list[np.ndarray] = []

    def check(self, ids: list[str]) -> list[bool]:
        """Whether each id was seen before (earlier in this batch included); records them all."""
        hashes = np.fromiter((int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "little")
                              for i in ids), dtype=np.uint64, count=len(ids))
        seen = np.zeros(len(ids), dtype=bool)
        for run in self.runs:
            position = np.minimum(np.searchsorted(run, hashes), len(run) - 1)
            seen |= run[position] == hashes
        unique, first = np.unique(hashes, return_index=True)
        seen[np.setdiff1d(np.arange(len(ids)), first)] = True
        while self.runs and len(self.runs[-1]) <= len(unique):
            unique = np.union1d(self.runs.pop(), unique)
        self.runs.append(unique)
        return seen.tolist()
