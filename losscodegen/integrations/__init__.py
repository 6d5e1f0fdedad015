"""Integrations with training libraries, each in its own module and imported only when used:

- ``losscodegen.integrations.transformers``: ``apply_losscodegen(model, head=None)`` patches a Hugging
  Face causal LM instance so that its training forwards take the loss from ``head.linear``;
- ``losscodegen.integrations.trl``: TRL's GRPO trainer on one fused head call per micro-batch.

Importing this package imports neither transformers nor trl (``pip install "losscodegen[hf]"``).
"""
