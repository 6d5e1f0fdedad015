"""-inf is a value, not a NaN: -inf logits on masked vocabulary entries (constrained decoding, padded
vocabularies), -inf teacher logits and -inf top-k log-probs give the finite values of the
``0 * log 0 = 0`` convention (torch.xlogy's), value and gradient, for every built-in term and
metric. Each expected value is float64 torch written here by hand."""
import math
import os

import pytest
import torch
import torch.distributed as dist

import losscodegen as lcg
from helpers import both_backends, run_backward, run_ranks
from losscodegen.backends.triton import tiles
from losscodegen.testing import TOLERANCES, reference
import reference as hand

# the parity tests run on both backends (conftest's ``backend``: the heads built with backend="auto")
BOTH = pytest.mark.usefixtures("backend")

NEG_INF = float("-inf")
R, V = 5, 700
SMALL_TILES = tiles.Config(512, 4)   # fp32 tiles of 256 entries: row 0's first two are all -inf


def _inputs(seed=0, student_only=0.0, teacher_only=0.0):
    """Logits and teacher logits -inf on the same ~30% of entries (row 0: its whole first tile),
    plus -inf on ``student_only`` / ``teacher_only`` fractions of one side; labels on finite entries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * 2
    t = torch.randn(R, V, generator=g) * 2 + 0.5 * x
    both = torch.rand(R, V, generator=g) < 0.3
    both[0, :520] = True
    x_only = (torch.rand(R, V, generator=g) < student_only) & ~both
    t_only = (torch.rand(R, V, generator=g) < teacher_only) & ~both & ~x_only
    x, t = x.masked_fill(both | x_only, NEG_INF), t.masked_fill(both | t_only, NEG_INF)
    finite = x > NEG_INF
    y = torch.stack([torch.multinomial(f.double(), 1, generator=g)[0] for f in finite])
    y[3] = -100
    return x, t, y


def _target(z, y):
    """The label's index; an ignored row's argmax (a -inf logit would put 0 * inf in its backward)."""
    return torch.where(y >= 0, y, z.detach().argmax(-1))[:, None]


def _xlogy(p, logq):
    """p * log q with 0 * log 0 = 0, differentiable (no 0 * inf in the backward either)."""
    return p * logq.masked_fill(p == 0, 0.0)


def _by_hand(name, z, t, y):
    """Per-row values in float64, from torch's log_softmax."""
    logp = torch.log_softmax(z, -1)
    logq = torch.log_softmax(t, -1) if t is not None else None
    p, q = logp.exp(), (logq.exp() if t is not None else None)
    zy = z.gather(1, _target(z, y))[:, 0]
    if name == "cross_entropy":
        return torch.logsumexp(z, -1) - zy
    if name == "z_loss":
        return torch.logsumexp(z, -1) ** 2
    if name == "entropy":
        return -_xlogy(p, logp).sum(-1)
    if name == "forward_kl":
        return (_xlogy(q, logq) - _xlogy(q, logp)).sum(-1)
    if name == "reverse_kl":
        return (_xlogy(p, logp) - _xlogy(p, logq)).sum(-1)
    if name == "jsd":
        m = 0.5 * p + 0.5 * q
        logm = torch.log(m.masked_fill(m == 0, 1.0))   # (where m = 0, p = q = 0: no 0/0 in the backward)
        return 0.5 * (_xlogy(p, logp) - _xlogy(p, logm)).sum(-1) + 0.5 * (_xlogy(q, logq) - _xlogy(q, logm)).sum(-1)
    if name == "token_accuracy":
        return (z.argmax(-1) == y).double()
    raise KeyError(name)


