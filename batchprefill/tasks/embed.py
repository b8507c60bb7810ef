"""task=embed: one vector per row from the final-norm hidden states (`model.pooling` last or mean,
`model.normalize`), the shared prefix computed once as for any prompt (tasks/pooled.py says what mean costs).

Any folder serves it: a base-model folder (`Qwen3Model`, `LlamaModel`: an embedding model's weights, no LM head), a
causal LM or a classifier. Decoder embedding models such as Qwen3-Embedding pool the last token, with an
instruction prefix that every query shares: under prefix ordering that prefix is one group's shared blocks.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from batchprefill.engine.request import Request
from batchprefill.tasks.base import OrderedRows
from batchprefill.tasks.pooled import ROW_FIELDS, PooledTask, pooled_requests, pooled_state

EMBEDDING = pa.field("embedding", pa.list_(pa.float32()))


class Embed(PooledTask):
    name = "embed"
    head = None  # every folder has final-norm hidden states

    def requests(self, rows: OrderedRows) -> list[Request]:
        return pooled_requests(rows, "hidden", mean=rows.pooling.kind == "mean", normalize=rows.pooling.normalize)

    def result_fields(self, samples: bool, logprobs: bool) -> list[pa.Field]:
        return [*ROW_FIELDS, EMBEDDING]

    def result_columns(self, request: Request) -> dict:
        state = pooled_state(request)
        return {} if state is None else {"embedding": state.pooled().astype(np.float32).tolist()}
