"""The formula language's second level: segment sums (a sequence's total without length tokens),
the row max of the logits (max-z loss), and the refusals that say what to write instead. Each
against the float64 reference, through head(...), head.linear(...) and vocab-parallel (2 gloo ranks)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import losscodegen as lcg
from losscodegen import symbols as S
from helpers import run_ranks

# every test here runs on both backends (conftest's ``backend``: the heads built with backend="auto";
# spawned ranks take the parent's), on CPU tensors (conftest's ``cpu``)
pytestmark = [pytest.mark.usefixtures("backend"), pytest.mark.cpu]

_l = S.target_logit - S.lse
# Dr. GRPO-style sequence loss (arXiv 2503.20783): each sequence's summed -A*log p, over a constant
# length budget instead of its own length; here divided by sqrt(length) to read segment_count too
SeqPG = lcg.declare_term(
    "seq_pg", -S.segment_sum(S.token("advantages") * _l) / S.segment_count ** S.param("power"),
    defaults={"power": 0.5})
# GSPO-token (arXiv 2507.18071, eq. 13): per token s = sg(R_seq) * pi(y_t) / sg(pi(y_t)), R_seq the
# sequence's geometric-mean ratio; each token's clipped objective over its sequence's length (with
# divisor= the number of sequences, the paper's mean of sequence means)
_R = S.exp(S.segment_mean(_l - S.token("old_logprobs")))
_s = S.stop_gradient(_R) * S.exp(_l - S.stop_gradient(_l))
_A = S.token("advantages")
GSPOToken = lcg.declare_term(
    "gspo_token", -S.Min(_s * _A, S.clamp(_s, 1 - S.param("eps_low"), 1 + S.param("eps_high")) * _A) / S.segment_count,
    defaults={"eps_low": 3e-4, "eps_high": 4e-4})
# a per-token term whose direct path reads the mean too: each log-prob's squared distance to its sequence's
SeqSpread = lcg.declare_term("seq_spread", (_l - S.segment_mean(_l)) ** 2)
# label smoothing toward a prior over the classes instead of the uniform one (Szegedy et al.,
# arXiv 1512.00567, sec. 7: u(k) may be any distribution, e.g. the unigram one), a [V] input
PriorSmoothing = lcg.declare_term(
    "prior_smoothing",
    (1 - S.param("eps")) * (S.lse - S.target_logit) + S.param("eps") * S.vsum(S.vector("prior") * (S.lse - S.logit)),
    defaults={"eps": 0.1})
# Baichuan 2 (arXiv 2309.10305) max-z loss: 2e-4 * (max_i z_i)^2 per token
MaxZ = lcg.declare_term("max_z", S.row_max ** 2)
MaxGap = lcg.declare_term("max_gap", S.row_max - S.target_logit, metric_only=True)
# LogitNorm (arXiv 2205.09310): cross-entropy of z / (tau * ||z||), ||z|| a first-read sum inside the
# softmax's sum (read again once it is known), shifted by the row max so that no exp overflows
_k = 1 / (S.param("tau") * (S.sqrt(S.vsum(S.logit ** 2)) + 1e-7))
LogitNorm = lcg.declare_term(
    "logit_norm", _k * (S.row_max - S.target_logit) + S.log(S.vsum(S.exp(_k * (S.logit - S.row_max)))),
    defaults={"tau": 0.04})
# A temperature known only at run time, inside the exponents (read relative to the row maxima in a
# read after the stats): cross-entropy at a per-row temperature tau (a token, e.g. one per sequence),
# with the entropy of softmax(z / tau) from exp(z / tau) written inside vsum
_tau = S.token("tau")
RowTemperatureCE = lcg.declare_term("row_temperature_ce", S.lse_at(_tau) - S.target_logit / _tau)
RowTemperatureEntropy = lcg.declare_term(
    "row_temperature_entropy",
    S.log(S.vsum(S.exp(S.logit / _tau))) - S.vsum(S.logit / _tau * S.exp(S.logit / _tau)) / S.vsum(S.exp(S.logit / _tau)),
    metric_only=True)
# CTKD's instance-wise temperature (Li et al., arXiv 2211.16231), given per row (detached): KD at tau
InstanceKD = lcg.declare_term(
    "instance_kd", S.vsum(S.teacher_prob_at(_tau) * (S.teacher_logprob_at(_tau) - S.logsoftmax_at(_tau))))
# a 0-dim tensor temperature (a schedule: one kernel for every value), as Annealing-KD's
TensorTemperatureCE = lcg.declare_term("tensor_temperature_ce", S.lse_at(S.param("T")) - S.target_logit / S.param("T"))


def _heads():
    return {"segment_sum": lcg.HeadLoss(SeqPG(), lcg.CrossEntropy(weight=0.3)),
            "row_reads_segment": lcg.HeadLoss(GSPOToken(), SeqSpread(weight=0.5), lcg.CrossEntropy(weight=0.1)),
            "row_max": lcg.HeadLoss(lcg.CrossEntropy(), MaxZ(weight=2e-4 * 500), metrics=(MaxGap(),)),
            "row_max_softcap": lcg.HeadLoss(MaxZ(), softcap=4.0, logit_scale=0.8),
            "vector": lcg.HeadLoss(PriorSmoothing(), metrics=(lcg.Entropy(),)),
            "nested_vsum": lcg.HeadLoss(LogitNorm(), metrics=(lcg.Entropy(),)),
            # an inner sum as the row factor of an online outer sum (the mean logit times the sum of z p)
            "nested_row_factor": lcg.HeadLoss(lcg.declare_term(
                "centred", S.vsum(S.softmax * S.logit * S.vsum(S.logit) / S.vocab_size))()),
            # lse - max: row_max as the factor of an online sum
            "row_max_in_vsum": lcg.HeadLoss(lcg.declare_term("log_mass", S.log(S.vsum(S.exp(S.logit - S.row_max))))()),
            "run_time_temperature": lcg.HeadLoss(RowTemperatureCE(), TensorTemperatureCE(T=torch.tensor(1.7), weight=0.5),
                                                 metrics=(RowTemperatureEntropy(),)),
            # Hinton's KD with the temperature a tensor: student and teacher normalisers both at run time
            "tensor_temperature_kd": lcg.HeadLoss(lcg.ForwardKL(temperature=torch.tensor(2.5)), lcg.CrossEntropy()),
            "row_temperature_kd": lcg.HeadLoss(InstanceKD(), lcg.CrossEntropy(weight=0.2)),
            # run-time temperatures inside segment statistics: a sequence's tempered NLL, and a row term
            # reading a segment mean of the tempered mean logit
            "run_time_temperature_segments": lcg.HeadLoss(
                lcg.declare_term("seq_nll_T", S.segment_sum(TensorTemperatureCE.formula) ** 2 / 100)(T=torch.tensor(1.5)),
                lcg.declare_term("ce_tau_by_mean", RowTemperatureCE.formula * S.segment_mean(
                    S.vsum(S.softmax_at(S.param("T")) * S.logit)) ** 2)(T=torch.tensor(0.7)))}


def _inputs(head, rows, g):
    """The per-row temperatures a head reads: positive, some below 1 (sharper than the logits)."""
    return {"tau": torch.rand(rows, generator=g, dtype=torch.float64) * 1.5 + 0.3} if head.terms_reading("tau") else {}


# A sum read as the row factor of another's summand keeps the row maximum in two row coefficients whose
# difference is the gradient (docs/decisions.md, "Numerics": a gap left): on a spread row (|z| ~ 4000)
# 8 times plain torch's error; the other regimes hold it to the oracle
_REGIMES = {"nested_row_factor": tuple(r for r in lcg.testing.DEFAULT_REGIMES if r != "spread")}


@pytest.mark.parametrize("name", list(_heads()))
def test_construct_matches_float64_reference(name):
    head = _heads()[name]
    lcg.testing.assert_parity(head, rows=18, vocab=70, regimes=_REGIMES.get(name, lcg.testing.DEFAULT_REGIMES),
                              **_inputs(head, 18, torch.Generator().manual_seed(0)))


def test_a_nested_row_factor_on_a_spread_row_is_within_what_fp32_rounding_of_the_maximum_allows():
    """The gap above, bounded: the error is an ulp of the row maximum times the inner sum's factor
    (the two coefficients that should cancel are each of size m * vsum(z) / V), not a wrong gradient."""
    head = _heads()["nested_row_factor"]
    logits, labels, kw = lcg.testing.random_inputs(head, 18, 70, regime="spread")
    x = logits.clone().requires_grad_()
    head(x, labels, **kw).loss.backward()
    _, _, want = lcg.testing.reference(head)(logits, labels, **kw)
    m = logits.abs().amax(-1, keepdim=True).double()
    inner = logits.double().sum(-1, keepdim=True).abs() / 70
    bound = 8 * 2.0**-24 * m * inner / 18     # (the mean's 1/rows)
    assert ((x.grad.double() - want).abs() <= bound + 1e-6).all()


def test_segment_sum_is_the_segments_total():
    """segment_sum(l) of a sequence is its log-probability: sum over its valid rows, by hand."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(9, 30, generator=g, dtype=torch.float64)
    y = torch.randint(0, 30, (9,), generator=g)
    y[4] = -100
    seg = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2])
    head = lcg.HeadLoss(lcg.declare_term("seq_logp", S.segment_sum(_l))(), )
    out = head(z.float(), y, segment_ids=seg, num_segments=3)
    lp = torch.log_softmax(z, -1).gather(1, y.clamp_min(0)[:, None])[:, 0].masked_fill(y == -100, 0)
    expected = torch.stack([lp[seg == s].sum() for s in range(3)]).mean()
    assert abs(out.loss.item() - expected.item()) <= 1e-5 * abs(expected.item())


