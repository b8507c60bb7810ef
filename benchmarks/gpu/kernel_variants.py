"""Every Triton kernel variant a GPU job launches, compiled for the GPU's architecture on a machine without one.

    python benchmarks/gpu/kernel_variants.py [--gpus h200,l40s,a100] [--out variants.json]     # a few minutes
    python benchmarks/gpu/kernel_variants.py --compiler-python /tmp/triton36/bin/python         # another Triton

A device session is 15 minutes, and a kernel that the CPU interpreter runs may still fail to compile for a GPU: the
first H200 session lost a run to a kernel reading a global that was not a constexpr, which the interpreter accepts.
Triton's wheel carries the NVIDIA backend and its `ptxas`, so compiling needs no GPU, only the launch's argument
types and constants. This script gets those from the jobs themselves, in two steps:
- **Record** (this process, Triton's interpreter): tiny random models of the families and features a job can have
  (`SETUPS`: heads of 64, 128 and 256; bfloat16, float32 with exact and TF32 dots; e4m3 and e5m2 KV pools; FP8
  linears per channel and per block; mixture of experts in bfloat16 and FP8; a sliding window; batch invariance;
  LoRA adapters) run the engine's warm-up and every padded decode size, which tests/test_start_up.py holds to
  cover every variant a job launches; then the batch-invariant linear (a GPU's only) and the FP8 linears at
  Llama-3-8B's decode shapes (their tiles follow the layer's width). Each kernel launch is recorded, not run, with
  its arguments' types and alignment and its constants. The tile choices are the GPU's: the kernels'
  `interpreting()` answers False while recording, and each GPU profile (`GPUS`) sets what the code asks of the
  device (Hopper or not, multiprocessors, shared memory).
- **Compile** (a child process without the interpreter, `--compiler-python` to use another Triton, such as the
  device's): Triton's own argument binding gives each launch the signature and specialization it would get on
  the GPU, duplicates are dropped, and each variant is compiled to a cubin for the profile's architecture.
  Triton's metadata gives its shared memory, `cuobjdump` its registers, spilled bytes and tensor-core
  instruction.

A variant fails where it does not compile, or needs more shared memory than the architecture gives one program
(`GPUS`: 227 KB on Hopper, 99 KB on Ada, 163 KB on an A100), which a GPU refuses at launch. The printed table
gives each variant's tiles and resources; the exit status is 1 if any variant failed (tests/test_gpu_compile.py).
What compiles may still be wrong or slow on the GPU: this finds what would stop a device run, not what a device
measures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Gpu:
    """What the code asks of a GPU to choose its tiles, and what the GPU gives one program."""

    arch: int  # compute capability as Triton names its targets: 90 = sm_90
    multiprocessors: int
    hopper: bool  # takes the prefill tile table measured on the H200 (`ops._hopper`)
    fp8: bool  # has FP8 (loader.FP8_CAPABILITY): the FP8 setups run on it
    shared_memory: int  # bytes of shared memory one program may have (cudaDevAttrMaxSharedMemoryPerBlockOptin)


GPUS = {
    "h200": Gpu(90, 132, True, True, 232448),
    "l40s": Gpu(89, 142, False, True, 101376),
    "a100": Gpu(80, 108, False, False, 166912),
    "a10": Gpu(86, 72, False, False, 101376),  # consumer Ampere's 99 KB (A10, A40, RTX 3090); not in the suite
}
SUITE_GPUS = ("h200", "l40s", "a100")  # what tests/test_gpu_compile.py compiles for, and the default
TRITON_MODULES = ("attention", "elementwise", "fp8", "lora", "matmul", "moe", "ops", "shared_decode")
BLOCK_SIZE = 16
MAX_NUM_SEQS = 64  # padded decode sizes 1 to 64: the widened FP8 linears' two row tiles among them
LLAMA3_8B_LINEARS = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # (out, in) of qkv, o, gate_up, down


# ---- record ------------------------------------------------------------------------------------------------------


def describe(value: object) -> dict:
    """A launch argument as the compile step rebuilds it: a tensor by dtype and 16-byte alignment, else its value."""
    import torch
    import triton.language as tl

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, tl.dtype):
        return {"tl": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"a launch argument of type {type(value).__name__} cannot be recorded")


class Recorder:
    """Kernel launches under the interpreter, by setup. A launch is recorded, not run: what a launch compiles to
    follows from its arguments' types and the host's choices, never from a kernel's output (the variants came out
    the same with every kernel run), and the interpreter would take minutes at a GPU's tiles."""

    def __init__(self):
        self.launches: dict[str, dict] = {}
        self.setup = ""

    @contextmanager
    def installed(self) -> Iterator[None]:
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def recorded(kernel, *args, grid, warmup, **kwargs):
            launch = {"module": kernel.fn.__module__, "kernel": kernel.fn.__name__,
                      "args": [describe(a) for a in args], "kwargs": {k: describe(v) for k, v in kwargs.items()}}
            key = json.dumps(launch, sort_keys=True)
            self.launches.setdefault(key, launch | {"setups": []})["setups"].append(self.setup)
            return None

        InterpretedFunction.run = recorded
        try:
            yield
        finally:
            InterpretedFunction.run = run


