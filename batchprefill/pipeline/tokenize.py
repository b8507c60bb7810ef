"""Tokenize the input's record batches on every core: chat rendering, row checks (error rows), and what the
job's task tokenizes beyond the prompt."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchprefill.io.columns import ADAPTER, ADAPTER_SCOPE, ERROR, NAMESPACE, ROW, TOKENS, Columns, is_token_ids
from batchprefill.io.input_format import InputDataset, record_batches
from batchprefill.model.tokenizer import ENCODE_ROWS
from batchprefill.pipeline.manifest import PrepareSettings
from batchprefill.pipeline.token_ids import given_token_ids, prompt_too_long
from batchprefill.tasks import get_task
from batchprefill.tasks.base import PromptBatch
from batchprefill.units import a_type

# Threads that tokenize record batches. The tokenizer spreads each call over every core by itself; a second
# thread keeps those cores fed while the first holds the GIL to turn its output into arrays.
TOKENIZE_THREADS = 2


@contextmanager
def tokenized_tables(dataset: InputDataset, settings: PrepareSettings, tokenizer,
                      workers: int) -> Iterator[Iterator[pa.Table]]:
    """The input's record batches tokenized by `workers` threads, yielded in input order.

    The tokenizer runs on every core in its own thread pool and releases the GIL, so while one batch is in it
    another thread turns its ids into arrays and the caller spills the batch before. At most 2 x `workers`
    batches are in flight, so memory does not follow the input. A worker's exception is raised where its batch
    is yielded; on the way out, batches not yet started are cancelled and the running ones are waited for.
    """
    with ThreadPoolExecutor(workers, thread_name_prefix="tokenize") as pool:
        pending: deque[Future[pa.Table]] = deque()

        def tables() -> Iterator[pa.Table]:
            offset = 0
            for batch in record_batches(dataset, settings.read_batch_rows):
                pending.append(pool.submit(_tokenized, batch, offset, settings, tokenizer))
                offset += batch.num_rows
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

        try:
            yield tables()
        finally:
            for future in pending:
                future.cancel()


def _tokenized(batch: pa.RecordBatch, offset: int, settings: PrepareSettings, tokenizer) -> pa.Table:
    """The batch with its row numbers, token ids, namespace, the task's own columns and, for rows that cannot run,
    an error."""
    columns = settings.columns
    table = pa.Table.from_batches([batch])
    row_numbers = np.arange(offset, offset + batch.num_rows, dtype=np.int64)
    if columns.id not in table.column_names:
        table = table.append_column(columns.id, pa.array(row_numbers))
    if columns.prompt and is_token_ids(table.schema.field(columns.prompt).type):  # pre-tokenized prompts
        tokens, errors = given_token_ids(table[columns.prompt], settings.max_prompt_tokens, settings.vocab_size)
    else:
        texts, errors = _texts(table, settings, tokenizer)
        limit = settings.max_prompt_tokens
        prompts = PromptBatch(table, texts, errors, columns, limit, tokenizer,
                              lambda given: _token_column(given, errors, limit, tokenizer))
        tokens, task_columns = get_task(settings.task).tokenize(prompts)
        for name, values in task_columns.items():
            table = table.append_column(name, values)
    if columns.namespace:
        namespaces = pc.fill_null(pc.cast(table[columns.namespace], pa.string()), "")
    else:
        namespaces = pa.array(np.full(batch.num_rows, ""), pa.string())
    if columns.adapter:
        adapters = row_adapters(table[columns.adapter], columns, settings.adapters, errors)
        namespaces = pa.array([f"{namespace}{ADAPTER_SCOPE}{adapter}" if adapter else namespace
                               for namespace, adapter in zip(namespaces.to_pylist(), adapters)], pa.string())
        table = table.append_column(ADAPTER, pa.array(adapters, pa.string()))
    return (table.append_column(ROW, pa.array(row_numbers))
            .append_column(TOKENS, tokens)
            .append_column(ERROR, pa.array(errors, type=pa.string()))
            .append_column(NAMESPACE, namespaces))


def row_adapters(names: pa.ChunkedArray, columns: Columns, adapters: tuple[str, ...],
                 errors: list[str | None]) -> list[str]:
    """Each row's adapter as it runs ("" for the base model). A row naming an adapter the job does not have gets
    an error in `errors` (data.adapter_column), or runs the base model where the format says so (an OpenAI batch
    line's `model` names the base model or an adapter)."""
    given = pc.fill_null(pc.cast(names, pa.string()), "").to_pylist()
    known = set(adapters)
    running = []
    for i, name in enumerate(given):
        if name and name not in known:
            if not columns.unknown_adapter_is_base and errors[i] is None:
                have = ", ".join(sorted(known)) or "none"
                errors[i] = f"adapter {name!r} is not one of this job's model.adapters ({have})"
            name = ""
        running.append(name)
    return running


def _texts(table: pa.Table, settings: PrepareSettings, tokenizer) -> tuple[list[str], list[str | None]]:
    """The text to tokenize per row (empty for rows already in error) and each row's error so far.

    A row's conversation, when the input has a messages column and the row has one, is rendered with the chat
    template; otherwise its prompt (OpenAI batch files mix chat lines, with messages, and completion lines).
    """
    columns = settings.columns
    num_rows = table.num_rows
    prompts = table[columns.prompt].to_pylist() if columns.prompt else [None] * num_rows
    conversations = table[columns.messages].to_pylist() if columns.messages else [None] * num_rows
    read_errors = table[columns.read_error].to_pylist() if columns.read_error else [None] * num_rows
    systems = table[columns.system].to_pylist() if columns.system else [None] * num_rows
    texts, errors = [], []
    for prompt, conversation, read_error, system in zip(prompts, conversations, read_errors, systems):
        text, error = "", read_error
        if error is None and (conversation is not None or not columns.prompt):
            error = _conversation_error(conversation)
            if error is None:
                text, error = _rendered(tokenizer.render_conversation, conversation)
        elif error is None:
            error = _prompt_error(prompt)
            if error is None and settings.chat_template:
                text, error = _rendered(tokenizer.apply_chat_template, prompt,
                                        system if isinstance(system, str) else None)
            elif error is None:
                text = prompt
        texts.append(text)
        errors.append(error)
    return texts, errors


def _rendered(render, *args) -> tuple[str, str | None]:
    try:
        return render(*args), None
    except Exception as error:  # noqa: BLE001 - a template failure belongs to this row alone
        return "", f"chat template failed: {error}"


def _conversation_error(conversation) -> str | None:
    """Why a conversation cannot be rendered, or None: a non-empty list of messages with a role and a text."""
    if conversation is None:
        return "messages is null"
    if not isinstance(conversation, list) or not conversation:
        return "messages is empty" if isinstance(conversation, list) else "messages is not a list"
    for index, message in enumerate(conversation):
        if not isinstance(message, dict):
            return f"messages[{index}] is not an object with role and content"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            return f"messages[{index}] has no role"
        if not isinstance(content, str):
            return f"messages[{index}] ({role}) has no text content"
    if all(not message["content"].strip() for message in conversation):
        return "messages hold no text"
    return None


def _prompt_error(prompt) -> str | None:
    if prompt is None:
        return "prompt is null"
    if not isinstance(prompt, str):
        return f"prompt is {a_type(prompt)}, not a string"
    if not prompt or prompt.isspace():
        return "prompt is empty or whitespace only"
    return None


def _token_column(texts: list[str], errors: list[str | None], limit: int, tokenizer) -> pa.ListArray:
    """Token ids as one Arrow list column; rows that tokenize to nothing or to more than `limit` tokens become
    errors, and error rows get no tokens.

    The tokenizer's output (an object per row, Python ints per token: about 100 bytes a token) lives for
    ENCODE_ROWS rows at a time, flattened into numpy at once, so it does not multiply a large read batch.
    """
    lengths, values = [], []
    for start in range(0, len(texts), ENCODE_ROWS):
        token_ids = tokenizer.encode_batch(texts[start : start + ENCODE_ROWS])
        counts = np.fromiter(map(len, token_ids), np.int64, len(token_ids))
        for i in np.flatnonzero((counts == 0) | (counts > limit)):
            if errors[start + i] is None:
                errors[start + i] = "prompt tokenizes to no tokens" if counts[i] == 0 else (
                    prompt_too_long(counts[i], limit))
        keep = np.fromiter((error is None for error in errors[start : start + len(token_ids)]), bool)
        counts[~keep] = 0
        kept = itertools.compress(token_ids, keep)
        values.append(np.fromiter(itertools.chain.from_iterable(kept), np.int32, int(counts.sum())))
        lengths.append(counts)
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(values)))

