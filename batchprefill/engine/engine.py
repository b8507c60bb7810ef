"""The engine loop: schedule a step, run it, sample, finish requests, record statistics."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from batchprefill.engine.block_pool import BlockPool, scope_key
from batchprefill.engine.model_runner import ModelRunner
from batchprefill.engine.request import Request
from batchprefill.engine.sampler import sample
from batchprefill.engine.scheduler import Scheduler
from batchprefill.model.decoder import DecoderModel


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    max_batched_tokens: int = 2048
    max_num_seqs: int = 256
    num_blocks: int = 1024
    prefix_caching: bool = True
    cache_namespace: str = "default"
    reserve_output_blocks: bool = True  # admit a request only if its prompt and max_tokens outputs fit
    padded_decode: str = "off"  # "graphs" on CUDA: decode-only steps replay captured CUDA graphs


@dataclass
class StepRecord:
    step: int
    num_decode_tokens: int
    num_prefill_tokens: int
    num_seqs: int
    active_blocks: int
    reclaimable_blocks: int
    free_blocks: int
    duration_ms: float


@dataclass
class EngineCounters:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: list[StepRecord] = field(default_factory=list)


class Engine:
    def __init__(self, model: DecoderModel, config: EngineConfig, decode: Callable[[list[int]], str],
                 model_scope: tuple, kv_dtype: torch.dtype, device: torch.device):
        self.config = config
        self.decode = decode
        self.model_scope = model_scope
        self.eos = set(model.config.eos_token_ids)
        self.max_positions = model.config.max_positions
        self.pool = BlockPool(config.num_blocks)
        self.root_keys: dict[str, bytes] = {}
        self.scheduler = Scheduler(self.pool, config.block_size, config.max_batched_tokens, config.max_num_seqs,
                                   config.prefix_caching, self.root_keys, config.reserve_output_blocks)
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, kv_dtype, device,
                                  config.padded_decode, config.max_num_seqs)
        self.counters = EngineCounters()
        self.rejected: list[Request] = []  # requests that can never fit the pool, returned by the next step

    def add(self, request: Request) -> None:
        capacity = self.config.num_blocks * self.config.block_size
        if request.num_prompt_tokens + request.sampling.max_tokens > capacity:
            request.error = (f"needs up to {request.num_prompt_tokens + request.sampling.max_tokens} KV slots "
                             f"(prompt + sampling.max_tokens) but the pool holds {capacity}; "
                             "raise engine.kv_cache_tokens")
            self._finish(request, "error", "")
            self.rejected.append(request)
            return
        namespace = request.namespace
        if namespace not in self.root_keys:
            self.root_keys[namespace] = scope_key(*self.model_scope, self.config.cache_namespace, namespace)
        self.scheduler.add(request)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.rejected)

    def step(self) -> list[Request]:
        """One forward pass; returns the requests that finished in it."""
        started = time.perf_counter()
        step = self.scheduler.schedule()
        finished, self.rejected = self.rejected, []
        if step.chunks:
            logits, sampled = self.runner.run(step)
            self.scheduler.commit(step)
            requests = [step.chunks[i].request for i in sampled]
            for request, token in zip(requests, sample(logits, requests)):
                if self._append(request, token):
                    self.scheduler.finish(request)
                    finished.append(request)
        self._record(step, started)
        return finished

    def generate(self, requests: Iterable[Request], lookahead: int | None = None) -> Iterator[Request]:
        """Feed requests in their given order, keeping only `lookahead` waiting, and yield them as they finish."""
        lookahead = lookahead or 2 * self.config.max_num_seqs
        pending = iter(requests)
        exhausted = False
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

    def _append(self, request: Request, token: int) -> bool:
        """Add a sampled token and decide whether the request is done."""
        request.output_token_ids.append(token)
        params = request.sampling
        if token in self.eos and not params.ignore_eos:
            return self._finish(request, "stop", self.decode(request.output_token_ids))
        if params.stop:
            text = self.decode(request.output_token_ids)
            hits = [text.find(s) for s in params.stop if s in text]
            if hits:
                return self._finish(request, "stop", text[: min(hits)])
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_positions:
            return self._finish(request, "length", self.decode(request.output_token_ids))
        return False

    @staticmethod
    def _finish(request: Request, reason: str, text: str) -> bool:
        request.finish_reason = reason
        request.output_text = text
        return True

    def _record(self, step, started: float) -> None:
        counts = self.pool.counts()
        self.counters.prefill_tokens += step.num_prefill_tokens
        self.counters.decode_tokens += step.num_decode_tokens
        self.counters.steps.append(StepRecord(
            step=len(self.counters.steps), num_decode_tokens=step.num_decode_tokens,
            num_prefill_tokens=step.num_prefill_tokens, num_seqs=len(step.chunks),
            active_blocks=counts.active, reclaimable_blocks=counts.reclaimable, free_blocks=counts.free,
            duration_ms=(time.perf_counter() - started) * 1e3,
        ))
