"""A step's readout rows: the flat-batch positions whose logits requests read instead of sampling (request.Readout),
and the one pass that turns those logits into each target token's log-probability and greedy flag; and the rows
whose final-norm hidden states state readouts read (request.StateReadout), with the sequence head on those that
ask for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from batchprefill.engine.request import Request
from batchprefill.engine.scheduler_output import ScheduledChunk


@dataclass
class StepReads:
    """The flat-batch rows whose logits a readout reads this step, and which readout each value goes back to."""

    rows: np.ndarray  # [E] int64 rows of the flat batch
    targets: np.ndarray  # [E] int64 the token each row's logits are read for
    readers: list[tuple[Request, list[int], int]]  # (request, the positions it selected, its first entry in rows)

    def record(self, logits: torch.Tensor) -> None:
        """Log-probability and greedy flag of every target, in one pass on the device and one host copy."""
        targets = torch.from_numpy(self.targets).to(logits.device)
        chosen = logits.gather(1, targets[:, None]).squeeze(1)
        logprob = chosen.double() - logits.logsumexp(-1).double()  # float32 scratch: [E, vocab] may be large
        greedy = (logits.argmax(-1) == targets).double()
        values = torch.stack([logprob, greedy]).cpu().numpy()
        for request, positions, begin in self.readers:
            stop = begin + len(positions)
            request.readout.record(positions, values[0, begin:stop], values[1, begin:stop] != 0)


def step_reads(chunks: list[ScheduledChunk], query_start: np.ndarray) -> StepReads | None:
    """What the step's readouts select, chunk by chunk in the flat batch's order; None when they select nothing."""
    rows: list[int] = []
    targets: list[int] = []
    readers: list[tuple[Request, list[int], int]] = []
    for chunk, begin in zip(chunks, query_start.tolist()):
        request = chunk.request
        if request.readout is None:
            continue
        start = request.num_computed_tokens
        positions, tokens = request.readout.select(request, start, start + chunk.num_tokens)
        if positions:
            readers.append((request, positions, len(rows)))
            rows += [begin + position - start for position in positions]
            targets += tokens
    if not rows:
        return None
    return StepReads(np.array(rows, np.int64), np.array(targets, np.int64), readers)


@dataclass
class StepStates:
    """The flat-batch rows whose final-norm hidden states state readouts read this step (request.StateReadout)."""

    rows: np.ndarray  # [E] int64 rows of the flat batch
    readers: list[tuple[Request, list[int], int]]  # (request, the positions it selected, its first entry in rows)

    def record(self, states: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Hand each reader its rows: the hidden states, or `head` of them for readers that read the head, applied
        once to those rows together. One host copy each."""
        hidden = states.float().cpu().numpy()
        heads = [(r, p, b) for r, p, b in self.readers if r.readout.states == "head"]
        head_values = None
        if heads:
            picks = torch.from_numpy(np.concatenate([np.arange(b, b + len(p)) for _, p, b in heads]))
            head_values = head(states[picks.to(states.device)]).cpu().numpy()
        offset = 0
        for request, positions, begin in self.readers:
            if request.readout.states == "head":
                values, offset = head_values[offset : offset + len(positions)], offset + len(positions)
            else:
                values = hidden[begin : begin + len(positions)]
            request.readout.record_states(positions, values)


def step_states(chunks: list[ScheduledChunk], query_start: np.ndarray) -> StepStates | None:
    """What the step's state readouts select, chunk by chunk in the flat batch's order; None when nothing."""
    rows: list[int] = []
    readers: list[tuple[Request, list[int], int]] = []
    for chunk, begin in zip(chunks, query_start.tolist()):
        request = chunk.request
        readout = request.readout
        if readout is None or readout.states is None:
            continue
        start = request.num_computed_tokens
        positions = readout.select_states(request, start, start + chunk.num_tokens)
        if positions:
            readers.append((request, positions, len(rows)))
            rows += [begin + position - start for position in positions]
    if not rows:
        return None
    return StepStates(np.array(rows, np.int64), readers)
