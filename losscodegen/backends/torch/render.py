"""The torch backend's renderer: a plan printed as torch code (emit's ``TorchPrinter``, the float64
reference's printer: the same ops, here on fp32 tensors), laid out by the Jinja2 template
``templates/head_loss_torch.py.j2``.

The kernel file it writes is a plain Python module of torch ops with the interface of
``interface.signatures`` (the arguments the runtime binds by name) and the constants the runtime reads,
as the Triton backend's file has them. Every decision is made here; the template places the
printed statements into the loops over a chunk of rows and a block of the vocabulary.
"""
from __future__ import annotations

from typing import Mapping

import jinja2
import sympy as sp

from ... import symbols as S
from ... import program
from ...emit import KernelSource, TorchPrinter, cse_statements, phases, wrap
from ...interface import check_interface, kernel_spec, seal, weight_name
from ...lower import IS_ARGMAX, IS_Y, TM, ZM
from ...plan import Merge, Plan
from ...program import Dialect, MergeStep, OnlineGroup
from ...resources import TEMPLATES

TEMPLATE = "head_loss_torch.py.j2"
_PRINT = TorchPrinter()


def _statements(exprs: list[sp.Expr], prefix: str) -> tuple[list[str], list[str]]:
    """emit's ``Statements`` printed as torch code."""
    return cse_statements(_PRINT, exprs, prefix)


# what varies along the vocabulary in the reads (the elements, and the elements relative to the maxima)
_VOCAB = (*S.ELEMENT_SYMBOLS, ZM, TM)


def _per_element(expr: sp.Expr, printed: str) -> str:
    """``printed`` (of ``expr``) as a [rows, block] tensor: a summand free of the elements (a row
    value, a number) is broadcast to the block, whose sum it is then summed over."""
    return printed if expr.has(*_VOCAB, IS_Y, IS_ARGMAX, *S.vectors_in(expr)) else f"({printed}) * torch.ones_like(z)"


class TorchDialect(Dialect):
    """The phase program in torch: a chunk's rows at once, each value a [rows, 1] or [rows, block]
    tensor; the shards' stats a [world, rows, columns] tensor (``part``), merged over its first dim."""

    printer = _PRINT
    rescale_name = "rescale{index}"

    def summand(self, group: OnlineGroup, body: sp.Expr) -> str:
        # (a summand free of the elements, without an exponential to broadcast it: broadcast here)
        return self.print(body) if group.exponent != 0 else _per_element(body, self.print(body))

    def row_value(self, index: int) -> str:
        return f"v[{index}]"

    def merge(self, steps: tuple[MergeStep, ...]) -> list[str]:
        lines = []
        for c in steps:
            part = f"part[:, :, {c.at}:{c.at + 1}]"
            if c.rule is Merge.MAX:
                lines += [f"{c.name}_r = {part}", f"{c.name} = {c.name}_r.amax(0)"]
            elif c.rule is Merge.SUM:
                lines.append(f"{c.name} = {part}.sum(0)")
            elif c.rule is Merge.SCALED:
                if c.moved is not None:
                    base = f"part[:, :, {c.base_at}:{c.base_at + 1}]"
                    part = f"({part} + {self.where(f'{base} > 0.0', f'({self.print(c.moved)}) * {base}', '0.0')})"
                lines.append(f"{c.name} = ({part} * {self.print(sp.exp(c.rescale))}).sum(0)")
            elif c.rule is Merge.ARGMAX:
                # strictly greater, rank by rank: the first rank that holds the maximum wins
                lines += [f"{c.name} = torch.zeros_like(m)", "best = torch.full_like(m, float(\"-inf\"))",
                          "for r in range(world):",
                          f"    {c.name} = {self.where('m_r[r] > best', f'part[r, :, {c.at}:{c.at + 1}]', c.name)}",
                          "    best = torch.maximum(best, m_r[r])"]
        return lines


_DIALECT = TorchDialect()


def render(plan: Plan, key: str, header: str, codegen: str,
           normalize: Mapping[str, str] | None = None) -> KernelSource:
    """The kernel file of a plan. ``normalize``: each loss term's normalisation ("tokens" where not
    given; a "sequence" term arrives as a segment term); metrics are means over the valid rows."""
    # the file's contract (interface.kernel_spec), and the plan's expressions printed by phase (emit.phases):
    # the same for every backend
    spec = kernel_spec(plan, key, dict(normalize or {}))
    printed = phases(plan, spec, _PRINT, _statements)
    body, common = printed.body, printed.context

    online = _DIALECT.online(program.online(plan, body))
    ctx = dict(
        common,
        header=header, key=key, codegen=codegen, spec=spec, sigs=spec.sigs, online=online,
        # (each summand a [rows, block] tensor, a row value broadcast)
        exact=[(name, _per_element(body[name], code)) for name, code in common["exact"]],
        grad_expr=_per_element(printed.grad_vocab, common["grad_expr"]),
        teacher_grad=common["teacher_grad"] and _per_element(printed.grad_teacher, common["teacher_grad"]),
        merge=_DIALECT.merge(program.merge(plan)),
        per_row_loss=_DIALECT.row_loss(program.row_loss(spec.row_loss_terms, spec.row_values), weight_name),
    )
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["tuple_lines"] = lambda names: wrap([f"{n!r}, " for n in names], "    ")
    env.filters["parameters"] = lambda sig: wrap([f"{a}, " for a in sig.names], "    ")
    text = env.get_template(TEMPLATE).render(**ctx)
    # (the row-slices kernel is the Triton backend's, for NVIDIA's asynchronous copies: none here)
    check_interface(text, {kind: sig for kind, sig in spec.sigs.items() if kind != "slices"})
    return KernelSource(f"head_loss_{key}", key, seal(text))
