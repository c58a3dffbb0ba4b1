"""Prompt datasets and tokenizers (data/datasets.py, data/tokenizer.py): file formats, field names,
error messages, chat templates, the prompt-length cut, and settings validation (data/settings.py)."""

import json
import logging

import pytest

from megatron_jetrl.config import ConfigError
from megatron_jetrl.data import synthetic
from megatron_jetrl.data.datasets import Prompt, PromptDataset
from megatron_jetrl.data.settings import (
    DataSettings,
    DatasetSettings,
    DynamicSamplingSettings,
    OverlongSettings,
    RewardSettings,
    SyntheticSettings,
)
from megatron_jetrl.data.tokenizer import load_tokenizer, render_prompt
from tests.helpers import ID
from tests.helpers import tiny_hf_tokenizer as _tiny_hf_tokenizer

@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    return load_tokenizer(_tiny_hf_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def hf_tok_plain(tmp_path_factory):
    return load_tokenizer(_tiny_hf_tokenizer(tmp_path_factory.mktemp("tok_plain"), chat_template=None))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# ------------------------------------------------------------------ tokenizer


def test_load_tokenizer_hf_pads_with_eos(hf_tok):
    assert hf_tok.eos_token_id == ID["<eos>"] and hf_tok.pad_token_id == ID["<eos>"]
    assert hf_tok.encode("what is 2+2 ?") == [ID["what"], ID["is"], ID["2+2"], ID["?"]]


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ConfigError, match="model.tokenizer.*no such local path.*download"):
        load_tokenizer(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=r"model.tokenizer.*holds no tokenizer files .*it holds \[\]\): download"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="model.tokenizer.*not a loadable HF tokenizer"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(ConfigError, match="model.tokenizer.*unknown synthetic task"):
        load_tokenizer("synthetic:nope")


def test_prompts_a_synthetic_tokenizer_cannot_encode_name_the_tokenizer():
    """A data file of real text with the synthetic character tokenizer: the fix is the tokenizer, not
    the chat template."""
    records = [{"prompt": "What is 2 + 2?", "answer": "4"}]
    with pytest.raises(ConfigError, match=r"record 1 of x\.jsonl: character 'W' .* use the model's tokenizer") as e:
        PromptDataset.from_records(records, load_tokenizer("synthetic:countdown"), DatasetSettings(path="x.jsonl"),
                                   "data.train", source="x.jsonl")
    assert e.value.key == "model.tokenizer"


def test_load_tokenizer_synthetic():
    tok = load_tokenizer("synthetic:countdown")
    assert tok is synthetic.TASKS["countdown"].tokenizer()
    assert tok.decode(tok.encode("3 5>8=")) == "3 5>8="


def test_render_prompt_modes(hf_tok, hf_tok_plain):
    q = [ID["what"], ID["is"], ID["2+2"], ID["?"]]
    # auto with a template: the template's markers, no extra special tokens
    assert render_prompt(hf_tok, "what is 2+2 ?") == [ID["<|user|>"], *q, ID["<|assistant|>"]]
    assert render_prompt(hf_tok, "what is 2+2 ?", system_prompt="be brief") == [
        ID["<|system|>"], ID["be"], ID["brief"], ID["<|user|>"], *q, ID["<|assistant|>"]]
    assert render_prompt(hf_tok, "what is 2+2 ?", chat_template="on") == render_prompt(hf_tok, "what is 2+2 ?")
    # off: plain text, the system prompt in front
    assert render_prompt(hf_tok, "what is 2+2 ?", chat_template="off") == q
    assert render_prompt(hf_tok, "what is 2+2 ?", system_prompt="be brief", chat_template="off") == [
        ID["be"], ID["brief"], *q]
    # auto without a template = off; on without one is an error
    assert render_prompt(hf_tok_plain, "what is 2+2 ?") == q
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        render_prompt(hf_tok_plain, "what is 2+2 ?", chat_template="on")
    with pytest.raises(ValueError, match="chat_template must be one of"):
        render_prompt(hf_tok, "x", chat_template="yes")


def test_render_prompt_messages(hf_tok, hf_tok_plain):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2 ?"}]
    assert render_prompt(hf_tok, msgs) == render_prompt(hf_tok, "what is 2+2 ?", system_prompt="be brief")
    with pytest.raises(ValueError, match="already hold a system message"):
        render_prompt(hf_tok, msgs, system_prompt="be brief")
    with pytest.raises(ValueError, match="chat messages needs a tokenizer with a chat template"):
        render_prompt(hf_tok_plain, msgs)


# ------------------------------------------------------------------ datasets


def test_jsonl_custom_keys_nested_answer_and_blank_lines(tmp_path, hf_tok):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "what is 2+2 ?", "meta": {"gt": "4"}}) + "\n\n"
                    + json.dumps({"question": "what is 3+3 ?", "meta": {"gt": 6}}) + "\n")
    s = DatasetSettings(path=str(path), prompt_key="question", answer_key="meta.gt", chat_template="off")
    ds = PromptDataset.from_settings(s, hf_tok, "data.train")
    assert len(ds) == 2 and ds.dropped == 0
    assert ds[0] == Prompt(index=0, token_ids=(ID["what"], ID["is"], ID["2+2"], ID["?"]), answer="4",
                           text="what is 2+2 ?")
    assert ds[1].index == 1 and ds[1].answer == 6


