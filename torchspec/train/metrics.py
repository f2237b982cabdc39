"""Metric sinks: stdout, ``metrics.jsonl`` (one JSON object per logged step), wandb, and the PNG
plot of loss and held-out acceptance length written at the end of a run.

Keys: ``train/loss``, ``train/acc_k``, ``train/kl_k``, ``train/acceptance_length``,
``train/chain_acceptance``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s`` (real, non-padding
tokens per second over all ranks) and the same ``eval/...`` keys on the held-out set.
``acceptance_length = 1 + sum_k prod_{i<=k} acc_k``: the 1 is the bonus token every verification
round yields, so an untrained drafter scores ~1.0 and a perfect one ``ttt_steps + 1``.
``chain_acceptance``: what a greedy chain of depth K would accept per round, averaged over start
positions: the joint leading run, with the token an efficient head would actually propose; comparable
with served chain acceptance (``torchspec.train.ttt.chain_rounds``). ``eval/chain_acceptance_d{d}``: the same
walk for a chain of serving depth d = 1..K (the unroll's first d steps), so a run trained with K = 7 reports
what a depth-5 chain will accept (``eval/chain_acceptance`` is d = K).

Crash safety: every record is fsynced as it is appended, so a checkpoint written after it can
count on it; a resume drops the records logged after its checkpoint (and a line torn by a crash
mid-append), so ``metrics.jsonl`` of a killed-and-resumed run equals the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torchspec.io import atomic_write_text


class MetricsLogger:
    def __init__(self, output_dir: str | Path, report_to: str, run_config: dict[str, Any],
                 project: str, run_name: str, resume_step: int | None, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.wandb = None
        if not enabled:
            return
        if resume_step is not None:
            self._truncate_after(resume_step)
        elif self.path.exists():
            self.path.unlink()
        if report_to == "wandb":
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(project=project, name=run_name, dir=str(output_dir),
                                    config=run_config, resume="allow")

    def _truncate_after(self, step: int) -> None:
        """On resume, drop records the interrupted run logged after its last checkpoint, and a last
        line a crash tore mid-append (only the last line can be torn: every append is fsynced)."""
        if not self.path.exists():
            return
        text = self.path.read_text()
        lines = text.splitlines()
        if lines and not text.endswith("\n"):
            lines.pop()
        kept = "".join(line + "\n" for line in lines if json.loads(line)["step"] <= step)
        if kept != text:  # a finished or cleanly stopped run's file is left untouched
            atomic_write_text(self.path, kept)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())  # durable before any checkpoint that counts this record as logged
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def plot_metrics(metrics_path: str | Path, out_png: str | Path) -> None:
    """Loss (train) and acceptance length (train and held-out) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/acceptance_length" in r]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot([r["step"] for r in train], [r["train/loss"] for r in train], label="train loss")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval/loss"] for r in evals], "o-", label="held-out loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("weighted KL loss")
    ax_loss.legend()
    ax_acc.plot([r["step"] for r in train], [r["train/acceptance_length"] for r in train], label="train", alpha=0.6)
    ax_acc.plot([r["step"] for r in evals], [r["eval/acceptance_length"] for r in evals], "o-", label="held-out")
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("simulated acceptance length (incl. bonus token)")
    ax_acc.legend()
    fig.tight_layout()
    tmp = Path(out_png).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out_png)
    plt.close(fig)
