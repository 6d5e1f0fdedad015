"""losscodegen.integrations.trl.GRPOTrainer against trl.GRPOTrainer's own _compute_loss: both trainers
on the same tiny model (a Llama config, random weights, a word-level tokenizer built here, no hub),
the same micro-batch (prompts, completions with padding, advantages of both signs, old / ref /
sampling log-probs), fp32 on the CPU: the loss, every parameter's gradient and TRL's logged metrics,
for each loss_type and option it fuses; the others are refused at construction, by name."""
import copy

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

from losscodegen.integrations import trl as lcg_trl  # noqa: E402
from helpers import tiny_causal_lm, tiny_tokenizer  # noqa: E402

V, B, P, C = 64, 4, 3, 6


def _tokenizer():
    return tiny_tokenizer(V)


def _model(model_type="llama", **overrides):
    return tiny_causal_lm(V, model_type, **overrides)


def _trainer(cls, model, **options):
    # num_iterations=2: TRL then passes old_per_token_logps (num_iterations=1 passes None: its own case)
    options = dict(dict(num_iterations=2, use_cpu=True), **options)
    args = trl.GRPOConfig(output_dir="/tmp/lcg-trl-test", per_device_train_batch_size=B, num_generations=2,
                          max_completion_length=C, report_to=[], gradient_accumulation_steps=2,
                          bf16=False, **options)
    trainer = cls(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                  train_dataset=datasets.Dataset.from_dict({"prompt": ["t5 t6 t7"] * 8}),
                  processing_class=_tokenizer())
    trainer.current_gradient_accumulation_steps = 2   # (the Trainer's loop sets it)
    trainer.model.train()
    return trainer


