"""Right where training goes (docs/api.md, "Numerics"): the rows late training produces (label
probabilities that round to 1 or 0, one-hot teachers, spreads up to 1e4, ratios at their clip
bounds), parameters at their edges, and plain torch fp32 of the same formula as the oracle: finite
wherever it is finite, and no further from float64 than 4 times its error."""
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

import losscodegen as lcg
from losscodegen import lower
from losscodegen import preference as P
from losscodegen import symbols as S
from losscodegen.testing import REGIMES, assert_parity, random_inputs, reference

ROOT = Path(__file__).resolve().parents[2]
# where assert_parity runs the heads (the GPU where there is one): tensor parameters are made there
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
p_y = S.exp(S.target_logit - S.lse)
# docs/adding-a-loss.md's focal loss and poly-1, as written there; a token-level unlikelihood term
Focal = lcg.declare_term("focal", -(1 - p_y) ** S.param("gamma") * (S.target_logit - S.lse), defaults={"gamma": 2.0})
Poly1 = lcg.declare_term("poly1", S.lse - S.target_logit + S.param("eps") * (1 - p_y))
Unlikelihood = lcg.declare_term("unlikelihood", S.topk_sum(-S.log(1 - S.exp(S.topk_logit - S.lse))))
# every regime a head's rows can be drawn in but "all_ignored" (a test of its own below)
ROW_REGIMES = tuple(r for r in REGIMES if r != "all_ignored")


def _terms() -> dict:
    return {
        "focal": lambda: Focal(), "focal_runtime_gamma": lambda: Focal(gamma=2.5),
        "focal_tensor_gamma": lambda: Focal(gamma=torch.tensor(2.0, device=DEVICE)), "poly1": lambda: Poly1(eps=2.0),
        "unlikelihood": lambda: Unlikelihood(),
        "cross_entropy": lambda: lcg.CrossEntropy(label_smoothing=0.1), "z_loss": lambda: lcg.ZLoss(weight=1e-4),
        "entropy": lambda: lcg.Entropy(), "forward_kl": lambda: lcg.ForwardKL(temperature=2.0),
        "forward_kl_tensor_t": lambda: lcg.ForwardKL(temperature=torch.tensor(0.7, device=DEVICE)),
        "reverse_kl": lambda: lcg.ReverseKL(), "jsd": lambda: lcg.JSD(beta=0.3),
        "topk_forward_kl": lambda: lcg.TopKForwardKL(), "grpo": lambda: lcg.GRPO(kl_beta=0.04),
        "cispo": lambda: lcg.CISPO(), "sapo": lambda: lcg.SAPO(), "gspo": lambda: lcg.GSPO(),
        "log_prob": lambda: lcg.LogProb(),
    }


@pytest.mark.parametrize("name", list(_terms()))
def test_every_built_in_and_documented_term_is_right_in_every_regime(name, backend):
    """The focal loss (its gamma a number, a runtime number and a tensor), poly-1, an unlikelihood
    term and every built-in: values and gradients against float64, plain torch fp32 the yardstick,
    on rows drawn in every regime at once (assert_parity names the one that fails)."""
    metrics = (lcg.Entropy(), lcg.TokenAccuracy()) if name not in ("entropy",) else ()
    if name in ("grpo", "sapo", "cispo", "gspo"):
        metrics += (lcg.ClipFraction(), lcg.RatioMean())
    head = lcg.HeadLoss(_terms()[name](), metrics=metrics)
    assert_parity(head, rows=18, vocab=96, regimes=ROW_REGIMES)


