"""A tiny target and an exported EAGLE-4 drafter that agree often: runtime tests need accepted spans.

A random drafter is almost never accepted, which would leave the accept/compact/catch-up paths of
the runtime untested. Here the target is *mostly bigram*: every layer's o_proj and down_proj are
scaled by ``mix`` (default 0.3), so its next token depends mainly on the current one and a
little on the context (the KV cache still matters). The drafter is built to imitate that bigram
part (the head is untied: a tied head's bigram argmax is the token itself, so greedy text
would repeat one token): eh_proj = [I, 0] (the step input is the normalised token embedding), its attention and
MLP outputs scaled by ``mix`` as well, its LM head is the target's, and ``noise`` perturbs eh_proj. Greedy acceptance is high
but not perfect, which is what the equality tests need.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from torchspec.config import DrafterConfig
from torchspec.export.serving import export_drafter, target_identity
from torchspec.models import build_drafter
from torchspec.targets import TargetDecoder, build_tiny_target

AUX = [1, 2, 3]


def build_pair(root, tokenizer=None, *, flavour: str = "llama", vocab_size: int = 384, mix: float = 0.3,
               seed: int = 0, sliding_window: int | None = 6, lm_head_rank: int = 0, lm_head_topk: int = 16,
               initializer_range: float = 0.02, noise: float = 0.1, num_layers: int = 6, moe: bool = False
               ) -> tuple[str, str]:
    """Write a target dir and a drafter export under ``root``; return (target_dir, export_dir)."""
    target_dir = build_tiny_target(str(root / f"target_{flavour}"), flavour=flavour, vocab_size=vocab_size,
                                   num_layers=num_layers, tokenizer=tokenizer, seed=seed, tie_word_embeddings=False,
                                   initializer_range=initializer_range)
    weights = load_file(f"{target_dir}/model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight", "linear_attn.out_proj.weight")):  # + GDN outputs
            weights[name] = weights[name] * mix
    save_file(weights, f"{target_dir}/model.safetensors", metadata={"format": "pt"})

    target = TargetDecoder.from_pretrained(target_dir, aux_layer_ids=AUX)
    cfg = DrafterConfig(sliding_window=sliding_window, lm_head_rank=lm_head_rank, lm_head_topk=lm_head_topk, moe=moe,
                        moe_shared_expert=moe)
    torch.manual_seed(seed + 1)
    drafter = build_drafter(cfg, target.config, AUX)
    drafter.init_from_target(target.embed_tokens_weight, target.lm_head_weight)
    h = drafter.config.hidden_size
    with torch.no_grad():
        drafter.eh_proj.weight.zero_()
        drafter.eh_proj.weight[:, :h] = torch.eye(h)
        drafter.eh_proj.weight.add_(noise / h**0.5 * torch.randn(h, 2 * h))
        drafter.layer.self_attn.o_proj.weight.mul_(mix * 5)
        mlp = drafter.layer.mlp
        for down in ((mlp.down, mlp.shared_expert.down_proj.weight) if moe else (mlp.down_proj.weight,)):
            down.mul_(mix * 5)
    export_dir = str(root / f"drafter_{flavour}_{lm_head_rank}{'_moe' if moe else ''}")
    export_drafter(drafter, export_dir, dtype=torch.float32, target_identity=target_identity(target))
    return target_dir, export_dir