@contextmanager
def choosing_for(gpu: Gpu) -> Iterator[None]:
    """The kernels' host code choosing tiles, and the loader holding FP8 weights, as on `gpu`, while the kernels
    themselves stay interpreted."""
    modules = [importlib.import_module(f"batchprefill.kernels.triton.{name}") for name in TRITON_MODULES]
    modules.append(importlib.import_module("batchprefill.model.loader"))  # whether the GPU multiplies in FP8
    replaced = {"interpreting": lambda: False, "_hopper": lambda device: gpu.hopper,
                "_default_target_programs": lambda device: 2 * gpu.multiprocessors,
                "_multiprocessors": lambda device: gpu.multiprocessors,
                "_shared_memory": lambda device: gpu.shared_memory, "has_fp8": lambda device: gpu.fp8}
    saved = [(module, name, getattr(module, name)) for module in modules for name in replaced if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, replaced[name])
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def hf_folder(folder: Path, kind: str) -> Path:
    """A random tiny HF model of `kind`, saved in float32: 1-2 layers, real head sizes."""
    import torch
    import transformers

    shape = dict(vocab_size=256, hidden_size=256, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                 intermediate_size=384, max_position_embeddings=1024, rms_norm_eps=1e-5, num_hidden_layers=1)
    configs = {
        "llama64": lambda: transformers.LlamaConfig(**(shape | {"head_dim": 64})),
        "llama128": lambda: transformers.LlamaConfig(**shape),
        "llama256": lambda: transformers.LlamaConfig(**(shape | {"head_dim": 256})),
        "mistral_window": lambda: transformers.MistralConfig(**shape, sliding_window=48),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**(shape | {"num_hidden_layers": 2}), num_experts=8,
                                                         num_experts_per_tok=2, moe_intermediate_size=128,
                                                         mlp_only_layers=[0]),
    }
    path = folder / kind
    if not path.exists():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(configs[kind]()).save_pretrained(path)
    return path


