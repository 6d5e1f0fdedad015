"""Running one case: ``check`` runs a head under a plan on random inputs of a regime and compares
every output with ``losscodegen.testing``'s float64 reference, plain torch fp32 as the yardstick;
``Ranks``, the gloo ranks of vocab-parallel plans."""
from __future__ import annotations

import dataclasses
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
import warnings
from typing import Any

import torch

import losscodegen as lcg
from .. import preference as P
from .. import symbols as S
from ..testing import TOLERANCES, compare, gradient_floor, random_inputs, reference
from .cases import Case, Plan


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # losscodegen/


def refused(e: Exception) -> bool:
    """Whether an error raised while a head is declared, built or generated is the compiler refusing
    it: a ValueError or TypeError raised by the package's declaring, lowering or planning code (a
    message naming the construct). A checks that emit.py runs on the generated file fails (a value
    read out of its scope, an interface the template does not keep), an error raised inside sympy,
    or any other exception: the compiler's own bug, a mismatch (the fuzzer's own code, calling a
    constructor, raises nothing the compiler means)."""
    if not isinstance(e, (ValueError, TypeError)):
        return False
    frames = traceback.extract_tb(e.__traceback__)
    origin = os.path.abspath(frames[-1].filename) if frames else ""
    return origin.startswith(_PACKAGE + os.sep) and not (
        origin == os.path.join(_PACKAGE, "emit.py")
        or any(origin.startswith(os.path.join(_PACKAGE, d) + os.sep) for d in ("backends", "fuzz")))


class Mismatch(AssertionError):
    """A case whose output differs from the float64 reference (or that raised where it should not)."""


class Skip(Exception):
    """A case that is not a fair test: its reference is not finite or not well conditioned."""


class Refused(Exception):
    """A plan the head is refused under, with one clear error (``refused``) on every rank alike:
    the compiler's right, counted, not a mismatch."""


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _inputs(head: lcg.HeadLoss, case: Case, device: str):
    plan = case.plan
    logits, labels, kw = random_inputs(head, case.rows, case.vocab, _dtype(plan.dtype), device, case.seed,
                                       regime=case.regime)
    # (a preference layout's inputs come from the labels: a head that reads none, as a shrunk case's
    # can be, keeps the random segments)
    if case.layout and head.kernel.SPEC.segments and labels is not None:
        kw.update(_preference_inputs(head, case.layout, labels, kw))
    if plan.reduction != "mean":
        kw["reduction"] = plan.reduction
    if plan.divisor is not None:
        kw["divisor"] = plan.divisor
    return logits, labels, kw


