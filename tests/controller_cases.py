"""What the CPU controller tests share (test_controlled_drafting, test_controller_probes, test_controller_holds):
the specs the controller is bounded by, the verified-node counts of their tables, the tiny pair's engines (plain,
and confident: the head's logits x40, the same argmax but confident enough for rounds to go deep), prompts, a
table builder and one controlled run."""

from __future__ import annotations

from tests.cost_tables import linear_table
from torchspec.runtime.cost_table import CostTable
from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.loading import load_engine

SPECS = [SpecConfig(shape="tree", depth=4, topk=3, num_nodes=12), SpecConfig(shape="chain", depth=5)]
NODES = [0, 1, 2, 4, 8, 12]


def cpu_engine(pair, *, confident: bool = False):
    """The tiny pair on the CPU in fp32 (three slots, 160 positions, pages of 4); ``confident``: the drafter's head
    logits x40 -- the tiny pair's own distributions are near-flat (top probability ~0.004), which no cost table
    makes worth a second depth."""
    engine = load_engine(*pair, device="cpu", dtype="float32", max_batch=3, max_context=160, page_size=4)
    if confident:
        engine.runner.model.lm_head.weight.data.mul_(40.0)
    return engine


def prompts(tokenizer, n: int) -> list[list[int]]:
    texts = ["hello there", "the cat sat on a mat and", "one two three", "repeat: red green blue"]
    return [tokenizer.encode(texts[i % len(texts)], add_special_tokens=False) for i in range(n)]


def table(engine, depth: float, verify_per_node: float, *, noise: float = 0.0, seed: int = 0) -> CostTable:
    return linear_table(engine, depth, verify_per_node, widths=[1, 2, 3], nodes=NODES, noise=noise, seed=seed)


def run(engine, tokenizer, n: int, spec: SpecConfig, costs: CostTable, mode: str):
    """``n`` prompts for 32 tokens under the controller: (the outputs, the controller's trace)."""
    out = engine.generate(prompts(tokenizer, n), max_new_tokens=32, spec=spec, ignore_eos=True, controller=costs,
                          controller_mode=mode)
    return out, list(engine.controller.trace)
