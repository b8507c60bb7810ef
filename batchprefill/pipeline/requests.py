"""One partition's rows as engine requests in run order: read back, resumed rows dropped, ordered, grouped."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from batchprefill.engine.request import Request
from batchprefill.io.columns import ADAPTER, ERROR, ROW
from batchprefill.model.adapters import adapter_index
from batchprefill.model.heads import head_mismatch
from batchprefill.pipeline.manifest import read_partition
from batchprefill.pipeline.order import Group, groups, in_run_order, reusable_tokens, shared_with_previous
from batchprefill.pipeline.prepare import Prepared
from batchprefill.pipeline.request_params import partition_sampling
from batchprefill.settings import JobSettings
from batchprefill.tasks import get_task
from batchprefill.tasks.base import OrderedRows, Task


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
    tasks: dict[int, Task] = field(default_factory=dict)  # request id -> its row's task, where rows name their own


def load_partition(job: JobSettings, task: Task, prepared: Prepared, part: int, skip: set) -> PartitionRun:
    """Read one partition, drop rows already done, order the rest and let the task turn them into requests; the
    task's own columns are then in its requests, and leave the table."""
    data, block_size, params = job.data, job.engine.block_size, job.sampling
    table = read_partition(prepared.partitions_dir, part)
    written = skip if params.n > 1 else set()
    if params.n > 1:  # a row is done when all its samples are
        skip = {i for i, count in Counter(i for i, _ in written).items() if count >= params.n}
    if skip:
        table = table.filter(pa.array([i not in skip for i in table[data.columns.id].to_pylist()]))
    sampling = partition_sampling(table, data.columns, params, prepared.model.config.max_positions)
    if data.columns.row_task:
        _check_row_heads(table[data.columns.row_task].to_pylist(), prepared.model.config.head, sampling.errors)
    table = table.set_column(table.schema.get_field_index(ERROR), ERROR, pa.array(sampling.errors, pa.string()))
    if written:
        row_of = dict(zip(table[data.columns.id].to_pylist(), table[ROW].to_pylist()))
        written = {(row_of[i], sample) for i, sample in written if i in row_of}
    run = in_run_order(table, data.order)
    order, token_ids, namespaces = run.order, run.token_ids, run.namespaces
    rows = table[ROW].take(order).to_pylist()
    settings = [sampling.settings[i] for i in sampling.index[order].tolist()]
    ordered = OrderedRows(table, order, rows, token_ids.to_pylist(), namespaces.to_pylist(), settings,
                          job.model.pooling)
    requests, tasks = (_requests_by_row_task(ordered, data.columns.row_task) if data.columns.row_task
                       else (task.requests(ordered), {}))
    table = table.drop_columns(list(task.internal_columns))
    if ADAPTER in table.column_names:
        with_adapters(requests, table[ADAPTER].take(order).to_pylist(), adapter_index(list(job.model.adapters)))
    link_prefix_donors(requests, shared_with_previous(token_ids, namespaces, block_size))
    errors = [(i, message) for i, message in enumerate(sampling.errors) if message is not None]
    return PartitionRun(part, table, errors, requests, groups(token_ids, namespaces, block_size),
                        dict(zip(rows, order.tolist())), sum(r.sampling.n for r in requests),
                        sum(reusable_tokens(token_ids, namespaces, block_size)), written, tasks)


def with_adapters(requests: list[Request], names: list[str], index: dict[str, int]) -> None:
    """Each request (one per row, in run order) and every child it forks runs its row's adapter ("": the base)."""
    for request, name in zip(requests, names, strict=True):
        if name:
            pending = [request]
            while pending:
                child = pending.pop()
                child.adapter = index[name]
                pending.extend(child.forks)


def link_prefix_donors(requests: list[Request], shared_blocks: np.ndarray) -> None:
    """Point each request at the one before it in run order when they share leading full blocks (the order
    stage's count), so the scheduler copies those block keys instead of hashing the same tokens again."""
    for previous, request, shared in zip(requests, requests[1:], shared_blocks[1:].tolist()):
        if shared:
            request.prefix_donor, request.donor_blocks = previous, shared


def _check_row_heads(names: list[str | None], head: str, errors: list[str | None]) -> None:
    """A row whose own task needs a head the model lacks (a chat line for a base-model folder) gets an error."""
    for index, name in enumerate(names):
        if errors[index] is None and name is not None:
            errors[index] = head_mismatch(name, get_task(name).head, head)


def _requests_by_row_task(rows: OrderedRows, column: str) -> tuple[list[Request], dict[int, Task]]:
    """Each row's requests from its own task, in run order, and each request id's task: rows of every task share
    the partition's order, so their prefixes are shared across tasks as well."""
    names = rows.table[column].take(rows.order).to_pylist()
    positions: dict[str, list[int]] = {}
    for position, name in enumerate(names):
        positions.setdefault(name, []).append(position)
    requests: list[Request | None] = [None] * len(names)
    tasks: dict[int, Task] = {}
    for name, picks in positions.items():
        task = get_task(name)
        subset = OrderedRows(rows.table, rows.order[picks], [rows.rows[p] for p in picks],
                             [rows.token_ids[p] for p in picks], [rows.namespaces[p] for p in picks],
                             [rows.sampling[p] for p in picks], rows.pooling)
        for position, request in zip(picks, task.requests(subset)):
            requests[position] = request
            tasks[request.request_id] = task
    return requests, tasks
