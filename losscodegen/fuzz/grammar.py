"""The fuzzer's formula grammar: random well-typed formulas over ``S`` (``losscodegen.symbols``).

A formula is a tree of ``Node``: each node a function of ``S`` and its children's values, so that
one tree is both the formula (``expr``: the function applied to the symbols module) and the code a
user would write (``code``: the same function applied to ``_CODE``, which writes what is done to it
as Python text, parenthesized by precedence).
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .. import symbols as S

# Python's binding strength of each operator: a printed operand is parenthesized where it binds
# less tightly than its place needs
_ATOM, _POWER, _UNARY, _PRODUCT, _SUM, _COMPARISON = 6, 5, 4, 3, 2, 1


class Code:
    """Python text over ``S``, and the binding strength of its outermost operator."""

    def __init__(self, text: str, strength: int = _ATOM) -> None:
        self.text, self.strength = text, strength

    def __getattr__(self, name: str) -> "Code":
        return Code(f"{self.text}.{name}")

    def __call__(self, *args: Any) -> "Code":
        return Code(f"{self.text}({', '.join(_text(a) for a in args)})")

    def _binary(self, op: str, other: Any, strength: int, reflected: bool = False) -> "Code":
        left, right = (_code(other), self) if reflected else (self, _code(other))
        # left-associative but for ``**``: the operand on the other side of the association is
        # parenthesized at equal strength too
        left_needs, right_needs = (strength + 1, strength) if op == "**" else (strength, strength + 1)
        return Code(f"{_operand(left, left_needs)} {op} {_operand(right, right_needs)}"
                    if op != "**" else f"{_operand(left, left_needs)}**{_operand(right, right_needs)}", strength)

    def __add__(self, o): return self._binary("+", o, _SUM)
    def __radd__(self, o): return self._binary("+", o, _SUM, True)
    def __sub__(self, o): return self._binary("-", o, _SUM)
    def __rsub__(self, o): return self._binary("-", o, _SUM, True)
    def __mul__(self, o): return self._binary("*", o, _PRODUCT)
    def __rmul__(self, o): return self._binary("*", o, _PRODUCT, True)
    def __truediv__(self, o): return self._binary("/", o, _PRODUCT)
    def __rtruediv__(self, o): return self._binary("/", o, _PRODUCT, True)
    def __pow__(self, o): return self._binary("**", o, _POWER)
    def __rpow__(self, o): return self._binary("**", o, _POWER, True)
    def __gt__(self, o): return self._binary(">", o, _COMPARISON)
    def __ge__(self, o): return self._binary(">=", o, _COMPARISON)
    def __neg__(self): return Code(f"-{_operand(self, _UNARY)}", _UNARY)


def _code(value: Any) -> Code:
    if isinstance(value, Code):
        return value
    text = repr(value)
    return Code(text, _UNARY if text.startswith("-") else _ATOM)


def _operand(code: Code, needs: int) -> str:
    return code.text if code.strength >= needs else f"({code.text})"


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return f"({', '.join(_text(v) for v in value)})"
    return _code(value).text


_CODE = Code("S")   # the code each formula function writes, given it in place of the symbols module


@dataclass(frozen=True)
class Node:
    """A formula: ``fn(S, *children)``. ``level``: "row", "elem" (inside vsum) or "topk" (inside
    topk_sum); ``pos``: positive and away from 0."""

    fn: Callable[..., Any]
    kids: tuple["Node", ...] = ()
    level: str = "row"
    pos: bool = False

    def expr(self) -> Any:
        """The formula itself (a sympy expression, or a number)."""
        return self.fn(S, *(k.expr() for k in self.kids))

    def code(self) -> str:
        """The formula as Python over ``S``."""
        return self._code().text

    def _code(self) -> Code:
        return _code(self.fn(_CODE, *(k._code() for k in self.kids)))

    def nodes(self) -> Iterator["Node"]:
        yield self
        for k in self.kids:
            yield from k.nodes()

    def replace(self, old: "Node", new: "Node") -> "Node":
        if self is old:
            return new
        return dataclasses.replace(self, kids=tuple(k.replace(old, new) for k in self.kids))


def leaf(fn: Callable[..., Any], level: str = "row", pos: bool = False) -> Node:
    return Node(fn, (), level, pos)


# leaves by level; (formula, positive)
_ROW_LEAVES = [(lambda S: S.lse, False), (lambda S: S.target_logit, False), (lambda S: S.target_logit - S.lse, False),
               (lambda S: S.lse_at(2), False), (lambda S: S.lse_at(0.5), False), (lambda S: S.token('a'), False),
               (lambda S: S.param('c'), False), (lambda S: 0.5, True), (lambda S: 2, True),
               (lambda S: S.lse - S.target_logit + 0.5, True),
               (lambda S: S.exp(S.target_logit - S.lse), True), (lambda S: 1 + S.token('a')**2, True),
               (lambda S: S.row_max, False), (lambda S: S.row_max - S.target_logit, False),
               (lambda S: S.exp(S.row_max - S.lse), True),
               # temperatures known at run time: a tensor parameter, a per-row one (> 0 either way)
               (lambda S: S.lse_at(S.param('T')), False), (lambda S: S.lse_at(1 + S.token('a')**2), False),
               # 1 - p_y, 0 where p_y rounds to 1 (poly-1), and the focal loss's power of it
               (lambda S: 1 - S.exp(S.target_logit - S.lse), False),
               (lambda S: (1 - S.exp(S.target_logit - S.lse))**S.param('g') * (S.lse - S.target_logit), False)]
_TEACHER_ROW_LEAVES = [(lambda S: S.teacher_lse, False), (lambda S: S.teacher_lse_at(2), False),
                       (lambda S: S.teacher_lse_at(S.param('T')), False)]
_ELEM_LEAVES = [(lambda S: S.logit, False), (lambda S: S.logsoftmax, False), (lambda S: S.softmax, True),
                (lambda S: S.logsoftmax_at(2), False), (lambda S: S.token('a'), False),
                (lambda S: S.param('c'), False), (lambda S: S.lse, False), (lambda S: 0.5, True),
                (lambda S: S.vector('u'), True)]
_TEACHER_ELEM_LEAVES = [(lambda S: S.teacher_logit, False), (lambda S: S.teacher_logprob, False),
                        (lambda S: S.teacher_prob, True), (lambda S: S.teacher_prob_at(2), True)]
# the weights of an online vocabulary sum: exp(alpha z + beta t) up to a row factor
_WEIGHTS = [lambda S: S.softmax, lambda S: S.softmax_at(2), lambda S: S.softmax_at(0.5),
            lambda S: S.exp(S.logit - S.lse_at(1)), lambda S: S.exp(S.param('k') * S.logit - S.lse),
            lambda S: S.exp(S.logit - S.row_max), lambda S: S.vector('u') * S.softmax,
            lambda S: S.softmax_at(S.param('T')), lambda S: S.softmax_at(1 + S.token('a')**2),
            lambda S: S.exp(S.logit / S.param('T'))]
_TEACHER_WEIGHTS = [lambda S: S.teacher_prob, lambda S: S.teacher_prob_at(2),
                    lambda S: S.exp(S.logit / 2 + S.teacher_logit / 2 - S.lse), lambda S: S.teacher_prob_at(S.param('T'))]
_TOPK_LEAVES = [(lambda S: S.topk_logit, False), (lambda S: S.topk_logprob, False),
                (lambda S: S.topk_logit - S.lse, False), (lambda S: S.exp(S.topk_logprob), True),
                (lambda S: S.exp(S.topk_logit - S.lse), True), (lambda S: S.token('a'), False)]
_TOPK_TERMS = [lambda S: S.exp(S.topk_logprob) * (S.topk_logprob - (S.topk_logit - S.lse)),
               lambda S: S.log(1 - S.exp(S.topk_logit - S.lse)),                      # token-level unlikelihood
               lambda S: S.exp(S.topk_logit - S.lse)]
# a sum of the first read, read inside another sum (its summand, or a row factor of it): online sums
_INNER_SUMS = [lambda S: S.vsum(S.softmax * S.logit), lambda S: S.vsum(S.logit**2) / 64,
               lambda S: S.vsum(S.softmax**2), lambda S: S.vsum(S.vector('u') * S.softmax)]
# outer summands around a random element e and an inner sum s
_NESTED = [lambda S, e, s: S.softmax * e * s, lambda S, e, s: S.softmax * S.Abs(S.logit - s),
           lambda S, e, s: S.softmax * S.tanh(S.logit * s) * e, lambda S, e, s: S.exp(S.logit - S.row_max) * (S.logit - s)**2]


def _logit_norm(S):
    """LogitNorm (docs/adding-a-loss.md): an exponent scaled by a row value, relative to the row's maximum."""
    scale = S.param('tau') * (S.sqrt(S.vsum(S.logit**2)) + 1e-7)
    return S.log(S.vsum(S.exp((S.logit - S.row_max) / scale))) + (S.row_max - S.target_logit) / scale


