"""Shared fixtures: the shipped model converted once, loaded once per session, in float32 on the CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: kernels run on the CPU
# Jobs the tests start run the shipped model in float32 whatever the CPU (model.dtype=auto would pick bfloat16 on
# one with AMX or AVX-512 bfloat16); the bfloat16 tests ask for it by name.
os.environ.setdefault("BATCHPREFILL_MODEL_DTYPE", "float32")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(max(1, os.cpu_count() or 1))

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_folder() -> Path:
    """The shipped GGUF as an HF-format folder (converted once into the cache)."""
    from batchprefill.model.loader import resolve_folder

    return resolve_folder(None)


@pytest.fixture(scope="session")
def tokenizer(model_folder):
    from batchprefill.model.tokenizer import PromptTokenizer

    return PromptTokenizer(model_folder)


@pytest.fixture(scope="session")
def loaded_model(model_folder):
    """SmolLM2-135M on the torch path in float32: one load for the whole session."""
    from batchprefill.kernels.torch.ops import TorchOps
    from batchprefill.model.loader import load_model

    return load_model(model_folder, torch.float32, torch.device("cpu"), TorchOps())


@pytest.fixture(scope="session")
def hf_reference(model_folder):
    """transformers' own Llama on the same GGUF: an implementation independent of ours."""
    import transformers

    from batchprefill.model.loader import shipped_gguf
    gguf = shipped_gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


def run_cli(args: list[str], cwd: Path | None = None, env: dict | None = None, timeout: int = 600):
    """Run a console script as a user would, returning the completed process."""
    import subprocess
    import sys

    # This interpreter's scripts first, so the suite also runs from a virtual environment that is not activated.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return subprocess.run(args, cwd=cwd or REPO, env={**os.environ, "PATH": path, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def make_engine(loaded_model, tokenizer):
    """An engine on the session's model; keyword arguments override `num_blocks`, `padded_decode` and
    EngineSettings fields, `structured` gives it structured outputs."""
    from batchprefill.engine.config import EngineConfig, EngineSettings
    from batchprefill.engine.engine import Engine

    def build(structured=None, num_blocks=512, padded_decode="off", **settings):
        config = EngineConfig(EngineSettings(**settings), num_blocks, padded_decode)
        return Engine(loaded_model.model, config, tokenizer.decode, (loaded_model.identity, "float32"),
                      torch.float32, torch.device("cpu"), structured)

    return build


CHAT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
QUESTIONS = [
    "What is the capital of France?", "Name three colors.", "What is 2+2?", "Who wrote Hamlet?",
    "Tell me a fun fact about cats.", "What is the largest planet?", "How many legs does a spider have?",
    "What do bees make?", "Translate 'hello' into Spanish.", "What is the boiling point of water?",
]


@pytest.fixture(scope="session")
def chat_prompts(tokenizer) -> list[list[int]]:
    """Ten chat-formatted questions sharing a system prompt: token ids."""
    texts = [f"{CHAT}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n" for q in QUESTIONS]
    return tokenizer.encode_batch(texts)
