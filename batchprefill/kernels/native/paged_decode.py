"""A step's decode attention read in place from the paged KV pool, one C++ call per layer
(`kernels/native/csrc/paged_decode.cpp`, built and loaded by `build.py`).

Why in place: on the CPU a decode's own blocks were gathered into a padded copy (`index_select`) before a fused
call, per layer and step. With long answers that copy is most of the step: at 80 decodes with 450 own tokens
each (SmolLM2-135M, float32, 2 threads) the gather took 440 ms and the fused call on the copy 250 ms of a
1,270 ms step. The kernel walks each decode's block list and keeps an online softmax, reading every key and
value once where it lies.

Why one call: decodes that share a prefix form a set; the set's rows walk the shared blocks together, then each
member goes on over its own, in the same online softmax. The shared and own halves used to be two calls joined
by a log-sum-exp merge in torch, some 25 small ops per layer: 12.4 ms of a 183 ms decode step at 80 decodes in 9
groups (benchmarks/cpu/step_ops.py); one call is 2.3-3.3x the gathered path at 40-450 own tokens (BENCHMARKS.md,
session 5).

Why tiles: in bfloat16 both walks are matrix-matrix work (a set's rows, or a decode's query heads, against a run of
keys), and the vector walks widen every key to float32 and spend an FMA per element and row, so bfloat16 attention
was no faster than float32 (35.8 against 32.3 ms a step at 80 decodes). On a CPU with AMX a bfloat16 model's walks
run as bfloat16 tile products with float32 sums and a float32 online softmax (the C++ source has the layouts).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from batchprefill.intmath import cdiv
from batchprefill.kernels.interface import AttentionMetadata
from batchprefill.kernels.native import build as native
from batchprefill.kernels.shared_prefix import by_deepest_prefix

_ENTRY_POINTS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16",
                 torch.float8_e4m3fn: "paged_decode_e4m3", torch.float8_e5m2: "paged_decode_e5m2"}

# A set holds at most this many query rows (members x query heads per KV head): a larger group is split into
# sets that each read the shared prefix once, so one big group still spreads over the threads (work items are
# sets x KV heads) while its prefix is read once per 16 members at SmolLM2's 3 query heads per KV head.
MAX_SET_ROWS = 48
# Query rows of a set of prefill rows (`_chunk_sets`): a step's chunks hold hundreds of rows, so larger sets read each
# prefix fewer times and still leave work items for every thread.
MAX_CHUNK_SET_ROWS = 192
# Query rows of a run: a chunk's rows are cut into runs, each of which reads the blocks before its first row once, its
# rows then walking the rest alone (runs with the same prefix, best-of-n responses, share sets). Smaller runs leave
# less to the rows' own walks, which over a bfloat16 pool widen every key to float32. Against runs of 192 rows, 96
# walked short fresh prompts in 0.60-0.75x the time over a bfloat16 pool (eight of 64 tokens: 0.89 -> 0.67x of the
# fused calls; one of 128: 0.87 -> 0.60x) and were level or faster elsewhere; 48 were slower on 2,048-token prompts
# (0.94 against 0.80x at Llama-3-8B's heads; an exploratory sweep of `benchmarks/cpu/chunk_routes.py`'s shapes, AMD
# EPYC Zen 4, 2 threads).
CHUNK_RUN_ROWS = 96


@dataclass(frozen=True)
class PagedPlan:
    """A step's rows as the kernel reads them, built once for every layer (layouts in the C++ source)."""

    kernel: PagedDecode
    sets: torch.Tensor  # [num_sets, 3] int64: first member, member count, shared tokens
    shared_blocks: torch.Tensor  # [num_sets, width] int64
    rows: torch.Tensor  # [members] int64 flat-batch row of each member, sets' members adjacent
    own_blocks: torch.Tensor  # [members, width] int64
    own_lens: torch.Tensor  # [members] int64
    fixed_order: bool = False  # batch-invariant: every row's keys in one order, whatever its set (`plan_every_row`)
    lane_lengths: torch.Tensor | None = None  # [members] int64: tokens of its set's shared walk each member sees
    own_skips: torch.Tensor | None = None  # [members] int64: tokens at the start of its own walk it does not see

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               out: torch.Tensor) -> None:
        """Writes every planned row's attention `[Hq, D]` into `out` (`[tokens, Hq, D]`) at its row."""
        self.kernel.run(self, query, k_cache, v_cache, scale, out)


