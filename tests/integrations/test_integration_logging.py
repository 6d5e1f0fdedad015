"""LosscodegenCallback: it patches the Trainer's model when the Trainer is built, and the head's terms
and metrics reach the Trainer's logs (log_history, and every callback that reports them, those listed
before it included) as per-token means over the accumulated batch; evaluate() reports the evaluation
set's. References: float64 torch on the model's own logits."""
import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import losscodegen as lcg  # noqa: E402
from losscodegen.integrations.transformers import LosscodegenCallback, apply_losscodegen  # noqa: E402
from helpers import tiny_causal_lm  # noqa: E402

V = 96
W_Z = 0.05


def _head():
    return lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=W_Z), metrics=(lcg.Entropy(), lcg.TokenAccuracy()))


def _rows(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(4, V, (n,), generator=g).tolist()} for n in lengths]


def _collate(rows):
    T = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = labels[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
    return dict(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels)


def _reference(model, rows):
    """Per-token means over every row's scored tokens, float64, from the model's own logits."""
    model = copy.deepcopy(model).double().eval()
    values = {"cross_entropy": [], "z_loss": [], "entropy": [], "token_accuracy": []}
    for r in rows:
        ids = torch.tensor([r["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        y = ids[0, 1:]
        logp = logits.log_softmax(-1)
        lse = logits.logsumexp(-1)
        values["cross_entropy"].append(-logp.gather(-1, y[:, None])[:, 0])
        values["z_loss"].append(lse ** 2)
        values["entropy"].append(-(logp.exp() * logp).sum(-1))
        values["token_accuracy"].append((logits.argmax(-1) == y).double())
    return {k: torch.cat(v).mean().item() for k, v in values.items()}


class Recorder(transformers.TrainerCallback):
    """A reporting callback (as report_to's are), listed before LosscodegenCallback."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_terms_and_metrics_reach_every_log_as_per_token_means_and_evaluate_reports_evaluation(tmp_path):
    model = tiny_causal_lm(V)
    reference = copy.deepcopy(model)
    train, evaluation = _rows([5, 11, 7, 3], seed=1), _rows([9, 4, 6], seed=2)   # unequal token counts
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=1,
        per_device_eval_batch_size=2, learning_rate=0.0, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, remove_unused_columns=False)
    recorder = Recorder()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                   data_collator=_collate, callbacks=[recorder, LosscodegenCallback(_head())])
    assert "losscodegen" in vars(trainer.model)       # patched when the Trainer was built
    trainer.train()
    want = _reference(reference, train)               # (learning rate 0: the step's parameters)
    (logged,) = [h for h in trainer.state.log_history if "loss" in h]
    (reported,) = [h for h in recorder.logs if "loss" in h]
    for name, value in want.items():
        assert logged[name] == pytest.approx(value, rel=1e-5), name
        assert reported[name] == logged[name], name
    # the Trainer's loss: the head's objective over the same tokens
    assert logged["loss"] == pytest.approx(want["cross_entropy"] + W_Z * want["z_loss"], rel=1e-5)

    metrics = trainer.evaluate()
    want = _reference(reference, evaluation)
    for name, value in want.items():
        assert metrics["eval_" + name] == pytest.approx(value, rel=1e-5), name
        assert trainer.state.log_history[-1]["eval_" + name] == metrics["eval_" + name]
        assert recorder.logs[-1]["eval_" + name] == metrics["eval_" + name]
    # (eval_loss is the Trainer's mean of its batches' losses, not a per-token mean: not compared)


def test_the_callback_keeps_a_patched_model_and_refuses_another_head(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    model = apply_losscodegen(tiny_causal_lm(V), head := _head())
    transformers.Trainer(model=model, args=args, callbacks=[LosscodegenCallback(head)])
    assert model.losscodegen.head is head
    with pytest.raises(ValueError, match="another head"):
        transformers.Trainer(model=model, args=args, callbacks=[LosscodegenCallback(_head())])
    with pytest.raises(TypeError, match="head must be"):
        LosscodegenCallback(lcg.CrossEntropy())


def test_label_smoothing_warns_that_the_head_is_not_used(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                                          label_smoothing_factor=0.1)
    with pytest.warns(UserWarning, match="label_smoothing_factor=0.1"):
        transformers.Trainer(model=tiny_causal_lm(V), args=args, callbacks=[LosscodegenCallback()])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        transformers.Trainer(model=tiny_causal_lm(V), args=transformers.TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[]), callbacks=[LosscodegenCallback()])
