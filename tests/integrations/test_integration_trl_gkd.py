"""losscodegen.integrations.trl_gkd.GKDTrainer: TRL's GKD trainer whose compute_loss is one fused head
call on both models' hidden states, against trl.experimental.gkd.GKDTrainer's own compute_loss (its
value and every student parameter's gradient), at TRL's beta 0 (forward KL), 0.3 and 1 (reverse KL), on
a softcapped student and on scaled logits (the teacher's scale another)."""
import copy

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

from trl.experimental.gkd import GKDConfig, GKDTrainer  # noqa: E402

from losscodegen.integrations import trl_gkd  # noqa: E402
from helpers import tiny_causal_lm, tiny_tokenizer  # noqa: E402

V = 96


def _trainer(cls, student, teacher, beta):
    args = GKDConfig(output_dir="/tmp/lcg-trl-gkd-test", use_cpu=True, report_to=[], bf16=False, beta=beta)
    t = cls(model=student, teacher_model=teacher, args=args, processing_class=tiny_tokenizer(V),
            train_dataset=datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "t5"}]] * 4}))
    t.model.train()
    return t


CASES = {"beta 0 (forward KL)": (0.0, "llama", {}, {}), "beta 0.3": (0.3, "llama", {}, {}),
         "beta 1 (reverse KL)": (1.0, "llama", {}, {}),
         "a Gemma 2 student's softcap": (0.3, "gemma2", dict(final_logit_softcapping=5.0), None),
         "Cohere's scale, the teacher's another": (0.3, "cohere", dict(logit_scale=0.5), dict(logit_scale=0.25))}


@pytest.mark.parametrize("case", list(CASES))
def test_compute_loss_equals_trls(case):
    beta, model_type, options, teacher_options = CASES[case]
    student = tiny_causal_lm(V, model_type, **options)
    # (None: a Llama teacher, its logits untransformed)
    teacher = tiny_causal_lm(V) if teacher_options is None else copy.deepcopy(student)
    for k, v in (teacher_options or {}).items():
        setattr(teacher.config, k, v)
        if hasattr(teacher, k):   # (Cohere's forward reads its own copy)
            setattr(teacher, k, v)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    theirs = _trainer(GKDTrainer, copy.deepcopy(student), copy.deepcopy(teacher), beta)
    ours = _trainer(trl_gkd.GKDTrainer, student, teacher, beta)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, V, (3, 10), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    labels[1, 8:] = -100
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    for num_items in (None, torch.tensor(11)):
        for t in (theirs, ours):
            t.model.zero_grad()
        want = theirs.compute_loss(theirs.model, dict(inputs), num_items_in_batch=num_items)
        got = ours.compute_loss(ours.model, dict(inputs), num_items_in_batch=num_items)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for (name, p), q in zip(ours.model.named_parameters(), theirs.model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * q.grad.abs().max().item(),
                                       msg=lambda m, n=name: f"{n}: {m}")
        # the teacher frozen, as TRL's: its parameters require grad, and get none
        assert all(p.grad is None for p in ours.teacher_model.parameters())


def test_a_softcapped_teacher_is_refused():
    teacher = tiny_causal_lm(V, "gemma2", final_logit_softcapping=5.0)
    with pytest.raises(ValueError, match="teacher's final logits are softcapped"):
        _trainer(trl_gkd.GKDTrainer, tiny_causal_lm(V), teacher, 0.5)
