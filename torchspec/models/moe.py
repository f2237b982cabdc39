"""Mixture-of-experts MLP for the EAGLE-4 drafter's single decoder layer.

For a token x in R^H, E SwiGLU experts, router W_r in R^{E x H} and top-k routing:

    p        = softmax(W_r x)                      in fp32 (logits too: routing is decided in fp32)
    S        = top-k indices of p                  (|S| = k)
    w_e      = p_e / sum_{j in S} p_j   for e in S (``norm_topk_prob=True``, the default)
             = p_e                                 (``norm_topk_prob=False``)
    expert_e = down_e( silu(gate_e x) * up_e x )
    moe(x)   = sum_{e in S} w_e expert_e(x)  [ + shared(x) if ``shared_expert`` ]
    out      = RMSNorm(moe(x))  if ``extra_norm``  else  moe(x)

With k = 1 and renormalisation, w = p_e / p_e = 1 exactly, so E = 1, k = 1 reproduces the dense
``SwiGLU`` with the same weights. The price: with k = 1 the router then gets gradient from the
auxiliary loss only (dw/dp = 0); ``norm_topk_prob=False`` (Switch-Transformer style) lets the task
loss reach it too. For k >= 2 the renormalised weights still depend on the router.

Load-balancing loss (Switch Transformer, eq. 4, generalised to k slots per token), over the valid
tokens n = 1..N (``token_mask``):

    f_e = (1 / (N k)) sum_n [e in S_n]   fraction of token-slots routed to e (no gradient)
    P_e = (1 / N)     sum_n p_{n,e}      mean router probability of e    (gradient -> router)
    aux = E sum_e f_e P_e

so sum_e f_e = sum_e P_e = 1 and aux = 1 at perfect balance (f = P = 1/E), up to E when every
token-slot goes to one expert with probability 1. ``expert_load[e] = sum_n [e in S_n]`` (counts,
not fractions) is returned so the caller can all-reduce it across ranks and micro-batches and log
``load_imbalance`` = max load / mean load of the global counts (contract 5). The trainer's loss is this
aux over the micro-batch of EVERY rank, not a mean of per-rank values (the product f P is not linear in the
tokens): ``MoEStats`` therefore also carries ``prob_sum`` and ``num_tokens``, and the trainer all-reduces
the loads before forming it (``torchspec.train.ttt.load_balancing_terms``), so the loss does not depend on
the data-parallel size.

Loss-free balancing (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-
Experts"): a per-expert bias b, a buffer, is added to the router logits for the top-k *selection* only,
S = top-k of (W_r x + b); the weights w_e stay those of p. After every optimizer step the trainer calls
``balance_step(expert_load, rate)``: b_e += rate * sign(mean load - load_e), with the step's global
counts, so an overloaded expert is picked less and an idle one more, without a gradient term. It
exists because the auxiliary loss alone lost on the H200: at 0.01 it was ~0.06% of the drafter's
loss and the router collapsed onto one expert within 100 steps (load imbalance 3.6-3.8 of at most
E/k = 4; docs/results.md, sixth session). b = 0 routes exactly as without it. The bias is kept in fp32
whatever the module's dtype (``_apply``): a bf16 bias would round steps of 0.01 away above 2.

Why ``extra_norm`` normalises the OUTPUT. The EAGLE-4 description adds "an additional
normalisation after the dense layer" for the MoE variant. The MoE input already is
``post_attention_layernorm(x)``; a second RMSNorm on it would be redundant (RMSNorm of an
RMS-normalised vector only rescales per channel, which the first norm's weight already does).
The non-redundant reading is a norm on the MoE output before the residual add (a
"post-feedforward" sandwich norm, as in Gemma 2/3): the size of a routed output depends on which
experts fire and their weights, and normalising it keeps the residual update -- and the state fed
back to the next drafting step -- at a stable magnitude regardless of routing.

Expert weights are stacked parameters, ``gate_up [E, H, 2I]`` (gate in ``[..., :I]``, up in
``[..., I:]``) and ``down [E, I, H]``, i.e. ``x @ W`` layout (the transpose of ``nn.Linear``'s).
Because each stacked tensor is ONE parameter that every forward uses, an expert that receives no
token still gets a gradient: its slice of ``gate_up.grad`` / ``down.grad`` is zero, never None.
Every rank therefore hands the same set of gradients to DDP / FSDP / ZeRO, with no
``0 * param.sum()`` terms and no data-dependent branch.

Two dispatches compute the same function (tested equal, outputs and gradients):

* ``"dense"``: every expert on every token, then pick the top-k outputs. No host sync, plain
  batched matmuls, but E/k times the expert FLOPs and an [E, N, 2I] activation. The reference,
  fine for tiny CPU configs and small E.
* ``"sorted"`` (default): sort the N*k token-slots by expert and run one grouped GEMM
  (``torch.nn.functional.grouped_mm``) over the jagged groups; group offsets stay on the device,
  no token is dropped (no capacity factor), no host sync. Expert FLOPs are exactly those of the k
  chosen experts, which is what matters at drafter sizes (H ~ 5K, I ~ 17K, thousands of tokens
  per micro-batch, K TTT steps whose activations are all kept for backward). Where
  ``grouped_mm`` is unavailable for the operands (older torch, float64, rows not 16-byte
  aligned), a per-expert loop runs instead; it reads the group sizes on the host (one sync).

Measured on one H200 (torch 2.11, bf16 autocast, fwd+bwd, shared expert + extra_norm, N = 8192
tokens, H = 4096, I = 12288): E=8, k=2: dense 143 ms, sorted 49 ms; E=4, k=1: dense 79 ms, sorted
32 ms; sorted also needs less activation memory; outputs bitwise equal. With
``torch.cuda.set_sync_debug_mode("error")`` neither dispatch synchronised under bf16 autocast; in
plain fp32 on CUDA, torch's own ``grouped_mm`` fallback does synchronise, so train in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchspec.models.layers import SwiGLU
from torchspec.targets.layers import RMSNorm

DISPATCHES = ("dense", "sorted")


@dataclass
class MoEStats:
    """Routing statistics of one ``MoEMLP`` call (no host sync happened)."""

    aux_loss: torch.Tensor  # scalar fp32 load-balancing loss of this call's tokens; differentiable w.r.t. the router
    expert_load: torch.Tensor  # [E] fp32 token-slots routed to each expert, valid tokens only; detached
    prob_sum: torch.Tensor  # [E] fp32 router probabilities summed over the valid tokens; differentiable
    num_tokens: torch.Tensor | float  # valid tokens (N of the module docstring)


def load_imbalance(expert_load: torch.Tensor) -> torch.Tensor:
    """max load / mean load over the last dim of ``expert_load [..., E]``.

    1.0 is perfect balance, E means every token-slot went to one expert; 1.0 when no tokens.
    Pass loads already summed over ranks / micro-batches / TTT steps for the global figure.
    """
    load = expert_load.float()
    mean = load.mean(-1)
    ratio = load.amax(-1) / mean.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.where(mean > 0, ratio, torch.ones_like(ratio))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls run in here: autocast's if enabled (grouped_mm is not autocast-aware)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _rows_aligned(dtype: torch.dtype, *row_lengths: int) -> bool:
    """Grouped GEMM kernels need 16-byte aligned row strides of every operand."""
    return all(n * dtype.itemsize % 16 == 0 for n in row_lengths)


def _grouped_mm_fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm") or a.dtype != b.dtype:
        return False
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    # (CUDA fp32/fp16 run through torch's own fallback, which is correct but synchronises with the host.)
    return _rows_aligned(a.dtype, a.shape[-1], b.shape[-1])


def grouped_mm_syncs(device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether the sorted dispatch's grouped GEMMs would read the group sizes on the host here: on CUDA
    torch's grouped_mm is a native kernel for bf16 only (its fp32/fp16 path and ours below sync), and a
    sync is what CUDA graph capture refuses (an fp32 MoE drafter fell back to eager on the H200)."""
    if device.type != "cuda":
        return False  # no graphs off the GPU: a sync costs little there
    native = hasattr(F, "grouped_mm") and dtype == torch.bfloat16
    return not (native and _rows_aligned(dtype, hidden, intermediate, 2 * intermediate))


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``a [M, K]`` grouped by expert (``offs [E]`` int32, cumulative ends, offs[-1] = M)
    times ``b [E, K, N]`` -> ``[M, N]``; group e is ``a[offs[e-1]:offs[e]] @ b[e]``."""
    if _grouped_mm_fits(a, b):
        return F.grouped_mm(a, b, offs=offs)
    bounds = [0, *offs.tolist()]  # host sync: the fallback needs the group sizes
    return torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))])


class MoEMLP(nn.Module):
    """Top-k routed SwiGLU experts (+ optional shared expert, optional output RMSNorm).

    ``forward(x [B, T, H], token_mask [B, T] | None) -> (out [B, T, H], MoEStats)``. Every token
    is computed (static shapes); ``token_mask`` only decides which tokens count in the loads and
    the aux loss (padding should not be balanced).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 shared_expert: bool = False, norm_eps: float = 1e-6, extra_norm: bool = False,
                 norm_topk_prob: bool = True, dispatch: str = "sorted"):
        super().__init__()
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"MoEMLP: need num_experts >= 1 and 1 <= top_k <= num_experts, got "
                             f"num_experts={num_experts}, top_k={top_k}.")
        if dispatch not in DISPATCHES:
            raise ValueError(f"MoEMLP: dispatch={dispatch!r} is not one of {DISPATCHES}.")
        self.num_experts, self.top_k = num_experts, top_k
        self.norm_topk_prob, self.dispatch = norm_topk_prob, dispatch
        self.gate_up = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.down = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.shared_expert = SwiGLU(hidden_size, intermediate_size) if shared_expert else None
        self.output_norm = RMSNorm(hidden_size, norm_eps) if extra_norm else nn.Identity()
        self.register_buffer("route_bias", torch.zeros(num_experts))  # selection only (loss-free balancing)
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._buffers["route_bias"] = self._buffers["route_bias"].float()  # routing is decided in fp32
        return self

    @torch.no_grad()
    def balance_step(self, expert_load: torch.Tensor, rate: float) -> None:
        """Loss-free balancing, once per optimizer step: ``expert_load [E]`` = this step's token-slot
        counts summed over ranks, micro-batches and TTT steps (the same on every rank, so every rank's
        bias stays equal); no tokens leave the bias as it is."""
        load = expert_load.float().to(self.route_bias.device)
        self.route_bias.add_(torch.sign(load.mean() - load), alpha=rate)

    def reset_parameters(self, std: float = 0.02) -> None:
        """Initialise the stacked expert weights (router, shared expert and norm are ordinary
        submodules, initialised by whoever initialises ``nn.Linear`` / ``RMSNorm``)."""
        nn.init.normal_(self.gate_up, std=std)
        nn.init.normal_(self.down, std=std)

    @torch.no_grad()
    def load_expert(self, index: int, mlp: SwiGLU) -> None:
        """Copy a dense ``SwiGLU``'s weights into expert ``index``."""
        i = self.down.shape[1]
        self.gate_up[index, :, :i].copy_(mlp.gate_proj.weight.t())
        self.gate_up[index, :, i:].copy_(mlp.up_proj.weight.t())
        self.down[index].copy_(mlp.down_proj.weight.t())

    @classmethod
    def from_dense(cls, mlp: SwiGLU, num_experts: int = 1, top_k: int = 1, **kwargs) -> MoEMLP:
        """Every expert a copy of ``mlp`` ("sparse upcycling" of a dense MLP, e.g. an EAGLE-3
        warm start). The router keeps its fresh initialisation; ``kwargs`` go to ``__init__``."""
        moe = cls(mlp.gate_proj.in_features, mlp.gate_proj.out_features, num_experts, top_k, **kwargs)
        moe.to(device=mlp.gate_proj.weight.device, dtype=mlp.gate_proj.weight.dtype)
        for e in range(num_experts):
            moe.load_expert(e, mlp)
        return moe

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> probs [N, E] fp32, top_idx [N, k], weights [N, k] fp32."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.weight.float())  # [N, E]
        probs = torch.softmax(logits, dim=-1)
        top_idx = (logits + self.route_bias).topk(self.top_k, dim=-1).indices  # [N, k]; b = 0: topk of probs
        top_p = probs.gather(1, top_idx)
        weights = top_p / top_p.sum(-1, keepdim=True) if self.norm_topk_prob else top_p
        return probs, top_idx, weights

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None, with_stats: bool = True
                ) -> tuple[torch.Tensor, MoEStats | None]:
        b, t, h = x.shape
        flat = x.reshape(b * t, h)  # [N, H]
        probs, top_idx, weights = self.route(flat)
        experts = self._dense_experts if self.dispatch == "dense" else self._sorted_experts
        picked = experts(flat, top_idx)  # [N, k, H]
        out = (picked.float() * weights[..., None]).sum(1)  # [N, H] fp32
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat).float()
        out = self.output_norm(out.to(picked.dtype)).reshape(b, t, h)
        return out, self._stats(probs, top_idx, token_mask) if with_stats else None  # serving needs none

    def _dense_experts(self, x: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
        """All experts on all tokens, then gather the chosen ones: [N, H] -> [N, k, H]."""
        dtype = _compute_dtype(x)
        gate, up = torch.matmul(x.to(dtype), self.gate_up.to(dtype)).chunk(2, dim=-1)  # [E, N, I] each
        y = torch.matmul(F.silu(gate) * up, self.down.to(dtype))  # [E, N, H]
        rows = torch.arange(x.shape[0], device=x.device)
        return y[top_idx, rows[:, None]]  # [N, k, H]

    def _sorted_experts(self, x: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
        """Token-slots sorted by expert through one grouped GEMM per projection: [N, H] -> [N, k, H]."""
        n, k = top_idx.shape
        dtype = _compute_dtype(x)
        if grouped_mm_syncs(x.device, dtype, x.shape[-1], self.down.shape[1]):
            return self._dense_experts(x, top_idx)  # static shapes, E / k x the FLOPs, no host sync
        slot_expert = top_idx.reshape(-1)  # [N*k]; slot s belongs to token s // k
        order = slot_expert.argsort(stable=True)  # [N*k] slots grouped by expert
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, slot_expert, torch.ones_like(slot_expert))  # [E], no host sync
        offs = counts.cumsum(0).to(torch.int32)
        xs = x.to(dtype)[order // k]  # [N*k, H]
        gate, up = grouped_mm(xs, self.gate_up.to(dtype), offs).chunk(2, dim=-1)  # [N*k, I] each
        ys = grouped_mm(F.silu(gate) * up, self.down.to(dtype), offs)  # [N*k, H]
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(n * k, device=x.device))
        return ys[inverse].view(n, k, -1)  # back to slot order: deterministic, no atomics

    def _stats(self, probs: torch.Tensor, top_idx: torch.Tensor, token_mask: torch.Tensor | None
               ) -> MoEStats:
        n, e = probs.shape
        chosen = torch.zeros_like(probs).scatter_(1, top_idx, 1.0)  # [N, E] 1 where routed
        if token_mask is not None:
            valid = token_mask.reshape(n, 1).to(probs.dtype)  # [N, 1]
            chosen, probs = chosen * valid, probs * valid
            num_tokens = valid.sum()
            num_valid = num_tokens.clamp(min=1)
        else:
            num_tokens = float(n)  # Python numbers: no host-to-device copy (CUDA graphs)
            num_valid = float(max(n, 1))
        expert_load = chosen.sum(0)  # [E]
        prob_sum = probs.sum(0)  # [E]
        f = expert_load / (num_valid * self.top_k)
        p = prob_sum / num_valid
        # num_tokens unclamped: a rank whose tokens are all masked adds 0 to the global count, not 1
        return MoEStats(aux_loss=e * (f * p).sum(), expert_load=expert_load.detach(), prob_sum=prob_sum,
                        num_tokens=num_tokens)
