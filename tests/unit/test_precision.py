"""bf16 parameters with fp32 master weights ("none" engine, ``torchspec/train/optim.py``).

* one engine step equals a hand-written reference: fp32 masters stepped by AdamW (written out
  here) from the fp32-cast bf16 gradients, clipped by their norm; the bf16 parameters are the
  masters rounded, exactly;
* micro-batch gradients accumulate in fp32 (a positive control bf16 accumulation fails), and 4
  micro-batches of one sequence equal one batch of 4 within bf16 tolerance;
* resume restores the fp32 masters and AdamW state bitwise and continues identically; the
  checkpoint and the export hold the masters, and checkpoints cross precisions both ways;
* the fp32 path is plain AdamW on the module; "auto" precision and attention resolve per device.
"""

from __future__ import annotations

import copy

import pytest
import torch

from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter
from torchspec.train.engine import PREFIX, OptimConfig, build_engine
from torchspec.train.engine_base import read_engine_state
from torchspec.train.loss import TeacherHead
from torchspec.train.optim import adamw_implementation, resolve_precision
from torchspec.train.ttt import ttt_unroll, valid_counts

VOCAB, HIDDEN, T, K, DECAY = 37, 16, 10, 3, 0.8
LR, BETAS, WD, EPS, MAX_NORM = 3e-2, (0.9, 0.95), 0.01, 1e-8, 0.5


def tiny_drafter(seed: int = 0) -> Eagle4Drafter:
    torch.manual_seed(seed)
    cfg = Eagle4Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=4, intermediate_size=24, aux_layer_ids=[0, 1, 2], target_num_layers=4,
                       rope_theta=100.0)
    drafter = Eagle4Drafter(cfg, attn_backend="eager")
    drafter.init_from_target(torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7)), None,
                             init_lm_head=False)
    return drafter.float().train()


def schedule(step: int) -> float:
    return 1.0 / (1 + step)  # the LR changes every step


def engine(precision: str, seed: int = 0, max_grad_norm: float = MAX_NORM):
    optim = OptimConfig(lr=LR, weight_decay=WD, betas=BETAS, max_grad_norm=max_grad_norm)
    return build_engine("none", tiny_drafter(seed), optim, schedule, precision=precision)


def batch(seed: int, rows: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, T, dtype=torch.long)
    mask[:, :2] = 0
    return {"ids": torch.randint(1, VOCAB, (rows, T), generator=g), "mask": mask,
            "aux": [torch.randn(rows, T, HIDDEN, generator=g) * s for s in (1.0, 4.0, 20.0)],
            "logits": torch.randn(rows, T, VOCAB, generator=g) * 3}


def rows(b: dict, i: int) -> dict:
    return {"ids": b["ids"][i : i + 1], "mask": b["mask"][i : i + 1], "aux": [a[i : i + 1] for a in b["aux"]],
            "logits": b["logits"][i : i + 1]}


def accumulate(e, mbs: list[dict]) -> float:
    """Forward + backward of micro-batches ``mbs`` with their global denominators; the summed loss."""
    den = sum(valid_counts(mb["mask"], K) for mb in mbs)
    loss = 0.0
    for mb in mbs:
        r = e.unroll(mb["ids"], mb["mask"], mb["aux"], TeacherHead.from_logits(mb["logits"]), den, K, DECAY)
        e.backward(r.loss)
        loss += float(r.loss.detach())
    return loss


def run(e, mbs: list[dict]) -> tuple[float, torch.Tensor]:
    """One optimizer step over micro-batches ``mbs``; (loss, grad norm)."""
    loss = accumulate(e, mbs)
    return loss, e.step()


