"""GRPO and its metrics, and segment terms (GSPO, a declared DPO), against float64 references."""
import pytest
import torch

import losscodegen as lcg
from losscodegen import symbols as S
from helpers import DEVICE, both_backends, check_head, make_inputs, policy_inputs, run_backward
import reference as R
from losscodegen.testing import compare


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (0.1, 0.28)])
@pytest.mark.parametrize("kl_beta", [0.0, 0.04])
def test_grpo_with_metrics(eps_low, eps_high, kl_beta, dtype):
    logits, labels, g = make_inputs(R=32, V=500, dtype=dtype)
    inputs = policy_inputs(logits, labels, g)
    head = lcg.HeadLoss(lcg.GRPO(eps_low=eps_low, eps_high=eps_high, kl_beta=kl_beta),
                        metrics=(lcg.Entropy(), lcg.ClipFraction(), lcg.RatioMean(), lcg.KLNewOld(),
                                 lcg.LogProb()))
    if kl_beta == 0:
        inputs.pop("ref_logprobs")
    out = check_head(head, logits, labels, **inputs)
    assert 0 < out.metrics["clip_fraction"] < 1  # both regimes are exercised


@pytest.mark.cpu
def test_grpo_zero_gradient_where_clipped():
    logits, labels, g = make_inputs(R=8, V=256, ignored=())
    inputs = policy_inputs(logits, labels, g, spread=0.0)
    inputs["old_logprobs"] = inputs["old_logprobs"] - 1.0  # r = e: clipped above
    inputs["advantages"] = torch.ones(8)                   # positive advantage: no gradient
    x = logits.clone().requires_grad_()
    lcg.HeadLoss(lcg.GRPO())(x, labels, **inputs).loss.backward()
    assert torch.count_nonzero(x.grad) == 0
    inputs["advantages"] = -torch.ones(8)                  # negative advantage: unclipped branch
    x.grad = None
    lcg.HeadLoss(lcg.GRPO())(x, labels, **inputs).loss.backward()
    assert torch.count_nonzero(x.grad) > 0


def test_clip_fraction_default_eps_without_grpo():
    logits, labels, g = make_inputs(R=32, V=256)
    inputs = policy_inputs(logits, labels, g)
    inputs.pop("ref_logprobs"), inputs.pop("advantages")
    check_head(lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.ClipFraction(),)), logits, labels, **inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_segments", [1, 4, 11])
def test_gspo_segments(n_segments, dtype):
    R = 33
    logits, labels, g = make_inputs(R=R, V=500, dtype=dtype, ignored=(0, 7, 8))
    inputs = policy_inputs(logits, labels, g, spread=0.002)
    inputs.pop("ref_logprobs")
    seg = torch.sort(torch.randint(0, n_segments, (R,), generator=g)).values
    if n_segments == 11:
        seg = torch.where(seg == 5, 6, seg)     # an empty segment id in the middle
        labels[seg == 2] = -100                 # a segment whose rows are all ignored
    head = lcg.HeadLoss(lcg.GSPO(), lcg.CrossEntropy(weight=0.1), metrics=(lcg.Entropy(),))
    check_head(head, logits, labels, segment_ids=seg, **inputs)
    check_head(head, logits, labels, segment_ids=seg, num_segments=n_segments, **inputs)
    check_head(head, logits, labels, segment_ids=seg, num_segments=n_segments, divisor=5.0, **inputs)


@pytest.mark.cpu
def test_policy_inputs_are_named_when_missing():
    logits, labels, _ = make_inputs(R=4, V=256)
    with pytest.raises(ValueError, match="advantages"):
        lcg.HeadLoss(lcg.GRPO())(logits, labels, old_logprobs=torch.zeros(4))
    with pytest.raises(ValueError, match="segment_ids"):
        lcg.HeadLoss(lcg.GSPO())(logits, labels, old_logprobs=torch.zeros(4), advantages=torch.zeros(4))
    with pytest.raises(ValueError, match="reduction"):
        lcg.HeadLoss(lcg.GSPO())(logits, labels, old_logprobs=torch.zeros(4),
                                 advantages=torch.zeros(4), segment_ids=torch.zeros(4, dtype=torch.long),
                                 reduction="none")


