"""Sparse mixture-of-experts blocks in the Qwen3-MoE layout (transformers' ``qwen3_moe``).

Which layers are sparse: ``num_experts > 0``, ``(layer + 1) % decoder_sparse_step == 0`` and the layer not in
``mlp_only_layers``; the others keep a dense MLP of ``intermediate_size``. Routing is transformers': router
logits ``gate(x)`` in the model dtype, softmax in float32, the top ``num_experts_per_tok`` experts, their
probabilities renormalized to sum 1 when ``norm_topk_prob``, cast back to the model dtype. Module names are the
checkpoint's (``mlp.gate.weight``, ``mlp.experts.<e>.{gate,up,down}_proj.weight``), so weights load by name and
tensor parallelism slices every expert's intermediate dimension (``runtime.models.parallel``). ``fuse()`` (serving,
after weights load) stacks the experts into ``w13`` [E, 2I, H] and ``w2`` [E, H, I], the layout every expert
kernel (``runtime.kernels.moe``) reads.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.kernels.moe import EXPERT_KERNELS
from runtime.models.parallel import SINGLE, ParallelContext


def sparse_layer_ids(config) -> list[int]:
    """The decoder layers whose MLP is a sparse MoE block (none for a dense config)."""
    experts = int(getattr(config, "num_experts", 0) or 0)
    if experts <= 0:
        return []
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return [i for i in range(config.num_hidden_layers) if (i + 1) % step == 0 and i not in dense]


class Expert(nn.Module):
    """One expert's SwiGLU weights (a holder: the block's kernel runs them all at once)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class SparseMoeBlock(nn.Module):
    """Router + experts; ``backend`` names the expert kernel (``runtime.kernels.moe.EXPERT_KERNELS``)."""

    def __init__(self, config, backend: str):
        super().__init__()
        if backend not in EXPERT_KERNELS:
            raise ValueError(f"moe backend {backend!r} has no expert kernel here; implemented: "
                             f"{sorted(EXPERT_KERNELS)}")
        hidden, experts = config.hidden_size, int(config.num_experts)
        self.top_k = int(config.num_experts_per_tok)
        if not 1 <= self.top_k <= experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in 1..num_experts ({experts})")
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, config.moe_intermediate_size) for _ in range(experts))
        self.backend = backend
        self.kernel = EXPERT_KERNELS[backend]
        self.parallel: ParallelContext = SINGLE  # set by tensor parallelism: the block all-reduces its output
        self.w13: nn.Parameter | None = None  # [E, 2I, H] after fuse()
        self.w2: nn.Parameter | None = None  # [E, H, I] after fuse()

    @property
    def num_experts(self) -> int:
        return self.gate.out_features

    def fuse(self) -> None:
        """Stack the experts' weights into ``w13``/``w2`` and drop the per-expert modules (serving only)."""
        with torch.no_grad():
            w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts])
            w2 = torch.stack([e.down_proj.weight for e in self.experts])
        self.w13, self.w2 = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)
        del self.experts

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.w13 is not None:
            return self.w13, self.w2
        return (torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in self.experts]),
                torch.stack([e.down_proj.weight for e in self.experts]))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, ids = self.route(x)
        return self.parallel.all_reduce(self.kernel(x, *self.stacked_weights(), weights, ids))

    def expert_ids(self, x: torch.Tensor) -> torch.Tensor:
        """The experts ``x`` [T, H] wakes (for measuring how many a verify block touches): [T, k]."""
        return self.route(x)[1]
