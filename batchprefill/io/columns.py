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


def check_columns(schema: pa.Schema, columns: Columns) -> None:
    names = set(schema.names)
    for key, name in (("prompt_column", columns.prompt), ("system_column", columns.system),
                      ("namespace_column", columns.namespace), ("messages_column", columns.messages),
                      ("schema_column", columns.schema), *columns.task_columns):
        if name is not None and name not in names:
            raise JobError(f"data.{key}={name!r} is not a column of the input (columns: {', '.join(schema.names)})")
    if columns.schema is not None and not pa.types.is_string(schema.field(columns.schema).type):
        raise JobError(f"data.schema_column={columns.schema!r} is {schema.field(columns.schema).type}, not a string "
                       "column: give each row's JSON Schema as JSON text")


ROW, TOKENS, ERROR, NAMESPACE = "_bp_row", "_bp_tokens", "_bp_error", "_bp_namespace"


INTERNAL = (ROW, TOKENS, ERROR, NAMESPACE)  # a task's own internal columns are its (tasks.Task.internal_columns)
