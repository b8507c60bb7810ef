"""One partition's rows as engine requests in run order: read back, resumed rows dropped, ordered, grouped."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from batchprefill.engine.request import Request, SamplingParams, with_samples
from batchprefill.engine.scoring import score_request
from batchprefill.io.columns import CHOICES, ERROR, NAMESPACE, ROW, TOKENS
from batchprefill.io.own_files import read_parquet
from batchprefill.pipeline.manifest import partition_path
from batchprefill.pipeline.order import Group, groups, reusable_tokens, run_order, shared_with_previous
from batchprefill.pipeline.prepare import Prepared
from batchprefill.pipeline.request_params import partition_sampling
from batchprefill.settings import DataSettings

PARTITION_REMEDY = "delete output.dir/partitions and rerun: the job prepares them again and resumes"


@dataclass
class PartitionRun:
    """One partition in flight: its rows (kept until its last request is written) and its requests."""

    part: int
    table: pa.Table
    errors: list[tuple[int, str]]  # (row of table, message) of rows that never reach the engine
    requests: list[Request]  # in run order
    groups: list[Group]
    position: dict[int, int]  # request id -> row of table
    unfinished: int  # result rows still to write: a row's samples count one each
    ideal_cached_tokens: int  # what an ideal cache serves in this run order (the plan's arithmetic)
    written: set  # with sampling.n > 1: (request id, sample_index) of samples an earlier run committed


def load_partition(data: DataSettings, block_size: int, params: SamplingParams, prepared: Prepared, part: int,
                   skip: set) -> PartitionRun:
    """Read one partition, drop rows already done, order the rest and turn them into requests: with task=score
    a context request per row carrying its choices, with sampling.n > 1 sample 0 carrying the others."""
    table = read_parquet(partition_path(prepared.partitions_dir, part), None, PARTITION_REMEDY)
    written = skip if params.n > 1 else set()
    if params.n > 1:  # a row is done when all its samples are
        skip = {i for i, count in Counter(i for i, _ in written).items() if count >= params.n}
    if skip:
        table = table.filter(pa.array([i not in skip for i in table[data.columns.id].to_pylist()]))
    sampling = partition_sampling(table, data.columns, params, prepared.model_config.max_positions)
    table = table.set_column(table.schema.get_field_index(ERROR), ERROR, pa.array(sampling.errors, pa.string()))
    if written:
        row_of = dict(zip(table[data.columns.id].to_pylist(), table[ROW].to_pylist()))
        written = {(row_of[i], sample) for i, sample in written if i in row_of}
    order = run_order(table[TOKENS], table[NAMESPACE], table[ROW], table[ERROR], data.order)
    token_ids, namespaces = table[TOKENS].take(order), table[NAMESPACE].take(order)
    rows = table[ROW].take(order).to_pylist()
    if data.columns.choices:
        choices = table[CHOICES].take(order).to_pylist()
        requests = [score_request(row, ids, row_choices, namespace) for row, ids, row_choices, namespace
                    in zip(rows, token_ids.to_pylist(), choices, namespaces.to_pylist())]
    else:
        settings = [sampling.settings[i] for i in sampling.index[order].tolist()]
        requests = [with_samples(Request(row, ids, row_params, namespace)) for row, ids, row_params, namespace
                    in zip(rows, token_ids.to_pylist(), settings, namespaces.to_pylist())]
    link_prefix_donors(requests, shared_with_previous(token_ids, namespaces, block_size))
    errors = [(i, message) for i, message in enumerate(sampling.errors) if message is not None]
    return PartitionRun(part, table, errors, requests, groups(token_ids, namespaces, block_size),
                        dict(zip(rows, order.tolist())), sum(r.sampling.n for r in requests),
                        sum(reusable_tokens(token_ids, namespaces, block_size)), written)


def link_prefix_donors(requests: list[Request], shared_blocks: np.ndarray) -> None:
    """Point each request at the one before it in run order when they share leading full blocks (the order
    stage's count), so the scheduler copies those block keys instead of hashing the same tokens again."""
    for previous, request, shared in zip(requests, requests[1:], shared_blocks[1:].tolist()):
        if shared:
            request.prefix_donor, request.donor_blocks = previous, shared
