"""CONTRACT.md "Backends" and the built-in terms table, checked as a user would: every head on
``backend="torch"`` and ``backend="triton"`` (Triton's interpreter on the CPU) against float64 torch
formulas written from the contract (tests/contract_reference.py), gradients by torch.autograd; plus
the older sections' edge cases (zero valid rows, reduction none/sum, divisor, bf16, -inf logits,
softcap/logit_scale, loss_mask)."""
import pytest
import torch

import losscodegen as lcg
import contract_reference as R

pytestmark = pytest.mark.cpu   # CPU tensors throughout (conftest's ``cpu``)

BACKENDS = ["torch", "triton"]
FP32 = 2e-5


def _grad(fn, x):
    x = x.detach().double().requires_grad_(True)
    fn(x).backward()
    return x.grad


def _run(head, x, y, **kw):
    x = x.detach().clone().requires_grad_(True)
    out = head(x, y, **kw)
    out.loss.backward()
    return out, x.grad


def test_backend_option_is_validated_naming_it():
    with pytest.raises(ValueError, match="backend"):
        lcg.HeadLoss(lcg.CrossEntropy(), backend="cuda")


@pytest.mark.parametrize("backend", BACKENDS)
def test_ce_family_with_metrics_matches_formulas(backend):
    x, y, _ = R.rows_in(16, 64, seed=1)
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1), lcg.ZLoss(weight=1e-2),
                        metrics=(lcg.Entropy(), lcg.TokenAccuracy()), backend=backend)
    out, g = _run(head, x, y)
    v = R.valid_rows(y)

    def loss(z):
        return R.mean_over(R.ce_rows(z, y, 0.1), v) + 1e-2 * R.mean_over(R.z_loss_rows(z), v)
    R.close(out.loss, loss(x.double()), FP32, "loss")
    R.close(out.terms["cross_entropy"], R.mean_over(R.ce_rows(x.double(), y, 0.1), v), FP32, "cross_entropy")
    R.close(out.terms["z_loss"], R.mean_over(R.z_loss_rows(x.double()), v), FP32, "z_loss (unweighted)")
    R.close(out.metrics["entropy"], R.mean_over(R.entropy_rows(x.double()), v), FP32, "entropy")
    R.close(out.metrics["token_accuracy"], R.mean_over(R.accuracy_rows(x.double(), y), v), 1e-6, "token_accuracy")
    R.close(g, _grad(loss, x), FP32, "grad")
    assert out.loss.dtype == torch.float32 and out.loss.dim() == 0
    assert not out.terms["z_loss"].requires_grad and not out.metrics["entropy"].requires_grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_distillation_terms_with_temperature_match_formulas(backend):
    x, y, t = R.rows_in(12, 50, seed=2)
    head = lcg.HeadLoss(lcg.ForwardKL(weight=0.5, temperature=2.0), lcg.ReverseKL(weight=0.3, temperature=0.7),
                        lcg.JSD(beta=0.3, temperature=1.5), backend=backend)
    out, g = _run(head, x, y, teacher_logits=t)
    v = R.valid_rows(y)
    parts = {"forward_kl": lambda z: R.forward_kl_rows(z, t, 2.0), "reverse_kl": lambda z: R.reverse_kl_rows(z, t, 0.7),
             "jsd": lambda z: R.jsd_rows(z, t, 0.3, 1.5)}
    weights = {"forward_kl": 0.5, "reverse_kl": 0.3, "jsd": 1.0}

    def loss(z):
        return sum(weights[k] * R.mean_over(f(z), v) for k, f in parts.items())
    for k, f in parts.items():
        R.close(out.terms[k], R.mean_over(f(x.double()), v), FP32, k)
    R.close(out.loss, loss(x.double()), FP32, "loss")
    R.close(g, _grad(loss, x), FP32, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_forward_kl_matches_formula(backend):
    x, y, t = R.rows_in(10, 40, seed=3)
    g0 = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(40, generator=g0)[:5] for _ in range(10)])
    lps = torch.log_softmax(t, -1).gather(1, ids)
    head = lcg.HeadLoss(lcg.TopKForwardKL(temperature=1.3), backend=backend)
    out, g = _run(head, x, y, teacher_topk_ids=ids, teacher_topk_logprobs=lps)
    v = R.valid_rows(y)

    def loss(z):
        return R.mean_over(R.topk_forward_kl_rows(z, ids, lps, 1.3), v)
    R.close(out.loss, loss(x.double()), FP32, "loss")
    R.close(g, _grad(loss, x), FP32, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_with_kl_and_policy_metrics_match_formulas(backend):
    x, y, _ = R.rows_in(16, 48, seed=4)
    gen = torch.Generator().manual_seed(5)
    l = torch.log_softmax(x, -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
    old = l + 0.4 * torch.randn(16, generator=gen)
    ref = l + 0.2 * torch.randn(16, generator=gen)
    adv = torch.randn(16, generator=gen)
    head = lcg.HeadLoss(lcg.GRPO(eps_low=0.2, eps_high=0.28, kl_beta=0.05),
                        metrics=(lcg.RatioMean(), lcg.ClipFraction(), lcg.KLNewOld(), lcg.LogProb()), backend=backend)
    out, g = _run(head, x, y, advantages=adv, old_logprobs=old, ref_logprobs=ref)
    v = R.valid_rows(y)

    def loss(z):
        return R.mean_over(R.grpo_rows(z, y, adv, old, ref, 0.2, 0.28, 0.05), v)
    R.close(out.loss, loss(x.double()), FP32, "loss")
    R.close(g, _grad(loss, x), FP32, "grad")
    lp = R.logprob_rows(x.double(), y)
    r = torch.exp(lp - old.double())
    R.close(out.metrics["ratio_mean"], R.mean_over(r, v), FP32, "ratio_mean")
    R.close(out.metrics["clip_fraction"], R.mean_over(((r < 0.8) | (r > 1.28)).double(), v), 1e-6, "clip_fraction")
    R.close(out.metrics["kl_new_old"], R.mean_over(r - torch.log(r) - 1, v), FP32, "kl_new_old")
    R.close(out.metrics["logprob"], R.mean_over(lp, v), FP32, "logprob")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gspo_divides_by_non_empty_segments(backend):
    x, y, _ = R.rows_in(16, 40, seed=6, ignored=(1, 6, 7))
    gen = torch.Generator().manual_seed(7)
    l = torch.log_softmax(x, -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
    old = l + 0.001 * torch.randn(16, generator=gen)
    adv = torch.randn(16, generator=gen)
    # segments 0..4 plus a huge global sample index; segment 3 holds only ignored rows (6, 7)
    seg = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 4, 4, 4, 4, 10**9, 10**9, 2, 2])
    head = lcg.HeadLoss(lcg.GSPO(), backend=backend)
    out, g = _run(head, x, y, advantages=adv, old_logprobs=old, segment_ids=seg)
    v = R.valid_rows(y)

    def loss(z):
        return R.gspo_total(z, y, adv, old, seg, v)
    R.close(out.loss, loss(x.double()), FP32, "loss")
    R.close(g, _grad(loss, x), FP32, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_valid_rows_give_zero_and_zero_gradient(backend):
    x, y, t = R.rows_in(8, 32, seed=8, ignored=range(8))
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(), metrics=(lcg.Entropy(), lcg.TokenAccuracy()), backend=backend)
    out, g = _run(head, x, y, teacher_logits=t)
    for name, val in [("loss", out.loss), *out.terms.items(), *out.metrics.items()]:
        assert float(val) == 0.0, (name, val)
    assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduction_none_sum_and_divisor(backend):
    x, y, _ = R.rows_in(3 * 5, 40, seed=9, ignored=(2, 9))
    x, y = x.reshape(3, 5, 40), y.reshape(3, 5)
    v = R.valid_rows(y)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1), backend=backend)

    def rows(z):
        return torch.where(v, R.ce_rows(z, y) + 0.1 * R.z_loss_rows(z), torch.zeros(()).double())
    # none: labels' shape, 0 on invalid rows, differentiable with any upstream gradient
    up = torch.randn(3, 5, dtype=torch.float64)
    xx = x.clone().requires_grad_(True)
    out = head(xx, y, reduction="none")
    assert out.loss.shape == (3, 5)
    R.close(out.loss, rows(x.double()), FP32, "rows")
    out.loss.backward(up.float())
    R.close(xx.grad, _grad(lambda z: (rows(z) * up).sum(), x), FP32, "none grad")
    # sum: no divisor
    out, g = _run(head, x, y, reduction="sum")
    R.close(out.loss, rows(x.double()).sum(), FP32, "sum")
    R.close(g, _grad(lambda z: rows(z).sum(), x), FP32, "sum grad")
    # divisor: a global token count
    out, g = _run(head, x, y, divisor=37)
    R.close(out.loss, rows(x.double()).sum() / 37, FP32, "divisor")
    R.close(out.terms["z_loss"], R.mean_over(R.z_loss_rows(x.double()), v, 37), FP32, "divisor term")
    R.close(g, _grad(lambda z: rows(z).sum() / 37, x), FP32, "divisor grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_metrics_stay_means_over_valid_rows_whatever_divisor(backend):
    x, y, _ = R.rows_in(12, 40, seed=10)
    v = R.valid_rows(y)
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),), backend=backend)
    for kw in ({"divisor": 100}, {"reduction": "sum"}, {"reduction": "none"}):
        out = head(x, y, **kw)
        R.close(out.metrics["entropy"], R.mean_over(R.entropy_rows(x.double()), v), FP32, f"entropy {kw}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_mask_marks_rows_invalid(backend):
    x, y, t = R.rows_in(12, 40, seed=11)
    mask = torch.tensor([True, True, False, True, False, True, True, True, False, True, True, True])
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(), backend=backend)
    out, g = _run(head, x, y, teacher_logits=t, loss_mask=mask)
    v = R.valid_rows(y, mask)

    def loss(z):
        return R.mean_over(R.ce_rows(z, y), v) + R.mean_over(R.forward_kl_rows(z, t), v)
    R.close(out.loss, loss(x.double()), FP32, "loss")
    R.close(g, _grad(loss, x), FP32, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_distillation_only_head_without_labels_uses_loss_mask(backend):
    x, _, t = R.rows_in(10, 40, seed=12)
    mask = torch.arange(10) % 3 != 0
    head = lcg.HeadLoss(lcg.ReverseKL(), backend=backend)
    xx = x.clone().requires_grad_(True)
    out = head(xx, None, teacher_logits=t, loss_mask=mask)
    out.loss.backward()

    def loss(z):
        return R.mean_over(R.reverse_kl_rows(z, t), mask)
    R.close(out.loss, loss(x.double()), FP32, "loss")
    R.close(xx.grad, _grad(loss, x), FP32, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", [{"softcap": 5.0}, {"logit_scale": 0.5}])
def test_softcap_and_logit_scale_apply_to_student_only(backend, transform):
    x, y, t = R.rows_in(10, 40, seed=13, scale=4.0)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5), backend=backend, **transform)
    out, g = _run(head, x, y, teacher_logits=t)
    v = R.valid_rows(y)

    def loss(z):
        z = R.transform(z, **transform)
        return R.mean_over(R.ce_rows(z, y), v) + 0.5 * R.mean_over(R.forward_kl_rows(z, t), v)
    R.close(out.loss, loss(x.double()), FP32, "loss")
    R.close(g, _grad(loss, x), FP32, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_logits_computed_in_fp32(backend):
    x, y, t = R.rows_in(12, 64, seed=14, dtype=torch.bfloat16)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ReverseKL(weight=0.5), metrics=(lcg.Entropy(),), backend=backend)
    out, g = _run(head, x, y, teacher_logits=t)
    assert out.loss.dtype == torch.float32 and g.dtype == torch.bfloat16
    v = R.valid_rows(y)

    def loss(z):
        return R.mean_over(R.ce_rows(z, y), v) + 0.5 * R.mean_over(R.reverse_kl_rows(z, t), v)
    R.close(out.loss, loss(x.double()), 1e-4, "loss")
    R.close(out.metrics["entropy"], R.mean_over(R.entropy_rows(x.double()), v), 1e-4, "entropy")
    want = _grad(loss, x)
    R.close(g, want, 1e-2 * max(1.0, 1 / float(want.abs().max())), "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_logits_follow_zero_log_zero(backend):
    x, y, t = R.rows_in(8, 32, seed=15)
    x[:, 5:9] = float("-inf")
    t[:, 5:12] = float("-inf")   # the teacher is 0 wherever the student is
    y[y.ge(5) & y.lt(9)] = 0
    # (no ReverseKL: q = 0 where p > 0 makes it +inf by its formula)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(), lcg.JSD(), metrics=(lcg.Entropy(),), backend=backend)
    out, g = _run(head, x, y, teacher_logits=t)
    v = R.valid_rows(y)
    R.close(out.terms["cross_entropy"], R.mean_over(R.ce_rows(x.double(), y), v), FP32, "cross_entropy")
    R.close(out.terms["forward_kl"], R.mean_over(R.forward_kl_rows(x.double(), t), v), FP32, "forward_kl")
    R.close(out.terms["jsd"], R.mean_over(R.jsd_rows(x.double(), t), v), FP32, "jsd")
    R.close(out.metrics["entropy"], R.mean_over(R.entropy_rows(x.double()), v), FP32, "entropy")
    assert not torch.isnan(g).any()
    assert torch.all(g[:, 5:9] == 0), "the gradient of a -inf logit is 0"


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_logits_without_teacher_are_finite_with_exact_gradient(backend):
    x, y, _ = R.rows_in(8, 32, seed=16)
    x[:, 20:] = float("-inf")
    y = y % 20
    y[3] = R.IGNORE
    head = lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.0), lcg.ZLoss(weight=0.1), metrics=(lcg.Entropy(),), backend=backend)
    out, g = _run(head, x, y)
    v = R.valid_rows(y)
    keep = x[:, :20]

    def loss(z):
        return R.mean_over(R.ce_rows(z, y), v) + 0.1 * R.mean_over(R.z_loss_rows(z), v)
    R.close(out.loss, loss(keep.double()), FP32, "loss")
    R.close(g[:, :20], _grad(loss, keep), FP32, "grad")
    assert torch.all(g[:, 20:] == 0)
    R.close(out.metrics["entropy"], R.mean_over(R.entropy_rows(keep.double()), v), FP32, "entropy")


