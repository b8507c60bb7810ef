"""engine.max_num_seqs=auto and engine.max_batched_tokens=auto: the CPU keeps 256 sequences and 2,048 tokens a step;
a GPU gets vLLM's offline sizes for its card, the sequences capped by what the KV pool holds of the job's typical
request. The GPU facts (the card's name and memory) are monkeypatched, as the bfloat16 tests patch the CPU's."""

import signal
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir

from batchprefill.engine.config import EngineSettings
from batchprefill.engine.decode_graphs import BATCH_SIZES
from batchprefill.engine.model_runner import ModelRunner
from batchprefill.errors import JobError
from batchprefill.pipeline.engine_sizes import ceiling_num_seqs, resolve_sizes
from batchprefill.pipeline.run import run_job
from batchprefill.settings import CONFIG_DIR, JobSettings

GIB = 2**30
AUTO = EngineSettings(max_num_seqs="auto", max_batched_tokens="auto")
CUDA = torch.device("cuda")


def job_settings(*overrides: str) -> JobSettings:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return JobSettings.from_config(compose("config", overrides=["output.dir=unused", *overrides]))


def on_card(monkeypatch, name: str, gib: int) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(name=name, total_memory=gib * GIB))


def test_both_keys_default_to_auto_and_take_whole_numbers():
    assert job_settings().engine.max_num_seqs == "auto" and job_settings().engine.max_batched_tokens == "auto"
    engine = job_settings("engine.max_num_seqs=512", "engine.max_batched_tokens=8192").engine
    assert (engine.max_num_seqs, engine.max_batched_tokens) == (512, 8192)


@pytest.mark.parametrize("override", ["engine.max_num_seqs=0", "engine.max_num_seqs=many",
                                      "engine.max_batched_tokens=1.5", "engine.max_batched_tokens=true"])
def test_anything_but_a_positive_whole_number_or_auto_is_a_one_line_error(override):
    key, value = override.split("=")
    with pytest.raises(JobError, match=rf"^{key}={value}(: must be >= 1| is an? \w+: give an integer) or auto$"):
        job_settings(override)


def test_on_the_cpu_auto_keeps_256_sequences_and_2048_tokens_whatever_the_pool():
    resolved = resolve_sizes(AUTO, torch.device("cpu"), pool_blocks=10, typical_request_tokens=800)
    assert (resolved.settings.max_num_seqs, resolved.settings.max_batched_tokens) == (256, 2048)
    assert resolved.summary == "engine.max_num_seqs=256 and engine.max_batched_tokens=2048 (auto on the CPU)"


def test_an_h200_with_room_for_them_gets_1024_sequences_and_16384_tokens(monkeypatch):
    on_card(monkeypatch, "NVIDIA H200", 140)
    assert ceiling_num_seqs(AUTO, CUDA) == 1024
    # the 1B job: 201,714 blocks of 16 and 764-token requests (48 blocks) would hold 4,202 sequences
    resolved = resolve_sizes(AUTO, CUDA, pool_blocks=201_714, typical_request_tokens=764)
    assert (resolved.settings.max_num_seqs, resolved.settings.max_batched_tokens) == (1024, 16384)
    assert resolved.summary == ("engine.max_num_seqs=1024 and engine.max_batched_tokens=16384 "
                                "(auto on NVIDIA H200, 140 GiB)")


def test_a_pool_of_10000_blocks_caps_auto_at_200_sequences_of_800_tokens(monkeypatch):
    on_card(monkeypatch, "NVIDIA H100 80GB HBM3", 80)
    resolved = resolve_sizes(AUTO, CUDA, pool_blocks=10_000, typical_request_tokens=800)  # 50 blocks each
    assert resolved.settings.max_num_seqs == 200 and resolved.settings.max_batched_tokens == 16384
    assert resolved.summary.endswith("as many as the KV pool holds of 800-token requests)")


@pytest.mark.parametrize(("name", "gib"), [("NVIDIA A100-SXM4-80GB", 80), ("NVIDIA L4", 22)])
def test_an_a100_and_cards_under_70_gib_get_256_sequences_and_8192_tokens(monkeypatch, name, gib):
    on_card(monkeypatch, name, gib)
    resolved = resolve_sizes(AUTO, CUDA, pool_blocks=10**6, typical_request_tokens=None)
    assert (resolved.settings.max_num_seqs, resolved.settings.max_batched_tokens) == (256, 8192)


def test_a_number_set_is_kept_and_only_the_other_key_is_chosen(monkeypatch):
    on_card(monkeypatch, "NVIDIA H200", 140)
    resolved = resolve_sizes(EngineSettings(max_num_seqs=96, max_batched_tokens="auto"), CUDA, 10, 800)
    assert (resolved.settings.max_num_seqs, resolved.settings.max_batched_tokens) == (96, 16384)
    assert resolved.summary == "engine.max_batched_tokens=16384 (auto on NVIDIA H200, 140 GiB)"
    assert ceiling_num_seqs(resolved.settings, CUDA) == 96
    assert resolve_sizes(EngineSettings(), CUDA, 10, 800).summary == ""  # nothing auto: nothing to say


def test_every_sequence_count_auto_starts_from_is_a_captured_graph_size():
    assert {256, 1024} <= set(BATCH_SIZES) and BATCH_SIZES[-1] == 1024
    assert all(later - earlier <= 64 for earlier, later in zip(BATCH_SIZES, BATCH_SIZES[1:]))  # padding <= 64 rows


def test_a_cpu_job_at_the_defaults_runs_256_by_2048_and_its_summary_says_auto_chose_them(tmp_path, capsys,
                                                                                         monkeypatch):
    def no_warm_up_on_the_cpu(runner, *args):
        raise AssertionError("the kernel warm-up ran on the CPU")

    monkeypatch.setattr(ModelRunner, "warm_up", no_warm_up_on_the_cpu)
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["The capital of France is", "Bees make"]}), data)
    job = job_settings(f"data.input={data}", f"output.dir={tmp_path / 'out'}", "engine.device=cpu",
                       "sampling.max_tokens=2", "engine.kv_cache_tokens=1024", "output.progress=false",
                       "output.plot=false")
    sigterm = signal.getsignal(signal.SIGTERM)  # the run traps SIGTERM to commit what finished: give it back
    try:
        stats = run_job(job)
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert stats["max_batched_tokens"] == 2048
    assert ", with engine.max_num_seqs=256 and engine.max_batched_tokens=2048 (auto on the CPU); a KV pool of " in (
        capsys.readouterr().err)
