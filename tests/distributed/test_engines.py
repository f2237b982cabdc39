"""Training engines on 2 gloo ranks against the single-process reference (fp32).

Every sequence of the global batch is generated from its own seed (token ids, loss mask, aux
states, target logits), so each rank builds its half of the same global batch: step s covers
sequences [s*G, (s+1)*G), split into WORLD x ACCUM micro-batches. Loss masks differ in length,
so the ranks hold different valid counts and only the all-reduced (global) denominators give
the single-process loss. Checked per engine (FSDP2, DeepSpeed ZeRO 1 and 2):
  * losses, pre-clip grad norms (these catch a missing x dp_size in backward: AdamW alone is
    nearly scale-invariant) and learning rates of 4 steps equal the reference, clipping active;
  * final weights equal the reference;
  * resume: saved after step 2, loaded into a fresh engine whose drafter has DIFFERENT initial
    weights, trained 2 more steps: equal to the uninterrupted run;
  * the fsdp2 checkpoint (DCP, one shard per rank) written at world 2 resumes in one process under "none";
  * bf16 (FSDP2 mixed precision, DeepSpeed bf16, "none" with fp32 masters): the first 2 steps
    close to the fp32 reference;
  * DeepSpeed bf16 accumulates and reduces micro-batch gradients in fp32 (gradients 1, 2^-10,
    2^-10 sum to 1 + 2^-9; bf16 would drop the small ones), on both stages;
  * a "none" bf16 checkpoint (fp32 masters) resumes under fsdp2 on 2 ranks, and fsdp2's under
    "none" bf16, with the masters bitwise equal to the weights written.
All engines run in ONE 2-rank launch (DeepSpeed's import and first initialize dominate).
"""

from __future__ import annotations

import pytest
import torch

from .launcher import launch

WORLD, ACCUM, MICRO = 2, 2, 2  # global batch G = WORLD * ACCUM * MICRO = 8 sequences per step
G = WORLD * ACCUM * MICRO
STEPS, SAVE_AT, TTT_STEPS, DECAY = 4, 2, 3, 0.8
VOCAB, HIDDEN, T = 37, 16, 10
CONFIGS = [("fsdp2", 0), ("deepspeed", 1), ("deepspeed", 2)]


def tiny_drafter(seed: int):
    """Trainable weights from ``seed``; the frozen embedding is "the target's": the same for every seed
    (checkpoints leave it out, as the recipe restores it from the target)."""
    from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter

    torch.manual_seed(seed)
    cfg = Eagle4Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=4, intermediate_size=24, aux_layer_ids=[0, 1, 2], target_num_layers=4,
                       rope_theta=100.0)
    drafter = Eagle4Drafter(cfg)
    target_embedding = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7))
    drafter.init_from_target(target_embedding, None, init_lm_head=False)
    return drafter.float().train()


def optim_config():
    from torchspec.train.engine import OptimConfig

    # max_grad_norm below the first steps' norms: clipping is exercised, not skipped.
    return OptimConfig(lr=3e-2, weight_decay=0.01, betas=(0.9, 0.95), max_grad_norm=0.5, micro_batch_size=MICRO,
                       grad_accum=ACCUM)


def lr_multiplier(step: int) -> float:
    from torchspec.train.optim import warmup_cosine

    return warmup_cosine(step, warmup_steps=2, max_steps=STEPS, min_lr_ratio=0.1)


