"""Speculative SAMPLING through the whole engine follows the target's distribution exactly.

``tests/unit/test_runtime_verify.py`` checks the verifier alone on synthetic table LMs. Here the
real pieces run together: a tiny target and an exported EAGLE-4 drafter (``tests/runtime_pair.py``,
vocabulary V = 8), the paged KV cache, drafting (sampled chain, sampled tree, deterministic-candidate
dynamic tree), the tree-masked verify forward, tree rejection sampling, accepted-path compaction
and drafter catch-up, under continuous batching (ROWS identical prompts through MAX_BATCH < ROWS
slots, so slots are refilled while other rows are mid-sequence).

Each row generates 5 tokens: the first from the prefill, the rest from speculation rounds. Two
joint distributions over V^3 cells are compared by chi-square tests with the exact target
distribution (transformers on all V^4 prefixes, ``process_logits`` with the engine's temperature
and top-p): the first 3 tokens (prefill + the first round's verify forward), and tokens 3-5. The
latter is needed because the first 3 tokens never see a compacted path: a round that accepts a
drafted node already commits 2 tokens, so a later round only follows one that accepted nothing.
Tokens 4-5 come after multi-token rounds, from KV the compaction moved.

**Mixed batches** (the request API, per-request settings): greedy, T = 1 and T = 0.7 / top-p rows
interleaved, so every round mixes them (per-row settings, sampled tree): each sampled group must
follow its own target distribution and every greedy row must equal the greedy output.

A chi-square test that passes proves little unless it is shown to have power at this size: each
positive control runs the same engine with a plausible bug patched in (a biased per-candidate
verification rule, no compaction, or per-row settings applied to the wrong rows), and the same test at the same ROWS must reject it outright.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

import torchspec.runtime.loading
import torchspec.runtime.steps
from tests.cost_tables import linear_table
from tests.runtime_pair import build_pair
from tests.stats import chi2_pvalue
from torchspec.runtime import verify
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.paged_kv import PagedKVCache
from torchspec.runtime.sampling import RowSampling, SamplingParams, process_logits

V = 8  # vocabulary: V^3 = 512 cells per test
PROMPT = [1, 2, 3]
OUT = 5  # tokens generated per row
ROWS = 3_000  # rows per case: ~0.7 ms of CPU engine time each; the controls show the power is ample
MAX_BATCH = 500  # slots: rows are admitted (batch-prefilled) in waves as slots free up

CHAIN = SpecConfig(shape="chain", depth=3)
SAMPLED_TREE = SpecConfig(shape="tree", depth=3, branching=(2, 2, 1))
DETERMINISTIC_TREE = SpecConfig(shape="tree", depth=3, topk=2, num_nodes=5, candidates="deterministic")
T1 = SamplingParams(temperature=1.0)
T07 = SamplingParams(temperature=0.7, top_p=0.9)

CASES = {
    "plain-t1": (None, T1),
    "chain-t1": (CHAIN, T1),
    "chain-t0.7-p0.9": (CHAIN, T07),
    "sampled_tree-t1": (SAMPLED_TREE, T1),
    "sampled_tree-t0.7-p0.9": (SAMPLED_TREE, T07),
    "deterministic_tree-t1": (DETERMINISTIC_TREE, T1),
    "deterministic_tree-t0.7-p0.9": (DETERMINISTIC_TREE, T07),
}


def no_residual_step(p, token, sampled, q, u):
    """Bug: the accept test is right (point mass for deterministic candidates, q_i for sampled
    ones) but a rejection leaves p as it was, so the rejected token can still be drawn after it."""
    accept, _ = verify.rejection_step(p, token, sampled, q, u)
    return accept, p


def unnormalised_residual_step(p, token, sampled, q, u):
    """Bug: the residual is not renormalised. The final draw does not care (sampling is scale
    free), but the next sibling is then accepted with too small a probability: trees only (a
    chain never tries a second candidate)."""
    accept, _ = verify.rejection_step(p, token, sampled, q, u)
    point = torch.zeros_like(p).scatter_(-1, token[:, None], 1.0)
    return accept, (p - torch.where(sampled[:, None], q, point)).clamp_min(0.0)


def biased_verifier(step: verify.CandidateStep) -> Callable[[pytest.MonkeyPatch], None]:
    def patch(mp: pytest.MonkeyPatch) -> None:
        biased = functools.partial(verify.verify_sampling, step=step)
        mp.setattr(torchspec.runtime.steps, "verify_sampling", biased)
    return patch


def no_compaction(mp: pytest.MonkeyPatch) -> None:
    """Bug: the accepted path's K/V stays where the verify forward wrote it, so a later round
    attends rejected siblings' K/V (a chain's path is already in place: trees only)."""
    mp.setattr(PagedKVCache, "move_slots", lambda self, src, dst: None)


CONTROLS = {
    "chain-no_residual": (CHAIN, T1, biased_verifier(no_residual_step)),
    "sampled_tree-unnormalised_residual": (SAMPLED_TREE, T1, biased_verifier(unnormalised_residual_step)),
    "deterministic_tree-no_residual": (DETERMINISTIC_TREE, T1, biased_verifier(no_residual_step)),
    "deterministic_tree-no_compaction": (DETERMINISTIC_TREE, T1, no_compaction),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # initializer_range 0.5: a peaked (non-uniform) target whose bigram part the drafter still tracks
    return build_pair(tmp_path_factory.mktemp("pair_v8"), None, vocab_size=V, initializer_range=0.5)


@pytest.fixture(scope="module")
def engine(pair):
    target, drafter = pair
    # load_engine always loads the checkpoint's tokenizer; a V = 8 target has none (token ids only)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torchspec.runtime.loading, "load_tokenizer", lambda path: None)
        return torchspec.runtime.loading.load_engine(target, drafter, device="cpu", dtype="float32",
                                                     max_batch=MAX_BATCH, max_context=20, page_size=4)


@pytest.fixture(scope="module")
def target_joint(pair):
    """SamplingParams -> exact P(t1..t5 | PROMPT) [V] * 5 under the processed target."""
    model = AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32).eval()
    prefixes = torch.cartesian_prod(*[torch.arange(V)] * (OUT - 1))  # [V^4, 4]: every t1..t4
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], 1)
    with torch.no_grad():
        logits = model(ids).logits[:, len(PROMPT) - 1:].reshape(*[V] * (OUT - 1), OUT, V)  # [t1..t4, step, V]
    cache = {}

    def joint(params: SamplingParams) -> torch.Tensor:
        if params not in cache:
            p = process_logits(logits, params).double()
            out = torch.ones([], dtype=torch.float64)
            for k in range(OUT):  # P(t_{k+1} | t1..tk) depends on the first k prefix tokens only
                step = p[(slice(None),) * k + (0,) * (OUT - 1 - k) + (k,)]  # [V] * (k + 1)
                out = out[..., None] * step
            cache[params] = out
        return cache[params]

    return joint


def run(engine, spec: SpecConfig | None, params: SamplingParams, seed: int, controller=None
        ) -> tuple[torch.Tensor, float]:
    """Generate OUT tokens for ROWS copies of PROMPT -> (counts [V] * OUT, mean acceptance)."""
    results = engine.generate([PROMPT] * ROWS, max_new_tokens=OUT, sampling=params, spec=spec, seed=seed,
                              ignore_eos=True, controller=controller)
    assert engine.free_pages == engine.total_pages
    assert all(len(r.token_ids) == OUT and r.finish_reason == "length" for r in results)
    tokens = torch.tensor([r.token_ids for r in results])  # [ROWS, OUT]
    counts = torch.zeros([V] * OUT, dtype=torch.long)
    counts.index_put_(tuple(tokens.T), torch.ones(ROWS, dtype=torch.long), accumulate=True)
    rounds = [a for r in results for a in r.accept_lengths]
    return counts, sum(rounds) / len(rounds)


def pvalues(counts: torch.Tensor, joint: torch.Tensor) -> dict[str, float]:
    """Chi-square p-values of the first 3 tokens and of tokens 3-5."""
    return {"t1-t3": chi2_pvalue(counts.sum((3, 4)), joint.sum((3, 4))),
            "t3-t5": chi2_pvalue(counts.sum((0, 1)), joint.sum((0, 1)))}


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_follow_target(engine, target_joint, case):
    spec, params = CASES[case]
    counts, acceptance = run(engine, spec, params, seed=list(CASES).index(case))
    ps = pvalues(counts, target_joint(params))
    print(f"{case}: p {ps}, mean acceptance {acceptance:.3f}")
    assert min(ps.values()) > 1e-3
    if spec is not None:  # the pair agrees often: multi-token accepted spans really happen
        assert acceptance > (1.3 if spec.shape == "chain" else 1.2)


def test_sampled_rounds_under_the_controller_follow_target(engine, target_joint):
    """The draft controller sets each sampled round's depth from the previous round's draws (fixed before the
    round's own): the output is still the target's (the positive controls above show the power at this size)."""
    table = linear_table(engine, 0.01, 0.02, widths=[1, 2, 4, 8], nodes=list(range(33)))
    counts, acceptance = run(engine, SAMPLED_TREE, T1, seed=77, controller=table)
    ps = pvalues(counts, target_joint(T1))
    depths = collections.Counter(engine.controller.sampled_depths)
    print(f"controller: p {ps}, mean acceptance {acceptance:.3f}, sampled depths {dict(depths)}")
    assert min(ps.values()) > 1e-3
    assert len(depths) >= 2 and acceptance > 1.2  # the depth really changed between rounds


@pytest.mark.parametrize("control", list(CONTROLS))
def test_positive_control_is_rejected(engine, target_joint, monkeypatch, control):
    spec, params, patch = CONTROLS[control]
    patch(monkeypatch)
    counts, _ = run(engine, spec, params, seed=100 + list(CONTROLS).index(control))
    ps = pvalues(counts, target_joint(params))
    print(f"{control}: p {ps}")
    assert min(ps.values()) < 1e-6


# --- mixed batches: rows with different settings in the same rounds ---------------------------------

MIXED_PATTERN = [SamplingParams(), T1, T07, T1, T07]  # request i gets MIXED_PATTERN[i % 5]
MIXED_CASES = {"chain": CHAIN, "sampled_tree": SAMPLED_TREE, "deterministic_tree": DETERMINISTIC_TREE}


def rows_misaligned(mp: pytest.MonkeyPatch) -> None:
    """Bug: the per-row settings tensor is built one row off (row b gets row b + 1's settings)."""
    of = RowSampling.of
    mp.setattr(RowSampling, "of", classmethod(lambda cls, params, device: of(params[1:] + params[:1], device)))


def run_mixed(engine, spec: SpecConfig, seed: int) -> tuple[dict, list[list[int]], float]:
    """ROWS requests of each sampled setting and ROWS / 2 greedy ones, interleaved, through the request
    API -> ({params: counts [V] * OUT}, greedy rows' tokens, mean acceptance of the sampled rows)."""
    engine.configure(spec=spec, seed=seed)
    n = len(MIXED_PATTERN) * ROWS // 2
    ids = {engine.submit(PROMPT, max_new_tokens=OUT, sampling=MIXED_PATTERN[i % 5], ignore_eos=True): i
           for i in range(n)}
    results = {}
    while engine.has_work:
        results.update((ids[r.request_id], r) for r in engine.step())
    assert engine.free_pages == engine.total_pages
    counts, greedy, rounds = {}, [], []
    for i, r in sorted(results.items()):
        params = MIXED_PATTERN[i % 5]
        assert len(r.token_ids) == OUT
        if params.greedy:
            greedy.append(r.token_ids)
            continue
        c = counts.setdefault(params, torch.zeros([V] * OUT, dtype=torch.long))
        c[tuple(r.token_ids)] += 1
        rounds += r.accept_lengths
    return counts, greedy, sum(rounds) / len(rounds)


@pytest.fixture(scope="module")
def greedy_tokens(engine):
    return engine.generate([PROMPT], max_new_tokens=OUT, ignore_eos=True)[0].token_ids


@pytest.mark.parametrize("case", list(MIXED_CASES))
def test_mixed_batch_rows_follow_their_own_settings(engine, target_joint, greedy_tokens, case):
    counts, greedy, acceptance = run_mixed(engine, MIXED_CASES[case], seed=200 + list(MIXED_CASES).index(case))
    assert all(g == greedy_tokens for g in greedy) and len(greedy) == ROWS // 2
    for params, c in counts.items():
        assert int(c.sum()) == ROWS
        ps = pvalues(c, target_joint(params))
        print(f"mixed {case} {params}: p {ps}, mean acceptance {acceptance:.3f}")
        assert min(ps.values()) > 1e-3
    assert acceptance > 1.2


def test_positive_control_mixed_rows_misaligned_is_rejected(engine, target_joint, monkeypatch):
    rows_misaligned(monkeypatch)
    counts, _, _ = run_mixed(engine, SAMPLED_TREE, seed=300)
    ps = {str(params): pvalues(c, target_joint(params)) for params, c in counts.items()}
    print(f"mixed rows misaligned: p {ps}")
    assert min(min(p.values()) for p in ps.values()) < 1e-6


def test_mixed_rounds_without_top_p_skip_the_filter_with_the_same_tokens(engine, monkeypatch):
    """A mixed round whose sampled rows use no top-k / top-p runs without the filter's sort; the
    seeded output is the same token for token as with the filter forced on (which keeps every token)."""
    rows = [[1, 2, 3], [3, 2, 1], [2, 2, 2], [1, 1, 3]] * 4
    params = SamplingParams(temperature=1.0)
    seen = []
    of = RowSampling.of

    def recording(cls, p, device):
        seen.append(of(p, device).filtered)
        return of(p, device)

    monkeypatch.setattr(RowSampling, "of", classmethod(recording))
    fast = [r.token_ids for r in engine.generate(rows, max_new_tokens=8, sampling=params, spec=SAMPLED_TREE,
                                                 seed=7, ignore_eos=True)]
    assert seen and not any(seen)  # every round took the unfiltered path
    forced = classmethod(lambda cls, p, device: dataclasses.replace(of(p, device), filtered=True))
    monkeypatch.setattr(RowSampling, "of", forced)
    slow = [r.token_ids for r in engine.generate(rows, max_new_tokens=8, sampling=params, spec=SAMPLED_TREE,
                                                 seed=7, ignore_eos=True)]
    assert fast == slow
