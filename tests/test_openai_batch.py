"""OpenAI Batch API files: the JSONL reader (bad lines become error rows, bounded memory on a million lines),
the results.jsonl writer, and a whole job against the same chats through the Parquet path."""

import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchprefill.io.openai_batch import SCHEMA, OpenAIBatchFile
from batchprefill.io.openai_results import write_results_jsonl
from tests.conftest import REPO, run_cli

SYSTEMS = ["You answer in one short sentence.", "You are a geography teacher. Be brief."]
QUESTIONS = ["What is the capital of France?", "Name a large ocean.", "What do bees make?"]
FAST = ["sampling.max_tokens=10", "engine.kv_cache_tokens=4096", "output.progress=false"]


def chat_line(custom_id: str, system: str, question: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2", "messages": [{"role": "system", "content": system},
                                                      {"role": "user", "content": question}], **body}}


def write_jsonl(path, lines: list) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def read_rows(path, batch_size: int = 8192) -> list[dict]:
    return [row for batch in OpenAIBatchFile([path]).to_batches(batch_size=batch_size) for row in batch.to_pylist()]


def test_each_kind_of_bad_line_gets_its_code_and_the_good_lines_keep_their_parameters(tmp_path):
    lines = [
        chat_line("a", SYSTEMS[0], QUESTIONS[0], max_completion_tokens=5, temperature=0.7, top_p=0.9, n=2,
                  stop="\n", seed=7, logprobs=True, top_logprobs=3, response_format={"type": "json_object"}),
        {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "Once upon a time", "max_tokens": 4,
                                                             "logprobs": 2, "stop": ["."]}},
        "{not json",
        chat_line("a", SYSTEMS[0], QUESTIONS[1]),  # a duplicate custom_id
        {"url": "/v1/completions", "body": {"prompt": "no id"}},
        {"custom_id": "c", "url": "/v1/moderations", "body": {"input": "x"}},
        {"custom_id": "d", "url": "/v1/chat/completions", "body": {"max_tokens": 3}},
        chat_line("e", SYSTEMS[0], QUESTIONS[2], temperature="hot"),
        chat_line("f", SYSTEMS[0], QUESTIONS[2], top_logprobs=21),
        {"custom_id": "g", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}},
    ]
    path = tmp_path / "batch.jsonl"
    write_jsonl(path, lines[:5] + [""] + lines[5:])  # a blank line is no request
    rows = read_rows(path, batch_size=3)  # the duplicate is found across batches
    assert OpenAIBatchFile([path]).count_rows() == len(rows) == 10
    codes = [(row["custom_id"], row["error_code"]) for row in rows]
    assert codes == [("a", None), ("b", None), ("#line-3", "invalid_json"), ("#line-4", "duplicate_custom_id"),
                     ("#line-5", "missing_custom_id"), ("c", "invalid_url"), ("d", "missing_input"),
                     ("e", "invalid_parameter"), ("f", "invalid_parameter"), ("g", "invalid_messages")]
    assert [row["line"] for row in rows] == [1, 2, 3, 4, 5, 7, 8, 9, 10, 11]
    assert all(row["error_message"] for row in rows[2:])
    a, b = rows[0], rows[1]
    assert a["messages"] == [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": QUESTIONS[0]}]
    assert (a["max_tokens"], a["temperature"], a["top_p"], a["n"], a["stop"], a["seed"], a["logprobs"],
            a["top_logprobs"], json.loads(a["response_format"])) == (
        5, 0.7, 0.9, 2, ["\n"], 7, True, 3, {"type": "json_object"})
    assert (b["prompt"], b["messages"], b["max_tokens"], b["logprobs"], b["top_logprobs"], b["stop"]) == (
        "Once upon a time", None, 4, True, 2, ["."])
    assert b["temperature"] is None and b["n"] is None  # unset: the job's sampling.* values apply


def test_developer_messages_and_text_parts_become_plain_chat_turns(tmp_path):
    path = tmp_path / "batch.jsonl"
    write_jsonl(path, [{"custom_id": "x", "url": "/v1/chat/completions", "body": {"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]}}])
    assert read_rows(path)[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hello\nthere"}]


def test_a_million_line_file_streams_with_peak_memory_flat_after_its_first_batch(tmp_path):
    path = tmp_path / "million.jsonl"
    # completion lines with long prompts: a large file, cheap to parse (the cost is per JSON object)
    line = '{{"custom_id": "req-{0}", "url": "/v1/completions", "body": {{"prompt": "Q{0}: ' + "x" * 120 + '"}}}}\n'
    with open(path, "w") as handle:
        for start in range(0, 1_000_000, 10_000):
            handle.write("".join(line.format(i) for i in range(start, start + 10_000)))
    size_mb = path.stat().st_size / 2**20
    # The first Arrow conversion in a process costs about 54 MB once (allocator and library set-up), so growth
    # is measured from the end of the first batch of 8,192 lines to the end of the file.
    script = textwrap.dedent(f"""
        from pathlib import Path
        from batchprefill.io.openai_batch import OpenAIBatchFile
        def peak_mb():  # VmHWM: this process's peak RSS (ru_maxrss would carry the parent's over exec)
            line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
            return int(line.split()[1]) / 1024
        batches = OpenAIBatchFile([Path({str(path)!r})]).to_batches(batch_size=8192)
        rows = next(batches).num_rows
        first = peak_mb()
        errors = 0
        for batch in batches:
            rows += batch.num_rows
            errors += batch.column("error_code").null_count != batch.num_rows
        print(rows, errors, peak_mb() - first, peak_mb())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr
    rows, batches_with_errors, growth_mb, peak_mb = done.stdout.split()
    assert int(rows) == 1_000_000 and int(batches_with_errors) == 0
    assert size_mb > 190  # the file alone, let alone its Arrow rows, would not fit under the bounds below
    # measured: 11 MB, one batch of lines in flight (repeated custom_ids are found before the first batch)
    assert float(growth_mb) < 64, f"peak RSS grew {growth_mb} MB after the first batch, reading {size_mb:.0f} MB"
    assert float(peak_mb) < 190, f"peak RSS {peak_mb} MB reading a {size_mb:.0f} MB file"


def results_part(rows: list[dict]) -> pa.Table:
    """Rows as the job writes them: the reader's columns, then the output columns."""
    base = {name: None for name in SCHEMA.names}
    return pa.Table.from_pylist([{**base, **row} for row in rows], schema=SCHEMA.append(
        pa.field("output_text", pa.string())).append(pa.field("output_token_ids", pa.list_(pa.int32())))
        .append(pa.field("num_prompt_tokens", pa.int32())).append(pa.field("num_cached_tokens", pa.int32()))
        .append(pa.field("finish_reason", pa.string())).append(pa.field("error", pa.string()))
        .append(pa.field("sample_index", pa.int32())).append(pa.field("output_logprobs", pa.list_(pa.float64())))
        .append(pa.field("output_top_logprobs", pa.list_(pa.list_(
            pa.struct([("token_id", pa.int32()), ("logprob", pa.float64())]))))))


def test_results_jsonl_gathers_two_samples_from_two_parts_with_usage_and_logprobs(tmp_path):
    chat = {"url": "/v1/chat/completions", "num_prompt_tokens": 40, "num_cached_tokens": 32, "logprobs": True}
    results = tmp_path / "results"
    results.mkdir()
    pq.write_table(results_part([
        {**chat, "custom_id": "q", "line": 2, "sample_index": 1, "output_text": "B", "output_token_ids": [66, 2],
         "finish_reason": "stop", "output_logprobs": [-0.5, -0.1],
         "output_top_logprobs": [[{"token_id": 66, "logprob": -0.5}], [{"token_id": 2, "logprob": -0.1}]]},
        {"custom_id": "#line-1", "line": 1, "error_code": "invalid_json", "error_message": "line 1 is not JSON",
         "output_text": "", "output_token_ids": [], "num_prompt_tokens": 0, "num_cached_tokens": 0,
         "finish_reason": "error", "error": "line 1 is not JSON", "sample_index": 0},
    ]), results / "part-0000-a-00000.parquet")
    pq.write_table(results_part([
        {**chat, "custom_id": "q", "line": 2, "sample_index": 0, "output_text": "A", "output_token_ids": [65, 66, 2],
         "finish_reason": "stop", "output_logprobs": [-1.0, -2.0, -0.2],
         "output_top_logprobs": [[{"token_id": 65, "logprob": -1.0}], [], []]},
        {"custom_id": "long", "line": 3, "url": "/v1/completions", "output_text": "", "output_token_ids": [],
         "num_prompt_tokens": 9000, "num_cached_tokens": 0, "finish_reason": "error", "error": "prompt too long",
         "sample_index": 0},
    ]), results / "part-0000-a-00001.parquet")
    path = tmp_path / "results.jsonl"
    names = {2: "<|im_end|>", 65: "A", 66: "B"}
    assert write_results_jsonl(results, path, "smollm2-135m", names.__getitem__) == 3
    bad, good, failed = [json.loads(line) for line in path.read_text().splitlines()]
    assert bad["response"] is None and bad["error"] == {"code": "invalid_json", "message": "line 1 is not JSON"}
    assert failed["response"] is None and failed["error"] == {"code": "request_failed", "message": "prompt too long"}
    assert good["custom_id"] == "q" and good["error"] is None and good["response"]["status_code"] == 200
    body = good["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "smollm2-135m"
    assert [c["message"]["content"] for c in body["choices"]] == ["A", "B"]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45,
                             "prompt_tokens_details": {"cached_tokens": 32}}
    first = body["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["logprob"]) for t in first] == [("A", -1.0), ("B", -2.0), ("<|im_end|>", -0.2)]
    assert first[0]["top_logprobs"] == [{"token": "A", "logprob": -1.0, "bytes": [65]}]


@pytest.fixture(scope="module")
def batch_and_parquet_runs(tmp_path_factory):
    """The same chats as an OpenAI batch file (shuffled, with bad lines and one completion) and as a Parquet
    messages column, each run as a job."""
    folder = tmp_path_factory.mktemp("openai")
    chats = [(f"{s}-{q}", SYSTEMS[s], QUESTIONS[q]) for q in range(3) for s in range(2)]
    lines = [chat_line(*chat) for chat in chats]
    lines.insert(2, "oops")
    lines.insert(4, {"custom_id": "late", "url": "/v1/moderations", "body": {}})
    lines.append({"custom_id": "story", "url": "/v1/completions", "body": {"prompt": "Once upon a time"}})
    lines.append(chat_line("0-0", SYSTEMS[0], QUESTIONS[1]))  # a duplicate custom_id
    source = folder / "batch.jsonl"
    write_jsonl(source, lines)
    batch_out = folder / "batch"
    done = run_cli(["batchprefill-run", "data.format=openai_batch", f"data.input={source}",
                    f"output.dir={batch_out}", *FAST])
    assert done.returncode == 0, done.stderr
    parquet = folder / "chats.parquet"
    pq.write_table(pa.table({"id": [c[0] for c in chats], "messages": [
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
        for _, system, question in chats]}), parquet)
    parquet_out = folder / "parquet"
    done = run_cli(["batchprefill-run", f"data.input={parquet}", "data.messages_column=messages",
                    f"output.dir={parquet_out}", *FAST])
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in (batch_out / "results.jsonl").read_text().splitlines()]
    return chats, answers, pq.read_table(parquet_out / "results").to_pylist(), pq.read_table(batch_out / "results"), \
        batch_out


def test_every_good_custom_id_is_answered_once_with_status_200_and_bad_lines_with_errors(batch_and_parquet_runs):
    chats, answers, _, table, _ = batch_and_parquet_runs
    assert len(answers) == 10 and table.num_rows == 10  # one per input line
    good = {a["custom_id"]: a for a in answers if a["error"] is None}
    assert sorted(good) == sorted([c[0] for c in chats] + ["story"])
    assert all(a["response"]["status_code"] == 200 for a in good.values())
    assert good["story"]["response"]["body"]["object"] == "text_completion"
    assert good["story"]["response"]["body"]["choices"][0]["text"]
    errors = {a["custom_id"]: a["error"]["code"] for a in answers if a["error"] is not None}
    assert errors == {"#line-3": "invalid_json", "late": "invalid_url", "#line-10": "duplicate_custom_id"}
    assert all(a["response"] is None for a in answers if a["error"] is not None)


def test_batch_answers_and_usage_equal_the_same_chats_through_the_parquet_path(batch_and_parquet_runs):
    chats, answers, parquet_rows, _, _ = batch_and_parquet_runs
    by_id = {a["custom_id"]: a["response"]["body"] for a in answers if a["error"] is None}
    for row in parquet_rows:
        body = by_id[row["id"]]
        assert body["choices"][0]["message"]["content"] == row["output_text"]
        assert body["choices"][0]["finish_reason"] == row["finish_reason"]
        assert body["usage"]["prompt_tokens"] == row["num_prompt_tokens"]
        assert body["usage"]["completion_tokens"] == len(row["output_token_ids"])
    cached = [by_id[c[0]]["usage"]["prompt_tokens_details"]["cached_tokens"] for c in chats]
    assert sum(tokens > 0 for tokens in cached) >= 3  # each system prompt computed once, then reused


def test_the_merge_writes_the_same_results_jsonl_from_the_parquet_results(batch_and_parquet_runs):
    _, answers, _, _, out = batch_and_parquet_runs
    (out / "results.jsonl").unlink()
    done = run_cli(["batchprefill-merge", "data.format=openai_batch", f"output.dir={out}"])
    assert done.returncode == 0, done.stderr
    merged = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for line in answers + merged:  # the creation time is the only field that may differ
        if line["response"]:
            line["response"]["body"].pop("created")
    assert merged == answers


def test_a_rerun_into_the_same_folder_resumes_and_writes_the_whole_results_jsonl_again(batch_and_parquet_runs):
    _, answers, _, _, out = batch_and_parquet_runs
    source = out.parent / "batch.jsonl"
    done = run_cli(["batchprefill-run", "data.format=openai_batch", f"data.input={source}", f"output.dir={out}",
                    *FAST])
    assert done.returncode == 0, done.stderr
    assert pq.read_table(out / "results").num_rows == 10  # nothing ran twice
    again = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    for line in answers + again:
        if line["response"]:
            line["response"]["body"].pop("created", None)
    assert again == answers


def test_each_line_gets_the_logprobs_it_asks_for_and_none_when_it_asks_for_none(tmp_path):
    source = tmp_path / "batch.jsonl"
    write_jsonl(source, [
        chat_line("top2", SYSTEMS[0], QUESTIONS[0], logprobs=True, top_logprobs=2),
        chat_line("alone", SYSTEMS[0], QUESTIONS[1], logprobs=True),  # the sampled tokens' logprobs, no others
        chat_line("none", SYSTEMS[0], QUESTIONS[2]),
        {"custom_id": "story", "url": "/v1/completions", "body": {"prompt": "Once upon a time", "logprobs": 1}},
    ])
    done = run_cli(["batchprefill-run", "data.format=openai_batch", f"data.input={source}",
                    f"output.dir={tmp_path / 'out'}", *FAST])
    assert done.returncode == 0, done.stderr
    bodies = {a["custom_id"]: a["response"]["body"] for a in map(json.loads, (tmp_path / "out" / "results.jsonl")
                                                                 .read_text().splitlines())}
    for custom_id, width in (("top2", 2), ("alone", 0)):
        choice, usage = bodies[custom_id]["choices"][0], bodies[custom_id]["usage"]
        content = choice["logprobs"]["content"]
        assert len(content) == usage["completion_tokens"] > 0
        assert all(t["logprob"] <= 0 and len(t["top_logprobs"]) == width for t in content)
        if width:  # greedy: the sampled token is the most likely one
            assert all(t["top_logprobs"][0]["logprob"] == t["logprob"] for t in content)
    assert bodies["none"]["choices"][0]["logprobs"] is None
    story = bodies["story"]["choices"][0]["logprobs"]
    assert len(story["token_logprobs"]) == bodies["story"]["usage"]["completion_tokens"]
    assert all(len(top) == 1 for top in story["top_logprobs"])
