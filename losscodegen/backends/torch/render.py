"""The torch backend's renderer: a plan printed as torch code (emit's ``TorchPrinter``, the float64
reference's printer: the same ops, here on fp32 tensors), laid out by the Jinja2 template
``templates/head_loss_torch.py.j2``.

The kernel file it writes is a plain Python module of torch ops with the interface of
``emit.signatures`` (the arguments the runtime binds by name) and the constants the runtime reads,
as the Triton backend's file has them. Every decision is made here; the template places the
printed statements into the loops over a chunk of rows and a block of the vocabulary.
"""
from __future__ import annotations

from typing import Mapping

import jinja2
import sympy as sp

from ... import symbols as S
from ...emit import (FLAG_SLOTS, M_REF, MT_REF, KernelSource, TorchPrinter, check_interface, kernel_spec,
                     neg_inf_handling, online_exponent, online_groups, printed_bodies, seal, stats_relative, wrap)
from ...lower import IS_ARGMAX, IS_Y, M, MT, TM, ZM, ZYM, base_of, shift
from ...plan import Plan
from ...resources import TEMPLATES

TEMPLATE = "head_loss_torch.py.j2"
X = sp.Symbol("x", real=True)
LOGIT_SCALE = sp.Symbol("logit_scale", positive=True)
SOFTCAP = sp.Symbol("softcap", positive=True)
_PRINT = TorchPrinter()