def test_row_max_gradient_goes_to_the_first_maximum_like_torch():
    z = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.1, 0.5, 0.2]])
    y = torch.tensor([0, 3])
    x = z.clone().requires_grad_()
    lcg.HeadLoss(MaxZ())(x, y).loss.backward()
    ref = z.double().clone().requires_grad_()
    (ref.gather(1, ref.argmax(-1, keepdim=True)) ** 2).mean().backward()
    assert torch.equal(x.grad, ref.grad.float())


def _linear(name):
    head = _heads()[name]
    g = torch.Generator().manual_seed(1)
    R, H, V = 12, 16, 40
    hidden, weight = torch.randn(R, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    labels = torch.randint(0, V, (R,), generator=g)
    labels[2] = -100
    inputs = {}
    if head.terms_reading("segment_ids"):
        inputs = dict(segment_ids=torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3]), num_segments=4,
                      advantages=torch.randn(R, generator=g))
    inputs.update(_inputs(head, R, g))
    if head.terms_reading("teacher_logits"):
        inputs["teacher_logits"] = torch.randn(R, V, generator=g) * 2
    if head.terms_reading("prior"):
        inputs["prior"] = torch.softmax(torch.randn(V, generator=g), -1)
    if head.terms_reading("old_logprobs"):
        with torch.no_grad():
            lp = torch.log_softmax(hidden @ weight.T, -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
        inputs["old_logprobs"] = lp + 3e-4 * torch.randn(R, generator=g)   # ratios on both clip sides
    return head, hidden, weight, labels, inputs


@pytest.mark.parametrize("name", ["segment_sum", "row_reads_segment", "row_max", "nested_vsum", "vector",
                                  "run_time_temperature", "tensor_temperature_kd"])
def test_construct_through_linear_equals_logits(name):
    head, hidden, weight, labels, inputs = _linear(name)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    teacher = {} if "teacher_logits" not in inputs else dict(   # (the teacher's hidden states: its logits)
        teacher_hidden=inputs["teacher_logits"], teacher_weight=torch.eye(inputs["teacher_logits"].shape[-1]))
    fused = head.linear(h1, w1, labels, chunk_rows=5, **teacher,
                        **{k: v for k, v in inputs.items() if k != "teacher_logits"})
    fused.loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    plain = head(h2 @ w2.T, labels, **inputs)
    plain.loss.backward()
    assert torch.allclose(fused.loss, plain.loss, rtol=1e-5, atol=1e-6)
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-4, atol=1e-6)
    assert torch.allclose(w1.grad, w2.grad, rtol=1e-4, atol=1e-6)