def _check(head, names, x, y, by_hand, split=False, **kw):
    """The head's loss, terms, metrics and gradient against the per-row values ``by_hand`` gives
    (in small tiles; with ``split``, the reads in separate launches)."""
    head.tile_override = tiles.Config(SMALL_TILES.block_v, SMALL_TILES.num_warps, split)
    xk = x.clone().requires_grad_()
    out = head(xk, y, **kw)
    if head.loss_terms:
        out.loss.backward()
    xd = x.double().requires_grad_()
    valid = y != -100
    loss = 0.0
    for name in names:
        per_row = by_hand(name, xd, y)
        value = torch.where(valid, per_row, 0.0).sum() / valid.sum()
        got = {**out.terms, **out.metrics}[name]
        assert torch.isfinite(got), (name, got)
        torch.testing.assert_close(got.double(), value.detach(), rtol=1e-4, atol=1e-5, msg=name)
        if name in out.terms:
            loss = loss + value
    if head.loss_terms:
        loss.backward()
        assert torch.isfinite(xk.grad).all()
        assert (xk.grad[x == NEG_INF] == 0).all()
        assert (xk.grad.double() - xd.grad).abs().max() <= 2e-4 * xd.grad.abs().max()
        # and the parity tool's reference applies the same convention
        _, values, grad = reference(head)(x, y, **kw)
        for name in names:
            torch.testing.assert_close(values[name], {**out.terms, **out.metrics}[name].double(),
                                       rtol=1e-4, atol=1e-5)
        assert (grad - xd.grad).abs().max() <= 1e-9 * xd.grad.abs().max() + 1e-12
    return out


@pytest.mark.parametrize("split", [False, True], ids=["one_launch", "split"])
@pytest.mark.parametrize("terms,metrics", [
    ((lcg.CrossEntropy(), lcg.ZLoss()), (lcg.Entropy(), lcg.TokenAccuracy())),
    ((lcg.Entropy(),), ()),                       # entropy as a loss: its gradient at -inf entries
    ((lcg.ForwardKL(),), ()),
    ((lcg.ReverseKL(),), ()),
    ((lcg.JSD(),), ()),
    ((lcg.CrossEntropy(), lcg.ForwardKL(), lcg.JSD()), (lcg.Entropy(),)),
], ids=["ce_z_entropy_acc", "entropy", "fkl", "rkl", "jsd", "ce_fkl_jsd"])
@BOTH
def test_masked_vocabulary_gives_the_xlogy_values(terms, metrics, split):
    x, t, y = _inputs()
    head = lcg.HeadLoss(*terms, metrics=metrics)
    names = [term.name for term in terms + metrics]
    _check(head, names, x, y, lambda n, z, yy: _by_hand(n, z, t.double(), yy), split, teacher_logits=t)


@pytest.mark.parametrize("term", [lcg.ForwardKL(), lcg.JSD()], ids=lambda term: term.name)
@BOTH
def test_teacher_only_neg_inf_is_finite_for_fkl_and_jsd(term):
    """q = 0 where only the teacher is -inf: FKL and JSD stay finite (RKL is +inf there, as in torch)."""
    x, t, y = _inputs(seed=1, teacher_only=0.2)
    _check(lcg.HeadLoss(term), [term.name], x, y, lambda n, z, yy: _by_hand(n, z, t.double(), yy),
           teacher_logits=t)


@pytest.mark.parametrize("term", [lcg.ReverseKL(), lcg.JSD()], ids=lambda term: term.name)
@BOTH
def test_student_only_neg_inf_is_finite_for_rkl_and_jsd(term):
    x, t, y = _inputs(seed=2, student_only=0.2)
    _check(lcg.HeadLoss(term), [term.name], x, y, lambda n, z, yy: _by_hand(n, z, t.double(), yy),
           teacher_logits=t)


