"""Turns a scheduled step into one flat forward pass over the paged KV pool, and samples its next tokens."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from batchprefill.engine.decode_graphs import PaddedDecode
from batchprefill.engine.input_batch import ForwardInputs, InputBatch
from batchprefill.engine.kv_cache import allocate_kv_caches
from batchprefill.engine.request import Request
from batchprefill.engine.sampler import SamplingBatch, argmax_for, sample, sample_on_device
from batchprefill.engine.scheduler_output import SchedulerOutput
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.lora import LoraStep
from batchprefill.model.decoder import DecoderModel

WARM_UP_LONG_CHUNK = 512  # a chunk this long takes the prefill kernel's 128-row tiles (TritonOps._choose_block_m)
COMPILING, CAPTURING = "compiling kernels", "capturing graphs"  # what `on_phase` hears of warm-up
WARM_UP_PHASES = (COMPILING, CAPTURING)


def say_nothing(phase: str) -> None:
    pass


def compiles_kernels(device: torch.device) -> bool:
    """Whether this device's first steps would compile kernels (Triton's, on a GPU): then start-up warms them."""
    return device.type == "cuda"


def warm_up_passes(block_size: int, long_chunk: int, decode_only: bool) -> list[tuple[list[int], list[int]]]:
    """The warm-up's steps as (query lengths, contexts): what a job's steps launch, so that no kernel variant
    compiles inside one (tests/test_start_up.py runs jobs and finds every variant they launch among these).
    - a chunk from scratch, a chunk after a cached context and two decodes that share no block;
    - a chunk beside two decodes that share two blocks (the shared-prefix decode of a mixed step: its first launch
      inside a job made one 8B step wait 92.5% of it on the host);
    - a `long_chunk`-token chunk (the prefill kernel's other tile);
    - with `decode_only` (decode-only steps run eagerly: no padded decode path, as with LoRA adapters or
      engine.cuda_graphs=false), two decode-only steps, one with two decodes sharing two blocks beside a third and
      one with none shared: without indexed chunk rows their kernels take other variants;
    - a 40-token chunk, a step of 17 to 64 rows: the LoRA kernel's tile follows the step's longest run of one
      adapter (up to 16, 64 and more tokens), and FP8 linears widen their weights in tiles of 16 rows up to 16 and
      of 64 up to 64 (a job whose decodes ran eagerly compiled the second inside a step without it).
    With adapters, the first sequence of each step runs the first adapter (`ModelRunner.warm_up`)."""
    size = block_size
    passes = [([5, 3, 1, 1], [0, size, 2 * size, 3]), ([3, 1, 1], [size, 2 * size, 2 * size]), ([long_chunk], [0])]
    if decode_only:
        passes += [([1, 1, 1], [2 * size, 2 * size, 3]), ([1, 1], [3, 5])]
    passes.append(([min(40, long_chunk)], [0]))
    return passes


class ModelRunner:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, padded_decode: str = "off", max_num_seqs: int = 256,
                 on_phase: Callable[[str], None] = say_nothing):
        """`padded_decode`: "off", "eager" (fixed padded buffers, no capture: for tests) or "graphs" (CUDA).
        `on_phase` hears what start-up is doing ("compiling kernels", "capturing graphs"): the progress bar."""
        self.model = model
        self.device = device
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(model.config, num_blocks, block_size, kv_dtype, device)
        self.batch = InputBatch(max_num_seqs, model.config.max_positions, block_size)
        self._staging = torch.empty(0, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._staged: torch.cuda.Event | None = None  # the last copy out of `_staging`
        self._argmax = argmax_for(device)
        self.decoder = None
        padded = padded_decode != "off" and not model.adapters  # the padded buffers and graphs hold no adapter deltas
        if compiles_kernels(device):
            on_phase(COMPILING)
            self.warm_up(decode_only=not padded)
        if padded:
            if padded_decode == "graphs":
                on_phase(CAPTURING)
            self.decoder = PaddedDecode(model, self.kv_caches, block_size, max_num_seqs, device,
                                        capture=padded_decode == "graphs")
        # Whether `greedy_tokens` lets the model pick without making the logits: on the CPU (where reading them
        # back was most of the sampler's time). A GPU's argmax stays on the device after the logits, as before,
        # and so does the padded decode path, whose buffers (and CUDA graphs) hold logits.
        self.fused_greedy = device.type == "cpu" and self.decoder is None

    def close(self) -> None:
        """Drop the KV pool and the padded decode buffers and graphs (`Engine.close`); on CUDA, hand the freed
        memory back to the device, so the next pool is sized from what is really free."""
        if self.decoder is not None:
            self.decoder.close()
        self.decoder = None
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def warm_up(self, long_chunk: int = WARM_UP_LONG_CHUNK, decode_only: bool = False) -> None:
        """Compile the kernels before the first step (on an H200 the first 3 steps of a fresh machine spent 5 s in
        Triton compiles): a greedy forward over each of `warm_up_passes`. Every block table is all block 0 and every
        slot -1, so nothing is written to the pool (the padded decode path warms its own kernels as it captures)."""
        size, longest = self.block_size, self.model.config.max_positions
        with_adapters = bool(self.model.adapters)
        for query_lens, contexts in warm_up_passes(size, min(long_chunk, longest), decode_only):
            query_lens, contexts = np.array(query_lens), np.array(contexts)
            seq_lens = contexts + query_lens
            query_start = np.concatenate([[0], np.cumsum(query_lens)])
            positions = np.concatenate([np.arange(c, s) for c, s in zip(contexts, seq_lens)])
            rows = query_start[1:] - 1
            greedy = SamplingBatch(np.zeros(len(rows), np.float32), np.zeros(len(rows), np.int32),
                                   np.ones(len(rows), np.float32), np.zeros(len(rows), np.uint64),
                                   np.zeros(len(rows), np.int64))
            adapters = np.zeros(len(positions), np.int32)
            adapters[: query_lens[0]] = with_adapters  # the first sequence under the first adapter, the rest base
            inputs = ForwardInputs(
                input_ids=np.zeros(len(positions), np.int64), positions=positions,
                slot_mapping=np.full(len(positions), -1, np.int64), query_start=query_start.astype(np.int32),
                seq_lens=seq_lens.astype(np.int32), block_tables=np.zeros((len(rows), -(-seq_lens.max() // size)),
                                                                          np.int32),
                logits_rows=rows, sampled=np.arange(len(rows)), sampling=greedy, prefilled=np.zeros(0, np.int64),
                token_adapters=adapters, may_end=np.zeros(len(rows), bool))
            if self.model.lm_head is None:  # a classifier's or embedder's model makes hidden states only
                self._hidden(inputs, rows)
            else:
                self.sample_on_device(self.forward(inputs), greedy)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release(self, request: Request) -> None:
        self.batch.release(request)

    def prepare(self, step: SchedulerOutput) -> ForwardInputs:
        return self.batch.prepare(step)

    def forward(self, inputs: ForwardInputs, extra_rows: np.ndarray | None = None,
                previous: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[R + E, vocab]` for the step's sampled rows, then for `extra_rows` of the flat batch (the rows
        that readouts read). `previous`: the last step's sampled tokens on the device, which `inputs.gather_rows`
        take (the overlapped loop)."""
        rows = inputs.logits_rows if extra_rows is None else np.concatenate([inputs.logits_rows, extra_rows])
        if (extra_rows is None and self.decoder and inputs.is_decode_only
                and self.decoder.fits(len(inputs.input_ids))):
            return self.decoder.run(inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.seq_lens,
                                    inputs.block_tables, inputs.gather_rows, inputs.gather_sources, previous)
        return self._run(inputs, rows, greedy=False, previous=previous)

    def forward_with_states(self, inputs: ForwardInputs, extra_rows: np.ndarray | None,
                            state_rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits `[R + E, vocab]` as `forward` makes them, and the final-norm hidden states `[S, hidden]` at
        `state_rows`, from one pass. With no logits row (a prefill-only step) the LM head does not run at all."""
        rows = [inputs.logits_rows] if extra_rows is None else [inputs.logits_rows, extra_rows]
        normed = self._hidden(inputs, np.concatenate([*rows, state_rows]))
        split = len(normed) - len(state_rows)
        head = self.model.lm_head
        if split:
            logits = head.logits(normed[:split])
        else:
            logits = torch.empty(0, head.vocab if head else 0, device=normed.device)
        return logits, normed[split:]

    def sequence_head(self, states: torch.Tensor) -> torch.Tensor:
        """The model's sequence-classification head on final-norm hidden rows (model/heads.py)."""
        return self.model.score_head(states)

    def greedy_tokens(self, inputs: ForwardInputs) -> np.ndarray:
        """The greedy token of every sampled row `[R]`, for a step where that is all anything reads of the logits
        (the engine decides). With `fused_greedy` the model picks them vocabulary chunk by chunk and the logits
        never exist; otherwise they are `sample` of the logits, as for any other step. Either way they equal
        the logits' argmax, ties to the first."""
        if not self.fused_greedy:
            return self.sample(self.forward(inputs), inputs.sampling)
        return self._run(inputs, inputs.logits_rows, greedy=True).numpy()

    def fused_greedy_on_device(self, inputs: ForwardInputs, previous: torch.Tensor | None) -> torch.Tensor:
        """`greedy_tokens` left on the device, for the overlapped loop; only where `fused_greedy`."""
        return self._run(inputs, inputs.logits_rows, greedy=True, previous=previous)

    def _run(self, inputs: ForwardInputs, rows: np.ndarray, greedy: bool,
             previous: torch.Tensor | None = None) -> torch.Tensor:
        args, lora = self._model_inputs(inputs, rows, previous)
        return self.model(*args, greedy=greedy, lora=lora)

    def _hidden(self, inputs: ForwardInputs, rows: np.ndarray) -> torch.Tensor:
        args, lora = self._model_inputs(inputs, rows)
        return self.model.final_hidden(*args, lora=lora)

    def _model_inputs(self, inputs: ForwardInputs, rows: np.ndarray,
                      previous: torch.Tensor | None = None) -> tuple[tuple, LoraStep | None]:
        """(ids, positions, kv caches, attention metadata, rows) on the device, as the model takes them, and the
        step's LoRA adapters (None: every token runs the base model)."""
        ids, positions, slots, query_start, seq_lens, tables, rows, gather_rows, gather_sources = self._to_device(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start, inputs.seq_lens,
            inputs.block_tables, rows, inputs.gather_rows, inputs.gather_sources)
        if len(inputs.gather_rows):
            ids = ids.index_put((gather_rows,), previous[gather_sources])
        meta = AttentionMetadata(
            query_start=query_start.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
            block_tables=tables.to(torch.int32), slot_mapping=slots,
            query_lens_host=np.diff(inputs.query_start).tolist(), seq_lens_host=inputs.seq_lens.tolist(),
            block_tables_host=inputs.block_tables,
        )
        lora = LoraStep.of(inputs.token_adapters, self.device) if self.model.adapters else None
        return (ids, positions, self.kv_caches, meta, rows), lora

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write for forks: each (source, target) block's K and V, in every layer, in one op per tensor."""
        if not copies:
            return
        source, target = (torch.tensor(side, device=self.device) for side in zip(*copies))
        for k_cache, v_cache in self.kv_caches:
            k_cache[target] = k_cache[source]
            v_cache[target] = v_cache[source]

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> np.ndarray:
        """Tokens for the logits rows, with this device's greedy pick (a step's rows and forked samples' alike)."""
        return sample(logits, batch, self._argmax)

    def sample_on_device(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        return sample_on_device(logits, batch, self._argmax)

    def copy_tokens(self, tokens: torch.Tensor) -> TokenCopy:
        """Start bringing a step's sampled tokens to the host without waiting for them."""
        return TokenCopy(tokens, self.device)

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """The step's index arrays as tensors on the device: int64, but on the CPU the int32 ones (query starts,
        sequence lengths, block tables: what the attention metadata takes) stay int32. On the CPU they are views of
        the arrays: widening the block tables to int64 and narrowing them back was a parallel copy whose threads
        waited on a loaded 2-core machine (a 1,024-sequence step's host time, benchmarks/cpu/host_overhead.py --seqs
        1024 --stub-forward, 2 threads: median 12.2 ms before, 0.80 ms after). On a GPU they travel packed in
        one int64 pinned buffer, in one copy that does not block the host."""
        if self.device.type == "cpu":
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32 if a.dtype == np.int32 else np.int64))
                    for a in arrays]
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if self._staging.numel() < total:
            self._staging = torch.empty(2 * total, dtype=torch.int64, pin_memory=True)
        host = self._staging.numpy()
        offset = 0
        for array, size in zip(arrays, sizes):
            host[offset : offset + size] = array.reshape(-1)
            offset += size
        if self._staged is not None:  # the overlapped loop may write the next step before this copy has run
            self._staged.synchronize()
        packed = self._staging[:total].to(self.device, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return [part.view(array.shape) for part, array in zip(packed.split(sizes), arrays)]


class TokenCopy:
    """A step's sampled tokens on their way to the host: on a GPU a non-blocking copy into pinned memory and an
    event after it, so the host waits only when it reads them (`wait`), a step later in the overlapped loop."""

    def __init__(self, tokens: torch.Tensor, device: torch.device):
        if device.type == "cpu":
            self.host, self.event = tokens, None
            return
        self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        self.host.copy_(tokens, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()
