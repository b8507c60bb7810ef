"""Each row's sampling parameters: the partition's per-request columns (an OpenAI batch body's max_tokens,
temperature, top_p, n, stop, seed, logprobs/top_logprobs and response_format; `data.schema_column`), with the
job's `sampling.*` wherever a row leaves one null.

A partition of many rows holds few distinct settings, so the work is per distinct setting, not per row: each
column is dictionary-encoded, the rows' codes go into one matrix, `np.unique` over its rows finds the distinct
combinations, and one `SamplingParams` is built per combination and shared by all its rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchprefill.constraint import Constraint, GrammarError
from batchprefill.io.columns import ERROR, TOKENS, Columns
from batchprefill.sampling_params import SamplingParams

STOP_SEPARATOR = "\x1f"  # joins a row's stop strings into one text, so the list column dictionary-encodes
PLAIN = ("max_tokens", "temperature", "top_p", "n", "seed")  # columns named as the SamplingParams fields
RESPONSE_FORMAT = "response_format"
SCHEMA = "schema"  # the key of data.schema_column among a row's values


@dataclass
class PartitionSampling:
    settings: list[SamplingParams]  # the partition's distinct settings
    index: np.ndarray  # each row's entry in settings
    errors: list[str | None]  # each row's error: the partition's own, else one its settings cause


def partition_sampling(table: pa.Table, columns: Columns, default: SamplingParams,
                       max_positions: int) -> PartitionSampling:
    """Every row's settings, and an error for each row that cannot run under them: a constraint that is not
    valid, or a prompt that leaves less room than the row's max_tokens in the model's context."""
    settings, index, setting_errors = row_sampling(table, columns, default)
    setting_errors = [error or _samples_error(params, default) for params, error in zip(settings, setting_errors)]
    errors = table[ERROR].to_pylist()
    bad = np.array([error is not None for error in setting_errors])[index]
    for row in np.flatnonzero(bad).tolist():
        errors[row] = errors[row] or setting_errors[index[row]]
    prompt_tokens = pc.list_value_length(table[TOKENS]).to_numpy(zero_copy_only=False)
    max_tokens = np.array([params.max_tokens for params in settings], dtype=np.int64)[index]
    for row, message in context_errors(prompt_tokens, max_tokens, max_positions).items():
        errors[row] = errors[row] or message
    return PartitionSampling(settings, index, errors)


def _samples_error(params: SamplingParams, default: SamplingParams) -> str | None:
    """Results, resume and the merge count a row's samples from the job's sampling.n, so a line's own n must
    agree with it."""
    if params.n == default.n:
        return None
    return (f"n={params.n} on this line but sampling.n={default.n}: every line of a job gets sampling.n samples; "
            f"run the lines with n={params.n} in a job with sampling.n={params.n}")


def row_sampling(table: pa.Table, columns: Columns, default: SamplingParams) -> tuple[list[SamplingParams],
                                                                                      np.ndarray, list[str | None]]:
    """The distinct settings of the table's rows, each row's index into them, and per distinct setting the
    error that stops its rows from running (a response_format or schema that is not a valid constraint)."""
    names = [name for name in columns.sampling if name in table.column_names]
    sources = {name: table[name] for name in names}
    if "stop" in sources:
        sources["stop"] = pc.binary_join(sources["stop"], STOP_SEPARATOR)
    if columns.schema is not None:
        sources[SCHEMA] = table[columns.schema]
    if not sources or table.num_rows == 0:
        return [default], np.zeros(table.num_rows, dtype=np.int64), [None]
    encoded = [pc.dictionary_encode(column.combine_chunks(), null_encoding="encode") for column in sources.values()]
    codes = np.stack([array.indices.to_numpy(zero_copy_only=False) for array in encoded], axis=1)
    distinct, index = np.unique(codes, axis=0, return_inverse=True)
    dictionaries = [array.dictionary.to_pylist() for array in encoded]
    settings, errors = [], []
    for combination in distinct.tolist():
        values = {key: dictionary[code] for key, dictionary, code in zip(sources, dictionaries, combination)}
        try:
            settings.append(_params(values, default))
            errors.append(None)
        except GrammarError as error:
            settings.append(default)
            errors.append(str(error))
    return settings, index.reshape(-1), errors


def _params(values: dict, default: SamplingParams) -> SamplingParams:
    """One distinct combination of column values (None: unset) over the job's default."""
    changes = {key: values[key] for key in PLAIN if values.get(key) is not None}
    if values.get("stop") is not None:
        changes["stop"] = tuple(values["stop"].split(STOP_SEPARATOR)) if values["stop"] else ()
    if values.get("logprobs") is not None:  # OpenAI's logprobs: true with top_logprobs: k asks for k alternatives
        changes["logprobs"] = (values.get("top_logprobs") or 0) if values["logprobs"] else None
    if values.get(SCHEMA) is not None:
        changes["constraint"] = Constraint.json_schema(values[SCHEMA])
    if values.get(RESPONSE_FORMAT) is not None:  # a line's own response_format wins; type text: unconstrained
        changes["constraint"] = Constraint.from_response_format(json.loads(values[RESPONSE_FORMAT]))
    return replace(default, **changes) if changes else default


def context_errors(prompt_tokens: np.ndarray, max_tokens: np.ndarray, max_positions: int) -> dict[int, str]:
    """Rows whose prompt plus their own max_tokens do not fit the model's context: row -> message."""
    over = np.flatnonzero((prompt_tokens > 0) & (prompt_tokens + max_tokens > max_positions))
    return {int(row): f"prompt ({prompt_tokens[row]} tokens) plus max_tokens={max_tokens[row]} exceeds the "
                      f"model's context of {max_positions} tokens: lower max_tokens or shorten the prompt"
            for row in over}


def max_output_tokens(table: pa.Table, default: SamplingParams) -> int:
    """The most output tokens the rows may ask for: each row's max_tokens, the job's where a row sets none."""
    if "max_tokens" not in table.column_names:
        return table.num_rows * default.max_tokens
    return int(pc.sum(pc.fill_null(table["max_tokens"], default.max_tokens)).as_py() or 0)


def may_be_constrained(table: pa.Table, columns: Columns) -> bool:
    """Whether any row names a constraint of its own (a schema, or a response_format other than text)."""
    if columns.schema is not None and table[columns.schema].null_count < table.num_rows:
        return True
    if RESPONSE_FORMAT not in table.column_names:
        return False
    formats = pc.unique(table[RESPONSE_FORMAT].combine_chunks()).drop_null().to_pylist()
    return any(json.loads(text).get("type") != "text" for text in formats)
