"""`data.chat_template=true` finds the template where transformers finds it and renders the text its
`apply_chat_template` renders, on folders saved by the transformers the tests install."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import transformers

import batchprefill
from batchprefill import JobError
from batchprefill.model.tokenizer import PromptTokenizer

SYSTEM = "You answer in one word. Ünïcödé & <tags> stay as they are."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Capital of France?"}]
# A template that uses what hub templates use: loop controls, raise_exception, tojson on non-ASCII text with `<`
# and `&`, a {% generation %} block, and the special tokens.
RICH = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'tool' %}"
    "{{ raise_exception('no tools') }}{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}"
    "<{{ message['role'] }}>{{ message['content'] | tojson }}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{% endgeneration %}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def transformers_text(folder: Path) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    return tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def saved(model_folder, tmp_path_factory) -> Path:
    """The shipped model's tokenizer as transformers saves it today: the template in chat_template.jinja."""
    folder = tmp_path_factory.mktemp("saved")
    transformers.AutoTokenizer.from_pretrained(str(model_folder)).save_pretrained(str(folder))
    return folder


def test_a_folder_transformers_saved_keeps_its_template_only_in_chat_template_jinja_and_renders_the_same(saved):
    assert (saved / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    ours = PromptTokenizer(saved).apply_chat_template("Capital of France?", SYSTEM)
    assert ours == transformers_text(saved) and ours.endswith("<|im_start|>assistant\n")


def test_a_job_with_chat_template_true_on_that_folder_plans_instead_of_saying_it_has_none(saved, model_folder,
                                                                                        tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    for name in ("config.json", "model.safetensors"):
        if (model_folder / name).exists():
            (folder / name).symlink_to(model_folder / name)
    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["Capital of France?", "Two plus two?"]}), data)
    row = batchprefill.plan(data, model=str(folder), progress=False, output={"dir": str(tmp_path / "out")},
                            data={"chat_template": True})
    assert row["requests"] == 2


@pytest.mark.parametrize("place", ["chat_template.jinja", "chat_template.json", "tokenizer_config.json",
                                   "named in tokenizer_config.json", "additional_chat_templates"])
def test_a_template_with_loop_controls_tojson_and_generation_renders_as_transformers_renders_it(saved, tmp_path,
                                                                                              place):
    folder = tmp_path / "folder"
    shutil.copytree(saved, folder)
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if place == "chat_template.jinja":
        (folder / place).write_text(RICH)
    elif place == "chat_template.json":
        (folder / place).write_text(json.dumps({"chat_template": RICH}))
    elif place == "tokenizer_config.json":
        config["chat_template"] = RICH
    elif place == "named in tokenizer_config.json":
        config["chat_template"] = [{"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default",
                                                                                      "template": RICH}]
    else:  # a default file beside a named one
        (folder / place).mkdir()
        (folder / place / "tool_use.jinja").write_text("{{ 'tools' }}")
        (folder / "chat_template.jinja").write_text(RICH)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = PromptTokenizer(folder).render_conversation(MESSAGES)
    assert 'one word. Ünïcödé & <tags> stay as they are."' in ours  # tojson, not HTML-escaped, not ASCII-escaped
    if place != "chat_template.json":  # a processor's file: AutoTokenizer does not read it, AutoProcessor does
        assert ours == transformers_text(folder)


def test_a_folder_whose_templates_are_all_named_but_none_default_says_so(saved, model_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(saved, folder)
    (folder / "chat_template.jinja").rename(folder / "chat.jinja")
    (folder / "additional_chat_templates").mkdir()
    (folder / "chat.jinja").rename(folder / "additional_chat_templates" / "chat.jinja")
    (folder / "config.json").symlink_to(model_folder / "config.json")
    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["Capital of France?"]}), data)
    with pytest.raises(JobError, match=r"data\.chat_template=true needs a chat template, but .* has only named ones "
                                       r"\(chat\), none named default"):
        batchprefill.plan(data, model=str(folder), progress=False, output={"dir": str(tmp_path / "out")},
                          data={"chat_template": True})