def test_bf16_step_equals_fp32_master_reference():
    e = engine("bf16")
    names = [n.removeprefix(PREFIX) for n in e.masters.names]
    assert {p.dtype for p in e.module.parameters()} == {torch.bfloat16}  # frozen embedding too
    assert e.drafter.rotary.inv_freq.dtype == torch.float32  # buffers untouched
    assert e.optimizer.param_groups[0]["params"] == e.masters.masters

    ref_model = copy.deepcopy(e.drafter)  # bf16 parameters; its weights are overwritten each step
    trainable = dict((n, p) for n, p in ref_model.named_parameters() if p.requires_grad)
    masters = {n: p.detach().clone() for n, p in tiny_drafter(0).named_parameters() if p.requires_grad}
    m = {n: torch.zeros_like(p) for n, p in masters.items()}
    v = {n: torch.zeros_like(p) for n, p in masters.items()}
    for step in range(3):
        b = batch(step)
        loss, norm = run(e, [b])

        with torch.no_grad():
            for n, p in trainable.items():
                p.copy_(masters[n])  # bf16 = the masters rounded
        r = ttt_unroll(ref_model, b["ids"], b["mask"], [a.bfloat16() for a in b["aux"]],
                       TeacherHead.from_logits(b["logits"]), K, DECAY, valid_counts(b["mask"], K))
        ref_model.zero_grad(set_to_none=True)
        r.loss.backward()
        grads = {n: p.grad.float() for n, p in trainable.items()}  # fp32-cast bf16 gradients
        ref_norm = torch.sqrt(sum((g**2).sum() for g in grads.values()))
        coef = min(1.0, MAX_NORM / (float(ref_norm) + 1e-6))
        lr, t = LR * schedule(step), step + 1
        for n in masters:  # AdamW (decoupled weight decay, bias-corrected moments), written out
            g = grads[n] * coef
            m[n] = BETAS[0] * m[n] + (1 - BETAS[0]) * g
            v[n] = BETAS[1] * v[n] + (1 - BETAS[1]) * g * g
            denom = (v[n] / (1 - BETAS[1] ** t)).sqrt() + EPS
            masters[n] = masters[n] * (1 - lr * WD) - lr * (m[n] / (1 - BETAS[0] ** t)) / denom

        assert loss == pytest.approx(float(r.loss.detach()), rel=1e-5), step
        assert float(norm) == pytest.approx(float(ref_norm), rel=1e-4), step
        assert coef < 1.0 or step > 0  # clipping active at least on the first step
        got = dict(zip(names, e.masters.masters))
        for n in masters:
            torch.testing.assert_close(got[n], masters[n], rtol=1e-5, atol=5e-7, msg=f"step {step} master {n}")
        for p, master in zip(e.masters.params, e.masters.masters):
            assert p.dtype == torch.bfloat16 and torch.equal(p, master.to(torch.bfloat16))
            assert p.grad is None  # consumed by the accumulation hook
        assert all(master.grad is None for master in e.masters.masters)  # zero_grad after the step


def test_micro_batches_accumulate_in_fp32():
    """Gradients 1, 2^-10, 2^-10 sum to 1 + 2^-9 in fp32; in bf16 (8 significant bits) the small
    ones vanish: the positive control shows the test can tell the two apart."""
    assert torch.tensor(1.0, dtype=torch.bfloat16) + 2**-10 + 2**-10 == 1.0
    e = build_engine("none", torch.nn.Linear(1, 4, bias=False), OptimConfig(lr=1e-3, max_grad_norm=0.0),
                     lambda s: 1.0, precision="bf16")
    x = torch.ones(1, 1, dtype=torch.bfloat16)
    for scale in (1.0, 2**-10, 2**-10):
        e.backward(e.drafter(x).float().sum() * scale)
    master = e.masters.masters[0]
    assert master.grad.dtype == torch.float32
    assert torch.equal(master.grad, torch.full((4, 1), 1 + 2**-9))
    assert float(e.step()) == pytest.approx(2 * (1 + 2**-9))  # the norm is taken over the fp32 grads


def test_four_micro_batches_equal_one_batch():
    b = batch(11, rows=4)
    one, four = engine("bf16"), engine("bf16")
    loss1 = accumulate(one, [b])
    loss4 = accumulate(four, [rows(b, i) for i in range(4)])
    assert loss4 == pytest.approx(loss1, rel=1e-2)
    for n, a, c in zip(one.masters.names, one.masters.masters, four.masters.masters):
        assert c.grad.dtype == torch.float32
        assert float((c.grad - a.grad).norm() / a.grad.norm()) < 2e-2, n  # bf16 rounding of each micro-batch
    assert float(four.step()) == pytest.approx(float(one.step()), rel=1e-2)


