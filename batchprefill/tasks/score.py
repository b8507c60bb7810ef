"""task=score: the log-likelihood of each choice after a context, with the context computed once.

The context is one request; its children (one per choice of two or more tokens) fork after it and compute
only the choice's own tokens. A choice token's log-probability needs the logits of the position before it:
for the first token that is the context's last position, which the context request computes anyway; for
the others, the child's own positions. The last token of a choice is never computed: nothing needs its KV or
its logits. Cost per row: |C| + sum(|X_i| - 1) tokens instead of k (|C| + |X_i|).

Each position's log-probability is stored at its own index (never added up on the way), so a child that is
preempted and recomputed, or that waits and recomputes what the cache lost, gives the same sums.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pyarrow as pa

from batchprefill.engine.request import Request
from batchprefill.errors import JobError
from batchprefill.model.tokenizer import ENCODE_ROWS
from batchprefill.sampling_params import SamplingParams
from batchprefill.tasks.base import OrderedRows, PromptBatch
from batchprefill.units import a_type

SCORE_SAMPLING = SamplingParams(max_tokens=0)  # a scored request samples nothing
CHOICES = "_bp_choices"  # each choice's token ids after the context
RESULT_FIELDS = [  # in place of the output_* columns
    pa.field("num_prompt_tokens", pa.int32()),
    pa.field("num_cached_tokens", pa.int32()),
    pa.field("finish_reason", pa.string()),
    pa.field("error", pa.string()),
    pa.field("choice_logprobs", pa.list_(pa.float64())),
    pa.field("choice_num_tokens", pa.list_(pa.int32())),
    pa.field("choice_is_greedy", pa.list_(pa.bool_())),
    pa.field("best_choice", pa.int32()),
]


@dataclass(eq=False)
class ChoiceScores:
    """One row's choices (token ids after the context) and each choice token's log-probability and greedy flag;
    the readout of the row's context request, which reads the first token of every choice."""

    states: ClassVar[None] = None  # logits only
    context_len: int
    choices: list[list[int]]
    logprobs: list[np.ndarray]
    greedy: list[np.ndarray]
    pending: int  # children still computing
    context: Request | None = None  # the row's context request, which the engine returns once all is scored
    computed_choice_tokens: int = 0  # tokens the children computed (context tokens a waiting child lost included)

    @property
    def choice_tokens(self) -> int:
        return sum(map(len, self.choices))

    def choice_logprobs(self) -> list[float]:
        return [float(values.sum()) for values in self.logprobs]

    def is_greedy(self) -> list[bool]:
        return [bool(flags.all()) for flags in self.greedy]

    def best_choice(self) -> int:
        """The highest sum, ties to the lowest index."""
        return int(np.argmax(self.choice_logprobs()))

    def select(self, request: Request, start: int, stop: int) -> tuple[list[int], list[int]]:
        """The context's last position once it is computed, once per choice: it scores every choice's first token."""
        if stop != request.num_tokens:
            return [], []
        return [stop - 1] * len(self.choices), [choice[0] for choice in self.choices]

    def record(self, positions: list[int], logprobs: np.ndarray, greedy: np.ndarray) -> None:
        for index, (value, flag) in enumerate(zip(logprobs.tolist(), greedy.tolist())):
            self.logprobs[index][0] = value
            self.greedy[index][0] = flag

    def finish(self, request: Request) -> Request | None:
        return self.row_done()

    def row_prompt_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens + self.choice_tokens

    def row_done(self) -> Request | None:
        """The row's context request once every choice is scored, its cached count then the row's: prompt and
        choice tokens whose KV this row did not compute."""
        if self.pending or self.context.forks:
            return None
        context = self.context
        computed = context.num_prompt_tokens - (context.num_cached_tokens or 0) + self.computed_choice_tokens
        context.num_cached_tokens = context.num_row_prompt_tokens - computed
        context.finish_reason = "stop"  # INTERFACE.md's values: a scored row ended normally
        return context


@dataclass(eq=False)
class ChoiceReadout:
    """The readout of the child that scores choice `index`: every token of the choice but the first."""

    states: ClassVar[None] = None
    scores: ChoiceScores
    index: int

    def select(self, request: Request, start: int, stop: int) -> tuple[list[int], list[int]]:
        """The child's positions from the context's end on: each scores the choice token after it."""
        context_len, choice = self.scores.context_len, self.scores.choices[self.index]
        positions = list(range(max(start, context_len), stop))
        return positions, [choice[position + 1 - context_len] for position in positions]

    def record(self, positions: list[int], logprobs: np.ndarray, greedy: np.ndarray) -> None:
        tokens = np.array(positions) + 1 - self.scores.context_len
        self.scores.logprobs[self.index][tokens] = logprobs
        self.scores.greedy[self.index][tokens] = greedy

    def finish(self, request: Request) -> Request | None:
        scores = self.scores
        scores.computed_choice_tokens += request.num_prompt_tokens - (request.num_cached_tokens or 0)
        scores.pending -= 1
        return scores.row_done()

    def row_prompt_tokens(self, request: Request) -> int:
        return request.num_prompt_tokens  # a child is no row of its own: its context's reports the choices


