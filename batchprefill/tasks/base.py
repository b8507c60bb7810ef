"""What a task is: everything about a job that depends on `task=` sits behind this one interface.

The stages around it stay generic: settings asks the task what its config needs, preparing asks it how long a
prompt may be and what to tokenize beyond the prompt, the run asks it for each partition's requests, how many KV
tokens they may need and which result columns to write. The engine sees only the requests it makes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa

from batchprefill.engine.request import Request
from batchprefill.io.columns import Columns
from batchprefill.model.tokenizer import PromptTokenizer
from batchprefill.pooling_params import PoolingParams
from batchprefill.sampling_params import SamplingParams


@dataclass
class PromptBatch:
    """One record batch on its way to token ids, as a task's tokenizing sees it."""

    table: pa.Table  # the batch's input columns
    texts: list[str]  # each row's prompt text (chat template applied; empty for rows already in error)
    errors: list[str | None]  # each row's error so far: a task may add its own
    columns: Columns
    limit: int  # the most tokens a row's prompt may have (Task.max_prompt_tokens)
    tokenizer: PromptTokenizer
    # Token ids of the given texts, one row each, as one column: rows of no token or over `limit` become errors.
    prompt_tokens: Callable[[list[str]], pa.ListArray]


@dataclass
class OrderedRows:
    """One partition's runnable rows in run order, as a task turns them into requests."""

    table: pa.Table  # the partition (its task columns included), in its stored order
    order: np.ndarray  # run order, as rows of `table`
    rows: list[int]  # each row's number in the input: its requests' id
    token_ids: list[list[int]]
    namespaces: list[str]
    sampling: list[SamplingParams]  # each row's: the job's, with the row's per-request columns
    pooling: PoolingParams = PoolingParams()  # the job's model.pooling and model.normalize


class Task(Protocol):
    name: str  # its `task=` value
    # The head the model folder must have (model/heads.py: "lm", "score"), None for any folder: a folder whose head
    # does not fit stops the job before any prompt runs.
    head: str | None
    # The data.* keys of the input columns it reads besides the prompt, each with what the column holds: the job
    # needs every one set (settings puts them in Columns.task_columns), and a format with fixed columns has none.
    input_columns: tuple[tuple[str, str], ...]
    # The columns its tokenizing adds to the partitions (named `_bp_...`): read back by its requests, never written.
    internal_columns: tuple[str, ...]

    def check(self, sampling: SamplingParams) -> None:
        """Raise a one-line JobError for sampling settings the task cannot honour."""
        ...

    def max_prompt_tokens(self, context: int, max_tokens: int) -> int:
        """The longest prompt preparing lets through, in a model of `context` positions with sampling.max_tokens."""
        ...

    def tokenize(self, batch: PromptBatch) -> tuple[pa.ListArray, dict[str, pa.Array]]:
        """The batch's prompt token ids and the internal columns it adds beside them (`internal_columns`)."""
        ...

    def requests(self, rows: OrderedRows) -> list[Request]:
        """The engine requests of a partition's rows, in run order: one per row, carrying any children."""
        ...

    def kv_tokens(self, prompt_tokens: int, output_tokens: int, samples: int) -> int:
        """KV slots that would hold all of a shard's requests at once (a pool never needs more), from the
        manifest's prompt tokens, the most output tokens its rows may ask for, and sampling.n."""
        ...

    def result_fields(self, samples: bool, logprobs: bool) -> list[pa.Field]:
        """The columns a job adds to its input columns (INTERFACE.md, "What a run writes"), with sampling.n > 1
        (`samples`) and where rows may carry logprobs."""
        ...

    def result_columns(self, request: Request) -> dict:
        """A finished request's values of the result fields beyond io.results.Outcome's own."""
        ...