@BOTH
def test_topk_forward_kl_with_neg_inf_logprobs_and_logits():
    """-inf top-k log-probs (a teacher's entries of probability 0), -inf logits elsewhere."""
    x, _, y = _inputs(seed=3)
    g = torch.Generator().manual_seed(3)
    K = 6
    ids = torch.stack([torch.nonzero(row > NEG_INF)[:, 0][torch.randperm(int((row > NEG_INF).sum()), generator=g)[:K]]
                       for row in x])
    lps = torch.log_softmax(torch.randn(R, K, generator=g, dtype=torch.float64), -1)
    lps[:, -2:] = NEG_INF
    lps = lps.float()

    def by_hand(name, z, yy):
        logp_k = torch.log_softmax(z, -1).gather(1, ids)
        l = lps.double()
        return (_xlogy(l.exp(), l) - _xlogy(l.exp(), logp_k)).sum(-1)
    _check(lcg.HeadLoss(lcg.TopKForwardKL()), ["topk_forward_kl"], x, y, by_hand,
           teacher_topk_ids=ids, teacher_topk_logprobs=lps)


@BOTH
def test_grpo_and_policy_metrics_with_masked_vocabulary():
    x, _, y = _inputs(seed=4)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        l = torch.log_softmax(x.double(), -1).gather(1, _target(x, y))[:, 0]
    kw = dict(advantages=torch.randn(R, generator=g), old_logprobs=(l + 0.3 * torch.randn(R, generator=g, dtype=torch.float64)).float(),
              ref_logprobs=(l + 0.1 * torch.randn(R, generator=g, dtype=torch.float64)).float())
    A, old, ref = (kw[k].double() for k in ("advantages", "old_logprobs", "ref_logprobs"))

    def by_hand(name, z, yy):
        lp = torch.log_softmax(z, -1).gather(1, _target(z, yy))[:, 0]
        r = torch.exp(lp - old)
        if name == "grpo":
            d = ref - lp
            return -torch.minimum(r * A, r.clamp(0.8, 1.2) * A) + 0.04 * (torch.exp(d) - d - 1)
        if name == "ratio_mean":
            return r
        if name == "kl_new_old":
            return r - (lp - old) - 1
        return _by_hand(name, z, None, yy) if name != "clip_fraction" else ((r < 0.8) | (r > 1.2)).double()
    head = lcg.HeadLoss(lcg.GRPO(kl_beta=0.04), metrics=(lcg.Entropy(), lcg.RatioMean(), lcg.KLNewOld(),
                                                         lcg.ClipFraction()))
    _check(head, ["grpo", "entropy", "ratio_mean", "kl_new_old", "clip_fraction"], x, y, by_hand, **kw)


@pytest.mark.cpu
@BOTH
def test_a_row_of_all_neg_inf_is_nan_for_that_row_only():
    """A row with no finite logit (or no finite teacher logit) has no distribution: its values are
    NaN, the other rows' are as usual (reduction="none" shows it row by row)."""
    x, t, y = _inputs(seed=5)
    x[1] = NEG_INF
    t[2] = NEG_INF
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL())
    rows = head(x, y, teacher_logits=t, reduction="none").loss
    assert rows[1].isnan() and rows[2].isnan()
    keep = torch.tensor([0, 3, 4])
    xd = x.double()
    want = _by_hand("cross_entropy", xd, t.double(), y) + _by_hand("forward_kl", xd, t.double(), y)
    want = torch.where(y != -100, want, 0.0)
    torch.testing.assert_close(rows[keep].double(), want[keep], rtol=1e-4, atol=1e-5)
    ent = lcg.HeadLoss(metrics=(lcg.Entropy(),))
    assert ent(x, y).metrics["entropy"].isnan()              # the mean over rows holds the NaN row
    assert torch.isfinite(ent(x[[0, 2, 4]], y[[0, 2, 4]]).metrics["entropy"])


@pytest.mark.cpu
@BOTH
def test_real_nans_are_not_hidden():
    """A NaN logit, or a NaN teacher logit, is not -inf: the loss and that row's gradient stay NaN."""
    x, t, y = _inputs(seed=6)
    x[0, 600] = float("nan")
    t[2, 7] = float("nan")
    xk = x.clone().requires_grad_()
    out = lcg.HeadLoss(lcg.Entropy(), lcg.ForwardKL())(xk, y, teacher_logits=t)
    out.loss.backward()
    assert out.terms["entropy"].isnan() and out.terms["forward_kl"].isnan()
    assert xk.grad[0].isnan().any() and xk.grad[2].isnan().any()
    assert torch.isfinite(xk.grad[4]).all()


