"""HF-format folders of Llama-family models load and match transformers; the Triton backend matches torch."""

import json
import shutil

import pytest
import torch
import transformers

from batchprefill.engine.config import EngineConfig, EngineSettings
from batchprefill.engine.engine import Engine
from batchprefill.engine.request import Request
from batchprefill.errors import JobError
from batchprefill.kernels.torch.ops import TorchOps
from batchprefill.model.decoder import DecoderModel
from batchprefill.model.families import read_config
from batchprefill.model.loader import load_model, resolve_folder
from batchprefill.sampling_params import SamplingParams
from tests.test_numerics import prefill_logits

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


def save_tiny(kind: str, folder, model_folder) -> transformers.PreTrainedModel:
    """A random tiny model of this family saved as an HF folder, with the shipped tokenizer beside it."""
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**TINY, rope_theta=50000.0)
    else:
        config = transformers.Qwen2Config(**TINY, rope_theta=50000.0, use_sliding_window=False)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if kind == "qwen2":  # random biases, so a dropped bias shows
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(model_folder / "tokenizer.json", folder / "tokenizer.json")
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_folder_loads_and_matches_transformers(kind, tmp_path, model_folder):
    reference = save_tiny(kind, tmp_path, model_folder)
    loaded = load_model(resolve_folder(str(tmp_path)), torch.float32, torch.device("cpu"), TorchOps())
    assert loaded.model.config.qkv_bias == (kind == "qwen2")
    ids = list(range(100, 141))
    ours = prefill_logits(loaded.model, ids, chunk=16)
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4


def test_rope_theta_is_read_from_either_config_layout(tmp_path, model_folder):
    save_tiny("llama", tmp_path, model_folder)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 1234.0
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_config(tmp_path).rope_theta == 1234.0
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 4321.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_config(tmp_path).rope_theta == 4321.0


def test_a_folder_without_a_tokenizer_is_a_job_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(JobError, match="tokenizer.json"):
        resolve_folder(str(tmp_path))


def test_triton_backend_gives_the_torch_backend_greedy_tokens(tmp_path, model_folder):
    """A whole engine run under the Triton interpreter on a tiny random model: same tokens as torch, also
    through the padded decode buffers that CUDA graphs capture (run eagerly here: no GPU)."""
    from batchprefill.kernels.triton.ops import TritonOps

    save_tiny("llama", tmp_path, model_folder)
    config = read_config(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    weights = {k: v.float() for k, v in reference.state_dict().items()}
    prompts = [list(range(7, 40)), list(range(7, 30)) + [5, 6, 7], [9] * 5]
    outputs = {}
    backends = (("torch", TorchOps(), "off"), ("triton", TritonOps(), "off"), ("padded", TritonOps(), "eager"))
    for name, ops, padded in backends:
        engine_config = EngineConfig(EngineSettings(block_size=8, max_batched_tokens=24, max_num_seqs=4),
                                     num_blocks=64, padded_decode=padded)
        engine = Engine(DecoderModel(config, weights, ops), engine_config, lambda ids: "", ("tiny",),
                        torch.float32, torch.device("cpu"))
        requests = [Request(i, p, SamplingParams(max_tokens=5, ignore_eos=True)) for i, p in enumerate(prompts)]
        outputs[name] = {r.request_id: r.output_token_ids for r in engine.generate(requests)}
        assert sum(r.num_cached_tokens for r in requests) > 0  # the second prompt reuses the first's blocks
    assert outputs["triton"] == outputs["torch"]
    assert outputs["padded"] == outputs["torch"]  # the fixed buffers a CUDA graph replays give the same tokens
