"""Start-up on a GPU compiles the kernels before the first step (a warm-up forward that writes nothing to the pool)
and says so to the progress bar; on the CPU nothing of it runs. The warm-up itself runs here on the Triton kernels
under the interpreter, on a tiny random Llama."""

import inspect
import random

import pytest
import torch

import batchprefill.kernels.triton.ops as triton_ops
from batchprefill.engine import model_runner
from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.engine import Engine
from batchprefill.engine.model_runner import ModelRunner
from batchprefill.kernels.lora import AdapterDelta, LoraPart, LoraWeights
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
    # decode; the long chunk and the 40-token one (capped at the long chunk's 20 here): prefill
    assert launched == ["prefill_attention", "decode_attention", "prefill_attention", "shared_decode_attention",
                        "prefill_attention", "prefill_attention"]
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


# --- every kernel variant a job launches was compiled by the warm-up ------------------------------------------------
#
# On a GPU, Triton compiles a kernel once per variant: its constexpr arguments, its tensors' dtypes and 16-byte
# alignment, and whether each integer argument (unless marked do_not_specialize) is 1 or a multiple of 16. A variant
# first met inside a job compiles there, while the step waits (0.5-1.5 s each on an H200). Under the interpreter
# nothing compiles, so these tests key each launch as Triton does and check that a job's launches are all among the
# warm-up's. Launches of the padded decode path are left out: on a GPU they replay graphs captured at start-up.


def launch_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a launch of `kernel` (an interpreted `triton.jit` function) for."""
    unspecialized = set(kernel.kwargs.get("do_not_specialize") or ())
    bound = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    parts = []
    for name, parameter in inspect.signature(kernel.fn).parameters.items():
        value = bound.get(name)
        if "constexpr" in str(parameter.annotation):
            parts.append((name, repr(value)))
        elif isinstance(value, torch.Tensor):
            parts.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or not isinstance(value, int):
            parts.append((name, type(value).__name__))
        elif name in unspecialized:
            parts.append((name, "int"))
        else:
            parts.append((name, "int", value == 1, value % 16 == 0))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in kernel.arg_names))
    return kernel.fn.__name__, tuple(parts), options


def variants_launched(monkeypatch, model, padded_decode: str, adapters: list[int]) -> tuple[set, set]:
    """(the warm-up's variants, the variants a job of 9 shared-prefix prompts, a long one, and 1-8 output tokens
    each launches), the job on an engine of 4 sequences and a 24-token budget, its requests under `adapters` in
    turn."""
    from triton.runtime.interpreter import InterpretedFunction

    from batchprefill.engine.decode_graphs import PaddedDecode
    from batchprefill.engine.request import Request
    from batchprefill.sampling_params import SamplingParams

    launches: dict[str, set] = {"warm-up": set(), "job": set()}
    phase, replaying = ["warm-up"], [False]
    run, padded_run = InterpretedFunction.run, PaddedDecode.run

    def recorded(kernel, *args, grid, warmup, **kwargs):
        if not replaying[0]:
            launches[phase[0]].add(launch_key(kernel, args, kwargs))
        return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

    def replayed(decoder, *args, **kwargs):
        replaying[0] = True
        try:
            return padded_run(decoder, *args, **kwargs)
        finally:
            replaying[0] = False

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    monkeypatch.setattr(PaddedDecode, "run", replayed)
    monkeypatch.setattr(model_runner, "compiles_kernels", lambda device: True)  # as on a GPU
    config = EngineConfig(EngineSettings(block_size=8, max_num_seqs=4, max_batched_tokens=24), 64,
                          padded_decode=padded_decode)
    engine = Engine(model, config, str, ("tiny",), torch.bfloat16, torch.device("cpu"))
    phase[0] = "job"
    rng = random.Random(0)
    prompts = []
    for length in (20, 33, 40):
        prefix = [rng.randrange(1, 50) for _ in range(length)]
        prompts += [prefix + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 14))] for _ in range(3)]
    prompts.append([rng.randrange(1, 50) for _ in range(70)])  # chunked over three steps
    requests = [Request(i, prompt, SamplingParams(max_tokens=rng.randrange(1, 9), ignore_eos=True),
                        adapter=adapters[i % len(adapters)]) for i, prompt in enumerate(prompts)]
    assert len(list(engine.generate(requests))) == len(prompts)
    return launches["warm-up"], launches["job"]


@pytest.mark.parametrize("padded_decode", ["eager", "off"])
def test_a_shared_prefix_job_launches_no_kernel_variant_the_warm_up_did_not_compile(monkeypatch, padded_decode):
    # "off": decode-only steps run eagerly, whose kernels take variants of their own (3 of this job's 11)
    warm, job = variants_launched(monkeypatch, tiny_llama(TritonOps(), dtype=torch.bfloat16), padded_decode, [0])
    assert job and not job - warm, sorted(key[0] for key in job - warm)


def test_a_job_mixing_two_lora_adapters_and_the_base_launches_no_variant_the_warm_up_did_not_compile(monkeypatch):
    model = tiny_llama(TritonOps(), dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(3)

    def delta(rank: int) -> AdapterDelta:  # every output of the fused QKV (64 + 2 x 32) under one part
        return AdapterDelta((0.1 * torch.randn(rank, 64, generator=generator)).bfloat16(),
                            [LoraPart(0, 128, 0, rank, (0.1 * torch.randn(128, rank, generator=generator)).bfloat16())])

    model.attach_adapters([{"qkv": LoraWeights(64, 128, {1: delta(8), 2: delta(16)})}])
    warm, job = variants_launched(monkeypatch, model, "eager", [1, 0, 2])
    assert any(key[0] == "_lora_kernel" for key in job)
    assert not job - warm, sorted(key[0] for key in job - warm)


def test_a_job_on_fp8_linears_launches_no_variant_the_warm_up_did_not_compile(monkeypatch):
    """FP8 linears widen their weights in 16-row tiles up to 16 rows and 64-row tiles up to 64 (then W8A8): a
    job whose decodes run eagerly (no padded path: engine.cuda_graphs=false) launches both tile sizes, and mixed
    steps of 17-24 rows here."""
    model = tiny_llama(TritonOps(), dtype=torch.bfloat16, fp8=True)
    warm, job = variants_launched(monkeypatch, model, "off", [0])
    assert "_widened_matmul_kernel" in {key[0] for key in job}
    assert not job - warm, sorted(key[0] for key in job - warm)
