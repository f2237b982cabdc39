"""recipes.bench.paired_timings: plain and speculative runs timed in pairs, the order alternating, the median pair
reported (torchspec-bench --repeats, bench_quality --timing-repeats, bench_runtime_efficiency --repeats)."""

from __future__ import annotations

import pytest

from recipes.bench import paired_timings


def scripted(order: list, kind: str, tokens_per_s: list[float]):
    runs = iter(tokens_per_s)

    def run():
        order.append(kind)
        return {"tokens_per_s": next(runs), "kind": kind}
    return run


def test_pairs_alternate_and_the_row_is_the_median_pair():
    order = []
    out = paired_timings(scripted(order, "plain", [100, 100, 50, 100]), scripted(order, "spec", [150, 300, 90, 120]), 4)
    assert order == ["plain", "spec", "spec", "plain", "plain", "spec", "spec", "plain"]
    assert out["speedup_repeats"] == pytest.approx([1.5, 3.0, 1.8, 1.2])
    assert out["speedup"] == pytest.approx(1.5)  # sorted 1.2, 1.5, 1.8, 3.0: the lower middle pair
    assert (out["plain"]["tokens_per_s"], out["spec"]["tokens_per_s"]) == (100, 150)
    assert (out["speedup_min"], out["speedup_max"]) == pytest.approx((1.2, 3.0))


def test_an_odd_count_takes_the_middle_pair_and_one_pair_is_plain_first():
    order = []
    out = paired_timings(scripted(order, "plain", [100, 80, 100]), scripted(order, "spec", [170, 160, 190]), 3)
    assert out["speedup"] == pytest.approx(1.9) and out["plain"]["tokens_per_s"] == 100  # 1.7, 2.0, 1.9
    order.clear()
    assert paired_timings(scripted(order, "plain", [10]), scripted(order, "spec", [20]), 1)["speedup"] == 2
    assert order == ["plain", "spec"]
    with pytest.raises(ValueError, match="repeats=0 must be >= 1"):
        paired_timings(scripted(order, "plain", []), scripted(order, "spec", []), 0)
