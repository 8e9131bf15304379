"""Prompt sources and prompt building, with real datasets files and real tokenizers."""

import json

import pytest

from hybridrl import plugins
from hybridrl.config import ConfigError, load_config
from hybridrl.models import load_tokenizer
from hybridrl.prompts import PromptOrder, check_columns, encode_prompt, prompt_messages, row_answer


def source(name, **options):
    cls = plugins.lookup("dataset", name)
    return cls(cls.Options(**options), ctx=None)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"q": f"What is {i} + 1?", "a": str(i + 1), "level": i % 2} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_hf_source_reads_local_jsonl(jsonl):
    ds = source("hf", path="json", data_files=jsonl)
    assert len(ds) == 5 and ds[2] == {"q": "What is 2 + 1?", "a": "3", "level": 0}
    assert source("hf", path="json", data_files=jsonl, limit=2).__len__() == 2
    assert source("hf", path=jsonl)[2] == ds[2]  # a single file as the path: its builder from the suffix


def test_missing_column_is_named_with_the_fields(jsonl):
    cfg = load_config(
        data={
            "model": {"path": "x"},
            "rewards": [{"function": "answer_match"}],
            "data": {
                "source": "hf",
                "path": "json",
                "data_files": jsonl,
                "prompt_column": "q",
                "answer_column": "answer",
            },
        }
    )
    ds = source("hf", path="json", data_files=jsonl)
    with pytest.raises(ConfigError, match=r"data.answer_column is 'answer'.*Fields: q, a, level"):
        check_columns(ds, cfg)


def test_reasoning_gym_source_is_seeded():
    a = source("reasoning_gym", task="chain_sum", size=4, seed=1)
    b = source("reasoning_gym", task="chain_sum", size=4, seed=1)
    assert len(a) == 4 and a[3] == b[3] and set(a[0]) == {"question", "answer", "metadata"}


def test_reasoning_gym_unknown_task_says_so():
    with pytest.raises(ValueError, match="could not create task 'no_such_task'"):
        source("reasoning_gym", task="no_such_task")


def test_prompt_order_covers_every_row_each_epoch_and_resumes():
    order = PromptOrder(5, seed=3)
    first = order.take(5)
    assert sorted(first) == list(range(5))
    state = order.state_dict()
    nxt = order.take(7)
    resumed = PromptOrder(5, seed=3)
    resumed.load_state_dict(state)
    assert resumed.take(7) == nxt
    assert sorted(nxt[:5]) == list(range(5))


class DataCfg:
    prompt_column, template, system_prompt = "q", "Q: {prompt} ({level})", "Be brief."
    chat_template, max_prompt_tokens = True, 512


def test_encode_prompt_applies_template_system_and_chat_template(tiny_model):
    tok = load_tokenizer(tiny_model)
    ids, text = encode_prompt({"q": "1+1?", "level": 2}, DataCfg, tok)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ: 1+1? (2)<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(ids) == text


def test_encode_prompt_accepts_chat_messages(tiny_model):
    tok = load_tokenizer(tiny_model)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    _, text = encode_prompt({"q": msgs}, DataCfg, tok)
    assert text.count("system") == 1 and "Be brief." not in text


def test_prompt_too_long_names_the_key(tiny_model):
    class Short(DataCfg):
        max_prompt_tokens = 5

    with pytest.raises(ConfigError, match="more than data.max_prompt_tokens=5"):
        encode_prompt({"q": "a long question", "level": 0}, Short, load_tokenizer(tiny_model))


def test_template_field_missing_lists_fields(tiny_model):
    class Bad(DataCfg):
        template = "{prompt} {difficulty}"

    with pytest.raises(ConfigError, match=r"\{difficulty\}.*Row fields: q, level"):
        encode_prompt({"q": "x", "level": 0}, Bad, load_tokenizer(tiny_model))


def test_smollm2_chat_template_from_the_packaged_gguf(smollm2):
    tok = load_tokenizer(smollm2)

    class Cfg(DataCfg):
        template, system_prompt = "{prompt}", "Answer with a number."

    ids, text = encode_prompt({"q": "What is 2 + 3?"}, Cfg, tok)
    assert text.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?")
    assert text.endswith("<|im_start|>assistant\n") and tok.decode(ids) == text


def data_config(**data):
    data = {"source": "hf", "path": "unused.jsonl", **data}
    return load_config(data={"model": {"path": "x"}, "rewards": [{"function": "format", "pattern": "x"}], "data": data})


VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": "train", "index": i, "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"},
    }
    for i in range(3)
]


def test_a_verl_parquet_file_loads_as_it_is(tmp_path, tiny_model):
    import datasets

    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(VERL_ROWS).to_parquet(str(path))
    cfg = data_config(source="hf", path=str(path))
    ds = source("hf", path=str(path))
    check_columns(ds, cfg)  # auto: the chat messages in 'prompt', the ground truth in reward_model
    assert ds[1] == VERL_ROWS[1]
    assert prompt_messages(ds[1], cfg.data) == VERL_ROWS[1]["prompt"] and row_answer(ds[1], cfg.data) == "2"
    assert encode_prompt(ds[1], cfg.data, load_tokenizer(tiny_model))[1].endswith(
        "What is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    # a dotted path names any nested field; one that is not there lists the nested fields
    assert row_answer(ds[1], data_config(answer_column="extra_info.index").data) == 1
    with pytest.raises(
        ConfigError, match=r"answer_column is 'reward_model.truth'.*reward_model.ground_truth, extra_info"
    ):
        check_columns(ds, data_config(source="hf", path=str(path), answer_column="reward_model.truth"))


def test_trl_text_prompts_and_extra_columns(capsys):
    cfg = data_config(template="Q: {prompt} ({level})")
    row = {"prompt": "1+1=", "solution": "2", "level": 3, "question": "one plus one"}
    assert prompt_messages(row, cfg.data) == [{"role": "user", "content": "Q: 1+1= (3)"}]
    assert row_answer(row, cfg.data) is None  # no answer field: rewards read the row's fields themselves
    check_columns([row], cfg)
    assert "the rows have prompt and question; prompts come from 'prompt'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="auto, but the rows have neither prompt nor question. Fields: q, a"):
        check_columns([{"q": "1+1=", "a": "2"}], cfg)