_SEGMENT_TERMS = [lambda S: -S.Min(S.exp(S.segment_mean(S.target_logit - S.lse - S.token('old_logprobs')))
                                   * S.segment_mean(S.token('a')), 1.2 * S.segment_mean(S.token('a'))),
                  lambda S: S.segment_mean(S.lse - S.target_logit) ** 2,
                  lambda S: S.exp(S.segment_mean(S.target_logit - S.lse)) * S.segment_mean(S.lse),
                  lambda S: -S.segment_sum(S.token('a') * (S.target_logit - S.lse)) / 8,
                  lambda S: S.segment_sum(S.lse - S.target_logit) / S.segment_count,
                  lambda S: S.segment_mean(S.token('a')) * S.segment_count,
                  # order statistics over the segments (DPO's aot: sorted log-ratios against sorted ones)
                  lambda S: -S.log(1 + S.exp(S.segment_sorted(S.token('old_logprobs'))
                                             - S.segment_sorted(S.target_logit - S.lse)))]
# segment terms around a random row formula r: sums and means of it
_SEGMENT_OF_ROW = [lambda S, r: S.segment_sum(r) / 4, lambda S, r: S.segment_mean(r)**2,
                   lambda S, r: S.segment_count * S.tanh(S.segment_mean(r)),
                   lambda S, r: S.tanh(S.segment_sorted(r) / 8) * S.segment_mean(S.token('a'))]
