"""Declare time is where formula mistakes surface: every function the code generator prints is
checked against float64 torch written by hand (value and gradient, at row level and inside vsum),
and everything it cannot print, or a name it could never be given, is refused by declare_term with
a message naming it."""
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sympy as sp
import torch

import losscodegen as lcg
from losscodegen import symbols as S
from losscodegen.inputs import STANDARD_INPUTS
from losscodegen.symbols import CALL_ARGUMENTS

SM90_COMPILE = Path(__file__).resolve().parents[2] / "bench" / "sm90_compile.py"
_l = S.target_logit - S.lse          # log p_y


# (formula, the same per row in float64 torch from z [R, V], z_y [R], lse [R], p [R, V])
SUPPORTED = {
    "sin": (sp.sin(3 * _l), lambda z, zy, lse, p: torch.sin(3 * (zy - lse))),
    "cos": (sp.cos(3 * _l), lambda z, zy, lse, p: torch.cos(3 * (zy - lse))),
    "erf": (sp.erf((_l + 4) / 2), lambda z, zy, lse, p: torch.erf((zy - lse + 4) / 2)),
    "tanh": (sp.tanh(_l / 4), lambda z, zy, lse, p: torch.tanh((zy - lse) / 4)),
    "sqrt": (sp.sqrt(-_l), lambda z, zy, lse, p: torch.sqrt(lse - zy)),
    "sign": (sp.sign(S.target_logit) * _l, lambda z, zy, lse, p: torch.sign(zy) * (zy - lse)),
    "pi": (sp.pi * _l, lambda z, zy, lse, p: torch.pi * (zy - lse)),
    "odd_power": ((_l + 3) ** 5, lambda z, zy, lse, p: (zy - lse + 3) ** 5),   # a negative base too
    "vsum_sin": (S.vsum(S.softmax * sp.sin(S.logit)), lambda z, zy, lse, p: (p * torch.sin(z)).sum(-1)),
    "vsum_cos": (S.vsum(sp.cos(S.logit)) / S.vocab_size, lambda z, zy, lse, p: torch.cos(z).mean(-1)),
    "vsum_erf": (S.vsum(S.softmax * sp.erf(S.logit)), lambda z, zy, lse, p: (p * torch.erf(z)).sum(-1)),
    "vsum_tanh": (S.vsum(S.softmax * sp.tanh(S.logit / 2)), lambda z, zy, lse, p: (p * torch.tanh(z / 2)).sum(-1)),
    "vsum_sign": (S.vsum(S.softmax * sp.sign(S.logit)), lambda z, zy, lse, p: (p * torch.sign(z)).sum(-1)),
    "vsum_sqrt": (S.vsum(S.softmax * sp.sqrt(S.logit ** 2 + 1)),
                  lambda z, zy, lse, p: (p * torch.sqrt(z ** 2 + 1)).sum(-1)),
    "vsum_odd_power": (S.vsum(S.softmax * S.logit ** 5), lambda z, zy, lse, p: (p * z ** 5).sum(-1)),
    "vsum_target": (S.vsum(S.softmax * sp.cos(S.logit - S.target_logit)),
                    lambda z, zy, lse, p: (p * torch.cos(z - zy[:, None])).sum(-1)),
}


@pytest.mark.cpu
@pytest.mark.parametrize("name", SUPPORTED)
def test_supported_function_value_and_gradient(name):
    formula, by_hand = SUPPORTED[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 96, generator=g) * 2
    y = torch.randint(0, 96, (6,), generator=g)
    y[2] = -100
    xk = x.clone().requires_grad_()
    out = lcg.HeadLoss(lcg.declare_term(f"fn_{name}", formula)())(xk, y)
    out.loss.backward()
    xd = x.double().requires_grad_()
    valid = y != -100
    zy = xd.gather(1, y.clamp_min(0)[:, None])[:, 0]
    per_row = by_hand(xd, zy, torch.logsumexp(xd, -1), torch.softmax(xd, -1))
    want = torch.where(valid, per_row, 0.0).sum() / valid.sum()
    want.backward()
    torch.testing.assert_close(out.loss.double(), want.detach(), rtol=1e-4, atol=1e-5)
    assert (xk.grad.double() - xd.grad).abs().max() <= 2e-4 * xd.grad.abs().max()


def _refused(formula, *match, name="t"):
    with pytest.raises(ValueError) as info:
        lcg.declare_term(name, formula)
    for m in match:
        assert m in str(info.value), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("fn", [sp.atan, sp.floor, sp.ceiling, sp.Heaviside, sp.sinh, sp.asin,
                                sp.Function("f"), lambda u: sp.Mod(u, 2)],
                         ids=["atan", "floor", "ceiling", "Heaviside", "sinh", "asin", "undefined", "Mod"])
@pytest.mark.parametrize("where", ["row", "vsum", "topk_sum", "segment_mean"])
def test_unsupported_function_is_refused_naming_it(fn, where):
    u = {"row": S.target_logit, "vsum": S.logit, "topk_sum": S.topk_logit, "segment_mean": S.target_logit}[where]
    wrap = {"row": lambda e: e, "vsum": S.vsum, "topk_sum": S.topk_sum, "segment_mean": S.segment_mean}[where]
    bad = fn(u)
    message = _refused(S.lse + wrap(S.exp(bad) if where == "vsum" else bad), type(bad).__name__, "supported")
    for listed in ("sin", "cos", "tanh", "erf", "sign", "sqrt", "Piecewise"):
        assert listed in message


