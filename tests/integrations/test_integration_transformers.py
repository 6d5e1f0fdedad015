"""apply_losscodegen against transformers' own code: tiny causal LMs built from configs (random weights,
fp32, CPU), the patched model's loss and gradients against the unpatched model's forward, which
computes its own loss; logits outside training exactly as before; and transformers.Trainer with
gradient accumulation leaving the same parameters as the unpatched model."""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import losscodegen as lcg  # noqa: E402
from losscodegen.integrations.transformers import SUPPORTED_MODEL_TYPES, apply_losscodegen  # noqa: E402

V = 96
# model type -> config overrides: the transforms made to matter (a small softcap, a scale, a divisor),
# Qwen2 with tied embeddings, Phi with its biased output layer.
CASES = {
    "llama": {},
    "qwen2": dict(tie_word_embeddings=True),
    "gemma2": dict(final_logit_softcapping=3.0),
    "gemma3_text": dict(final_logit_softcapping=2.5),
    "phi": {},
    "cohere": dict(logit_scale=0.5),
    "granite": dict(logits_scaling=4.0),
}


def tiny(model_type, seed=0):
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **CASES[model_type])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():   # logits of a few units, where the softcap and the scales matter
        model.lm_head.weight.mul_(20)
        if model.lm_head.bias is not None:
            model.lm_head.bias.normal_()
    return model


def batch(seed=0, B=2, T=10):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100        # a prompt
    labels[1, 7:] = -100        # padding
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", list(CASES))
def test_training_forward_matches_the_unpatched_forward(model_type):
    ref = tiny(model_type)
    model = apply_losscodegen(copy.deepcopy(ref))
    inputs = batch()
    for kwargs in ({}, dict(num_items_in_batch=torch.tensor(23))):
        for m in (ref, model):
            m.train()
            m.zero_grad()
        want = ref(**inputs, **kwargs)
        got = model(**inputs, **kwargs)
        assert got.logits is None and want.logits is not None
        want.loss.backward()
        got.loss.backward()
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
        ref_grads, grads = _grads(ref), _grads(model)
        assert ref_grads.keys() == grads.keys() and model.lm_head.weight.grad is not None
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    if model_type == "qwen2":   # tied: one parameter for both ends, its gradient from both
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("model_type", ["gemma2", "phi"])
def test_outside_training_the_logits_are_the_models_own(model_type):
    ref = tiny(model_type).eval()
    model = apply_losscodegen(copy.deepcopy(ref)).eval()
    inputs = batch()
    with torch.no_grad():
        want, got = ref(**inputs), model(**inputs)                   # evaluation: logits and loss
        assert torch.equal(got.logits, want.logits)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
        no_labels = {k: v for k, v in inputs.items() if k != "labels"}
        assert torch.equal(model(**no_labels).logits, ref(**no_labels).logits)
        assert torch.equal(model(**no_labels, logits_to_keep=1).logits, ref(**no_labels, logits_to_keep=1).logits)
        generated = model.generate(inputs["input_ids"][:, :4], max_new_tokens=3, do_sample=False)
        assert torch.equal(generated, ref.generate(inputs["input_ids"][:, :4], max_new_tokens=3, do_sample=False))


def test_shift_labels_and_tuples():
    ref = tiny("llama").train()
    model = apply_losscodegen(copy.deepcopy(ref))
    inputs = batch()
    labels = inputs.pop("labels")
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    want = ref(**inputs, labels=labels).loss
    torch.testing.assert_close(model(**inputs, shift_labels=shifted).loss, want, rtol=1e-6, atol=1e-6)
    out = model(**inputs, labels=labels, return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], want, rtol=1e-6, atol=1e-6)


