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

import numpy as np
import torch

from batchprefill.engine.request import Request
from batchprefill.engine.scheduler_output import ScheduledChunk
from batchprefill.sampling_params import SamplingParams

SCORE_SAMPLING = SamplingParams(max_tokens=0)  # a scored request samples nothing


@dataclass(eq=False)
class ChoiceScores:
    """One row's choices (token ids after the context) and each choice token's log-probability and greedy flag."""

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


def score_request(request_id: int, context: list[int], choices: list[list[int]], namespace: str = "") -> Request:
    """The context request of a row, carrying the children that fork after it (choices of one token need none)."""
    scores = ChoiceScores(len(context), choices, [np.full(len(c), np.nan) for c in choices],
                          [np.zeros(len(c), bool) for c in choices], 0)
    parent = Request(request_id, context, SCORE_SAMPLING, namespace, score=scores)
    for index, choice in enumerate(choices):
        if len(choice) > 1:
            parent.forks.append(Request(request_id, context + choice[:-1], SCORE_SAMPLING, namespace,
                                        score=scores, choice_index=index))
    scores.pending = len(parent.forks)
    scores.context = parent
    return parent


@dataclass
class ScoreRows:
    """The flat-batch rows whose logits score a choice token this step, and where each result goes."""

    rows: np.ndarray  # [E] int64 rows of the flat batch
    targets: np.ndarray  # [E] int64 the choice token each row's logits score
    owners: list[tuple[ChoiceScores, int, int]]  # (row's scores, choice, token index within the choice)

    def record(self, logits: torch.Tensor) -> None:
        """Log-probability and greedy flag of every target, in one pass on the device and one host copy."""
        targets = torch.from_numpy(self.targets).to(logits.device)
        chosen = logits.gather(1, targets[:, None]).squeeze(1)
        logprob = chosen.double() - logits.logsumexp(-1).double()  # float32 scratch: [E, vocab] may be large
        greedy = (logits.argmax(-1) == targets).double()
        values = torch.stack([logprob, greedy]).cpu().numpy()
        for (scores, choice, token), value, flag in zip(self.owners, values[0], values[1]):
            scores.logprobs[choice][token] = value
            scores.greedy[choice][token] = bool(flag)


def score_rows(chunks: list[ScheduledChunk], query_start: np.ndarray) -> ScoreRows | None:
    """The step's scoring rows: the last position of each context finished now (once per choice: it scores every
    choice's first token) and each child's positions from the context's end on; None when there are none."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[ChoiceScores, int, int]] = []
    for chunk, begin in zip(chunks, query_start.tolist()):
        request = chunk.request
        scores = request.score
        if scores is None:
            continue
        start = request.num_computed_tokens
        stop = start + chunk.num_tokens
        if request.choice_index < 0:
            if stop == request.num_tokens:
                for index, choice in enumerate(scores.choices):
                    rows.append(begin + chunk.num_tokens - 1)
                    targets.append(choice[0])
                    owners.append((scores, index, 0))
            continue
        choice = scores.choices[request.choice_index]
        for position in range(max(start, scores.context_len), stop):
            token = position + 1 - scores.context_len
            rows.append(begin + position - start)
            targets.append(choice[token])
            owners.append((scores, request.choice_index, token))
    if not rows:
        return None
    return ScoreRows(np.array(rows, np.int64), np.array(targets, np.int64), owners)


def finish_scored(request: Request) -> Request | None:
    """A context (its children forked) or a child is computed; returns the row's context request once every
    choice is scored, its cached count then the row's: prompt and choice tokens whose KV this row did not compute."""
    scores = request.score
    if request.choice_index >= 0:
        scores.computed_choice_tokens += request.num_prompt_tokens - (request.num_cached_tokens or 0)
        scores.pending -= 1
    if scores.pending or scores.context.forks:
        return None
    context = scores.context
    computed = context.num_prompt_tokens - (context.num_cached_tokens or 0) + scores.computed_choice_tokens
    context.num_cached_tokens = context.num_row_prompt_tokens - computed
    context.finish_reason = "stop"  # INTERFACE.md's values: a scored row ended normally
    return context