def _statements(exprs: list[sp.Expr], prefix: str) -> tuple[list[str], list[str]]:
    """Common subexpressions first (``prefix0 = ...``), then the printed results."""
    temps, reduced = sp.cse(exprs, symbols=sp.numbered_symbols(prefix, real=True), order="canonical")
    return [f"{s} = {_PRINT.doprint(e)}" for s, e in temps], [_PRINT.doprint(e) for e in reduced]


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
        if c.merge == "max":
            lines += [f"{c.name}_r = part[:, :, {at[c.name]}:{at[c.name] + 1}]", f"{c.name} = {c.name}_r.amax(0)"]
    for c in plan.columns:
        part = f"part[:, :, {at[c.name]}:{at[c.name] + 1}]"
        if c.merge == "sum":
            lines.append(f"{c.name} = {part}.sum(0)")
        elif c.merge == "scaled":
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
        elif c.merge == "argmax":
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
    transform = LOGIT_SCALE * (SOFTCAP * sp.tanh(X / SOFTCAP) if plan.softcap else X)
    body, (grad_vocab, grad_topk) = printed_bodies(lw)

    online, stats_exprs = [], []
    for i, ((alpha, beta), accs) in enumerate(online_groups(plan).items()):
        exponent = online_exponent(alpha, beta)
        stats_exprs += [exponent] + [body[a.name] for a in accs]
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
    topk_online = [(a.name, _PRINT.doprint(sp.exp(a.alpha * (S.topk_logit - M)) * body[a.name]))
                   for a in lw.accumulators if a.online and a.domain == "topk"]
    exact = [a for a in lw.accumulators if not a.online and a.domain == "vocab"]
    exact_temps, exact_bodies = _statements([body[a.name] for a in exact], "e")
    topk_exact = [a for a in lw.accumulators if not a.online and a.domain == "topk"]
    tk_temps, tk_bodies = _statements([body[a.name] for a in topk_exact], "k")
    row_temps, row_exprs = _statements([e for _, e in lw.row_values], "r")
    coef_temps, coef_exprs = _statements([e for _, e in lw.grad_coefs], "c")
    # (apart: the vocabulary's temporaries live in its loop, the top-k entries' before it)
    grad_temps, (grad_expr,) = _statements([grad_vocab], "d")
    topk_grad_temps, (topk_grad_expr,) = _statements([grad_topk], "dk")

    # the file's contract (emit.kernel_spec): what the runtime reads of it, the same for every backend
    spec = kernel_spec(plan, key, dict(normalize or {}))
    row_names, seg_means, norm = list(spec.row_values), list(spec.segment_means), spec.normalization
    segments = []
    for seg in lw.segments:
        temps, (value, *grads) = _statements([seg.formula, *seg.dformula], f"{seg.name}_u")
        segments.append(dict(name=seg.name, temps=temps, value=value, slot=lw.outputs.index(seg.name),
                             per_sequence=norm[seg.name] == "sequence",
                             # its divisor: a row term of segment statistics is divided as a row term is
                             div="div_rows" if seg.rows else "div_seq" if norm[seg.name] == "sequence" else "div",
                             grads=[(seg_means.index(U.name), g) for U, g in zip(seg.means, grads)],
                             # a row term of segment statistics: its row values, read row by row
                             rows=[(p.name, row_names.index(p.name)) for p in seg.rows],
                             valid=row_names.index(seg.valid) if seg.valid else None))
    head_exprs = ([a.body for a in lw.accumulators] + [e for _, e in lw.grad_coefs + lw.row_values]
                  + [lw.grad_vocab, lw.grad_topk])

    neg_inf = dict(stats=neg_inf_handling([body[a.name] for a in lw.accumulators
                                           if a.online and a.domain == "vocab"], _VOCAB),
                   exact=neg_inf_handling([body[a.name] for a in exact], _VOCAB),
                   grad=neg_inf_handling([grad_vocab], _VOCAB),
                   topk=neg_inf_handling([sp.exp(a.alpha * S.topk_logit) * body[a.name] for a in lw.accumulators
                                          if a.domain == "topk"] + [grad_topk], S.TOPK_SYMBOLS))
    ctx = dict(
        header=header, key=key, codegen=codegen, plan=plan, lw=lw, spec=spec, sigs=spec.sigs,
        transform=_PRINT.doprint(transform), dtransform=_PRINT.doprint(transform.diff(X)),
        online=online, topk_online=topk_online,
        stats_relative=[(e.name, _PRINT.doprint(value)) for e, value in stats_relative(stats_exprs)],
        exact=[(a.name, _per_element(body[a.name], b)) for a, b in zip(exact, exact_bodies)], exact_temps=exact_temps,
        topk_exact=list(zip([a.name for a in topk_exact], tk_bodies)), topk_temps=tk_temps,
        normalizers=[(name, _PRINT.doprint(value)) for n in lw.normalizers
                     for name, value in ((n.log_acc.name, sp.log(sp.Symbol(n.acc, real=True))),
                                         (n.symbol.name, n.alpha * M + n.beta * MT + n.log_acc))],
        row_temps=row_temps, rows=list(zip(row_names, row_exprs)),
        coef_temps=coef_temps, coefs=list(zip([s.name for s, _ in lw.grad_coefs], coef_exprs)),
        grad_temps=grad_temps, grad_expr=_per_element(grad_vocab, grad_expr), topk_grad=None if lw.grad_topk == 0 else topk_grad_expr, topk_grad_temps=topk_grad_temps,
        neg_inf=neg_inf, uses_is_y=lw.grad_vocab.has(IS_Y), uses_is_argmax=lw.grad_vocab.has(IS_ARGMAX),
        grad_teacher=lw.grad_uses_teacher,
        # the means (and the count) the gradient launch reads per row for a row term of segment
        # statistics' direct path
        grad_means=[(U.name, seg_means.index(U.name)) for seg in lw.segments if seg.rows for U in seg.means],
        merge=_merge(plan),
        grad_weights=[(n, f"weight_{n} * grad_scale" if norm[n] == "tokens" else f"weight_{n}")
                      for n in spec.row_loss_terms],
        per_row_loss=" + ".join(f"weight_{n} * v[{row_names.index(n)}]" for n in spec.row_loss_terms) or "0.0",
        finish=[(n, row_names.index(n), lw.outputs.index(n),
                 {"tokens": " * value_scale", "mean": " * count_scale", "sum": ""}[norm[n]])
                for n in lw.outputs if n not in spec.segments],
        finish_loss=" + ".join(f"weight_{n} * value_{n}" for n in spec.row_loss_terms),
        flag_slots={name: i for i, name in enumerate(FLAG_SLOTS)},
        seg_coefs=[c.name for s in lw.segments for c in s.coefs],
        segments=segments, seg_mean_rows=[row_names.index(u) for u in seg_means],
        uses_label=any(e.has(S.label) for _, e in lw.row_values),
        uses_zym=any(e.has(ZYM) for _, e in lw.row_values + lw.grad_coefs),
        uses_vocab_size=any(e.has(S.vocab_size) for e in head_exprs),
    )
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["tuple_lines"] = lambda names: wrap([f"{n!r}, " for n in names], "    ")
    env.filters["parameters"] = lambda sig: wrap([f"{a}, " for a in sig.names], "    ")
    text = env.get_template(TEMPLATE).render(**ctx)
    check_interface(text, spec.sigs)
    return KernelSource(f"head_loss_{key}", key, seal(text))
