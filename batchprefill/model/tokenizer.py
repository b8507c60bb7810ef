"""Tokenizer and chat template of an HF-format folder, through the `tokenizers` library and jinja2."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

ENCODE_ROWS = 1024  # rows per tokenizer call: enough to keep every core busy, few enough to bound its output


class PromptTokenizer:
    def __init__(self, folder: Path):
        folder = Path(folder)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # some folders ship named templates
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template = (
            ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
            if template else None
        )

    def apply_chat_template(self, prompt: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.render_conversation(messages)

    def render_conversation(self, messages: list[dict]) -> str:
        """A conversation (dicts with `role` and `content`) in the chat template, ending with the generation
        prompt, so the model's answer is the next turn."""
        if self.chat_template is None:
            raise ValueError("the model folder has no chat template")
        return self.chat_template.render(
            messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Multi-threaded in the `tokenizers` library; special tokens in the text stay whole."""
        return [encoding.ids for encoding in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @functools.lru_cache(maxsize=1 << 16)  # noqa: B019 - one tokenizer per job; logprobs name the same tokens often
    def decode_one(self, token_id: int) -> str:
        """One token's text, special tokens included (an OpenAI logprobs entry names every token)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
