"""Pre-tokenized prompts: a prompt column of integer lists is each row's tokens, as vLLM takes prompt_token_ids.

No tokenizer and no chat template touch them (check_columns refuses data.chat_template=true with such a column).
The ids are checked in Arrow and numpy for the whole batch at once; a row that cannot run gets its own error.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

INT32_END = 1 << 31  # the partitions hold token ids as int32: without a vocabulary size, the ids must fit them


def prompt_too_long(count: int, limit: int) -> str:
    return f"prompt has {count} tokens; at most {limit} fit (model context minus sampling.max_tokens)"


def given_token_ids(prompts: pa.ChunkedArray, limit: int,
                    vocab_size: int | None) -> tuple[pa.ListArray, list[str | None]]:
    """The rows' token ids as one Arrow list column of int32, and each row's error: a null or empty list, an id
    that is null or outside [0, vocab_size), or more than `limit` ids. Error rows get no tokens."""
    lists = prompts.combine_chunks()
    end = INT32_END if vocab_size is None else vocab_size
    lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(lists)  # the ids of the non-null lists, row after row
    starts = np.cumsum(lengths) - lengths
    outside = pc.fill_null(pc.or_(pc.less(values, 0), pc.greater_equal(values, end)), True)
    errors: list[str | None] = [None] * len(lists)
    for row in np.flatnonzero(lists.is_null().to_numpy(zero_copy_only=False)):
        errors[row] = "prompt is null"
    for row in np.flatnonzero(lengths == 0):
        errors[row] = errors[row] or "prompt is an empty list of token ids"
    bad = np.flatnonzero(outside.to_numpy(zero_copy_only=False))
    rows, first = np.unique(pc.list_parent_indices(lists).to_numpy()[bad], return_index=True)
    for row, at in zip(rows.tolist(), bad[first].tolist()):
        value = values[at].as_py()
        errors[row] = f"prompt token {at - starts[row]} is " + (
            "null" if value is None else f"{value}, not an id of the model's vocabulary [0, {end})")
    for row in np.flatnonzero(lengths > limit):
        errors[row] = errors[row] or prompt_too_long(int(lengths[row]), limit)
    keep = np.fromiter((error is None for error in errors), bool, len(errors))
    counts = np.where(keep, lengths, 0)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    kept = values.filter(pa.array(np.repeat(keep, lengths))).cast(pa.int32())
    return pa.ListArray.from_arrays(pa.array(offsets), kept), errors
