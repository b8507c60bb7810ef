"""The columns of a job's tables: the user's column names (from data.*) and the internal ones that preparing adds."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from batchprefill.errors import JobError


@dataclass(frozen=True)
class Columns:
    prompt: str | None  # None when every row's text comes from `messages`
    id: str
    system: str | None
    namespace: str | None
    messages: str | None = None  # chat conversations (list of struct role, content); used before `prompt`
    read_error: str | None = None  # errors the reader found in a row (OpenAI batch lines): such rows never run
    schema: str | None = None  # a per-row JSON Schema (string) the row's output must follow
    sampling: tuple[str, ...] = ()  # per-request sampling columns (OpenAI batch bodies'; see request_params)
    # The input columns the job's task reads besides the prompt, as (data.* key, column name) (tasks.Task).
    task_columns: tuple[tuple[str, str], ...] = ()
    adapter: str | None = None  # each row's LoRA adapter by name (model.adapters); null or empty: the base model
    # A name that is not one of the job's adapters runs the base model (an OpenAI batch body's `model`) instead of
    # making an error row (data.adapter_column).
    unknown_adapter_is_base: bool = False
    # A column naming each row's task (an OpenAI batch line's, from its url): the job's `task` does not apply to it.
    row_task: str | None = None


def check_columns(schema: pa.Schema, columns: Columns, chat_template: bool = False) -> None:
    """Every column a data.* key names is in the input, and of a type the job can read; token-id prompts are not
    text, so neither the chat template nor a task's columns read after the prompt's text (choices) apply to them."""
    names = set(schema.names)
    for key, name in (("prompt_column", columns.prompt), ("system_column", columns.system),
                      ("namespace_column", columns.namespace), ("messages_column", columns.messages),
                      ("schema_column", columns.schema), ("adapter_column", columns.adapter), *columns.task_columns):
        if name is not None and name not in names:
            raise JobError(f"data.{key}={name!r} is not a column of the input (columns: {', '.join(schema.names)})")
    if columns.adapter is not None and not is_text(schema.field(columns.adapter).type):
        raise JobError(f"data.adapter_column={columns.adapter!r} is {schema.field(columns.adapter).type}, not a string "
                       "column: give each row's adapter by its name in model.adapters")
    if columns.schema is not None and not is_text(schema.field(columns.schema).type):
        raise JobError(f"data.schema_column={columns.schema!r} is {schema.field(columns.schema).type}, not a string "
                       "column: give each row's JSON Schema as JSON text")
    prompt_type = schema.field(columns.prompt).type if columns.prompt is not None else None
    if prompt_type is not None and is_token_ids(prompt_type):
        if chat_template:
            raise JobError(f"data.chat_template=true renders text, but data.prompt_column={columns.prompt!r} holds "
                           f"token ids ({prompt_type}): set data.chat_template=false to take the ids as they are")
        for key, name in columns.task_columns:
            raise JobError(f"data.{key}={name!r} is tokenized after each prompt's text, but data.prompt_column="
                           f"{columns.prompt!r} holds token ids ({prompt_type}): give the prompts as text")


def is_text(arrow_type: pa.DataType) -> bool:
    """A string column in any of Arrow's layouts (polars writes large_string)."""
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or \
        pa.types.is_string_view(arrow_type)


def is_token_ids(arrow_type: pa.DataType) -> bool:
    """A column of integer lists: pre-tokenized prompts, taken as token ids as vLLM takes prompt_token_ids."""
    return (pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type)) and \
        pa.types.is_integer(arrow_type.value_type)


INTERNAL_PREFIX = "_bp_"  # of every column preparing adds (these, and each task's own): never the user's
ROW, TOKENS, ERROR, NAMESPACE = "_bp_row", "_bp_tokens", "_bp_error", "_bp_namespace"
ADAPTER = "_bp_adapter"  # the row's adapter name as it runs ("" for the base model); also folded into NAMESPACE
# Between a row's namespace and its adapter in NAMESPACE, which partitions, the order stage and the prefix cache key
# on: rows of two adapters never share a prefix group nor a cached block; rows of one adapter share as before.
ADAPTER_SCOPE = "\x1fadapter:"


# A task's own internal columns are its (tasks.Task.internal_columns).
INTERNAL = (ROW, TOKENS, ERROR, NAMESPACE, ADAPTER)