def _vp_worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name in ("segment_sum", "row_reads_segment", "row_max", "nested_vsum", "vector", "run_time_temperature",
                 "tensor_temperature_kd"):
        head, hidden, weight, labels, inputs = _linear(name)
        z = (hidden @ weight.T).detach()
        full = z.clone().requires_grad_()
        ref = head(full, labels, **inputs)
        ref.loss.backward()
        Vl = z.shape[-1] // world
        shard = z[:, rank * Vl:(rank + 1) * Vl].clone().requires_grad_()
        if "teacher_logits" in inputs:
            inputs["teacher_logits"] = inputs["teacher_logits"][:, rank * Vl:(rank + 1) * Vl]
        out = head(shard, labels, process_group=dist.group.WORLD, **inputs)
        out.loss.backward()
        err = (shard.grad - full.grad[:, rank * Vl:(rank + 1) * Vl]).abs().max().item()
        values = {k: (v.item(), ref.metrics[k].item()) for k, v in out.metrics.items()}
        queue.put((name, out.loss.item(), ref.loss.item(), err, full.grad.abs().max().item(), values))
    dist.destroy_process_group()


def test_constructs_vocab_parallel_equal_unsharded():
    for name, loss, ref, err, scale, values in run_ranks(_vp_worker, 2, 14):
        assert abs(loss - ref) <= 1e-5 * max(1.0, abs(ref)), (name, loss, ref)
        assert err <= 1e-5 * scale, (name, err, scale)
        for k, (v, r) in values.items():
            assert abs(v - r) <= 1e-5 * max(1.0, abs(r)), (name, k, v, r)