def test_jsonl_bad_line_names_file_and_line(tmp_path, hf_tok):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "what", "answer": 1}) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"data\.train\.path: got '.*bad\.jsonl:2'.*not valid JSON"):
        PromptDataset.from_settings(DatasetSettings(path=str(path)), hf_tok, "data.train")
    path.write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1'.*JSON list, not an object"):
        PromptDataset.from_settings(DatasetSettings(path=str(path)), hf_tok, "data.train")


def test_missing_field_names_key_and_file(tmp_path, hf_tok):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "what", "answer": 1}, {"prompt": "is"}])
    with pytest.raises(ConfigError, match=r"data\.eval\.answer_key: got 'answer'; record 2 of .*d\.jsonl \(line 2\) "
                                          r"has no such field \(it has \['prompt'\]\)"):
        PromptDataset.from_settings(DatasetSettings(path=path), hf_tok, "data.eval")
    with pytest.raises(ConfigError, match=r"data\.train\.prompt_key: got 'q'; record 1 of"):
        PromptDataset.from_settings(DatasetSettings(path=path, prompt_key="q"), hf_tok, "data.train")


@pytest.mark.parametrize("prompt, what", [("", "empty"), ("  \n", "only whitespace"),
                                           ([{"role": "user", "content": ""}], "empty")])
