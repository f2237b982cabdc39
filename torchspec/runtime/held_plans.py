"""Held plans (``TORCHSPEC_CONTROLLER_PLANS=held``, the default): when the draft controller's plan settles, run it
undecided.

A deciding round that plans the very (depth, width) it ran starts a hold: up to ``HOLD_ROUNDS - 1`` rounds run
that plan as its fixed shape (no scores, decision or calibration evidence: the fixed shape's cost), and the
round after them decides again (``controlled_drafting.Controller``).

A hold lasts only while the plan pays. Every round's committed tokens reach the host in the round's one sync
anyway, so the hold keeps the tokens a row-round its plan has committed -- the deciding round that started it
and each held round since -- and ends once they fall short of the plan's break-even
(``round_costs.break_even_tokens``: its modeled round time over a plain step's, from the cost table) by more
than ``RELEASE_Z`` standard errors. The next round then decides, as every round does without holds. Without a
release a middling drafter's marginal plan (d1w1 at 1.2 tokens a row-round, where it breaks even at 1.3) ran
held for seven rounds in eight that the deciding controller mostly gave to plain steps (H100, thirtieth
session: x0.88 against x0.92 at c = 64).

**Why a standard error.** A hold starts only on a deciding round whose own tokens reached the break-even, so a
drafter the calibration still overrates (an untrained one, early) starts none, as before. Once started, a hold
is released on evidence: a row-round commits between 1 and ``most`` = 1 + min(depth, width) tokens, so its
variance around a mean ``m`` is at most ``(m - 1) * (most - m)`` (the Bhatia-Davis bound; no per-row tokens need
reach the host), ``m`` being the hold's tokens a row-round with one more row-round at the break-even. At c = 64
one round is 64 row-rounds and the margin is small (d1w1 above: 0.05, released at once as before); at c = 1 one
round is one draw of a spread-out count, and a round that accepted nothing no longer ends a hold that needs 1.6
tokens (started on a round of 2, the fourth such round in a row does). Against the break-even as is, the
thirty-third session's c = 1 holds were cut by noise: 90 of 263 rounds decided, each 0.14-0.36 ms dearer than a
held one (H100, a 725-step SmolLM2 drafter: 0.94 of the best fixed tree).

**A plan that keeps paying is decided less often.** A hold that ran all its rounds while paying, confirmed by
the deciding round after it (the same plan again), is held again for twice as many rounds (7, 15, 31: up to
``HOLD_MOST - 1``), judged on that hold's own rounds and the deciding round's together -- so the confirming round
need not pay by itself, a draw that at c = 1 failed one deciding round in four. A release on evidence, another plan,
a probe or width 0 starts over with a fresh hold of ``HOLD_ROUNDS - 1`` on a round that paid. In the thirty-fifth
session a deciding round cost ~0.136 ms more than the held round of its plan (H100, SmolLM2, c = 1), and 63 of the
263 rounds of a replayed c = 1 run decided, 27 of 29 holds having run their 7 rounds to the end.

**The default** since the thirty-first session: on an H200, with the release rule and the thirtieth session's
fixes (one averaged table per shape under CUDA graphs, no catch-up on idle rows), held plans were faster than
every round deciding ("average") or level in all eight pairs of the controlled SmolLM2-shaped pair: a good
drafter x1.86 / 1.37 / 1.09 against x1.79 / 1.34 / 1.05 at c = 1 / 8 / 64 (reruns at c = 8 and 64: x1.35 against
1.29, x1.15 against 1.08), a middling one x0.97 / 0.97 / 0.85 against x0.97 / 0.97 / 0.83. A width-0 plan holds
nothing, so an untrained drafter's plain streaks run as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HOLD_ROUNDS = 8  # a fresh hold runs at most HOLD_ROUNDS - 1 rounds undecided; the next decides
HOLD_MOST = 32  # ... a hold its deciding round confirmed after a full one twice as many, up to HOLD_MOST - 1
RELEASE_Z = 1.0  # a hold ends once its tokens a row-round fall this many standard errors below its break-even


@dataclass
class Hold:
    """One hold's state: ``left`` rounds it may still run undecided, the tokens a row-round it must commit
    (``need``), the most a row-round can commit (``most``: 1 + min(depth, width)), what its rounds committed so far
    (``tokens`` over ``rows`` live row-rounds, with what it carried from the hold before: ``pays`` judges these),
    and its own rounds' share (``own_tokens`` over ``own_rows``: what a hold that follows it carries). ``plan``,
    ``length`` and ``full``: the plan held, the rounds it was given, and whether it ran them all while paying."""

    left: int = 0
    need: float = 0.0
    most: int = 1
    tokens: int = 0
    rows: int = 0
    own_tokens: int = 0
    own_rows: int = 0
    plan: tuple[int, int] | None = None
    length: int = 0
    full: bool = False

    def start(self, need: float, tokens: int, rows: int, most: int, plan: tuple[int, int] | None = None) -> None:
        """The deciding round that ran ``plan`` planned it again, committing ``tokens`` over ``rows`` live rows, at
        most ``most`` a row. A fresh hold starts only if those reach ``need`` themselves (a hold starts on a round
        that paid) and runs ``HOLD_ROUNDS - 1`` rounds. A round that confirms the plan of a hold that ran all its
        rounds while paying (``full``) instead goes on from that hold's own rounds: held if they and this round
        still pay (``pays``: within the noise), for twice as many rounds, up to ``HOLD_MOST - 1`` -- a plan that
        keeps paying is decided less and less often, and a release on evidence (``observe``) or a changed plan
        starts over. ``plan`` None: never carried."""
        chained = plan is not None and self.full and plan == self.plan
        carried = (self.own_tokens, self.own_rows) if chained else (0, 0)
        self.need, self.most, self.plan, self.full = need, most, plan, False
        self.tokens, self.rows = carried[0] + tokens, carried[1] + rows
        self.own_tokens, self.own_rows = tokens, rows
        if chained:
            self.length = min(2 * self.length + 1, HOLD_MOST - 1)
            paid = self.pays()
        else:
            self.length = HOLD_ROUNDS - 1
            paid = rows > 0 and need <= most and tokens >= need * rows
        self.left = self.length if paid else 0

    def take(self) -> bool:
        """Whether this round runs held (and, if so, one round fewer is left; the last one leaves the hold full
        unless its rounds stop paying)."""
        if self.left <= 0:
            return False
        self.left -= 1
        self.full = self.left == 0
        return True

    def observe(self, tokens: int, rows: int) -> None:
        """A held round committed ``tokens`` over ``rows`` live rows: the hold ends once the plan stops paying."""
        self.tokens, self.rows = self.tokens + tokens, self.rows + rows
        self.own_tokens, self.own_rows = self.own_tokens + tokens, self.own_rows + rows
        if not self.pays():
            self.left, self.full = 0, False

    def stop(self) -> None:
        self.left, self.full = 0, False

    def pays(self) -> bool:
        """Whether the tokens a row-round so far are within ``RELEASE_Z`` standard errors of the break-even (or
        above it); a break-even beyond what a row-round can commit never pays."""
        if self.rows <= 0 or self.need > self.most:
            return False
        mean = (self.tokens + self.need) / (self.rows + 1)  # one pseudo row-round at the break-even
        spread = math.sqrt(max(mean - 1.0, 0.0) * max(self.most - mean, 0.0) / self.rows)
        return self.tokens >= (self.need - RELEASE_Z * spread) * self.rows
