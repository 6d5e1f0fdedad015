"""losscodegen: loss terms declared as sympy formulas, compiled into one fused Triton kernel."""
__version__ = "0.2.0"

from . import symbols
from .head import HeadLoss, HeadOutput
from .terms import (CISPO, GRPO, GSPO, JSD, SAPO, CISPOClipRatio, ClipFraction, ClipRatioHigh,
                    ClipRatioLow, ClipRatioRegion, CrossEntropy, Entropy, ForwardKL, KLNewOld, LogProb,
                    RatioMean, RefKL, ReverseKL, Term, TokenAccuracy, TopKForwardKL, ZLoss, declare_term)
from . import testing  # noqa: E402  (it tests HeadLoss)
from . import preference  # noqa: E402  (its terms are HeadLoss terms)


__all__ = ["HeadLoss", "HeadOutput", "Term", "declare_term", "symbols", "testing", "preference",
           "CrossEntropy", "ZLoss", "Entropy", "TokenAccuracy", "ForwardKL", "ReverseKL", "JSD",
           "TopKForwardKL", "GRPO", "GSPO", "RatioMean", "ClipFraction", "KLNewOld", "LogProb",
           "RefKL", "CISPO", "SAPO", "ClipRatioLow", "ClipRatioHigh", "ClipRatioRegion", "CISPOClipRatio"]
