"""losscodegen.integrations.trl.DPOTrainer and KTOTrainer against trl.DPOTrainer and trl.KTOTrainer on a
tiny causal LM (CPU): the same constructor, and TRL's own _compute_loss on its fused LM head against
ours, one head.linear call: the loss, every trainable parameter's gradient and every metric TRL logs.
DPO: TRL's loss types, several with loss_weights, the f-divergences, WPO's weighting, a reference model
or precomputed reference log-probs, a softcapped model. KTO: both loss types (with TRL's KL estimate),
the desirable/undesirable weights, a batch of one kind. The options that cannot be fused are refused
at construction."""
import copy

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

from losscodegen.integrations import trl as lcg_trl  # noqa: E402
from helpers import TorchOps, tiny_causal_lm, tiny_tokenizer  # noqa: E402

V, B, T = 80, 3, 9  # (V: no width of the model's own tensors)


def _models(model_type="llama", **overrides):
    """A policy and a reference a little away from it (so that rewards and margins are not 0)."""
    policy = tiny_causal_lm(V, model_type, **overrides)
    ref = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return policy, ref


def _trainer(cls, policy, ref, evaluate=False, **options):
    args = trl.DPOConfig(output_dir="/tmp/lcg-trl-dpo-test", use_cpu=True, report_to=[], bf16=False,
                         **{"per_device_train_batch_size": B, **options})
    data = datasets.Dataset.from_dict({"prompt": ["t5 t6 t7"] * B, "chosen": [" t8 t9"] * B,
                                       "rejected": [" t10"] * B})
    return _built(cls, policy, ref, args, data, evaluate)


def _built(cls, policy, ref, args, data, evaluate=False):
    trainer = cls(model=copy.deepcopy(policy), ref_model=None if ref is None else copy.deepcopy(ref), args=args,
                  processing_class=tiny_tokenizer(V), train_dataset=data, eval_dataset=data if evaluate else None)
    trainer.model.train()
    return trainer