def _batch(model, old=True, ref=False, vllm=False, seed=0, empty=False, advantages=None, shift=0.0, sampling=False,
           per_sequence_ratio=False):
    """``empty``: the last completion has no token (as mask_truncated_completions leaves one);
    ``advantages``: given (else random, of both signs); ``shift``: added to the old log-probs;
    ``sampling``: vLLM's sampling log-probs, one of them NaN (a token vLLM could not score);
    ``per_sequence_ratio``: vLLM's importance-sampling ratios [B, 1] (its sequence_* modes)."""
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 6, [0] * 6 if empty else [1] * 2 + [0] * 4])
    inputs = dict(prompt_ids=torch.randint(4, V, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.long),
                  completion_ids=torch.randint(4, V, (B, C), generator=g), completion_mask=completion_mask,
                  advantages=torch.randn(B, generator=g) if advantages is None else torch.tensor(advantages),
                  num_items_in_batch=torch.tensor(37.0))
    with torch.no_grad():   # log-probs near the model's, so ratios fall inside and outside the clip range
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        logits = model(input_ids=ids).logits[:, P - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
    if old:
        inputs["old_per_token_logps"] = logp + 0.3 * torch.randn(B, C, generator=g) + shift
    if ref:
        inputs["ref_per_token_logps"] = logp + 0.2 * torch.randn(B, C, generator=g)
    if sampling:
        inputs["sampling_per_token_logps"] = logp + 0.3 * torch.randn(B, C, generator=g) + torch.tensor(
            [0.0, 0.3, 0.0, 0.2])[:, None]
        inputs["sampling_per_token_logps"][1, 2] = float("nan")
    if vllm:
        inputs["importance_sampling_ratio"] = torch.rand(B, 1 if per_sequence_ratio else C, generator=g) + 0.5
    return inputs


GSPO_BATCH = dict(advantages=[1.0, -0.5, 0.3, -1.2], shift=-0.1)

CASES = {
    "dapo (TRL's default loss)": dict(loss_type="dapo"),
    "old_per_token_logps=None (TRL's default)": dict(loss_type="dapo", num_iterations=1),
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "luspo token-level": dict(loss_type="luspo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.2),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
    "cispo, old_per_token_logps=None, beta": dict(loss_type="cispo", epsilon_high=1.2, num_iterations=1, beta=0.03),
    "beta": dict(loss_type="bnpo", beta=0.04),
    "beta, bias-corrected KL": dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=True),
    "epsilon_high, delta": dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, delta=1.5),
    "temperature": dict(loss_type="grpo", temperature=0.7),
    "vLLM importance sampling": dict(loss_type="dapo", beta=0.02),
    "entropy bonus": dict(loss_type="grpo", entropy_coef=0.01),
    "entropy bonus, cispo": dict(loss_type="cispo", epsilon_high=1.2, entropy_coef=0.01),
    "cast_lm_head_to_fp32": dict(loss_type="bnpo", cast_lm_head_to_fp32=True),
    "adaptive entropy": dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.02, entropy_target=10.0),
    "an empty completion": dict(loss_type="grpo", _batch=dict(empty=True)),
    "every completion clipped low": dict(loss_type="bnpo", _batch=dict(advantages=[-1.0, -0.5, -2.0, -0.1], shift=0.6)),
    # GSPO: importance_sampling_level="sequence", with each loss_type it combines with (advantages, old
    # log-probs and clip ranges such that one sequence clips low, one high, two not)
    **{f"GSPO {t}": dict(loss_type=t, importance_sampling_level="sequence", epsilon=0.03, epsilon_high=0.04,
                         _batch=GSPO_BATCH) for t in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo")},
    "GSPO cispo": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.05, _batch=GSPO_BATCH),
    "GSPO, old_per_token_logps=None": dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=1),
    "GSPO, beta": dict(loss_type="dapo", importance_sampling_level="sequence", beta=0.04, epsilon=0.03,
                       epsilon_high=0.04, _batch=GSPO_BATCH),
    "GSPO, beta, bias-corrected KL": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
                                          use_bias_correction_kl=True, _batch=GSPO_BATCH),
    "GSPO, epsilon_high, delta": dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.03,
                                      epsilon_high=0.04, delta=1.05,   # (binds: A < 0 where coef_1 > delta)
                                      _batch=dict(GSPO_BATCH, advantages=[-1.0, -0.5, 0.3, 1.2])),
    "vLLM importance sampling, one ratio per sequence": dict(loss_type="grpo", _batch=dict(per_sequence_ratio=True)),
    "GSPO, vLLM importance sampling, one ratio per sequence": dict(
        loss_type="bnpo", importance_sampling_level="sequence", epsilon=0.03, epsilon_high=0.04,
        _batch=dict(GSPO_BATCH, per_sequence_ratio=True)),
    "GSPO, vLLM importance sampling": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.02,
                                           epsilon=0.03, epsilon_high=0.04, _batch=GSPO_BATCH),
    "GSPO, entropy bonus, temperature": dict(loss_type="grpo", importance_sampling_level="sequence", entropy_coef=0.01,
                                            temperature=0.7, _batch=GSPO_BATCH),
    "GSPO cispo, entropy bonus, beta": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.05,
                                            entropy_coef=0.01, beta=0.03, _batch=GSPO_BATCH),
    "GSPO, an empty completion": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.03,
                                      epsilon_high=0.04, beta=0.02, use_bias_correction_kl=True,
                                      _batch=dict(GSPO_BATCH, empty=True)),
    "GSPO, every completion clipped low": dict(loss_type="grpo", importance_sampling_level="sequence",
                                               _batch=dict(advantages=[-1.0, -0.5, -2.0, -0.1], shift=0.6)),
    # VESPO: TRL's gamma weights of the sequences' ratios
    "vespo": dict(loss_type="vespo"),
    "vespo, other k and lambda": dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.0, vespo_k_neg=2.5,
                                      vespo_lambda_neg=1.0),
    "vespo, old_per_token_logps=None": dict(loss_type="vespo", num_iterations=1),
    "vespo, vLLM importance sampling": dict(loss_type="vespo", beta=0.02),
    "vespo, beta, bias-corrected KL": dict(loss_type="vespo", beta=0.04, use_bias_correction_kl=True),
    "vespo, sequence level, beta, bias-corrected KL": dict(loss_type="vespo", importance_sampling_level="sequence",
                                                           beta=0.04, use_bias_correction_kl=True),
    "vespo, entropy bonus": dict(loss_type="vespo", entropy_coef=0.01),
    "vespo, an empty completion, vLLM": dict(loss_type="vespo", _batch=dict(empty=True)),
    # the off-policy sequence mask: thresholds that drop some negative-advantage sequences and keep others
    "off-policy mask, GSPO": dict(loss_type="grpo", importance_sampling_level="sequence", off_policy_mask_threshold=0.14,
                                  epsilon=0.03, epsilon_high=0.04, _batch=GSPO_BATCH),
    "off-policy mask, vLLM sampling log-probs, GSPO dapo, beta": dict(
        loss_type="dapo", importance_sampling_level="sequence", off_policy_mask_threshold=0.1, beta=0.02,
        _batch=dict(GSPO_BATCH, sampling=True)),
    "off-policy mask, cispo": dict(loss_type="cispo", epsilon_high=1.2, off_policy_mask_threshold=0.14,
                                   entropy_coef=0.01, _batch=GSPO_BATCH),
    "off-policy mask, vLLM sampling log-probs, sapo": dict(loss_type="sapo", off_policy_mask_threshold=0.1,
                                                           _batch=dict(GSPO_BATCH, sampling=True)),
    "off-policy mask, vespo": dict(loss_type="vespo", off_policy_mask_threshold=0.14, _batch=GSPO_BATCH),
    # TRL's high-entropy token mask (S.row_quantile of the entropies): the policy loss of the top q tokens
    "top_entropy_quantile": dict(loss_type="dapo", top_entropy_quantile=0.5),
    "top_entropy_quantile, grpo, beta": dict(loss_type="grpo", top_entropy_quantile=0.2, beta=0.04),
    "top_entropy_quantile, cispo, temperature": dict(loss_type="cispo", epsilon_high=1.2, top_entropy_quantile=0.4,
                                                     temperature=0.7),
    "off-policy mask, old_per_token_logps=None, GSPO": dict(loss_type="grpo", importance_sampling_level="sequence",
                                                            off_policy_mask_threshold=0.05, num_iterations=1),
}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """The tiny model on disk: with beta != 0 TRL loads its reference model from the policy's path."""
    path = tmp_path_factory.mktemp("tiny-llama")
    _model().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("case", list(CASES))
