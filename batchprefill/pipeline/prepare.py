"""Prepare a whole job up to the engine: find the model's config and tokenizer, and partition the input.

The plan command and the run share this, so both see the same partitions, made once and reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchprefill.errors import JobError
from batchprefill.io.formats import input_format, resolve_input
from batchprefill.model.config import ModelConfig
from batchprefill.model.heads import check_head
from batchprefill.model.loader import model_identity, read_model_config, resolve_folder
from batchprefill.model.tokenizer import PromptTokenizer
from batchprefill.pipeline.manifest import PARTITIONS_PER_SHARD, Manifest, PrepareSettings
from batchprefill.pipeline.partitions import make_partitions
from batchprefill.settings import JobSettings, ModelSettings
from batchprefill.tasks import get_task


@dataclass
class ModelFiles:
    """A job's model folder, opened once: what the run, the plan and batchprefill-eval read before any weight."""

    folder: Path
    config: ModelConfig
    identity: str  # model_identity(folder), read once per job
    tokenizer: PromptTokenizer


@dataclass
class Prepared:
    """What the plan command and the run share: the opened model and the input's partitions."""

    model: ModelFiles
    manifest: Manifest
    partitions_dir: Path


def open_model(settings: ModelSettings) -> ModelFiles:
    """The model folder `model.path` names (the shipped GGUF converted when null), its config, identity and
    tokenizer."""
    folder = resolve_folder(settings.path)
    return ModelFiles(folder, read_model_config(folder), model_identity(folder), PromptTokenizer(folder))


def prepare_job(job: JobSettings, model: ModelFiles | None = None) -> Prepared:
    """The job's input partitioned for its model: `model` when a caller opened it already (a Runner keeps it), else
    the one `model.path` names."""
    files, fmt = resolve_input(job.data.input, job.data.format)
    model = model or open_model(job.model)
    if not input_format(fmt).row_tasks:  # rows that name their own task are checked one by one (requests.py)
        check_head(job.task, get_task(job.task).head, model.config, model.folder)
    if (job.data.chat_template or job.data.columns.messages) and model.tokenizer.chat_template is None:
        asked = "data.chat_template=true" if job.data.chat_template else "a conversation column"
        names = model.tokenizer.template_names
        has = f"only named ones ({', '.join(names)}), none named default" if names else "none"
        raise JobError(f"{asked} needs a chat template, but {model.folder} has {has} (looked for chat_template.jinja, "
                       "additional_chat_templates/, chat_template.json and tokenizer_config.json's chat_template)")
    prepare_settings = PrepareSettings(
        columns=job.data.columns, chat_template=job.data.chat_template, order=job.data.order,
        block_size=job.engine.block_size, max_prompt_tokens=_max_prompt_tokens(job, model.config),
        tokenizer_id=model.identity, read_batch_rows=job.data.read_batch_rows, buffer_mb=job.data.buffer_mb,
        task=job.task, min_partitions=PARTITIONS_PER_SHARD * job.data.sharding.num_shards,
        vocab_size=model.config.vocab_size, adapters=tuple(sorted(job.model.adapters)),
    )
    partitions_dir = job.output.dir / "partitions"
    manifest = make_partitions(files, fmt, prepare_settings, model.tokenizer, partitions_dir, job.output.progress)
    return Prepared(model, manifest, partitions_dir)


def _max_prompt_tokens(job: JobSettings, model_config: ModelConfig) -> int:
    """The longest prompt preparing lets through. Rows that set their own max_tokens are checked against it
    when their partition loads (request_params), so here only the model's context bounds them."""
    if "max_tokens" in job.data.columns.sampling:
        return model_config.max_positions - 1
    return get_task(job.task).max_prompt_tokens(model_config.max_positions, job.sampling.max_tokens)
