"""CONTRACT.md "Integrations" and "Integrations, grown", checked as a user would: import hygiene,
SUPPORTED_MODEL_TYPES / register_model_type / AutoLosscodegenForCausalLM / LosscodegenCallback on
tiny transformers models built from configs (no hub), and TRL's generalized_jsd_loss convention.
Expected values are float64 torch formulas written in this file (TRL's GKD loss as TRL defines it)."""
import os
import subprocess
import sys

import pytest
import torch

import reference as R

FP32 = 5e-5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def fresh_process():
    """One fresh interpreter for both checks below (a fresh one imports torch again: seconds): the
    heavy modules loaded after ``import losscodegen``, then after a head's call and backward (in
    Triton's interpreter, chosen before triton is imported)."""
    code = ("import sys, losscodegen, losscodegen.integrations\n"
            "print([m for m in ('torch._dynamo', 'transformers', 'trl') if m in sys.modules])\n"
            "import torch, losscodegen as lcg\n"
            "x = torch.randn(4, 16, requires_grad=True)\n"
            "lcg.HeadLoss(lcg.CrossEntropy())(x, torch.tensor([0, 1, 2, 3])).loss.backward()\n"
            "print([m for m in ('transformers', 'trl') if m in sys.modules])\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_importing_losscodegen_imports_neither_dynamo_transformers_nor_trl(fresh_process):
    assert fresh_process[-2] == "[]", fresh_process


def test_a_head_call_does_not_import_dynamo_or_transformers(fresh_process):
    assert fresh_process[-1] == "[]", fresh_process


# ------------------------------------------------------------------------------- transformers

def _tiny(model_type="llama", vocab=64, **over):
    import transformers
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0, eos_token_id=2, bos_token_id=3, **over)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float(), config


def _batch(vocab=64, B=2, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :3] = R.IGNORE
    labels[-1, -2:] = R.IGNORE
    return ids, labels


def _shifted_ce_reference(model, ids, labels, *, softcap=None, num_items=None):
    """float64 CE of the model's own (unpatched) logits against labels shifted by one, with the
    lm_head weight's gradient by autograd."""
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state
    w = model.lm_head.weight.detach().double().requires_grad_(True)
    z = h.double() @ w.T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z, y = z[:, :-1].reshape(-1, z.shape[-1]), labels[:, 1:].reshape(-1)
    v = R.valid_rows(y)
    loss = torch.where(v, R.ce_rows(z, y), torch.zeros((), dtype=torch.float64)).sum() / (num_items or int(v.sum()))
    loss.backward()
    return loss, w.grad


def test_supported_model_types_cover_ligers_families():
    from losscodegen.integrations.transformers import SUPPORTED_MODEL_TYPES
    need = {"llama", "mistral", "mixtral", "gemma", "gemma2", "qwen2", "qwen3", "phi3", "granite", "olmo2", "qwen2_vl"}
    assert need <= set(SUPPORTED_MODEL_TYPES), need - set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("num_items", [None, 23])
def test_apply_losscodegen_on_llama_matches_shifted_cross_entropy(num_items):
    from losscodegen.integrations.transformers import apply_losscodegen
    model, _ = _tiny()
    ids, labels = _batch()
    want, gw = _shifted_ce_reference(model, ids, labels, num_items=num_items)
    cls_forward = type(model).forward
    apply_losscodegen(model)
    assert type(model).forward is cls_forward, "the patch applies to the instance, not the class"
    kw = {} if num_items is None else {"num_items_in_batch": num_items}
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    R.close(out.loss, want, FP32, "loss")
    R.close(model.lm_head.weight.grad, gw, 1e-4, "lm_head grad")
    # forwards without labels are unchanged: the logits come back
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (2, 9, 64)


