"""Tokenizer and chat template of an HF-format folder, through the `tokenizers` library and jinja2.

The chat template is found where transformers finds it and rendered as its `apply_chat_template` renders it, so a
prompt reads the same text here as under transformers: `chat_template.jinja` (what transformers saves today) and
named templates in `additional_chat_templates/*.jinja`, else a processor's `chat_template.json`, else the
`chat_template` of `tokenizer_config.json` (a string, or a list of named templates). Of named templates, the one
named `default` is used, as transformers picks it when no name is given.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

ENCODE_ROWS = 1024  # rows per tokenizer call: enough to keep every core busy, few enough to bound its output
TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"
DEFAULT_TEMPLATE = "default"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # handed to the template, as transformers does


class PromptTokenizer:
    def __init__(self, folder: Path):
        folder = Path(folder)
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        legacy_path = folder / "special_tokens_map.json"  # read under the config's tokens, as transformers reads it
        config = {**(json.loads(legacy_path.read_text()) if legacy_path.exists() else {}), **config}
        self.special_tokens = {name: text for name in SPECIAL_TOKENS if (text := _token_text(config.get(name)))}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        templates = chat_templates(folder, config)
        self.template_names = sorted(templates)
        template = templates.get(DEFAULT_TEMPLATE)
        self.chat_template = _environment().from_string(template) if template else None

    def apply_chat_template(self, prompt: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return self.render_conversation(messages)

    def render_conversation(self, messages: list[dict]) -> str:
        """A conversation (dicts with `role` and `content`) in the chat template, ending with the generation
        prompt, so the model's answer is the next turn."""
        if self.chat_template is None:
            raise ValueError("the model folder has no chat template")
        return self.chat_template.render(
            messages=messages, add_generation_prompt=True, tools=None, documents=None, **self.special_tokens
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


def chat_templates(folder: Path, config: dict) -> dict[str, str]:
    """The folder's chat templates by name, from the first place that has any, in transformers' order; a single
    unnamed one is `default`."""
    named = {path.stem: path.read_text(encoding="utf-8")
             for path in sorted((folder / NAMED_TEMPLATES_DIR).glob("*.jinja"))}
    if (folder / TEMPLATE_FILE).is_file():
        named[DEFAULT_TEMPLATE] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if named:
        return named
    if (folder / PROCESSOR_TEMPLATE_FILE).is_file():
        template = json.loads((folder / PROCESSOR_TEMPLATE_FILE).read_text(encoding="utf-8")).get("chat_template")
        if template:
            return {DEFAULT_TEMPLATE: template}
    template = config.get("chat_template")
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}
    return {DEFAULT_TEMPLATE: template} if template else {}


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`, which transformers' templates may use to mark the assistant's
    text (for its masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON as transformers' templates get it: not HTML-escaped (jinja's own filter escapes `<`, `&`)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox transformers renders chat templates in: its whitespace control, loop controls, and the
    functions and filter templates on the hub call (`raise_exception`, `strftime_now`, `tojson`)."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_Generation, loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment
