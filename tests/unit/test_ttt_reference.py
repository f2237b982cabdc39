"""The TTT unroll against a naive reference: explicit loops over steps and positions, explicit
lists of attended keys, explicit index arithmetic for targets and masks (contract 3), no masks
or shifted tensors. If the unroll's shift, mask, positions or attention pattern were off by one,
these would disagree."""

from __future__ import annotations

import math

import pytest
import torch

from torchspec.models.eagle4 import Eagle4Config, Eagle4Drafter
from torchspec.models.layers import apply_rope
from torchspec.train.loss import TeacherHead
from torchspec.train.ttt import acceptance_length, ttt_unroll, valid_counts


def tiny_drafter(seed: int = 0, **flags) -> Eagle4Drafter:
    torch.manual_seed(seed)
    cfg = Eagle4Config(vocab_size=37, hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=4, intermediate_size=24, aux_layer_ids=[0, 1, 2], target_num_layers=4,
                       rope_theta=100.0, **flags)
    model = Eagle4Drafter(cfg)
    with torch.no_grad():  # non-trivial norm weights so a skipped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def reference_unroll(model, ids, loss_mask, aux, target_logits, num_steps, decay):
    b, t_len = ids.shape
    layer, attn = model.layer, model.layer.self_attn
    groups = attn.num_heads // attn.num_kv_heads
    total_loss = 0.0
    kl_sum, correct, valid = [0.0] * num_steps, [0] * num_steps, [0] * num_steps
    hidden = [[model.fuse_target_states([a[i : i + 1, t : t + 1] for a in aux])[0, 0] for t in range(t_len)]
              for i in range(b)]
    keys = [[[] for _ in range(t_len)] for _ in range(b)]  # keys[i][t][k] = (k_vec, v_vec)
    for k in range(num_steps):
        new_hidden = [[None] * t_len for _ in range(b)]
        for i in range(b):
            xs = []
            for t in range(t_len):
                tok = ids[i, t + k + 1] if t + k + 1 < t_len else torch.tensor(0)
                emb = model.embed_tokens.weight[tok]
                x = model.eh_proj(torch.cat([model.embed_norm(emb), model.hidden_norm(hidden[i][t])]))
                h = layer.input_layernorm(x)
                q, kk, vv = attn.project_qkv(h[None, None], None, None)  # [1, heads, 1, D]
                if model.config.nope:
                    q, kk = q[0, :, 0], kk[0, :, 0]
                else:
                    cos, sin = model.rotary.cos_sin(torch.tensor([[t + k]]))
                    q, kk = apply_rope(q, cos, sin)[0, :, 0], apply_rope(kk, cos, sin)[0, :, 0]
                keys[i][t].append((kk, vv[0, :, 0]))
                xs.append((x, q))
            for t in range(t_len):
                x, q = xs[t]
                window = model.config.sliding_window or t_len
                oldest = max(0, t - window + 1)
                attended = [keys[i][s][0] for s in range(oldest, t + 1)] + [keys[i][t][j] for j in range(1, k + 1)]
                heads = []
                for hd in range(attn.num_heads):
                    kvh = hd // groups
                    scores = torch.stack([q[hd] @ kv[0][kvh] for kv in attended]) / math.sqrt(attn.head_dim)
                    p = torch.softmax(scores, 0)
                    heads.append(sum(p[n] * attended[n][1][kvh] for n in range(len(attended))))
                x = x + attn.o_proj(torch.cat(heads))
                h = layer.post_attention_layernorm(x)
                x = x + (layer.mlp(h[None, None])[0][0, 0] if layer.moe else layer.mlp(h))
                y = model.norm(x)
                new_hidden[i][t] = y if model.config.norm_output else x
                j = t + k + 2  # the predicted token
                if j <= t_len - 1 and loss_mask[i, j]:
                    logq = torch.log_softmax(model.lm_head(y), -1)
                    logp = torch.log_softmax(target_logits[i, t + k + 1], -1)
                    kl = (logp.exp() * (logp - logq)).sum()
                    kl_sum[k] = kl_sum[k] + kl
                    valid[k] += 1
                    correct[k] += int(logq.argmax() == target_logits[i, t + k + 1].argmax())
        hidden = new_hidden
    for k in range(num_steps):
        total_loss = total_loss + decay**k * kl_sum[k] / max(valid[k], 1)
    return total_loss, kl_sum, correct, valid


@pytest.mark.parametrize("flags", [
    {"norm_output": True}, {"norm_output": False}, {"sliding_window": 3}, {"nope": True, "sliding_window": 1},
    {"moe": True, "moe_num_experts": 3, "moe_top_k": 2, "moe_shared_expert": True},
])
def test_unroll_matches_naive_reference(flags):
    model = tiny_drafter(**flags)
    g = torch.Generator().manual_seed(1)
    b, t_len, steps = 2, 9, 3
    ids = torch.randint(1, 37, (b, t_len), generator=g)
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1, 1, 1, 0, 0]])
    aux = [torch.randn(b, t_len, 16, generator=g) * s for s in (1.0, 5.0, 30.0)]
    target_logits = torch.randn(b, t_len, 37, generator=g) * 3
    result = ttt_unroll(model, ids, loss_mask, aux, TeacherHead.from_logits(target_logits), steps, 0.8, valid_counts(loss_mask, steps))
    ref_loss, ref_kl, ref_correct, ref_valid = reference_unroll(model, ids, loss_mask, aux, target_logits, steps, 0.8)
    assert result.valid.tolist() == ref_valid
    assert result.correct.tolist() == ref_correct
    torch.testing.assert_close(result.kl_sum, torch.stack([torch.as_tensor(x) for x in ref_kl]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result.loss, ref_loss, rtol=1e-4, atol=1e-5)
    # gradients agree too
    result.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref_loss.backward()
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-3, atol=1e-6, msg=n)