def test_compute_loss_equals_trls(case, saved_model):
    _check(case, saved_model)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dapo (TRL's default loss)", "entropy bonus", "GSPO grpo",
                                  "GSPO, beta, bias-corrected KL", "vespo, an empty completion, vLLM",
                                  "off-policy mask, vLLM sampling log-probs, sapo"])
def test_compute_loss_equals_trls_on_the_gpu(case, saved_model):
    """Both trainers on CUDA (fp32): our compiled kernels against TRL's own, as on the CPU."""
    _check(case, saved_model, use_cpu=False, grad_atol=1e-5)


def _check(case, saved_model, use_cpu=True, grad_atol=1e-6):
    options = dict(CASES[case], model_init_kwargs={"dtype": torch.float32}, use_cpu=use_cpu)
    batch = options.pop("_batch", {})
    model = transformers.AutoModelForCausalLM.from_pretrained(saved_model)
    no_old = options.get("num_iterations") == 1     # TRL passes old_per_token_logps=None
    ref_trainer = _trainer(trl.GRPOTrainer, saved_model, **options)
    trainer = _trainer(lcg_trl.GRPOTrainer, saved_model, **options)
    vllm = "vLLM" in case
    for t in (ref_trainer, trainer):
        if vllm:   # what _compute_loss reads of vLLM; the ratios come in the inputs
            t.use_vllm = t.vllm_importance_sampling_correction = True
        if t.use_adaptive_entropy:
            t._last_world_entropy = 5.0   # (below the target: the bonus applies)
    inputs = _batch(model, old=not no_old, ref="beta" in options, vllm=vllm, **batch)
    inputs = {k: v.to(trainer.accelerator.device) for k, v in inputs.items()}
    _assert_same_step(trainer, ref_trainer, inputs, grad_atol)
    ours, theirs = trainer._metrics["train"], ref_trainer._metrics["train"]
    assert set(ours) == set(theirs)
    for name in theirs:
        torch.testing.assert_close(torch.tensor(ours[name]), torch.tensor(theirs[name]), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"metric {n}: {m}")
    if trainer.use_adaptive_entropy:
        assert trainer.entropy_coef == ref_trainer.entropy_coef



