"""Serving hybrid Gated-DeltaNet targets (qwen3_5, qwen3_next): recurrent state per slot, tree recurrence, commit.

* unit level (`recurrent_state.py` against `gdn_ops`): every node of a random draft tree gets exactly
  the conv output and delta-rule output of running its root-to-node path sequentially from the
  committed state; ``commit`` writes the chosen node's states and nothing else; a prefill's padding
  leaves the committed state alone;
* engine (fp32, CPU): the plain decoder equals transformers' greedy ``generate``; greedy speculation
  (chains and trees) equals the plain decoder token for token over 5 prompts of different lengths
  through 3 slots (continuous batching: slots are refilled and their state restarts from zero);
* **a rejected node leaves no trace**: after one real round, each row's committed state equals the
  state of prefilling exactly its committed tokens; the positive controls commit a wrong node (the
  tree's last node, a node of the same depth, the accepted node's parent) and the same check must
  fail for each;
* sampled speculation follows the target distribution (the chi-square test of
  ``test_runtime_engine_sampling.py``) on a hybrid target, for a sampled tree and a chain;
* ``tools/bench_hybrid_verify.py --smoke`` runs.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

import torchspec.runtime.loading
import torchspec.runtime.steps
from tests.runtime_pair import build_pair
from tests.stats import chi2_pvalue
from torchspec.runtime.drafting import DraftInputs, SpecConfig
from torchspec.runtime.loading import load_engine
from torchspec.runtime.paged_kv import PagedKVCache
from torchspec.runtime.recurrent_state import (
    HybridAttend,
    RecurrentState,
    RecurrentStep,
    build_recurrent_meta,
    tree_level_widths,
)
from torchspec.runtime.sampling import SamplingParams, process_logits
from torchspec.runtime.steps import Caches, prefill, speculate
from torchspec.targets.gdn_ops import causal_conv, delta_rule_step

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_hybrid_verify.py"
FLAVOURS = ("qwen3_5", "qwen3_next")
CHAIN = SpecConfig(shape="chain", depth=3)
TREE = SpecConfig(shape="tree", depth=4, topk=3, num_nodes=10)
GREEDY = SamplingParams()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def hybrid_pair(root, tokenizer, flavour: str, mix: float = 0.3, **kwargs) -> tuple[str, str]:
    """`tests.runtime_pair.build_pair` (a mostly-bigram target, GDN outputs scaled by ``mix`` too, and a
    drafter imitating it)."""
    return build_pair(root, tokenizer, flavour=flavour, mix=mix, **kwargs)


def oracle(path: str, flavour: str):
    cls = Qwen3_5ForConditionalGeneration if flavour == "qwen3_5" else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=FLAVOURS)
def pair(request, tmp_path_factory, tiny_tokenizer):
    flavour = request.param
    return flavour, *hybrid_pair(tmp_path_factory.mktemp(f"hybrid_{flavour}"), tiny_tokenizer, flavour)


@pytest.fixture(scope="module")
def engine(pair):
    return load_engine(pair[1], pair[2], device="cpu", dtype="float32", max_batch=3, max_context=96, page_size=4)


def prompts(tokenizer, n: int) -> list[list[int]]:
    texts = ["hello there", "the cat sat on a mat and", "one two three", "alpha",
             "a much longer prompt that spans several pages of the cache"]
    return [tokenizer.encode(texts[i % len(texts)], add_special_tokens=False) for i in range(n)]


# --- unit level: the tree recurrence against gdn_ops --------------------------------------------

def random_trees(b: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((b, n), -1)
    depths = torch.zeros(b, n, dtype=torch.long)
    for r in range(b):
        for i in range(1, n):
            parents[r, i] = int(torch.randint(0, i, (1,), generator=g))
            depths[r, i] = depths[r, parents[r, i]] + 1
    return parents, depths


def path_to(parents: torch.Tensor, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def gdn_inputs(b: int, t: int, h=2, dk=4, dv=5, c=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g), dim=-1)  # noqa: E731
    return (torch.randn(b, t, c, generator=g), unit(b, t, h, dk), unit(b, t, h, dk) * dk**-0.5,
            torch.randn(b, t, h, dv, generator=g), -torch.rand(b, t, h, generator=g), torch.rand(b, t, h, generator=g))


def sequential(state, history, weight, x, q, k, v, g, beta, path):
    """gdn_ops along one path from the committed state: (conv out, delta out, ssm, conv history) at its end."""
    path = torch.tensor(path)
    y = causal_conv(x[None, path], weight, history[None])[0, -1]
    s = state[None]
    for j in path:
        o, s = delta_rule_step(s, q[None, j], k[None, j], v[None, j], g[None, j], beta[None, j])
    hist = torch.cat([history, x[path].T], 1)[:, -(weight.shape[1] - 1):]
    return y, o[0], s[0], hist


@pytest.mark.parametrize("tight", [False, True], ids=["default_widths", "tight_widths"])
def test_tree_recurrence_equals_sequential_paths_and_commit_takes_one_node(tight):
    b, n, kernel = 3, 11, 4
    parents, depths = random_trees(b, n, seed=1)
    parents[2] = torch.arange(n) - 1  # a chain is the tree whose node i has parent i - 1
    depths[2] = torch.arange(n)
    x, q, k, v, g, beta = gdn_inputs(b, n)
    weight = torch.randn(6, kernel)
    state = RecurrentState([1, 5], num_slots=5, conv_channels=6, conv_kernel=kernel, num_heads=2, key_dim=4,
                           value_dim=5, dtype=torch.float32, device="cpu")
    state.conv.normal_()
    state.ssm.normal_()
    before = (state.conv.clone(), state.ssm.clone())
    slots = torch.tensor([4, 0, 2])
    widths = tuple(int((depths == d).sum(1).max()) for d in range(int(depths.max()) + 1)) if tight else None
    step = RecurrentStep(state, build_recurrent_meta(slots, kernel, parents=parents, depths=depths,
                                                     level_widths=widths))
    y, o = step.conv(5, x, weight), step.delta_rule(5, q, k, v, g, beta)
    for r in range(b):
        committed = (before[1][1, slots[r]], before[0][1, slots[r]])
        for i in range(n):
            ry, ro, _, _ = sequential(*committed, weight, x[r], q[r], k[r], v[r], g[r], beta[r], path_to(parents[r], i))
            torch.testing.assert_close(y[r, i], ry, rtol=0, atol=1e-6)
            torch.testing.assert_close(o[r, i], ro, rtol=0, atol=1e-5)
    last, valid = torch.tensor([n - 1, 3, 6]), torch.tensor([True, False, True])
    step.commit(last, valid)
    for r in range(b):
        committed = (before[1][1, slots[r]], before[0][1, slots[r]])
        _, _, s, hist = sequential(*committed, weight, x[r], q[r], k[r], v[r], g[r], beta[r], path_to(parents[r], last[r]))
        want_ssm, want_conv = (s, hist) if valid[r] else committed
        torch.testing.assert_close(state.ssm[1, slots[r]], want_ssm, rtol=0, atol=1e-5)
        torch.testing.assert_close(state.conv[1, slots[r]], want_conv, rtol=0, atol=0)
    untouched = torch.tensor([1, 3])
    assert torch.equal(state.ssm[0], before[1][0]) and torch.equal(state.conv[0], before[0][0])  # other layer
    assert torch.equal(state.ssm[:, untouched], before[1][:, untouched])  # other slots


def test_prefill_padding_leaves_the_committed_state_alone():
    b, t, kernel = 3, 9, 4
    lengths = torch.tensor([9, 2, 5])
    x, q, k, v, g, beta = gdn_inputs(b, t, seed=2)
    weight = torch.randn(6, kernel)
    state = RecurrentState([0], 3, 6, kernel, 2, 4, 5, torch.float32, "cpu")
    state.ssm.fill_(7.0)  # whatever a slot held before: a prompt starts from zero state
    step = RecurrentStep(state, build_recurrent_meta(torch.tensor([2, 0, 1]), kernel, lengths=lengths))
    y, o = step.conv(0, x, weight), step.delta_rule(0, q, k, v, g, beta)
    for r, slot in enumerate([2, 0, 1]):
        n = int(lengths[r])
        zero = (torch.zeros(2, 4, 5), torch.zeros(6, kernel - 1))
        ry, ro, s, hist = sequential(*zero, weight, x[r], q[r], k[r], v[r], g[r], beta[r], list(range(n)))
        torch.testing.assert_close(y[r, n - 1], ry, rtol=0, atol=1e-6)
        torch.testing.assert_close(o[r, n - 1], ro, rtol=0, atol=1e-5)
        torch.testing.assert_close(state.ssm[0, slot], s, rtol=0, atol=1e-5)
        torch.testing.assert_close(state.conv[0, slot], hist, rtol=0, atol=0)


def test_level_widths_bound_the_drafted_trees():
    assert tree_level_widths(CHAIN, GREEDY) == (1, 1, 1, 1)
    assert tree_level_widths(SpecConfig(shape="tree", depth=3, branching=(3, 2, 1)), SamplingParams(temperature=1.0)) \
        == (1, 3, 6, 6)
    assert tree_level_widths(TREE, GREEDY) == (1, 3, 9, 8, 7)  # min(k W, k^2, m - (d - 1)), m = 10


# --- engine: losslessness --------------------------------------------------------------------------

def test_kv_cache_holds_attention_layers_only(engine):
    dec = engine.decoder
    assert engine.caches.target.num_layers == len(dec.attention_layer_ids) < dec.num_layers
    r = dec.args.recurrent
    assert engine.caches.recurrent.ssm.shape == (len(dec.linear_layer_ids), 3, r.num_heads, r.key_dim, r.value_dim)
    assert engine.caches.recurrent.conv.shape == (len(dec.linear_layer_ids), 3, r.conv_channels, r.conv_kernel - 1)


def test_plain_decoder_equals_transformers_generate(pair, engine, tiny_tokenizer):
    hf = oracle(pair[1], pair[0])
    ps = prompts(tiny_tokenizer, 2)
    for p, r in zip(ps, engine.generate(ps, max_new_tokens=16, ignore_eos=True)):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0, min_new_tokens=16)[0, len(p):].tolist()
        assert r.token_ids == ref


@pytest.fixture(scope="module")
def plain_outputs(engine, tiny_tokenizer):
    engine.caches.recurrent.ssm.fill_(3.0)  # stale slot contents must not matter: prefill starts from zero
    return engine.generate(prompts(tiny_tokenizer, 5), max_new_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_greedy_speculation_equals_plain_with_continuous_batching(engine, plain_outputs, tiny_tokenizer, spec):
    out = engine.generate(prompts(tiny_tokenizer, 5), max_new_tokens=24, spec=spec, ignore_eos=True)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain_outputs]
    rounds = [a for r in out for a in r.accept_lengths]
    assert sum(rounds) / len(rounds) > 1.2  # multi-token rounds (compaction + commit of deep nodes) happen
    assert engine.free_pages == engine.total_pages


# --- a rejected node leaves no trace ---------------------------------------------------------------

def _wrong_node(kind: str, parents: torch.Tensor, depths: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    n = parents.shape[1]
    idx = torch.arange(n)
    if kind == "tree_last":
        return torch.full_like(last, n - 1)
    if kind == "parent":
        return parents.gather(1, last[:, None])[:, 0].clamp(min=0)
    same = (depths == depths.gather(1, last[:, None])) & (idx != last[:, None])  # "same_depth": a rejected node
    return torch.where(same.any(1), same.long().argmax(1), last)


def committed_state_error(engine, tokenizer, monkeypatch, mutation: str | None) -> float:
    """One greedy tree round on 3 rows (the third invalid) from a prefill; max |state - reference| over
    rows, where the reference is a prefill of exactly the committed tokens (row 3: its prefill state)."""
    dec, runner = engine.decoder, engine.runner
    ps = prompts(tokenizer, 3)
    b, pages, page = 3, 8, 4
    block_table = 1 + torch.arange(b * pages).view(b, pages)

    def fresh() -> Caches:
        return Caches(PagedKVCache.for_target(dec, b * pages + 1, page), runner.make_kv_cache(b * pages + 1, page),
                      page, RecurrentState.for_target(dec, b))

    def run_prefill(caches, seqs):
        lengths = torch.tensor([len(s) for s in seqs])
        ids = torch.zeros(b, int(lengths.max()), dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
        return prefill(dec, runner, caches, block_table, ids, lengths, GREEDY, None), lengths

    caches = fresh()
    first, lengths = run_prefill(caches, ps)
    after_prefill = (caches.recurrent.ssm.clone(), caches.recurrent.conv.clone())
    if mutation is not None:
        seen, verify, commit = {}, torchspec.runtime.steps.verify_greedy, HybridAttend.commit

        def keep_tree(tree, *args, **kwargs):
            seen["tree"] = tree
            return verify(tree, *args, **kwargs)

        monkeypatch.setattr(torchspec.runtime.steps, "verify_greedy", keep_tree)
        monkeypatch.setattr(HybridAttend, "commit", lambda self, last, valid: commit(
            self, _wrong_node(mutation, seen["tree"].parents, seen["tree"].depths, last), valid))
    valid = torch.tensor([True, True, False])
    inp = DraftInputs(root=first.root, normed=first.normed, feedback=first.feedback, ctx_len=lengths,
                      block_table=block_table, row_valid=valid)
    out = speculate(dec, runner, caches, inp, TREE, GREEDY, None)
    assert int(out.count[:2].max()) >= 2  # a drafted node was accepted somewhere
    committed = [p + [int(first.root[r])] + out.tokens[r, : int(out.count[r]) - 1].tolist() for r, p in enumerate(ps)]
    ref = fresh()
    run_prefill(ref, committed)
    err = 0.0
    for r in range(b):
        want_ssm = ref.recurrent.ssm[:, r] if valid[r] else after_prefill[0][:, r]
        want_conv = ref.recurrent.conv[:, r] if valid[r] else after_prefill[1][:, r]
        err = max(err, (caches.recurrent.ssm[:, r] - want_ssm).abs().max().item(),
                  (caches.recurrent.conv[:, r] - want_conv).abs().max().item())
    return err


@pytest.mark.parametrize("mode", ["ahead", "within"])
def test_the_draft_controller_serves_hybrid_targets(pair, plain_outputs, tiny_tokenizer, mode):
    """Every controller decision on a hybrid target -- plain rounds and probes, stops at every depth, widths 0 .. N,
    the tree and the chain -- commits the recurrent state of the accepted path: the text is plain decoding's (the
    drafter's head x40: as confident as test_controlled_drafting's, the same argmax)."""
    from tests.cost_tables import linear_table

    engine = load_engine(pair[1], pair[2], device="cpu", dtype="float32", max_batch=3, max_context=96, page_size=4)
    engine.runner.model.lm_head.weight.data.mul_(40.0)

    seen = set()
    for seed, (depth, per_node) in enumerate([(0.01, 50.0), (1e-4, 1e-4), (0.002, 0.01)]):
        costs = linear_table(engine, depth, per_node, widths=[1, 2], nodes=[0, 1, 2, 4, 8], noise=0.5, seed=seed)
        for spec in (SpecConfig(shape="tree", depth=3, topk=2, num_nodes=8), SpecConfig(shape="chain", depth=4)):
            out = engine.generate(prompts(tiny_tokenizer, 5), max_new_tokens=24, spec=spec, ignore_eos=True,
                                  controller=costs, controller_mode=mode)
            assert [r.token_ids for r in out] == [r.token_ids for r in plain_outputs], (mode, depth, per_node, spec.shape)
            seen |= set(engine.controller.trace)
    widths = {w for _, w in seen}
    assert 0 in widths and len(widths) >= 3 and len({d for d, _ in seen}) >= 3, seen
    assert engine.free_pages == engine.total_pages


def test_committed_state_is_the_accepted_paths(engine, tiny_tokenizer, monkeypatch):
    assert committed_state_error(engine, tiny_tokenizer, monkeypatch, None) < 1e-4


@pytest.mark.parametrize("mutation", ["tree_last", "same_depth", "parent"])
def test_positive_control_wrong_node_is_caught(engine, tiny_tokenizer, monkeypatch, mutation):
    assert committed_state_error(engine, tiny_tokenizer, monkeypatch, mutation) > 1e-2


# --- sampled speculation follows the target ---------------------------------------------------------

V, PROMPT, OUT, ROWS = 8, [1, 2, 3], 4, 1500  # 4 tokens: t4 follows a round that committed a deep node


@pytest.fixture(scope="module")
def sampling_engine(tmp_path_factory):
    """A V = 8 hybrid pair (as in test_runtime_engine_sampling) and the exact target logits after every
    prefix t1..t3 of PROMPT (transformers: ``logits[t1, t2, t3, step]``)."""
    target, drafter = hybrid_pair(tmp_path_factory.mktemp("hybrid_v8"), None, "qwen3_5", vocab_size=V, mix=0.15,
                                  initializer_range=0.5)
    with pytest.MonkeyPatch.context() as mp:  # a V = 8 target ships no tokenizer
        mp.setattr(torchspec.runtime.loading, "load_tokenizer", lambda path: None)
        engine = torchspec.runtime.loading.load_engine(target, drafter, device="cpu", dtype="float32",
                                                       max_batch=500, max_context=20, page_size=4)
    prefixes = torch.cartesian_prod(*[torch.arange(V)] * (OUT - 1))
    ids = torch.cat([torch.tensor(PROMPT).expand(len(prefixes), -1), prefixes], 1)
    with torch.no_grad():
        logits = oracle(target, "qwen3_5")(ids).logits[:, len(PROMPT) - 1:].reshape(*[V] * (OUT - 1), OUT, V)
    return engine, logits


def exact_joint(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """P(t1..t4 | PROMPT) [V] * 4 under the processed target."""
    p = process_logits(logits, params).double()
    out = torch.ones([], dtype=torch.float64)
    for k in range(OUT):  # P(t_{k+1} | t1..tk) depends on the first k prefix tokens only
        out = out[..., None] * p[(slice(None),) * k + (0,) * (OUT - 1 - k) + (k,)]
    return out


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)],
                         ids=["t1", "t0.7-p0.9"])
def test_sampled_tree_follows_the_target(sampling_engine, params):
    engine, logits = sampling_engine
    spec = SpecConfig(shape="tree", depth=3, branching=(2, 2, 1))
    results = engine.generate([PROMPT] * ROWS, max_new_tokens=OUT, sampling=params, spec=spec, seed=3,
                              ignore_eos=True)
    assert engine.free_pages == engine.total_pages
    tokens = torch.tensor([r.token_ids for r in results])  # [ROWS, OUT]
    counts = torch.zeros([V] * OUT, dtype=torch.long)
    counts.index_put_(tuple(tokens.T), torch.ones(ROWS, dtype=torch.long), accumulate=True)
    joint = exact_joint(logits, params)
    ps = {"t1-t3": chi2_pvalue(counts.sum(3), joint.sum(3)), "t2-t4": chi2_pvalue(counts.sum(0), joint.sum(0))}
    rounds = [a for r in results for a in r.accept_lengths]
    print(f"p {ps}, mean acceptance {sum(rounds) / len(rounds):.3f}")
    assert min(ps.values()) > 1e-3
    assert sum(rounds) / len(rounds) > 1.1  # multi-token rounds (deep commits) happen


def test_bench_smoke_runs(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_hybrid_verify", TOOL)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    monkeypatch.setattr(sys, "argv", ["bench_hybrid_verify.py", "--smoke", "--json", str(out)])
    bench.main()
    data = json.loads(out.read_text())
    assert {r["name"] for r in data["results"]} == {"plain_step", "verify_tree", "verify_tree_exact", "verify_chain",
                                                   "commit", "capture"}
    assert data["layers"] == 4 and "layers 4 of 4" in capsys.readouterr().out
