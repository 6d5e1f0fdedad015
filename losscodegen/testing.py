"""Parity tests for your own heads: ``assert_parity(head)`` and the float64 ``reference(head)``.

The reference evaluates the head's declared formulas directly in float64 torch: each formula is
printed by the torch printer, with ``lse_at(T)`` as a logsumexp, ``vsum`` a sum over the
vocabulary, ``topk_sum`` a gather and a sum, ``segment_mean`` a mean over a segment's valid rows
(``segment_sorted``: their sums, torch.sort's; ``row_quantile``: torch.quantile over the valid rows);
the terms are reduced as the head's contract says (divisor, weights, metrics), and the gradient is
taken by ``torch.autograd``. Nothing of the compiler takes part (no lowering, planning, emitted
code or sympy derivative), so it checks all of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy as sp
import torch

from . import symbols as S
from .emit import TorchPrinter
from .head import HeadLoss
from .inputs import STANDARD_INPUTS

__all__ = ["reference", "assert_parity", "random_inputs", "TOLERANCES"]

# (values: relative and absolute; gradient: error over the largest |gradient|) per logits dtype.
# A bf16 gradient is stored in bf16 (2**-8 relative), values are accumulated in fp32 either way.
TOLERANCES = {torch.float32: (1e-4, 1e-5, 2e-4), torch.bfloat16: (2e-3, 2e-3, 1e-2),
              torch.float16: (2e-3, 2e-3, 5e-3)}


_Z_ROW, _T_ROW = sp.Symbol("z_row", real=True), sp.Symbol("t_row", real=True)


class _Printer(TorchPrinter):
    """Formulas over whole rows: element symbols are [rows, V] (or [rows, K]) tensors, row
    symbols [rows, 1], reductions keep the row dimension. Each construct is the torch op a user
    would write (``Min``/``Max`` as torch.minimum/maximum, or amin/amax of more than two, ``clamp``
    as torch.clamp, ``Abs`` as torch.abs, ``Piecewise`` as torch.where, ``stop_gradient`` as
    ``.detach()``), so that autograd's derivative at a kink is torch's own."""

    def _tensor(self, expr: sp.Expr) -> str:
        return f"z.new_tensor({self._print(expr)})" if expr.is_number else self._print(expr)

    def _extremum(self, fn: str, args) -> str:
        # torch.maximum/minimum of two; amax/amin of the stacked arguments for more (equal split of a tie)
        printed = ", ".join(self._tensor(a) for a in args)
        if len(args) == 2:
            return f"torch.{fn}imum({printed})"
        return f"torch.stack(torch.broadcast_tensors({printed})).a{fn}(0)"

    def _print_Min(self, expr) -> str:
        return self._extremum("min", expr.args)

    def _print_Max(self, expr) -> str:
        return self._extremum("max", expr.args)

    def _print_clamp(self, expr) -> str:
        return "torch.clamp(" + ", ".join(self._tensor(a) for a in expr.args) + ")"

    def _print_stop_gradient(self, expr) -> str:
        return f"({self._print(expr.args[0])}).detach()"

    def _print_LSE(self, expr) -> str:
        # over the whole rows (z_row, t_row), also inside a vsum (whose summand takes z, t)
        alpha, beta = expr.args
        return f"torch.logsumexp({self._print(alpha * _Z_ROW + beta * _T_ROW)}, -1, keepdim=True)"

    def _print_vsum(self, expr) -> str:
        return f"_sum(lambda z, t: ({self._print(expr.args[0])}) + torch.zeros_like(z), z, t)"

    def _print_topk_sum(self, expr) -> str:
        return f"_sum(lambda z_k, l_k: ({self._print(expr.args[0])}) + torch.zeros_like(z_k), z_k, l_k)"


_PRINT = _Printer()


def _sum(summand, a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The sum over the last dim of ``summand(a, b)`` with the ``0 * log 0 = 0`` convention: a
    summand that is NaN where ``a`` or ``b`` is -inf counts as 0. (It is evaluated again with those
    elements set to 0, so that autograd's gradient there is 0, not 0 * NaN.)"""
    dead = a == float("-inf")
    if b is not None:
        dead = dead | (b == float("-inf"))
    with torch.no_grad():
        zero = dead & summand(a, b).isnan()
    if not zero.any():
        return summand(a, b).sum(-1, keepdim=True)
    a, b = a.masked_fill(zero, 0.0), (None if b is None else b.masked_fill(zero, 0.0))
    return summand(a, b).masked_fill(zero, 0.0).sum(-1, keepdim=True)


