"""The engine loop: schedule a step, run it, sample, fork, finish requests, record statistics.

One forward pass serves four kinds of rows: sampled rows (one per sequence whose prompt is done and that samples),
the rows whose logits readouts read (a request's own positions: task=score's choices), the rows whose final-norm
hidden states state readouts read (task=embed, task=classify: no LM head runs for them), and the
log-probabilities of sampled tokens where asked. A request that samples nothing is done when its prompt is.
A parent whose prompt completes in a step forks its children right after it: n-sample children draw their first
token from the parent's logits of this very step, so the prompt is computed once for all of them.

The overlapped loop (`EngineConfig.overlap`, on CUDA; the anchors are vLLM's async scheduling and SGLang's overlap
scheduler): on an H200 a 511-sequence decode step took 7.1 ms, 2.1 ms of it host work (schedule 0.83, prepare
0.65, bookkeeping 0.61) while the GPU waited. Here the host schedules and prepares step N+1 while the device runs
step N, whose sampled tokens stay on the device: each sampled request holds PENDING_TOKEN as its last output and
step N+1's decodes gather their input ids on the device from step N's token tensor. Only after launching step N+1
does the host read step N's tokens (a non-blocking copy into pinned memory and an event) and do their bookkeeping:
append, stop checks, finishes. So an end is learnt a step late: a request that ended on step N's token was already
in step N+1, whose token for it is dropped and whose KV write goes to blocks it has given back (later steps that
reuse them run after it on the stream). An end by length is known when a step is launched: such a request gives its
blocks back then, and no later step holds it. The loop runs only where all a step needs of its logits is the
tokens: no grammar, readouts, logprobs or forks to come; otherwise the in-flight step lands first and the step runs
synchronously. It gives the same tokens as the synchronous loop (tests/test_overlap.py).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from batchprefill.engine.block_pool import BlockPool
from batchprefill.engine.config import EngineConfig
from batchprefill.engine.counters import EngineCounters, StepStats
from batchprefill.engine.input_batch import ForwardInputs
from batchprefill.engine.logprobs import append_logprobs, top_logprobs
from batchprefill.engine.model_runner import ModelRunner, TokenCopy, say_nothing
from batchprefill.engine.readout import StepReads, step_reads, step_states
from batchprefill.engine.request import PENDING_TOKEN, Request, Status
from batchprefill.engine.sampler import fork_sampling
from batchprefill.engine.scheduler import Scheduler
from batchprefill.engine.scheduler_output import SchedulerOutput
from batchprefill.model.decoder import DecoderModel

if TYPE_CHECKING:  # xgrammar loads only for jobs that can be constrained
    from batchprefill.engine.structured import StructuredOutputs


@dataclass
class InFlight:
    """The overlapped loop's last launched step, whose tokens the host has not read."""

    requests: list[Request | None]  # per sampled row, the request whose PENDING_TOKEN it fills (None: dropped)
    tokens: torch.Tensor  # on the device: the next step's decodes gather their input ids from it
    copy: TokenCopy
    may_end: np.ndarray  # per sampled row: it may end whatever its token (Engine._may_end)