def test_apply_losscodegen_reads_gemma2_final_softcap():
    from losscodegen.integrations.transformers import apply_losscodegen
    model, config = _tiny("gemma2", final_logit_softcapping=3.0, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    ids, labels = _batch()
    want, gw = _shifted_ce_reference(model, ids, labels, softcap=3.0)
    apply_losscodegen(model)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    R.close(out.loss, want, FP32, "loss")
    R.close(model.lm_head.weight.grad, gw, 1e-4, "lm_head grad")


def test_in_place_ops_on_the_loss_work():
    from losscodegen.integrations.transformers import apply_losscodegen
    model, _ = _tiny()
    ids, labels = _batch()
    want, _ = _shifted_ce_reference(model, ids, labels)
    apply_losscodegen(model)
    out = model(input_ids=ids, labels=labels)
    loss = out.loss
    loss.mul_(2.0)          # plain tensor, not a view
    R.close(loss, 2 * want, FP32, "loss after mul_")


def _forward_calling_its_parent(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
    """A forward apply_losscodegen cannot read as transformers' standard causal-LM loss path (it calls
    its parent class's), whose loss is that path's."""
    return type(self).__mro__[1].forward(self, input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                         logits_to_keep=logits_to_keep, **kwargs)


def test_register_model_type_declares_an_unknown_type():
    from losscodegen.integrations import transformers as lt
    from losscodegen.integrations.transformers import apply_losscodegen, register_model_type
    model, _ = _tiny()
    model.config.model_type = "contract_llama_finetune"
    model.__class__ = type("ContractLlamaFinetune", (type(model),), {"forward": _forward_calling_its_parent})
    with pytest.raises((ValueError, TypeError), match="contract_llama_finetune"):
        apply_losscodegen(model)
    register_model_type("contract_llama_finetune")
    ids, labels = _batch()
    want, gw = _shifted_ce_reference(model, ids, labels)
    apply_losscodegen(model)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    R.close(out.loss, want, FP32, "loss")
    R.close(model.lm_head.weight.grad, gw, 1e-4, "lm_head grad")


def test_registered_type_is_listed_in_supported_model_types():
    from losscodegen.integrations import transformers as lt
    from losscodegen.integrations import transformers_model_types
    lt.register_model_type("contract_listed_type")
    try:
        assert "contract_listed_type" in lt.SUPPORTED_MODEL_TYPES
    finally:
        transformers_model_types._MODEL_TYPES.pop("contract_listed_type")


def test_auto_model_from_config_comes_back_patched_with_the_given_head():
    import losscodegen as lcg
    from losscodegen.integrations.transformers import AutoLosscodegenForCausalLM
    _, config = _tiny()
    torch.manual_seed(0)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-2))
    model = AutoLosscodegenForCausalLM.from_config(config, head=head).float()
    ids, labels = _batch()
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state.double()
    z = (h @ model.lm_head.weight.double().T)[:, :-1].reshape(-1, 64)
    y = labels[:, 1:].reshape(-1)
    v = R.valid_rows(y)
    want = R.mean_over(R.ce_rows(z, y), v) + 1e-2 * R.mean_over(R.z_loss_rows(z), v)
    out = model(input_ids=ids, labels=labels)
    R.close(out.loss, want, FP32, "loss")
    default = AutoLosscodegenForCausalLM.from_config(config)
    assert default.__class__.__name__.endswith("ForCausalLM")


def test_callback_is_a_trainer_callback_and_logs_per_token_means(tmp_path):
    import transformers
    from losscodegen.integrations.transformers import LosscodegenCallback
    import losscodegen as lcg
    assert issubclass(LosscodegenCallback, transformers.TrainerCallback)
    model, _ = _tiny()
    rows = []
    for s in range(4):
        ids, labels = _batch(B=1, T=7 + s, seed=s)
        rows.append({"input_ids": ids[0], "labels": labels[0]})
    head = lcg.HeadLoss(lcg.CrossEntropy(), metrics=(lcg.Entropy(),))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=4,
                                          max_steps=1, learning_rate=0.0, logging_steps=1, report_to=[], use_cpu=True,
                                          save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[LosscodegenCallback(head)])
    trainer.train()
    # per-token means over the 4 accumulated micro-batches (lr 0: the model is the one that made them)
    ce_sum = ent_sum = 0.0
    n = 0
    for r in rows:
        with torch.no_grad():
            h = model.model(input_ids=r["input_ids"][None]).last_hidden_state.double()
        z = (h @ model.lm_head.weight.double().T)[0, :-1]
        y = r["labels"][1:]
        v = R.valid_rows(y)
        ce_sum += float(torch.where(v, R.ce_rows(z, y), torch.zeros((), dtype=torch.float64)).sum())
        ent_sum += float(torch.where(v, R.entropy_rows(z), torch.zeros((), dtype=torch.float64)).sum())
        n += int(v.sum())
    logged = [h for h in trainer.state.log_history if "cross_entropy" in h]
    assert logged, trainer.state.log_history
    assert abs(logged[0]["cross_entropy"] - ce_sum / n) <= 1e-4 * max(1, ce_sum / n), (logged[0], ce_sum / n)
    assert abs(logged[0]["entropy"] - ent_sum / n) <= 1e-4 * max(1, ent_sum / n), (logged[0], ent_sum / n)


# ----------------------------------------------------------------------------------- TRL GKD

def _trl_gjsd(student, teacher, labels=None, beta=0.5, temperature=1.0, reduction="batchmean", num_items_in_batch=None):
    """TRL's GKDTrainer.generalized_jsd_loss, written out in float64: beta weighs the teacher in the
    mixture; beta 0 = KL(teacher || student), 1 = KL(student || teacher); -100 positions dropped."""
    s = torch.log_softmax(student.double() / temperature, -1)
    t = torch.log_softmax(teacher.double() / temperature, -1)
    if beta == 0:
        jsd = t.exp() * (t - s)
    elif beta == 1:
        jsd = s.exp() * (s - t)
    else:
        m = torch.logsumexp(torch.stack([s + torch.log(torch.tensor(1 - beta, dtype=torch.float64)),
                                         t + torch.log(torch.tensor(beta, dtype=torch.float64))]), 0)
        jsd = beta * t.exp() * (t - m) + (1 - beta) * s.exp() * (s - m)
    if labels is not None:
        jsd = jsd[labels != -100]
    if reduction == "batchmean":
        if num_items_in_batch is not None:
            return jsd.sum() / num_items_in_batch
        return jsd.sum() / (jsd.size(0) if labels is not None else jsd.size(0))
    if reduction == "sum":
        return jsd.sum()
    if reduction == "mean":
        return jsd.sum() / jsd.numel()
    raise ValueError(reduction)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("reduction,labelled,num_items", [("batchmean", True, None), ("batchmean", False, None),
                                                          ("batchmean", True, 17), ("sum", True, None), ("mean", True, None)])