def _evaluate(expr: sp.Expr, namespace: dict[str, Any]) -> torch.Tensor:
    # one dict: the summands of _sum are lambdas, which see globals only
    return eval(_PRINT.doprint(expr), {"torch": torch, "_sum": _sum, **namespace})


@dataclass
class Reference:
    """``ref(logits, labels, **inputs) -> (loss, {name: value}, dL/dlogits)``, all float64."""

    head: HeadLoss

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor | None = None, **inputs: Any):
        x, out, values, _ = self.evaluate(logits, labels, **inputs)
        if out.requires_grad:
            (out.sum() if inputs.get("reduction") == "none" else out).backward()
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        return out.detach(), values, grad.reshape(logits.shape)

    def evaluate(self, logits: torch.Tensor, labels: torch.Tensor | None = None, *,
                 precision: torch.dtype = torch.float64, **inputs: Any):
        """``(x, out, values, rows)`` before any backward: ``x`` the float64 leaf the logits became
        (``[rows, V]``), ``out`` the loss (per row under reduction="none") and ``rows`` each
        non-segment output's per-row values (0 on invalid rows), both in the graph of ``x``, so
        that a caller can take gradients of its own (upstream gradients on ``out.rows``).
        ``precision``: the dtype the logits (and teacher logits) are evaluated in; float32 gives
        what plain torch computes in fp32 for the same formula (the fuzzer's yardstick of a
        formula's own rounding)."""
        head = self.head
        V = logits.shape[-1]
        shape = logits.shape[:-1]
        x = logits.detach().to(precision).reshape(-1, V).requires_grad_()
        z = x if head.softcap is None else head.softcap * torch.tanh(x / head.softcap)
        z = z * head.logit_scale
        R = z.shape[0]
        y = labels.reshape(-1) if labels is not None else torch.zeros(R, dtype=torch.long, device=z.device)
        valid = torch.ones(R, dtype=torch.bool, device=z.device)
        if labels is not None:
            valid &= y != head.ignore_index
        if inputs.get("loss_mask") is not None:
            valid &= inputs["loss_mask"].reshape(-1)
        # an ignored row's target: its argmax, a finite logit (a -inf one would make 0 * inf in the backward)
        yc = torch.where(valid, y.clamp(0, V - 1), z.detach().argmax(-1))[:, None]
        ns = {"z": z, "z_y": z.gather(1, yc), "label": y[:, None].double(), "vocab_size": z.new_tensor(float(V)),
              "argmax": z.argmax(-1, keepdim=True).double(), "t": None,
              S.row_max.name: z.gather(1, z.detach().argmax(-1, keepdim=True))}
        # a row whose logits (or teacher logits) are all -inf has no distribution: its values are NaN
        no_dist = (z == float("-inf")).all(-1)
        if inputs.get("teacher_logits") is not None:
            ns["t"] = inputs["teacher_logits"].detach().to(precision).reshape(R, V)
            no_dist = no_dist | (ns["t"] == float("-inf")).all(-1)
        elif any(f.has(S.teacher_logit) for _, f, _ in head._bound):
            # teacher logits a formula names but its kernel does not read (vsum(teacher_prob_at(T))
            # is 1): values of their own, as for a token or a vector below; the head takes none
            ns["t"] = torch.linspace(-1.0, 1.0, V, dtype=precision, device=z.device).expand(R, V)
        ns["z_row"], ns["t_row"] = z, ns["t"]
        if inputs.get("teacher_topk_ids") is not None:
            ids = inputs["teacher_topk_ids"].reshape(R, -1)
            ns["z_k"] = z.gather(1, ids)
            ns["l_k"] = inputs["teacher_topk_logprobs"].to(precision).reshape(R, -1)
        # a token or a vector that a formula names but its kernel does not read (the formula's value
        # does not depend on it: Min(1 + a**2, vsum(softmax)) is 1, vsum(u - stop_gradient(u)) is 0)
        # takes values of its own: the head accepts no such input
        for sym in set().union(*(f.free_symbols for _, f, _ in head._bound)):
            if sym.name.startswith(S.TOKEN_PREFIX):
                ns[sym.name] = torch.linspace(-1.5, 1.5, R, dtype=torch.float64, device=z.device)[:, None]
            elif sym.name.startswith(S.VECTOR_PREFIX):
                ns[sym.name] = torch.linspace(0.5, 1.5, V, dtype=torch.float64, device=z.device)[None, :]
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor) and name in head.kernel.SPEC.vectors:   # [V], along each row
                ns[S.VECTOR_PREFIX + name] = value.double().reshape(1, V)
            elif isinstance(value, torch.Tensor) and name not in STANDARD_INPUTS:
                ns[S.TOKEN_PREFIX + name] = value.double().reshape(R, 1)
        for name, value in head.scalars.items():     # weights and runtime parameters, as they are now
            ns[name] = torch.tensor(float(value), dtype=torch.float64, device=z.device)
        # a term with class weights: each row's value times class_weight[label] (its formula as the
        # head binds it reads them as S.class_weight(term)); its mean divides by their valid sum
        class_weights = {}
        for t in head.loss_terms:
            if t.class_weight is not None:
                w = getattr(head, f"class_weight_{t.name}").detach().double().to(z.device)
                rows_w = torch.where(valid, w[y.clamp(0, V - 1)], 0.0)
                ns[S.class_weight(t.name).name] = rows_w[:, None]
                class_weights[t.name] = float(rows_w.sum()) or 1.0   # (a sum of 0: every row is 0)
        divisor, reduction = inputs.get("divisor"), inputs.get("reduction", "mean")
        n_valid = float(valid.sum().clamp_min(1))
        normalize = {t.name: t.normalize for t in head.loss_terms}
        values, rows, per_row_loss, loss = {}, {}, z.new_zeros(R), z.new_zeros(())
        for name, formula, is_metric in head._bound:
            weight = 0.0 if is_metric else ns[f"weight_{name}"]
            if formula.has(S.segment_mean) and _reads_rows(formula):
                # a row term of segment statistics: each row's formula with its segment's means
                seg = inputs.get("segment_ids")    # (none for batch quantiles alone: one segment)
                seg = torch.zeros(R, dtype=torch.long) if seg is None else seg.reshape(-1)
                per_row = _evaluate(_row_means(formula, ns, valid, seg), ns)
                per_row = torch.where(valid, torch.as_tensor(per_row, dtype=torch.float64).expand(R, 1)[:, 0], 0.0)
                div = 1.0 if reduction == "sum" else float(divisor) if divisor is not None else n_valid
                value = per_row.sum() / div
            elif formula.has(S.segment_mean):
                value = _segment_term(formula, ns, valid, inputs["segment_ids"].reshape(-1), divisor, reduction,
                                      inputs.get("num_segments") if normalize[name] == "sequence" else False)
            else:
                per_row = torch.as_tensor(_evaluate(formula, ns), dtype=torch.float64).expand(R, 1)[:, 0]
                per_row = torch.where(valid, per_row.masked_fill(no_dist, float("nan")), 0.0)
                # metrics: means over the valid rows; terms by their normalize= and the call's divisor
                div = n_valid if is_metric else 1.0 if normalize[name] == "sum" or reduction == "sum" \
                    else float(divisor) if divisor is not None else class_weights.get(name, n_valid)
                value = per_row.sum() / div
                per_row_loss = per_row_loss + weight * per_row
                rows[name] = per_row.reshape(shape)
            values[name] = value.detach()
            loss = loss + weight * value
        return x, per_row_loss.reshape(shape) if reduction == "none" else loss, values, rows


