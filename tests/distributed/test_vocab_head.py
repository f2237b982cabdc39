"""The vocabulary-parallel verify head on gloo: argmax == the full logits' argmax, ties included.

One 3-rank launch (a vocabulary of 10 rows does not divide by 3, so the last slice is shorter)
covers TP=3 and the TP=1 reference on every rank. Ties are forced: several columns hold the
same maximum, across shards and inside one, and the winner must be the lowest id, as
``torch.argmax`` gives. ``logits`` all-gathers the slices back to the full fp32 logits (equal up to GEMM rounding).
"""

import torch
import torch.distributed as dist

from torchspec.distributed import init_distributed
from torchspec.targets.head import VocabParallelHead, fp32_logits

from .launcher import launch

VOCAB, HIDDEN = 10, 6


def _weight_and_hidden() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    hidden = torch.randn(2, 5, HIDDEN, generator=g)
    weight[7] = weight[2]  # rows 2 and 7 (different shards) tie everywhere
    weight[5] = weight[4]  # rows 4 and 5 (one shard) tie everywhere
    hidden[0, 0] = weight[2] * 10  # row 2 (and 7) win: tie across shards
    hidden[1, 3] = weight[4] * 10  # row 4 (and 5) win: tie inside a shard
    return weight, hidden


def _worker():
    init_distributed(backend="gloo", device_type="cpu")
    weight, hidden = _weight_and_hidden()
    head = VocabParallelHead(weight, dist.group.WORLD)
    full = fp32_logits(hidden, weight)
    return {"argmax": head.argmax(hidden), "expected": full.argmax(-1), "logits": head.logits(hidden),
            "full": full, "slice": (head.start, head.weight.shape[0])}


def test_vocab_parallel_argmax_and_logits_equal_full():
    results = launch(_worker, world_size=3)
    weight, hidden = _weight_and_hidden()
    expected = fp32_logits(hidden, weight).argmax(-1)
    assert expected[0, 0] == 2 and expected[1, 3] == 4  # the ties are real and resolve low
    assert [r["slice"] for r in results] == [(0, 4), (4, 4), (8, 2)]
    for r in results:
        assert torch.equal(r["argmax"], expected)
        # a slice's GEMM may round its last bit differently from the full one's (BLAS blocking)
        torch.testing.assert_close(r["logits"], r["full"], rtol=1e-6, atol=1e-5)


def test_single_process_head_is_plain_fp32_logits():
    weight, hidden = _weight_and_hidden()
    head = VocabParallelHead(weight.to(torch.bfloat16))
    out = head.local_logits(hidden.to(torch.bfloat16))
    assert out.dtype == torch.float32 and out.shape == (2, 5, VOCAB)
    ref = hidden.to(torch.bfloat16).float() @ weight.to(torch.bfloat16).float().t()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert torch.equal(head.argmax(hidden.to(torch.bfloat16)), ref.argmax(-1))
