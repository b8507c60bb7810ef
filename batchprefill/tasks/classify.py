"""task=classify: a `*ForSequenceClassification` folder's score head at each row's last token (classifiers, and
reward models: the one-label case), the head applied to that one row only, never logits over the vocabulary.

Best-of-n reward scoring is this task's best case: n responses after one prompt sort into one prefix group, so the
prompt is computed once and each response's own tokens after it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from batchprefill.engine.request import Request
from batchprefill.model.heads import SCORE
from batchprefill.tasks.base import OrderedRows
from batchprefill.tasks.pooled import ROW_FIELDS, PooledTask, pooled_requests, pooled_state

CLASS_FIELDS = [
    pa.field("class_logits", pa.list_(pa.float32())),  # raw, one per label: a one-label reward model's reward
    pa.field("class_probs", pa.list_(pa.float32())),  # softmax over the labels; null with one label
    pa.field("best_class", pa.int32()),
]


def class_columns(logits: np.ndarray) -> dict:
    """The classify columns of one row's head outputs."""
    probs = None
    if len(logits) > 1:
        shifted = np.exp(logits - logits.max())
        probs = (shifted / shifted.sum()).astype(np.float32).tolist()
    return {"class_logits": logits.astype(np.float32).tolist(), "class_probs": probs,
            "best_class": int(np.argmax(logits))}


class Classify(PooledTask):
    name = "classify"
    head = SCORE

    def requests(self, rows: OrderedRows) -> list[Request]:
        return pooled_requests(rows, "head")

    def result_fields(self, samples: bool, logprobs: bool) -> list[pa.Field]:
        return [*ROW_FIELDS, *CLASS_FIELDS]

    def result_columns(self, request: Request) -> dict:
        state = pooled_state(request)
        return {} if state is None else class_columns(state.pooled())
