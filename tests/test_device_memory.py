"""The GPU path's first-contact faults, checked on the CPU: an engine's KV pool goes back when its job ends (no
reference cycle left for the garbage collector), the C++ kernel never receives a device pointer, and a device that
cannot hold the model or the pool ends the job in one line."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.engine import Engine
from batchprefill.engine.kv_cache import pool_blocks
from batchprefill.engine.request import Request
from batchprefill.errors import JobError
from batchprefill.kernels.native import paged_decode
from batchprefill.kernels.torch.decode_groups import DecodePlan
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.pipeline.build_engine import device_memory
from batchprefill.sampling_params import SamplingParams
from tests.synthetic import random_paged_batch, tiny_llama


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The garbage collector off for the test: what is freed must be freed by reference counts alone."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("padded_decode", ["off", "eager"])
def test_an_engine_that_ran_12_requests_frees_every_kv_tensor_when_its_with_block_ends(collector_off, padded_decode):
    model = tiny_llama(TorchOps(), num_layers=2)
    config = EngineConfig(EngineSettings(max_num_seqs=4, max_batched_tokens=32), num_blocks=64,
                          padded_decode=padded_decode)
    engine = Engine(model, config, lambda ids: "", ("tiny", "float32"), torch.float32, torch.device("cpu"))
    pool = [weakref.ref(tensor) for pair in engine.runner.kv_caches for tensor in pair]
    assert len(pool) == 4  # 2 layers x (K, V)
    shared = list(range(1, 20))
    requests = [Request(i, shared + [20 + i], SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(12)]
    with engine:
        finished = list(engine.generate(requests))
    assert sorted(len(r.output_token_ids) for r in finished) == [3] * 12
    assert engine.counters.decode_tokens > 0  # counters stay readable after close
    assert [ref() for ref in pool] == [None] * 4  # `engine` is still bound: nothing but close let them go


def test_a_job_through_the_python_api_leaves_none_of_its_pool_alive_when_it_returns(collector_off, monkeypatch):
    import batchprefill
    from batchprefill.engine import model_runner

    pools: list[weakref.ref] = []
    allocate = model_runner.allocate_kv_caches

    def recorded(*args, **kwargs):
        caches = allocate(*args, **kwargs)
        pools.extend(weakref.ref(tensor) for pair in caches for tensor in pair)
        return caches

    monkeypatch.setattr(model_runner, "allocate_kv_caches", recorded)
    result = batchprefill.run(["What is 2+2?", "Name a color."], sampling={"max_tokens": 2}, progress=False,
                              engine={"kv_cache_tokens": 512})
    assert len(result.table) == 2
    assert len(pools) == 60  # the shipped model's 30 layers x (K, V)
    assert all(ref() is None for ref in pools)


@pytest.mark.skipif(paged_decode.load() is None, reason="the C++ kernel is not built here (no compiler)")
def test_the_cpu_kernel_refuses_tensors_on_another_device_in_one_line_instead_of_reading_their_pointers():
    query, k_cache, v_cache, meta = random_paged_batch([(40, 1), (40, 1)], 4, 2, 16, 16, torch.float32, "cpu")
    kernel = paged_decode.load()
    tables = meta.block_tables.tolist()
    plan = kernel.plan(meta, [0, 1], [], tables, 16, 2)
    out = torch.empty_like(query)
    plan.attend(query, k_cache, v_cache, 0.25, out)  # on the host: runs
    on_meta = [t.to("meta") for t in (query, k_cache, v_cache)]
    with pytest.raises(ValueError, match=r"^the CPU kernel reads host memory only, and was handed tensors on meta$"):
        plan.attend(*on_meta, 0.25, torch.empty_like(on_meta[0]))


def test_the_torch_backend_plans_its_decodes_as_torch_ops_when_the_pool_is_off_the_cpu():
    query, k_cache, v_cache, meta = random_paged_batch([(40, 1), (40, 1), (7, 1)], 4, 2, 16, 16, torch.float32,
                                                       "cpu")
    ops = TorchOps()
    on_host = ops.plan(meta, k_cache, 4, torch.float32).plan.decodes
    off_host = ops.plan(meta, k_cache.to("meta"), 4, torch.float32).plan.decodes
    if paged_decode.load() is not None:
        assert isinstance(on_host, paged_decode.PagedPlan)
    assert isinstance(off_host, DecodePlan)
    assert all(t.device.type == "meta" for t in (off_host.own_mask,))


def test_a_gpu_pool_that_cannot_hold_a_block_per_sequence_is_one_line_naming_what_to_change(monkeypatch):
    from batchprefill.engine import kv_cache
    from batchprefill.model.config import ModelConfig

    smollm2 = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None,
        max_positions=8192, tie_word_embeddings=True, qkv_bias=False, eos_token_ids=(2,),
    )
    per_block = smollm2.kv_bytes_per_token(2) * 16  # 2 x 30 layers x 3 KV heads x 64 x 2 bytes, x 16 tokens
    assert per_block == 368_640
    monkeypatch.setattr(kv_cache, "_free_memory", lambda device: 100 * per_block)
    cuda = torch.device("cuda")
    assert pool_blocks(smollm2, torch.bfloat16, cuda, 16, 64, None, 10**6) == 100
    with pytest.raises(JobError) as error:
        pool_blocks(smollm2, torch.bfloat16, cuda, 16, 256, None, 10**6)
    line = str(error.value)
    assert "\n" not in line
    assert line.startswith("the KV pool needs at least 90.0 MiB (256 blocks of 16 tokens) but 35.2 MiB of cuda is left")
    assert line.endswith("lower engine.max_num_seqs, set engine.kv_cache_tokens, or use a GPU with more memory")
    assert pool_blocks(smollm2, torch.bfloat16, torch.device("cpu"), 16, 256, None, 10**6) == 100  # the CPU: as before


def test_running_out_of_device_memory_while_loading_is_one_job_error_line():
    expected = r"^cpu ran out of memory for a KV pool of 1\.0 GiB \(0 B free now\): lower engine\.max_num_seqs$"
    with (pytest.raises(JobError, match=expected),
          device_memory(torch.device("cpu"), "a KV pool of 1.0 GiB", "lower engine.max_num_seqs")):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