@pytest.mark.parametrize("constant", [sp.oo, -sp.oo, sp.nan, sp.zoo, sp.I])
def test_constants_must_be_finite_and_real(constant):
    with pytest.raises(ValueError, match="not supported"):
        lcg.declare_term("t", S.lse + constant * S.target_logit)


@pytest.mark.parametrize("symbol", [sp.Symbol("foo"), sp.Symbol("z"), sp.Symbol("tok_x"), sp.Symbol("param_eps"),
                                    sp.Symbol("m", real=True)])
def test_raw_sympy_symbols_are_refused(symbol):
    _refused(S.lse - symbol, "unknown symbol", str(symbol), "S.token", "S.param")


def test_symbols_at_the_wrong_level_are_refused():
    _refused(S.vsum(S.softmax * S.topk_logit), "topk_sum", "vsum", "z_k")
    _refused(S.vsum(S.softmax * S.topk_logprob), "topk_sum", "l_k")
    _refused(S.topk_sum(S.exp(S.topk_logprob) * S.logit), "vsum(...)", "topk_sum")
    _refused(S.topk_sum(S.teacher_logit), "vsum(...)")
    _refused(S.lse - S.logit, "inside vsum")
    _refused(S.topk_logprob, "inside topk_sum")
    _refused(S.segment_mean(S.logit), "inside vsum")
    _refused(S.LSE(S.target_logit, 0), "temperature")


@pytest.mark.parametrize("name", CALL_ARGUMENTS + STANDARD_INPUTS)
def test_token_names_of_the_heads_own_arguments_are_refused(name):
    _refused(S.token(name) * (S.lse - S.target_logit), f"token({name!r})", "clashes")


def test_the_refused_token_names_cover_the_call_signatures():
    """Every named argument of HeadLoss.forward and HeadLoss.linear is refused as a token name."""
    for fn in (lcg.HeadLoss.forward, lcg.HeadLoss.linear):
        named = [p.name for p in inspect.signature(fn).parameters.values()
                 if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
        for name in named:
            _refused(S.token(name) * S.lse, "clashes")


def test_param_named_weight_is_refused():
    """Term(weight=2) is the loss weight: a param called weight could never be set."""
    _refused(S.param("weight") * S.lse, "param('weight')", "clashes")
    Ok = lcg.declare_term("ok", S.param("w") * S.lse)   # any other name is a parameter
    assert dict(Ok(weight=3.0, w=2.0).params) == {"w": 2.0}


def test_policy_tokens_are_still_tokens():
    """advantages, old_logprobs, ref_logprobs are tokens every head accepts: not refused."""
    lcg.declare_term("t", S.token("advantages") * S.token("old_logprobs") * S.token("ref_logprobs") * _l)


def test_new_functions_compile_for_sm90(tmp_path):
    """What the printers write for sin, cos, erf, sign, sqrt and odd powers (row level, in an online
    and in an exact sum of the vocabulary, in a segment term) compiles for an H100, without a GPU."""
    manifest = tmp_path / "manifest"
    manifest.write_text(
        "Fns = declare_term('fns', S.sin(S.target_logit - S.lse) + S.cos(S.lse) * S.erf(S.target_logit)"
        " + S.vsum(S.softmax * (S.sin(S.logit) + S.sign(S.logit) + S.sqrt(S.logit ** 2 + 1)))"
        " + S.vsum(S.softmax * S.log(1 + S.erf(S.logsoftmax) ** 2)) + (S.target_logit - S.lse) ** 5)\n"
        "Seg = declare_term('seg', S.cos(S.segment_mean(S.target_logit - S.lse)))\n"
        "HeadLoss(Fns(), Seg())\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LOSSCODEGEN_CACHE"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(SM90_COMPILE), str(manifest)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = done.stdout.splitlines()
    assert any("EXACT" in k for k in kernels) and any(k.startswith("segments_") for k in kernels), done.stdout


def test_a_maximum_of_a_row_value_and_the_log_of_a_sum_is_declared():
    # (found by the fuzzer: the level check replaced each sum by 0, and Max(lse_at(2), log(0)) raised
    # sympy's "The argument 'zoo' is not comparable")
    lcg.declare_term("max_log_sum", S.Max(S.lse_at(2), S.log(S.vsum(S.softmax**2))))


def test_a_condition_on_an_element_that_sympy_moves_out_of_its_sum_is_refused_naming_it():
    # (found by the fuzzer: sympy rewrote vsum(Piecewise((p, u > 0), (q, True))) > 0 inside a Piecewise
    # condition as ITE(u > 0, ...), a condition on the vector outside any sum; the level check saw no
    # element symbol there, and the kernel read u after the vocabulary loop)
    with pytest.raises(ValueError, match=r"vec_u.*moved a condition on an element out of its sum"):
        lcg.declare_term("hoisted", S.Piecewise(
            (S.lse, S.vsum(S.Piecewise((S.softmax, S.vector("u") > 0), (0.5, True))) > 0), (S.vsum(S.softmax), True)))


def test_an_order_statistic_where_it_has_no_meaning_is_refused_naming_it():
    """S.segment_sorted is a segment statistic: refused inside a row term that reads row quantities
    beside it (the k-th smallest of the segments' sums has no row), at the wrong level, nested."""
    with pytest.raises(ValueError, match=r"t: segment_sorted\(\.\.\.\) belongs to a segment term"):
        lcg.HeadLoss(lcg.declare_term("t", _l * S.segment_sorted(_l))()).explain()   # (lowered at first use)
    with pytest.raises(ValueError, match="a segment term cannot be a metric"):
        lcg.HeadLoss(metrics=(lcg.declare_term("t", S.segment_sorted(_l))(),)).explain()
    _refused(S.segment_sorted(S.logit), "inside vsum")
    _refused(S.segment_mean(S.segment_sorted(_l)), "nested reductions")


def test_a_row_quantile_metric_is_refused_when_built_naming_the_quantile():
    """A metric is a mean taken as the rows are read; a row quantile (or a segment statistic) is known
    only once every row has been: refused at declare_term(metric_only=True) and at HeadLoss(metrics=...),
    each message saying what the formula reads, not at the first call."""
    u = (_l - S.row_quantile(_l, 0.5)) ** 2
    with pytest.raises(ValueError, match=r"qm: a row quantile \(S.row_quantile.*cannot be a metric.*weight=0.0"):
        lcg.declare_term("qm", u, metric_only=True)
    with pytest.raises(ValueError, match=r"qm: a row quantile \(S.row_quantile.*cannot be a metric"):
        lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.declare_term("qm", u)(),))
    with pytest.raises(ValueError, match=r"grpo: a row quantile"):
        lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.GRPO(top_entropy_quantile=0.2),))
    with pytest.raises(ValueError, match="t: a segment term cannot be a metric"):   # (at construction now)
        lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.declare_term("t", S.segment_sum(_l))(),))
    lcg.HeadLoss(lcg.CrossEntropy(), lcg.declare_term("qm", u)(weight=0.0))   # the way to log it


