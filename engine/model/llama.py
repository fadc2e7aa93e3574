"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) running over the paged KV pool.

Parameter names equal transformers' state-dict names, so a checkpoint loads name for name. Numerics
follow transformers' implementation op for op (RMSNorm in float32, RoPE tables computed in float32
then cast), so float32 logits agree with it to rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv.pool import KVPool
from engine.model.attention import TorchAttention
from engine.model.attention_backend import AttentionBackend, AttentionPlan
from engine.model.config import ModelConfig, RopeScaling
from engine.model.forward_batch import ForwardBatch


class _Linear(nn.Linear):
    """An ``nn.Linear`` whose parameters stay as allocated: the loader overwrites them. A random init would cost
    seconds on a large model, and torch's ``skip_init`` (built on the meta device) costs a second and a half at the
    first model a process builds, however small (its meta-device init imports torch's Python reference kernels)."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(nn.Embedding):
    """An ``nn.Embedding`` left as allocated, for the same reason as :class:`_Linear`."""

    def reset_parameters(self) -> None:
        pass


def _linear(
    in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
) -> nn.Linear:
    return _Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back before the weight, as transformers does."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # The same arithmetic in one op (bit for bit here): a third of the CPU time of the eight below.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [D/2] in float32, including Llama 3.1 scaling, computed as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [D/2]
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)  # [D/2]
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )  # [D/2]
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled  # [D/2]
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)  # [D/2]
    return torch.where(is_medium, smoothed, scaled)  # [D/2]


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_position_embeddings, precomputed once."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # [D/2]
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)  # [P]
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]
        # Non-persistent: derived from the config, never part of a checkpoint.
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos().to(dtype=dtype, device=device), persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin().to(dtype=dtype, device=device), persistent=False)  # [P, D/2]
        self.max_positions = config.max_position_embeddings

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions`` [T], each [T, 1, D/2] (broadcast over heads)."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate half-split pairs; x: [T, H, D], cos/sin: [T, 1, D/2]. Same rounding as rotate_half form."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, H, D]


class LlamaAttention(nn.Module):
    """q/k/v/o projections, optional per-head q/k RMSNorm (Qwen3), RoPE and paged attention."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = _linear(hidden, q_dim, config.qkv_bias, dtype, device)
        self.k_proj = _linear(hidden, kv_dim, config.qkv_bias, dtype, device)
        self.v_proj = _linear(hidden, kv_dim, config.qkv_bias, dtype, device)
        self.o_proj = _linear(q_dim, hidden, config.o_bias, dtype, device)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attention: AttentionPlan,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attention.attend(q, k, v, k_cache, v_cache)  # [T, H, D]
        return self.o_proj(o.reshape(tokens, -1))  # [T, hidden]


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = _linear(hidden, inter, bias, dtype, device)
        self.up_proj = _linear(hidden, inter, bias, dtype, device)
        self.down_proj = _linear(inter, hidden, bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, hidden]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, device)
        self.mlp = LlamaMLP(config, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attention: AttentionPlan,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, k_cache, v_cache, attention)  # [T, hidden]
        return h + self.mlp(self.post_attention_layernorm(h))  # [T, hidden]


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (transformers' ``model.`` prefix)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        layers = (LlamaDecoderLayer(config, dtype, device) for _ in range(config.num_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config, dtype, device)


class LlamaForCausalLM(nn.Module):
    """The causal LM: one ``forward`` per engine step over a ForwardBatch and the KV pool.

    Weights are uninitialised until ``engine.model.loader.load_model`` fills them. ``attention``: the attention
    backend (engine/model/attention_backend.py; default the torch reference).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        attention: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.attention: AttentionBackend = attention if attention is not None else TorchAttention()
        self.model = LlamaModel(config, dtype, device)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)
        # Layers with the same window share one set of masks per forward.
        self._windows = tuple(config.layer_window(i) for i in range(config.num_layers))

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv: KVPool) -> torch.Tensor:
        """Run one step; returns float32 logits ``[batch.num_logits_rows, vocab]`` in sequence order."""
        self.check(batch, kv)
        plans = {w: self.attention.plan(batch, w) for w in set(self._windows)}
        rope = self.model.rotary_emb(batch.positions)
        h = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        for i, layer in enumerate(self.model.layers):
            h = layer(h, rope, kv.k(i), kv.v(i), plans[self._windows[i]])  # [T, hidden]
        h = self.model.norm(h.index_select(0, batch.logits_rows))  # [R, hidden]
        return self.lm_head(h).float()  # [R, V]

    def check(self, batch: ForwardBatch, kv: KVPool) -> None:
        """A batch the model can run over ``kv``; raises ValueError naming what does not fit."""
        # Checked on host-side ints: an out-of-range index on CUDA would be an opaque device assert.
        if batch.max_position >= self.model.rotary_emb.max_positions:
            raise ValueError(
                f"position {batch.max_position} exceeds max_position_embeddings {self.model.rotary_emb.max_positions}"
            )
        if batch.max_page >= kv.num_pages:
            raise ValueError(f"page id {batch.max_page} is outside the KV pool of {kv.num_pages} pages")
        if batch.page_size != kv.page_size:
            raise ValueError(f"batch page_size {batch.page_size} != KV pool page_size {kv.page_size}")
        dtype = self.model.embed_tokens.weight.dtype  # the model's (its linears may be packed: panel_linear.py)
        if kv.dtype != dtype:
            raise ValueError(f"KV pool dtype {kv.dtype} != model dtype {dtype}")
        if kv.num_layers != self.config.num_layers:
            raise ValueError(f"KV pool has {kv.num_layers} layers, model has {self.config.num_layers}")