def _reads_rows(formula: sp.Expr) -> bool:
    """Whether a formula of segment means reads row quantities outside them (GSPO-token)."""
    outside = formula.replace(lambda e: isinstance(e, S.segment_mean), lambda e: sp.Dummy(real=True))
    return bool(outside.atoms(S.LSE, S.vsum, S.topk_sum)) or any(
        not s.name.startswith(S.RUNTIME_PREFIX) and s not in S.SEGMENT_SYMBOLS and not isinstance(s, sp.Dummy)
        for s in outside.free_symbols)


def _row_means(formula, ns, valid, seg) -> sp.Expr:
    """``formula`` with each segment_mean a per-row symbol bound in ``ns`` to the mean over the
    row's segment's valid rows (and ``segment_count`` to that segment's valid rows)."""
    ids = sorted(set(seg[valid].tolist()))
    sel = {s: (seg == s) & valid for s in ids}
    count = sum(torch.where(seg == s, float(sel[s].sum()), 0.0) for s in ids) if ids else torch.zeros(seg.shape[0])
    ns[S.segment_count.name] = torch.as_tensor(count, dtype=torch.float64, device=seg.device)[:, None]
    means = {}
    for k, mean in enumerate(formula.atoms(S.segment_mean)):
        u = torch.as_tensor(_evaluate(mean.args[0], ns), dtype=torch.float64).expand(seg.shape[0], 1)[:, 0]
        if isinstance(mean, S.row_quantile):   # the batch's, detached (torch.quantile, TRL's mask)
            per_row = (torch.quantile(u[valid].detach(), float(mean.args[1])) if valid.any() else u.new_zeros(())) \
                .expand(seg.shape[0])
        else:
            per_row = sum((torch.where(seg == s, u[sel[s]].mean(), 0.0) for s in ids), u.new_zeros(seg.shape[0]))
        means[mean] = sp.Symbol(f"segment_mean_{k}", real=True)
        ns[means[mean].name] = per_row[:, None]
    return formula.xreplace(means)


