"""AutoLosscodegenForCausalLM: AutoModelForCausalLM's loaders, the model patched (no code beyond the
class name): the same weights as AutoModelForCausalLM loads, and the head's loss."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import losscodegen as lcg  # noqa: E402
from losscodegen.integrations.transformers import AutoLosscodegenForCausalLM  # noqa: E402
from helpers import tiny_causal_lm  # noqa: E402

V = 96


def test_from_pretrained_loads_the_same_model_patched(tmp_path):
    tiny_causal_lm(V).save_pretrained(tmp_path)
    head = lcg.HeadLoss(lcg.CrossEntropy(), lcg.ZLoss(weight=0.1))
    model = AutoLosscodegenForCausalLM.from_pretrained(tmp_path, head=head).train()
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).train()
    assert type(model) is type(plain) and model.losscodegen.head is head
    ids = torch.randint(4, V, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = plain(input_ids=ids).logits[:, :-1].double()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1)) \
        + 0.1 * (logits.logsumexp(-1) ** 2).mean()
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss.double(), want, rtol=1e-5, atol=1e-6)


def test_from_config_patches_with_the_default_head():
    config = transformers.AutoConfig.for_model("llama", vocab_size=V, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    model = AutoLosscodegenForCausalLM.from_config(config)
    assert isinstance(model, transformers.LlamaForCausalLM)
    assert [t.name for t in model.losscodegen.head.loss_terms] == ["cross_entropy"]
