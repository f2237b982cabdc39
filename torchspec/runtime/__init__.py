"""The bundled speculative-decoding runtime: target decoder, paged KV cache, drafting, verification.

Entry points: ``load_engine`` (paths -> ``SpeculativeEngine``), ``SpeculativeEngine.generate``; CLIs ``torchspec-generate``
and ``torchspec-bench`` (``recipes/generate.py``, ``recipes/bench.py``). See docs/runtime.md.
"""

from torchspec.runtime.drafting import SpecConfig
from torchspec.runtime.engine import GenerationResult, SpeculativeEngine
from torchspec.runtime.loading import load_engine
from torchspec.runtime.sampling import SamplingParams

__all__ = ["GenerationResult", "SpeculativeEngine", "SamplingParams", "SpecConfig", "load_engine"]