def _segment_term(formula, ns, valid, seg, divisor, reduction, sequence) -> torch.Tensor:
    """A term of segment means: each mean over its segment's valid rows, the formula per non-empty
    segment, summed and divided (by the non-empty segments by default). ``sequence`` (not False: a
    term with normalize="sequence", given ``num_segments`` or None): divided by every segment, the
    empty ones too (``num_segments``, else the largest valid segment id + 1), whatever the divisor."""
    ids = sorted(set(seg[valid].tolist()))
    ns[S.segment_count.name] = torch.tensor([float(((seg == s) & valid).sum()) for s in ids],
                                            dtype=torch.float64, device=seg.device)
    means = {}
    for k, mean in enumerate(formula.atoms(S.segment_mean)):
        u = torch.as_tensor(_evaluate(mean.args[0], ns), dtype=torch.float64).expand(seg.shape[0], 1)[:, 0]
        per_seg = torch.stack([u[(seg == s) & valid].mean() for s in ids]) if ids else u.new_zeros(0)
        if isinstance(mean, S.segment_sorted):   # the segments' sums, the k-th smallest at the k-th segment
            per_seg = torch.sort(per_seg * ns[S.segment_count.name], stable=True).values
        means[mean] = sp.Symbol(f"segment_mean_{k}", real=True)
        ns[means[mean].name] = per_seg
    total = torch.as_tensor(_evaluate(formula.xreplace(means), ns), dtype=torch.float64).sum()
    if sequence is not False:
        n_seg = sequence if sequence is not None else (max(ids) + 1 if ids else 0)
        return total / (1.0 if reduction == "sum" else max(n_seg, 1))
    div = float(divisor) if divisor is not None else 1.0 if reduction == "sum" else max(len(ids), 1)
    return total / div


def reference(head: HeadLoss) -> Reference:
    """The head's declared formulas in float64 torch, for parity tests (see the module's doc)."""
    return Reference(head)


