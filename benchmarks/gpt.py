"""A small GPT: a decoder-only transformer over bytes, for the convergence benchmark.

Pre-LayerNorm blocks (``x + attn(ln(x))``, ``x + mlp(ln(x))``), causal multi-head self-attention through
``F.scaled_dot_product_attention``, a GELU MLP four times wider than the model, learned positional
embeddings, and an output head separate from (untied to) the input embedding. No dropout: a run is a
deterministic function of its seed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    d_model: int
    n_layer: int
    n_head: int
    context: int  # longest sequence the positional embedding covers
    vocab_size: int = 256

    def to_dict(self) -> dict:
        return asdict(self)

    def num_params(self) -> int:
        """Parameters of :class:`GPT` with this configuration (without building it)."""
        d = self.d_model
        per_block = 12 * d * d + 13 * d  # qkv, proj, fc, proj (weights and biases), two LayerNorms
        return 2 * self.vocab_size * d + self.context * d + self.n_layer * per_block + 2 * d


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"d_model={cfg.d_model} is not a multiple of n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (b, t, 3d) -> three (b, n_head, t, head_dim)
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """``forward(idx, targets)`` returns the mean next-token cross-entropy (nats) of ``idx`` (b, t) int64."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_out = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # N(0, 0.02) for embeddings and matrices, zero biases; the projections back into the residual
        # stream are scaled down by sqrt(2 * n_layer) so the stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            # LayerNorm weights keep their default of one

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds the model's context of {self.cfg.context}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_out(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Two groups: weight matrices decay, embeddings, biases and LayerNorm weights do not."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            is_matrix = p.dim() == 2 and not name.endswith("_emb.weight")
            (decay if is_matrix else no_decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