def sequence(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    ids = torch.randint(1, VOCAB, (T,), generator=g)
    start = int(torch.randint(1, T - 2, (), generator=g))
    real = (torch.arange(T) < int(torch.randint(T - 3, T + 1, (), generator=g))).long()  # right padding
    mask = (torch.arange(T) >= start).long() * real
    mask[int(torch.randint(start, T, (), generator=g))] = 0  # a hole inside the answer
    aux = [torch.randn(T, HIDDEN, generator=g) * s for s in (1.0, 4.0, 20.0)]
    return {"ids": ids * real, "mask": mask, "real": real, "aux": aux,
            "logits": torch.randn(T, VOCAB, generator=g) * 3}


def micro_batch(indices: list[int]) -> dict:
    seqs = [sequence(i) for i in indices]
    return {"ids": torch.stack([s["ids"] for s in seqs]), "mask": torch.stack([s["mask"] for s in seqs]),
            "real": torch.stack([s["real"] for s in seqs]),
            "aux": [torch.stack([s["aux"][j] for s in seqs]) for j in range(3)],
            "logits": torch.stack([s["logits"] for s in seqs])}


def micro_batches(step: int, rank: int, world: int) -> list[dict]:
    """This rank's micro-batches of global step ``step`` (world=1: the whole global batch)."""
    per = G // (world * ACCUM)
    chunks = [list(range(step * G + c * per, step * G + (c + 1) * per)) for c in range(world * ACCUM)]
    return [micro_batch(chunks[j * world + rank]) for j in range(ACCUM)]


def train(engine, steps: range, rank: int = 0, world: int = 1) -> list[tuple[float, float, float]]:
    """(global loss, grad norm, lr) per step: what train_step does, with global denominators."""
    import torch.distributed as dist

    from torchspec.train.loss import TeacherHead
    from torchspec.train.ttt import valid_counts

    out = []
    for step in steps:
        mbs = micro_batches(step, rank, world)
        denominators = sum(valid_counts(mb["mask"], TTT_STEPS) for mb in mbs)
        if world > 1:
            dist.all_reduce(denominators)
        loss = torch.zeros(())
        for mb in mbs:
            result = engine.unroll(mb["ids"], mb["mask"], mb["aux"], TeacherHead.from_logits(mb["logits"]),
                                   denominators, TTT_STEPS, DECAY,
                                   attention_mask=mb["real"])  # keyword arguments reach ttt_unroll
            engine.backward(result.loss)
            loss += result.loss.detach()
        if world > 1:
            dist.all_reduce(loss)
        lr = engine.lr
        grad_norm = engine.step()
        out.append((float(loss), float(grad_norm), lr))
    return out


def build(kind: str, zero_stage: int, seed: int = 0, precision: str = "fp32"):
    from torchspec.train.engine import build_engine

    return build_engine(kind, tiny_drafter(seed), optim_config(), lr_multiplier, precision=precision,
                        zero_stage=zero_stage or 2)


def _engines_worker(tmp: str, none_bf16_ckpt: str) -> dict:
    from pathlib import Path

    from deepspeed.utils import safe_get_full_grad

    from torchspec.distributed import barrier, init_distributed
    from torchspec.train.engine import OptimConfig, build_engine
    from torchspec.train.loss import TeacherHead

    info = init_distributed()
    torch.set_num_threads(1)
    results = {}
    for kind, stage in CONFIGS:
        name = f"{kind}{stage or ''}"
        ckpt = Path(tmp) / name
        if info.rank == 0:
            ckpt.mkdir()
        barrier()
        engine = build(kind, stage)
        with torch.no_grad():  # an eval forward first: must leave training unaffected
            mb = micro_batches(0, info.rank, WORLD)[0]
            engine.module.eval()
            engine.unroll(mb["ids"], mb["mask"], mb["aux"], TeacherHead.from_logits(mb["logits"]),
                          torch.ones(TTT_STEPS), TTT_STEPS, DECAY)
            engine.module.train()
        records = train(engine, range(SAVE_AT), info.rank, WORLD)
        engine.save(ckpt)
        barrier()
        records += train(engine, range(SAVE_AT, STEPS), info.rank, WORLD)
        final = engine.drafter_state_dict()
        resumed = build(kind, stage, seed=1)
        resumed.load(ckpt)
        resumed_records = train(resumed, range(SAVE_AT, STEPS), info.rank, WORLD)
        results[name] = {"records": records, "final": final, "resumed_records": resumed_records,
                         "resumed": resumed.drafter_state_dict(), "ckpt": str(ckpt)}
    for kind, stage in CONFIGS:  # bf16 compute, fp32 master weights and gradient reduction
        results[f"{kind}{stage or ''}-bf16"] = train(build(kind, stage, precision="bf16"), range(2), info.rank, WORLD)
    mb = micro_batches(0, 0, WORLD)[0]  # the same micro-batch on both ranks
    teacher = TeacherHead.from_logits(mb["logits"])
    for stage in (1, 2):  # DeepSpeed bf16: micro-batch gradients g, g/2^10, g/2^10 summed in fp32
        for accum in (1, 3):
            optim = OptimConfig(lr=1e-3, max_grad_norm=0.0, micro_batch_size=MICRO, grad_accum=accum)
            engine = build_engine("deepspeed", tiny_drafter(0), optim, lr_multiplier, precision="bf16",
                                  zero_stage=stage)
            for scale in (1.0, 2.0**10, 2.0**10)[:accum]:  # denominators x 2^10: gradients / 2^10, exactly
                result = engine.unroll(mb["ids"], mb["mask"], mb["aux"], teacher, torch.ones(TTT_STEPS) * scale,
                                       TTT_STEPS, DECAY)
                engine.backward(result.loss)
            results[f"deepspeed{stage}-accum{accum}"] = {
                n: safe_get_full_grad(p).float().clone() for n, p in engine.drafter.named_parameters() if p.requires_grad}
            engine.step()
    resumed = build("fsdp2", 0, seed=1)  # fp32 shards from the masters "none" bf16 wrote
    resumed.load(none_bf16_ckpt)
    results["fsdp2-from-none-bf16"] = resumed.drafter_state_dict()
    return results


@pytest.fixture(scope="module")
def reference():
    from torchspec.train.engine import build_engine

    engine = build_engine("none", tiny_drafter(0), optim_config(), lr_multiplier)
    records = train(engine, range(STEPS))
    return {"records": records, "final": engine.drafter_state_dict()}


@pytest.fixture(scope="module")
def none_bf16(tmp_path_factory):
    """A "none" bf16 engine after SAVE_AT steps, saved; (checkpoint dir, its fp32 masters)."""
    engine = build("none", 0, precision="bf16")
    train(engine, range(SAVE_AT))
    ckpt = tmp_path_factory.mktemp("none_bf16")
    engine.save(ckpt)
    return str(ckpt), {n.removeprefix("drafter."): m.clone() for n, m in engine.masters.named_masters()}


@pytest.fixture(scope="module")
def world2(tmp_path_factory, none_bf16):
    tmp = tmp_path_factory.mktemp("engines")
    return launch(_engines_worker, WORLD, args=(str(tmp), none_bf16[0]), timeout_s=300)


def assert_weights_equal(got: dict, want: dict, tol: float, what: str) -> None:
    assert set(got) == set(want), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol, msg=lambda m, k=k: f"{what}: {k}: {m}")


