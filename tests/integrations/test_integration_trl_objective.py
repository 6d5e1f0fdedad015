"""Never a silently different objective under TRL: a model patched by apply_losscodegen with a head
that is not TRL's fused cross-entropy is refused when a TRL trainer gives it TRL's fused LM head;
``replace_fused_lm_heads`` refuses trainers whose loss TRL computes from the full logits (GKD's); a
training forward whose loss is computed outside the model (label smoothing) warns; and
``generalized_jsd_loss`` is TRL's GKD loss (its beta convention), value and gradient, against TRL's own
function."""
import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

import losscodegen as lcg  # noqa: E402
from losscodegen.integrations import trl as lcg_trl  # noqa: E402
from losscodegen.integrations.transformers import apply_losscodegen  # noqa: E402
from helpers import tiny_causal_lm, tiny_tokenizer  # noqa: E402

V = 96
OUT = "/tmp/lcg-trl-objective-test"


def _sft(model, cls=None):
    args = trl.SFTConfig(output_dir=OUT, use_cpu=True, report_to=[], bf16=False)
    return (cls or trl.SFTTrainer)(model=model, args=args, processing_class=tiny_tokenizer(V),
                                   train_dataset=datasets.Dataset.from_dict({"text": ["t5 t6 t7 t8"] * 4}))


def test_sft_trainer_refuses_a_patched_model_whose_head_is_not_its_cross_entropy():
    model = apply_losscodegen(tiny_causal_lm(V), lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-2)))
    with pytest.raises(ValueError, match=r"z_loss.*different objective"):
        _sft(model)


