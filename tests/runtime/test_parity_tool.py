"""losscodegen.testing: assert_parity passes on declared heads of every kind, fails on wrong ones, and
its float64 reference agrees with the hand-written references of tests/reference.py (which check
the checker); `python -m losscodegen check` runs it over a manifest."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import losscodegen as lcg
from helpers import make_inputs, spec, topk_inputs
from losscodegen import symbols as S
from losscodegen.testing import assert_parity, reference
from reference import head_reference

ROOT = Path(__file__).resolve().parents[2]
p_y = S.exp(S.target_logit - S.lse)
DECLARED = {
    # the three a new user tried (issue: parity tests as a product feature)
    "tsallis": lcg.declare_term("tsallis", 1 - S.vsum(S.softmax ** 2))(),
    "log1p_py": lcg.declare_term("log1p_py", S.lse - S.target_logit - S.param("a") * S.log(1 + p_y))(a=0.5),
    "total_variation": lcg.declare_term("total_variation",
                                        S.vsum(S.Abs(S.softmax - S.teacher_prob)) / 2)(),   # exact read
    "focal": lcg.declare_term("focal", -(1 - p_y) ** S.param("gamma") * (S.target_logit - S.lse))(gamma=2.0),
    "token_weighted_ce": lcg.declare_term("token_weighted_ce",
                                          S.token("token_weight") * (S.lse - S.target_logit))(),
    "topk_rkl": lcg.declare_term("topk_rkl", S.topk_sum(S.exp(S.topk_logit - S.lse) * (S.topk_logit - S.lse
                                                                                       - S.topk_logprob)))(),
}


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_declared_heads_of_every_kind_pass(name):
    assert_parity(lcg.HeadLoss(DECLARED[name], metrics=(lcg.Entropy(), lcg.TokenAccuracy())), rows=16,
                  vocab=300)


def test_segment_terms_and_policy_metrics_pass():
    l = S.target_logit - S.lse
    DPO = lcg.declare_term("dpo", S.log(1 + S.exp(-0.5 * S.segment_mean(S.token("sign") * (l - S.token("ref"))))))
    assert_parity(lcg.HeadLoss(DPO(), lcg.CrossEntropy(weight=0.1)), rows=18, vocab=200)
    assert_parity(lcg.HeadLoss(lcg.GSPO(), metrics=(lcg.ClipFraction(), lcg.RatioMean(), lcg.KLNewOld())),
                  rows=18, vocab=200)


class _Wrong(lcg.HeadLoss):
    """A head whose output is deliberately off: its loss value, its gradient, or one metric."""

    def __init__(self, *terms, off: str, **kw):
        super().__init__(*terms, **kw)
        self.off = off

    def forward(self, logits, labels=None, **inputs):
        out = super().forward(logits, labels, **inputs)
        loss, metrics = out.loss, dict(out.metrics)
        if self.off == "value":
            loss = loss * 1.02
        elif self.off == "gradient":
            loss = loss + 0.05 * (loss - loss.detach())        # same value, gradient 5% larger
        else:
            metrics["entropy"] = metrics["entropy"] * 1.02
        return lcg.HeadOutput(loss, out.terms, metrics)


@pytest.mark.parametrize("off, named", [("value", "loss"), ("gradient", "gradient"), ("metric", "entropy")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wrong_heads_fail_and_are_named(off, named, dtype):
    head = _Wrong(lcg.CrossEntropy(), metrics=(lcg.Entropy(),), off=off)
    with pytest.raises(AssertionError, match=rf"^{named} \(regime 'randn', {dtype}"):
        assert_parity(head, rows=16, vocab=300, dtypes=(dtype,))


CHECKED = [
    (lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1), lcg.ZLoss(weight=1e-2),
                  metrics=(lcg.Entropy(), lcg.TokenAccuracy()), softcap=4.0, logit_scale=0.7), set()),
    (lcg.HeadLoss(lcg.ForwardKL(temperature=2.0), lcg.ReverseKL(weight=0.5), lcg.JSD(beta=0.3)), {"teacher"}),
    (lcg.HeadLoss(lcg.GRPO(kl_beta=0.04), metrics=(lcg.ClipFraction(), lcg.LogProb())), {"policy"}),
    (lcg.HeadLoss(lcg.TopKForwardKL(temperature=2.0)), {"topk"}),
    (lcg.HeadLoss(lcg.GSPO()), {"policy", "segments"}),
]


@pytest.mark.parametrize("case", range(len(CHECKED)))
def test_the_reference_agrees_with_the_hand_written_one(case):
    """testing.reference, printed from the formulas, against tests/reference.py, written by hand."""
    head, needs = CHECKED[case]
    logits, labels, g = make_inputs(R=20, V=96, ignored=(2, 11))
    inputs = {"loss_mask": torch.rand(20, generator=g) > 0.2}
    if "teacher" in needs:
        inputs["teacher_logits"] = torch.randn(20, 96, generator=g)
    if "policy" in needs:
        inputs.update(advantages=torch.randn(20, generator=g), old_logprobs=torch.randn(20, generator=g) - 4,
                      ref_logprobs=torch.randn(20, generator=g) - 4)
    if "topk" in needs:
        inputs.update(topk_inputs(20, 96, 6, g))
    if "segments" in needs:
        inputs["segment_ids"] = torch.arange(20) // 6
    for reduction in ("mean", "sum"):
        got_loss, got, got_grad = reference(head)(logits, labels, reduction=reduction, **inputs)
        want_loss, want, want_grad = head_reference(
            [spec(t, head) for t in head.loss_terms], [spec(t, head) for t in head.metric_terms], logits, labels,
            logit_scale=head.logit_scale, softcap=head.softcap, reduction=reduction, **inputs)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-10, atol=1e-12)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-9, atol=1e-12)


def test_check_command_over_the_manifest(capsys):
    # (the command's main() in this process, on its default manifest and sizes: `python -m
    # losscodegen check` as a process, its exit status and options, is the class-weighted test's below)
    from losscodegen.__main__ import main
    status = main(["check"])
    stdout = capsys.readouterr().out
    assert status == 0, stdout[-3000:]
    heads = [line for line in (ROOT / "generated" / "manifest").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert stdout.count("ok    ") == len(heads)


def test_check_command_fails_on_a_wrong_head(tmp_path, monkeypatch):
    manifest = tmp_path / "manifest"
    manifest.write_text("HeadLoss(CrossEntropy())\nHeadLoss(ZLoss())\n")
    import losscodegen.__main__ as cli
    calls = []

    def fake_parity(head, device=None, **sizes):
        calls.append(head)
        if len(calls) == 2:
            raise AssertionError("z_loss (torch.float32, 24 x 500, seed 0): error 1 > 0.1")
    monkeypatch.setattr(lcg.testing, "assert_parity", fake_parity)
    assert cli.check(manifest, "cpu") == 1
    assert len(calls) == 2


def test_check_command_takes_a_class_weights_vocabulary_and_goes_on_after_a_head_that_fails(tmp_path):
    """`python -m losscodegen check` as a user runs it: a class-weighted head (300 classes) is checked at
    its vocabulary without --vocab; a head whose kernel cannot be had (its file in a kernel folder cut
    short) fails as `file:line: message`, no traceback, and the next head is still checked; exit 1."""
    from losscodegen import backends, load
    manifest = tmp_path / "manifest"
    manifest.write_text("import torch\n"
                        "HeadLoss(CrossEntropy(class_weight=torch.linspace(0.5, 2.0, 300)))\n"
                        "HeadLoss(ReverseKL())\n"
                        "HeadLoss(CrossEntropy(), ZLoss())\n")
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    broken = lcg.HeadLoss(lcg.ReverseKL())
    (kernels / load.file_name(broken.key, backends.get("triton"))).write_text("cut short\n")
    env = {**os.environ, "LOSSCODEGEN_KERNELS": str(kernels)}
    done = subprocess.run([sys.executable, "-m", "losscodegen", "check", "--manifest", str(manifest), "--device",
                           "cpu", "--rows", "12"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in out, out[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "ok    HeadLoss(CrossEntropy(class_weight=torch.linspace(0.5, 2.0, 300)))", out[-3000:]
    assert lines[1] == "FAIL  HeadLoss(ReverseKL())"
    assert lines[2].strip().startswith(f"{manifest}:3: RuntimeError: ") and "TEXT_HASH" in lines[2]
    assert lines[3] == "ok    HeadLoss(CrossEntropy(), ZLoss())"
    assert lines[-1] == "1 of the manifest's heads failed"


def test_check_command_names_a_vocab_unlike_a_heads_class_weights(tmp_path, capsys):
    import losscodegen.__main__ as cli
    manifest = tmp_path / "manifest"
    manifest.write_text("import torch\nHeadLoss(CrossEntropy(class_weight=torch.ones(40)))\n")
    assert cli.check(manifest, "cpu", vocab=500) == 1     # (refused before any kernel runs)
    out = capsys.readouterr().out
    assert f"{manifest}:2: ValueError: --vocab 500: this head's class weights have 40 classes" in out
    assert "leave --vocab out (check then takes 40) or give --vocab 40" in out