def test_valid_counts_use_mask_of_predicted_token():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])  # the toy example of ttt.py's docstring
    assert valid_counts(loss_mask, 4).tolist() == [4, 3, 2, 1]


def test_all_masked_batch_touches_every_trainable_parameter():
    model = tiny_drafter()
    ids = torch.randint(1, 37, (2, 8))
    mask = torch.zeros(2, 8, dtype=torch.long)
    aux = [torch.randn(2, 8, 16) for _ in range(3)]
    result = ttt_unroll(model, ids, mask, aux, TeacherHead.from_logits(torch.randn(2, 8, 37)), 2, 0.8, valid_counts(mask, 2))
    result.loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, n
            assert torch.count_nonzero(p.grad) == 0, n


def test_loss_independent_of_padding():
    model = tiny_drafter()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 37, (1, 7), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1]])
    aux = [torch.randn(1, 7, 16, generator=g) for _ in range(3)]
    logits = torch.randn(1, 7, 37, generator=g)
    plain = ttt_unroll(model, ids, mask, aux, TeacherHead.from_logits(logits), 3, 0.8, valid_counts(mask, 3))
    pad = 4
    padded = ttt_unroll(
        model, torch.cat([ids, torch.zeros(1, pad, dtype=torch.long)], 1),
        torch.cat([mask, torch.zeros(1, pad, dtype=torch.long)], 1),
        [torch.cat([a, torch.randn(1, pad, 16)], 1) for a in aux],
        TeacherHead.from_logits(torch.cat([logits, torch.randn(1, pad, 37)], 1)), 3, 0.8, valid_counts(mask, 3))
    torch.testing.assert_close(plain.loss, padded.loss, rtol=1e-5, atol=1e-6)
    assert plain.valid.tolist() == padded.valid.tolist()


def test_acceptance_length_formula():
    assert acceptance_length(torch.tensor([0.0, 0.0])) == 1.0
    assert acceptance_length(torch.tensor([1.0, 1.0, 1.0])) == 4.0
    assert abs(acceptance_length(torch.tensor([0.5, 0.5])) - (1 + 0.5 + 0.25)) < 1e-12


@pytest.mark.parametrize("flags", [{}, {"sliding_window": 3}])
def test_packed_row_equals_its_documents_run_alone(flags):
    """Two conversations packed into one row (per-document positions, document-aware attention and
    validity) give exactly the per-step sums and the loss of the two run as separate rows."""
    model = tiny_drafter(**flags)
    g = torch.Generator().manual_seed(4)
    lengths, steps = (9, 7), 3
    ids = [torch.randint(1, 37, (n,), generator=g) for n in lengths]
    masks = [torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1]), torch.tensor([0, 0, 1, 1, 1, 1, 1])]
    aux = [[torch.randn(n, 16, generator=g) for _ in range(3)] for n in lengths]
    logits = [torch.randn(n, 37, generator=g) * 3 for n in lengths]

    packed_ids, packed_mask = torch.cat(ids)[None], torch.cat(masks)[None]
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    denominators = valid_counts(packed_mask, steps, documents)
    packed = ttt_unroll(model, packed_ids, packed_mask, [torch.cat(a)[None] for a in zip(*aux)],
                        TeacherHead.from_logits(torch.cat(logits)[None]), steps, 0.8, denominators,
                        position_ids=positions, document_ids=documents)
    alone = [ttt_unroll(model, i[None], m[None], [a[None] for a in x], TeacherHead.from_logits(lg[None]), steps,
                        0.8, denominators) for i, m, x, lg in zip(ids, masks, aux, logits)]
    assert denominators.tolist() == (valid_counts(masks[0][None], steps) + valid_counts(masks[1][None], steps)).tolist()
    assert packed.valid.tolist() == (alone[0].valid + alone[1].valid).tolist()
    assert packed.correct.tolist() == (alone[0].correct + alone[1].correct).tolist()
    torch.testing.assert_close(packed.kl_sum, alone[0].kl_sum + alone[1].kl_sum, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed.loss, alone[0].loss + alone[1].loss, rtol=1e-5, atol=1e-6)
    # without document ids the second conversation would see the first: the sums differ
    blind = ttt_unroll(model, packed_ids, packed_mask, [torch.cat(a)[None] for a in zip(*aux)],
                       TeacherHead.from_logits(torch.cat(logits)[None]), steps, 0.8, denominators)
    assert not torch.allclose(blind.loss, packed.loss)