@pytest.mark.parametrize("name", [f"{k}{s or ''}" for k, s in CONFIGS])
def test_world2_matches_single_process(world2, reference, name):
    ref = reference["records"]
    assert ref[0][1] > optim_config().max_grad_norm  # clipping is active
    for rank_results in world2:
        got = rank_results[name]["records"]
        for step, ((loss, norm, lr), (ref_loss, ref_norm, ref_lr)) in enumerate(zip(got, ref, strict=True)):
            assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), f"{name} step {step} loss"
            assert norm == pytest.approx(ref_norm, rel=1e-5, abs=1e-6), f"{name} step {step} grad norm"
            assert lr == pytest.approx(ref_lr, rel=1e-12), f"{name} step {step} lr"
    assert_weights_equal(world2[0][name]["final"], reference["final"], 1e-5, f"{name} final weights")


@pytest.mark.parametrize("name", [f"{k}{s or ''}" for k, s in CONFIGS])
def test_world2_bf16_close_to_fp32_reference(world2, reference, name):
    for (loss, norm, lr), (ref_loss, ref_norm, ref_lr) in zip(world2[0][f"{name}-bf16"], reference["records"]):
        assert loss == pytest.approx(ref_loss, rel=2e-2) and norm == pytest.approx(ref_norm, rel=5e-2), name
        assert lr == ref_lr


def test_none_bf16_close_to_fp32_reference(reference):
    records = train(build("none", 0, precision="bf16"), range(2))
    for (loss, norm, lr), (ref_loss, ref_norm, ref_lr) in zip(records, reference["records"]):
        assert loss == pytest.approx(ref_loss, rel=2e-2) and norm == pytest.approx(ref_norm, rel=5e-2)
        assert lr == ref_lr


@pytest.mark.parametrize("stage", [1, 2])
def test_world2_deepspeed_bf16_accumulates_in_fp32(world2, stage):
    """g + g/2^10 + g/2^10 = g (1 + 2^-9) exactly in fp32 (g is bf16: 8 + 9 significant bits fit);
    summed in bf16 the small terms vanish (positive control on the same g)."""
    single, three = world2[0][f"deepspeed{stage}-accum1"], world2[0][f"deepspeed{stage}-accum3"]
    lost = 0
    for name, g in single.items():
        assert torch.equal(three[name], g * (1 + 2**-9)), name
        g16 = g.bfloat16()
        lost += int((g16 + g16 / 2**10 + g16 / 2**10 == g16).sum())
    assert lost > 0.9 * sum(g.numel() for g in single.values())


def test_none_bf16_and_fsdp2_checkpoints_cross(world2, none_bf16):
    from torchspec.train.engine import build_engine
    from torchspec.train.engine_base import read_engine_state

    _, masters = none_bf16
    got = world2[0]["fsdp2-from-none-bf16"]  # fsdp2 (fp32 shards, 2 ranks) resumed from "none" bf16
    for name, master in masters.items():
        assert torch.equal(got[name], master), name
    engine = build_engine("none", tiny_drafter(1), optim_config(), lr_multiplier, precision="bf16")
    engine.load(world2[0]["fsdp2"]["ckpt"])  # and "none" bf16 from fsdp2's checkpoint: its masters
    written = read_engine_state(world2[0]["fsdp2"]["ckpt"], "model")["model"]
    for name, master in engine.masters.named_masters():
        assert torch.equal(master, written[name.removeprefix("drafter.")]), name
    train(engine, range(SAVE_AT, STEPS))  # and trains on