@pytest.mark.parametrize("q", [float("nan"), sp.nan, sp.I, sp.oo, -0.1])
def test_a_row_quantile_of_no_number_in_0_1_is_refused_naming_q(q):
    with pytest.raises(ValueError, match=r"q must be a number in \[0, 1\]"):
        S.row_quantile(_l, q)


def test_jsd_refuses_a_beta_outside_0_1_when_built():
    """beta*p + (1-beta)*q is a distribution only for beta in [0, 1] (outside, log of a negative: NaN);
    a tensor beta is looked at as the term is built, like a tensor temperature."""
    for beta in (1.5, -0.2, torch.tensor(1.5)):
        with pytest.raises(ValueError, match=r"jsd: beta must be in \[0, 1\].*got"):
            lcg.JSD(beta=beta)
    for beta in (0.0, 1.0, 0.3, torch.tensor(0.7)):
        lcg.JSD(beta=beta)


def test_metrics_must_be_a_tuple_of_terms():
    with pytest.raises(TypeError, match=r"metrics must be a tuple of terms, got the single term 'entropy'"):
        lcg.HeadLoss(lcg.CrossEntropy(), metrics=lcg.Entropy())
    with pytest.raises(TypeError, match=r"metrics must be a tuple of terms such as"):
        lcg.HeadLoss(lcg.CrossEntropy(), metrics=lcg.Entropy)
    lcg.HeadLoss(lcg.CrossEntropy(), metrics=[lcg.Entropy()])   # (any iterable of terms)


@pytest.mark.parametrize("call, where", [
    (lambda: lcg.ZLoss(lse_square_scale=1e-4), r"lse_square_scale=: .*ZLoss\(weight=\.\.\.\)"),
    (lambda: lcg.CrossEntropy(softcap=30.0), r"softcap=: .*HeadLoss\(\.\.\., softcap=\.\.\.\)"),
    (lambda: lcg.CrossEntropy(logit_scale=0.5), r"logit_scale=: .*HeadLoss\(\.\.\., logit_scale=\.\.\.\)"),
    (lambda: lcg.CrossEntropy(ignore_index=0), r"ignore_index=: .*HeadLoss\(\.\.\., ignore_index=\.\.\.\)"),
    (lambda: lcg.ForwardKL(reduction="sum"), r"reduction=: .*head\(logits, labels, reduction=\.\.\.\)"),
    (lambda: lcg.GRPO(temperature=0.7), r"temperature=: .*HeadLoss\(\.\.\., logit_scale=1 / T\)"),
])
def test_a_peers_option_given_to_a_term_names_where_it_goes(call, where):
    """Liger's, flash-attn's, torch's and TRL's options that belong to the head, the call or another term:
    the error says where each goes, and what the term does take (its weight= among them)."""
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) .*; it takes .*weight=, normalize=, "
                                        r"class_weight=; " + where):
        call()