def test_explain_shows_the_segment_count_the_argmax_gradient_and_the_nested_sum():
    text = _heads()["segment_sum"].explain()
    assert "segment term seq_pg" in text and "count" in text
    assert "is_argmax" in _heads()["row_max"].explain()
    assert "row term of segment statistics (row by row, in the segment kernel) gspo_token" \
        in _heads()["row_reads_segment"].explain()
    # ||z||^2 in the first read, the softmax of z / (tau*||z||) in the second
    text = _heads()["nested_vsum"].explain()
    assert "sum_i 1 * z**2    [online]" in text and "exact" in text and "2 for the loss" in text


def test_a_tensor_temperature_follows_its_value_without_a_new_kernel():
    """A schedule writes the temperature in place: the next call reads it, and equals a head built
    with that number (the number's online path against the tensor's exact read)."""
    T = torch.tensor(2.0)
    head = lcg.HeadLoss(lcg.ForwardKL(temperature=T), lcg.ReverseKL(temperature=T, weight=0.5))
    g = torch.Generator().manual_seed(3)
    z, t = torch.randn(10, 50, generator=g) * 4, torch.randn(10, 50, generator=g) * 4
    y = torch.randint(0, 50, (10,), generator=g)
    y[3] = -100
    first, kernel = head(z, y, teacher_logits=t).loss, head.kernel
    for value in (0.5, 3.0):
        T.fill_(value)
        x1, x2 = z.clone().requires_grad_(), z.clone().requires_grad_()
        out = head(x1, y, teacher_logits=t)
        out.loss.backward()
        fixed = lcg.HeadLoss(lcg.ForwardKL(temperature=value), lcg.ReverseKL(temperature=value, weight=0.5))
        want = fixed(x2, y, teacher_logits=t)
        want.loss.backward()
        assert not torch.allclose(out.loss, first)
        assert torch.allclose(out.loss, want.loss, rtol=1e-5, atol=1e-6), (value, out.loss, want.loss)
        assert torch.allclose(x1.grad, x2.grad, rtol=1e-4, atol=1e-7)
    assert head.kernel is kernel
    assert "exp(tm/p_forward_kl__temperature)    [exact: an exponent's coefficient known at run time" in head.explain()


def test_a_run_time_temperature_on_split_launches_and_large_logits():
    """Logits near 100 at a temperature of 0.3 (exp(z / tau) past 88 without the row max), one
    launch per read."""
    from losscodegen.backends.triton import tiles
    head = _heads()["run_time_temperature"]
    head.tile_override = tiles.Config(4096, 8, split=True)
    g = torch.Generator().manual_seed(5)
    z = torch.randn(14, 300, generator=g, dtype=torch.float64) * 3 + 100
    y = torch.randint(0, 300, (14,), generator=g)
    y[2] = -100
    tau = torch.rand(14, generator=g, dtype=torch.float64) * 0.5 + 0.25
    want_loss, want, want_grad = lcg.testing.reference(head)(z, y, tau=tau)
    x = z.float().requires_grad_()
    out = head(x, y, tau=tau.float())
    out.loss.backward()
    for name, got, expected in [("loss", out.loss, want_loss), ("gradient", x.grad, want_grad)] + [
            (n, v, want[n]) for n, v in {**out.terms, **out.metrics}.items()]:
        lcg.testing.compare(name, got, expected, torch.float32)