_OUT_OF_RANGE = r"segment_ids of valid rows must be in \[0, num_segments=2\)"


@pytest.mark.cpu
@pytest.mark.parametrize("bad, match", [
    (dict(segment_ids=torch.tensor([0, -1, 1, 1])), "segment_ids of valid rows must be non-negative; found -1"),
    (dict(segment_ids=torch.tensor([0, -1, 1, 1]), num_segments=2), "must be non-negative; found -1"),
    (dict(segment_ids=torch.tensor([0, 3, 1, 1]), num_segments=2), _OUT_OF_RANGE),
    (dict(segment_ids=torch.tensor([0, 0, 1, 1]), num_segments=-1), "num_segments"),
])
def test_bad_segments_are_named(bad, match):
    logits, labels, _ = make_inputs(R=4, V=256)
    labels = labels.clamp_min(0)  # every row valid
    with pytest.raises(ValueError, match=match):
        lcg.HeadLoss(lcg.GSPO())(logits, labels, old_logprobs=torch.zeros(4), advantages=torch.zeros(4),
                                 **bad)


@pytest.mark.cpu
def test_ignored_rows_may_carry_any_segment_id():
    """Padding rows (ignored) often carry -1 or a huge id: neither is checked nor sizes the segments."""
    logits, labels, g = make_inputs(R=6, V=256, ignored=(1, 4))
    inputs = policy_inputs(logits, labels, g)
    del inputs["ref_logprobs"]
    head = lcg.HeadLoss(lcg.GSPO())
    seg = torch.tensor([0, -1, 0, 1, 10**9, 1])
    out = head(logits, labels, segment_ids=seg, **inputs)
    ref = head(logits, labels, segment_ids=torch.tensor([0, 0, 0, 1, 1, 1]), num_segments=2, **inputs)
    assert torch.equal(out.loss, ref.loss)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dpo_pair_loss_declared_with_segments(dtype):
    """docs/examples.md's DPO: a pair's chosen (sign +1) and rejected (sign -1) responses share a
    segment; segment_mean(seg_rows * sign * (l - ref)) is the pair's reward margin."""
    l = S.target_logit - S.lse
    margin = S.segment_mean(S.token("seg_rows") * S.token("sign") * (l - S.token("ref")))
    DPO = lcg.declare_term("dpo", S.log(1 + S.exp(-S.param("beta") * margin)))
    R, beta = 30, 0.5
    logits, labels, g = make_inputs(R=R, V=500, dtype=dtype, ignored=(0, 10, 20, 23))  # prompts
    seg = torch.arange(R) // 10                                  # three pairs of 10 rows
    sign = torch.where(torch.arange(R) % 10 < 5, 1.0, -1.0)     # chosen, then rejected
    valid = labels != -100
    seg_rows = torch.zeros(3).index_add_(0, seg, valid.float())[seg]
    with torch.no_grad():
        lp = torch.log_softmax(logits.double(), -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
    ref = (lp + 0.3 * torch.randn(R, generator=g, dtype=torch.float64)).float()

    x = logits.detach().double().requires_grad_()
    l_ref = torch.log_softmax(x, -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
    per_row = torch.where(valid, sign.double() * (l_ref - ref.double()), 0.0)
    pair_margin = torch.zeros(3, dtype=torch.float64).index_add(0, seg, per_row)
    expected = torch.nn.functional.softplus(-beta * pair_margin).mean()
    expected.backward()

    head = lcg.HeadLoss(DPO(beta=beta))
    xs = logits.detach().clone().requires_grad_()
    out = head(xs, labels, segment_ids=seg, num_segments=3, seg_rows=seg_rows, sign=sign, ref=ref)
    out.loss.backward()
    assert abs(out.loss.item() - expected.item()) <= 1e-5 * max(1.0, abs(expected.item()))
    assert abs(out.terms["dpo"].item() - expected.item()) <= 1e-5 * max(1.0, abs(expected.item()))
    err = (xs.grad.double() - x.grad).abs().max().item()  # bf16: the rounding of the stored gradient
    assert err <= (1e-5 if dtype == torch.float32 else 8e-3) * x.grad.abs().max().item(), err


@pytest.mark.cpu
def test_segment_ids_must_be_shaped_like_labels():
    logits, labels, _ = make_inputs(R=6, V=256, shape=(2, 3))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \(2, 3\)"):
        lcg.HeadLoss(lcg.GSPO())(logits, labels, old_logprobs=torch.zeros(2, 3), advantages=torch.zeros(2, 3),
                                 segment_ids=torch.zeros(3, 2, dtype=torch.long))


# GSPO-token (arXiv 2507.18071, eq. 13): per token s = sg(R_seq) * pi(y_t) / sg(pi(y_t)), R_seq the
# sequence's geometric-mean ratio; each token's clipped objective, with no length of its own: its
# sequence's mean over its tokens comes from normalize="sequence"
_l = S.target_logit - S.lse
_s = S.stop_gradient(S.exp(S.segment_mean(_l - S.token("old_logprobs")))) * S.exp(_l - S.stop_gradient(_l))
_A = S.token("advantages")
GSPOToken = lcg.declare_term(
    "gspo_token", -S.Min(_s * _A, S.clamp(_s, 1 - S.param("eps_low"), 1 + S.param("eps_high")) * _A),
    defaults={"eps_low": 0.2, "eps_high": 0.28})


def _seq_mean_token_mean(logits, labels, seg, A, old, n_seg, *, token=True, reduction="mean",
                         eps_low=0.2, eps_high=0.28):
    """verl's "seq-mean-token-mean" in float64 torch (not losscodegen's reference): each sequence's
    mean over its valid tokens of GSPO-token's per-token loss (``token=False``: GSPO's, whose ratio
    and advantage are the sequence's), then the mean over ``n_seg`` sequences, an empty one counting
    0 (``reduction="sum"``: their sum)."""
    l = torch.log_softmax(logits, -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
    total = logits.new_zeros(())
    for s in range(n_seg):
        rows = (seg == s) & (labels != -100)
        if not rows.any():
            continue
        ratio = torch.exp((l[rows] - old[rows]).mean())
        if token:
            r, adv = ratio.detach() * torch.exp(l[rows] - l[rows].detach()), A[rows]
        else:
            r, adv = ratio, A[rows].mean()
        total = total + (-torch.minimum(r * adv, r.clamp(1 - eps_low, 1 + eps_high) * adv)).mean()
    return total if reduction == "sum" else total / n_seg


def _sequences(dtype, R=26, V=64, H=16):
    """Rows of 7 sequences (ids 0..6 of valid rows): ignored rows, sequence 2 with no row and 4 with
    only ignored ones (both empty, both counted); old log-probs 0.3 away, so that ratios clip."""
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(R, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, V, (R,), generator=g)
    seg = torch.tensor([0] * 5 + [1] * 2 + [3] * 7 + [4] * 3 + [5] * 6 + [6] * 3)
    labels[[1, 8, 20]] = -100
    labels[seg == 4] = -100
    logits = (hidden @ weight.t()).to(dtype).double()
    with torch.no_grad():
        lp = torch.log_softmax(logits, -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
    old = (lp + 0.3 * torch.randn(R, generator=g, dtype=torch.float64)).float()
    A = torch.randn(R, generator=g).float()
    return hidden.to(dtype), weight.to(dtype), labels, seg, A, old


@pytest.mark.parametrize("dtype,backend", [(torch.float32, "triton"), (torch.float32, "torch"),
                                           (torch.bfloat16, "triton"), (torch.bfloat16, "torch")],
                         indirect=["backend"])
def test_gspo_token_with_sequence_mean_normalization(dtype, backend):
    """TRL/verl's GSPO-token with "seq-mean-token-mean": normalize="sequence" on a row term that reads
    its sequence's mean ratio; by num_segments (a trailing empty sequence), else the largest valid
    sequence id + 1; reduction="sum"; head(...) and head.linear; value and gradient."""
    hidden, weight, labels, seg, A, old = _sequences(dtype)
    head = lcg.HeadLoss(GSPOToken(normalize="sequence"))
    inputs = dict(segment_ids=seg.to(DEVICE), advantages=A.to(DEVICE), old_logprobs=old.to(DEVICE))
    rtol, atol, grad_tol = lcg.testing.TOLERANCES[dtype]
    for kw, n_seg in ((dict(num_segments=8), 8), ({}, 7), (dict(reduction="sum"), 7)):
        x64 = (hidden.double() @ weight.double().t()).to(dtype).double().requires_grad_()
        want = _seq_mean_token_mean(x64, labels, seg, A.double(), old.double(), n_seg,
                                    reduction=kw.get("reduction", "mean"))
        want.backward()
        x = x64.detach().to(dtype).to(DEVICE).requires_grad_()
        out = head(x, labels.to(DEVICE), **inputs, **kw)
        out.loss.backward()
        compare("loss", out.loss, want.detach(), dtype)
        compare("gspo_token", out.terms["gspo_token"], want.detach(), dtype)
        compare("gradient", x.grad, x64.grad, dtype)

        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        _seq_mean_token_mean(h64 @ w64.t(), labels, seg, A.double(), old.double(), n_seg,
                             reduction=kw.get("reduction", "mean")).backward()
        h, w = hidden.to(DEVICE).clone().requires_grad_(), weight.to(DEVICE).clone().requires_grad_()
        fused = head.linear(h, w, labels.to(DEVICE), chunk_rows=8, **inputs, **kw)
        fused.loss.backward()
        # (bf16: the fused head's logits are rounded from the product; the reference's are not)
        tol = dict(tolerances=(1e-2, 1e-2, 3e-2)) if dtype == torch.bfloat16 else {}
        compare("loss", fused.loss, want.detach(), dtype, **tol)
        compare("gradient of hidden", h.grad, h64.grad, dtype, **tol)
        compare("gradient of weight", w.grad, w64.grad, dtype, **tol)
    # normalised by tokens it is another loss (the sequences' lengths differ): the option is read
    by_tokens = lcg.HeadLoss(GSPOToken())(x.detach(), labels.to(DEVICE), **inputs).loss.item()
    by_sequence = head(x.detach(), labels.to(DEVICE), **inputs).loss.item()
    assert abs(by_tokens - by_sequence) > 10 * (atol + rtol * abs(by_sequence)), (by_tokens, by_sequence)


@pytest.mark.parametrize("dtype,backend", [(torch.float32, "torch"), (torch.bfloat16, "triton")],
                         indirect=["backend"])
def test_gspo_with_sequence_mean_normalization_counts_every_sequence(dtype, backend):
    """GSPO (a term of sequence statistics alone) with normalize="sequence": divided by every sequence,
    the empty ones too, where by default it is divided by the non-empty ones; and the public float64
    reference (assert_parity) agrees for it and for GSPO-token."""
    hidden, weight, labels, seg, A, old = _sequences(dtype)
    head = lcg.HeadLoss(lcg.GSPO(normalize="sequence", eps_low=0.2, eps_high=0.28))
    inputs = dict(segment_ids=seg.to(DEVICE), advantages=A.to(DEVICE), old_logprobs=old.to(DEVICE))
    x64 = (hidden.double() @ weight.double().t()).to(dtype).double().requires_grad_()
    want = _seq_mean_token_mean(x64, labels, seg, A.double(), old.double(), 8, token=False)
    want.backward()
    x = x64.detach().to(dtype).to(DEVICE).requires_grad_()
    out = head(x, labels.to(DEVICE), num_segments=8, **inputs)
    out.loss.backward()
    compare("loss", out.loss, want.detach(), dtype)
    compare("gradient", x.grad, x64.grad, dtype)
    by_default = lcg.HeadLoss(lcg.GSPO(eps_low=0.2, eps_high=0.28))(x.detach(), labels.to(DEVICE), num_segments=8,
                                                                    **inputs).loss
    compare("loss", by_default * 5 / 8, want.detach(), dtype)   # (5 sequences with a valid row, of 8)
    for term in (lcg.GSPO(normalize="sequence"), GSPOToken(normalize="sequence")):
        lcg.testing.assert_parity(lcg.HeadLoss(term, lcg.CrossEntropy(weight=0.1)), rows=20, vocab=48,
                                  dtypes=(dtype,), regimes=("randn", "policy_edges"))


# ---- against the hand-written formulas (tests/reference.py), both backends: the second in the slow tier ----


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("torch"), indirect=True)
def test_grpo_with_kl_and_policy_metrics_match_formulas(backend):
    x, y, _ = R.rows_in(16, 48, seed=4)
    gen = torch.Generator().manual_seed(5)
    l = torch.log_softmax(x, -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
    old = l + 0.4 * torch.randn(16, generator=gen)
    ref = l + 0.2 * torch.randn(16, generator=gen)
    adv = torch.randn(16, generator=gen)
    head = lcg.HeadLoss(lcg.GRPO(eps_low=0.2, eps_high=0.28, kl_beta=0.05),
                        metrics=(lcg.RatioMean(), lcg.ClipFraction(), lcg.KLNewOld(), lcg.LogProb()), backend=backend)
    out, g = run_backward(head, x, y, advantages=adv, old_logprobs=old, ref_logprobs=ref)
    v = R.valid_rows(y)

    def loss(z):
        return R.mean_over(R.grpo_rows(z, y, adv, old, ref, 0.2, 0.28, 0.05), v)
    R.close(out.loss, loss(x.double()), R.FP32, "loss")
    R.close(g, R.grad(loss, x), R.FP32, "grad")
    lp = R.logprob_rows(x.double(), y)
    r = torch.exp(lp - old.double())
    R.close(out.metrics["ratio_mean"], R.mean_over(r, v), R.FP32, "ratio_mean")
    R.close(out.metrics["clip_fraction"], R.mean_over(((r < 0.8) | (r > 1.28)).double(), v), 1e-6, "clip_fraction")
    R.close(out.metrics["kl_new_old"], R.mean_over(r - torch.log(r) - 1, v), R.FP32, "kl_new_old")
    R.close(out.metrics["logprob"], R.mean_over(lp, v), R.FP32, "logprob")


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("triton"), indirect=True)
def test_gspo_divides_by_non_empty_segments(backend):
    x, y, _ = R.rows_in(16, 40, seed=6, ignored=(1, 6, 7))
    gen = torch.Generator().manual_seed(7)
    l = torch.log_softmax(x, -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
    old = l + 0.001 * torch.randn(16, generator=gen)
    adv = torch.randn(16, generator=gen)
    # segments 0..4 plus a huge global sample index; segment 3 holds only ignored rows (6, 7)
    seg = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 4, 4, 4, 4, 10**9, 10**9, 2, 2])
    head = lcg.HeadLoss(lcg.GSPO(), backend=backend)
    out, g = run_backward(head, x, y, advantages=adv, old_logprobs=old, segment_ids=seg)
    v = R.valid_rows(y)

    def loss(z):
        return R.gspo_total(z, y, adv, old, seg, v)
    R.close(out.loss, loss(x.double()), R.FP32, "loss")
    R.close(g, R.grad(loss, x), R.FP32, "grad")


@pytest.mark.cpu
@pytest.mark.parametrize("backend", both_backends("torch"), indirect=True)
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
        R.close(out.loss, ref(x.double()), R.FP32, f"grpo eps_high={e}")
        R.close(xx.grad, R.grad(ref, x), R.FP32, f"grpo grad eps_high={e}")
        R.close(out.metrics["clip_fraction"], R.mean_over(((r < 0.8) | (r > 1 + e)).double(), v), 1e-6, f"clip_fraction {e}")
