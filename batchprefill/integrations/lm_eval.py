"""The `batchprefill` model for lm-evaluation-harness: every request kind runs as one prefix-ordered job.

lm-eval hands over all requests of a kind at once. `loglikelihood` goes through task=score: requests that share
a context become one row whose choices fork after it, and contexts that share a few-shot header share its KV
through the prefix cache, so a 5-shot header is computed once per engine, not once per (question, choice) as
lm-eval's vLLM backend (prompt_logprobs skip vLLM's prefix cache) does. `loglikelihood_rolling` makes the same
windows as lm-eval's HF backend and scores each as a context of one token with one choice; `generate_until`
honours `until`, `max_gen_toks` and greedy or sampled settings. Results come back in lm-eval's order.

Model arguments: `pretrained=PATH` (a model folder or GGUF, as `model.path`), `dtype=...` (`model.dtype`), and
any batchprefill config key (`engine.block_size=16`, `sampling.seed=1`, `engine.kv_cache_dtype=fp8`). Each request
kind's closing line on stderr names the KV pool it ran on ("a KV pool of 8,192 tokens in float8_e4m3fn, ..."), so a
run's log says which KV precision its metrics come from.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterable

from hydra import compose, initialize_config_dir
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from batchprefill.engine.request import Request
from batchprefill.errors import JobError
from batchprefill.pipeline.build_engine import engine_on, load_job_model
from batchprefill.pipeline.prepare import open_model
from batchprefill.pipeline.run import kv_pool_line
from batchprefill.sampling_params import SamplingParams
from batchprefill.settings import CONFIG_DIR, JobSettings
from batchprefill.tasks.score import ChoiceScores, score_request

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's HF backend's default


def job_settings(pretrained: str, dtype: str, config: dict) -> JobSettings:
    """The batchprefill config for these model arguments, checked as `batchprefill-run` checks its own."""
    overrides = [f"model.path={pretrained}", f"model.dtype={dtype}",
                 f"output.dir={tempfile.gettempdir()}/batchprefill-eval"]
    overrides += [f"{key}={value}" for key, value in config.items()]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return JobSettings.from_config(compose("config", overrides=overrides))


@register_model("batchprefill")
class BatchprefillLM(TemplateLM):
    def __init__(self, pretrained: str, dtype: str = "auto", batch_size: int | str | None = None,
                 max_batch_size: int | None = None, device: str | None = None, **config):
        """`batch_size`, `max_batch_size` and `device` come from lm-eval's own flags: the engine's step budget and
        `engine.device` decide those here."""
        super().__init__()
        self.job = job_settings(pretrained, dtype, config)
        files = open_model(self.job.model)
        self.model_config, self.tokenizer_files = files.config, files.tokenizer
        self.model = load_job_model(self.job, files)
        vocab = self.tokenizer_files.tokenizer
        eos, bos = self.tokenizer_files.eos_token, self.tokenizer_files.bos_token
        self._eot = vocab.token_to_id(eos) if eos else self.model_config.eos_token_ids[0]
        self._prefix = vocab.token_to_id(bos) if bos else self._eot  # as lm-eval's HF backend: BOS, else EOS

    # ---- tokens -------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self.model_config.max_positions

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer_files.encode_batch([string])[0]

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer_files.decode(tokens)

    # ---- request kinds --------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """One score row per distinct context, its requests' continuations as the choices."""
        rows: dict[tuple[int, ...], list[int]] = {}  # context -> indices of its requests
        for index, (_, context, continuation) in enumerate(requests):
            if not continuation:
                raise JobError(f"loglikelihood request {index} has a continuation of no tokens")
            if len(context) + len(continuation) - 1 > self.max_length:
                raise JobError(f"loglikelihood request {index}: context plus continuation need "
                               f"{len(context) + len(continuation) - 1} positions; the model has {self.max_length}")
            rows.setdefault(tuple(context), []).append(index)
        contexts = list(rows)
        built = [score_request(number, list(context), [requests[i][2] for i in rows[context]])
                 for number, context in enumerate(contexts)]
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        for row in self._run(built, "loglikelihood", len(requests), disable_tqdm, lambda r: len(r.readout.choices)):
            scores: ChoiceScores = row.readout
            for choice, (logprob, greedy) in enumerate(zip(scores.choice_logprobs(), scores.is_greedy())):
                results[rows[contexts[row.request_id]][choice]] = (logprob, greedy)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The windows of lm-eval's HF backend (disjoint, each with the most context that fits), summed per text."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        built = []
        eos = self.tokenizer_files.decode_one(self.eot_token_id)
        for index, (context, gen_kwargs) in enumerate(request.args for request in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
            # the EOS token stops the engine by itself: only text stop strings are passed on
            until = [s for s in handle_stop_sequences(kwargs.pop("until", None), eos=eos) if s != eos]
            max_tokens = int(kwargs.pop("max_gen_toks"))
            if max_tokens >= self.max_length:
                raise JobError(f"generate_until request {index}: max_gen_toks={max_tokens} leaves no room for a "
                               f"prompt in the model's {self.max_length} positions")
            sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 1.0)) > 0
            params = SamplingParams(
                max_tokens=max_tokens, temperature=float(kwargs.get("temperature", 1.0)) if sampled else 0.0,
                top_p=float(kwargs.get("top_p") or 1.0), top_k=int(kwargs.get("top_k") or -1),
                seed=self.job.sampling.seed, stop=tuple(until))
            ids = self.tok_encode(context)[-(self.max_length - max_tokens):]  # left-truncated as the HF backend
            built.append(Request(index, ids, params))
        texts = [""] * len(requests)
        for request in self._run(built, "generate_until", len(requests), disable_tqdm, lambda r: 1):
            texts[request.request_id] = request.output_text
        return texts

    def _run(self, requests: list[Request], kind: str, total: int, disable_tqdm: bool, weight) -> Iterable[Request]:
        """Requests through one engine in prefix order (the trie's depth-first order: each shared prefix's KV is
        computed once while it is cached), yielding them as they finish; an error ends the run in one line."""
        ordered = sorted(requests, key=lambda r: r.prompt_token_ids)
        tokens = sum(r.num_prompt_tokens + r.sampling.max_tokens for r in requests)
        tokens += sum(f.num_prompt_tokens for r in requests for f in r.forks)
        engine = engine_on(self.job, self.model, self.tokenizer_files, tokens)
        with engine, tqdm(total=total, desc=kind, unit="req", disable=disable_tqdm) as bar:
            for request in engine.generate(ordered):
                if request.error is not None:
                    raise JobError(f"{kind} request {request.request_id} cannot run: {request.error}")
                bar.update(weight(request))
                yield request
        counters = engine.counters
        print(f"batchprefill-eval: {kind}: {total} requests, {counters.finished_prompt_tokens} prompt tokens, "
              f"{counters.prefill_tokens} computed, {counters.finished_cached_tokens} from the prefix cache; "
              f"{kv_pool_line(engine, self.model_config)}",
              file=sys.stderr)
