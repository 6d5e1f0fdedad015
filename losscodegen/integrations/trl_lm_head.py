"""TRL's fused LM head on ``head.linear``: ``add_fused_lm_head`` takes the arguments of
``trl.trainer.utils.add_fused_lm_head`` and patches the model so that ``model(..., labels=labels,
fused_lm_head=True)`` returns the same ``FusedCausalLMOutput`` (per-token log-probs, entropy, ...),
computed by one losscodegen head in one pass over the vocabulary, with no ``[batch, seq, vocab]``
logits; ``replace_fused_lm_heads(trainer)`` puts it in place of the heads a TRL trainer has added
(docs/integrations-trl.md). TRL's own loss code then runs on our outputs, unchanged.

The forward does what TRL's does around the kernel (read from TRL 1.16's ``add_fused_lm_head``): the
backbone, the label shift (or ``shift_labels`` as given), only the positions whose label is not -100
scored, zeros elsewhere, the config's final-logit transform and the temperature, ``cast_lm_head_to_fp32``,
``num_items_in_batch`` as the loss's divisor, and a mixture-of-experts model's load-balancing loss.
"""
from __future__ import annotations

import contextvars
import functools
import math
import types
import contextlib
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

import losscodegen as lcg
from losscodegen.integrations.trl_losses import LogSumSqProbs, MeanLogits

try:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from trl.trainer.utils import FusedCausalLMOutput, maybe_gather_lm_head_ctx
    from trl.trainer.utils import add_fused_lm_head as trl_add_fused_lm_head
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl needs trl>=1.16: pip install "losscodegen[hf]"') from e

__all__ = ["add_fused_lm_head", "replace_fused_lm_heads", "final_logit_transform", "computes_trls_fused_loss",
           "FUSED_OUTPUTS"]

# FusedCausalLMOutput's per-token fields that ``outputs=`` may ask for (TRL's names and order)
FUSED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_IGNORE_INDEX = -100

_ROWS = dict(log_probs="logprob", entropy="entropy", log_sum_sq_probs="log_sum_sq_probs",
             mean_logits="mean_logits", is_top1="token_accuracy")   # field -> the head's row name


