"""The trainer's data stage: prompt files, target-generated responses (cached, resumable),
training samples with a loss mask."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from blockspec.errors import BlockspecError
from blockspec.tokens import encode_prompt, stop_token_ids
from blockspec.training.function_stubs import function_stub
from blockspec.training.prompts import GSM8K_INSTRUCTION, PromptRecord, load_prompts, record_id, restyle_prompts
from blockspec.training.response_cache import meta_path, read_cache
from blockspec.training.responses import generate_responses, responses_from_data
from blockspec.training.samples import load_samples
from helpers import TWO_FAMILIES, make_causal_lm, make_tokenizer


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models run faster on one thread, and far faster when the machine is busy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_causal_lm("llama", vocab_size=len(tokenizer), seed=0)


def user(text):
    return [{"role": "user", "content": text}]


def make_records(n, start=0):
    words = ["fox", "clips", "step by step", "sum of a list", "twelve", "dog", "tokens"]
    return [PromptRecord(id=f"p:{i}", messages=user(" ".join(words[: 1 + (i * 3) % 7]) + f" {i}"))
            for i in range(start, start + n)]


# ---------------------------------------------------------------------------- formats


def test_gsm8k_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k_train.jsonl", [
        {"question": "Natalia sold 48 clips. How many?", "answer": "48 + 24 = 72\n#### 72"},
        {"question": "Weng earns $12 an hour.", "answer": "#### 10"},
    ])
    records, report = load_prompts(path, shuffle=False)
    assert [r.id for r in records] == ["gsm8k_train:0", "gsm8k_train:1"]
    assert records[0].messages == user("Natalia sold 48 clips. How many?" + GSM8K_INSTRUCTION)
    assert records[0].response == "48 + 24 = 72\n#### 72"
    assert report.files[0].kind == "gsm8k" and report.kept == 2 and report.read == 2
    raw, _ = load_prompts(path, shuffle=False, format_prompts=False)
    assert raw[1].messages == user("Weng earns $12 an hour.")


def test_code_alpaca_json_list(tmp_path):
    path = tmp_path / "code_alpaca_2k.json"
    path.write_text(json.dumps([
        {"instruction": "What are the distinct values?", "input": "dataList = [3, 9, 3]",
         "output": "3 and 9"},
        {"instruction": "Write hello world in Python.", "input": "", "output": "print('hello world')"},
    ], indent=6), encoding="utf-8")
    records, report = load_prompts(path, shuffle=False)
    assert records[0].messages == user("What are the distinct values?\n\ndataList = [3, 9, 3]")
    assert records[0].response == "3 and 9"
    assert records[1].messages == user("Write hello world in Python.")
    assert report.files[0].kind == "alpaca"


def test_mbpp_test_split_excluded(tmp_path):
    rows = [{"text": f"Write function {t}.", "code": f"def f{t}(): pass", "task_id": t,
             "test_list": [f"assert f{t}() is None"]} for t in (1, 10, 11, 300, 510, 511, 974)]
    records, report = load_prompts(write_jsonl(tmp_path / "mbpp.jsonl", rows), shuffle=False)
    assert [r.messages[0]["content"] for r in records] == [
        "Write function 1.", "Write function 10.", "Write function 511.", "Write function 974."]
    assert report.files[0].skipped["test_split"] == 3
    assert report.skipped["test_split"] == 3 and report.kept == 4
    assert records[0].response == "def f1(): pass"
    # Recognised by its rows too, whatever the file is called.
    _, report = load_prompts(write_jsonl(tmp_path / "tasks.jsonl", rows), shuffle=False)
    assert report.skipped["test_split"] == 3


def test_generic_layouts(tmp_path):
    rows = [
        {"prompt": "A prompt.", "response": "A response."},
        {"text": "A text."},
        {"question": "A question?"},
        {"instruction": "An instruction."},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
                      {"role": "assistant", "content": "Hello."}]},
        {"turns": ["First turn.", "Second turn."]},
        {"conversations": [{"from": "human", "value": "Shared?"}, {"from": "gpt", "value": "GPT."}]},
        {"prompt": "With a system prompt.", "system": "You are terse."},
    ]
    records, report = load_prompts(write_jsonl(tmp_path / "mixed.jsonl", rows), shuffle=False)
    by_id = {r.id: r for r in records}
    assert by_id["mixed:0"].messages == user("A prompt.") and by_id["mixed:0"].response == "A response."
    assert by_id["mixed:1"].messages == user("A text.")
    assert by_id["mixed:2"].messages == user("A question?")  # not gsm8k-like: no instruction
    assert by_id["mixed:3"].messages == user("An instruction.")
    assert by_id["mixed:4"].messages == [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi."}]
    assert by_id["mixed:4"].response == "Hello."
    assert by_id["mixed:5"].messages == user("First turn.")
    assert by_id["mixed:6"].messages == user("Shared?") and by_id["mixed:6"].response == "GPT."
    assert by_id["mixed:7"].messages[0] == {"role": "system", "content": "You are terse."}
    assert report.kept == 8


def test_gzipped_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"prompt": "zipped"}\n'))
    records, _ = load_prompts(path)
    assert records[0].id == "prompts:0" and records[0].messages == user("zipped")


def test_rows_without_text_and_duplicates_are_counted(tmp_path):
    rows = [{"prompt": "ok"}, {"prompt": "  "}, {"other": 1}, [1, 2], {"prompt": "ok"},
            {"messages": [{"role": "assistant", "content": "no user"}]}, {"prompt": "long " * 50}]
    records, report = load_prompts(write_jsonl(tmp_path / "d.jsonl", rows), max_chars=100)
    assert [r.id for r in records] == ["d:0"]
    assert report.read == 7
    assert report.skipped == {"no_text": 4, "duplicate": 1, "too_long": 1, "test_split": 0}
    assert "d.jsonl" in report.summary()


def test_duplicates_across_files_and_ids_stable(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"q{i}"} for i in range(20)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "q3"}, {"prompt": "new"}])
    records, report = load_prompts([a, b], limit=10, seed=1)
    again, _ = load_prompts([a, b], limit=10, seed=1)
    assert [r.id for r in records] == [r.id for r in again]
    assert len(records) == 10 and report.kept == 10 and report.over_limit == 11
    assert report.files[1].skipped["duplicate"] == 1
    everything, _ = load_prompts([a, b], shuffle=False)
    content = {r.id: r.messages for r in everything}
    assert all(content[r.id] == r.messages for r in records)  # an id always names the same row


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(BlockspecError, match="not found.*nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(BlockspecError, match="empty.jsonl is empty"):
        load_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(BlockspecError, match="empty.json holds no rows"):
        load_prompts(tmp_path / "empty.json")


def test_malformed_json_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"\n{"prompt": "d"}\n')
    with pytest.raises(BlockspecError, match=r"bad\.jsonl: line 3.*malformed JSON.*fix"):
        load_prompts(path)
    path = tmp_path / "bad.json"
    path.write_text('[\n  {"prompt": "a"},\n  {"prompt": "b",,}\n]\n')
    with pytest.raises(BlockspecError, match=r"bad\.json: line 3.*malformed JSON"):
        load_prompts(path)


def test_no_usable_prompts_is_an_error(tmp_path):
    with pytest.raises(BlockspecError, match="no usable prompts"):
        load_prompts(write_jsonl(tmp_path / "x.jsonl", [{"foo": "bar"}]))


# ---------------------------------------------------------------------------- tokenization


def test_encode_prompt(tokenizer):
    record = PromptRecord(id="x", messages=user("The quick brown fox."))
    ids = encode_prompt(tokenizer, record.messages)
    expected = tokenizer("<|im_start|>user\nThe quick brown fox.<|im_end|>\n<|im_start|>assistant\n",
                         add_special_tokens=False)["input_ids"]
    assert ids == expected and all(isinstance(t, int) for t in ids)
    plain = encode_prompt(tokenizer, record.messages, use_chat_template=False)
    assert plain == tokenizer("The quick brown fox.")["input_ids"]
    assert stop_token_ids(tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


# ---------------------------------------------------------------------------- generation


@pytest.mark.parametrize("arch", TWO_FAMILIES)
def test_batched_generation_matches_one_at_a_time(tmp_path, tokenizer, arch):
    model = make_causal_lm(arch, vocab_size=len(tokenizer), seed=3)
    records = make_records(7)
    lengths = {len(encode_prompt(tokenizer, r.messages)) for r in records}
    assert len(lengths) > 2  # batches really pad
    alone = generate_responses(model, tokenizer, records, tmp_path / "alone.jsonl",
                               max_new_tokens=10, batch_size=1, progress=False)
    batched = generate_responses(model, tokenizer, records, tmp_path / "batched.jsonl",
                                 max_new_tokens=10, batch_size=4, progress=False)
    assert alone.generated == batched.generated == 7
    one = {r["id"]: r["response_ids"] for r in read_cache(tmp_path / "alone.jsonl")}
    many = {r["id"]: r["response_ids"] for r in read_cache(tmp_path / "batched.jsonl")}
    assert one == many
    # and batch_size=1 is plain generate on the unpadded prompt
    ids = torch.tensor([encode_prompt(tokenizer, records[3].messages)])
    direct = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    assert one["p:3"] == direct[0, ids.shape[1]:].tolist()[: len(one["p:3"])]


def test_stop_token_ends_response(tmp_path, tokenizer, model):
    records = make_records(5)
    generate_responses(model, tokenizer, records, tmp_path / "free.jsonl", max_new_tokens=10,
                       batch_size=5, stop_ids=[], progress=False)
    free = {r["id"]: r["response_ids"] for r in read_cache(tmp_path / "free.jsonl")}
    stop = free["p:0"][4]  # a token the model produces: make it the stop token
    report = generate_responses(model, tokenizer, records, tmp_path / "stop.jsonl", max_new_tokens=10,
                                batch_size=5, stop_ids=[stop], progress=False)
    rows = {r["id"]: r for r in read_cache(tmp_path / "stop.jsonl")}
    for row_id, tokens in free.items():
        row = rows[row_id]
        if stop in tokens:
            cut = tokens.index(stop) + 1
            assert row["finished"] and row["response_ids"] == tokens[:cut]
        else:
            assert not row["finished"] and row["response_ids"] == tokens and len(tokens) == 10
    assert rows["p:0"]["finished"] and rows["p:0"]["response_ids"][-1] == stop
    assert report.finished == sum(r["finished"] for r in rows.values())
    assert 0 < report.eos_fraction <= 1
    assert report.new_tokens == sum(len(r["response_ids"]) for r in rows.values())


def test_too_long_prompts_skipped_and_counted(tmp_path, tokenizer, model):
    records = make_records(6)
    lengths = [len(encode_prompt(tokenizer, r.messages)) for r in records]
    limit = sorted(lengths)[3]
    report = generate_responses(model, tokenizer, records, tmp_path / "c.jsonl", max_new_tokens=4,
                                max_prompt_tokens=limit, progress=False)
    assert report.skipped_too_long == sum(n > limit for n in lengths) > 0
    assert report.generated == sum(n <= limit for n in lengths)
    assert all(len(r["prompt_ids"]) <= limit for r in read_cache(tmp_path / "c.jsonl"))
    # default limit: the model's context (512) minus max_new_tokens
    huge = [PromptRecord(id="huge", messages=user("fox " * 600))]
    report = generate_responses(model, tokenizer, huge, tmp_path / "h.jsonl", max_new_tokens=4,
                                progress=False)
    assert report.skipped_too_long == 1 and report.generated == 0


class CountingModel(torch.nn.Module):
    """Wraps a model, counts the prompts it generates for, and can fail after n batches."""

    def __init__(self, model, fail_after=None):
        super().__init__()
        self.inner = model
        self.rows = 0
        self.calls = 0
        self.fail_after = fail_after

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def generate(self, *args, **kwargs):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.calls += 1
        self.rows += kwargs["input_ids"].shape[0]
        return self.inner.generate(*args, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_resume_after_kill_equals_uninterrupted_run(tmp_path, tokenizer, model, temperature):
    records = make_records(7)
    kw = dict(max_new_tokens=6, batch_size=2, temperature=temperature, seed=5, progress=False)
    full = tmp_path / "full.jsonl"
    generate_responses(model, tokenizer, records, full, **kw)

    # A run killed during its third batch keeps two batches.
    part = tmp_path / "part.jsonl"
    with pytest.raises(KeyboardInterrupt):
        generate_responses(CountingModel(model, fail_after=2), tokenizer, records, part, **kw)
    assert len(read_cache(part)) == 4
    counting = CountingModel(model)
    report = generate_responses(counting, tokenizer, list(reversed(records)), part, **kw)
    assert report.cached == 4 and report.generated == 3 and counting.rows == 3
    assert part.read_bytes() == full.read_bytes()

    # A kill in the middle of writing: a batch cut short and a truncated last line.
    cut = tmp_path / "cut.jsonl"
    lines = full.read_bytes().splitlines(keepends=True)
    cut.write_bytes(b"".join(lines[:5]) + lines[5][:30])
    meta_path(cut).write_bytes(meta_path(full).read_bytes())
    assert len(read_cache(cut)) == 5  # the half line is ignored when reading
    counting = CountingModel(model)
    report = generate_responses(counting, tokenizer, records, cut, **kw)
    # rows 0-3 (two whole batches) are kept; the cut batch (rows 4, 5) is generated again whole
    assert report.cached == 4 and report.generated == 3 and counting.rows == 3
    assert cut.read_bytes() == full.read_bytes()

    # Nothing left to do: nothing generated.
    counting = CountingModel(model)
    report = generate_responses(counting, tokenizer, records, full, **kw)
    assert report.cached == 7 and report.generated == 0 and counting.rows == 0


def test_more_records_later_only_generates_the_new_ones(tmp_path, tokenizer, model):
    cache = tmp_path / "c.jsonl"
    generate_responses(model, tokenizer, make_records(4), cache, max_new_tokens=6, progress=False)
    counting = CountingModel(model)
    report = generate_responses(counting, tokenizer, make_records(7), cache, max_new_tokens=6,
                                batch_size=3, progress=False)
    assert report.cached == 4 and report.generated == 3 and counting.rows == 3
    assert len(read_cache(cache)) == 7


def test_sampling_is_seeded(tmp_path, tokenizer, model):
    records = make_records(4)
    kw = dict(max_new_tokens=10, temperature=1.0, progress=False)
    torch.manual_seed(123)
    generate_responses(model, tokenizer, records, tmp_path / "a.jsonl", seed=1, **kw)
    torch.manual_seed(456)  # the global RNG does not matter
    generate_responses(model, tokenizer, records, tmp_path / "b.jsonl", seed=1, **kw)
    generate_responses(model, tokenizer, records, tmp_path / "c.jsonl", seed=2, **kw)
    a, b, c = ((tmp_path / f"{x}.jsonl").read_bytes() for x in "abc")
    assert a == b and a != c


def test_cache_with_other_settings_is_refused(tmp_path, tokenizer, model):
    cache = tmp_path / "c.jsonl"
    records = make_records(3)
    generate_responses(model, tokenizer, records, cache, max_new_tokens=4, progress=False)
    with pytest.raises(BlockspecError, match=r"max_new_tokens: cache 4, now 5.*overwrite=True"):
        generate_responses(model, tokenizer, records, cache, max_new_tokens=5, progress=False)
    with pytest.raises(BlockspecError, match="temperature"):
        generate_responses(model, tokenizer, records, cache, max_new_tokens=4, temperature=0.7,
                           progress=False)
    other = make_causal_lm("qwen3", vocab_size=len(tokenizer), seed=1)
    with pytest.raises(BlockspecError, match="model"):
        generate_responses(other, tokenizer, records, cache, max_new_tokens=4, progress=False)
    # batch size is not a generation setting: changing it resumes
    assert generate_responses(model, tokenizer, records, cache, max_new_tokens=4, batch_size=1,
                              progress=False).cached == 3
    report = generate_responses(model, tokenizer, records, cache, max_new_tokens=5, overwrite=True,
                                progress=False)
    assert report.generated == 3
    assert json.loads(meta_path(cache).read_text())["settings"]["max_new_tokens"] == 5
    meta_path(cache).unlink()
    with pytest.raises(BlockspecError, match="missing"):
        generate_responses(model, tokenizer, records, cache, max_new_tokens=5, progress=False)


def test_corrupt_cache_line_is_an_error(tmp_path, tokenizer, model):
    cache = tmp_path / "c.jsonl"
    generate_responses(model, tokenizer, make_records(3), cache, max_new_tokens=4, progress=False)
    lines = cache.read_text().splitlines(keepends=True)
    cache.write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
    with pytest.raises(BlockspecError, match="line 2.*corrupt"):
        load_samples(cache)


def test_responses_from_data(tmp_path, tokenizer):
    records = [PromptRecord(id="a", messages=user("The quick brown fox."),
                            response="jumps over the lazy dog."),
               PromptRecord(id="b", messages=user("No answer here."))]
    cache = tmp_path / "data.jsonl"
    report = responses_from_data(tokenizer, records, cache)
    assert report.generated == 1 and report.skipped_empty == 1
    (row,) = read_cache(cache)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert row["prompt_ids"] == encode_prompt(tokenizer, records[0].messages)
    text_ids = tokenizer("jumps over the lazy dog.", add_special_tokens=False)["input_ids"]
    assert row["response_ids"] == text_ids + [eot]
    assert row["finished"]
    assert responses_from_data(tokenizer, records, cache).cached == 1


# ---------------------------------------------------------------------------- samples


def test_loss_mask_covers_exactly_the_response(tmp_path):
    cache = tmp_path / "c.jsonl"
    rows = [{"id": "a", "prompt_ids": [5, 6, 7], "response_ids": [8, 9, 2], "finished": True},
            {"id": "b", "prompt_ids": [5, 6, 7, 8, 9], "response_ids": [10, 11], "finished": False}]
    write_jsonl(cache, rows)
    a, b = load_samples(cache)
    assert a.id == "a" and a.input_ids.tolist() == [5, 6, 7, 8, 9, 2]
    assert a.loss_mask.tolist() == [False, False, False, True, True, True]  # the eos is learned too
    assert a.input_ids.dtype == torch.long and a.loss_mask.dtype == torch.bool
    assert b.loss_mask.tolist() == [False] * 5 + [True] * 2 and b.num_response_tokens == 2
    (a4,) = load_samples(cache, max_length=5)  # b keeps no response token within 5
    assert a4.input_ids.tolist() == [5, 6, 7, 8, 9] and a4.loss_mask.tolist() == [False] * 3 + [True] * 2
    assert [s.id for s in load_samples(cache, only_finished=True)] == ["a"]


def test_samples_from_generated_cache(tmp_path, tokenizer, model):
    cache = tmp_path / "c.jsonl"
    generate_responses(model, tokenizer, make_records(3), cache, max_new_tokens=5, progress=False)
    rows = {r["id"]: r for r in read_cache(cache)}
    for sample in load_samples(cache):
        row = rows[sample.id]
        assert sample.input_ids.tolist() == row["prompt_ids"] + row["response_ids"]
        assert sample.input_ids[sample.loss_mask].tolist() == row["response_ids"]
    with pytest.raises(BlockspecError, match="not found"):
        load_samples(tmp_path / "missing.jsonl")


def test_restyled_prompts_are_asked_in_each_style_with_their_own_ids():
    records = [PromptRecord(id=f"gsm8k:{i}", messages=[{"role": "user", "content": f"What is {i} + 1?"}])
               for i in range(60)]
    restyled = restyle_prompts(records, ["plain", "suffix", "chat"], seed=0)
    styles = {record.id.rsplit("@", 1)[1] for record in restyled}
    assert styles == {"plain", "suffix", "chat"}
    for original, record in zip(records, restyled):
        question, text = original.messages[0]["content"], record.messages[0]["content"]
        assert question in text
        style = record.id.rsplit("@", 1)[1]
        assert (text == question) == (style == "plain")
        assert text.endswith(GSM8K_INSTRUCTION) == (style == "suffix")
    assert restyle_prompts(records, ["plain", "suffix", "chat"], seed=0) == restyled  # reproducible
    with pytest.raises(BlockspecError, match="prompt styles"):
        restyle_prompts(records, ["shouting"])


SOLUTION = ("import math\r\ndef helper(x):\r\n\treturn x\r\n"
            "def area(r, scale=1):\r\n\treturn helper(math.pi * r * r) * scale")


@pytest.mark.parametrize("solution, tests, expected", [
    (SOLUTION, ["assert area(1) == 3.14159", "assert area(2, scale=2) == 25.1327", "assert area(0) is not None"],
     'import math\n\n\ndef area(r, scale=1):\n    """ Area of a circle.\n    >>> area(1)\n    3.14159\n'
     '    >>> area(2, scale=2)\n    25.1327\n    """\n'),
    # no tests: the last function is the one asked for
    ("def f(a: int) -> int:\n    return a\n", [], 'def f(a: int) -> int:\n    """ Area of a circle.\n    """\n'),
    ("The area is pi r squared.", [], None),  # not Python
    ("x = 1\nprint(x)", [], None),  # no function
])
def test_function_stub_asks_the_tested_function_with_its_examples(solution, tests, expected):
    assert function_stub("Area of a circle.", solution, tests) == expected


