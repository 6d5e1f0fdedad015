"""losscodegen.integrations.trl's drop-in for TRL's fused LM head, against TRL's own: the patched
forward's every field (and the gradients through log-probs and entropy) against
trl.trainer.utils.add_fused_lm_head's and a float64 torch reference from the model's own logits; then
TRL's trainers (GRPO, RLOO, SFT), built on a tiny model from a config (no hub), with TRL's head and
with ours: TRL's own loss code, its value, every parameter's gradient and its logged metrics equal in
fp32 on the CPU, for options whose loss no one head call holds too (TRL's code computes it from our
per-token outputs). And no [batch, seq, vocab] tensor."""
import copy

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head  # noqa: E402

from losscodegen.integrations import trl as lcg_trl  # noqa: E402
from losscodegen.integrations.trl_lm_head import FUSED_OUTPUTS, final_logit_transform  # noqa: E402
from helpers import TorchOps, tiny_causal_lm, tiny_tokenizer  # noqa: E402

V, B, T = 96, 3, 10     # (V unlike any other width of the model: 32 hidden, 64 intermediate)
FIELDS = ("loss", *FUSED_OUTPUTS, "label_mask")


def _model(model_type="llama", **overrides):
    return tiny_causal_lm(V, model_type, **overrides)


def _pair(model, **options):
    """The model with TRL's fused head, and a copy with ours, given the same arguments."""
    ours = copy.deepcopy(model)
    trl_add_fused_lm_head(model, **options)
    lcg_trl.add_fused_lm_head(ours, **options)
    return model, ours


def _inputs(model, shift=False, seed=0):
    """input ids; labels with a masked prompt, padding and (with ``shift``, as shift_labels) half of them
    the model's top-1, so that is_top1 is both True and False."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (B, T), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    labels[2, 7:] = -100
    if shift:
        with torch.no_grad():
            top1 = model(input_ids=ids).logits.argmax(-1)
        labels = torch.where(torch.rand(B, T, generator=g) < 0.5, top1, torch.roll(ids, -1, 1))
        labels[:, :2] = -100
        labels[1, 6:] = -100
        return ids, dict(shift_labels=labels)
    return ids, dict(labels=labels)


def _float64_reference(model64, ids, labels, temperature, shifted):
    """Every field from the model's own logits (its final-logit transform included), in float64 torch."""
    logits = model64(input_ids=ids).logits / temperature
    if not shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    mask = labels != -100
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    y = labels.clamp(min=0)[..., None]
    fields = dict(log_probs=logp.gather(-1, y)[..., 0], entropy=-(p * logp).sum(-1),
                  log_sum_sq_probs=torch.log((p * p).sum(-1)), mean_logits=logits.mean(-1),
                  is_top1=logits.argmax(-1) == labels)
    fields = {k: torch.where(mask, v, torch.zeros_like(v)) for k, v in fields.items()}
    fields.update(loss=-fields["log_probs"].sum() / mask.sum(), label_mask=mask)
    return fields


def _assert_same_grads(model, ref, tol=1e-5):
    """Every parameter's gradient, to ``tol`` of its largest element (fp32 sums of a few hundred terms)."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad.double(), rtol=0, atol=tol * q.grad.abs().max().item(),
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("model_type, overrides, shift", [
    ("llama", {}, False), ("llama", {}, True), ("gemma2", dict(final_logit_softcapping=3.0), True),
    ("cohere", dict(logit_scale=0.5), False), ("granite", dict(logits_scaling=2.0), True)])
def test_every_field_equals_trls_and_float64(model_type, overrides, shift):
    """TRL's transform softcap(logits * scale) / temperature, read from the config as TRL reads it."""
    model = _model(model_type, **overrides)
    ids, labels = _inputs(model, shift=shift)
    model64 = copy.deepcopy(model).double()
    want64 = _float64_reference(model64, ids, next(iter(labels.values())), 0.7, shift)
    theirs, ours = _pair(model, temperature=0.7, outputs=FUSED_OUTPUTS)
    want, got = theirs(input_ids=ids, fused_lm_head=True, **labels), ours(input_ids=ids, fused_lm_head=True, **labels)
    if shift:   # (half the labels the model's top-1)
        assert got.is_top1.any() and not got.is_top1.all()
    for name in FIELDS:
        g, w, w64 = getattr(got, name), getattr(want, name), want64[name]
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if g.dtype == torch.bool:
            assert torch.equal(g, w) and torch.equal(g, w64), name
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=2e-6, msg=lambda m, n=name: f"{n} vs TRL: {m}")
            torch.testing.assert_close(g.double(), w64.detach(), rtol=1e-5, atol=2e-6,
                                       msg=lambda m, n=name: f"{n} vs float64: {m}")
    assert got.aux_loss is None and got.log_probs.requires_grad and got.entropy.requires_grad
    assert not any(getattr(got, n).requires_grad for n in ("log_sum_sq_probs", "mean_logits", "is_top1"))
    # gradients through log-probs and entropy (GRPO's entropy bonus differentiates the entropy)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = torch.randn(want.log_probs.shape, generator=g), torch.randn(want.log_probs.shape, generator=g)
    for out in (want, got, want64):
        (out["log_probs"] * w_lp + out["entropy"] * w_ent).sum().backward()
    _assert_same_grads(ours, theirs)
    _assert_same_grads(ours, model64)


