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
from ...emit import (M_REF, MT_REF, KernelSource, TorchPrinter, cse_statements, online_exponent, online_groups, phases,
                     wrap)
from ...interface import check_interface, kernel_spec, seal, weight_name
from ...lower import IS_ARGMAX, IS_Y, M, MT, TM, ZM, base_of, shift
from ...plan import Merge, Plan
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


def _merge(plan: Plan) -> list[str]:
    """Statements merging the packed stats of the vocab shards (``part``: [world, rows, columns]),
    by each column's rule: the maxima over ranks first, then the sums, each rank's running sums
    rescaled from its maxima (``m_r``, ``m_t_r``: [world, rows, 1]) to the global ones, and the
    argmax of the first rank that holds the maximum."""
    at = {c.name: i for i, c in enumerate(plan.columns)}
    accs = {a.name: a for a in plan.lowered.accumulators}
    rank_max = {M: sp.Symbol("m_r", real=True), MT: sp.Symbol("m_t_r", real=True)}
    lines = []
    for c in plan.columns:
        if c.merge is Merge.MAX:
            lines += [f"{c.name}_r = part[:, :, {at[c.name]}:{at[c.name] + 1}]", f"{c.name} = {c.name}_r.amax(0)"]
    for c in plan.columns:
        part = f"part[:, :, {at[c.name]}:{at[c.name] + 1}]"
        if c.merge is Merge.SUM:
            lines.append(f"{c.name} = {part}.sum(0)")
        elif c.merge is Merge.SCALED:
            acc = accs.get(c.name)
            cz, ct = shift(acc) if acc is not None and acc.online else (0, 0)
            if (cz, ct) != (0, 0):
                # a sum of z - m_r, moved to the global maxima by its weights' sum
                b = at[base_of(acc, plan.lowered.accumulators).name]
                base = f"part[:, :, {b}:{b + 1}]"
                moved = _PRINT.doprint(cz * (rank_max[M] - M) + ct * (rank_max[MT] - MT))
                part = f"({part} + torch.where({base} > 0.0, ({moved}) * {base}, 0.0))"
            rescale = _PRINT.doprint(sp.exp(c.alpha * (rank_max[M] - M) + c.beta * (rank_max[MT] - MT)))
            lines.append(f"{c.name} = ({part} * {rescale}).sum(0)")
        elif c.merge is Merge.ARGMAX:
            # strictly greater, rank by rank: the first rank that holds the maximum wins
            lines += [f"{c.name} = torch.zeros_like(m)", "best = torch.full_like(m, float(\"-inf\"))",
                      "for r in range(world):",
                      f"    {c.name} = torch.where(m_r[r] > best, part[r, :, {at[c.name]}:{at[c.name] + 1}], {c.name})",
                      "    best = torch.maximum(best, m_r[r])"]
    return lines


def render(plan: Plan, key: str, header: str, codegen: str,
           normalize: Mapping[str, str] | None = None) -> KernelSource:
    """The kernel file of a plan. ``normalize``: each loss term's normalisation ("tokens" where not
    given; a "sequence" term arrives as a segment term); metrics are means over the valid rows."""
    lw = plan.lowered
    # the file's contract (interface.kernel_spec), and the plan's expressions printed by phase (emit.phases):
    # the same for every backend
    spec = kernel_spec(plan, key, dict(normalize or {}))
    printed = phases(plan, spec, _PRINT, _statements)
    body, common = printed.body, printed.context

    online = []
    for i, ((alpha, beta), accs) in enumerate(online_groups(plan).items()):
        exponent = online_exponent(alpha, beta)
        rescale = alpha * (M - M_REF) + beta * (MT - MT_REF)
        shifts = []
        for a in accs:
            cz, ct = shift(a)
            if (cz, ct) != (0, 0):
                # the running maxima grew: a sum of z - m moves by (m - m_new) times its weights' sum
                # (an empty sum by nothing: m is then -inf)
                base = base_of(a, lw.accumulators).name
                moved = _PRINT.doprint((cz * (M - M_REF) + ct * (MT - MT_REF)) * sp.Symbol(base, real=True))
                shifts.append((a.name, f"torch.where({base} > 0.0, {moved}, 0.0)"))
        online.append(dict(
            index=i, scale=None if exponent == 0 else _PRINT.doprint(sp.exp(exponent)),
            rescale=None if rescale == 0 else _PRINT.doprint(sp.exp(rescale)),
            accs=[(a.name, _PRINT.doprint(body[a.name]) if exponent != 0
                   else _per_element(body[a.name], _PRINT.doprint(body[a.name]))) for a in accs], shifts=dict(shifts)))

    row_names = list(spec.row_values)
    ctx = dict(
        common,
        header=header, key=key, codegen=codegen, spec=spec, sigs=spec.sigs, online=online,
        # (each summand a [rows, block] tensor, a row value broadcast)
        exact=[(name, _per_element(body[name], code)) for name, code in common["exact"]],
        grad_expr=_per_element(printed.grad_vocab, common["grad_expr"]),
        teacher_grad=common["teacher_grad"] and _per_element(printed.grad_teacher, common["teacher_grad"]),
        merge=_merge(plan),
        per_row_loss=" + ".join(f"{weight_name(n)} * v[{row_names.index(n)}]" for n in spec.row_loss_terms) or "0.0",
    )
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["tuple_lines"] = lambda names: wrap([f"{n!r}, " for n in names], "    ")
    env.filters["parameters"] = lambda sig: wrap([f"{a}, " for a in sig.names], "    ")
    text = env.get_template(TEMPLATE).render(**ctx)
    check_interface(text, spec.sigs)
    return KernelSource(f"head_loss_{key}", key, seal(text))
