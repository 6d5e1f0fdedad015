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


def _token_means(model, rows):
    """Per-token means over every row's scored tokens (each row's own, labels its input ids), float64,
    from the model's own logits."""
    model = copy.deepcopy(model).double().eval()
    values = {"cross_entropy": [], "z_loss": [], "entropy": [], "token_accuracy": []}
    for ids in rows:
        ids = torch.tensor([ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        y = ids[0, 1:]
        logp = logits.log_softmax(-1)
        values["cross_entropy"].append(-logp.gather(-1, y[:, None])[:, 0])
        values["z_loss"].append(logits.logsumexp(-1) ** 2)
        values["entropy"].append(-(logp.exp() * logp).sum(-1))
        values["token_accuracy"].append((logits.argmax(-1) == y).double())
    return {k: torch.cat(v).mean().item() for k, v in values.items()}


class _Reporter(transformers.TrainerCallback):
    """A reporting callback, as report_to's are."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_the_heads_terms_reach_log_history_as_per_token_means_over_the_accumulated_batch(tmp_path):
    model = tiny_causal_lm(V)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    train = [torch.randint(4, V, (n,), generator=g).tolist() for n in (5, 11, 7, 3)]   # unequal token counts
    evaluation = [torch.randint(4, V, (n,), generator=g).tolist() for n in (9, 4, 6)]
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=W_Z), metrics=(lcg.Entropy(), lcg.TokenAccuracy()))
    args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, learning_rate=0.0,
                         per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
                         per_device_eval_batch_size=2, logging_steps=1, save_strategy="no", disable_tqdm=True)
    reporter = _Reporter()
    trainer = lcg_trl.SFTTrainer(model=apply_losscodegen(model, head), args=args, processing_class=tiny_tokenizer(V),
                                 train_dataset=datasets.Dataset.from_dict({"input_ids": train}),
                                 eval_dataset=datasets.Dataset.from_dict({"input_ids": evaluation}),
                                 callbacks=[reporter])
    trainer.train()
    want = _token_means(reference, train)      # (learning rate 0: the step's parameters)
    (logged,) = [h for h in trainer.state.log_history if "loss" in h]
    (reported,) = [h for h in reporter.logs if "loss" in h]
    for name, value in want.items():
        assert logged[name] == pytest.approx(value, rel=1e-5), name
        assert reported[name] == logged[name], name
    assert logged["loss"] == pytest.approx(want["cross_entropy"] + W_Z * want["z_loss"], rel=1e-5)

    metrics = trainer.evaluate()
    want = _token_means(reference, evaluation)
    for name, value in want.items():
        assert metrics["eval_" + name] == pytest.approx(value, rel=1e-5), name
        assert reporter.logs[-1]["eval_" + name] == metrics["eval_" + name], name