# A set's member: (sequence, flat-batch row, keys the row sees, how many of them are in its set's shared walk).
Member = tuple[int, int, int, int]
# A set: the block ids its members share, the tokens of them its walk covers, and its members.
Set = tuple[tuple[int, ...], int, list[Member]]


class PagedDecode:
    """The loaded kernel: plans a step's decodes and runs them, for every KV dtype it has an entry point for."""

    def __init__(self, library: ctypes.CDLL):
        self._functions = {}
        plan_arguments = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        for dtype, name in _ENTRY_POINTS.items():
            function = getattr(library, name)
            function.restype = None
            function.argtypes = [*plan_arguments, ctypes.c_int, ctypes.c_void_p]  # fixed order, own skips
            self._functions[dtype] = function
        self._tiles_run = library.paged_decode_bf16_tiles_run  # bfloat16 queries and outputs, tile walks
        self._tiles_run.restype = None
        self._tiles_run.argtypes = [*plan_arguments, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]  # and lane lengths
        self._tiles = library.paged_decode_bf16_tiles
        self._tiles.restype = ctypes.c_int
        self._tiles.argtypes = [ctypes.c_int64, ctypes.c_int64]
        self.tile_chunk = int(library.paged_decode_tile_chunk())  # tokens: where an invariant tile walk may start

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._functions

    @functools.cache  # noqa: B019 (one kernel object per process)
    def uses_tiles(self, block: int, head_dim: int) -> bool:
        """Whether a bfloat16 model's decodes over a bfloat16 pool of this block and head size run as AMX tile
        matmuls (the CPU has AMX, Linux granted it, heads a multiple of 32 up to 128, blocks a multiple of 16)."""
        return bool(self._tiles(block, head_dim))

    def plan(self, meta: AttentionMetadata, decodes: list[int], chunks: list[int], tables: list[list[int]],
             block: int, per_kv: int, tiles: bool = False) -> PagedPlan | None:
        """A step's `decodes` and the rows of its `chunks` (prefill chunks after a cached prefix), for one call.

        Decodes sharing a prefix form sets (`shared_prefix.by_deepest_prefix`) of at most MAX_SET_ROWS rows; a
        decode that shares nothing with another is a set of one. Chunks as `_chunk_sets` lays them out (`tiles`:
        for the tile walks). Largest sets first: items are taken in order by whichever thread is free, so the
        longest ones do not start last.

        Why chunks here: they went through the padded, masked fused calls of `prefix_groups.py`, which compute every
        query of a group against every member's keys and then mask most of them off. In a best-of-8 reward job (768
        rows, 53,588 computed tokens after cached prompts, SmolLM2-135M, one thread) the kernel's walks took
        attention from 19.95 to 9.31 s of the model's 35.30 s in bfloat16 (22.81 s after), and from 46.90 to 20.79 s
        of 130.93 s in float32 (`benchmarks/cpu/step_ops.py --job reward`)."""
        sets = _decode_sets(meta, decodes, tables, block, per_kv) + _chunk_sets(meta, chunks, tables, block, per_kv,
                                                                                 tiles)
        if not sets:
            return None
        return self._layout(sets, tables, block, fixed_order=False, tiles=tiles and bool(chunks))

    def plan_every_row(self, meta: AttentionMetadata, tables: list[list[int]], block: int, per_kv: int,
                       tiles: bool = False) -> PagedPlan | None:
        """Every query row of the step, a prefill chunk's as well as a decode's, as one row of the kernel, each
        reducing its keys block by block from position 0 in one order (batch invariance): its bits then depend on
        its own query and keys only, never on the step's other rows, its set, or where its prompt was chunked.

        Sets as in `plan`. The tile walks reduce keys in chunks of `tile_chunk` tokens from a walk's start, so there
        every walk starts at a multiple of it: a decode set's prefix is cut to whole chunks, and a run of prefill rows
        walks its sequence from 0, each lane to its own position. Either way the same walk serves prefill and decode,
        so a recomputed (preempted) answer gets the bits its decode steps had."""
        lens = meta.query_lens_host
        decodes = [s for s, n in enumerate(lens) if n == 1]
        chunk_blocks = max(1, self.tile_chunk // block) if tiles else 1
        sets = _decode_sets(meta, decodes, tables, block, per_kv, chunk_blocks)
        sets += _chunk_sets(meta, [s for s, n in enumerate(lens) if n > 1], tables, block, per_kv, tiles)
        if not sets:
            return None
        return self._layout(sets, tables, block, fixed_order=True, tiles=tiles)

    def plan_windowed(self, meta: AttentionMetadata, tables: list[list[int]], block: int, window: int
                      ) -> PagedPlan | None:
        """Every query row of the step alone under a sliding window (batch invariance): the row at position p walks
        from the block holding p - window + 1, skipping that block's tokens before it. Its walk then depends on p
        and the window only, never on its company or its chunk."""
        members, skips = [], {}
        query_start = np.cumsum([0, *meta.query_lens_host]).tolist()
        for s, (count, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
            for j in range(count):
                length = seq_len - count + j + 1
                first = max(0, length - window)
                members.append((s, query_start[s] + j, length, first // block * block))
                skips[query_start[s] + j] = first % block
        if not members:
            return None
        sets = [((), 0, [member]) for member in members]
        return self._layout(sets, tables, block, fixed_order=True, skips=skips)

    def _layout(self, sets: list[Set], tables: list[list[int]], block: int, fixed_order: bool,
                tiles: bool = False, skips: dict[int, int] | None = None) -> PagedPlan:
        """The kernel's arrays for `sets`, the ones that read the most keys first: items are taken in order by
        whichever thread is free, so the longest ones do not start last. `skips`: flat-batch row -> tokens at the
        start of its own walk it does not see."""
        sets.sort(key=lambda item: -sum(length for _, _, length, _ in item[2]))
        members = [member for _, _, chosen in sets for member in chosen]
        seen = np.array([shared for _, _, _, shared in members], dtype=np.int64)
        own_lens = np.array([length for _, _, length, _ in members], dtype=np.int64) - seen
        own_blocks = np.zeros((len(members), max(1, cdiv(int(own_lens.max()), block))), dtype=np.int64)
        for i, (s, _, length, shared) in enumerate(members):
            own = tables[s][shared // block : cdiv(length, block)]
            own_blocks[i, : len(own)] = own
        shared_blocks = np.zeros((len(sets), max(1, max(len(prefix) for prefix, _, _ in sets))), dtype=np.int64)
        layout = np.zeros((len(sets), 3), dtype=np.int64)
        first = 0
        for i, (prefix, shared, chosen) in enumerate(sets):
            shared_blocks[i, : len(prefix)] = prefix
            layout[i] = (first, len(chosen), shared)
            first += len(chosen)
        rows = np.array([row for _, row, _, _ in members], dtype=np.int64)
        return PagedPlan(self, torch.from_numpy(layout), torch.from_numpy(shared_blocks), torch.from_numpy(rows),
                         torch.from_numpy(own_blocks), torch.from_numpy(own_lens), fixed_order,
                         torch.from_numpy(seen) if tiles else None,
                         None if skips is None else torch.tensor([skips[row] for row in rows.tolist()]))

    def run(self, plan: PagedPlan, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
            out: torch.Tensor) -> None:
        on_host(query, k_cache, v_cache, out)
        _, q_heads, dim = query.shape
        kv_heads = k_cache.shape[2]
        tiles = (query.dtype == k_cache.dtype == out.dtype == torch.bfloat16 and out.is_contiguous()
                 and self.uses_tiles(k_cache.shape[1], dim))
        if plan.lane_lengths is not None and not tiles:  # prefill rows laid out for the tile walks' lane limits
            raise ValueError(f"a plan laid out for the tile walks cannot run {query.dtype} queries over a "
                             f"{k_cache.dtype} pool")
        skips = plan.own_skips.data_ptr() if plan.own_skips is not None else None
        arguments = (
            plan.sets.data_ptr(), plan.shared_blocks.data_ptr(), plan.rows.data_ptr(), plan.own_blocks.data_ptr(),
            plan.own_lens.data_ptr(), plan.sets.shape[0], plan.shared_blocks.shape[1], plan.own_blocks.shape[1],
            k_cache.shape[1], kv_heads, q_heads // kv_heads, dim, scale)
        if tiles:  # the flat batch's own bfloat16 rows in and out: 60 us a layer of copies saved at 80 decodes
            query = query.contiguous()  # held here: the call must not outlive a temporary
            lanes = plan.lane_lengths.data_ptr() if plan.lane_lengths is not None else None
            self._tiles_run(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *arguments, out.data_ptr(),
                            torch.get_num_threads(), int(plan.fixed_order), lanes, skips)
            return
        query = query.to(torch.float32).contiguous()
        target = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty_like(query)
        self._functions[k_cache.dtype](query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *arguments,
                                       target.data_ptr(), torch.get_num_threads(), int(plan.fixed_order), skips)
        if target is out:
            return
        if plan.rows.shape[0] == out.shape[0]:  # every row planned (a decode-only step)
            out.copy_(target)  # one op where the index copies below took 35 us a layer at 81 decodes (6x)
        else:
            out.index_copy_(0, plan.rows, target.index_select(0, plan.rows).to(out.dtype))


def on_host(*tensors: torch.Tensor) -> None:
    """Refuse, in one line, any tensor the C++ code cannot read: it takes raw pointers into host memory, so a device
    pointer (a CUDA tensor) would crash the process, as it did on the first GPU run (`attention_backend=torch`)."""
    elsewhere = sorted({str(t.device) for t in tensors if t.device.type != "cpu"})
    if elsewhere:
        raise ValueError(f"the CPU kernel reads host memory only, and was handed tensors on {', '.join(elsewhere)}")


def _decode_sets(meta: AttentionMetadata, decodes: list[int], tables: list[list[int]], block: int,
                 per_kv: int, whole: int = 1) -> list[Set]:
    """Decodes sharing a prefix (`shared_prefix.by_deepest_prefix`), cut to a multiple of `whole` blocks, in sets
    of at most MAX_SET_ROWS rows; a decode that shares nothing with another is a set of one."""
    most = max(1, MAX_SET_ROWS // per_kv)
    query_start = np.cumsum([0, *meta.query_lens_host]).tolist()
    seq_lens = meta.seq_lens_host
    sets: list[Set] = []
    for deepest, sequences in by_deepest_prefix(meta, decodes, tables, block).items():
        prefix = deepest[: len(deepest) // whole * whole]
        shared = len(prefix) * block
        members = [(s, query_start[s], seq_lens[s], shared) for s in sequences]
        if prefix and len(members) > 1:
            sets += [(prefix, shared, members[i : i + most]) for i in range(0, len(members), most)]
        else:
            sets += [((), 0, [(s, row, length, 0)]) for s, row, length, _ in members]
    return sets


def _chunk_sets(meta: AttentionMetadata, chunks: list[int], tables: list[list[int]], block: int, per_kv: int,
                tiles: bool) -> list[Set]:
    """The rows of prefill `chunks` as sets, a chunk's rows CHUNK_RUN_ROWS at a time (a run; the tile walks'
    MAX_CHUNK_SET_ROWS).

    With the vector walks a run's walk covers the blocks wholly before its first row, so its rows read that prefix
    once and each walks at most the run and a block of its own; runs whose prefixes are the same blocks (best-of-n
    responses under one prompt) share sets. The tile walks take their lane limits instead: a run walks its sequence
    from 0 to its last row, each row's lane stopping at its own position, so no row walks alone."""
    most = max(1, MAX_CHUNK_SET_ROWS // per_kv)
    run = max(1, (CHUNK_RUN_ROWS if not tiles else MAX_CHUNK_SET_ROWS) // per_kv)
    query_start = np.cumsum([0, *meta.query_lens_host]).tolist()
    sets: list[Set] = []
    by_prefix: dict[tuple[int, ...], list[Member]] = {}
    for s in chunks:
        count = meta.query_lens_host[s]
        first_position = meta.seq_lens_host[s] - count
        for start in range(0, count, run):
            lengths = [first_position + j + 1 for j in range(start, min(count, start + run))]
            rows = range(query_start[s] + start, query_start[s] + start + len(lengths))
            if tiles:
                prefix = tuple(tables[s][: cdiv(lengths[-1], block)])
                sets.append((prefix, lengths[-1], [(s, row, n, n) for row, n in zip(rows, lengths)]))
            else:
                prefix = tuple(tables[s][: (first_position + start) // block])
                shared = len(prefix) * block
                by_prefix.setdefault(prefix, []).extend((s, row, n, shared) for row, n in zip(rows, lengths))
    for prefix, members in by_prefix.items():
        sets += [(prefix, len(prefix) * block, members[i : i + most]) for i in range(0, len(members), most)]
    return sets


def load() -> PagedDecode | None:
    """The kernel, or None where it is disabled or cannot be built."""
    library = native.library("paged_decode")
    return None if library is None else PagedDecode(library)