def _assert_same_step(trainer, ref_trainer, inputs, grad_atol=1e-6):
    """Both trainers' _compute_loss on the same batch: equal losses and every parameter's gradient."""
    want = ref_trainer._compute_loss(ref_trainer.model, inputs)
    got = trainer._compute_loss(trainer.model, inputs)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(trainer.model.named_parameters(), ref_trainer.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=grad_atol, msg=lambda m, n=name: f"{n}: {m}")

@pytest.mark.parametrize("option, values", [
    ("loss_type", dict(loss_type="ppo")),      # (not one of TRL's: its _compute_loss would raise later)
    ("importance_sampling_level", dict(loss_type="grpo", importance_sampling_level="sequence_token")),
    ("top_entropy_quantile=0.5 with a sequence-level loss",
     dict(top_entropy_quantile=0.5, importance_sampling_level="sequence")),
    ("top_entropy_quantile=0.5 with the entropy bonus", dict(top_entropy_quantile=0.5, entropy_coef=0.01)),
    ("off_policy_mask_threshold", dict(off_policy_mask_threshold=0.5)),   # (dapo at the token level)
])
def test_unfused_options_are_refused_at_construction(option, values):
    with pytest.raises(ValueError, match=option):
        _trainer(lcg_trl.GRPOTrainer, _model(), **values)


@pytest.mark.parametrize("model_type, overrides", [("gemma2", dict(final_logit_softcapping=3.0)),
                                                   ("cohere", dict(logit_scale=0.5))])
def test_the_models_final_logit_transform_and_temperature(model_type, overrides, tmp_path):
    """TRL's transform, softcap(logits * scale) / temperature, read from the config as TRL reads it."""
    _model(model_type, **overrides).save_pretrained(tmp_path)
    options = dict(loss_type="grpo", temperature=0.7, model_init_kwargs={"dtype": torch.float32})
    ref_trainer = _trainer(trl.GRPOTrainer, str(tmp_path), **options)
    trainer = _trainer(lcg_trl.GRPOTrainer, str(tmp_path), **options)
    inputs = _batch(transformers.AutoModelForCausalLM.from_pretrained(tmp_path))
    _assert_same_step(trainer, ref_trainer, inputs)
    torch.testing.assert_close(torch.tensor(trainer._metrics["train"]["entropy"]),
                               torch.tensor(ref_trainer._metrics["train"]["entropy"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type,factory", [("dapo", "GRPO"), ("cispo", "CISPO"), ("sapo", "SAPO")])
def test_the_trainers_policy_terms_are_terms_pys_declarations(loss_type, factory):
    """The trainer's token-level policy term is terms.py's formula (GRPO without its KL, CISPO, SAPO) times
    TRL's per-token weight, and its KL penalty RefKL's: no formula of TRL's losses declared twice."""
    import sympy as sp
    from losscodegen import symbols as S
    from losscodegen import terms as T
    params = dict(dapo=dict(eps_low=0.2, eps_high=0.28, delta=float("inf")), cispo=dict(eps_high=4.0),
                  sapo=dict(temperature_pos=1.0, temperature_neg=1.05))[loss_type]
    from losscodegen.integrations.trl_losses import grpo_head
    head = grpo_head(loss_type=loss_type, sequence=False, old_given=True, off_policy=False, sampling_given=False,
                     beta=True, bias_corrected=False, entropy=False, params=params, softcap=None, logit_scale=1.0)
    (policy,) = head.loss_terms
    want = (S.token("w_pol") * getattr(T, factory).formula.xreplace({S.param("kl_beta"): 0})
            + S.token("w_kl") * T.RefKL.formula.xreplace({S.param("kl_bias_correction"): 0}))
    assert sp.expand(policy.formula - want) == 0
    assert dict(policy.params) == params