def test_resume_restores_masters_bitwise(tmp_path):
    a = engine("bf16")
    for step in range(2):
        run(a, [batch(step)])
    a.save(tmp_path)
    state = read_engine_state(tmp_path)
    masters = dict(a.masters.named_masters())
    for name, w in state["model"].items():  # the checkpoint holds the fp32 masters, not the bf16 copies
        assert w.dtype == torch.float32 and torch.equal(w, masters[PREFIX + name])
    assert not all(torch.equal(w, w.bfloat16().float()) for w in state["model"].values())

    b = engine("bf16", seed=1)  # other initial weights
    b.load(tmp_path)
    for x, y in zip(a.masters.masters, b.masters.masters):
        assert torch.equal(x, y)
    for x, y in zip(a.masters.params, b.masters.params):
        assert torch.equal(x, y)
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    for i in sa["state"]:
        for key in sa["state"][i]:
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)
    assert a.lr == b.lr
    for step in range(2, 4):
        la, na = run(a, [batch(step)])
        lb, nb = run(b, [batch(step)])
        assert (la, float(na)) == (lb, float(nb))
    for x, y in zip(a.masters.masters, b.masters.masters):
        assert torch.equal(x, y)
    export = a.drafter_state_dict()  # the export holds the masters too, every tensor fp32
    assert all(v.dtype == torch.float32 for v in export.values() if v.is_floating_point())
    for name, master in a.masters.named_masters():
        assert torch.equal(export[name.removeprefix(PREFIX)], master)


def test_checkpoints_cross_precisions(tmp_path):
    bf16, fp32 = engine("bf16"), engine("fp32")
    run(bf16, [batch(0)])
    run(fp32, [batch(0)])
    (tmp_path / "bf16").mkdir()
    (tmp_path / "fp32").mkdir()
    bf16.save(tmp_path / "bf16")
    fp32.save(tmp_path / "fp32")

    into_fp32 = engine("fp32", seed=1)
    into_fp32.load(tmp_path / "bf16")
    params = dict(into_fp32.module.named_parameters())
    for name, master in bf16.masters.named_masters():
        assert torch.equal(params[name], master)
    into_bf16 = engine("bf16", seed=1)
    into_bf16.load(tmp_path / "fp32")
    params = dict(fp32.module.named_parameters())
    for name, master in into_bf16.masters.named_masters():
        assert torch.equal(master, params[name])
    assert len(into_bf16.optimizer.state) == len(fp32.optimizer.state)
    run(into_bf16, [batch(1)])  # and it trains on


def test_fp32_path_is_plain_adamw_on_the_module():
    e = engine("fp32")
    assert e.masters is None and {p.dtype for p in e.module.parameters()} == {torch.float32}
    ref = tiny_drafter(0)
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    for step in range(2):
        b = batch(step)
        loss, norm = run(e, [b])
        r = ttt_unroll(ref, b["ids"], b["mask"], b["aux"], TeacherHead.from_logits(b["logits"]), K, DECAY,
                       valid_counts(b["mask"], K))
        r.loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        for group in opt.param_groups:
            group["lr"] = LR * schedule(step)
        opt.step()
        opt.zero_grad()
        assert loss == float(r.loss.detach()) and float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
    for (n, p), q in zip(e.drafter.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


def test_precision_and_optimizer_choices(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)  # whatever this CPU has
    assert resolve_precision("auto", cpu) is None and resolve_precision("fp32", cpu) is None
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)  # AMX: bf16 is the faster
    assert resolve_precision("auto", cpu) == torch.bfloat16 and resolve_precision("fp32", cpu) is None
    assert resolve_precision("fp32", cuda) is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_precision("auto", cuda) == torch.bfloat16 == resolve_precision("bf16", cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_precision("auto", cuda) is None
    with pytest.raises(ValueError, match="train.precision=bf16 but cuda here has no bf16 support"):
        resolve_precision("bf16", cuda)
    assert adamw_implementation("cuda") == {"fused": True, "foreach": None}
    assert adamw_implementation("cpu") == {"fused": None, "foreach": True}
    assert engine("bf16").optimizer.param_groups[0]["foreach"] is True


def test_auto_attention_is_chunked_on_cpu():
    from torchspec.config import DrafterConfig
    from torchspec.models.attention import select_ttt_attention, ttt_attention_chunked

    assert DrafterConfig().attn_backend == "auto"
    g = torch.Generator().manual_seed(0)
    q, k1, v1, k2, v2 = (torch.randn(1, 2, 12, 4, generator=g) for _ in range(5))
    auto = select_ttt_attention("auto")(q, [k1, k2], [v1, v2], 0.5, 4)
    assert torch.equal(auto, ttt_attention_chunked(q, [k1, k2], [v1, v2], 0.5, 4))
