"""Load a job's model and build the engine around it: device, dtype, backend, KV pool, grammar machinery."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from batchprefill.constraint import GrammarError
from batchprefill.engine.config import EngineConfig
from batchprefill.engine.engine import Engine
from batchprefill.engine.kv_cache import pool_blocks
from batchprefill.engine.model_runner import say_nothing
from batchprefill.errors import JobError
from batchprefill.malloc import keep_freed_memory
from batchprefill.model.adapters import adapter_identity, load_adapters
from batchprefill.model.config import ModelConfig
from batchprefill.model.families.base import GatedMLP
from batchprefill.model.loader import (
    LoadedModel,
    load_model,
    make_ops,
    quantization_choice,
    refuse_kv_dtype_without_fp8,
    resolve_device,
    resolve_dtype,
    resolve_kv_dtype,
)
from batchprefill.model.tokenizer import PromptTokenizer
from batchprefill.pipeline.engine_sizes import ceiling_num_seqs, resolve_sizes
from batchprefill.pipeline.prepare import ModelFiles, Prepared
from batchprefill.settings import JobSettings
from batchprefill.units import readable_bytes

if TYPE_CHECKING:  # the grammar engine loads only for a job whose rows can be constrained (structured_outputs)
    from batchprefill.engine.structured import StructuredOutputs


@dataclass
class JobModel:
    """The model loaded for a job, with what every engine built on it shares."""

    loaded: LoadedModel
    files: ModelFiles  # what it was loaded from: a Runner's later jobs prepare their input with its tokenizer
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    graph_safe_decode: bool
    adapter_scope: tuple = ()  # (name, fingerprint) of every adapter: part of each block's cache scope

    @property
    def config(self) -> ModelConfig:
        return self.files.config


def structured_outputs(job: JobSettings, prepared: Prepared) -> StructuredOutputs:
    """The grammar machinery, built only for a job whose rows can be constrained; the job-wide constraint is
    compiled here, before the model loads, so a schema that cannot compile fails the job in seconds.

    Imported here: xgrammar brings transformers, 0.68 s of a job's 2.3 s of imports on the CPU (AMD EPYC, 2 cores),
    which an unconstrained job does not need."""
    from batchprefill.engine.grammar import Grammars
    from batchprefill.engine.structured import StructuredOutputs

    config = prepared.model.config
    grammars = Grammars(prepared.model.tokenizer, config.vocab_size, config.eos_token_ids)
    constraint = job.sampling.constraint
    if constraint is not None:
        try:
            grammars.compile(constraint)
        except GrammarError as error:
            raise JobError(f"sampling.{constraint.kind}: {error}; fix the constraint") from None
    return StructuredOutputs(grammars, ceiling_num_seqs(job.engine, resolve_device(job.engine.device)))


def build_engine(job: JobSettings, prepared: Prepared, tokens_needed: int,
                 structured: StructuredOutputs | None = None, typical_request_tokens: int | None = None,
                 on_phase: Callable[[str], None] = say_nothing) -> Engine:
    """Load the model on the chosen device and backend, size the KV pool, and build the engine around them."""
    on_phase("loading the model")
    model = load_job_model(job, prepared.model)
    return engine_on(job, model, prepared.model.tokenizer, tokens_needed, structured, typical_request_tokens,
                     on_phase)


def load_job_model(job: JobSettings, files: ModelFiles) -> JobModel:
    settings = job.engine
    device = resolve_device(settings.device)
    keep_freed_memory()
    if device.type == "cpu" and settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    dtype = resolve_dtype(job.model.dtype, device)
    kv_dtype = resolve_kv_dtype(settings.kv_cache_dtype, dtype)
    refuse_kv_dtype_without_fp8(kv_dtype, device)
    ops = make_ops(settings.attention_backend, device, settings.batch_invariant)
    with device_memory(device, f"model {files.folder} in {str(dtype).removeprefix('torch.')}",
                       "use a GPU with more memory or a smaller model"):
        loaded = load_model(files.folder, dtype, device, ops, files.config, files.identity, job.model.quantization)
    adapter_scope = attach_job_adapters(job, loaded, files.config, dtype, device)
    return JobModel(loaded, files, device, dtype, kv_dtype, ops.graph_safe_decode, adapter_scope)


def attach_job_adapters(job: JobSettings, loaded: LoadedModel, config: ModelConfig, dtype: torch.dtype,
                        device: torch.device) -> tuple:
    """Load model.adapters onto the model's device, once for the job, before any prompt runs (an adapter it
    cannot serve is a JobError naming it); their (name, fingerprint) pairs, for the cache scope."""
    if not job.model.adapters:
        return ()
    folders = {name: Path(folder).expanduser() for name, folder in job.model.adapters.items()}
    dense = [isinstance(layer.mlp, GatedMLP) for layer in loaded.model.layers]
    loaded.model.attach_adapters(load_adapters(folders, config, dense, dtype, device))
    return tuple((name, adapter_identity(folder)) for name, folder in sorted(folders.items()))


def engine_on(job: JobSettings, model: JobModel, tokenizer: PromptTokenizer, tokens_needed: int,
              structured: StructuredOutputs | None = None, typical_request_tokens: int | None = None,
              on_phase: Callable[[str], None] = say_nothing) -> Engine:
    """An engine on a loaded model with a KV pool sized for `tokens_needed` (batchprefill-eval builds one per
    batch of lm-eval requests, on one model); engine.*=auto sizes are picked here, from the pool and
    `typical_request_tokens` (a request's mean prompt plus outputs; None: not known). On a GPU the engine compiles
    its kernels and captures its graphs before the first step, telling `on_phase` (the progress bar)."""
    model_config = model.config
    loaded, device, dtype, kv_dtype = model.loaded, model.device, model.dtype, model.kv_dtype
    num_blocks = pool_blocks(model_config, kv_dtype, device, job.engine.block_size,
                             ceiling_num_seqs(job.engine, device), job.engine.kv_cache_tokens, tokens_needed)
    sizes = resolve_sizes(job.engine, device, num_blocks, typical_request_tokens)
    settings = sizes.settings
    graphs = settings.cuda_graphs and device.type == "cuda" and model.graph_safe_decode
    config = EngineConfig(settings, num_blocks, padded_decode="graphs" if graphs else "off",
                          overlap=device.type == "cuda", sizes_summary=sizes.summary)
    # The quantization is part of the scope: model.quantization=fp8 loads the same folder (the same identity) with
    # other weights, and FP8 products give other KV than the dequantized weights'.
    scope = (loaded.identity, str(dtype), str(kv_dtype), model_config.rope_theta, repr(model_config.rope_scaling),
             model_config.layer_windows, settings.block_size, model.adapter_scope,
             quantization_choice(loaded.quantization, dtype, device))
    pool = num_blocks * settings.block_size * model_config.kv_bytes_per_token(torch.finfo(kv_dtype).bits // 8)
    with device_memory(device, f"a KV pool of {readable_bytes(pool)} and the decode graphs",
                       "lower engine.max_num_seqs or engine.kv_cache_tokens, or use a GPU with more memory"):
        return Engine(loaded.model, config, tokenizer.decode, scope, kv_dtype, device, structured, on_phase)


@contextmanager
def device_memory(device: torch.device, what: str, advice: str) -> Iterator[None]:
    """A device that runs out of memory while `what` is allocated ends the job in one line saying what did not fit,
    how much was free, and what to change, not in a CUDA traceback."""
    try:
        yield
    except torch.OutOfMemoryError:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        raise JobError(f"{device} ran out of memory for {what} ({readable_bytes(free)} free now): {advice}") from None