@pytest.mark.parametrize("backend", BACKENDS)
def test_declared_terms_match_their_formulas(backend):
    from losscodegen import symbols as S
    Poly1 = lcg.declare_term(f"poly1_{backend}", S.lse - S.target_logit + S.param("eps") * (1 - S.exp(S.target_logit - S.lse)))
    Collision = lcg.declare_term(f"collision_{backend}", S.vsum(S.softmax ** 2))
    x, y, _ = R.rows_in(10, 40, seed=17)
    head = lcg.HeadLoss(Poly1(eps=2.0), Collision(weight=0.5), backend=backend)
    out, g = _run(head, x, y)
    v = R.valid_rows(y)

    def parts(z):
        lse = torch.logsumexp(z, -1)
        zy = z.gather(-1, y.clamp_min(0)[:, None])[:, 0]
        return lse - zy + 2.0 * (1 - torch.exp(zy - lse)), (torch.softmax(z, -1) ** 2).sum(-1)

    def loss(z):
        a, b = parts(z)
        return R.mean_over(a, v) + 0.5 * R.mean_over(b, v)
    R.close(out.loss, loss(x.double()), FP32, "loss")
    R.close(out.terms[f"collision_{backend}"], R.mean_over(parts(x.double())[1], v), FP32, "collision")
    R.close(g, _grad(loss, x), FP32, "grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_head_matches_logits_head_with_any_chunk(backend):
    gen = torch.Generator().manual_seed(18)
    h = torch.randn(13, 16, generator=gen)
    w = torch.randn(50, 16, generator=gen) * 0.5
    b = torch.randn(50, generator=gen) * 0.1
    th, tw = torch.randn(13, 8, generator=gen), torch.randn(50, 8, generator=gen)
    y = torch.randint(0, 50, (13,), generator=gen)
    y[[0, 7]] = R.IGNORE
    v = R.valid_rows(y)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(weight=0.5, temperature=2.0), backend=backend)

    def loss(hh, ww, bb):
        z = hh @ ww.T + bb
        t = th.double() @ tw.double().T
        return R.mean_over(R.ce_rows(z, y), v) + 0.5 * R.mean_over(R.forward_kl_rows(z, t, 2.0), v)
    hd, wd, bd = (a.double().requires_grad_(True) for a in (h, w, b))
    want = loss(hd, wd, bd)
    want.backward()
    for chunk in (None, 1, 5, 13):
        hh, ww, bb = (a.clone().requires_grad_(True) for a in (h, w, b))
        out = head.linear(hh, ww, y, bias=bb, teacher_hidden=th, teacher_weight=tw, chunk_rows=chunk)
        out.loss.backward()
        R.close(out.loss, want, FP32, f"loss chunk={chunk}")
        for got, ref, n in ((hh.grad, hd.grad, "hidden"), (ww.grad, wd.grad, "weight"), (bb.grad, bd.grad, "bias")):
            R.close(got, ref, 1e-4, f"{n} grad chunk={chunk}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_fraction_without_grpo_uses_0_2_and_tensor_eps_is_read_each_call(backend):
    x, y, _ = R.rows_in(16, 30, seed=19)
    gen = torch.Generator().manual_seed(19)
    l = torch.log_softmax(x, -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
    old = l + 0.3 * torch.randn(16, generator=gen)
    adv = torch.randn(16, generator=gen)
    v = R.valid_rows(y)
    r = torch.exp(R.logprob_rows(x.double(), y) - old.double())
    out = lcg.HeadLoss(lcg.LogProb(), metrics=(lcg.ClipFraction(),), backend=backend)(x, y, old_logprobs=old)
    R.close(out.metrics["clip_fraction"], R.mean_over(((r < 0.8) | (r > 1.2)).double(), v), 1e-6, "clip_fraction eps 0.2")
    eps_high = torch.tensor(0.1)
    head = lcg.HeadLoss(lcg.GRPO(eps_high=eps_high), metrics=(lcg.ClipFraction(),), backend=backend)
    for e in (0.1, 0.5):
        eps_high.fill_(e)
        xx = x.clone().requires_grad_(True)
        out = head(xx, y, advantages=adv, old_logprobs=old, ref_logprobs=l)
        out.loss.backward()
        ref = lambda z: R.mean_over(R.grpo_rows(z, y, adv, old, l, 0.2, e), v)  # noqa: E731
        R.close(out.loss, ref(x.double()), FP32, f"grpo eps_high={e}")
        R.close(xx.grad, _grad(ref, x), FP32, f"grpo grad eps_high={e}")
        R.close(out.metrics["clip_fraction"], R.mean_over(((r < 0.8) | (r > 1 + e)).double(), v), 1e-6, f"clip_fraction {e}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_jsd_at_beta_limits_is_zero(backend, beta):
    x, y, t = R.rows_in(8, 30, seed=20)
    xx = x.clone().requires_grad_(True)
    out = lcg.HeadLoss(lcg.JSD(beta=beta), backend=backend)(xx, y, teacher_logits=t)
    out.loss.backward()
    R.close(out.loss, R.mean_over(R.jsd_rows(x.double(), t, beta), R.valid_rows(y)), FP32, "jsd")
    assert not torch.isnan(xx.grad).any() and xx.grad.abs().max() < 1e-6
