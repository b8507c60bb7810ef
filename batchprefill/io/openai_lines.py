"""OpenAI Batch API request lines: what a line must hold, and the row it becomes (`parse_line`).

A good line's row carries its prompt or messages and its body's sampling parameters, each in a column of its own
(null where the line did not set one), so the engine applies them to that request alone (see SAMPLING_COLUMNS).
A bad line's row carries `error_code` and `error_message` instead; a row's `custom_id` is its id, `#line-<n>` for
a line without a usable one (not JSON, or no custom_id; n counts lines from 1).
"""

from __future__ import annotations

import json

import pyarrow as pa

ID, LINE, URL, PROMPT, MESSAGES, TASK = "custom_id", "line", "url", "prompt", "messages", "task"
MODEL = "model"  # the body's model: one of model.adapters runs with that adapter, any other name the base model
ERROR_CODE, ERROR_MESSAGE = "error_code", "error_message"
CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)
# The task each url's lines run (the row's `task` column; tasks/ names them): the job's `task` does not apply.
URL_TASKS = {CHAT_URL: "generate", COMPLETIONS_URL: "generate", EMBEDDINGS_URL: "embed"}
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
                    pa.field(TASK, pa.string()), pa.field(PROMPT, pa.string()), pa.field(MESSAGES, MESSAGE_TYPE),
                    pa.field(MODEL, pa.string()),
                    *SAMPLING_COLUMNS,
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


def parse_line(number: int, line: bytes) -> dict:
    """The row of request line `number` (counted from 1), an error row if the line is bad."""
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
    if url not in URLS:
        raise BadLine("invalid_url", f"url {url!r}: only {', '.join(URLS[:-1])} and {URLS[-1]} are served")
    method = request.get("method", "POST")
    if method != "POST":
        raise BadLine("invalid_method", f"method {method!r}: only POST is served")
    body = request.get("body")
    if not isinstance(body, dict):
        raise BadLine("missing_body", "the line has no body object")
    row: dict = {URL: url, TASK: URL_TASKS[url]}
    if isinstance(body.get("model"), str):
        row[MODEL] = body["model"]
    if url == EMBEDDINGS_URL:
        row[PROMPT] = _one_string(body.get("input"), "a /v1/embeddings body needs input (one string)")
        return row  # nothing is sampled: sampling keys do not apply
    if url == CHAT_URL:
        row[MESSAGES] = _messages(body.get("messages"))
    else:
        row[PROMPT] = _one_string(body.get("prompt"), "a /v1/completions body needs prompt (one string)")
    row.update(_sampling(url, body))
    return row


def _one_string(value, message: str) -> str:
    """A body's one input text: a string, or a list holding one."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise BadLine("missing_input", message)
    return value


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