def random_inputs(head: HeadLoss, rows: int = 24, vocab: int = 500, dtype: torch.dtype = torch.float32,
                  device: Any = "cpu", seed: int = 0, **given: Any) -> tuple[torch.Tensor, Any, dict]:
    """``(logits, labels, inputs)`` for everything the head reads: ignored rows, a loss_mask,
    teacher logits, per-row tokens (a ``*logprobs`` token near the logits' own log-probability),
    top-k ids and log-probs, segments. ``given`` inputs are used as they are."""
    spec = head.kernel.SPEC
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)
    logits = (randn(rows, vocab) * 2).to(dtype)
    labels = given.pop("labels", None)
    if labels is None and spec.uses_labels:
        labels = torch.randint(0, vocab, (rows,), generator=g, device=device)
        labels[torch.rand(rows, generator=g, device=device) < 0.15] = head.ignore_index
    inputs = {"loss_mask": torch.rand(rows, generator=g, device=device) > 0.1}
    if spec.uses_teacher:
        inputs["teacher_logits"] = (randn(rows, vocab) * 2 + 0.5 * logits.float()).to(dtype)
    if spec.uses_topk:
        K = min(8, vocab)
        inputs["teacher_topk_ids"] = torch.rand(rows, vocab, generator=g, device=device).argsort(-1)[:, :K]
        inputs["teacher_topk_logprobs"] = torch.log_softmax(randn(rows, K + 2), -1)[:, :K]
    target = (labels if labels is not None else torch.zeros(rows, dtype=torch.long, device=device))
    logp = torch.log_softmax(logits.double(), -1).gather(1, target.clamp(0, vocab - 1)[:, None])[:, 0]
    for name in spec.tokens:
        if name in head.class_weight_tokens:    # (the head's own: its class weights at the labels)
            continue
        noise = randn(rows, dtype=torch.float64)
        inputs[name] = (logp + 0.2 * noise if name.endswith("logprobs") else noise).float()
    for name in spec.vectors:
        inputs[name] = torch.rand(vocab, generator=g, device=device) + 0.5
    if spec.segments:
        n_seg = max(rows // 6, 1)
        inputs["segment_ids"] = torch.sort(torch.randint(0, n_seg, (rows,), generator=g, device=device)).values
        inputs["num_segments"] = n_seg
    inputs.update(given)
    return logits, labels, inputs


def _worst(got: torch.Tensor, want: torch.Tensor) -> tuple[float, tuple[int, ...], float, float]:
    """(largest |got - want|, where, got there, want there); NaN counts as the worst."""
    got, want = got.detach().double().cpu().reshape(want.shape), want.double().cpu()
    err = (got - want).abs().nan_to_num(float("inf"))
    if err.dim() == 0:
        return float(err), (), float(got), float(want)
    at = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    return float(err[at]), at, float(got[at]), float(want[at])


def assert_parity(head: HeadLoss, rows: int = 24, vocab: int = 500,
                  dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), device: Any = None,
                  seed: int = 0, **inputs: Any) -> None:
    """Run ``head`` on random inputs (``inputs`` given are used as they are) in each dtype, on the
    GPU when there is one, and compare its loss, terms, metrics and gradient with ``reference(head)``.
    Raises ``AssertionError`` naming the term (or the gradient), the worst element and the tolerance."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    ref = reference(head)
    for dtype in dtypes:
        logits, labels, kw = random_inputs(head, rows, vocab, dtype, device, seed, **inputs)
        x = logits.clone().requires_grad_()
        out = head(x, labels, **kw)
        if head.loss_terms:
            out.loss.sum().backward()
        ref_kw = {name: (v.cpu() if isinstance(v, torch.Tensor) else v) for name, v in kw.items()}
        want_loss, want, want_grad = ref(logits.cpu(), None if labels is None else labels.cpu(), **ref_kw)
        where = f"({dtype}, {rows} x {vocab}, seed {seed})"
        for name, got, expected in [("loss", out.loss, want_loss)] + [
                (n, v, want[n]) for n, v in {**out.terms, **out.metrics}.items()]:
            compare(name, got, expected, dtype, where=where)
        if head.loss_terms:
            compare("gradient", x.grad, want_grad, dtype, where=where)


def compare(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, *,
            tolerances: tuple[float, float, float] | None = None, where: str = "") -> None:
    """The one comparison of a head's output with a float64 reference (``assert_parity`` and the
    project's own tests): a value within ``atol + rtol * max|want|``, the gradient (``name ==
    "gradient"``) within ``grad_tol * max|want|``, ``TOLERANCES[dtype]`` unless given. Raises
    ``AssertionError`` naming the output, the worst element and the bound."""
    rtol, atol, grad_tol = tolerances or TOLERANCES[dtype]
    err, at, got_at, want_at = _worst(got, want)
    scale = float(want.abs().max()) if want.numel() else 0.0
    bound = grad_tol * scale + 1e-9 if name == "gradient" else atol + rtol * scale
    if not err <= bound:
        raise AssertionError(f"{name} {where}{' at ' + str(at) if at else ''}: {got_at:.6g} against the "
                             f"float64 reference {want_at:.6g}, error {err:.3g} > {bound:.3g}")
