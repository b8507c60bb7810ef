"""task=generate: sample each row's output after its prompt, `sampling.n` times when asked."""

from __future__ import annotations

import pyarrow as pa

from batchprefill.engine.request import Request, with_samples
from batchprefill.io.results import LOGPROB_FIELDS, OUTPUT_FIELDS, SAMPLE_INDEX
from batchprefill.sampling_params import SamplingParams
from batchprefill.tasks.base import OrderedRows, PromptBatch


class Generate:
    name = "generate"
    head = "lm"
    input_columns: tuple[tuple[str, str], ...] = ()
    internal_columns: tuple[str, ...] = ()

    def check(self, sampling: SamplingParams) -> None:
        """Every sampling setting applies."""

    def max_prompt_tokens(self, context: int, max_tokens: int) -> int:
        return context - max_tokens

    def tokenize(self, batch: PromptBatch) -> tuple[pa.ListArray, dict[str, pa.Array]]:
        return batch.prompt_tokens(batch.texts), {}

    def requests(self, rows: OrderedRows) -> list[Request]:
        """A request per row; with sampling.n > 1 it is sample 0 and carries the others."""
        return [with_samples(Request(row, ids, params, namespace)) for row, ids, params, namespace
                in zip(rows.rows, rows.token_ids, rows.sampling, rows.namespaces)]

    def kv_tokens(self, prompt_tokens: int, output_tokens: int, samples: int) -> int:
        return prompt_tokens + output_tokens * samples

    def result_fields(self, samples: bool, logprobs: bool) -> list[pa.Field]:
        return [SAMPLE_INDEX] * samples + OUTPUT_FIELDS + LOGPROB_FIELDS * logprobs

    def result_columns(self, request: Request) -> dict:
        asked = request.sampling.logprobs is not None  # 0 (an OpenAI line's logprobs alone): the sampled tokens'
        return {"sample_index": request.sample_index,
                "output_logprobs": request.output_logprobs if asked else None,
                "output_top_logprobs": [[{"token_id": t, "logprob": v} for t, v in top]
                                        for top in request.output_top_logprobs] if asked else None}