@pytest.mark.cpu
@BOTH
def test_bad_labels_still_raise_with_neg_inf_logits():
    x, t, y = _inputs(seed=7)
    y[0] = V
    with pytest.raises(ValueError, match="labels"):
        lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),))(x, y)


def _sharded_worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, t, y = _inputs(seed=8)
    Vl = V // world
    x[2, Vl:] = NEG_INF        # row 2: the second shard all -inf
    t[2, Vl:] = NEG_INF
    x[4, :Vl] = NEG_INF        # row 4: the first shard all -inf (its label in the second)
    t[4, :Vl] = NEG_INF
    y[2], y[4] = 3, Vl + 3
    x[2, 3] = x[4, Vl + 3] = 1.0
    cols = slice(rank * Vl, (rank + 1) * Vl)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(), lcg.JSD(), metrics=(lcg.Entropy(),))
    shard = x[:, cols].clone().requires_grad_()
    out = head(shard, y, teacher_logits=t[:, cols].contiguous(), process_group=dist.group.WORLD)
    out.loss.backward()
    full = x.clone().requires_grad_()
    ref = head(full, y, teacher_logits=t)
    ref.loss.backward()
    # (plain numbers and arrays: a tensor would be shared memory, gone with this process)
    queue.put((rank, {k: float(v) for k, v in {**out.terms, **out.metrics}.items()},
               {k: float(v) for k, v in {**ref.terms, **ref.metrics}.items()},
               shard.grad.numpy(), full.grad[:, cols].numpy()))
    dist.destroy_process_group()


@pytest.mark.cpu
@BOTH
def test_a_vocab_shard_of_all_neg_inf_merges_to_the_unsharded_values():
    """Vocab-parallel: a rank whose whole shard of a row is -inf adds nothing to the merged sums."""
    for rank, values, ref_values, grad, ref_grad in run_ranks(_sharded_worker, 2, 2):
        for name, value in values.items():
            assert math.isfinite(value), (rank, name)
            assert value == pytest.approx(ref_values[name], rel=1e-5, abs=1e-6), (rank, name)
        grad, ref_grad = torch.from_numpy(grad), torch.from_numpy(ref_grad)
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_masked_vocabulary_compiled_on_the_gpu(dtype):
    """The compiled kernel (fast log and reciprocal, real tiles) on a padded 32000-entry vocabulary:
    row 0's first 20000 entries -inf, ~30% elsewhere; against float64 torch by hand."""
    g = torch.Generator().manual_seed(9)
    rows, vocab = 64, 32000
    x = (torch.randn(rows, vocab, generator=g) * 2).to(dtype)
    t = (torch.randn(rows, vocab, generator=g) * 2).to(dtype)
    dead = torch.rand(rows, vocab, generator=g) < 0.3
    dead[0, :20000] = True
    dead[:, -1] = False
    x, t = x.masked_fill(dead, NEG_INF), t.masked_fill(dead, NEG_INF)
    y = torch.full((rows,), vocab - 1)
    y[5] = -100
    rtol, atol, grad_tol = TOLERANCES[dtype]
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(), lcg.JSD(), metrics=(lcg.Entropy(),))
    xk = x.cuda().requires_grad_()
    out = head(xk, y.cuda(), teacher_logits=t.cuda())
    out.loss.backward()
    xd, valid = x.double().requires_grad_(), y != -100
    loss = 0.0
    for name in ("cross_entropy", "forward_kl", "jsd", "entropy"):
        want = torch.where(valid, _by_hand(name, xd, t.double(), y), 0.0).sum() / valid.sum()
        got = {**out.terms, **out.metrics}[name].cpu().double()
        assert abs(got - want.detach()) <= atol + rtol * abs(want.detach()), (name, got, want)
        loss = loss + (want if name != "entropy" else 0.0)
    loss.backward()
    grad = xk.grad.cpu().double()
    assert torch.isfinite(grad).all() and (grad[dead] == 0).all()
    assert (grad - xd.grad).abs().max() <= grad_tol * xd.grad.abs().max()