# row terms that read their segment's statistics (GSPO-token-like) around a random row formula r
_ROW_OF_SEGMENT = [lambda S, r: r * S.stop_gradient(S.exp(S.segment_mean(S.target_logit - S.lse - S.token('old_logprobs'))))
                   / S.segment_count,
                   lambda S, r: r / S.segment_mean(1 + S.token('a')**2),
                   lambda S, r: r * (S.segment_sum(S.lse - S.target_logit) / S.segment_count - S.target_logit),
                   # batch quantiles (TRL's top_entropy_quantile): a mask of the rows, and a value
                   lambda S, r: r * S.Piecewise((1, S.token('a') >= S.row_quantile(S.token('a'), 0.7)), (0, True)),
                   lambda S, r: r * S.row_quantile(S.lse - S.target_logit, 0.5)]


class Generator:
    """Random well-typed formulas (``row``, ``elem``, ...), from one ``random.Random``."""

    def __init__(self, rng: random.Random, *, teacher: bool = True, topk: bool = True,
                 segments: bool = True) -> None:
        self.rng, self.teacher, self.topk, self.segments = rng, teacher, topk, segments

    def pick(self, options: list):
        return options[self.rng.randrange(len(options))]

    # -- elements (inside vsum) ------------------------------------------------------------------
    def elem(self, depth: int, pos: bool = False) -> Node:
        leaves = _ELEM_LEAVES + (_TEACHER_ELEM_LEAVES if self.teacher else [])
        if pos:
            leaves = [l for l in leaves if l[1]]
        if depth <= 0 or self.rng.random() < 0.35:
            return leaf(self.pick(leaves)[0], level="elem", pos=pos)
        if pos:
            return self.pick([
                lambda: Node(lambda S, a, b: a + b, (self.elem(depth - 1, True), self.elem(depth - 1, True)), "elem", True),
                lambda: Node(lambda S, a: S.exp(S.tanh(a)), (self.elem(depth - 1),), "elem", True),
                lambda: Node(lambda S, a: 1 + a**2, (self.elem(depth - 1),), "elem", True),
                lambda: Node(lambda S, a: 1 + S.Abs(a), (self.elem(depth - 1),), "elem", True),
            ])()
        a = lambda: self.elem(depth - 1)
        return self.pick([
            lambda: Node(lambda S, x, y: x + y, (a(), a()), "elem"),
            lambda: Node(lambda S, x, y: x - y, (a(), a()), "elem"),
            lambda: Node(lambda S, x, y: x * y, (a(), a()), "elem"),
            lambda: Node(lambda S, x: S.log(x), (self.elem(depth - 1, True),), "elem"),
            lambda: Node(lambda S, x: S.Abs(x), (a(),), "elem"),
            lambda: Node(lambda S, x, y: S.Max(x, y), (a(), a()), "elem"),
            lambda: Node(lambda S, x, y: S.Min(x, y), (a(), a()), "elem"),
            lambda: Node(lambda S, x: S.tanh(x), (a(),), "elem"),
            lambda: Node(lambda S, x: S.clamp(x, -1, 1), (a(),), "elem"),
            lambda: Node(lambda S, x, c, y: S.Piecewise((x, c > 0), (y, True)), (a(), a(), a()), "elem"),
            lambda: Node(lambda S, x: S.stop_gradient(x), (a(),), "elem"),
            lambda: Node(lambda S, x: x**2, (a(),), "elem"),
        ])()

    def vsum(self, depth: int) -> Node:
        """A vocabulary sum: an online one (a weight exp(alpha z + beta t) times h), a sum with no
        weight, or an exact one (a log of the mixture, as JSD's)."""
        weights = _WEIGHTS + (_TEACHER_WEIGHTS if self.teacher else [])
        kind = self.rng.random()
        if kind < 0.1:   # a sum of the first read inside this one's summand
            inner = leaf(self.pick(_INNER_SUMS))
            body = Node(self.pick(_NESTED), (self.elem(depth - 1), inner), "elem")
        elif kind < 0.6:
            body = Node(lambda S, w, h: w * h, (leaf(self.pick(weights), "elem", True), self.elem(depth)), "elem")
        elif kind < 0.75:
            body = self.elem(depth)
        elif self.teacher:
            body = Node(lambda S, x: S.softmax * S.log(S.softmax / 2 + S.teacher_prob / 2 + x),
                        (leaf(self.pick([lambda S: 0, lambda S: S.softmax**2, lambda S: S.teacher_prob / 4]), "elem"),),
                        "elem")
        else:
            body = Node(lambda S, x: S.log(1 + S.softmax * x), (self.elem(depth, True),), "elem")
        return Node(lambda S, x: S.vsum(x), (body,), "row")

    def topk_sum(self, depth: int) -> Node:
        if self.rng.random() < 0.5:
            return Node(lambda S, x: S.topk_sum(x), (leaf(self.pick(_TOPK_TERMS), "topk"),), "row")
        w = leaf(self.pick([lambda S: S.exp(S.topk_logprob), lambda S: S.exp(S.topk_logit - S.lse), lambda S: 1]),
                 "topk", True)
        h = leaf(self.pick(_TOPK_LEAVES)[0], "topk")
        if depth > 0 and self.rng.random() < 0.5:
            h = Node(self.pick([lambda S, x: S.Abs(x), lambda S, x: S.tanh(x), lambda S, x: x**2,
                                lambda S, x: S.Max(x, -1)]), (h,), "topk")
        return Node(lambda S, w, h: S.topk_sum(w * h), (w, h), "row")

    # -- rows --------------------------------------------------------------------------------------
    def row(self, depth: int, pos: bool = False) -> Node:
        leaves = _ROW_LEAVES + (_TEACHER_ROW_LEAVES if self.teacher else [])
        if pos:
            leaves = [l for l in leaves if l[1]]
        if depth <= 0 or self.rng.random() < 0.25:
            if not pos and self.rng.random() < 0.5:
                return self.topk_sum(depth) if self.topk and self.rng.random() < 0.25 else self.vsum(1)
            return leaf(self.pick(leaves)[0], pos=pos)
        if pos:
            return self.pick([
                lambda: Node(lambda S, x, y: x + y, (self.row(depth - 1, True), self.row(depth - 1, True)), pos=True),
                lambda: Node(lambda S, x, y: x * y, (self.row(depth - 1, True), self.row(depth - 1, True)), pos=True),
                lambda: Node(lambda S, x: S.exp(S.tanh(x)), (self.row(depth - 1),), pos=True),
                lambda: Node(lambda S, x: 1 + x**2, (self.row(depth - 1),), pos=True),
                lambda: Node(lambda S: S.vsum(S.softmax**2), (), pos=True),
                lambda: Node(lambda S, x: S.sqrt(x), (self.row(depth - 1, True),), pos=True),
            ])()
        a = lambda: self.row(depth - 1)
        return self.pick([
            lambda: Node(lambda S, x, y: x + y, (a(), a())),
            lambda: Node(lambda S, x, y: x - y, (a(), a())),
            lambda: Node(lambda S, x, y: x * y, (a(), a())),
            lambda: Node(lambda S, x, y: x / y, (a(), self.row(depth - 1, True))),
            lambda: Node(lambda S, x: S.log(x), (self.row(depth - 1, True),)),
            lambda: Node(lambda S, x: S.exp(S.tanh(x)), (a(),)),
            lambda: Node(lambda S, x: S.Abs(x), (a(),)),
            lambda: Node(lambda S, x, y: S.Max(x, y), (a(), a())),
            lambda: Node(lambda S, x, y: S.Min(x, y), (a(), a())),
            lambda: Node(lambda S, x: S.clamp(x, -1, 2), (a(),)),
            lambda: Node(lambda S, x, c, y: S.Piecewise((x, c > 0), (y, True)), (a(), a(), a())),
            lambda: Node(lambda S, x: S.stop_gradient(x), (a(),)),
            lambda: Node(lambda S, x: S.tanh(x), (a(),)),
            lambda: Node(lambda S, x: x**2, (a(),)),
            lambda: Node(lambda S, x: x**S.param('g'), (self.row(depth - 1, True),)),
            lambda: self.vsum(depth - 1),
            lambda: self.topk_sum(depth - 1) if self.topk else self.vsum(depth - 1),
        ])()
