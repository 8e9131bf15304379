"""Model FLOPs for the MFU metrics, against a count by hand."""

import torch

from hybridrl.batch import Batch
from hybridrl.flops import PEAK_BF16, forward_flops, peak_flops
from hybridrl.metrics import update_throughput
from hybridrl.models import load_causal_lm


def test_forward_flops_of_the_tiny_llama_by_hand(tiny_model):
    model = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    c = model.config  # hidden 64, 4 heads of 16, 2 KV heads, MLP 128, 2 layers, tied embeddings
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (64, 4, 2, 128)
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # q, k and v (2 KV heads of 16), o, gate/up/down
    vocab = c.vocab_size
    seqs, logits = [10, 6], 5
    want = 2 * 2 * per_layer * 16 + 2 * vocab * 64 * logits + 2 * 2 * 64 * (10 * 10 + 6 * 6)
    assert forward_flops(model, seqs, logits) == want


def test_update_throughput_counts_real_tokens_and_three_passes(tiny_model):
    model = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    batch = Batch()
    batch["prompt_mask"] = torch.tensor([[0, 1, 1], [1, 1, 1]])
    batch["response_mask"] = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    m = update_throughput(model, batch, epochs=2, seconds=0.5, device=torch.device("cpu"))
    assert m["throughput/train_tokens_per_s"] == (4 + 7) * 2 / 0.5
    assert m["throughput/update_tflops"] == 3 * 2 * forward_flops(model, [4, 7], 6) / 0.5 / 1e12
    assert "throughput/update_mfu" not in m  # no known peak on a CPU


def test_shared_prompts_count_once_in_the_flops(tiny_model):
    """Two rows answer prompt [5, 6, 7] (3 tokens, one left-padding column), one answers [8, 9]."""
    model = load_causal_lm(tiny_model, torch.float32, torch.device("cpu"))
    batch = Batch()
    batch["prompts"] = torch.tensor([[0, 5, 6, 7], [0, 5, 6, 7], [0, 0, 8, 9]])
    batch["prompt_mask"] = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]])
    batch["response_mask"] = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    full = update_throughput(model, batch, epochs=1, seconds=1.0, device=torch.device("cpu"))
    shared = update_throughput(model, batch, epochs=1, seconds=1.0, device=torch.device("cpu"), share_prompts=True)
    assert full["throughput/train_tokens_per_s"] == shared["throughput/train_tokens_per_s"] == 5 + 6 + 3
    c = model.config
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    # the second row's prompt: 3 tokens fewer through the body, its 3 x 3 attention square fewer
    saved = 2 * 2 * per_layer * 3 + 2 * 2 * 64 * 3 * 3
    assert c.num_hidden_layers == 2
    want = full["throughput/update_tflops"] - 3 * saved / 1e12
    assert abs(shared["throughput/update_tflops"] - want) < 1e-15


def test_peaks_match_the_most_specific_name_first():
    names = [n for n, _ in PEAK_BF16]
    assert names.index("H100 PCIe") < names.index("H100") and names.index("GH200") < names.index("H200")
    assert peak_flops(torch.device("cpu")) is None