def test_a_run_time_temperature_per_row_under_reduction_none_matches_the_reference():
    head = _heads()["run_time_temperature"]
    g = torch.Generator().manual_seed(8)
    z = torch.randn(9, 30, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, 30, (9,), generator=g)
    y[1] = -100
    tau = torch.rand(9, generator=g, dtype=torch.float64) + 0.2
    upstream = torch.randn(9, generator=g, dtype=torch.float64)
    x = z.float().requires_grad_()
    out = head(x, y, tau=tau.float(), reduction="none")
    (out.loss * upstream.float()).sum().backward()
    ref = z.clone().requires_grad_()

    def nll(scaled):
        return -torch.log_softmax(scaled, -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
    # row_temperature_ce + 0.5 * tensor_temperature_ce (T = 1.7) per row, 0 where ignored
    want = torch.where(y == -100, 0.0, nll(ref / tau[:, None]) + 0.5 * nll(ref / 1.7))
    (want * upstream).sum().backward()
    lcg.testing.compare("loss", out.loss, want.detach(), torch.float32)
    lcg.testing.compare("gradient", x.grad, ref.grad, torch.float32)


def test_a_tensor_temperature_not_positive_when_the_term_is_built_is_refused():
    for value in (0.0, -1.0):
        with pytest.raises(ValueError, match="forward_kl: a temperature must be > 0"):
            lcg.ForwardKL(temperature=torch.tensor(value))


def test_a_tensor_temperature_where_a_sum_reads_its_normalisers_inside_a_log_is_refused_saying_what_to_write():
    with pytest.raises(ValueError, match="jsd: temperature as a tensor.*give the temperature as a number"):
        lcg.JSD(beta=0.3, temperature=torch.tensor(2.0))
    T = S.param("T")
    m = S.log(S.softmax_at(T) / 2 + S.teacher_prob_at(T) / 2)
    head = lcg.HeadLoss(lcg.declare_term("js", S.vsum(S.softmax_at(T) * (S.logsoftmax_at(T) - m)))(T=torch.tensor(2.0)))
    with pytest.raises(ValueError, match="known only at run time.*give the temperature as a number"):
        head.explain()
    lcg.testing.assert_parity(lcg.HeadLoss(lcg.TopKForwardKL(temperature=torch.tensor(2.0))), rows=10, vocab=40)


def test_an_exponent_not_linear_in_the_element_with_a_row_coefficient_is_refused_saying_what_to_write():
    with pytest.raises(ValueError, match="write the exponent linear in the element"):
        lcg.declare_term("x", S.log(S.vsum(S.exp(S.logit ** 2 / S.token("tau")))))


def test_a_nested_sum_that_needs_a_second_read_itself_is_refused():
    inner = S.vsum(S.softmax * S.log(S.softmax + S.teacher_prob))   # an exact sum
    head = lcg.HeadLoss(lcg.declare_term("x", S.vsum(S.softmax * inner))())
    with pytest.raises(ValueError, match="must be one of the first read"):
        head.explain()   # (the head is lowered at its first use)


@pytest.mark.parametrize("formula,match", [
    (S.segment_count * _l, "segment_count"),
    (S.segment_count * S.segment_mean(_l) + S.vsum(S.segment_count * S.softmax), "segment_count"),
    (S.vsum(S.logit * S.vsum(S.softmax * S.row_max)), "nested reductions"),
    (S.vsum(S.logit * S.vsum(S.logit * S.vsum(S.logit))), "nested reductions"),
    (S.topk_sum(S.topk_logit * S.vsum(S.logit)), "nested reductions"),
])
def test_outside_the_language_is_refused_saying_what_to_write(formula, match):
    with pytest.raises(ValueError, match=match):
        lcg.declare_term("x", formula)


def test_dpo_declared_as_in_the_docs_equals_the_built_in():
    """docs/adding-a-loss.md's DPO, written with segment_sum and a chosen token, is P.DPO."""
    from losscodegen import preference as P
    chosen, lr = S.token("chosen"), S.token("ref_logprobs")
    margin = S.segment_sum(chosen * (_l - lr)) - S.segment_sum((1 - chosen) * (_l - lr))
    declared = lcg.HeadLoss(lcg.declare_term("dpo", -P.logsigmoid(S.param("beta") * margin))(beta=0.3))
    built_in = lcg.HeadLoss(P.DPO(beta=0.3))
    g = torch.Generator().manual_seed(4)
    z = torch.randn(4, 5, 30, generator=g)
    y = torch.randint(0, 30, (4, 5), generator=g)
    y[:, 0] = -100
    inputs = P.pair_inputs(built_in, y, ref_chosen_logps=torch.tensor([-12.0, -14.0]),
                           ref_rejected_logps=torch.tensor([-13.0, -11.0]))
    grads = []
    for head in (declared, built_in):
        x = z.clone().requires_grad_()
        head(x, y, **inputs).loss.backward()
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    lcg.testing.assert_parity(declared, rows=20, vocab=30, labels=y.reshape(-1),
                              **{k: (v.reshape(-1) if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()})


def test_gspo_token_matches_the_papers_formula_in_torch():
    """GSPO-token against its definition written in float64 torch with .detach() (not our reference):
    loss = (1/G) sum_seq (1/|seq|) sum_t -min(s_t A_t, clip(s_t) A_t), s_t = sg(R) pi_t / sg(pi_t)."""
    g = torch.Generator().manual_seed(5)
    R, V, eps_low, eps_high = 14, 40, 3e-4, 4e-4
    z = torch.randn(R, V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (R,), generator=g)
    y[[2, 9]] = -100
    seg = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3])
    A = torch.randn(R, generator=g, dtype=torch.float64)
    with torch.no_grad():
        old = torch.log_softmax(z, -1).gather(1, y.clamp_min(0)[:, None])[:, 0] + 4e-4 * torch.randn(R, generator=g)
    x = z.clone().requires_grad_()
    l = torch.log_softmax(x, -1).gather(1, y.clamp_min(0)[:, None])[:, 0]
    total = 0
    for s in range(4):
        rows = (seg == s) & (y != -100)
        ratio = torch.exp((l[rows] - old[rows]).mean())
        st = ratio.detach() * torch.exp(l[rows] - l[rows].detach())
        total = total + (-torch.minimum(st * A[rows], st.clamp(1 - eps_low, 1 + eps_high) * A[rows])).mean()
    (total / 4).backward()
    ours = z.float().clone().requires_grad_()
    out = lcg.HeadLoss(GSPOToken())(ours, y, segment_ids=seg, num_segments=4, advantages=A.float(),
                                    old_logprobs=old.float(), divisor=4.0)
    out.loss.backward()
    assert abs(out.loss.item() - total.item() / 4) <= 1e-5 * max(1.0, abs(total.item() / 4))
    err = (ours.grad.double() - x.grad).abs().max().item()
    assert err <= 1e-4 * x.grad.abs().max().item(), err