def test_generalized_jsd_loss_follows_trls_convention(beta, reduction, labelled, num_items):
    from losscodegen.integrations.trl import generalized_jsd_loss
    g = torch.Generator().manual_seed(1)
    z = torch.randn(2, 5, 30, generator=g) * 2
    t = torch.randn(2, 5, 30, generator=g) * 2
    labels = torch.randint(0, 30, (2, 5), generator=g)
    labels[0, 0] = labels[1, 3] = -100
    lab = labels if labelled else None
    zz = z.clone().requires_grad_(True)
    got = generalized_jsd_loss(zz, t, lab, beta=beta, temperature=1.7, reduction=reduction, num_items_in_batch=num_items)
    got.backward()
    z64 = z.double().requires_grad_(True)
    want = _trl_gjsd(z64, t, lab, beta=beta, temperature=1.7, reduction=reduction, num_items_in_batch=num_items)
    want.backward()
    R.close(got, want, FP32, "value")
    R.close(zz.grad, z64.grad, FP32, "student grad")


def test_generalized_jsd_loss_equals_trls_own():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        from trl.experimental.gkd import GKDTrainer
    except ImportError:
        from trl import GKDTrainer
    from losscodegen.integrations.trl import generalized_jsd_loss
    g = torch.Generator().manual_seed(2)
    z, t = torch.randn(3, 4, 25, generator=g), torch.randn(3, 4, 25, generator=g)
    labels = torch.randint(0, 25, (3, 4), generator=g)
    labels[2, :2] = -100
    for beta in (0.0, 0.5, 0.9, 1.0):
        want = GKDTrainer.generalized_jsd_loss(z.double(), t.double(), labels, beta=beta, temperature=0.8)
        got = generalized_jsd_loss(z, t, labels, beta=beta, temperature=0.8)
        R.close(got, want, FP32, f"beta={beta}")


@pytest.mark.parametrize("model_type,over", [
    ("mixtral", {"output_router_logits": True, "router_aux_loss_coef": 0.3, "num_local_experts": 4, "num_experts_per_tok": 2}),
    ("qwen3_moe", {"output_router_logits": True, "router_aux_loss_coef": 0.3, "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 16, "decoder_sparse_step": 1}),
    ("granite", {"logits_scaling": 4.0}),
    ("cohere", {"logit_scale": 0.5}),
    ("gemma", {"tie_word_embeddings": False}),
])
def test_patched_model_loss_equals_the_unpatched_models_own(model_type, over):
    """The model's own (transformers) training loss, router loss included, against the patched one."""
    import copy
    from losscodegen.integrations.transformers import apply_losscodegen
    model, _ = _tiny(model_type, **over)
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
    ids, labels = _batch()
    # float64 where transformers allows it (its grouped expert matmul takes fp32 at most)
    ref = copy.deepcopy(model) if "output_router_logits" in over else copy.deepcopy(model).double()
    want = ref(input_ids=ids, labels=labels).loss
    want.backward()
    apply_losscodegen(model)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    R.close(out.loss, want, 1e-4, f"{model_type} loss")
    R.close(model.lm_head.weight.grad, ref.lm_head.weight.grad, 1e-4, f"{model_type} lm_head grad")


def test_callback_evaluation_logs_per_token_means_over_the_eval_set(tmp_path):
    import transformers
    import losscodegen as lcg
    from losscodegen.integrations.transformers import LosscodegenCallback
    model, _ = _tiny()
    rows = []
    for s in range(3):
        ids, labels = _batch(B=1, T=6 + 2 * s, seed=10 + s)
        rows.append({"input_ids": ids[0], "labels": labels[0]})
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=1e-3))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=1, report_to=[], use_cpu=True,
                                          disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, eval_dataset=rows, callbacks=[LosscodegenCallback(head)])
    metrics = trainer.evaluate()
    ce = zl = 0.0
    n = 0
    for r in rows:
        with torch.no_grad():
            h = model.model(input_ids=r["input_ids"][None]).last_hidden_state.double()
        z = (h @ model.lm_head.weight.double().T)[0, :-1]
        y = r["labels"][1:]
        v = R.valid_rows(y)
        zero = torch.zeros((), dtype=torch.float64)
        ce += float(torch.where(v, R.ce_rows(z, y), zero).sum())
        zl += float(torch.where(v, R.z_loss_rows(z), zero).sum())
        n += int(v.sum())
    assert abs(metrics["eval_cross_entropy"] - ce / n) <= 1e-4 * max(1, ce / n), (metrics, ce / n)
    assert abs(metrics["eval_z_loss"] - zl / n) <= 1e-4 * max(1, zl / n), (metrics, zl / n)
