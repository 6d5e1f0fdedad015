"""Integrations with training libraries, each in its own module and imported only when used:

- ``losscodegen.integrations.transformers``: ``apply_losscodegen(model, head=None)`` patches a Hugging
  Face causal LM instance (``SUPPORTED_MODEL_TYPES``, ``register_model_type``) so that its training
  forwards take the loss from ``head.linear``; ``AutoLosscodegenForCausalLM`` and
  ``LosscodegenCallback`` switch it on without calling it, the callback logging the head's terms;
- ``losscodegen.integrations.trl``: TRL's GRPO trainer on one fused head call per micro-batch,
  ``generalized_jsd_loss`` (TRL's GKD loss, fused), and ``add_fused_lm_head`` / ``replace_fused_lm_heads``:
  TRL's fused LM head on ``head.linear``, under TRL's own loss code (``losscodegen.integrations.trl_lm_head``);
  its SFT, DPO and KTO trainers; ``trl_gkd``, ``trl_cpo`` and ``trl_orpo`` (TRL's experimental GKD, CPO and
  ORPO trainers), each in one fused call. One module per trainer over ``trl_base``; the losses in ``trl_losses``.

Importing this package imports neither transformers nor trl (``pip install "losscodegen[hf]"``).
"""