def test_row_term_of_segment_statistics_refuses_sequence_parallel_and_says_why():
    head = lcg.HeadLoss(SeqSpread())
    z, y = torch.randn(4, 10), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="segment_group"):
        head(z, y, segment_ids=torch.tensor([0, 0, 1, 1]), num_segments=2, segment_group=object())


def test_no_segments_with_a_valid_row_is_refused_and_writes_only_the_segment_region(monkeypatch):
    """num_segments=0 with a valid row (validate=True): the row's id is flagged, and its clamped slot
    is the segment region's one slot, not the fixed slots before it (the valid-row count) nor, in
    the segment kernel's rows, the regions before the coefficients."""
    from losscodegen import segments
    head = lcg.HeadLoss(SeqSpread(), lcg.CrossEntropy())
    seen = []

    def run(call, ws, n_seg, kernel, args, ignore_index, _run=segments.run):
        before = ws.t.clone()
        _run(call, ws, n_seg, kernel, args, ignore_index)
        seen.append((ws, before, ws.t.clone()))
    monkeypatch.setattr(segments, "run", run)
    z, y = torch.randn(4, 10), torch.tensor([1, -100, 3, 4])
    with pytest.raises(ValueError, match="segment_ids"):
        head(z, y, segment_ids=torch.tensor([0, 0, 1, 1]), num_segments=0)
    (ws, before, after), = seen
    k = head.kernel
    assert before[k.COUNT].item() == 3 and before[k.DONE].item() == 4
    # the segment kernel writes the outputs, the loss and the coefficients only
    torch.testing.assert_close(after[k.LOSS + 1:ws.off_seg_coefs], before[k.LOSS + 1:ws.off_seg_coefs],
                               rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", ["segment_sum", "row_reads_segment", "row_max", "nested_vsum", "run_time_temperature",
                                  "tensor_temperature_kd"])