def test_empty_prompt_is_refused_at_load_naming_file_and_line(tmp_path, hf_tok, prompt, what):
    """An empty prompt is refused when the data loads (``jetrl check`` loads it too), not when its
    batch reaches the engine: the error names the file, the record and its line."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "what is 2+2 ?", "answer": 4}) + "\n\n"
                    + json.dumps({"prompt": prompt, "answer": 0}) + "\n")
    for template in ("auto", "off") if isinstance(prompt, str) else ("auto",):
        with pytest.raises(ConfigError, match=rf"^data\.train\.prompt_key: got 'prompt'; record 2 of .*d\.jsonl "
                                              rf"\(line 3\): the prompt is {what}; remove the record"):
            PromptDataset.from_settings(DatasetSettings(path=str(path), chat_template=template), hf_tok, "data.train")


class _DroppingTokenizer:
    """Encodes each word as token 1 except ``<drop>``, which it drops (no chat template)."""

    eos_token_id = pad_token_id = 0
    vocab_size = 2

    def encode(self, text):
        return [1 for word in text.split() if word != "<drop>"]


def test_prompt_that_tokenizes_to_nothing_is_refused_at_load():
    records = [{"prompt": "a b", "answer": 1}, {"prompt": "<drop> <drop>", "answer": 2}]
    with pytest.raises(ConfigError, match=r"^data\.eval\.prompt_key: got 'prompt'; record 2 of <records>: the prompt "
                                          r"'<drop> <drop>' tokenizes to no tokens"):
        PromptDataset.from_records(records, _DroppingTokenizer(), DatasetSettings(path="x.jsonl"), "data.eval")
    assert len(PromptDataset.from_records(records[:1], _DroppingTokenizer(), DatasetSettings(path="x.jsonl"),
                                          "data.eval")) == 1


def test_file_errors(tmp_path, hf_tok):
    with pytest.raises(ConfigError, match=r"data\.train\.path.*no such file"):
        PromptDataset.from_settings(DatasetSettings(path=str(tmp_path / "x.jsonl")), hf_tok, "data.train")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match=r"data\.train\.path.*unknown file type '\.csv'"):
        PromptDataset.from_settings(DatasetSettings(path=str(tmp_path / "d.csv")), hf_tok, "data.train")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no records"):
        PromptDataset.from_settings(DatasetSettings(path=str(tmp_path / "empty.jsonl")), hf_tok, "data.train")
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "what", "answer": 1}\n{"prompt": "\xe9"}\n')
    with pytest.raises(ConfigError, match=r"latin\.jsonl:2'.*not UTF-8"):
        PromptDataset.from_settings(DatasetSettings(path=str(tmp_path / "latin.jsonl")), hf_tok, "data.train")


def test_long_prompts_dropped_and_counted(tmp_path, hf_tok, caplog):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "what is 2+2 ?", "answer": 4},
                                         {"prompt": "a very very very long long question ?", "answer": 0},
                                         {"prompt": "what is 3+3 ?", "answer": 6}])
    s = DatasetSettings(path=path, chat_template="off", max_prompt_tokens=4)
    with caplog.at_level(logging.WARNING, logger="megatron_jetrl.data.datasets"):
        ds = PromptDataset.from_settings(s, hf_tok, "data.train")
    assert len(ds) == 2 and ds.dropped == 1
    assert [p.answer for p in ds] == [4, 6] and [p.index for p in ds] == [0, 1]
    assert "dropped 1 of 3 prompts longer than data.train.max_prompt_tokens=4" in caplog.text
    with pytest.raises(ConfigError, match=r"data\.train\.max_prompt_tokens: got 2; all 3 prompts"):
        PromptDataset.from_settings(DatasetSettings(path=path, max_prompt_tokens=2), hf_tok, "data.train")


def test_chat_template_settings(tmp_path, hf_tok, hf_tok_plain):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "what is 2+2 ?", "answer": 4}])
    auto = PromptDataset.from_settings(DatasetSettings(path=path, system_prompt="be brief"), hf_tok, "data.train")
    assert auto[0].token_ids[0] == ID["<|system|>"] and auto[0].token_ids[-1] == ID["<|assistant|>"]
    off = PromptDataset.from_settings(DatasetSettings(path=path, chat_template="off"), hf_tok, "data.train")
    assert off[0].token_ids == (ID["what"], ID["is"], ID["2+2"], ID["?"])
    with pytest.raises(ConfigError, match=r"data\.train\.chat_template: got 'on'.*has none; use 'auto' or 'off'"):
        PromptDataset.from_settings(DatasetSettings(path=path, chat_template="on"), hf_tok_plain, "data.train")


def test_chat_message_prompts(tmp_path, hf_tok, hf_tok_plain):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2 ?"}]
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": msgs, "reward_model": {"ground_truth": "4"}}])
    s = DatasetSettings(path=path, answer_key="reward_model.ground_truth")
    ds = PromptDataset.from_settings(s, hf_tok, "data.train")
    assert ds[0].text == "what is 2+2 ?" and ds[0].answer == "4"
    assert ds[0].token_ids[0] == ID["<|system|>"]
    with pytest.raises(ConfigError, match=r"data\.train\.chat_template.*record 1 of .*needs a tokenizer with a "
                                          r"chat template"):
        PromptDataset.from_settings(s, hf_tok_plain, "data.train")
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": 5, "answer": 1}])
    with pytest.raises(ConfigError, match=r"data\.train\.prompt_key.*string or a list of .*messages; got int"):
        PromptDataset.from_settings(DatasetSettings(path=bad), hf_tok, "data.train")


def test_parquet(tmp_path, hf_tok):
    import pyarrow as pa  # a dependency: the recipes' data format
    import pyarrow.parquet as pq

    table = pa.table({"problem": ["what is 2+2 ?", "what is 3+3 ?"], "solution": ["4", "6"]})
    pq.write_table(table, tmp_path / "d.parquet")
    s = DatasetSettings(path=str(tmp_path / "d.parquet"), prompt_key="problem", answer_key="solution",
                        chat_template="off")
    ds = PromptDataset.from_settings(s, hf_tok, "data.train")
    assert [p.answer for p in ds] == ["4", "6"] and ds[1].token_ids == (ID["what"], ID["is"], ID["3+3"], ID["?"])
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"data\.train\.path.*not a readable Parquet file"):
        PromptDataset.from_settings(DatasetSettings(path=str(tmp_path / "junk.parquet")), hf_tok, "data.train")


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, hf_tok, monkeypatch):
    import sys

    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ConfigError, match="pip install pyarrow"):
        PromptDataset.from_settings(DatasetSettings(path=str(tmp_path / "d.parquet")), hf_tok, "data.train")


class _FakeTask:
    name = "fake"

    def tokenizer(self):
        return load_tokenizer("synthetic:countdown")

    def generate(self, size, seed, **options):
        return [{"prompt": f"{i}+{seed}=", "answer": i + seed, "solution": str(i + seed)} for i in range(size)]

    def score(self, response, answer):
        return float(response.strip() == str(answer))


def test_synthetic_dataset_with_fake_task(monkeypatch):
    monkeypatch.setitem(synthetic.TASKS, "fake", _FakeTask())
    tok = _FakeTask().tokenizer()
    s = DatasetSettings(synthetic=SyntheticSettings(task="fake", size=3, seed=5))
    ds = PromptDataset.from_settings(s, tok, "data.train")
    assert [p.text for p in ds] == ["0+5=", "1+5=", "2+5="] and ds[2].answer == 7
    assert ds.source == "synthetic:fake" and tok.decode(ds[1].token_ids) == "1+5="


def test_records_field(tmp_path, hf_tok):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "what is 2+2 ?", "answer": 4, "sol": "4", "m": {"s": "a"}},
                                         {"prompt": "a very very very long long question ?", "answer": 0},
                                         {"prompt": "what is 3+3 ?", "answer": 6, "sol": "6", "m": {"s": "b"}}])
    ds = PromptDataset.from_settings(DatasetSettings(path=path, max_prompt_tokens=6), hf_tok, "data.train")
    assert ds.records_field("sol", "sft.response_key") == ["4", "6"]  # aligned with the kept prompts
    assert ds.records_field("m.s", "sft.response_key") == ["a", "b"]
    with pytest.raises(ConfigError, match=r"^sft\.response_key: got 'solution'; the record of prompt 0 of"):
        ds.records_field("solution", "sft.response_key")


def test_synthetic_countdown_dataset():
    tok = load_tokenizer("synthetic:countdown")
    s = DatasetSettings(synthetic=SyntheticSettings(task="countdown", size=20, seed=3))
    ds = PromptDataset.from_settings(s, tok, "data.train")
    records = synthetic.TASKS["countdown"].generate(20, 3)
    assert len(ds) == 20
    assert [p.text for p in ds] == [r["prompt"] for r in records]
    assert all(tok.decode(p.token_ids) == p.text for p in ds)
    task = synthetic.TASKS["countdown"]
    assert task.score(records[0]["solution"], ds[0].answer) == 1.0
    assert ds.records_field("solution", "sft.response_key") == [r["solution"] for r in records]


# ------------------------------------------------------------------ settings


def test_data_settings_defaults_and_prefixes():
    d = DataSettings(train=DatasetSettings(path="train.jsonl"))
    assert d.prompts_per_step == 32 and d.seed == 1 and d.shuffle and d.eval is None
    assert d.dynamic_sampling == DynamicSamplingSettings(enabled=False, max_rounds=4)
    assert d.overlong == OverlongSettings(mode="none", buffer_tokens=256, penalty=1.0)
    with pytest.raises(ConfigError, match=r"^data\.train\.path: got None; set data\.train\.path"):
        DataSettings(train=DatasetSettings())
    with pytest.raises(ConfigError, match=r"^data\.eval\.synthetic: .*either data\.eval\.path or"):
        DataSettings(train=DatasetSettings(path="t.jsonl"),
                     eval=DatasetSettings(path="e.jsonl", synthetic=SyntheticSettings()))
    with pytest.raises(ConfigError, match=r"^data\.eval\.synthetic\.task: got 'nope'; must be one of"):
        DataSettings(train=DatasetSettings(path="t.jsonl"),
                     eval=DatasetSettings(synthetic=SyntheticSettings(task="nope")))
    with pytest.raises(ConfigError, match=r"^data\.train\.chat_template: got 'yes'"):
        DataSettings(train=DatasetSettings(path="t.jsonl", chat_template="yes"))
    with pytest.raises(ConfigError, match=r"^data\.train\.prompt_key: got 'q'; synthetic records always use"):
        DataSettings(train=DatasetSettings(synthetic=SyntheticSettings(), prompt_key="q"))


@pytest.mark.parametrize("kwargs, key", [
    ({"prompts_per_step": 0}, "data.prompts_per_step"),
    ({"seed": 1.5}, "data.seed"),
    ({"shuffle": "yes"}, "data.shuffle"),
    ({"eval_size": 10}, "data.eval_size"),  # no eval set
    ({"train": DatasetSettings(path="t.jsonl", max_prompt_tokens=0)}, "data.train.max_prompt_tokens"),
    ({"train": DatasetSettings(synthetic=SyntheticSettings(size=0))}, "data.train.synthetic.size"),
    ({"train": DatasetSettings(synthetic=SyntheticSettings(options=[1]))}, "data.train.synthetic.options"),
])
def test_data_settings_errors(kwargs, key):
    kwargs = {"train": DatasetSettings(path="t.jsonl"), **kwargs}
    with pytest.raises(ConfigError) as e:
        DataSettings(**kwargs)
    assert e.value.key == key


@pytest.mark.parametrize("make, key", [
    (lambda: DynamicSamplingSettings(max_rounds=0), "data.dynamic_sampling.max_rounds"),
    (lambda: DynamicSamplingSettings(enabled=1), "data.dynamic_sampling.enabled"),
    (lambda: OverlongSettings(mode="hard"), "data.overlong.mode"),
    (lambda: OverlongSettings(buffer_tokens=0), "data.overlong.buffer_tokens"),
    (lambda: OverlongSettings(penalty=-1.0), "data.overlong.penalty"),
    (lambda: RewardSettings(type="code"), "reward.type"),
    (lambda: RewardSettings(time_limit_s=0.0), "reward.time_limit_s"),
    (lambda: RewardSettings(format_score=float("nan")), "reward.format_score"),
])
def test_section_settings_errors(make, key):
    with pytest.raises(ConfigError) as e:
        make()
    assert e.value.key == key


def test_reward_settings_types():
    assert RewardSettings().type == "math"
    assert RewardSettings(type="countdown").type == "countdown"


def test_eval_settings_with_eval_size():
    d = DataSettings(train=DatasetSettings(path="t.jsonl"), eval=DatasetSettings(path="e.jsonl"), eval_size=8)
    assert d.eval_size == 8