def _preference_inputs(head, layout: str, labels: torch.Tensor, kw: dict) -> dict:
    """The preference terms' inputs as a user gets them (``P.pair_inputs`` / ``P.sequence_inputs``),
    for TRL's layout of the rows: [2B, T] (pair b: rows b and B + b) or [B, T], one sequence a row."""
    sequences = 2 if layout == "pairs" else 4
    shape = (sequences, labels.numel() // sequences)
    labels2, mask2 = labels.reshape(shape), kw["loss_mask"].reshape(shape)
    ref = kw.get("ref_logprobs")
    ref = None if ref is None else ref.reshape(shape)
    if layout == "pairs":
        given = P.pair_inputs(head, labels2, ref_logprobs=ref, ignore_index=head.ignore_index, loss_mask=mask2)
    else:
        desirable = torch.arange(sequences, device=labels.device) % 2 == 0
        given = P.sequence_inputs(head, labels2, desirable=desirable, ref_logprobs=ref,
                                  ignore_index=head.ignore_index, loss_mask=mask2)
    return {k: (v.reshape(-1) if isinstance(v, torch.Tensor) else v) for k, v in given.items()}


def _reference(head, logits, labels, kw, up=None, precision: torch.dtype = torch.float64):
    """(loss, values, rows, dL/dlogits) in float64 (``precision=torch.float32``: plain torch's fp32
    of the same formulas); ``up``: upstream gradients (reduction="none"): on the per-row loss and
    on each term's rows."""
    ref = reference(head)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    x, out, values, rows = ref.evaluate(logits.cpu(), None if labels is None else labels.cpu(),
                                        precision=precision, **cpu)
    if kw.get("reduction") == "none":
        total = (out * up["loss"]).sum() + sum((rows[n] * g).sum() for n, g in up["rows"].items())
    else:
        total = out
    grad = torch.autograd.grad(total, x, allow_unused=True)[0] if total.requires_grad else None
    grad = torch.zeros_like(x) if grad is None else grad
    return out.detach(), values, {n: r.detach() for n, r in rows.items()}, grad.reshape(logits.shape)


def _teacher_gradient(head, logits, labels, kw, up, precision: torch.dtype = torch.float64) -> torch.Tensor:
    """dL/dteacher_logits of the reference (autograd through the teacher as a float64 leaf) in
    ``precision`` (float32: plain torch's)."""
    t = kw["teacher_logits"].detach().double().cpu().requires_grad_()
    cpu = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    _, out, _, rows = reference(head).evaluate(logits.cpu(), None if labels is None else labels.cpu(),
                                               precision=precision, **{**cpu, "teacher_logits": t})
    total = (out * up["loss"]).sum() + sum((rows[n] * g).sum() for n, g in up["rows"].items()) \
        if kw.get("reduction") == "none" else out
    grad = torch.autograd.grad(total, t, allow_unused=True)[0] if total.requires_grad else None
    return torch.zeros_like(t) if grad is None else grad


def _upstream(head, labels_shape, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + 1)
    terms = [t.name for t in head.loss_terms if not t.formula.has(S.segment_mean) and t.normalize != "sequence"]
    return {"loss": torch.randn(labels_shape, generator=g, dtype=torch.float64),
            "rows": {n: torch.randn(labels_shape, generator=g, dtype=torch.float64) for n in terms[:2]}}


def _screen(head, logits, labels, kw, up, want, dtype, regime: str = "randn") -> None:
    """Skip a case whose reference is not finite, is huge, or moves by more than an eighth of the
    tolerance when the inputs move by a few fp32 ulps (a near tie at a kink, a cancellation). A case
    of another regime than ``randn`` means its infinities and huge values (the oracle, plain torch
    fp32, decides there): only the last is screened, where the reference is finite."""
    loss, values, rows, grad = want
    everything = [loss, grad, *values.values(), *rows.values()]
    if regime == "randn":
        if not all(torch.isfinite(t).all() for t in everything):
            raise Skip("reference not finite")
        if max(float(t.abs().max()) if t.numel() else 0.0 for t in everything) > 1e5:
            raise Skip("reference too large")
    g = torch.Generator().manual_seed(7)

    def jiggle(t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return t
        return t.detach().double().cpu() * (1 + 4 * 2.0**-24 * torch.randn(t.shape, generator=g, dtype=torch.float64))
    kw2 = {k: (jiggle(v) if k in ("teacher_logits",) or k in head.kernel.SPEC.tokens else v) for k, v in kw.items()}
    other = _reference(head, jiggle(logits), labels, kw2, up)
    rtol, atol, gtol = TOLERANCES[dtype]
    tight = (rtol / 8, atol / 8, gtol / 8)

    def finite(a, b):   # (the elements where both are finite: infinities are the oracle's to judge)
        keep = torch.isfinite(a) & torch.isfinite(b)
        return a.masked_fill(~keep, 0.0), b.masked_fill(~keep, 0.0)
    try:
        compare("loss", *finite(other[0], loss), dtype, tolerances=tight)
        for name in values:
            compare(name, *finite(other[1][name], values[name]), dtype, tolerances=tight)
        compare("gradient", *finite(other[3], grad), dtype, tolerances=tight)
    except AssertionError as e:
        raise Skip(f"ill-conditioned: {e}") from None


def check(head: lcg.HeadLoss, plan: Plan, *, rows: int = 12, vocab: int = 64, seed: int = 0,
          device: str = "cpu", layout: str = "", regime: str = "randn", ranks: "Ranks | None" = None) -> None:
    """Run ``head`` under ``plan`` on random inputs drawn in ``regime`` (``testing.REGIMES``) and
    compare loss, terms, metrics, rows and the gradient with the float64 reference, plain torch fp32
    as the yardstick. Raises ``Mismatch`` naming what differs, ``Skip`` for a case that is no fair
    test. ``ranks``: a running pool of gloo ranks for a sharded plan (one is started for the call
    otherwise)."""
    case = Case((), plan, rows=rows, vocab=vocab, seed=seed, layout=layout, regime=regime)
    if plan.backend or plan.inplace:
        head = lcg.HeadLoss(*head.loss_terms, metrics=head.metric_terms, ignore_index=head.ignore_index,
                            logit_scale=head.logit_scale, softcap=head.softcap, backend=plan.backend or "auto",
                            inplace_backward=plan.inplace)
    dtype = _dtype(plan.dtype)
    logits, labels, kw = _inputs(head, case, device)
    shape = labels.shape if labels is not None else logits.shape[:-1]
    up = _upstream(head, shape, seed)
    if plan.kind == "linear":
        return _check_linear(head, plan, logits, labels, kw, up, device, seed, regime)
    want = _reference(head, logits, labels, kw, up)
    _screen(head, logits, labels, kw, up, want, dtype, regime)
    if plan.kind == "sharded":
        own = ranks is None
        ranks = ranks or Ranks(plan.world)
        try:
            got = ranks.run(plan, head, logits, labels, kw, up)
        finally:
            if own:
                ranks.close()
    else:
        if plan.teacher_grad:
            teacher = kw["teacher_logits"].clone().requires_grad_()
            kw = {**kw, "teacher_logits": teacher}
        got = _run_here(head, plan, logits, labels, kw, up)
    _compare(head, plan, got, want, dtype, _reference(head, logits, labels, kw, up, torch.float32))
    if plan.teacher_grad and head.loss_terms:
        _compare_teacher_gradient(teacher.grad if teacher.grad is not None else torch.zeros_like(teacher),
                                  _teacher_gradient(head, logits, labels, kw, up),
                                  _teacher_gradient(head, logits, labels, kw, up, torch.float32), want, dtype, plan)


def _compare_teacher_gradient(got: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor, want, dtype,
                              plan: Plan) -> None:
    """The teacher's gradient. One that cancels to 0 keeps the rounding of its parts, each a row's
    loss-sized value times the derivative's scale, which the row's logits gradient shows
    (1/temperature, the upstream gradient): a one-hot teacher at temperature 0.05 cancels parts of
    20 * 2.2 * 35557 to 0, where plain torch's exact 0 comes from subtracting the very value it
    summed. The floor is the largest such product of one row (not one row's loss times another's
    gradient); as every floor, it holds only where the whole gradient is below it."""
    V = ref.shape[-1]
    grad = want[3].reshape(-1, V).nan_to_num(0.0, 0.0, 0.0).abs()
    loss = want[0].reshape(-1).nan_to_num(0.0, 0.0, 0.0).abs()
    floor = 0.0
    for r in range(grad.shape[0]):
        row_loss = loss[r if loss.numel() == grad.shape[0] else 0]
        floor = max(floor, gradient_floor(row_loss) * max(1.0, float(grad[r].max()) if V else 0.0))
    try:
        compare("gradient of teacher_logits", got, ref, dtype, where=f"({plan.code()})", plain=plain,
                floor=floor or gradient_floor(want[0]))
    except AssertionError as e:
        raise Mismatch(str(e)) from None


def _forced(head, plan: Plan, logits: torch.Tensor) -> Any:
    """The head's backend configuration for this call with the plan's tile and split forced (a
    dataclass: each field the backend's configuration has of ``block_v``, ``num_warps``, ``split``),
    or None: the runtime's own choice."""
    if plan.slices is not None:     # (the row-slices kernel is the Triton backend's)
        return head.backend.row_slices(plan.slices[0], 1, copy_bytes=plan.slices[1])
    if plan.tile is None:
        return None
    config = head.backend.config(head, head.kernel, logits.shape[-1], logits.dtype, logits.device,
                                 sharded=plan.kind == "sharded")
    forced = dict(zip(("block_v", "num_warps", "split"), plan.tile))
    names = {f.name for f in dataclasses.fields(config)}
    return dataclasses.replace(config, **{k: v for k, v in forced.items() if k in names})


def _run_here(head, plan: Plan, logits, labels, kw, up):
    """(loss, values, rows, dL/dlogits) of one call in this process."""
    head.tile_override = _forced(head, plan, logits)
    x = logits.clone().requires_grad_()
    try:
        if plan.kind == "compile":
            torch._dynamo.reset()

            def step(x, labels, kw):
                out = head(x, labels, **kw)
                return out.loss, out.terms, out.metrics, out.rows
            loss, terms, metrics, rows = torch.compile(step, fullgraph=True, backend="aot_eager")(x, labels, kw)
            values = {**terms, **metrics}
        else:
            # (inplace: a copy of the leaf, which the gradient overwrites)
            out = head(x * 1.0 if plan.inplace else x, labels, **kw)
            loss, values, rows = out.loss, {**out.terms, **out.metrics}, out.rows
        _backward(head, plan, x, loss, rows, up)
    finally:
        head.tile_override = None
    grad = x.grad if x.grad is not None else torch.zeros_like(x)
    return loss.detach(), {n: v.detach() for n, v in values.items()}, \
        {n: r.detach() for n, r in (rows or {}).items()}, grad


def _backward(head, plan: Plan, x, loss, rows, up) -> None:
    if not head.loss_terms or not loss.requires_grad:
        return
    if plan.reduction == "none":
        total = (loss * up["loss"].to(loss)).sum()
        for name, g in up["rows"].items():
            total = total + (rows[name] * g.to(loss)).sum()
    else:
        total = loss
    total.backward()


def _compare(head, plan: Plan, got, want, dtype, plain) -> None:
    """``testing.compare`` of each output, ``plain`` (the same outputs of plain torch fp32) the yardstick."""
    g_loss, g_values, g_rows, g_grad = got
    w_loss, w_values, w_rows, w_grad = want
    p_loss, p_values, p_rows, p_grad = plain
    where = f"({plan.code()})"
    try:
        compare("loss", g_loss, w_loss, dtype, where=where, plain=p_loss)
        for name, value in w_values.items():
            compare(name, g_values[name], value, dtype, where=where, plain=p_values[name])
        if plan.reduction == "none":
            for name, value in w_rows.items():
                compare(f"rows[{name!r}]", g_rows[name], value, dtype, where=where, plain=p_rows[name])
        if head.loss_terms and g_grad is not None:
            compare("gradient", g_grad, w_grad, dtype, where=where, plain=p_grad, floor=gradient_floor(w_loss))
    except AssertionError as e:
        raise Mismatch(str(e)) from None


def _check_linear(head, plan: Plan, logits, labels, kw, up, device, seed, regime: str = "randn") -> None:
    """head.linear on hidden, weight (and a teacher's), fp32: against the reference on their logits,
    the gradients of hidden and weight from its dL/dlogits. Outside the ``randn`` regime the hidden
    states carry the regime's logits through an identity block of the weight (plus a small random
    part): a saturated row reaches head.linear as it is, where one non-finite gradient would
    poison the whole dW."""
    g = torch.Generator().manual_seed(seed + 2)
    R, V, H = logits.shape[0], logits.shape[1], 8
    hidden = torch.randn(R, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    if regime != "randn":
        eye = torch.eye(V, dtype=torch.float64)
        hidden = torch.cat([logits.double().nan_to_num(neginf=-1e4), 0.1 * hidden], 1)
        weight = torch.cat([eye, 0.1 * weight], 1)
    lin_kw = dict(kw)
    if "teacher_logits" in kw:
        th = torch.randn(R, H, generator=g, dtype=torch.float64)
        tw = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
        kw = {**kw, "teacher_logits": (th @ tw.T).float()}
        lin_kw.pop("teacher_logits")
        lin_kw.update(teacher_hidden=th.float().to(device), teacher_weight=tw.float().to(device))
    z = (hidden.float().double() @ weight.float().double().T).float()
    want = _reference(head, z, labels, kw, up)
    _screen(head, z, labels, kw, up, want, torch.float32, regime)
    head.tile_override = _forced(head, plan, z)
    h, w = hidden.float().to(device).requires_grad_(), weight.float().to(device).requires_grad_()
    try:
        out = head.linear(h, w, labels, chunk_rows=plan.chunk_rows, **lin_kw)
        _backward(head, plan, h, out.loss, out.rows, up)
    finally:
        head.tile_override = None
    plain = _reference(head, z, labels, kw, up, torch.float32)
    got = (out.loss.detach(), {**out.terms, **out.metrics}, out.rows or {}, None)
    _compare(head, dataclasses.replace(plan), got, want, torch.float32, plain)
    if head.loss_terms:
        where = f"({plan.code()})"
        G, P32 = want[3].double(), plain[3].double()
        W, Hd = weight.float().double(), hidden.float().double()
        # (a dL/dlogits that cancels to 0 keeps the rounding of its parts, gradient_floor; the products
        # carry it times the other factor's largest column sum: the regimes' hidden states are large)
        floor = gradient_floor(want[0])
        for name, t, ref, torch_fp32, scale in (("gradient of hidden", h, G @ W, P32 @ W, W.abs().sum(0).max()),
                                                ("gradient of weight", w, G.T @ Hd, P32.T @ Hd, Hd.abs().sum(0).max())):
            grad = (t.grad if t.grad is not None else torch.zeros_like(t)).cpu()
            try:
                compare(name, grad, ref, torch.float32, where=where, plain=torch_fp32, floor=floor * float(scale))
            except AssertionError as e:
                raise Mismatch(str(e)) from None


# ---- vocab-parallel ranks -------------------------------------------------------------------------------
class Ranks:
    """``world`` gloo ranks in spawned processes, kept between cases: each gets the head (pickled),
    runs its columns of the logits, and returns (loss, values, rows, its gradient shard), or the
    error it raised."""

    def __init__(self, world: int, timeout: float = 300.0) -> None:
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.world, self.timeout = world, timeout
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, args=(r, world, port, self.jobs[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def run(self, plan: Plan, head, logits, labels, kw, up):
        bounds = [0]
        for w in plan.shards:
            bounds.append(bounds[-1] + w)
        for r in range(self.world):
            cols = slice(bounds[r], bounds[r + 1])
            skw = dict(kw)
            if "teacher_logits" in kw:
                skw["teacher_logits"] = kw["teacher_logits"][:, cols].contiguous()
            self.jobs[r].put((pickle.dumps(head), logits[:, cols].contiguous(), labels, skw, up))
        results = {}
        deadline = time.monotonic() + self.timeout
        while len(results) < self.world:
            try:
                rank, result = self.results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue_mod.Empty:
                self.close()
                raise Mismatch(f"vocab-parallel on {self.world} ranks ({plan.code()}): no answer from ranks "
                               f"{sorted(set(range(self.world)) - set(results))} in {self.timeout:.0f} s (a hang)")
            results[rank] = result
        errors = {r: res for r, res in results.items() if isinstance(res, dict)}
        if errors:
            messages = {res["error"] for res in errors.values()}
            if len(errors) == self.world and len(messages) == 1 and all(res["refused"] for res in errors.values()):
                raise Refused(f"vocab-parallel ({plan.code()}): {messages.pop()}")   # alike on every rank
            raise Mismatch(f"vocab-parallel ({plan.code()}): "
                           + "; ".join(f"rank {r}: {errors[r]['error'] if r in errors else 'a value'}"
                                       for r in sorted(results)))
        losses = [results[r][0] for r in range(self.world)]
        for r in range(1, self.world):
            # (NaN on every rank alike is one value: a regime's row with no distribution)
            if not torch.equal(losses[r].nan_to_num(), losses[0].nan_to_num()) \
                    or not torch.equal(losses[r].isnan(), losses[0].isnan()):
                raise Mismatch(f"vocab-parallel ({plan.code()}): rank {r}'s loss {losses[r]} is not rank 0's {losses[0]}")
        loss, values, rows, _ = results[0]
        grad = torch.cat([results[r][3] for r in range(self.world)], -1)
        return loss, values, rows, grad

    def close(self) -> None:
        for q in self.jobs:
            try:
                q.put(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def nan_workspaces() -> None:
    """Every call's workspace starts as NaN, not as whatever memory held: a launch that reads a slot
    nothing wrote gives NaN, which no comparison passes (tests/conftest.py does the same)."""
    from .. import launch
    launch.workspace = lambda size, device: torch.full((size,), float("nan"), device=device)


def _rank_main(rank: int, world: int, port: int, jobs, results) -> None:
    import torch.distributed as dist
    nan_workspaces()
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    while True:
        job = jobs.get()
        if job is None:
            break
        head, logits, labels, kw, up = job
        try:
            head = pickle.loads(head)
            x = logits.clone().requires_grad_()
            out = head(x, labels, process_group=dist.group.WORLD, **kw)
            plan = Plan(reduction=kw.get("reduction", "mean"))
            _backward(head, plan, x, out.loss, out.rows, up)
            grad = x.grad if x.grad is not None else torch.zeros_like(x)
            results.put((rank, (out.loss.detach(), {**out.terms, **out.metrics},
                                {n: r.detach() for n, r in (out.rows or {}).items()}, grad)))
        except Exception as e:   # the same refusal on every rank is one; compared by the parent
            results.put((rank, {"error": f"{type(e).__name__}: {e}", "refused": refused(e)}))
    dist.destroy_process_group()