def test_no_valid_row_gives_zero_and_a_zero_gradient(name):
    head, hidden, weight, labels, inputs = _linear(name)
    x = (hidden @ weight.T).detach().requires_grad_()
    out = head(x, torch.full_like(labels, -100), **inputs)
    out.loss.backward()
    assert out.loss.item() == 0.0 and all(v.item() == 0.0 for v in {**out.terms, **out.metrics}.values())
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_a_batch_statistic_is_a_segment_statistic_of_one_segment():
    """Each token's cross-entropy weighted by its entropy over the batch's mean entropy (one segment:
    segment_ids all 0), the gradient through the batch mean included."""
    H = -S.vsum(S.softmax * S.logsoftmax)
    head = lcg.HeadLoss(lcg.declare_term("entropy_weighted_ce", (S.lse - S.target_logit) * H / S.segment_mean(H))())
    lcg.testing.assert_parity(head, rows=16, vocab=40, segment_ids=torch.zeros(16, dtype=torch.long), num_segments=1)


def test_class_weight_with_label_smoothing_as_torch_computes_it():
    """torch's cross_entropy(weight=w, label_smoothing=e), which CrossEntropy refuses: the smoothing
    sum reads every class's weight (a vector input) and the mean divides by the valid rows' sum of
    w[y] (a statistic of one segment)."""
    e, wy = S.param("eps"), S.token("w_y")
    smoothed = (1 - e) * wy * (S.lse - S.target_logit) + e / S.vocab_size * S.vsum(S.vector("w") * (S.lse - S.logit))
    head = lcg.HeadLoss(lcg.declare_term("weighted_smoothed_ce", S.segment_sum(smoothed) / S.segment_sum(wy))(eps=0.1))
    g = torch.Generator().manual_seed(6)
    R, V = 12, 40
    z = torch.randn(R, V, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (R,), generator=g)
    y[[3, 7]] = -100
    w = torch.rand(V, generator=g, dtype=torch.float64) + 0.5
    x = z.float().requires_grad_()
    out = head(x, y, w=w.float(), w_y=w[y.clamp_min(0)].float(), segment_ids=torch.zeros(R, dtype=torch.long),
               num_segments=1)
    out.loss.backward()
    ref_x = z.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_x, y, weight=w, label_smoothing=0.1)
    ref.backward()
    assert abs(out.loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert (x.grad.double() - ref_x.grad).abs().max().item() <= 1e-4 * ref_x.grad.abs().max().item()


def test_a_vector_input_is_checked_and_stays_inside_vsum():
    head = _heads()["vector"]
    z, y = torch.randn(4, 10), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="prior is required"):
        head(z, y)
    with pytest.raises(ValueError, match=r"prior must be a float tensor of shape \(10,\)"):
        head(z, y, prior=torch.ones(9))
    with pytest.raises(ValueError, match="may only appear inside"):
        lcg.declare_term("x", S.vector("prior") * S.lse)
    with pytest.raises(ValueError, match="clashes"):
        lcg.declare_term("x", S.vsum(S.vector("labels") * S.logit))


def test_the_trl_trainer_fuses_top_entropy_quantile_at_the_token_level(tmp_path):
    """lcg.GRPO(top_entropy_quantile=q) is TRL's mask (tests/runtime/test_quantile.py): the trainer fuses
    it at the token level, and refuses it, saying why, where the mask would sit inside a sequence's term."""
    trl = pytest.importorskip("trl")
    from losscodegen.integrations import trl as lcg_trl

    def refused(**options):
        return lcg_trl.unfused_options(trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                                      report_to=[], top_entropy_quantile=0.2, **options))
    assert refused() == []
    assert any("top_entropy_quantile=0.2 with a sequence-level loss" in r and "importance_sampling_level='token'" in r
               for r in refused(importance_sampling_level="sequence"))