def final_logit_transform(model: nn.Module, temperature: float = 1.0) -> tuple[float | None, float]:
    """``(softcap, logit_scale)`` of a ``HeadLoss`` whose logits are TRL's ``softcap(logits * scale) /
    temperature``, with the softcap and scale read from the model's config as TRL reads them.

    TRL's ``c * tanh(s * x / c) / T`` is the head's ``scale' * c' * tanh(x / c')`` with ``scale' = s / T``
    and ``c' = c / |s|`` (tanh is odd, so a negative ``s`` keeps ``c'`` positive)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    text_config = model.config.get_text_config()
    cap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)      # Muse Glimmer
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)     # Falcon-H1
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        # Granite and MiniCPM3 divide by logits_scaling, HyperCLOVA X multiplies by it
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    scale = 1.0 if scale is None else float(scale)
    softcap = None if cap is None or scale == 0 else float(cap) / abs(scale)
    return softcap, scale / temperature


def _head(outputs: tuple[str, ...], softcap: float | None, logit_scale: float,
          objective: lcg.HeadLoss | None) -> lcg.HeadLoss:
    metrics = [m() for name, m in (("log_sum_sq_probs", LogSumSqProbs), ("mean_logits", MeanLogits),
                                   ("is_top1", lcg.TokenAccuracy)) if name in outputs]
    if objective is None:
        terms = [lcg.LogProb()] + ([lcg.Entropy()] if "entropy" in outputs else [])
    else:   # the objective's terms and metrics; the entropy logged only (a metric)
        terms = list(objective.loss_terms)
        metrics += [lcg.Entropy()] if "entropy" in outputs else []
        ours = {m.name: m for m in metrics}
        for m in objective.metric_terms:   # (TRL's fields and the head's metrics of one name are one metric)
            if m.name in ours and ours[m.name].formula != m.formula:
                raise ValueError(f"objective: its metric {m.name!r} is not TRL's field of that name")
            metrics += [] if m.name in ours else [m]
    return lcg.HeadLoss(*terms, metrics=tuple(metrics), softcap=softcap, logit_scale=logit_scale,
                        ignore_index=_IGNORE_INDEX)


def add_fused_lm_head(model: nn.Module, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                      outputs: tuple[str, ...] = ("log_probs",), *, objective: lcg.HeadLoss | None = None) -> None:
    """``trl.trainer.utils.add_fused_lm_head``, computed by losscodegen: patch ``model`` (a causal LM
    instance) so that ``model(..., labels=labels, fused_lm_head=True)`` returns TRL's
    ``FusedCausalLMOutput`` from one ``head.linear`` call, without the ``[batch, seq, vocab]`` logits;
    without ``fused_lm_head=True`` the model's forward is unchanged (generation).

    ``outputs``: the per-token fields computed, among ``FUSED_OUTPUTS`` (``log_probs``, and so ``loss``,
    always). ``log_probs`` and ``entropy`` carry gradients; the others are detached, as in TRL.

    ``objective`` (losscodegen's, for a loss that is ``-sum(log_probs) / n`` such as SFT's): a head
    whose loss terms replace the log-likelihood: ``log_probs`` is then each token's objective, negated
    (so that ``loss`` and SFT's loss are the objective), and ``entropy`` is detached. Its softcap and
    scale must be the model's (``final_logit_transform``). Where it is the head of the model's
    ``apply_losscodegen`` patch, each forward adds its terms and metrics to ``model.losscodegen``'s
    ``train`` (or, outside training mode, ``eval``) token means, as the patched forward does.
    """
    if isinstance(outputs, str) or not all(isinstance(o, str) for o in outputs) \
            or not set(outputs) <= set(FUSED_OUTPUTS):
        raise ValueError(f"outputs must be a tuple of names among {FUSED_OUTPUTS}, got {outputs!r}")
    if not isinstance(cast_lm_head_to_fp32, bool):
        raise TypeError(f"cast_lm_head_to_fp32 must be a bool, got {type(cast_lm_head_to_fp32).__name__}")
    if not callable(getattr(model, "get_output_embeddings", None)) or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers causal LM (a PreTrainedModel with an output layer), "
                        f"got {type(model).__name__}")
    softcap, logit_scale = final_logit_transform(model, temperature)
    if objective is not None and ((objective.softcap is None) != (softcap is None) or not math.isclose(
            objective.logit_scale, logit_scale, rel_tol=1e-9) or (softcap is not None and not math.isclose(
            objective.softcap, softcap, rel_tol=1e-9))):
        raise ValueError(f"objective: softcap={objective.softcap}, logit_scale={objective.logit_scale}, but TRL's head "
                         f"on this model has softcap={softcap}, logit_scale={logit_scale}")
    head = _head(tuple(outputs), softcap, logit_scale, objective)
    fields = tuple(f for f in FUSED_OUTPUTS if f in outputs or f == "log_probs")
    original_forward = model.forward
    text_config = model.config.get_text_config()
    state = vars(model).get("losscodegen")
    if objective is None or state is None or state.head is not objective:
        state = None

    # TRL's signature: generate validates its model kwargs against the class's forward
    @functools.wraps(type(model).forward)
    def _fused_forward(self, *args: Any, fused_lm_head: bool = False, labels: torch.Tensor | None = None,
                       shift_labels: torch.Tensor | None = None, num_items_in_batch: Any = None,
                       **kwargs: Any) -> Any:
        if not fused_lm_head:
            passed = dict(labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch)
            return original_forward(*args, **kwargs, **{k: v for k, v in passed.items() if v is not None})
        if labels is None and shift_labels is None:
            raise ValueError("fused_lm_head=True needs labels= (or shift_labels=): the tokens to score")
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):   # as the model's own forward asks for them
            kwargs.setdefault("output_router_logits", True)
        # (the backbone and the output layer are looked up at each call: FSDP and PEFT replace them)
        backbone = self.base_model(*args, **kwargs)
        if shift_labels is None:
            hidden, labels = backbone.last_hidden_state[:, :-1], labels[:, 1:]
        else:
            hidden, labels = backbone.last_hidden_state, shift_labels
        lm_head = self.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        hidden, labels = hidden.to(weight.device), labels.to(weight.device)
        mask = labels != _IGNORE_INDEX
        autocast = nullcontext()
        if cast_lm_head_to_fp32:   # the projection in fp32, outside autocast (an fp16/bf16 weight computes in fp32)
            hidden = hidden.float()
            autocast = torch.autocast(hidden.device.type, enabled=False)
        if isinstance(weight, DTensor):   # FSDP2: the whole head, as TRL gathers it
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        if is_deepspeed_zero3_enabled() and torch.is_grad_enabled() and weight.requires_grad:
            raise ValueError("losscodegen's fused LM head does not train under DeepSpeed ZeRO-3: its backward "
                             "computes the logits again from lm_head.weight, which ZeRO-3 has partitioned by then")
        # Only the scored positions go through the head (TRL's choice on GPUs too: one host sync to
        # count them); each field is scattered back to the labels' shape, zero elsewhere.
        with autocast, maybe_gather_lm_head_ctx(weight, bias):
            out = head.linear(hidden[mask], weight, labels[mask], bias=bias, reduction="none")
        rows = dict(out.rows, logprob=-out.loss) if objective is not None else out.rows
        if state is not None:   # the head's own terms and metrics (means over the scored rows)
            state.terms = {t.name: out.terms[t.name] for t in objective.loss_terms}
            state.metrics = {m.name: out.metrics[m.name] for m in objective.metric_terms}
            (state.train if self.training else state.eval).add(
                lcg.HeadOutput(out.loss, state.terms, state.metrics), mask.sum(), None)
        per_token = {f: rows[_ROWS[f]].new_zeros(mask.shape).masked_scatter(mask, rows[_ROWS[f]]) for f in fields}
        if "is_top1" in per_token:
            per_token["is_top1"] = per_token["is_top1"] == 1
        log_probs = per_token["log_probs"]
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        aux_loss = None
        if kwargs.get("output_router_logits"):
            aux_loss = _load_balancing_loss(self, text_config, backbone, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, **per_token, label_mask=mask, aux_loss=aux_loss)

    model.forward = types.MethodType(_fused_forward, model)


def _load_balancing_loss(model: nn.Module, text_config: Any, backbone: Any, attention_mask: Any) -> torch.Tensor:
    """A mixture-of-experts model's load-balancing loss, as TRL's fused head adds it (Mixtral's, which
    every MoE family of transformers 5 uses)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    num_experts = getattr(text_config, "num_experts", None)
    if num_experts is None:   # (GptOssConfig before transformers 5.6 has none: the model's)
        num_experts = model.num_experts
    return load_balancing_loss_func(backbone.router_logits, num_experts, text_config.num_experts_per_tok,
                                    attention_mask)


def trl_fused_head_of(module: nn.Module) -> dict[str, Any] | None:
    """The arguments TRL's ``add_fused_lm_head`` was given for ``module`` (and the forward it wrapped),
    read from the forward it set; None where it set none."""
    forward = vars(module).get("forward")
    fn = getattr(forward, "__func__", None)
    # (functools.wraps gave it the model class's name and module: its code and globals are TRL's)
    if getattr(getattr(fn, "__code__", None), "co_name", None) != "_fused_forward" \
            or fn.__globals__.get("add_fused_lm_head") is not trl_add_fused_lm_head:
        return None
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    wanted = ("original_forward", "temperature", "cast_lm_head_to_fp32", "outputs")
    if not all(k in cells for k in wanted):
        raise ValueError(f"{type(module).__name__} has TRL's fused LM head, but not as TRL 1.16 builds it "
                         f"(its forward holds {sorted(cells)}): this TRL is not one losscodegen was checked against")
    return {k: cells[k] for k in wanted}


def computes_trls_fused_loss(head: lcg.HeadLoss) -> bool:
    """Whether ``head``'s objective is the one TRL's fused LM head computes (its ``-log_probs``):
    cross-entropy alone, weight 1, no label smoothing, no class weights."""
    if len(head.loss_terms) != 1:
        return False
    (term,) = head.loss_terms
    return term.name == "cross_entropy" and term.class_weight is None and term.normalize == "tokens" \
        and float(term.weight) == 1.0 and float(dict(term.params).get("label_smoothing", 0.0)) == 0.0


# set while losscodegen's own trainers are built: they fuse the patched model's objective themselves
_FUSING_OBJECTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("losscodegen_fusing", default=False)


@contextlib.contextmanager
def fusing_objective() -> Any:
    """While a losscodegen trainer that fuses the patched model's objective is built: no refusal."""
    token = _FUSING_OBJECTIVE.set(True)
    try:
        yield
    finally:
        _FUSING_OBJECTIVE.reset(token)


def drops_objective(model: nn.Module) -> bool:
    """Whether ``model``, patched by ``apply_losscodegen``, has TRL's fused LM head in place of its forward
    while its head is not TRL's cross-entropy (and no losscodegen trainer is fusing it)."""
    state = vars(model).get("losscodegen")
    return state is not None and not _FUSING_OBJECTIVE.get() and not computes_trls_fused_loss(state.head) \
        and trl_fused_head_of(model) is not None


# TRL's trainers that give their model TRL's fused LM head (SFTTrainer's constructor does) but whose own
# compute_loss computes the loss from the full logits, never calling the model with fused_lm_head=True
# (read in TRL 1.16). Any other trainer is decided by its models: a model with TRL's fused head returns
# ours once replaced, whatever the trainer's class (GMPO's and AsyncGRPO's losses read it too, and so may
# a user's own compute_loss).
_LOSS_FROM_FULL_LOGITS = ("GKDTrainer.compute_loss", "GOLDTrainer.compute_loss")


def _reads_full_logits(trainer: Any) -> str | None:
    """The TRL method computing ``trainer``'s loss from the full logits (``_LOSS_FROM_FULL_LOGITS``), or None."""
    method = getattr(type(trainer), "compute_loss", None)
    name = getattr(method, "__qualname__", None)
    return name if name in _LOSS_FROM_FULL_LOGITS and method.__module__.startswith("trl.") else None


def _loss_from_full_logits(trainer: Any) -> list[str]:
    """The options under which a TRL trainer that reads the fused outputs computes its loss from the full
    logits instead, the fused outputs feeding its metrics only (SFT's, in TRL 1.16)."""
    import trl
    if not isinstance(trainer, trl.SFTTrainer):
        return []
    out = ["compute_loss_func"] if trainer.compute_loss_func is not None else []
    if trainer.label_smoother is not None and trainer.args.loss_type == "nll":
        out.append(f"label_smoothing_factor={trainer.args.label_smoothing_factor}")
    return out


def replace_fused_lm_heads(trainer: Any) -> Any:
    """Put losscodegen's fused LM head in place of TRL's on every model of ``trainer`` that has one
    (``trl.trainer.utils.add_fused_lm_head``'s: its model, the PEFT base model under it, its reference
    model), with the temperature, fp32 cast and outputs TRL chose for it; return the trainer. Call it
    after building the trainer, before training. The models decide, not the trainer's class: TRL 1.16's
    GRPO, RLOO, DPO, KTO and SFT trainers add the head, and a trainer of any other class whose model has
    it (a subclass, a user's own trainer) gets ours, since ``model(..., fused_lm_head=True)`` then
    returns our outputs. Refused: a trainer without such a model; one whose loss TRL's own code computes
    from the full logits (GKD's and GOLD's ``compute_loss``, SFT with ``compute_loss_func`` or
    ``label_smoothing_factor``); a model patched by ``apply_losscodegen`` with a head other than
    cross-entropy alone."""
    method = _reads_full_logits(trainer)
    if method is not None:
        raise ValueError(f"{type(trainer).__name__}'s loss does not come from TRL's fused LM head ({method} computes "
                         "it from the full logits): replacing the head would change nothing it trains on")
    options = _loss_from_full_logits(trainer)
    if options:
        raise ValueError(f"{type(trainer).__name__}'s loss does not come from TRL's fused LM head with "
                         f"{' and '.join(options)} (a loss from the full logits; the fused outputs feed its metrics "
                         "only): replacing the head would change nothing it trains on")
    seen: set[int] = set()
    replaced = 0
    for value in list(vars(trainer).values()):
        if not isinstance(value, nn.Module):
            continue
        for module in value.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            found = trl_fused_head_of(module)
            if found is None:
                continue
            state = vars(module).get("losscodegen")    # (apply_losscodegen's: its head is not TRL's loss)
            if state is not None and not computes_trls_fused_loss(state.head):
                raise ValueError(f"{type(module).__name__} was patched by apply_losscodegen with a head that is not "
                                 f"cross-entropy alone, and {type(trainer).__name__}'s loss reads TRL's fused LM head "
                                 "(log-probabilities): it would train on a different objective")
            module.forward = found.pop("original_forward")     # TRL's patch undone, then ours
            add_fused_lm_head(module, **found)
            replaced += 1
    if not replaced:
        raise ValueError(f"{type(trainer).__name__} has no model with TRL's fused LM head (the one "
                         "trl.trainer.utils.add_fused_lm_head sets as the model's forward: trl>=1.16's GRPO, RLOO, "
                         "DPO, KTO and SFT trainers add one when they are built)")
    return trainer