@pytest.mark.parametrize("scale", [0.5, -0.5])
def test_softcap_with_a_scale_of_either_sign(scale):
    """A config with both a softcap and a scale (TRL applies c * tanh(s * x / c) / T whatever the
    model's own forward does): the head's softcap is c / |s|, its scale s / T."""
    model = _model("gemma2", final_logit_softcapping=3.0)
    model.config.logit_scale = scale
    ids, labels = _inputs(model)
    theirs, ours = _pair(model, temperature=0.7, outputs=("log_probs", "entropy"))
    want, got = (m(input_ids=ids, fused_lm_head=True, **labels) for m in (theirs, ours))
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-5, atol=2e-6)
    assert final_logit_transform(model, 0.7) == pytest.approx((3.0 / abs(scale), scale / 0.7))


def test_options_bias_num_items_and_fp32_cast():
    """A biased output layer, num_items_in_batch as the divisor, the default outputs, and
    cast_lm_head_to_fp32 on a bf16 model under autocast (the projection in fp32, as TRL's)."""
    model = _model()
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(32, V, bias=True)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1.0)
    ids, labels = _inputs(model)
    theirs, ours = _pair(model)
    want = theirs(input_ids=ids, fused_lm_head=True, num_items_in_batch=torch.tensor(11), **labels)
    got = ours(input_ids=ids, fused_lm_head=True, num_items_in_batch=torch.tensor(11), **labels)
    assert got.entropy is None and got.is_top1 is None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=1e-5, atol=1e-6)
    want.loss.backward()
    got.loss.backward()
    _assert_same_grads(ours, theirs)
    assert ours.lm_head.bias.grad.abs().sum() > 0

    theirs, ours = _pair(_model().to(torch.bfloat16), cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = (m(input_ids=ids, fused_lm_head=True, **labels) for m in (theirs, ours))
    assert got.log_probs.dtype == torch.float32
    torch.testing.assert_close(got.log_probs, want.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-5, atol=1e-5)
    (want.log_probs.sum() + want.entropy.sum()).backward()
    (got.log_probs.sum() + got.entropy.sum()).backward()
    assert all(p.grad.dtype == torch.bfloat16 for p in ours.parameters())
    _assert_same_grads(ours, theirs, tol=2e-2)


def test_mixture_of_experts_load_balancing_loss():
    """A MoE model whose config asks for router logits: aux_loss, and the loss with it, as TRL's."""
    model = _model("mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                   router_aux_loss_coef=0.02)
    ids, labels = _inputs(model)
    theirs, ours = _pair(model, outputs=("log_probs", "entropy"))
    want, got = (m(input_ids=ids, attention_mask=torch.ones_like(ids), fused_lm_head=True, **labels)
                 for m in (theirs, ours))
    assert got.aux_loss is not None
    torch.testing.assert_close(got.aux_loss, want.aux_loss)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    want.loss.backward()
    got.loss.backward()
    _assert_same_grads(ours, theirs)


def test_without_fused_lm_head_the_forward_is_the_models():
    model = _model()
    ids, labels = _inputs(model)
    want = model(input_ids=ids, **labels)
    _, ours = _pair(copy.deepcopy(model), outputs=FUSED_OUTPUTS)
    got = ours(input_ids=ids, **labels)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)
    out = ours.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(out, model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0))


def test_a_micro_batch_without_scored_tokens():
    """Every label ignored (a micro-batch of prompts only): zeros, a loss of 0, zero gradients."""
    theirs, ours = _pair(_model(), outputs=("log_probs", "entropy"))
    ids = torch.randint(4, V, (B, T))
    labels = torch.full_like(ids, -100)
    for m in (theirs, ours):
        out = m(input_ids=ids, labels=labels, fused_lm_head=True)
        assert torch.equal(out.log_probs, torch.zeros(B, T - 1)) and torch.equal(out.entropy, torch.zeros(B, T - 1))
        (out.loss + out.entropy.sum()).backward()
    _assert_same_grads(ours, theirs)
    assert torch.equal(ours.lm_head.weight.grad, torch.zeros_like(ours.lm_head.weight))