def test_a_head_with_more_terms_and_its_metrics_for_logging():
    """CE + z-loss with entropy and accuracy metrics, against a float64 reference on the unpatched
    model's logits; model.losscodegen holds the last training forward's terms and metrics."""
    ref = tiny("gemma2").train()
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-2), metrics=(lcg.Entropy(), lcg.TokenAccuracy()),
                        softcap=3.0)
    model = apply_losscodegen(copy.deepcopy(ref), head)
    inputs = batch()
    out = model(**inputs)
    out.loss *= 2   # as the Trainer scales it, in place
    out.loss.backward()
    z = ref(**inputs).logits.double()                   # softcapped by the model itself
    y = torch.nn.functional.pad(inputs["labels"], (0, 1), value=-100)[:, 1:]
    valid = y != -100
    z, y = z[valid], y[valid]
    lse = torch.logsumexp(z, -1)
    ce, zl = (lse - z.gather(-1, y[:, None])[:, 0]).mean(), (lse ** 2).mean()
    ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1).mean()
    acc = (z.argmax(-1) == y).double().mean()
    state = model.losscodegen
    torch.testing.assert_close(out.loss.double(), 2 * (ce + 1e-2 * zl), rtol=1e-5, atol=1e-6)
    for got, want in ((state.terms["cross_entropy"], ce), (state.terms["z_loss"], zl),
                      (state.metrics["entropy"], ent), (state.metrics["token_accuracy"], acc)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_the_patch_is_the_instances_only():
    ref = tiny("llama")
    signature = inspect.signature(ref.forward)
    model = apply_losscodegen(copy.deepcopy(ref))
    assert inspect.signature(model.forward) == signature        # the Trainer reads it
    assert type(model).forward is type(ref).forward and "forward" not in vars(ref)
    clone = copy.deepcopy(model).train()                       # bound to the copy, not to the original
    clone(**batch()).loss.backward()
    assert clone.lm_head.weight.grad is not None and model.lm_head.weight.grad is None
    assert dict(model.named_modules()).keys() == dict(ref.named_modules()).keys()   # the head is no submodule


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        apply_losscodegen(tiny("gemma2"), lcg.HeadLoss(lcg.CrossEntropy()))
    with pytest.raises(ValueError, match="logit_scale"):
        apply_losscodegen(tiny("granite"), lcg.HeadLoss(lcg.CrossEntropy()))
    with pytest.raises(ValueError, match="-100"):
        apply_losscodegen(tiny("llama"), lcg.HeadLoss(lcg.CrossEntropy(), ignore_index=-1))
    with pytest.raises(ValueError, match="already patched"):
        apply_losscodegen(apply_losscodegen(tiny("llama")))
    with pytest.raises(TypeError, match="PreTrainedModel"):
        apply_losscodegen(torch.nn.Linear(2, 2))
    model = tiny("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.mean()
    with pytest.raises(ValueError, match="loss_function is not transformers' ForCausalLMLoss"):
        apply_losscodegen(model)

    class Doubled(torch.nn.Linear):       # an output layer that is not the linear map its weight says
        def forward(self, x):
            return super().forward(x) * 2
    model = tiny("llama")
    model.lm_head = Doubled(32, V, bias=False)
    with pytest.raises(ValueError, match="the output layer self.lm_head is a Doubled, not an nn.Linear"):
        apply_losscodegen(model)
    model = apply_losscodegen(tiny("llama")).train()
    model.lm_head = Doubled(32, V, bias=False)          # wrapped after the patch (as PEFT would wrap it)
    with pytest.raises(ValueError, match="the output layer self.lm_head is a Doubled, not an nn.Linear"):
        model(**batch())


def test_a_causal_lm_no_test_of_losscodegen_has_seen_is_patched():
    """GPT-NeoX is in no list of losscodegen's: its forward reads as the standard path, and the patched
    model trains on the loss and gradients of the unpatched one."""
    assert "gpt_neox" not in SUPPORTED_MODEL_TYPES
    config = transformers.AutoConfig.for_model("gpt_neox", vocab_size=V, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).train()
    model = apply_losscodegen(copy.deepcopy(ref))
    inputs = batch()
    want, got = ref(**inputs), model(**inputs)
    want.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# ---- transformers.Trainer ------------------------------------------------------------------------
def _dataset(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, V, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()}
            for _ in range(n)]


def _collate(rows):
    """Right padding, labels -100 on padding: micro-batches of different token counts, so the
    gradient accumulation's divisor (num_items_in_batch) matters."""
    T = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = labels[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
    return dict(input_ids=ids, attention_mask=(labels != -100).long(), labels=labels)


def _train(model, out_dir):
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", use_cpu=True, report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0, remove_unused_columns=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset(), data_collator=_collate)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2"])
def test_trainer_with_gradient_accumulation_ends_at_the_unpatched_parameters(model_type, tmp_path):
    ref = tiny(model_type)
    model = apply_losscodegen(copy.deepcopy(ref))
    start = copy.deepcopy(ref)
    ref_losses, losses = _train(ref, tmp_path / "ref"), _train(model, tmp_path / "patched")
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    moved = 0.0
    for (name, p), q, p0 in zip(model.named_parameters(), ref.parameters(), start.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        moved = max(moved, (q - p0).abs().max().item())
    assert moved > 1e-2   # (the steps did train)


def test_a_batch_without_valid_labels_gives_0_with_any_num_items_in_batch():
    from helpers import tiny_causal_lm
    model = apply_losscodegen(tiny_causal_lm(48)).train()
    ids = torch.randint(3, 48, (2, 6), generator=torch.Generator().manual_seed(0))
    for count in (None, 0, torch.tensor(0), torch.tensor(7)):   # (the Trainer's count is a tensor)
        model.zero_grad()
        loss = model(input_ids=ids, labels=torch.full_like(ids, -100), num_items_in_batch=count).loss
        loss.backward()
        assert loss.item() == 0, count
        assert model.lm_head.weight.grad is None or not model.lm_head.weight.grad.any(), count
    labels = ids.clone()
    with pytest.raises(ValueError, match="num_items_in_batch must be a positive finite number, got -1"):
        model(input_ids=ids, labels=labels, num_items_in_batch=-1)
    with pytest.raises(TypeError, match="num_items_in_batch must be a number or a numeric tensor"):
        model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(True))
    # with valid labels the count divides as given
    ref = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(20)).loss,
                               ref * 10 / 20)
