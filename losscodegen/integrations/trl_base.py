"""What losscodegen's TRL trainers share: the fused call on the trainer's model (``add_fused_objective``:
the backbone, then one ``head.linear`` call on the hidden states and the output layer, no ``[batch, seq,
vocab]`` logits), the pair trainers' forward (CPO, ORPO), the cross-process mean their logged metrics are
(``global_mean``), and the refusals by name of what one fused call cannot compute. The losses are
declared in ``trl_losses``; each trainer has a module of its own (``trl_grpo``, ``trl_sft``, ``trl_dpo``,
``trl_kto``, ``trl_cpo``, ``trl_orpo``, ``trl_gkd``)."""
from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from typing import Any

import torch

import losscodegen as lcg
from losscodegen.integrations.trl_lm_head import final_logit_transform

try:
    from transformers.modeling_outputs import ModelOutput
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError('losscodegen.integrations.trl needs trl>=1.16: pip install "losscodegen[hf]"') from e


def refuse_unfused(options: list[str], trainer: str, use: str | None = None) -> None:
    """Refuse the ``options`` (each with why) that losscodegen's ``trainer`` cannot fuse, pointing to
    TRL's trainer (``use``: its path, ``trl.<trainer>`` by default)."""
    if options:
        raise ValueError(f"losscodegen's {trainer} cannot fuse " + "; ".join(options)
                         + f": use {use or 'trl.' + trainer} for these")


def policy_model(model: Any) -> Any:
    """The causal LM a trainer trains (the base model under a PEFT wrapper): the instance patched."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def router_loss_options(args: Any, model: Any) -> list[str]:
    """A mixture-of-experts model's load-balancing loss, which TRL adds to the head's (refused)."""
    text_config = model.config.get_text_config()
    coef = args.router_aux_loss_coef
    coef = getattr(text_config, "router_aux_loss_coef", 0.0) if coef is None else coef
    if hasattr(text_config, "output_router_logits") and coef != 0.0:
        return [f"router_aux_loss_coef={coef} (a mixture-of-experts load-balancing loss)"]
    return []


@dataclass
class FusedObjectiveOutput(ModelOutput):
    """What the patched forward returns for ``losscodegen=(head, labels, inputs, n)``: the head's
    ``HeadOutput`` fields."""

    loss: torch.Tensor | None = None
    terms: dict | None = None
    metrics: dict | None = None
    rows: dict | None = None


def add_fused_objective(model: Any, cast_lm_head_to_fp32: bool) -> None:
    """Patch ``model`` (the instance TRL gave its fused LM head) so that ``model(..., losscodegen=(head,
    labels, inputs, n))`` runs the backbone and ``head.linear(..., **inputs)`` on the hidden states that
    predict the last ``n`` tokens; any other call goes to the forward it had."""
    inner = model.forward

    def forward(self, *args: Any, losscodegen: tuple | None = None, **kwargs: Any) -> Any:
        if losscodegen is None:
            return inner(*args, **kwargs)
        head, labels, inputs, n = losscodegen
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, -n - 1:-1]   # (TRL: [:, :-1], last n)
        lm_head = self.get_output_embeddings()
        hidden = hidden.to(lm_head.weight.device)
        autocast = contextlib.nullcontext()
        if cast_lm_head_to_fp32:   # TRL: the projection in fp32, outside autocast
            hidden = hidden.float()
            autocast = torch.autocast(hidden.device.type, enabled=False)
        with autocast:
            out = head.linear(hidden, lm_head.weight, labels.to(hidden.device), bias=lm_head.bias, **inputs)
        return FusedObjectiveOutput(loss=out.loss, terms=out.terms, metrics=out.metrics, rows=out.rows)

    model.forward = types.MethodType(functools.wraps(type(model).forward)(forward), model)

def fused_policy(trainer: Any, name: str, refused: list[str]) -> tuple[Any, float | None, float]:
    """Check a TRL trainer of sequences built (DPO, KTO): refuse, with ``refused`` (the trainer's own), a
    vision dataset (its images' inputs are not checked through the fused forward); return the policy model
    and its final-logit transform (softcap, scale)."""
    if trainer._is_vision_dataset:
        refused.append("a vision dataset (the images' inputs are not checked through the fused forward)")
    refuse_unfused(refused, name)
    target = policy_model(trainer.model)
    return (target, *final_logit_transform(target))


def fused_pair_trainer(trainer: Any, name: str, refused: list[str]) -> tuple[Any, float]:
    """Check a TRL pair trainer (CPO, ORPO) built: refuse what one fused call on the policy's hidden states
    cannot compute (with ``refused``, the trainer's own), patch its model for ``add_fused_objective``, and
    return the patched model and its logit scale."""
    target = policy_model(trainer.model)
    softcap, scale = final_logit_transform(target)
    if trainer.is_encoder_decoder:
        refused.append("an encoder-decoder model")
    if softcap is not None:
        refused.append(f"a final-logit softcap ({softcap * abs(scale)}: TRL's logits/chosen, a mean of the full "
                       "logits, is then no function of the hidden states' mean)")
    if trainer.aux_loss_enabled and trainer.aux_loss_coef != 0.0:
        refused.append(f"router_aux_loss_coef={trainer.aux_loss_coef} (a mixture-of-experts load-balancing loss)")
    refuse_unfused(refused, name, f"trl.experimental.{name[:-len('Trainer')].lower()}.{name}")
    add_fused_objective(target, cast_lm_head_to_fp32=False)
    return target, scale


def fused_pair_forward(model: Any, target: Any, scale: float, cat: dict, head: lcg.HeadLoss, labels: torch.Tensor,
                       call: dict) -> tuple[lcg.HeadOutput, torch.Tensor]:
    """One ``head.linear`` call on TRL's concatenated batch ``cat`` (labels ``[2B, T - 1]``, shifted), and
    each position's mean logit over the vocabulary ``[2B, T]`` (TRL logs means of the full logits): linear
    in the hidden state, ``h . mean(W) + mean(b)`` times the logit scale, from the backbone's output."""
    hidden = []
    hook = target.base_model.register_forward_hook(
        lambda module, inputs, output: hidden.append(output.last_hidden_state.detach()))
    try:
        out = model(cat["concatenated_input_ids"], attention_mask=cat["concatenated_attention_mask"],
                    use_cache=False, losscodegen=(head, labels, call, labels.shape[1]))
    finally:
        hook.remove()
    lm_head = target.get_output_embeddings()
    with torch.no_grad():
        mean_logit = hidden[0].float() @ lm_head.weight.float().mean(0)
        if lm_head.bias is not None:
            mean_logit = mean_logit + lm_head.bias.float().mean()
    return out, mean_logit * scale


def global_mean(gather: Any, total: torch.Tensor, count: Any, *, empty: float | None = None) -> float | None:
    """``total / count``, each summed over the processes (``gather``: the accelerator's ``gather`` or
    ``gather_for_metrics``), as TRL's logged means are; ``empty`` where the count is 0 on every process."""
    count = torch.as_tensor(count, dtype=torch.float32, device=total.device)
    totals = gather(torch.stack([total.float(), count])[None]).reshape(-1, 2).sum(0)
    return (totals[0] / totals[1]).item() if totals[1] > 0 else empty


def empty_sequences_error(trainer: str, what: str) -> ValueError:
    return ValueError(f"losscodegen's {trainer}: {what} has no completion token (truncated by max_length?): TRL "
                      "counts it as a constant in its mean, the fused segment terms cannot; raise max_length or drop "
                      "such examples")