def test_stub_style_applies_to_records_with_a_function_to_complete(tmp_path):
    path = write_jsonl(tmp_path / "mbpp.jsonl", [
        {"task_id": 2, "text": "Add one.", "code": "def add_one(x):\r\n\treturn x + 1",
         "test_list": ["assert add_one(1) == 2"]},
        {"task_id": 3, "text": "Say hi.", "code": "print('hi')", "test_list": []},
        {"task_id": 20, "text": "A test-split task.", "code": "def t():\n    pass", "test_list": []},
    ])
    records, _ = load_prompts([path], shuffle=False, format_prompts=False)
    only_stubs = restyle_prompts(records, ["stub"])
    assert [r.id for r in only_stubs] == ["mbpp:0@stub"]  # the row without a function is left out
    assert [record_id(r.id) for r in only_stubs] == ["mbpp:0"]
    text = only_stubs[0].messages[-1]["content"]
    assert "def add_one(x):" in text and ">>> add_one(1)\n    2" in text and "Add one." in text
    mixed = restyle_prompts(records, ["plain", "stub"], seed=1)
    assert [r.id.split("@")[0] for r in mixed] == ["mbpp:0", "mbpp:1"]
    assert mixed[1].id == "mbpp:1@plain" and mixed[1].messages[-1]["content"] == "Say hi."
