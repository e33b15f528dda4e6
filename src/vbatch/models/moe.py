"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a top-k router, then each expert's
gated MLP over the tokens routed to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vbatch.layers.activation import ACTIVATIONS
from vbatch.models.config import ModelConfig


class MoeExperts(nn.Module):
    """Every expert's weights stacked, as transformers 5 holds them: gate_up_proj
    [num_experts, 2 * intermediate, hidden] (gate rows first), down_proj
    [num_experts, hidden, intermediate]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    """softmax(router logits) in float32, the top k experts per token (torch.topk's choice, as
    transformers), their weights renormalised to sum 1 where the family says (norm_topk_prob;
    Mixtral always), then the weighted sum of those experts' outputs.

    Experts run grouped: the (token, expert) pairs are sorted by expert, and each expert with
    tokens runs two GEMMs over all of its rows. Each token then sums its k outputs in ascending
    expert order, the order transformers adds them in, so the sums round alike.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.act = ACTIVATIONS[config.hidden_act]
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = MoeExperts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens, hidden_size = x.shape
        top_k = self.top_k
        # [num_tokens, num_experts]
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        # [num_tokens, top_k] each
        weights, experts = torch.topk(probs, top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        experts, by_expert = experts.sort(dim=-1)
        # [num_tokens * top_k]: pair p is token p // top_k's (p % top_k)-th lowest expert
        pair_weights = weights.gather(-1, by_expert).to(x.dtype).flatten()
        pair_experts = experts.flatten()
        # NOTE: a stable sort keeps each expert's pairs in token order.
        order = torch.argsort(pair_experts, stable=True)
        # NOTE: one host sync per layer (as transformers); the engine runs MoE models without
        # CUDA graphs for it.
        counts = torch.bincount(pair_experts, minlength=self.experts.gate_up_proj.shape[0])
        # NOTE: index_copy_, not index_add_: on CPU index_add_ costs milliseconds a call when
        # threads are oversubscribed, and each pair is written once.
        pair_out = x.new_empty(num_tokens * top_k, hidden_size)
        size = self.experts.intermediate_size
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            pairs = order[start : start + count]
            # [count, 2 * intermediate]
            gate_up = F.linear(x.index_select(0, pairs // top_k), self.experts.gate_up_proj[expert])
            y = F.linear(
                self.act(gate_up[:, :size]) * gate_up[:, size:], self.experts.down_proj[expert]
            )
            pair_out.index_copy_(0, pairs, y * pair_weights.index_select(0, pairs)[:, None])
            start += count
        # [num_tokens, top_k, hidden_size]
        per_token = pair_out.view(num_tokens, top_k, hidden_size)
        out = per_token[:, 0]
        for j in range(1, top_k):
            out = out + per_token[:, j]
        return out