@pytest.mark.parametrize("name", [f"{k}{s or ''}" for k, s in CONFIGS])
def test_world2_resume_is_exact(world2, name):
    res = world2[0][name]
    assert res["resumed_records"] == res["records"][SAVE_AT:]
    assert_weights_equal(res["resumed"], res["final"], 0.0, f"{name} resumed weights")


def test_none_resume_and_fsdp2_checkpoint_at_world1(tmp_path, reference, world2):
    from torchspec.train.engine import build_engine

    engine = build_engine("none", tiny_drafter(0), optim_config(), lr_multiplier)
    first = train(engine, range(SAVE_AT))
    engine.save(tmp_path)
    rest = train(engine, range(SAVE_AT, STEPS))
    assert first + rest == reference["records"]
    for ckpt in (tmp_path, world2[0]["fsdp2"]["ckpt"]):  # ours, and the one fsdp2 wrote on 2 ranks
        resumed = build_engine("none", tiny_drafter(1), optim_config(), lr_multiplier)
        resumed.load(ckpt)
        again = train(resumed, range(SAVE_AT, STEPS))
        for (loss, norm, lr), (ref_loss, ref_norm, ref_lr) in zip(again, rest, strict=True):
            assert (loss, norm, lr) == pytest.approx((ref_loss, ref_norm, ref_lr), rel=1e-5, abs=1e-6), ckpt
        assert_weights_equal(resumed.drafter_state_dict(), reference["final"], 1e-5, f"resumed from {ckpt}")


def test_none_refuses_a_deepspeed_checkpoint(tmp_path, world2):
    from torchspec.train.engine import build_engine

    engine = build_engine("none", tiny_drafter(0), optim_config(), lr_multiplier)
    with pytest.raises(ValueError, match="not written by the 'none' or 'fsdp2' engine"):
        engine.load(world2[0]["deepspeed2"]["ckpt"])


def test_deepspeed_config_merge_and_validation():
    from torchspec.train.engine_deepspeed import deepspeed_config

    cfg = deepspeed_config(optim_config(), "bf16", 2, {"zero_optimization": {"overlap_comm": False},
                                                       "gradient_accumulation_steps": ACCUM})
    assert cfg["zero_optimization"] == {"stage": 2, "overlap_comm": False}
    assert cfg["train_micro_batch_size_per_gpu"] == MICRO and cfg["gradient_clipping"] == 0.5
    assert cfg["bf16"] == {"enabled": True} and cfg["data_types"] == {"grad_accum_dtype": "fp32"}
    assert cfg["communication_data_type"] == "fp32"
    assert "communication_data_type" not in deepspeed_config(optim_config(), "fp32", 2, None)
    with pytest.raises(ValueError, match=r"communication_data_type='bf16' disagrees with train.precision='bf16'"):
        deepspeed_config(optim_config(), "bf16", 2, {"communication_data_type": "bf16"})
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4 disagrees with train.grad_accum=2"):
        deepspeed_config(optim_config(), "fp32", 2, {"gradient_accumulation_steps": 4})
    with pytest.raises(ValueError, match=r"zero_optimization.stage=3 disagrees with zero_stage=2"):
        deepspeed_config(optim_config(), "fp32", 2, {"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match=r"bf16.enabled=True disagrees with train.precision='fp32'"):
        deepspeed_config(optim_config(), "fp32", 2, {"bf16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"zero_stage=3 is refused.*fsdp2"):
        deepspeed_config(optim_config(), "fp32", 3, None)
    with pytest.raises(ValueError, match=r"section 'optimizer' is not allowed"):
        deepspeed_config(optim_config(), "fp32", 2, {"optimizer": {"type": "Adam"}})


def test_build_engine_rejects_bad_arguments():
    from torchspec.train.engine import build_engine

    with pytest.raises(ValueError, match=r"engine kind 'ddp' is not one of"):
        build_engine("ddp", tiny_drafter(0), optim_config(), lr_multiplier)
    with pytest.raises(ValueError, match=r"precision 'auto'"):
        build_engine("none", tiny_drafter(0), optim_config(), lr_multiplier, precision="auto")
    with pytest.raises(ValueError, match=r"DeepSpeed config was given but the engine is 'none'"):
        build_engine("none", tiny_drafter(0), optim_config(), lr_multiplier, ds_config={"zero_optimization": {}})
