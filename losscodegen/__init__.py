"""losscodegen: loss terms declared as sympy formulas, compiled into one fused Triton kernel."""
__version__ = "0.2.0"

from typing import Any

from . import symbols
from . import terms as _terms
from .head import HeadLoss, HeadOutput
from .terms import Term, declare_term
from . import testing  # noqa: E402  (it tests HeadLoss)
from . import preference  # noqa: E402  (its terms are HeadLoss terms)


__all__ = ["HeadLoss", "HeadOutput", "Term", "declare_term", "symbols", "testing", "preference",
           "CrossEntropy", "ZLoss", "Entropy", "TokenAccuracy", "ForwardKL", "ReverseKL", "JSD",
           "TopKForwardKL", "GRPO", "GSPO", "RatioMean", "ClipFraction", "KLNewOld", "LogProb",
           "RefKL", "CISPO", "SAPO", "ClipRatioLow", "ClipRatioHigh", "ClipRatioRegion", "CISPOClipRatio"]


def __getattr__(name: str) -> Any:
    """The built-in terms (lcg.CrossEntropy, ...), declared at their first use (terms.py), not here."""
    if name in _terms.BUILTIN_NAMES:
        return getattr(_terms, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_terms.BUILTIN_NAMES))
