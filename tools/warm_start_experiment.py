"""Does a warm-started EAGLE-4 drafter start where its EAGLE-3 source is? (CPU, tiny target, minutes)

    python tools/warm_start_experiment.py --out-dir outputs/warm_start [--e3-steps 150] [--e4-steps 150]

Trains an EAGLE-3 drafter for ``--e3-steps`` on synthetic chats over a tiny random target, converts it
(``torchspec.export.warm_start``), evaluates held-out acceptance of EAGLE-3, the converted EAGLE-4
(step 0) and a randomly initialised EAGLE-4, then trains both EAGLE-4 drafters ``--e4-steps`` with
the same optimizer and data, logging held-out acceptance every ``--eval-every`` steps. Prints a
table; writes ``warm_start.json`` and ``warm_start.png`` into ``--out-dir``.

``--distill-steps N`` adds a third EAGLE-4: the converted one, then N steps distilled from EAGLE-3 on the fit
batch (``torchspec.export.warm_start_distill``, what ``torchspec-convert --distill-steps`` runs), then trained
like the others. Its curve counts only the steps after the distillation.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import make_conversations  # noqa: E402

from torchspec.data import build_tiny_tokenizer, collate, tokenize_conversation  # noqa: E402
from torchspec.data.dataset import Example  # noqa: E402
from torchspec.data.vocab import build_vocab_mapping  # noqa: E402
from torchspec.export.warm_start import eagle3_to_eagle4, format_report  # noqa: E402
from torchspec.export.warm_start_distill import distill_from_eagle3  # noqa: E402
from torchspec.export.warm_start_fit import attention_fit_error  # noqa: E402
from torchspec.models.eagle3 import Eagle3Config, Eagle3Drafter  # noqa: E402
from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter  # noqa: E402
from torchspec.targets import TargetDecoder, build_tiny_target  # noqa: E402
from torchspec.train.loss import TeacherHead
from torchspec.train.ttt import summarize, ttt_unroll, valid_counts  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", default="outputs/warm_start")
    p.add_argument("--e3-steps", type=int, default=150)
    p.add_argument("--e4-steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear LR warmup steps (every model trained here)")
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--draft-vocab", type=int, default=192)
    p.add_argument("--moe", action="store_true", help="convert to the MoE EAGLE-4 (4 experts, top-2, shared expert)")
    p.add_argument("--residual-weight", type=float, default=1.0)
    p.add_argument("--distill-steps", type=int, default=0, help="also distil the converted drafter from EAGLE-3")
    p.add_argument("--distill-lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(2)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    tok = build_tiny_tokenizer(384)
    v, h, k = 384, args.hidden, args.ttt_steps
    target_dir = build_tiny_target(tempfile.mkdtemp(prefix="ws_target_"), vocab_size=v, num_layers=8, hidden_size=h,
                                   num_heads=4, num_kv_heads=2, tokenizer=tok, initializer_range=0.1)
    aux_ids = [1, 3, 4]  # [1, L//2 - 1, L - 4] for L = 8
    target = TargetDecoder.from_pretrained(target_dir, aux_layer_ids=aux_ids)

    def batch(seed: int, n: int):
        exs = []
        for conv in make_conversations(n, seed=seed):
            ids, mask = tokenize_conversation(tok, conv["messages"], 256)
            exs.append(Example(torch.tensor(ids), torch.tensor(mask)))
        b = collate(exs, 0)
        out = target.capture(b["input_ids"], b["attention_mask"])
        return b, out.aux_hidden_states, target.target_logits(out.last_hidden_state)

    train = [batch(1000 + i, 8) for i in range(16)]
    held = [batch(1, 16), batch(2, 16)]
    sizes = dict(vocab_size=v, hidden_size=h, num_attention_heads=4, num_key_value_heads=2, head_dim=h // 4,
                 intermediate_size=2 * h, aux_layer_ids=aux_ids, target_num_layers=8)

    def unroll(model, bt):
        b, aux, logits = bt
        return ttt_unroll(model, b["input_ids"], b["loss_mask"], aux, TeacherHead.from_logits(logits), k, 0.8,
                          valid_counts(b["loss_mask"], k), attention_mask=b["attention_mask"],
                          moe_aux_coef=0.01 if getattr(model.config, "moe", False) else 0.0)

    @torch.no_grad()
    def acceptance(model) -> dict[str, float]:
        model.eval()
        rs = [unroll(model, bt) for bt in held]
        model.train()
        return summarize(sum(r.kl_sum for r in rs), sum(r.correct for r in rs), sum(r.valid for r in rs))

    def fit(model, steps: int, log: list | None = None, name: str = "") -> None:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
        # Warmup matters for the converted drafter: Adam's first full-size steps move every weight by
        # ~lr regardless of its gradient's size and knock a pretrained drafter off its optimum.
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(args.warmup, 1)))
        model.train()
        for step in range(1, steps + 1):
            loss = unroll(model, train[(step - 1) % len(train)]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if log is not None and (step % args.eval_every == 0 or step == steps):
                m = acceptance(model)
                log.append({"step": step, "acceptance_length": m["acceptance_length"], "acc_0": m["acc_0"]})
                print(f"  {name} step {step}: held-out acceptance {m['acceptance_length']:.3f}", flush=True)

    # EAGLE-3: draft vocabulary = the ids the (random) target predicts most on the training split.
    torch.manual_seed(args.seed)
    e3 = Eagle3Drafter(Eagle3Config(**sizes, draft_vocab_size=args.draft_vocab), attn_backend="eager")
    freqs = sum(torch.bincount(lg.argmax(-1)[b["loss_mask"].bool()], minlength=v) for b, _, lg in train)
    e3.set_vocab_mapping(*build_vocab_mapping(freqs, args.draft_vocab))
    e3.init_from_target(target.embed_tokens_weight, target.lm_head_weight)
    fit(e3, args.e3_steps)
    e3.eval()
    al3 = acceptance(e3)["acceptance_length"]
    print(f"EAGLE-3 after {args.e3_steps} steps: held-out acceptance {al3:.3f}  ({time.time() - started:.0f}s)")

    flags = dict(sliding_window=None, lm_head_rank=0)
    if args.moe:
        flags.update(moe=True, moe_num_experts=4, moe_top_k=2, moe_shared_expert=True)
    c4 = Eagle4Config(**sizes, **flags)
    fb, faux, _ = train[0]
    converted, report = eagle3_to_eagle4(e3, c4, target_lm_head=target.lm_head_weight, fit_tokens=fb["input_ids"],
                                         fit_aux=faux, fit_attention_mask=fb["attention_mask"],
                                         residual_weight=args.residual_weight, attn_backend="eager")
    print(format_report(report))
    hb, haux, _ = held[0]
    held_err = attention_fit_error(e3, converted, hb["input_ids"], haux, hb["attention_mask"])
    print("held-out fit relative errors:", {n: round(x, 3) for n, x in held_err.items()})
    torch.manual_seed(args.seed + 1)
    fresh = Eagle4Drafter(c4, attn_backend="eager")
    fresh.init_from_target(target.embed_tokens_weight, target.lm_head_weight)

    models = [("converted", converted), ("random", fresh)]
    if args.distill_steps:
        distilled = Eagle4Drafter(c4, attn_backend="eager")
        distilled.load_state_dict(converted.state_dict())
        m = acceptance(distilled)["acceptance_length"]
        distill_from_eagle3(distilled, e3, fb["input_ids"], faux, fb["attention_mask"], args.distill_steps,
                            lr=args.distill_lr, ttt_steps=k, warmup=args.warmup)
        print(f"EAGLE-4 distilled: held-out acceptance {m:.3f} -> {acceptance(distilled)['acceptance_length']:.3f} "
              f"after {args.distill_steps} distillation steps")
        models.append(("distilled", distilled))
    curves = {}
    for name, model in models:
        m0 = acceptance(model)
        curves[name] = [{"step": 0, "acceptance_length": m0["acceptance_length"], "acc_0": m0["acc_0"]}]
        print(f"EAGLE-4 {name} step 0: held-out acceptance {m0['acceptance_length']:.3f}")
        fit(model, args.e4_steps, curves[name], name)

    def first_reaching(curve: list[dict], level: float) -> int | None:
        return next((p["step"] for p in curve if p["acceptance_length"] >= level), None)

    result = {
        "args": vars(args), "eagle3_acceptance": al3, "fit_metrics": report.metrics, "held_out_fit_error": held_err,
        "curves": curves, "steps_to_reach_eagle3": {n: first_reaching(c, al3) for n, c in curves.items()},
        "notes": report.notes, "seconds": time.time() - started,
    }
    (out_dir / "warm_start.json").write_text(json.dumps(result, indent=2))
    print(f"\n{'step':>6} " + " ".join(f"{n:>10}" for n in curves) + f"   (EAGLE-3: {al3:.3f})")
    for points in zip(*curves.values()):
        print(f"{points[0]['step']:>6} " + " ".join(f"{p['acceptance_length']:>10.3f}" for p in points))
    print("steps to reach EAGLE-3's acceptance:", result["steps_to_reach_eagle3"])
    plot(curves, al3, out_dir / "warm_start.png", args.e3_steps)
    print(f"wrote {out_dir}/warm_start.json and warm_start.png in {time.time() - started:.0f}s")


def plot(curves: dict, al3: float, path: Path, e3_steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        ax.plot([p["step"] for p in curve], [p["acceptance_length"] for p in curve], marker="o", ms=3,
                label=f"EAGLE-4 {name}")
    ax.axhline(al3, color="gray", ls="--", label=f"EAGLE-3 ({e3_steps} steps)")
    ax.set_xlabel("EAGLE-4 training steps")
    ax.set_ylabel("held-out acceptance length")
    ax.set_title("Warm start from EAGLE-3 (tiny target, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
