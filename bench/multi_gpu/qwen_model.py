"""A compact Qwen2-style decoder (RMSNorm, grouped-query attention, SwiGLU MLP, rotary positions)
for the end-to-end timing runs. Random init; the shapes are what matter for step time."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class QwenConfig:
    vocab: int = 151936
    hidden: int = 1536
    intermediate: int = 8960
    layers: int = 28
    heads: int = 12
    kv_heads: int = 2
    rope_theta: float = 1e6

    @staticmethod
    def named(name: str) -> "QwenConfig":
        presets = {
            "qwen2.5-1.5b": QwenConfig(),
            "qwen2.5-0.5b": QwenConfig(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2),
            "tiny": QwenConfig(vocab=512, hidden=64, intermediate=176, layers=2, heads=4, kv_heads=2),
        }
        return presets[name]


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding over the last dimension of (b, h, t, d)."""
    d, t = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, c: QwenConfig):
        super().__init__()
        hd = c.hidden // c.heads
        self.c, self.hd = c, hd
        self.input_norm = nn.RMSNorm(c.hidden)
        self.q_proj = nn.Linear(c.hidden, c.heads * hd, bias=True)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(c.heads * hd, c.hidden, bias=False)
        self.post_norm = nn.RMSNorm(c.hidden)
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.input_norm(x)
        q = self.q_proj(h).view(b, t, self.c.heads, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.c.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.c.kv_heads, self.hd).transpose(1, 2)
        q, k = rotary(q, self.c.rope_theta), rotary(k, self.c.rope_theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Qwen(nn.Module):
    def __init__(self, c: QwenConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        for p in self.parameters():
            if p.ndim >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                loss_chunk: int = 0) -> torch.Tensor:
        """The logits; with targets, the mean cross-entropy instead. loss_chunk > 0 computes it
        that many tokens at a time, each chunk's logits recomputed in backward: the (tokens x
        vocab) float32 logits never exist whole (1.2 GiB and as much again for their softmax at
        2048 tokens and Qwen's vocabulary, what ran eight ranks sharing one GPU out of memory).
        Inside forward, so that FSDP2 holds the head's weight gathered for every chunk."""
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        h = self.norm(x)
        if targets is None:
            return self.lm_head(h)
        h, t = h.reshape(-1, h.shape[-1]), targets.reshape(-1)

        def part(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(self.lm_head(hc).float(), tc, reduction="sum")

        if loss_chunk <= 0:
            return part(h, t) / h.shape[0]
        total = sum(checkpoint(part, h[i:i + loss_chunk], t[i:i + loss_chunk], use_reentrant=False)
                    for i in range(0, h.shape[0], loss_chunk))
        return total / h.shape[0]
