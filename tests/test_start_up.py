"""Start-up on a GPU compiles the kernels before the first step (a warm-up forward that writes nothing to the pool)
and says so to the progress bar; on the CPU nothing of it runs. The warm-up itself runs here on the Triton kernels
under the interpreter, on a tiny random Llama."""

import torch

import batchprefill.kernels.triton.ops as triton_ops
from batchprefill.engine import model_runner
from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.engine import Engine
from batchprefill.engine.model_runner import ModelRunner
from batchprefill.kernels.triton.ops import TritonOps
from tests.synthetic import tiny_llama


def test_the_warm_up_runs_prefill_plain_and_shared_decode_kernels_and_leaves_the_pool_all_zero(monkeypatch):
    launched = []
    for name in ("prefill_attention", "decode_attention", "shared_decode_attention"):
        kernel = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, _k=kernel, _n=name, **kw: launched.append(_n) or _k(*a, **kw))
    runner = ModelRunner(tiny_llama(TritonOps()), num_blocks=8, block_size=8, kv_dtype=torch.float32,
                         device=torch.device("cpu"), padded_decode="eager", max_num_seqs=4)
    assert not launched  # the CPU skips it when building the runner
    runner.warm_up(long_chunk=20)
    # the mixed pass: the prefill kernel (two chunks) and the decode kernel (two decodes at contexts 16 and 3,
    # no block in common); a chunk beside two decodes at context 16 holding the same 2 blocks: the shared-prefix
    # decode; the long chunk: prefill
    assert launched == ["prefill_attention", "decode_attention", "prefill_attention", "shared_decode_attention",
                        "prefill_attention"]
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)


def test_where_kernels_compile_the_runner_warms_up_before_its_padded_decode_and_says_so(monkeypatch):
    phases = []
    monkeypatch.setattr(model_runner, "compiles_kernels", lambda device: True)  # as on a GPU
    runner = ModelRunner(tiny_llama(TritonOps()), num_blocks=8, block_size=8, kv_dtype=torch.float32,
                         device=torch.device("cpu"), padded_decode="eager", max_num_seqs=4, on_phase=phases.append)
    assert phases == ["compiling kernels"] and runner.decoder is not None  # "capturing graphs" only with graphs
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)


def test_an_engine_on_the_cpu_reports_no_start_up_phase(monkeypatch):
    phases = []
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self, *a: phases.append("warm_up"))
    config = EngineConfig(EngineSettings(block_size=8, max_num_seqs=4), 8, padded_decode="eager")
    Engine(tiny_llama(TritonOps()), config, str, ("tiny",), torch.float32, torch.device("cpu"),
           on_phase=phases.append)
    assert phases == []