def test_no_batch_seq_vocab_tensor():
    """The output layer is never called as a module, and no tensor of the logits' width has more rows
    than the scored tokens (the head's one chunk): forward and backward."""
    _, ours = _pair(_model(), outputs=FUSED_OUTPUTS)
    calls = []
    ours.lm_head.register_forward_hook(lambda *_: calls.append(1))
    ids, labels = _inputs(ours)
    scored = int((labels["labels"][:, 1:] != -100).sum())
    with TorchOps() as seen:
        out = ours(input_ids=ids, fused_lm_head=True, **labels)
        (out.log_probs.sum() + out.entropy.sum()).backward()
    assert not calls
    # (tensors as wide as the vocabulary, but the output layer's weight transposed, [hidden, V])
    rows = [torch.Size(s).numel() // V for _, shapes in seen.ops for s in shapes
            if s and s[-1] == V and s != (32, V)]
    assert rows and max(rows) == scored < B * (T - 1)


def test_bad_arguments_name_them():
    with pytest.raises(ValueError, match="outputs must be"):
        lcg_trl.add_fused_lm_head(_model(), outputs=("log_probs", "logits"))
    with pytest.raises(ValueError, match="outputs must be"):
        lcg_trl.add_fused_lm_head(_model(), outputs="entropy")
    with pytest.raises(ValueError, match="temperature"):
        lcg_trl.add_fused_lm_head(_model(), temperature=0.0)
    _, ours = _pair(_model())
    with pytest.raises(ValueError, match="needs labels="):
        ours(input_ids=torch.randint(4, V, (B, T)), fused_lm_head=True)
    with pytest.raises(TypeError, match="model must be"):
        lcg_trl.add_fused_lm_head(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="Trainer has no model with TRL's fused LM head"):
        lcg_trl.replace_fused_lm_heads(transformers.Trainer(model=_model(), args=transformers.TrainingArguments(
            output_dir="/tmp/lcg-trl-lm-head-test", use_cpu=True, report_to=[])))