def test_sft_trainer_takes_a_patched_model_whose_head_is_its_cross_entropy():
    """CE alone is what TRL's fused head computes: SFT's loss is the unpatched model's."""
    ours = apply_losscodegen(tiny_causal_lm(V), lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),)))
    theirs, ours = _sft(tiny_causal_lm(V)), _sft(ours)
    ids = torch.randint(4, V, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    for t in (theirs, ours):
        t.model.train()
    torch.testing.assert_close(ours.compute_loss(ours.model, dict(inputs)),
                               theirs.compute_loss(theirs.model, dict(inputs)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head", [lcg.HeadLoss(lcg.CrossEntropy(label_smoothing=0.1)),
                                  lcg.HeadLoss(lcg.CrossEntropy(weight=2.0))])
def test_cross_entropy_unlike_trls_is_refused_too(head):
    with pytest.raises(ValueError, match="different objective"):
        _sft(apply_losscodegen(tiny_causal_lm(V), head))


def test_replace_fused_lm_heads_refuses_trls_trainers_whose_loss_reads_the_full_logits():
    """GKD's and GOLD's trainers subclass SFT's, whose constructor gives the model TRL's fused head, and
    compute their loss from the full logits (TRL's code): refused by what their compute_loss is. GMPO's
    subclasses GRPO's with its own _compute_loss, which reads the fused head: decided by its models (an
    empty trainer has none)."""
    from trl.experimental.gkd import GKDTrainer
    from trl.experimental.gmpo import GMPOTrainer
    from trl.experimental.gold import GOLDTrainer
    for cls in (GKDTrainer, GOLDTrainer):
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.compute_loss computes it from the full logits"):
            lcg_trl.replace_fused_lm_heads(cls.__new__(cls))
    with pytest.raises(ValueError, match="GMPOTrainer has no model with TRL's fused LM head"):
        lcg_trl.replace_fused_lm_heads(GMPOTrainer.__new__(GMPOTrainer))


@pytest.mark.parametrize("option", ["label_smoothing_factor", "compute_loss_func"])
def test_replace_fused_lm_heads_refuses_sft_whose_loss_comes_from_the_full_logits(option):
    """SFT with label smoothing or a compute_loss_func computes its loss from the model's logits, the fused
    outputs feeding its metrics only: TRL's own compute_loss takes that path, and the replacement is refused."""
    args = trl.SFTConfig(output_dir=OUT, use_cpu=True, report_to=[], bf16=False,
                         label_smoothing_factor=0.1 if option == "label_smoothing_factor" else 0.0)
    extra = dict(compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.mean()) \
        if option == "compute_loss_func" else {}
    trainer = trl.SFTTrainer(model=tiny_causal_lm(V), args=args, processing_class=tiny_tokenizer(V),
                             train_dataset=datasets.Dataset.from_dict({"text": ["t5 t6 t7 t8"] * 4}), **extra)
    trainer.model.train()
    ids = torch.randint(4, V, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    fused = []   # (TRL's own path: the loss's forward is the model's, without fused_lm_head)
    forward = trainer.model.forward
    trainer.model.forward = lambda *a, fused_lm_head=False, **k: fused.append(fused_lm_head) or forward(
        *a, fused_lm_head=fused_lm_head, **k)
    trainer.compute_loss(trainer.model, inputs)
    assert fused[0] is False and fused[-1] is True
    trainer.model.forward = forward
    with pytest.raises(ValueError, match=f"does not come from TRL's fused LM head with {option}"):
        lcg_trl.replace_fused_lm_heads(trainer)


def test_a_training_forward_whose_loss_is_computed_outside_warns_once():
    """Trainer(label_smoothing_factor>0) takes the labels out of the model's inputs: the head is unused."""
    model = apply_losscodegen(tiny_causal_lm(V)).train()
    ids = torch.randint(4, V, (2, 8))
    with pytest.warns(UserWarning, match="label_smoothing"):
        model(input_ids=ids)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=ids)
        with torch.no_grad():
            model.eval()(input_ids=ids)


JSD_CASES = [dict(beta=0.5), dict(beta=0.0), dict(beta=1.0), dict(beta=0.3, temperature=0.7),
             dict(beta=0.9, reduction="sum"), dict(beta=0.2, reduction="mean"),
             dict(beta=0.5, num_items_in_batch=torch.tensor(7.0)), dict(beta=0.5, labels=None),
             dict(beta=0.7, labels=None, reduction="mean")]


@pytest.mark.parametrize("case", JSD_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_generalized_jsd_loss_is_trls(case):
    from trl.experimental.gkd import GKDTrainer
    g = torch.Generator().manual_seed(1)
    student = (3 * torch.randn(2, 5, 80, generator=g)).requires_grad_()
    teacher = 3 * torch.randn(2, 5, 80, generator=g)
    labels = torch.randint(0, 80, (2, 5), generator=g)
    labels[0, :2] = -100
    labels[1, 4] = -100
    kwargs = {"labels": labels, **case}
    student64 = student.detach().double().requires_grad_()
    want = GKDTrainer.generalized_jsd_loss(student64, teacher.double(), **kwargs)
    got = lcg_trl.generalized_jsd_loss(student, teacher, **kwargs)
    want.backward()
    got.backward()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(student.grad.double(), student64.grad, rtol=1e-4, atol=1e-6)


def test_generalized_jsd_loss_refuses_what_one_pass_cannot_give():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="reduction='none'"):
        lcg_trl.generalized_jsd_loss(x, x, reduction="none")
    with pytest.raises(ValueError, match="beta"):
        lcg_trl.generalized_jsd_loss(x, x, beta=1.5)
    with pytest.raises(ValueError, match="one shape"):
        lcg_trl.generalized_jsd_loss(x, x[:, :8])


@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.3, 0.7), (1.0, 2.0)])
def test_jsd_trl_takes_trls_beta(beta, temperature):
    """``lcg.JSD.trl(beta=b)`` through head.linear is TRL's generalized_jsd_loss at beta=b (b weighs the
    teacher; 0 and 1 the KLs), against TRL's function on the float64 logits."""
    from trl.experimental.gkd import GKDTrainer
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(10, 24, generator=g), torch.randn(80, 24, generator=g) / 2
    t_hidden, t_weight = torch.randn(10, 16, generator=g), torch.randn(80, 16, generator=g) / 2
    labels = torch.randint(0, 80, (10,), generator=g)
    labels[[2, 7]] = -100
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = GKDTrainer.generalized_jsd_loss(h64 @ w64.T, (t_hidden @ t_weight.T).double(), labels=labels,
                                           beta=beta, temperature=temperature)
    want.backward()
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    got = lcg.HeadLoss(lcg.JSD.trl(beta=beta, temperature=temperature)).linear(
        h, w, labels, teacher_hidden=t_hidden, teacher_weight=t_weight).loss
    got.backward()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="JSD.trl: beta must be a number in"):
        lcg.JSD.trl(beta=1.5)
