"""losscodegen.integrations.trl.SFTTrainer: TRL's SFT trainer (same constructor, TRL's compute_loss) on
losscodegen's fused LM head. On a plain model its loss, gradients and metrics are trl.SFTTrainer's; on a
model patched by apply_losscodegen with CE + z-loss (which trl.SFTTrainer refuses) they are the head's
objective, against float64 torch on the model's own logits."""
import copy

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

V, W_Z = 96, 0.05
N_ITEMS = 19


def _trainer(cls, model, **options):
    args = trl.SFTConfig(output_dir="/tmp/lcg-trl-sft-test", use_cpu=True, report_to=[], bf16=False, **options)
    t = cls(model=model, args=args, processing_class=tiny_tokenizer(V),
            train_dataset=datasets.Dataset.from_dict({"text": ["t5 t6 t7 t8"] * 4}))
    t.model.train()
    return t


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, V, (3, 10), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[2, 7:] = -100
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def _loss_grads_metrics(trainer):
    loss = trainer.compute_loss(trainer.model, _inputs(), num_items_in_batch=torch.tensor(N_ITEMS))
    loss.backward()
    grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss, grads, {k: v[-1] for k, v in trainer._metrics["train"].items() if k != "num_tokens"}


def test_on_a_plain_model_it_is_trls_sft():
    want, want_grads, want_metrics = _loss_grads_metrics(_trainer(trl.SFTTrainer, tiny_causal_lm(V)))
    got, grads, metrics = _loss_grads_metrics(_trainer(lcg_trl.SFTTrainer, tiny_causal_lm(V)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item())
    assert metrics.keys() == want_metrics.keys()
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_on_a_patched_model_it_trains_on_the_heads_objective():
    model = tiny_causal_lm(V)
    reference = copy.deepcopy(model).double()
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=W_Z))
    with pytest.raises(ValueError, match="different objective"):
        _trainer(trl.SFTTrainer, apply_losscodegen(copy.deepcopy(model), head))
    got, grads, metrics = _loss_grads_metrics(_trainer(lcg_trl.SFTTrainer, apply_losscodegen(model, head)))

    inputs = _inputs()
    logits = reference(input_ids=inputs["input_ids"]).logits[:, :-1]
    y = inputs["labels"][:, 1:]
    valid = y != -100
    logp = logits.log_softmax(-1)
    ce = -logp.gather(-1, y.clamp(min=0)[..., None])[..., 0]
    rows = ce + W_Z * logits.logsumexp(-1) ** 2
    want = torch.where(valid, rows, 0).sum() / N_ITEMS
    want.backward()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item(),
                                   msg=lambda m, n=name: f"{n}: {m}")
    entropy = -(logp.exp() * logp).sum(-1)
    accuracy = (logits.argmax(-1) == y).double()
    assert metrics["entropy"] == pytest.approx(entropy[valid].mean().item(), rel=1e-5)
    assert metrics["mean_token_accuracy"] == pytest.approx(accuracy[valid].mean().item(), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("option", [dict(loss_type="dft"), dict(label_smoothing_factor=0.1)])
def test_options_whose_loss_is_not_the_fused_outputs_are_refused_for_another_objective(option):
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=W_Z))
    with pytest.raises(ValueError, match=next(iter(option))):
        _trainer(lcg_trl.SFTTrainer, apply_losscodegen(tiny_causal_lm(V), head), **option)
