"""The LM head: final hidden rows to logits, or straight to each row's greedy token.

A decode step of 256 sequences over SmolLM2's 49,152-token vocabulary makes 256 x 49,152 float32 logits,
50 MB: more than the cache holds, so the projection writes them out to memory (in fresh pages: above glibc's
largest mmap threshold) and the greedy argmax reads them back. On benchmarks/cpu/host_overhead.py that read was
3.5 ms of the 3.9 ms sample phase, and the write most of the LM head's time inside the forward.

On the CPU the head is therefore held as vocabulary chunks of `VOCAB_CHUNK` rows of the weight, each prepacked.
`greedy_tokens` computes one chunk's logits at a time (256 x 4,096 float32, 4 MB, cache-resident), takes their
row maxima, and keeps a running (largest value, first index) per row: the full logits never exist. `logits`
runs the very same per-chunk ops and copies each chunk into the full tensor, so the two paths see the same
values bit for bit and the pick equals argmax(logits), ties included (the first maximum, as numpy and torch
break them). Holding only the chunks keeps the head's memory as it was (one prepacked copy). The price is on the
full-logits path (sampled, logprobs, grammar and scoring steps): one more copy of each chunk, measured at 62.6
against 49.7 ms for 256 rows x hidden 64 -> 49,152 and 172 against 166 ms at SmolLM2's hidden 576 (one
thread, interleaved medians, CPU time); the pick itself took 24.5 against 53.3 ms (hidden 64) and 146 against
168 ms (hidden 576) for the unchunked head plus argmax. Keeping an unchunked copy beside the chunks would
remove that price at twice the head's memory.

On a GPU the head is one matrix and the pick an argmax on the device: the logits never leave it there.
"""

from __future__ import annotations

import numpy as np
import torch

from batchprefill.kernels.linear import Linear

# Columns of logits per chunk on the CPU. 2,048 to 16,384 all took 19-21 ms for 256 rows x 49,152 x hidden 64
# against 43 ms for the unchunked head plus argmax (one thread); 4,096 keeps a 256-row chunk at 4 MB.
VOCAB_CHUNK = 4096


class LMHead:
    """`logits(x)`: float32 `[R, vocab]`, with the final softcap where the family has one; `greedy_tokens(x)`:
    int64 `[R]`, equal to `logits(x).argmax(-1)`."""

    def __init__(self, weight: torch.Tensor, softcap: float | None = None, chunk: int = VOCAB_CHUNK):
        self.vocab = weight.shape[0]
        self.softcap = softcap or None
        size = chunk if weight.device.type == "cpu" else self.vocab
        self.starts = list(range(0, self.vocab, size))
        self.parts = [Linear(weight[start : start + size]) for start in self.starts]

    def _part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of one vocabulary chunk, softcapped: the one place both paths get their values from.

        The softcap is applied here for the pick too, although tanh is monotonic: in float32 it can round two
        different raw logits near the top to the same capped value, and argmax over the capped logits then takes
        the first of them, not the larger. On a cache-resident chunk the tanh costs little next to the matmul."""
        logits = self.parts[index](x).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self._part(0, x)
        out = torch.empty(x.shape[0], self.vocab, dtype=torch.float32, device=x.device)
        for index, start in enumerate(self.starts):
            part = self._part(index, x)
            out[:, start : start + part.shape[1]] = part
        return out

    def greedy_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax without the full logits on the CPU (numpy's argmax: 4x torch's on a CPU row)."""
        if x.device.type != "cpu":
            return self.logits(x).argmax(-1)
        rows = np.arange(x.shape[0])
        best = tokens = None
        for index, start in enumerate(self.starts):
            values = self._part(index, x).numpy()
            top = values.argmax(-1)
            peak = values[rows, top]
            if best is None:
                best, tokens = peak, top
                continue
            # Strictly larger wins, so an equal maximum keeps the earlier chunk's (lower) index. A NaN counts as
            # the maximum, the first one winning, as in numpy's argmax.
            wins = (peak > best) | (np.isnan(peak) & ~np.isnan(best))
            best = np.where(wins, peak, best)
            tokens = np.where(wins, top + start, tokens)
        return torch.from_numpy(np.asarray(tokens, dtype=np.int64))
