"""A request as the engine sees it: token ids, the blocks holding its KV, and its sampling state."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np

from batchprefill.sampling_params import SamplingParams

PENDING_TOKEN = -1  # an output token sampled on the device that the host has not read yet


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    namespace: str = ""
    adapter: int = 0  # its LoRA adapter's index (model.adapters.adapter_index); 0: the base model
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained keys of full blocks, grown lazily
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens reused at first admission
    finish_reason: str | None = None
    output_text: str = ""
    error: str | None = None
    sample_index: int = 0  # which of a prompt's samples this is: part of its random stream's key
    batch_row: int = -1  # its row in the model runner's persistent batch while it runs, else -1
    # With the overlapped loop (engine.py): its last output token is still on the device, at this index of the
    # in-flight step's sampled tokens (its place in output_token_ids holds PENDING_TOKEN until it lands); else -1.
    pending_sample: int = -1
    # Children to fork once this request's prompt is computed: they share its full blocks and copy its partial one.
    forks: list[Request] = field(default_factory=list)
    readout: Readout | None = None  # what it reads from its prompt's logits instead of sampling (task=score)
    output_logprobs: list[float] = field(default_factory=list)  # with sampling.logprobs: one per output token
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # The request before it in run order when the order stage found their first `donor_blocks` full blocks
    # equal (same tokens, same namespace): the scheduler then copies those block keys instead of hashing them.
    # On benchmarks/cpu/host_overhead.py (1,500 shared tokens per prompt) hashing was most of the scheduler's time.
    prefix_donor: Request | None = None
    donor_blocks: int = 0
    # False for a request that reads every prompt position's hidden state (mean pooling): cached blocks hold KV,
    # not those states, so it takes no prefix from the cache and computes its whole prompt.
    reuse_prefix: bool = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_row_prompt_tokens(self) -> int:
        """Prompt tokens as the row reports them: a readout may count its row's other requests too."""
        return self.num_prompt_tokens if self.readout is None else self.readout.row_prompt_tokens(self)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self, start: int, stop: int) -> list[int]:
        """Token ids start..stop of prompt + output, copying only that span (decodes read one token)."""
        prompt, size = self.prompt_token_ids, len(self.prompt_token_ids)
        if stop <= size:
            return prompt[start:stop]
        if start >= size:
            return self.output_token_ids[start - size : stop - size]
        return prompt[start:] + self.output_token_ids[: stop - size]

    @property
    def is_decoding(self) -> bool:
        """All tokens but the last sampled one are in the cache: the next step computes one token."""
        return self.num_computed_tokens == self.num_tokens - 1 and bool(self.output_token_ids)


class Readout(Protocol):
    """What a request reads from the logits of its own prompt positions instead of sampling after them (task=score:
    each choice token's log-probability). Each step the engine asks every request that carries one which of the
    step's positions it reads, computes all their targets' log-probabilities in one pass, and hands them back.

    A request with a readout samples nothing (its max_tokens is 0): it is done once its prompt is computed, and
    its children that carry one are computed for their readouts, never sampled and never rows of their own.
    A readout whose `states` is set reads hidden states as well (StateReadout)."""

    # None, or what it reads of the final-norm hidden states: "hidden" (the states) or "head" (the model's
    # sequence head on them: a classifier's logits).
    states: str | None

    def select(self, request: Request, start: int, stop: int) -> tuple[list[int], list[int]]:
        """Of `request`'s positions start..stop (those this step computes), the ones whose logits it reads, and
        for each the token whose log-probability it reads there."""
        ...

    def record(self, positions: list[int], logprobs: np.ndarray, greedy: np.ndarray) -> None:
        """Each selected token's log-probability and whether it is the logits' argmax, in `select`'s order."""
        ...

    def finish(self, request: Request) -> Request | None:
        """`request`'s prompt is computed (its children forked): the request that returns as its row's result now,
        or None while the row's other requests still compute."""
        ...

    def row_prompt_tokens(self, request: Request) -> int:
        """The prompt tokens `request`'s row reports (task=score: the context and every choice)."""
        ...


class StateReadout(Readout, Protocol):
    """A readout of final-norm hidden states (task=embed, task=classify): no logits over the vocabulary are made
    for its positions, only the hidden rows (or the sequence head's outputs) it selects."""

    def select_states(self, request: Request, start: int, stop: int) -> list[int]:
        """Of `request`'s positions start..stop (computed this step), the ones whose states it reads."""
        ...

    def record_states(self, positions: list[int], values: np.ndarray) -> None:
        """Float32 `[len(positions), width]`: the hidden states (or head outputs) at `positions`, in order."""
        ...


def with_samples(request: Request) -> Request:
    """The request as sample 0 of `sampling.n`, carrying samples 1..n-1 as children that fork after its prompt."""
    request.forks = [Request(request.request_id, request.prompt_token_ids, request.sampling, request.namespace,
                             request.adapter, sample_index=index) for index in range(1, request.sampling.n)]
    return request
