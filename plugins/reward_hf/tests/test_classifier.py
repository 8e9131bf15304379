"""reward_model and reranker on tiny real DeBERTa-v2 / XLM-RoBERTa classifiers with real tokenizers."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hybridrl.config import ConfigError, load_config

PROMPTS = ["What is the capital of France?", "Name a colour.", "今天天气怎么样？", "What is 2 + 2?"]
RESPONSES = [
    "Paris.",
    "Blue, like the sky on a clear summer day when no cloud is in sight.",
    "很好",
    "The answer is 4 because two and two make four.",
]


def conversation(prompt):
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]


def rm_batch(make_batch):
    msgs = [conversation(p) for p in PROMPTS]
    policy_texts = [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n" for p in PROMPTS]
    return make_batch(policy_texts, RESPONSES, messages=msgs)


def forward(folder, **enc):
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(**enc).logits[:, 0]


def test_reward_model_reads_its_own_tokenizer_and_chat_template(deberta_rm, tiny_model, make_reward, make_batch):
    rm = make_reward("reward_model", model=deberta_rm)
    assert rm.mode == "chat"
    batch = rm_batch(make_batch)
    texts, second, add_special = rm.inputs(batch)
    # the reward model's template over the conversation and the response, not the policy's ChatML text
    assert (
        texts[0] == "[CLS]system : Be brief. [SEP]user : What is the capital of France? [SEP]assistant : Paris. [SEP]"
    )
    assert second is None and add_special is False  # the template writes [CLS] itself: none is added twice
    rm_tok = AutoTokenizer.from_pretrained(deberta_rm)
    expected = [rm_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    enc = rm.encode(texts, None, add_special)
    got = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
    assert got == expected
    assert rm_tok.convert_ids_to_tokens(got[0][:3]) == ["[CLS]", "system", ":"]
    # the check can fail: the policy's tokenizer gives other ids for the same conversation
    policy_tok = AutoTokenizer.from_pretrained(tiny_model)
    policy_text = policy_tok.apply_chat_template(
        batch["messages"][0] + [{"role": "assistant", "content": RESPONSES[0]}], tokenize=False
    )
    policy_ids = policy_tok(policy_text, add_special_tokens=False)["input_ids"]
    assert policy_text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and policy_ids != got[0]
    # and the score is the model's logit on exactly those ids
    scores = rm.score(batch)
    ref = torch.stack([forward(deberta_rm, input_ids=torch.tensor([ids]))[0] for ids in expected])
    torch.testing.assert_close(scores, ref, atol=1e-5, rtol=1e-5)
    policy_like = forward(deberta_rm, input_ids=torch.tensor([[i % len(rm_tok) for i in policy_ids]]))[0]
    assert abs(policy_like - scores[0]) > 1e-3


def test_reward_model_batching_equals_one_by_one(deberta_rm, make_reward, make_batch):
    batch = rm_batch(make_batch)
    together = make_reward("reward_model", model=deberta_rm, batch_size=8).score(batch)
    one_rm = make_reward("reward_model", model=deberta_rm, batch_size=1)
    alone = torch.cat([one_rm.score(batch.select([i])) for i in range(len(batch))])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert together.max() - together.min() > 0.05  # different inputs, visibly different scores


def test_reward_model_without_template_scores_prompt_response_pairs(xlmr_reranker, make_reward, make_batch):
    rm = make_reward("reward_model", model=xlmr_reranker)  # its tokenizer has no chat template
    assert rm.mode == "pair"
    batch = rm_batch(make_batch)
    first, second, _ = rm.inputs(batch)
    assert first == PROMPTS and second == RESPONSES  # the last user message, not the system prompt
    tok = AutoTokenizer.from_pretrained(xlmr_reranker)
    ref = torch.stack([forward(xlmr_reranker, **tok(p, r, return_tensors="pt"))[0] for p, r in zip(first, second)])
    torch.testing.assert_close(rm.score(batch), ref, atol=1e-5, rtol=1e-5)


def test_without_messages_the_prompt_text_is_read_with_a_warning(deberta_rm, make_reward, make_batch, capsys):
    import hybridrl_reward_hf.common as common

    common._warned.clear()
    rm = make_reward("reward_model", model=deberta_rm)
    batch = make_batch(["<|im_start|>user\nHi<|im_end|>\n"], ["Hello"])
    assert rm.inputs(batch)[0] == ["[CLS]user : <|im_start|>user\nHi<|im_end|>\n [SEP]assistant : Hello [SEP]"]
    assert "the batch has no 'messages'" in capsys.readouterr().err


def test_truncation_keeps_the_end_of_the_response(deberta_rm, make_reward):
    long = "word " * 200 + "the final verdict"
    rm = make_reward("reward_model", model=deberta_rm, max_length=24, template="pair")
    enc = rm.encode(["short question"], [long])
    ids = enc["input_ids"][0].tolist()
    tok = AutoTokenizer.from_pretrained(deberta_rm)
    assert len(ids) == 24 and ids[0] == tok.cls_token_id and ids[-1] == tok.sep_token_id
    assert tok.decode(ids[-4:-1]) == "the final verdict"
    assert tok.decode(ids[1:3]) == "short question"  # the shorter text is kept whole
    right = make_reward("reward_model", model=deberta_rm, max_length=24, template="pair", truncation_side="right")
    assert "verdict" not in tok.decode(right.encode(["short question"], [long])["input_ids"][0])


def test_reranker_scores_query_response_pairs(xlmr_reranker, make_reward, make_batch):
    batch = make_batch(PROMPTS, RESPONSES, messages=[conversation(p) for p in PROMPTS])
    tok = AutoTokenizer.from_pretrained(xlmr_reranker)
    logits = torch.stack(
        [forward(xlmr_reranker, **tok(p, r, return_tensors="pt"))[0] for p, r in zip(PROMPTS, RESPONSES)]
    )
    sig = make_reward("reranker", model=xlmr_reranker).score(batch)
    torch.testing.assert_close(sig, torch.sigmoid(logits), atol=1e-5, rtol=1e-5)
    raw = make_reward("reranker", model=xlmr_reranker, activation="none", batch_size=1).score(batch)
    torch.testing.assert_close(raw, logits, atol=1e-5, rtol=1e-5)
    assert logits.max() - logits.min() > 0.05


def test_reranker_query_field_and_reference_comparison(xlmr_reranker, make_reward, make_batch):
    answers = ["Paris", "red", "晴天", "4"]
    batch = make_batch(PROMPTS, RESPONSES, answers=answers, metadata=[{"topic": a + "?"} for a in answers])
    tok = AutoTokenizer.from_pretrained(xlmr_reranker)

    def logit(q, p):
        return forward(xlmr_reranker, **tok(q, p, return_tensors="pt"))[0]

    by_topic = make_reward("reranker", model=xlmr_reranker, activation="none", query="metadata.topic").score(batch)
    torch.testing.assert_close(by_topic, torch.stack([logit(a + "?", r) for a, r in zip(answers, RESPONSES)]))
    batch["messages"] = [conversation(p) for p in PROMPTS]
    diff = make_reward("reranker", model=xlmr_reranker, activation="none", subtract_reference=True).score(batch)
    expected = torch.stack([logit(q, r) - logit(q, a) for q, r, a in zip(PROMPTS, RESPONSES, answers)])
    torch.testing.assert_close(diff, expected, atol=1e-5, rtol=1e-5)


def test_a_model_with_several_labels_needs_label_index(xlmr_3labels, make_reward, make_batch):
    with pytest.raises(ValueError, match=r"has 3 labels \(0: LABEL_0, 1: LABEL_1, 2: LABEL_2\); set label_index"):
        make_reward("reranker", model=xlmr_3labels)
    with pytest.raises(ValueError, match="label_index is 5, but model .* has 3 label"):
        make_reward("reranker", model=xlmr_3labels, label_index=5)
    batch = make_batch(PROMPTS[:2], RESPONSES[:2], messages=[conversation(p) for p in PROMPTS[:2]])
    probs = make_reward("reranker", model=xlmr_3labels, label_index=2, activation="softmax").score(batch)
    tok = AutoTokenizer.from_pretrained(xlmr_3labels)
    model = AutoModelForSequenceClassification.from_pretrained(xlmr_3labels).eval()
    with torch.no_grad():
        ref = [
            torch.softmax(model(**tok(p, r, return_tensors="pt")).logits[0], -1)[2]
            for p, r in zip(PROMPTS[:2], RESPONSES[:2])
        ]
    torch.testing.assert_close(probs, torch.stack(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="this machine has a second GPU")
def test_a_missing_device_is_named(xlmr_reranker, make_reward):
    message = r"reward function 'reranker': device is 'cuda:1', but torch sees no CUDA device .* device to cpu"
    with pytest.raises(ValueError, match=message):
        make_reward("reranker", model=xlmr_reranker, device="cuda:1")


def test_config_errors_name_the_key(tmp_path, xlmr_reranker):
    base = {"model": {"path": "unused"}, "data": {"source": "reasoning_gym", "task": "chain_sum"}}
    with pytest.raises(
        ConfigError, match="Unknown key 'temprature' in rewards\\[0\\] \\(reward function 'reranker'\\)"
    ):
        load_config(data=base | {"rewards": [{"function": "reranker", "model": xlmr_reranker, "temprature": 1}]})
    with pytest.raises(ConfigError, match="rewards\\[0\\].query: String should match pattern"):
        load_config(data=base | {"rewards": [{"function": "reranker", "model": xlmr_reranker, "query": "question"}]})


def test_a_missing_model_folder_says_what_to_give(make_reward):
    with pytest.raises(FileNotFoundError, match="reward function 'reward_model': model './nope' does not exist"):
        make_reward("reward_model", model="./nope")
    with pytest.raises(FileNotFoundError, match="package 'no_such_pkg' is not installed"):
        make_reward("reward_model", model="package:no_such_pkg/model")