def _batch(seed=0, ref=None):
    """TRL's collated layout: B chosen rows then B rejected ones, prompts of 2-4 tokens, right padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (2 * B, T), generator=g)
    completion_mask = torch.zeros(2 * B, T, dtype=torch.long)
    attention_mask = torch.ones(2 * B, T, dtype=torch.long)
    for i in range(2 * B):
        start, end = 2 + i % 3, T - (i * 2) % 4
        completion_mask[i, start:end] = 1
        attention_mask[i, end:] = 0
        ids[i, end:] = 0
    inputs = dict(input_ids=ids, attention_mask=attention_mask, completion_mask=completion_mask)
    if ref is not None:   # precomputed reference log-probs: the reference model's sums
        with torch.no_grad():
            logp = torch.log_softmax(ref(input_ids=ids, attention_mask=attention_mask).logits[:, :-1].float(), -1)
            lp = logp.gather(-1, ids[:, 1:, None])[..., 0] * completion_mask[:, 1:]
        inputs.update(ref_chosen_logps=lp.sum(1)[:B], ref_rejected_logps=lp.sum(1)[B:])
    return inputs


def _run(trainer, inputs):
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    loss.backward()
    grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _assert_same(policy, ref, precompute=False, **options):
    theirs = _trainer(trl.DPOTrainer, policy, None if precompute else ref, precompute_ref_log_probs=precompute,
                      **options)
    ours = _trainer(lcg_trl.DPOTrainer, policy, None if precompute else ref, precompute_ref_log_probs=precompute,
                    **options)
    return _assert_same_step(theirs, ours, _batch(ref=ref if precompute else None))


def _assert_same_step(theirs, ours, inputs):
    want, want_grads, want_metrics = _run(theirs, inputs)
    got, grads, metrics = _run(ours, inputs)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        assert g is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=2e-5 * g.abs().max().item(), msg=name)
    assert metrics.keys() == want_metrics.keys()
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=2e-5, abs=2e-6), name
    return want_metrics


CASES = {
    "sigmoid (TRL's default), a reference model": dict(),
    "hinge": dict(loss_type=["hinge"], beta=0.5),
    "ipo, WPO weighting": dict(loss_type=["ipo"], use_weighting=True),
    "robust with label smoothing, js divergence": dict(loss_type=["robust"], label_smoothing=0.2,
                                                       f_divergence_type="js_divergence"),
    "apo_zero + sft, loss_weights": dict(loss_type=["apo_zero", "sft"], loss_weights=[1.0, 0.3]),
    "aot + aot_unpaired (the batch's sorted log-ratios), label smoothing": dict(
        loss_type=["aot", "aot_unpaired"], loss_weights=[1.0, 0.5], label_smoothing=0.1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_trainer_equals_trls(case):
    metrics = _assert_same(*_models(), **CASES[case])
    # (the metrics were logged and moved: the reference is not the policy)
    assert metrics["rewards/margins"] != 0.0 and {"rewards/accuracies", "logps/chosen", "logits/rejected",
                                                  "mean_token_accuracy", "entropy"} <= metrics.keys()


def test_dpo_trainer_with_precomputed_reference_logprobs():
    _assert_same(*_models(), precompute=True, loss_type=["sigmoid", "nca_pair"], loss_weights=[0.7, 0.5],
                 f_divergence_type="reverse_kl")


def test_dpo_trainer_on_a_softcapped_model():
    _assert_same(*_models("gemma2", final_logit_softcapping=3.0), loss_type=["discopop"])


def test_dpo_trainer_builds_no_logits():
    """The output layer is never called as a module, and no tensor as wide as the vocabulary is the
    model's [2B, T, V] logits: only head.linear's 2-D chunks of rows (forward and backward; the
    reference log-probs precomputed)."""
    policy, ref = _models()
    ours = _trainer(lcg_trl.DPOTrainer, policy, ref, precompute_ref_log_probs=True)
    calls = []
    ours.model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    inputs = _batch(ref=ref)
    with TorchOps() as seen:
        ours._compute_loss(ours.model, inputs, return_outputs=False).backward()
    assert not calls
    wide = [s for _, shapes in seen.ops for s in shapes if s and s[-1] == V and s[0] != V]
    assert wide and all(len(s) == 2 for s in wide), {s for s in wide if len(s) != 2}


@pytest.mark.parametrize("options,named", [(dict(ld_alpha=0.5), "ld_alpha=0.5")])
def test_options_it_cannot_fuse_are_refused_naming_them(options, named):
    policy, ref = _models()
    with pytest.raises(ValueError, match=f"losscodegen's DPOTrainer cannot fuse {named}"):
        _trainer(lcg_trl.DPOTrainer, policy, ref, **options)


def test_a_pair_without_completion_tokens_is_refused():
    trainer = _trainer(lcg_trl.DPOTrainer, *_models())
    inputs = _batch()
    inputs["completion_mask"][[0, B]] = 0
    with pytest.raises(ValueError, match="has no completion token"):
        trainer._compute_loss(trainer.model, inputs, return_outputs=False)


# ----- KTO ----------------------------------------------------------------------------------------
def _kto_trainer(cls, policy, ref, labels=(True, False, True, False), evaluate=False, **options):
    args = trl.KTOConfig(output_dir="/tmp/lcg-trl-kto-test", use_cpu=True, report_to=[], bf16=False,
                         **{"per_device_train_batch_size": len(labels), **options})
    prompts, completions = ["t5 t6 t7", "t8 t9", "t10 t11 t12 t13", "t14"], [" t20 t21", " t22", " t23 t24 t25", " t26 t27"]
    data = datasets.Dataset.from_dict({"prompt": [prompts[i % 4] for i in range(len(labels))],
                                       "completion": [completions[i % 4] for i in range(len(labels))],
                                       "label": list(labels)})
    return _built(cls, policy, ref, args, data, evaluate)


KTO_CASES = {
    "kto (TRL's default, with its KL estimate), a reference model": dict(),
    "kto, weights, precomputed reference log-probs": dict(desirable_weight=1.3, undesirable_weight=0.6,
                                                          precompute_ref_log_probs=True),
    "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired", beta=0.5),
    "desirable completions only": dict(labels=(True, True, True)),
}


@pytest.mark.parametrize("case", list(KTO_CASES))
def test_kto_trainer_equals_trls(case):
    policy, ref = _models()
    theirs = _kto_trainer(trl.KTOTrainer, policy, ref, **KTO_CASES[case])
    ours = _kto_trainer(lcg_trl.KTOTrainer, policy, ref, **KTO_CASES[case])
    n = len(theirs.train_dataset)
    inputs = theirs.data_collator([theirs.train_dataset[i] for i in range(n)])
    metrics = _assert_same_step(theirs, ours, inputs)
    assert metrics["rewards/chosen"] != 0.0 and {"kl", "logps/chosen", "logits/chosen", "entropy"} <= metrics.keys()


def test_kto_trainer_refuses_a_completion_without_tokens():
    trainer = _kto_trainer(lcg_trl.KTOTrainer, *_models())
    inputs = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    inputs["completion_mask"][1] = 0
    with pytest.raises(ValueError, match="a completion has no completion token"):
        trainer._compute_loss(trainer.model, inputs, return_outputs=False)


@pytest.mark.parametrize("build", [_trainer, _kto_trainer], ids=["dpo", "kto"])
def test_a_mixture_of_experts_load_balancing_loss_is_refused(build):
    cls = lcg_trl.DPOTrainer if build is _trainer else lcg_trl.KTOTrainer
    moe = _models("mixtral", num_local_experts=2, num_experts_per_tok=1, output_router_logits=True,
                  router_aux_loss_coef=0.02)
    with pytest.raises(ValueError, match="cannot fuse router_aux_loss_coef=0.02"):
        build(cls, *moe)


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_training_steps_log_what_trls_trainer_logs(kind):
    """trainer.train(): two optimizer steps (two micro-batches each) from the same seed, then evaluate():
    our trainer's log_history equal to TRL's (the loss, the learning rate, every metric, the eval_ ones):
    the fused loss drives the Trainer's loops as TRL's does."""
    policy, ref = _models()
    options = dict(max_steps=2, logging_steps=1, gradient_accumulation_steps=2, learning_rate=1e-2, seed=3,
                   evaluate=True)
    histories = []
    for cls in ((trl.DPOTrainer, lcg_trl.DPOTrainer) if kind == "dpo" else (trl.KTOTrainer, lcg_trl.KTOTrainer)):
        if kind == "dpo":
            trainer = _trainer(cls, policy, ref, per_device_train_batch_size=1, **options)
        else:
            trainer = _kto_trainer(cls, policy, ref, labels=(True, False) * 4, per_device_train_batch_size=2,
                                   **options)
        trainer.train()
        trainer.evaluate()
        histories.append([{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k}
                          for h in trainer.state.log_history])
    want, got = histories
    assert len(want) == len(got) == 4 and want[0].keys() == got[0].keys() and "rewards/chosen" in got[0]
    assert want[-1].keys() == got[-1].keys() and "eval_rewards/chosen" in got[-1]
    for w, g in zip(want, got):
        for name, value in w.items():
            assert g[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


# ----- CPO (trl.experimental) -----------------------------------------------------------------------
def _cpo_trainer(cls, policy, **options):
    from trl.experimental.cpo import CPOConfig
    args = CPOConfig(output_dir="/tmp/lcg-trl-cpo-test", use_cpu=True, report_to=[], bf16=False,
                     per_device_train_batch_size=B, **options)
    data = datasets.Dataset.from_dict({"prompt": ["t5 t6 t7", "t8", "t9 t10"],
                                       "chosen": [" t11 t12", " t13", " t14 t15 t16"],
                                       "rejected": [" t17", " t18 t19 t20", " t21 t22"]})
    trainer = cls(model=copy.deepcopy(policy), args=args, processing_class=tiny_tokenizer(V), train_dataset=data)
    trainer.model.train()
    return trainer


CPO_CASES = {
    "sigmoid (TRL's default), cpo_alpha": dict(cpo_alpha=0.5, label_smoothing=0.1),
    "simpo (SimPO: cpo_alpha=0)": dict(loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.7, beta=2.0),
    "ipo": dict(loss_type="ipo"),
    "hinge, AlphaPO": dict(loss_type="hinge", alpha=0.3),
}


@pytest.mark.parametrize("case", list(CPO_CASES))
def test_cpo_trainer_equals_trls(case):
    from trl.experimental.cpo import CPOTrainer
    from losscodegen.integrations.trl_cpo import CPOTrainer as Ours
    policy, _ = _models()
    runs = []
    for cls in (CPOTrainer, Ours):
        trainer = _cpo_trainer(cls, policy, **CPO_CASES[case])
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(B)])
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in trainer.model.named_parameters()}, metrics))
    (want, want_grads, want_metrics), (got, grads, metrics) = runs
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=2e-5 * g.abs().max().item(), msg=name)
    assert list(metrics) == list(want_metrics)
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=2e-5, abs=2e-6), name
    assert want_metrics["rewards/margins"] != 0.0


def test_cpo_trainer_refuses_a_softcapped_model():
    from losscodegen.integrations.trl_cpo import CPOTrainer
    with pytest.raises(ValueError, match="cannot fuse a final-logit softcap"):
        _cpo_trainer(CPOTrainer, _models("gemma2", final_logit_softcapping=3.0)[0])


# ----- ORPO (trl.experimental) ----------------------------------------------------------------------
def _orpo_trainer(cls, policy, **options):
    from trl.experimental.orpo import ORPOConfig
    args = ORPOConfig(output_dir="/tmp/lcg-trl-orpo-test", use_cpu=True, report_to=[], bf16=False,
                      per_device_train_batch_size=B, **options)
    data = datasets.Dataset.from_dict({"prompt": ["t5 t6 t7", "t8", "t9 t10"],
                                       "chosen": [" t11 t12", " t13", " t14 t15 t16"],
                                       "rejected": [" t17", " t18 t19 t20", " t21 t22"]})
    trainer = cls(model=copy.deepcopy(policy), args=args, processing_class=tiny_tokenizer(V), train_dataset=data)
    trainer.model.train()
    return trainer


@pytest.mark.parametrize("options", [{}, dict(beta=0.7)], ids=["default beta", "beta 0.7"])
def test_orpo_trainer_equals_trls(options):
    """TRL's compute_loss (its concatenated_forward, odds_ratio_loss and NLL over the prompt and the
    response) against ours: the loss, every parameter's gradient and every metric it stores."""
    from trl.experimental.orpo import ORPOTrainer
    from losscodegen.integrations.trl_orpo import ORPOTrainer as Ours
    policy, _ = _models()
    runs = []
    for cls in (ORPOTrainer, Ours):
        trainer = _orpo_trainer(cls, policy, **options)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(B)])
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in trainer.model.named_parameters()},
                     {k: v[-1] for k, v in trainer._stored_metrics["train"].items()}))
    (want, want_grads, want_metrics), (got, grads, metrics) = runs
    torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=2e-5 * g.abs().max().item(), msg=name)
    assert list(metrics) == list(want_metrics)
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=2e-5, abs=2e-6), name
    assert want_metrics["rewards/margins"] != 0.0 and want_metrics["log_odds_chosen"] != 0.0


def test_orpo_trainer_refuses_a_negative_beta_and_a_softcapped_model():
    from losscodegen.integrations.trl_orpo import ORPOTrainer
    with pytest.raises(ValueError, match="cannot fuse beta=-0.1"):
        _orpo_trainer(ORPOTrainer, _models()[0], beta=-0.1)
    with pytest.raises(ValueError, match="cannot fuse a final-logit softcap.*trl.experimental.orpo.ORPOTrainer"):
        _orpo_trainer(ORPOTrainer, _models("gemma2", final_logit_softcapping=3.0)[0])