def test_the_columns_past_a_rows_end_are_neg_inf_only_where_every_sum_vanishes():
    # A read whose running sums are all 0 at -inf inputs takes a tile's columns past the row's end
    # as -inf inputs (one select an element for the logits, where masks cost one a sum and a max);
    # one with a sum that is not, sum p z**3 (FLOOR**3 overflows fp32 to -inf, and 0 * -inf is NaN),
    # keeps its masks. Both against the float64 reference, on a vocabulary that ends inside a tile.
    padded = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(), lcg.ForwardKL(weight=0.5), metrics=(lcg.Entropy(),))
    cubic = lcg.declare_term("cubic", lcg.symbols.vsum(lcg.symbols.softmax * lcg.symbols.logit ** 3))
    masked = lcg.HeadLoss(lcg.CrossEntropy(), cubic(weight=1e-3), metrics=(lcg.Entropy(), lcg.TokenAccuracy()))
    assert 'other=float("-inf")' in padded.source().text
    assert 'z = tl.where(in_row, z, float("-inf"))' not in masked.source().text
    for head in (padded, masked):
        lcg.testing.assert_parity(head, rows=12, vocab=300)


# ---- against the hand-written formulas (tests/reference.py), both backends: the second in the slow tier ----


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("triton"), indirect=True)
def test_minus_inf_logits_follow_zero_log_zero(backend):
    x, y, t = hand.rows_in(8, 32, seed=15)
    x[:, 5:9] = float("-inf")
    t[:, 5:12] = float("-inf")   # the teacher is 0 wherever the student is
    y[y.ge(5) & y.lt(9)] = 0
    # (no ReverseKL: q = 0 where p > 0 makes it +inf by its formula)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(), lcg.JSD(), metrics=(lcg.Entropy(),), backend=backend)
    out, g = run_backward(head, x, y, teacher_logits=t)
    v = hand.valid_rows(y)
    hand.close(out.terms["cross_entropy"], hand.mean_over(hand.ce_rows(x.double(), y), v), hand.FP32, "cross_entropy")
    hand.close(out.terms["forward_kl"], hand.mean_over(hand.forward_kl_rows(x.double(), t), v), hand.FP32, "forward_kl")
    hand.close(out.terms["jsd"], hand.mean_over(hand.jsd_rows(x.double(), t), v), hand.FP32, "jsd")
    hand.close(out.metrics["entropy"], hand.mean_over(hand.entropy_rows(x.double()), v), hand.FP32, "entropy")
    assert not torch.isnan(g).any()
    assert torch.all(g[:, 5:9] == 0), "the gradient of a -inf logit is 0"


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("torch"), indirect=True)
def test_minus_inf_logits_without_teacher_are_finite_with_exact_gradient(backend):
    x, y, _ = hand.rows_in(8, 32, seed=16)
    x[:, 20:] = float("-inf")
    y = y % 20
    y[3] = hand.IGNORE
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.0), lcg.ZLoss(weight=0.1), metrics=(lcg.Entropy(),), backend=backend)
    out, g = run_backward(head, x, y)
    v = hand.valid_rows(y)
    keep = x[:, :20]

    def loss(z):
        return hand.mean_over(hand.ce_rows(z, y), v) + 0.1 * hand.mean_over(hand.z_loss_rows(z), v)
    hand.close(out.loss, loss(keep.double()), hand.FP32, "loss")
    hand.close(g[:, :20], hand.grad(loss, keep), hand.FP32, "grad")
    assert torch.all(g[:, 20:] == 0)
    hand.close(out.metrics["entropy"], hand.mean_over(hand.entropy_rows(keep.double()), v), hand.FP32, "entropy")