class Engine:
    def __init__(self, model: DecoderModel, config: EngineConfig, detokenize: Callable[[list[int]], str],
                 model_scope: tuple, kv_dtype: torch.dtype, device: torch.device,
                 structured: StructuredOutputs | None = None, on_phase: Callable[[str], None] = say_nothing):
        """`model_scope`: everything about the model that changes KV for the same tokens (the cache's scope).
        `structured`: structured outputs, for an engine whose requests may be constrained; None costs nothing.
        `on_phase`: told what start-up does on a GPU (compiling kernels, capturing graphs), for the progress bar."""
        settings = config.settings
        self.config = config
        self.detokenize = detokenize
        self.eos = set(model.config.eos_token_ids)
        self.eos_ids = np.array(sorted(self.eos), dtype=np.int64)
        self.max_positions = model.config.max_positions
        self.capacity = config.num_blocks * settings.block_size  # KV slots: what no request may exceed
        self.pool = BlockPool(config.num_blocks)
        self.scheduler = Scheduler(self.pool, settings, model_scope)
        self.kv_dtype = kv_dtype
        self.runner = ModelRunner(model, config.num_blocks, settings.block_size, kv_dtype, device,
                                  config.padded_decode, settings.max_num_seqs, on_phase)
        self.counters = EngineCounters()
        self.rejected: list[Request] = []  # requests that can never fit the pool, returned by the next step
        self.structured = structured
        # Set by the first request that asks: until then no step looks for forks, readout rows or logprobs.
        self.forking = False
        self.readouts = False
        self.state_readouts = False
        self.logprobs = False
        self.in_flight: InFlight | None = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Give back the KV pool and the decode graphs now, not when the garbage collector next finds them: a Runner
        running several jobs on one GPU, or lm-eval calling us per task, needs each job's memory back before the
        next one sizes its pool (on the first H200 run, 83 GiB stayed held after `del engine` until `gc.collect()`).
        The engine cannot run after this; its counters stay readable."""
        self.runner.close()

    def add(self, request: Request) -> None:
        need = max(r.num_prompt_tokens + r.sampling.max_tokens for r in (request, *request.forks))
        self.forking |= bool(request.forks)
        self.readouts |= request.readout is not None
        self.state_readouts |= request.readout is not None and request.readout.states is not None
        self.logprobs |= request.sampling.logprobs is not None  # 0: the sampled token's alone
        if need > self.capacity:
            request.error = (f"needs up to {need} KV slots (prompt + sampling.max_tokens, or context + choice) "
                             f"but the pool holds {self.capacity}; raise engine.kv_cache_tokens")
            self._reject_with_samples(request)
            return
        if request.sampling.constraint is not None:
            request.error = ("the engine was built without structured outputs" if self.structured is None
                             else self.structured.compile_error(request))
            if request.error is not None:
                self._reject_with_samples(request)
                return
        self.scheduler.add(request)

    def _reject(self, request: Request) -> None:
        self._finish(request, "error", "")
        self.rejected.append(request)

    def _reject_with_samples(self, request: Request) -> None:
        """A request that can never run, and its other samples (each a result row of its own), as error rows."""
        samples = [c for c in request.forks if c.readout is None]
        request.forks = []
        for rejected in (request, *samples):
            rejected.error = request.error
            self._reject(rejected)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.rejected) or self.in_flight is not None

    def step(self) -> list[Request]:
        """One forward pass; returns the requests that finished in it (in the overlapped loop: whose last token
        came from the step before it)."""
        if self.config.overlap and self._may_overlap():
            return self._overlapped_step()
        clock = [time.perf_counter()]
        finished: list[Request] = []
        waited = self._land(finished)  # the overlapped loop's last step, before this one is scheduled
        step = self.scheduler.schedule()
        clock.append(time.perf_counter())
        finished, self.rejected = finished + self.rejected, []
        for request in step.preempted:
            self._release(request)
        if step.requests:
            inputs = self.runner.prepare(step)
            reads = step_reads(step.chunks, inputs.query_start) if self.readouts else None
            states = step_states(step.chunks, inputs.query_start) if self.state_readouts else None
            masks = self.structured.start(step, inputs.sampled) if self.structured is not None else None
            sampled = [step.requests[index] for index in inputs.sampled.tolist()]
            clock.append(time.perf_counter())
            if states is None and sampled and self._greedy_only(inputs, sampled, reads):
                tokens = self.runner.greedy_tokens(inputs)  # the forward, which picks them on the way
                logits = raw = tops = None
                clock.append(time.perf_counter())
            else:
                extra = None if reads is None else reads.rows
                if states is None and sampled:
                    logits = self.runner.forward(inputs, extra)
                else:  # hidden states read, or no row samples: the LM head makes only the logits read
                    logits, hidden = self.runner.forward_with_states(
                        inputs, extra, np.zeros(0, np.int64) if states is None else states.rows)
                    if states is not None:
                        states.record(hidden, self.runner.sequence_head)
                clock.append(time.perf_counter())
                num_sampled = len(inputs.logits_rows)
                if reads is not None:
                    reads.record(logits[num_sampled:])
                    logits = logits[:num_sampled]
                raw = logits
                if masks is not None and sampled:  # logprobs stay the raw distribution: kept apart when both asked
                    raw = logits.clone() if self.logprobs else logits
                    self.structured.mask(logits, masks)
                tokens = self.runner.sample(logits, inputs.sampling) if sampled else np.zeros(0, np.int64)
                tops = self._logprobs(raw, tokens, sampled) if sampled else None
            clock.append(time.perf_counter())
            self.scheduler.commit(step)
            if self.forking:
                self._fork(logits, raw, sampled, finished)
            if inputs.prefilled.size:
                self._prefilled([step.requests[index] for index in inputs.prefilled.tolist()], finished)
            if tops is None and self.structured is None:
                self._append_all(sampled, tokens, self._may_end(inputs), finished)
            else:
                self._append_each(sampled, tokens.tolist(), tops, finished)
        else:
            clock += clock[-1:] * 3
        self._record(step, clock, finished, waited, overlapped=False)
        return finished

    def _may_overlap(self) -> bool:
        """Whether this step may run overlapped: all the job's steps need of their logits is their tokens (no
        grammar masks them, no readout or logprob reads them) and no parent is left to fork children from them."""
        if self.structured is not None or self.readouts or self.logprobs:
            return False
        return not (self.forking and (self.scheduler.fork_slots or any(r.forks for r in self.scheduler.waiting)))

    def _overlapped_step(self) -> list[Request]:
        """Schedule, prepare and launch this step while the last one runs, then land the last one's tokens."""
        clock = [time.perf_counter()]
        step = self.scheduler.schedule()
        clock.append(time.perf_counter())
        finished, self.rejected = self.rejected, []
        for request in step.preempted:
            self._release(request)
        sampled: list[Request] = []
        if step.requests:
            inputs = self.runner.prepare(step)
            sampled = [step.requests[index] for index in inputs.sampled.tolist()]
            clock.append(time.perf_counter())
            previous = None if self.in_flight is None else self.in_flight.tokens
            if not sampled:  # a prefill-only step: no LM head
                self.runner.forward_with_states(inputs, None, np.zeros(0, np.int64))
                clock += [time.perf_counter()] * 2
            elif self.runner.fused_greedy and not (inputs.sampling.temperature > 0).any():
                tokens = self.runner.fused_greedy_on_device(inputs, previous)
                clock += [time.perf_counter()] * 2
            else:
                logits = self.runner.forward(inputs, previous=previous)
                clock.append(time.perf_counter())
                tokens = self.runner.sample_on_device(logits, inputs.sampling)
                clock.append(time.perf_counter())
            copy = self.runner.copy_tokens(tokens) if sampled else None
        else:
            clock += clock[-1:] * 3
        waited = self._land(finished)
        if step.requests:
            self.scheduler.commit(step)
            if inputs.prefilled.size:
                self._prefilled([step.requests[index] for index in inputs.prefilled.tolist()], finished)
            if sampled:
                self.in_flight = self._pend(sampled, tokens, copy, self._may_end(inputs))
        self._record(step, clock, finished, waited, overlapped=True)
        return finished

    def _pend(self, sampled: list[Request], tokens: torch.Tensor, copy: TokenCopy, may_end: np.ndarray) -> InFlight:
        """Each sampled request still running holds PENDING_TOKEN until its token lands; one that ended on the last
        step's token (learnt just now) has its token dropped. One whose output ends by length at this token is
        done now: it gives its blocks back and no later step schedules it (only the `may_end` rows can)."""
        waiting: list[Request | None] = []
        finished = Status.FINISHED
        for index, request in enumerate(sampled):
            if request.status is finished:
                waiting.append(None)
                continue
            request.output_token_ids.append(PENDING_TOKEN)
            request.pending_sample = index
            waiting.append(request)
        for index in np.flatnonzero(may_end).tolist():
            request = waiting[index]
            if request is not None and (len(request.output_token_ids) >= request.sampling.max_tokens
                                        or request.num_tokens >= self.max_positions):
                self._done(request)
        return InFlight(waiting, tokens, copy, may_end)

    def _land(self, finished: list[Request]) -> float:
        """Read the in-flight step's tokens into their requests and finish those that may end (an EOS token, or
        the step's `may_end`: as `_append_all` does); returns the milliseconds the host waited for the device."""
        flight, self.in_flight = self.in_flight, None
        if flight is None:
            return 0.0
        started = time.perf_counter()
        tokens = flight.copy.wait()
        waited = (time.perf_counter() - started) * 1e3
        values = tokens.tolist()
        for request, token in zip(flight.requests, values):
            if request is not None:
                request.output_token_ids[-1] = token
                request.pending_sample = -1
        for index in np.flatnonzero(flight.may_end | np.isin(tokens, self.eos_ids)).tolist():
            request = flight.requests[index]
            if request is not None and self._ends(request, values[index]):
                self._done(request)  # a second time for one done by length when launched: nothing more happens
                finished.append(request)
        return waited

    def _prefilled(self, requests: list[Request], finished: list[Request]) -> None:
        """Requests that sample nothing and whose prompt this step completed: each forks its children (they share
        its blocks; copies of its partial block are made before the next pass), then is done, its readout saying
        which request returns as the row's result (a request without a readout ends with `length`)."""
        copies = []
        for request in requests:
            if request.forks:
                copies += self.scheduler.fork(request)
        self.runner.copy_blocks(copies)
        for request in requests:
            self._done(request)
            if request.readout is None:
                self._finish(request, "length", "")
                finished.append(request)
            elif (row := request.readout.finish(request)) is not None:
                finished.append(row)

    def _may_end(self, inputs: ForwardInputs) -> np.ndarray:
        """Per sampled row: whether it may end whatever token it samples (`ForwardInputs.may_end`, or its next token
        reaches the position limit: the row's sequence is its computed tokens and that one)."""
        return inputs.may_end | (inputs.seq_lens[inputs.sampled] + 1 >= self.max_positions)

    def _append_all(self, requests: list[Request], tokens: np.ndarray, may_end: np.ndarray,
                    finished: list[Request]) -> None:
        """A step's tokens when no row is constrained or records logprobs (the usual decode step): one tight loop
        appends them, and only the rows that may end now (an EOS token, or `may_end`: stop strings to look for, a
        length limit reached), found with numpy, go through `_ends`, which decides as `_append` always did. At
        1,024 decodes a step (benchmarks/cpu/host_overhead.py --seqs 1024 --stub-forward) testing every row in the
        loop made bookkeeping 0.37 ms."""
        values = tokens.tolist()
        for request, token in zip(requests, values):
            request.output_token_ids.append(token)
        for index in np.flatnonzero(may_end | np.isin(tokens, self.eos_ids)).tolist():
            request = requests[index]
            if self._ends(request, values[index]):
                self._done(request)
                finished.append(request)

    def _append_each(self, sampled: list[Request], tokens: list[int], tops: np.ndarray | None,
                     finished: list[Request]) -> None:
        """A step's tokens, row by row, with what logprobs and grammars add."""
        verdicts = self.structured.advance(sampled, tokens) if self.structured is not None else None
        for position, (request, token) in enumerate(zip(sampled, tokens)):
            if tops is not None and request.sampling.logprobs is not None:
                append_logprobs(request.output_logprobs, request.output_top_logprobs, tops[position],
                                request.sampling.logprobs)
            if self._append(request, token) or (verdicts is not None and verdicts[position] is not None
                                                and self._grammar_ends(request, token, verdicts[position])):
                self._done(request)
                finished.append(request)

    def _greedy_only(self, inputs: ForwardInputs, sampled: list[Request], reads: StepReads | None) -> bool:
        """Whether all this step needs of its logits is each sampled row's greedy token: then the runner may pick
        them without making the logits (on the CPU, 256 rows x 49,152 float32 are 50 MB written and read back;
        see LMHead). Decided once per step, from flags the engine already keeps: not when a row draws
        (temperature > 0), when any request of the job asks for logprobs, when the engine can constrain outputs
        (the grammar masks the logits), when readouts read rows, or when a parent forks children now that draw
        their first token from its logits."""
        if reads is not None or self.structured is not None or self.logprobs:
            return False
        if (inputs.sampling.temperature > 0).any():
            return False
        return not (self.forking and any(r.forks and not r.output_token_ids for r in sampled))

    def _done(self, request: Request) -> None:
        self.scheduler.finish(request)
        self._release(request)

    def _logprobs(self, logits: torch.Tensor, tokens: np.ndarray, requests: list[Request]) -> np.ndarray | None:
        """The step's `top_logprobs` rows (one per sampled row) when any of them asked, with the largest k asked."""
        if not self.logprobs:
            return None
        k = max((r.sampling.logprobs for r in requests if r.sampling.logprobs is not None), default=None)
        return top_logprobs(logits, torch.from_numpy(tokens), k) if k is not None else None

    def _fork(self, logits: torch.Tensor, raw: torch.Tensor, sampled: list[Request], finished: list[Request]) -> None:
        """Fork the children of every parent whose prompt this step completed. Sample children take their first
        token from their parent's logits row (masked by the grammar where there is one), drawn from their own
        random streams, in one batched call; their logprobs come from the raw row, like every other token's."""
        parents = [(position, r) for position, r in enumerate(sampled) if r.forks and not r.output_token_ids]
        if not parents:
            return
        copies, rows, children = [], [], []
        for position, parent in parents:
            samples = [c for c in parent.forks if c.readout is None]
            copies += self.scheduler.fork(parent)
            rows += [position] * len(samples)
            children += samples
        self.runner.copy_blocks(copies)
        if not children:
            return
        parent_rows = torch.tensor(rows, device=logits.device)
        parent_logits = logits[parent_rows]
        tokens = self.runner.sample(parent_logits, fork_sampling(children))
        tops = self._logprobs(parent_logits if raw is logits else raw[parent_rows], tokens, children)
        for position, (child, token) in enumerate(zip(children, tokens.tolist())):
            if tops is not None and child.sampling.logprobs is not None:
                append_logprobs(child.output_logprobs, child.output_top_logprobs, tops[position],
                                child.sampling.logprobs)
            if self._append(child, token):
                self._done(child)
                finished.append(child)

    def generate(self, requests: Iterable[Request], lookahead: int | None = None) -> Iterator[Request]:
        """Feed requests in their given order, keeping only `lookahead` waiting, and yield them as they finish.

        While it runs, what the process held before (modules, the model, the tokenizer: about 274,000 objects once
        the shipped model is loaded) is frozen out of the cyclic garbage collector: a full collection over them took
        120-175 ms on a loaded 2-core machine, a pause that lands in whichever step triggers it (vLLM freezes its
        start-up heap too). They are thawed when it ends."""
        lookahead = lookahead or 2 * self.config.settings.max_num_seqs
        pending = iter(requests)
        exhausted = False
        gc.freeze()
        try:
            while True:
                while not exhausted and len(self.scheduler.waiting) < lookahead:
                    request = next(pending, None)
                    if request is None:
                        exhausted = True
                    else:
                        self.add(request)
                if not self.has_work():
                    return
                yield from self.step()
        finally:
            gc.unfreeze()

    def _release(self, request: Request) -> None:
        if self.structured is not None:
            self.structured.release(request)
        self.runner.release(request)

    def _grammar_ends(self, request: Request, token: int, reason: str) -> bool:
        """A constrained request also ends when its grammar does (with sampling.ignore_eos) or rejects a token."""
        if reason == "error":
            request.error = f"the grammar rejected sampled token {token}"
        return self._finish(request, reason, self.detokenize(request.output_token_ids))

    def _append(self, request: Request, token: int) -> bool:
        """Add a sampled token and decide whether the request is done."""
        request.output_token_ids.append(token)
        return self._ends(request, token)

    def _ends(self, request: Request, token: int) -> bool:
        """Whether the request is done now that `token` ends its output (finishing it if so)."""
        params = request.sampling
        if token in self.eos and not params.ignore_eos:
            return self._finish(request, "stop", self.detokenize(request.output_token_ids))
        if params.stop and self._stop_in_tail(request):
            text = self.detokenize(request.output_token_ids)
            return self._finish(request, "stop", text[: min(text.find(s) for s in params.stop if s in text)])
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_positions:
            return self._finish(request, "length", self.detokenize(request.output_token_ids))
        return False

    def _stop_in_tail(self, request: Request) -> bool:
        """Whether a stop string now ends the output: only the last tokens are decoded, enough for the longest
        stop string even at one byte per token (4 per character), so the check costs the same at every length."""
        params = request.sampling
        window = 4 * max(map(len, params.stop)) + 4
        tail = self.detokenize(request.output_token_ids[-window:])
        return any(s in tail for s in params.stop)

    @staticmethod
    def _finish(request: Request, reason: str, text: str) -> bool:
        request.finish_reason = reason
        request.output_text = text
        return True

    def _record(self, step: SchedulerOutput, clock: list[float], finished: list[Request], waited: float,
                overlapped: bool) -> None:
        """The step's statistics row; `clock` holds its start and the end of schedule, prepare, forward, sample;
        `waited`: the milliseconds the host waited on the device for the overlapped loop's last step's tokens,
        within the bookkeeping of an overlapped step and before the schedule of a synchronous one."""
        counts = self.pool.counts()
        self.counters.prefill_tokens += step.num_prefill_tokens
        self.counters.decode_tokens += step.num_decode_tokens
        self.counters.finished_prompt_tokens += sum(r.num_row_prompt_tokens for r in finished)
        self.counters.finished_cached_tokens += sum(r.num_cached_tokens or 0 for r in finished)
        now = time.perf_counter()
        schedule, prepare, forward, sample = (1e3 * (b - a) for a, b in zip(clock, clock[1:]))
        bookkeeping = (now - clock[-1]) * 1e3
        if overlapped:
            bookkeeping -= waited
        else:
            schedule -= waited
        self.counters.steps.append(StepStats(
            step=len(self.counters.steps), num_decode_tokens=step.num_decode_tokens,
            num_prefill_tokens=step.num_prefill_tokens, num_seqs=len(step.requests),
            active_blocks=counts.active, reclaimable_blocks=counts.reclaimable, free_blocks=counts.free,
            duration_ms=(now - clock[0]) * 1e3, schedule_ms=schedule, prepare_ms=prepare, forward_ms=forward,
            sample_ms=sample, bookkeeping_ms=bookkeeping, token_wait_ms=waited,
            evicted_blocks=self.pool.evictions,
            preemptions=self.scheduler.preemptions, finished_prompt_tokens=self.counters.finished_prompt_tokens,
            finished_cached_tokens=self.counters.finished_cached_tokens,
        ))