class _OwnFusedLoss(transformers.Trainer):
    """A user's trainer, of no TRL class, whose loss reads the fused LM head: the NLL less an entropy bonus."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs, fused_lm_head=True)
        return out.loss - 0.1 * out.entropy.sum() / out.label_mask.sum()


def test_replace_fused_lm_heads_in_a_trainer_of_another_class():
    """A model that TRL's add_fused_lm_head patched, in a user's own trainer: its head is replaced (the
    model decides, not the trainer's class), with the outputs TRL was asked for, and the user's loss on
    our outputs equals it on TRL's: value and every parameter's gradient."""
    from losscodegen.integrations.trl_lm_head import trl_fused_head_of

    def trainer(replace):
        model = _model()
        trl_add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        t = _OwnFusedLoss(model=model, args=transformers.TrainingArguments(
            output_dir="/tmp/lcg-trl-lm-head-test", use_cpu=True, report_to=[]))
        return lcg_trl.replace_fused_lm_heads(t) if replace else t
    theirs, ours = trainer(False), trainer(True)
    assert trl_fused_head_of(theirs.model) is not None and trl_fused_head_of(ours.model) is None
    assert ours.model.forward.__func__.__globals__["__name__"] == "losscodegen.integrations.trl_lm_head"
    ids, labels = _inputs(ours.model)
    want, got = (t.compute_loss(t.model, dict(input_ids=ids, **labels)) for t in (theirs, ours))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want.backward()
    got.backward()
    _assert_same_grads(ours.model, theirs.model)


# ---- TRL's trainers, with TRL's head and with ours ------------------------------------------------
P, C = 3, 6


def _tokenizer():
    return tiny_tokenizer(V)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """The tiny model on disk: with beta != 0 TRL loads its reference model from the policy's path."""
    path = tmp_path_factory.mktemp("tiny-llama")
    _model().save_pretrained(path)
    return str(path)


def _rl_trainer(kind, path, replace, **options):
    common = dict(output_dir="/tmp/lcg-trl-lm-head-test", per_device_train_batch_size=4, num_generations=2,
                  max_completion_length=C, use_cpu=True, report_to=[], gradient_accumulation_steps=2, bf16=False,
                  model_init_kwargs={"dtype": torch.float32})
    config, cls = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    trainer = cls(model=path, reward_funcs=lambda completions, **_: [0.0] * len(completions),
                  args=config(**common, **options), processing_class=_tokenizer(),
                  train_dataset=datasets.Dataset.from_dict({"prompt": ["t5 t6 t7"] * 8}))
    if replace:
        assert lcg_trl.replace_fused_lm_heads(trainer) is trainer
    trainer.current_gradient_accumulation_steps = 2   # (the Trainer's loop sets it)
    trainer.model.train()
    return trainer


def _rl_batch(kind, model, seed=0):
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 6, [1] * 2 + [0] * 4])
    inputs = dict(prompt_ids=torch.randint(4, V, (4, P), generator=g), prompt_mask=torch.ones(4, P, dtype=torch.long),
                  completion_ids=torch.randint(4, V, (4, C), generator=g), completion_mask=completion_mask,
                  advantages=torch.randn(4, generator=g), num_items_in_batch=torch.tensor(37.0))
    with torch.no_grad():   # log-probs near the model's, so ratios fall inside and outside the clip range
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        logits = model(input_ids=ids).logits[:, P - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
    if kind == "rloo":
        inputs["old_logps"] = (logp * completion_mask).sum(1) + 0.3 * torch.randn(4, generator=g)
    else:
        inputs["old_per_token_logps"] = logp + 0.3 * torch.randn(4, C, generator=g)
        inputs["ref_per_token_logps"] = logp + 0.2 * torch.randn(4, C, generator=g)
    return inputs


RL_CASES = {
    "grpo: dapo (TRL's default)": ("grpo", dict(num_iterations=2)),
    "grpo: entropy bonus, temperature, beta": ("grpo", dict(loss_type="grpo", entropy_coef=0.05, temperature=0.7,
                                                            beta=0.04, num_iterations=2)),
    "grpo: top_entropy_quantile": ("grpo", dict(top_entropy_quantile=0.5, num_iterations=2)),
    "grpo: sequence-level importance sampling (GSPO)": ("grpo", dict(importance_sampling_level="sequence",
                                                                     loss_type="grpo", num_iterations=2)),
    "grpo: vespo": ("grpo", dict(loss_type="vespo", num_iterations=2)),
    "grpo: off_policy_mask_threshold": ("grpo", dict(off_policy_mask_threshold=0.5, num_iterations=2)),
    "grpo: cast_lm_head_to_fp32": ("grpo", dict(cast_lm_head_to_fp32=True, num_iterations=2)),
    "rloo": ("rloo", dict(num_iterations=2)),
    "rloo: temperature": ("rloo", dict(temperature=0.7, num_iterations=2)),
}


@pytest.mark.parametrize("case", list(RL_CASES))
def test_trl_trainers_loss_on_our_head(case, saved_model):
    """TRL's own _compute_loss, on TRL's fused head and on ours: value, gradients, metrics."""
    kind, options = RL_CASES[case]
    theirs = _rl_trainer(kind, saved_model, replace=False, **options)
    ours = _rl_trainer(kind, saved_model, replace=True, **options)
    inputs = _rl_batch(kind, transformers.AutoModelForCausalLM.from_pretrained(saved_model))
    want = theirs._compute_loss(theirs.model, inputs)
    got = ours._compute_loss(ours.model, inputs)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _assert_same_grads(ours.model, theirs.model)
    assert theirs._metrics["train"].keys() == ours._metrics["train"].keys()
    for name, values in theirs._metrics["train"].items():
        torch.testing.assert_close(torch.tensor(ours._metrics["train"][name]), torch.tensor(values), rtol=1e-5,
                                   atol=1e-6, msg=lambda m, n=name: f"metric {n}: {m}")
    if getattr(theirs, "ref_model", None) is not None:   # the reference model's head (TRL's default outputs)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        with torch.no_grad():
            want, got = (t._get_per_token_logps_and_entropies(t.ref_model, ids, mask, C)[0] for t in (theirs, ours))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sft_trainer_loss_and_metrics_on_our_head(saved_model):
    """SFT's loss from log_probs, its entropy and mean_token_accuracy from entropy and is_top1."""
    def trainer(replace):
        args = trl.SFTConfig(output_dir="/tmp/lcg-trl-lm-head-test", use_cpu=True, report_to=[], bf16=False,
                             model_init_kwargs={"dtype": torch.float32})
        t = trl.SFTTrainer(model=saved_model, args=args, processing_class=_tokenizer(),
                           train_dataset=datasets.Dataset.from_dict({"text": ["t5 t6 t7 t8"] * 4}))
        if replace:
            lcg_trl.replace_fused_lm_heads(t)
        t.model.train()
        return t
    theirs, ours = trainer(False), trainer(True)
    ids, labels = _inputs(ours.model, shift=True)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), **labels)
    want = theirs.compute_loss(theirs.model, dict(inputs), num_items_in_batch=torch.tensor(19))
    got = ours.compute_loss(ours.model, dict(inputs), num_items_in_batch=torch.tensor(19))
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _assert_same_grads(ours.model, theirs.model)
    for name in ("entropy", "mean_token_accuracy"):
        torch.testing.assert_close(torch.tensor(ours._metrics["train"][name]),
                                   torch.tensor(theirs._metrics["train"][name]), rtol=1e-5, atol=1e-6)
    assert 0 < ours._metrics["train"]["mean_token_accuracy"][0] < 1