@pytest.mark.parametrize("gamma", [2.0, 2.5, "tensor"])
def test_the_focal_loss_through_head_linear_keeps_dw_and_dh_finite_at_saturated_rows(gamma, backend):
    """Issue 45: one saturated row made the focal loss's gradient NaN, and through head.linear every
    element of dW and dh. Hidden states that put the label 40 above the rest (p_y rounds to 1 in
    fp32) on some rows: dW and dh finite and equal to float64's chain rule."""
    head = lcg.HeadLoss(Focal(gamma=torch.tensor(2.0, device=DEVICE) if gamma == "tensor" else gamma))
    g = torch.Generator().manual_seed(0)
    R, V, H = 12, 80, 16
    hidden = torch.randn(R, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    labels = torch.randint(0, V, (R,), generator=g)
    labels[3] = -100
    # rows 0, 2, 4, ...: hidden along the label's weight row, until its logit is 40 above the rest
    for r in range(0, R, 2):
        w = weight[labels[r].clamp_min(0)]
        while (weight @ hidden[r]).topk(2).values.diff().abs() < 40 or (weight @ hidden[r]).argmax() != labels[r]:
            hidden[r] += (20.0 / w.dot(w)) * w
    z = (hidden.float().double() @ weight.float().double().T)
    p = torch.softmax(z.float(), -1).gather(1, labels.clamp_min(0)[:, None])
    assert (p[0::2] == 1).all(), "the rows meant to saturate do not round p_y to 1"
    h, w = hidden.float().to(DEVICE).requires_grad_(), weight.float().to(DEVICE).requires_grad_()
    out = head.linear(h, w, labels.to(DEVICE), chunk_rows=5)
    out.loss.backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    _, _, G = reference(head)(z.float(), labels)
    lcg.testing.compare("gradient of hidden", h.grad, G @ weight.float().double(), torch.float32)
    lcg.testing.compare("gradient of weight", w.grad, G.T @ hidden.float().double(), torch.float32)


def test_log_of_one_minus_p_y_on_a_confident_row_over_many_tiles(backend):
    """A confident row at a large vocabulary: the label's logit 0, the 32767 others at -25 (each
    1.4e-11 of the mass, 1 - p_y = 4.5e-7). Tiles of 4096 columns each add 5.7e-8 to the
    normaliser's sum, below half an ulp of 1: added tile after tile, the rest of the mass was
    rounded away, p_y was 1 and log(1 - p_y) -inf, where torch's one sum over the row keeps it
    (found by the fuzzer on 16-column tiles). The normaliser's sum is compensated."""
    from losscodegen.backends.triton import tiles
    unlikely = lcg.declare_term("unlikely", -S.log(1 - p_y))
    head = lcg.HeadLoss(unlikely())
    head.tile_override = tiles.Config(4096, 4, split=False)
    V = 32768
    z = torch.full((2, V), -25.0)
    z[:, 7] = 0.0
    z[1, 100] = -3.0     # (a second row less confident)
    labels = torch.tensor([7, 7])
    x = z.clone().requires_grad_()
    out = head(x, labels, reduction="none")
    out.loss.sum().backward()
    z64 = z.double().requires_grad_()
    want = -torch.log(-torch.expm1(torch.log_softmax(z64, -1)[:, 7]))
    want.sum().backward()
    z32 = z.clone().requires_grad_()
    plain = -torch.log(1 - torch.softmax(z32, -1)[:, 7])
    plain.sum().backward()
    lcg.testing.compare("loss", out.loss, want.detach(), torch.float32, plain=plain.detach())
    lcg.testing.compare("gradient", x.grad, z64.grad, torch.float32, plain=z32.grad)


def _docs_heads() -> dict:
    """Each head docs/adding-a-loss.md and docs/examples.md build (``head = lcg.HeadLoss(...)``) and
    each term they declare (built with its defaults, where it has them): every top-level statement
    of their python blocks run in order, those that need data the docs do not define left out."""
    found = {}
    for doc in ("adding-a-loss.md", "examples.md"):
        namespace = {"lcg": lcg, "S": S, "P": P, "torch": torch, "math": math}
        text = (ROOT / "docs" / doc).read_text()
        for block in re.findall(r"```python\n(.*?)```", text, re.S):
            statement = ""
            for line in block.splitlines():
                statement += line + "\n"
                try:
                    compile(statement, doc, "exec")
                except SyntaxError:
                    continue     # (a statement over several lines)
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        exec(statement, namespace)
                except Exception:
                    pass        # (a call on the docs' logits, a trainer: data the docs leave out)
                statement = ""
                for name, value in list(namespace.items()):
                    if isinstance(value, lcg.HeadLoss):
                        found.setdefault(f"{doc}:{name}:{len(found)}", value)
                        del namespace[name]
    return found


_DOCS = _docs_heads()


def test_the_docs_build_heads_to_check():
    assert len(_DOCS) >= 8, sorted(_DOCS)


@pytest.mark.parametrize("name", sorted(_DOCS))
def test_every_head_in_the_docs_passes_parity_at_saturated_rows(name):
    head = _DOCS[name]
    if head.kernel.SPEC.segments and not (head.kernel.SPEC.tokens or head.kernel.SPEC.uses_labels):
        pytest.skip("a segment head the parity helper cannot invent inputs for")
    assert_parity(head, rows=18, vocab=96, dtypes=(torch.float32,))


def test_assert_parity_fails_an_unsafe_head_and_names_the_regime(monkeypatch, tmp_path):
    """The focal loss compiled without the stable forms (stable.stable_form as the identity: sympy's
    own derivative, ``gamma * x**gamma / x``, 0/0 at p_y = 1) is the head issue 45 found: it passes on
    randn rows and fails on saturated ones, the regime named; the compiler's own passes them all."""
    monkeypatch.setenv("LOSSCODEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(lower, "stable_form", lambda e: e)
    formula = -(1 - p_y) ** S.param("gamma") * (S.target_logit - S.lse)
    # (and the declaration's check names the quotient sympy left)
    with pytest.warns(UserWarning, match=r"focal_unsafe: the derived forms \(g0, g1\) divide by expm1\(zym - log\(acc0\)\) .* 0/0"):
        Unsafe = lcg.declare_term("focal_unsafe", formula)
    head = lcg.HeadLoss(Unsafe(gamma=2.0), backend="torch")
    assert_parity(head, rows=18, vocab=96, dtypes=(torch.float32,), regimes=("randn",))
    with pytest.raises(AssertionError, match=r"^gradient \(regime 'saturated'.*nan where plain torch fp32 gives"):
        assert_parity(head, rows=18, vocab=96, dtypes=(torch.float32,))
    monkeypatch.undo()
    # (another name: another kernel, not the unsafe one this process holds)
    Safe = lcg.declare_term("focal_safe", formula)
    assert_parity(lcg.HeadLoss(Safe(gamma=2.0), backend="torch"), rows=18, vocab=96, dtypes=(torch.float32,))


@pytest.mark.parametrize("beta", [0, 0.0, "tensor"])
def test_a_parameter_where_the_formula_is_undefined_is_refused_naming_it(beta):
    """IPO's (x - 1/(2 beta))**2 at beta = 0 (a number or a 0-dim tensor) and SAPO's 4/tau at a
    temperature of 0 have no finite value: a ValueError when the head is built, naming the parameter
    and its value, never a kernel printing zoo (it ended in "no torch/tl printing for
    ComplexInfinity") or a NaN loss."""
    value = torch.tensor(0.0) if beta == "tensor" else beta
    with pytest.raises(ValueError, match=r"dpo_ipo: parameter beta=0\.0: the formula is undefined"):
        lcg.HeadLoss(P.DPO(loss_type="ipo", beta=value))
    with pytest.raises(ValueError, match=r"sapo: parameter temperature_neg=0\.0"):
        lcg.HeadLoss(lcg.SAPO(temperature_neg=value))


def test_a_parameter_at_zero_gives_the_formulas_finite_limit(backend):
    """SimPO's beta*(x - gamma/beta) at beta = 0 is its limit -gamma (it stopped in sympy's "The
    argument 'nan' is not comparable"); DPO at a tensor beta of 0 (a schedule from 0) is log 2 with a
    zero gradient; the focal loss at a gamma of 0, a number or a tensor, is cross-entropy."""
    g = torch.Generator().manual_seed(0)
    for head in (lcg.HeadLoss(P.SimPO(beta=0)), lcg.HeadLoss(P.DPO(beta=torch.tensor(0.0, device=DEVICE)))):
        labels = torch.randint(0, 40, (4, 6), generator=g)
        labels[:, 0] = -100
        logits = torch.randn(24, 40, generator=g) * 2
        kw = P.pair_inputs(head, labels, ref_logprobs=torch.randn(4, 6, generator=g) - 3)
        kw = {k: (v.reshape(-1) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        labels = labels.reshape(-1)
        x = logits.to(DEVICE).requires_grad_()
        out = head(x, labels.to(DEVICE), **{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v)
                                            for k, v in kw.items()})
        out.loss.backward()
        want_loss, _, want_grad = reference(head)(logits, labels, **kw)
        assert torch.isfinite(out.loss) and torch.isfinite(x.grad).all()
        lcg.testing.compare("loss", out.loss, want_loss, torch.float32)
        lcg.testing.compare("gradient", x.grad, want_grad, torch.float32)
    ce = lcg.HeadLoss(lcg.CrossEntropy())
    logits, labels, _ = random_inputs(ce, 12, 40, device=DEVICE, regime="saturated")
    for gamma in (0, torch.tensor(0.0, device=DEVICE)):
        x = logits.clone().requires_grad_()
        out = lcg.HeadLoss(Focal(gamma=gamma))(x, labels)
        out.loss.backward()
        y = logits.clone().requires_grad_()
        torch.nn.functional.cross_entropy(y, labels).backward()
        torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(logits, labels))
        torch.testing.assert_close(x.grad, y.grad)


def test_a_form_the_compiler_cannot_make_safe_warns_when_declared():
    """A quotient of the derived forms whose numerator vanishes with its divisor (0/0 on a finite
    row) is named when the term is declared, and explain() lists it; the documented focal loss has
    none once its powers are merged."""
    with pytest.warns(UserWarning, match=r"unsafe_ratio: .* divide by .*expm1.* 0/0"):
        Unsafe = lcg.declare_term("unsafe_ratio", S.log(1 + (1 - p_y) ** 2) / (1 - p_y))
    assert "divide by" in lcg.HeadLoss(Unsafe(), backend="torch").explain()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lcg.declare_term("focal_again", -(1 - p_y) ** S.param("gamma") * (S.target_logit - S.lse))
    explained = lcg.HeadLoss(Focal(), backend="torch").explain()
    assert "numerics (forms that can be 0/0 where the formulas are finite):\n  none" in explained


def test_per_row_inputs_are_drawn_from_the_domain_their_formula_needs():
    """docs/adding-a-loss.md's per-row temperature (a token in lse_at): drawn > 0 (it got -0.0038
    and a NaN "mismatch"); a domain a term declares is drawn from, and a wrong one refused."""
    tau = S.token("tau")
    InstanceKD = lcg.declare_term("instance_kd", S.vsum(S.teacher_prob_at(tau) * (S.teacher_logprob_at(tau)
                                                                               - S.logsoftmax_at(tau))))
    head = lcg.HeadLoss(InstanceKD(), backend="torch")
    _, _, kw = random_inputs(head, 64, 20)
    assert (kw["tau"] > 0).all()
    Scaled = lcg.declare_term("scaled", S.token("s") * (S.lse - S.target_logit), domains={"s": (2.0, 3.0)})
    _, _, kw = random_inputs(lcg.HeadLoss(Scaled(), backend="torch"), 64, 20)
    assert ((kw["s"] >= 2) & (kw["s"] <= 3)).all()
    with pytest.raises(ValueError, match="domains names 'nope'"):
        lcg.declare_term("scaled2", S.token("s") * S.lse, domains={"nope": (0, 1)})
    with pytest.raises(ValueError, match=r"domains\['s'\] must be finite with low < high"):
        lcg.declare_term("scaled3", S.token("s") * S.lse, domains={"s": (1, 0)})
    assert_parity(head, rows=12, vocab=40, dtypes=(torch.float32,))


def test_the_regimes_draw_the_rows_they_name():
    """Saturated rows round p_y to 1 and to 0 in fp32 and bf16; one-hot teachers, near-uniform and
    -inf-masked ones; spreads of 1e3 and more; ratios at the clip bounds and past exp's overflow."""
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ForwardKL(), lcg.GRPO(), backend="torch")
    for dtype in (torch.float32, torch.bfloat16):
        logits, labels, kw = random_inputs(head, 60, 50, dtype, regime="saturated")
        p = torch.softmax(logits.float(), -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
        assert (p == 1).any() and (p == 0).any()
    _, _, kw = random_inputs(head, 60, 50, regime="one_hot_teacher")
    q = torch.softmax(kw["teacher_logits"].float(), -1)
    assert (q.amax(-1) == 1).any() and (q.amax(-1) < 0.03).any() and torch.isinf(kw["teacher_logits"]).any()
    logits, _, _ = random_inputs(head, 60, 50, regime="spread")
    assert float((logits.amax(-1) - logits.amin(-1)).min()) > 1e3
    logits, labels, kw = random_inputs(head, 60, 50, regime="policy_edges")
    logp = torch.log_softmax(logits.double(), -1).gather(1, labels.clamp_min(0)[:, None])[:, 0]
    r = torch.exp(logp - kw["old_logprobs"].double())
    near = lambda b: ((r - b).abs() < 2e-4 * b).any()   # noqa: E731
    assert near(1.2) and near(0.8) and torch.isinf(r.float()).any() and (kw["advantages"] == 0).any()
    _, labels, _ = random_inputs(head, 10, 50, regime="all_ignored")
    assert (labels == -100).all()
    with pytest.raises(ValueError, match="unknown regime"):
        random_inputs(head, 10, 50, regime="sturated")


def test_all_rows_ignored_give_zero_and_a_zero_gradient(backend):
    head = lcg.HeadLoss(Focal(gamma=torch.tensor(2.0, device=DEVICE)), lcg.CrossEntropy())
    logits, labels, kw = random_inputs(head, 12, 40, device=DEVICE, regime="all_ignored")
    x = logits.clone().requires_grad_()
    out = head(x, labels, **kw)
    out.loss.backward()
    assert float(out.loss) == 0.0 and not x.grad.any()
