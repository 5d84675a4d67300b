"""What the training-framework tests share: tiny models built from code (random init, never downloaded),
synthetic data, and the comparisons between two trained models.

Sizes are chosen so that both kinds of state occur: a tensor of at least ``min_quant_size`` (4096) elements
gets 8-bit state, a smaller one fp32 state.
"""

from __future__ import annotations

import torch

VOCAB = 128
SEQ_LEN = 32

# A resumed run is compared with an uninterrupted one, for our optimizer and for torch.optim.AdamW under the same
# framework; ours may differ by twice torch's difference or by this floor, whichever is larger. Our state_dict
# resumes bit for bit, so a difference can only come from the framework (data order, RNG), which torch's run
# meets too. The floor is about one fp32 ulp of a weight of magnitude 1 (1.2e-7) and a thousandth of a single
# step at the tests' learning rate (1e-3): a Trainer resume that lost the moments ends 5e-3 away (measured),
# thousands of times this floor.
RESUME_FLOOR = 1e-6

# AdamW8bit against torch.optim.AdamW after a few steps under the same framework: the distance between the two
# final models over the distance torch's model travelled (L2 over all parameters). The 8-bit moments carry a
# relative rounding error of a few percent per element; measured 1.3% (fp32) and 1.6% (bf16 autocast) after
# 5 steps of the tiny GPT-2, and fp32-state ours against torch 6e-6. A run whose learning rate or schedule did
# not reach our optimizer lands far outside (measured: 31% with the learning rate 1.3x, 51% without the schedule).
QUANTIZED_DRIFT = 0.05


def tiny_gpt2(seed: int = 0):
    """A 2-layer GPT-2 with 64-wide embeddings (112k parameters): the token embedding (8192 elements, tied with the
    LM head), the position embedding and every attention and MLP matrix get 8-bit state; biases and LayerNorms
    keep fp32 state."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config)


class TokenDataset(torch.utils.data.Dataset):
    """``n`` random token sequences; each item is a causal-LM example (the model shifts the labels)."""

    def __init__(self, n: int = 64, seed: int = 1):
        gen = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=gen)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def mlp(seed: int = 0) -> torch.nn.Module:
    """64 -> 128 -> 8: the first weight (8192 elements) gets 8-bit state, the rest fp32 state."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8))


def regression_batch(seed: int, size: int = 8):
    """A batch for :func:`mlp` that depends only on ``seed``, so a resumed run sees the same data without the
    framework having to restore a data loader's position."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(size, 64, generator=gen), torch.randn(size, 8, generator=gen)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b - start|| over all parameters: how far ``a`` ended from ``b``, in units of how far ``b``
    travelled from ``start``."""
    apart = sum((a[k].float() - b[k].float()).square().sum() for k in b).sqrt()
    travelled = sum((b[k].float() - start[k].float()).square().sum() for k in b).sqrt()
    return (apart / travelled).item()


def assert_resumes_as_closely_as_torch(ours: float, torchs: float) -> None:
    """``ours``/``torchs``: max abs difference between a resumed and an uninterrupted run (see RESUME_FLOOR)."""
    assert ours <= max(2 * torchs, RESUME_FLOOR), (
        f"resuming moved our run {ours:.3g} away from the uninterrupted one; torch.optim.AdamW's moved {torchs:.3g}"
    )
