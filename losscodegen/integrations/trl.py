"""TRL: losscodegen's trainers and TRL's fused LM head on ``head.linear`` (docs/integrations-trl.md), by the
names they are documented under. Each trainer has a module of its own over a shared base
(``trl_base``: the fused call on the trainer's model, the cross-process mean of the logged metrics), and
every loss they compute is declared in ``trl_losses``:

- ``GRPOTrainer`` (``trl_grpo``): TRL's whole GRPO objective in one ``head.linear`` call per micro-batch;
- ``SFTTrainer`` (``trl_sft``): a model patched by ``apply_losscodegen`` trains on its head's objective;
- ``DPOTrainer`` (``trl_dpo``) and ``KTOTrainer`` (``trl_kto``): the terms of ``losscodegen.preference``;
- ``add_fused_lm_head`` / ``replace_fused_lm_heads`` (``trl_lm_head``): TRL's fused LM head, under TRL's
  own loss code;
- ``generalized_jsd_loss`` (``trl_losses``): TRL's GKD loss, fused.

TRL's experimental trainers (importing ``trl.experimental`` warns) are in ``trl_cpo``, ``trl_orpo`` and
``trl_gkd``, imported only when used.
"""
from __future__ import annotations

from losscodegen.integrations.trl_dpo import DPOTrainer, unfused_dpo_options
from losscodegen.integrations.trl_grpo import (FUSED_IMPORTANCE_SAMPLING_LEVELS, FUSED_LOSS_TYPES, GRPOTrainer,
                                               unfused_options)
from losscodegen.integrations.trl_kto import KTOTrainer
from losscodegen.integrations.trl_lm_head import add_fused_lm_head, final_logit_transform, replace_fused_lm_heads
from losscodegen.integrations.trl_losses import generalized_jsd_loss
from losscodegen.integrations.trl_sft import SFTTrainer

__all__ = ["GRPOTrainer", "SFTTrainer", "DPOTrainer", "KTOTrainer", "FUSED_LOSS_TYPES", "unfused_dpo_options",
           "FUSED_IMPORTANCE_SAMPLING_LEVELS", "unfused_options", "generalized_jsd_loss", "add_fused_lm_head",
           "replace_fused_lm_heads", "final_logit_transform"]