def score_request(request_id: int, context: list[int], choices: list[list[int]], namespace: str = "") -> Request:
    """The context request of a row, carrying the children that fork after it (choices of one token need none)."""
    scores = ChoiceScores(len(context), choices, [np.full(len(c), np.nan) for c in choices],
                          [np.zeros(len(c), bool) for c in choices], 0)
    parent = Request(request_id, context, SCORE_SAMPLING, namespace, readout=scores)
    for index, choice in enumerate(choices):
        if len(choice) > 1:
            parent.forks.append(Request(request_id, context + choice[:-1], SCORE_SAMPLING, namespace,
                                        readout=ChoiceReadout(scores, index)))
    scores.pending = len(parent.forks)
    scores.context = parent
    return parent


def choice_tokens(choices: list, contexts: list[str], spaces: list[str], context_tokens: list[list[int]],
                  errors: list[str | None], limit: int, tokenizer) -> list[list[list[int]] | None]:
    """Each row's choices as lm-evaluation-harness tokenizes them: the tokens of context + whitespace + choice
    after the context's own tokens. A row with no choices, a null or empty choice, a choice that adds no token,
    or a context and choice longer than `limit` (the model's context) gets an error instead."""
    texts, owners = [], []
    for row, (row_choices, error) in enumerate(zip(choices, errors)):
        if error is not None:
            continue
        row_choices = [row_choices] if isinstance(row_choices, str) else row_choices
        problem = _choices_error(row_choices)
        if problem is not None:
            errors[row] = problem
            continue
        texts += [contexts[row] + spaces[row] + choice for choice in row_choices]
        owners += [row] * len(row_choices)
    result: list[list[list[int]] | None] = [None] * len(choices)
    for start in range(0, len(texts), ENCODE_ROWS):
        encoded = tokenizer.encode_batch(texts[start : start + ENCODE_ROWS])
        for row, whole in zip(owners[start : start + ENCODE_ROWS], encoded):
            if errors[row] is not None:
                continue
            context = context_tokens[row]
            choice = whole[len(context):]
            index = len(result[row] or [])
            if not choice:
                errors[row] = f"choices[{index}] adds no token to the prompt"
            elif len(context) + len(choice) > limit:
                errors[row] = (f"prompt plus choices[{index}] have {len(context) + len(choice)} tokens; at most "
                               f"{limit} fit (the model's context)")
            else:
                result[row] = [*(result[row] or []), choice]
    return [None if error is not None else row for row, error in zip(result, errors)]


def _choices_error(choices) -> str | None:
    if choices is None:
        return "choices is null"
    if not isinstance(choices, list) or not choices:
        return "choices is empty" if isinstance(choices, list) else f"choices is {a_type(choices)}"
    for index, choice in enumerate(choices):
        if choice is None:
            return f"choices[{index}] is null"
        if not isinstance(choice, str) or not choice:
            return f"choices[{index}] is empty" if choice == "" else f"choices[{index}] is not a string"
    return None


class Score:
    name = "score"
    head = "lm"
    input_columns = (("choices_column", "the column of choices"),)
    internal_columns = (CHOICES,)

    def check(self, sampling: SamplingParams) -> None:
        if sampling.n != 1:
            raise JobError(f"task=score scores each choice once: set sampling.n=1, not {sampling.n}")

    def max_prompt_tokens(self, context: int, max_tokens: int) -> int:
        """A context samples nothing: the whole context is the limit (each choice is checked against it too)."""
        return context

    def tokenize(self, batch: PromptBatch) -> tuple[pa.ListArray, dict[str, pa.Array]]:
        """Contexts and their choices split as lm-eval does: the context's trailing whitespace begins every choice."""
        spaces = [text[len(text.rstrip()):] for text in batch.texts]
        contexts = [text.rstrip() for text in batch.texts]
        tokens = batch.prompt_tokens(contexts)
        column = dict(batch.columns.task_columns)["choices_column"]
        choices = choice_tokens(batch.table[column].to_pylist(), contexts, spaces, tokens.to_pylist(), batch.errors,
                                batch.limit, batch.tokenizer)
        return tokens, {CHOICES: pa.array(choices, pa.list_(pa.list_(pa.int32())))}

    def requests(self, rows: OrderedRows) -> list[Request]:
        """A context request per row, carrying its choices."""
        choices = rows.table[CHOICES].take(rows.order).to_pylist()
        return [score_request(row, ids, row_choices, namespace) for row, ids, row_choices, namespace
                in zip(rows.rows, rows.token_ids, choices, rows.namespaces)]

    def kv_tokens(self, prompt_tokens: int, output_tokens: int, samples: int) -> int:
        """The choices' tokens are not in the manifest: twice the contexts' is taken (a pool that is short only
        makes children wait)."""
        return 2 * prompt_tokens

    def result_fields(self, samples: bool, logprobs: bool) -> list[pa.Field]:
        return RESULT_FIELDS

    def result_columns(self, request: Request) -> dict:
        scores = request.readout
        if not isinstance(scores, ChoiceScores) or request.error is not None:
            return {}
        return {"choice_logprobs": scores.choice_logprobs(), "choice_num_tokens": list(map(len, scores.choices)),
                "choice_is_greedy": scores.is_greedy(), "best_choice": scores.best_choice()}