def block_fp8_folder(folder: Path, kind: str) -> Path:
    """`kind`'s folder as a block-wise FP8 checkpoint (`quant_method: fp8`, 128 x 128 blocks): every dense linear
    and expert weight quantized by gpu_moe.quantize_blocks."""
    from safetensors.torch import load_file, save_file

    from batchprefill.model.quantization import DENSE_LINEAR, EXPERT_LINEAR

    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    from gpu_moe import quantize_blocks

    source, path = hf_folder(folder, kind), folder / f"{kind}_fp8"
    if not path.exists():
        path.mkdir()
        tensors = load_file(str(source / "model.safetensors"))
        for name in [n for n in tensors if DENSE_LINEAR.match(n) or EXPERT_LINEAR.match(n)]:
            weight = quantize_blocks(tensors[name])
            tensors[name], tensors[name + "_scale_inv"] = weight.data, weight.scale
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((source / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
        (path / "config.json").write_text(json.dumps(config))
    return path


def load(folder: Path, dtype, quantize: str | None = None, batch_invariant: bool = False):
    """The folder's model on the Triton kernels, loaded as a job loads it (`loader.load_model`): its FP8 weights,
    or with `quantize` ("fp8") its linears quantized at load, held as the profile's GPU holds them
    (`choosing_for` answers `has_fp8`)."""
    import torch

    from batchprefill.kernels.triton.ops import TritonOps
    from batchprefill.model.loader import load_model

    return load_model(folder, dtype, torch.device("cpu"), TritonOps(batch_invariant=batch_invariant),
                      quantize=quantize).model


def with_lora():
    """tests/synthetic's tiny Llama with two LoRA adapters on its fused QKV."""
    import torch

    from batchprefill.kernels.lora import AdapterDelta, LoraPart, LoraWeights
    from batchprefill.kernels.triton.ops import TritonOps
    from tests.synthetic import tiny_llama

    model = tiny_llama(TritonOps(), dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(3)

    def delta(rank: int) -> AdapterDelta:
        return AdapterDelta((0.1 * torch.randn(rank, 64, generator=generator)).bfloat16(),
                            [LoraPart(0, 128, 0, rank, (0.1 * torch.randn(128, rank, generator=generator)).bfloat16())])

    model.attach_adapters([{"qkv": LoraWeights(64, 128, {1: delta(8), 2: delta(16)})}])
    return model


@dataclass(frozen=True)
class Setup:
    """A kind of job whose kernel launches are recorded: its model and how it runs."""

    name: str
    folder: str  # `hf_folder`'s kind; "lora": tests/synthetic's tiny Llama with two adapters
    dtype: str = "bfloat16"
    kv: str | None = None  # the KV pool's dtype; None: the model's
    quantize: str | None = None  # model.quantization ("fp8": per channel at load)
    block_fp8: bool = False  # the folder saved as a block-wise FP8 checkpoint (`block_fp8_folder`)
    batch_invariant: bool = False
    tf32: bool = False  # float32 dots as TF32 (torch.set_float32_matmul_precision("high"))
    needs_fp8: bool = False  # only on GPUs with FP8


SETUPS = (
    Setup("bfloat16, head 64", "llama64"),
    Setup("bfloat16, head 128", "llama128"),
    Setup("bfloat16, head 256", "llama256"),
    Setup("float32, head 128", "llama128", dtype="float32"),
    Setup("float32 with TF32 dots, head 128", "llama128", dtype="float32", tf32=True),
    Setup("FP8 e4m3 KV", "llama128", kv="float8_e4m3fn", needs_fp8=True),
    Setup("FP8 e5m2 KV", "llama128", kv="float8_e5m2"),
    Setup("FP8 linears per channel", "llama128", quantize="fp8", needs_fp8=True),
    Setup("FP8 linears in 128 x 128 blocks", "llama128", block_fp8=True, needs_fp8=True),
    Setup("sliding window", "mistral_window"),
    Setup("mixture of experts", "qwen3_moe"),
    Setup("mixture of experts, FP8 experts", "qwen3_moe", block_fp8=True, needs_fp8=True),
    Setup("batch invariant", "llama128", batch_invariant=True),
    Setup("LoRA adapters", "lora"),
)


def build(setup: Setup, folder: Path) -> tuple:
    """(the setup's model on the Triton kernels, its KV pool's dtype), its folders made under `folder`."""
    import torch

    dtype = getattr(torch, setup.dtype)
    kv_dtype = getattr(torch, setup.kv) if setup.kv else dtype
    if setup.folder == "lora":
        return with_lora(), kv_dtype
    path = block_fp8_folder(folder, setup.folder) if setup.block_fp8 else hf_folder(folder, setup.folder)
    return load(path, dtype, setup.quantize, setup.batch_invariant), kv_dtype


def warm_up(model, kv_dtype) -> None:
    """What a job's engine runs before its first step: the warm-up passes, then (without adapters) the padded
    decode at every size, as graph capture runs it."""
    import numpy as np
    import torch

    from batchprefill.engine import model_runner
    from batchprefill.engine.model_runner import ModelRunner

    compiles, model_runner.compiles_kernels = model_runner.compiles_kernels, lambda device: True
    try:
        runner = ModelRunner(model, num_blocks=96, block_size=BLOCK_SIZE, kv_dtype=kv_dtype,
                             device=torch.device("cpu"), padded_decode="eager", max_num_seqs=MAX_NUM_SEQS)
    finally:
        model_runner.compiles_kernels = compiles
    decoder, nothing = runner.decoder, np.zeros(0, dtype=np.int64)
    for size in decoder.sizes if decoder else ():
        decoder._stage(size, nothing, nothing, nothing, nothing, nothing, np.zeros((0, 0), dtype=np.int32))
        decoder._forward(size)
    runner.close()


def fp8_linears_at_8b() -> None:
    """The FP8 linears' launches at Llama-3-8B's decode shapes (1 and 64 rows, then 128 past the widened path), per
    channel and per block."""
    import torch

    from batchprefill.kernels.fp8 import Fp8Weight, fp8_linear

    for out_features, in_features in LLAMA3_8B_LINEARS:
        data = torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn)
        weights = (Fp8Weight(data, torch.ones(out_features)),
                   Fp8Weight(data, torch.ones(out_features // 128, in_features // 128), (128, 128)))
        for rows in (1, 64, 128):
            x = torch.zeros(rows, in_features, dtype=torch.bfloat16)
            for weight in weights[1:] if rows > 64 else weights:  # W8A8 per channel is `_scaled_mm`, not Triton
                fp8_linear(x, weight, None)


def invariant_linears() -> None:
    """The batch-invariant linear's launches (`kernels/triton/matmul.py`, on a GPU only: a CPU's invariant linears
    multiply in fixed slices), in bfloat16 and float32, with and without a bias."""
    import torch

    from batchprefill.kernels.triton.matmul import invariant_linear

    for dtype in (torch.bfloat16, torch.float32):
        weight, bias = torch.zeros(384, 256, dtype=dtype), torch.zeros(384, dtype=dtype)
        for rows in (1, 100):
            invariant_linear(torch.zeros(rows, 256, dtype=dtype), weight, bias)
            invariant_linear(torch.zeros(rows, 256, dtype=dtype), weight)


def record(gpu: Gpu, folder: Path) -> list[dict]:
    """Every launch of every setup `gpu` runs, with the GPU's tile choices."""
    import torch

    recorder = Recorder()
    with torch.no_grad(), recorder.installed(), choosing_for(gpu):
        for setup in SETUPS:
            if setup.needs_fp8 and not gpu.fp8:
                continue
            recorder.setup = setup.name
            precision = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("high" if setup.tf32 else precision)
            try:
                warm_up(*build(setup, folder))
            finally:
                torch.set_float32_matmul_precision(precision)
        recorder.setup = "batch-invariant linears"
        invariant_linears()
        if gpu.fp8:
            recorder.setup = "FP8 linears at Llama-3-8B's shapes"
            fp8_linears_at_8b()
    return list(recorder.launches.values())


# ---- compile (a process without the interpreter) -----------------------------------------------------------------


def rebuild(described: dict):
    """A stand-in argument with the recorded type, alignment or value."""
    import torch
    import triton.language as tl

    if "tensor" in described:
        tensor = torch.empty(64, dtype=getattr(torch, described["tensor"]))
        return tensor if described["aligned"] else tensor[1:]
    if "tl" in described:
        return getattr(tl, described["tl"])
    return described["value"]


RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
# Tensor-core instructions in SASS, most specific first: Hopper's FP8 and 16-bit warpgroup MMAs, then mma.sync.
MMA_INSTRUCTIONS = ("QGMMA", "HGMMA", "HMMA")


def resources(cubin: bytes) -> dict:
    """Registers, stack and local (spilled) bytes of a cubin's kernel, as cuobjdump reports them, and the
    tensor-core instruction its SASS uses ("-": none)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True)
        sass = subprocess.run([str(tool), "-sass", file.name], capture_output=True, text=True).stdout
    found = RESOURCES.search(usage.stdout)
    mma = next((name for name in MMA_INSTRUCTIONS if name in sass), "-")
    if not found:
        return {"mma": mma}
    registers, stack, _, local = map(int, found.groups())
    return {"registers": registers, "stack_bytes": stack, "spilled_bytes": local, "mma": mma}


def distinct_variants(launches: list[dict], arch: int) -> list[dict]:
    """The distinct variants of `launches` on sm_`arch`: each as Triton's launcher binds it (signature, constants,
    specialization, options), with the setups that launched it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    variants: dict[str, dict] = {}
    for launch in launches:
        kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
        kwargs = {k: rebuild(v) for k, v in launch["kwargs"].items()}
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*[rebuild(a) for a in launch["args"]], **kwargs)
        options, signature, constants, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        key = json.dumps([launch["kernel"], signature, sorted(map(repr, constants.items())),
                          sorted(map(repr, attrs.items())), repr(options)])
        named = {p.name: value for p, value in zip(kernel.params, bound.values()) if p.is_constexpr}
        variant = variants.setdefault(key, {
            "module": launch["module"], "kernel": launch["kernel"], "signature": signature, "constants": constants,
            "attrs": attrs, "options": options.__dict__, "setups": [],
            "named_constants": named})
        variant["setups"] += [s for s in launch["setups"] if s not in variant["setups"]]
    return list(variants.values())


def compile_variant(variant: dict, arch: int) -> dict:
    """One variant compiled to a cubin for sm_`arch`: its resources, or the error that stopped it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    kernel = getattr(importlib.import_module(variant["module"]), variant["kernel"])
    result = {"kernel": variant["kernel"], "setups": variant["setups"], "triton": triton.__version__,
              "constants": variant["named_constants"], "num_warps": variant["options"]["num_warps"],
              "num_stages": variant["options"]["num_stages"]}
    began = time.perf_counter()
    try:
        compiled = compile(ASTSource(kernel, variant["signature"], variant["constants"], variant["attrs"]),
                           target=GPUTarget("cuda", arch, 32), options=variant["options"])
    except Exception as error:  # noqa: BLE001 - every failure is the finding, reported per variant
        result["error"] = " ".join(f"{type(error).__name__}: {error}".split())[:2000]
    else:
        result |= {"shared_bytes": compiled.metadata.shared, **resources(compiled.asm["cubin"])}
    result["seconds"] = round(time.perf_counter() - began, 2)
    return result


def compile_all(launches: list[dict], arch: int) -> list[dict]:
    """Each distinct variant of `launches` compiled for sm_`arch`, on every core (compiling is single-threaded)."""
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial
    from multiprocessing import get_context

    variants = distinct_variants(launches, arch)
    with ProcessPoolExecutor(os.cpu_count(), mp_context=get_context("fork")) as pool:
        return list(pool.map(partial(compile_variant, arch=arch), variants))


def compile_in_child(launches: list[dict], arch: int, python: str) -> list[dict]:
    """`compile_all` in a fresh process without the interpreter (Triton chooses it at import)."""
    with tempfile.TemporaryDirectory() as folder:
        given, got = Path(folder) / "launches.json", Path(folder) / "compiled.json"
        given.write_text(json.dumps(launches))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([python, __file__, "--compile", str(given), str(arch), str(got)], env=env,
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"the compile step for sm_{arch} failed: {done.stderr[-3000:]}")
        return json.loads(got.read_text())


# ---- report --------------------------------------------------------------------------------------------------------


def verdicts(results: list[dict], gpu: Gpu) -> list[str]:
    """Why each failed variant would stop a run on `gpu`."""
    failures = []
    for result in results:
        if "error" in result:
            failures.append(f"{result['kernel']} {result['constants']}: {result['error'][:300]}")
        elif result["shared_bytes"] > gpu.shared_memory:
            failures.append(f"{result['kernel']} {result['constants']}: {result['shared_bytes']:,} bytes of shared "
                            f"memory, the GPU gives a program {gpu.shared_memory:,}")
    return failures


def table(results: list[dict], gpu: Gpu) -> Iterator[str]:
    yield (f"{'kernel':28s} {'tiles (constants)':58s} {'warps':>5s} {'stages':>6s} {'shared KB':>9s} {'regs':>4s} "
           f"{'spill B':>7s} {'mma':>5s} {'s':>5s}")
    for result in sorted(results, key=lambda r: (r["kernel"], str(r["constants"]))):
        tiles = ", ".join(f"{k}={v}" for k, v in result["constants"].items() if k.startswith(("BLOCK", "GROUP")))
        if "error" in result:
            yield f"{result['kernel']:28s} {tiles[:58]:58s} FAILED: {result['error'][:200]}"
            continue
        over = " OVER" if result["shared_bytes"] > gpu.shared_memory else ""
        yield (f"{result['kernel']:28s} {tiles[:58]:58s} {result['num_warps']:5d} {result['num_stages']:6d} "
               f"{result['shared_bytes'] / 1024:9.1f} {result.get('registers', -1):4d} "
               f"{result.get('spilled_bytes', -1):7d} {result.get('mma', '?'):>5s} {result['seconds']:5.2f}{over}")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--compile":  # the child: launches file, arch, results file
        launches = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[4]).write_text(json.dumps(compile_all(launches, int(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default=",".join(SUITE_GPUS),
                        help=f"profiles to compile for, of {', '.join(GPUS)} (default: {', '.join(SUITE_GPUS)})")
    parser.add_argument("--compiler-python", default=sys.executable,
                        help="the Python whose Triton compiles (default: this one)")
    parser.add_argument("--out", type=Path, help="write every variant's result as JSON here")
    args = parser.parse_args()
    os.environ["TRITON_INTERPRET"] = "1"  # before batchprefill imports triton: the recording runs the kernels
    sys.path.insert(0, str(ROOT))
    report, failed = {}, False
    with tempfile.TemporaryDirectory() as folder:
        for name in args.gpus.split(","):
            gpu = GPUS[name]
            began = time.perf_counter()
            launches = record(gpu, Path(folder))
            recorded = time.perf_counter() - began
            results = compile_in_child(launches, gpu.arch, args.compiler_python)
            failures = verdicts(results, gpu)
            failed |= bool(failures)
            print(f"\n{name} (sm_{gpu.arch}, {gpu.shared_memory // 1024} KB of shared memory a program): "
                  f"{len(launches)} launches recorded in {recorded:.0f} s, {len(results)} variants compiled in "
                  f"{sum(r['seconds'] for r in results):.0f} s, {len(failures)} failed", flush=True)
            print("\n".join(table(results, gpu)), flush=True)
            for failure in failures:
                print(f"FAILED on {name}: {failure}", flush=True)
            report[name] = {"gpu": gpu.__dict__, "variants": results, "failures": failures}
            if args.out:
                args.out.write_text(json.dumps(report, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
