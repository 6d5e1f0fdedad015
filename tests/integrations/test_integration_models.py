"""Every model type apply_losscodegen supports, against the unpatched model's own forward (which
computes its own loss): a tiny model of each family from its config (1 layer, 2 where experts follow a dense one, hidden 32, vocabulary
96, random weights, fp32, CPU), the training loss with num_items_in_batch and every parameter's
gradient; mixture-of-experts models with their router's load-balancing loss (output_router_logits,
router_aux_loss_coef); *ForConditionalGeneration models through their language model. And the docs'
list of types is the code's."""
import copy
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from losscodegen.integrations.transformers import (SUPPORTED_MODEL_TYPES, apply_losscodegen,  # noqa: E402
                                                   register_model_type)

V = 96
TEXT = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           output_router_logits=True, router_aux_loss_coef=0.3)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
              patch_size=8)
MROPE = {"type": "mrope", "mrope_section": [1, 1, 2]}
# model type -> config arguments (beyond TEXT for text models): the final-logit transforms made to matter,
# experts few and small
CASES = {
    **{t: {} for t in ("llama", "mistral", "ministral", "qwen2", "qwen3", "gemma", "phi", "phi3", "olmo", "olmo2",
                       "olmo3", "starcoder2", "smollm3", "glm", "glm4", "helium", "exaone4", "ernie4_5", "seed_oss",
                       "apertus", "arcee", "nemotron", "stablelm", "hunyuan_v1_dense")},
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
                     first_k_dense_replace=1, num_hidden_layers=2),
    "olmoe": MOE,
    "phimoe": MOE,
    "ernie4_5_moe": dict(MOE, moe_num_experts=4, moe_k=2, moe_layer_start_index=0),
    "minimax": dict(MOE, layer_types=["full_attention"]),
    "granitemoe": dict(MOE, logits_scaling=4.0),
    "gemma2": dict(final_logit_softcapping=3.0),
    "gemma3_text": dict(final_logit_softcapping=2.5),
    "cohere": dict(logit_scale=0.5),
    "cohere2": dict(logit_scale=0.25),
    "granite": dict(logits_scaling=4.0),
    "mixtral": MOE,
    "qwen3_moe": MOE,
    "gpt_oss": MOE,
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=16),
    "qwen3_next": dict(MOE, shared_expert_intermediate_size=16, linear_num_value_heads=2, linear_num_key_heads=2,
                       linear_key_head_dim=8, linear_value_head_dim=8, num_hidden_layers=2,
                       layer_types=["linear_attention", "full_attention"]),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, q_lora_rank=16,
                        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1,
                        topk_group=1, first_k_dense_replace=1, n_shared_experts=1, head_dim=4, num_hidden_layers=2,
                        num_key_value_heads=4),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64),
    "gemma3": dict(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_index=90,
                   boi_token_index=91, eoi_token_index=92),
    "llava": dict(text_config={**TEXT, "model_type": "llama"}, image_token_index=90,
                  vision_config={**VISION, "model_type": "clip_vision_model", "projection_dim": 16}),
    "qwen2_5_vl": dict(text_config={**TEXT, "rope_scaling": MROPE}, image_token_id=90, video_token_id=91,
                       vision_start_token_id=92,
                       vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                                          patch_size=4, spatial_merge_size=1, temporal_patch_size=1,
                                          fullatt_block_indexes=[0])),
    "qwen2_vl": dict(text_config={**TEXT, "rope_scaling": MROPE}, image_token_id=90, video_token_id=91,
                     vision_start_token_id=92,
                     vision_config=dict(depth=1, embed_dim=16, hidden_size=32, mlp_ratio=2, num_heads=2, patch_size=4,
                                        spatial_merge_size=1, temporal_patch_size=1)),
}
CASES.update(
    mistral3=dict(text_config={**TEXT, "model_type": "mistral"}, image_token_index=90, spatial_merge_size=1,
                  vision_config={**VISION, "model_type": "pixtral", "head_dim": 8}),
    qwen3_vl=dict(text_config={**TEXT, "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2]}},
                  image_token_id=90, video_token_id=91, vision_start_token_id=92,
                  vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                                     patch_size=4, spatial_merge_size=1, temporal_patch_size=1,
                                     deepstack_visual_indexes=[0], num_position_embeddings=16)),
    internvl=dict(text_config={**TEXT, "model_type": "qwen2"}, image_token_id=90,
                  vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=[16, 16], patch_size=[8, 8])),
    smolvlm=dict(text_config={**TEXT, "model_type": "llama"}, image_token_id=90, scale_factor=1,
                 vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=16, patch_size=8)),
    paligemma=dict(text_config={**TEXT, "model_type": "gemma2", "final_logit_softcapping": 3.0}, image_token_index=90,
                   vision_config={**VISION, "model_type": "siglip_vision_model", "projection_dim": 32},
                   projection_dim=32, hidden_size=32),
)
CASES.update(
    hunyuan_v1_moe=dict(num_experts=4, moe_topk=2, moe_intermediate_size=16),
    falcon_h1=dict(lm_head_multiplier=0.5, mamba_d_ssm=16, mamba_n_heads=4, mamba_d_head=4, mamba_d_state=8,
                   mamba_n_groups=1, mamba_chunk_size=8),
    glm4v=dict(text_config={**TEXT, "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2]}},
               image_token_id=90, video_token_id=91, image_start_token_id=92, image_end_token_id=93,
               vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                                  patch_size=4, spatial_merge_size=1, temporal_patch_size=1)),
)
MULTIMODAL = ("gemma3", "glm4v", "llava", "qwen2_5_vl", "qwen2_vl", "mistral3", "qwen3_vl", "internvl", "smolvlm", "paligemma")


def tiny(model_type):
    kwargs = CASES[model_type] if model_type in MULTIMODAL else {**TEXT, **CASES[model_type]}
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    auto = transformers.AutoModelForImageTextToText if model_type in MULTIMODAL else transformers.AutoModelForCausalLM
    model = auto.from_config(config).float()
    with torch.no_grad():   # logits of a few units, where the softcaps and scales matter
        model.lm_head.weight.mul_(20)
    return model


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 80, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100            # a prompt
    labels[1, 6:] = -100            # padding
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(13))


def _loss_and_grads(model, inputs):
    model.train()
    torch.manual_seed(1)          # (dropout, if a config has any, alike)
    out = model(**inputs)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_every_supported_type_has_a_case():
    assert set(CASES) == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_patched_training_loss_and_gradients_equal_the_models_own(model_type):
    ref = tiny(model_type)
    model = apply_losscodegen(copy.deepcopy(ref))
    want, want_grads = _loss_and_grads(ref, batch())
    got, grads = _loss_and_grads(model, batch())
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    if getattr(ref.config.get_text_config(), "output_router_logits", False) and hasattr(ref, "router_aux_loss_coef"):
        assert want.aux_loss is not None      # (the router loss is in both)
        torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item() + 1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_a_mixture_of_experts_router_loss_follows_output_router_logits():
    ref = tiny("mixtral")
    model = apply_losscodegen(copy.deepcopy(ref)).train()
    ref.train()
    inputs = batch()
    for flag in (False, True):
        want, got = ref(**inputs, output_router_logits=flag), model(**inputs, output_router_logits=flag)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
        assert (got.aux_loss is None) == (not flag)
    assert ref(**inputs, output_router_logits=True).loss > ref(**inputs, output_router_logits=False).loss


def test_register_model_type_lets_another_family_be_patched():
    config = transformers.AutoConfig.for_model("qwen2", **TEXT)
    config.model_type = "my_qwen2_finetune"      # (a type losscodegen does not know, with a plain forward)
    model = transformers.Qwen2ForCausalLM(config)
    with pytest.raises(ValueError, match="'my_qwen2_finetune'.*register_model_type"):
        apply_losscodegen(model)
    try:
        register_model_type("my_qwen2_finetune")
        apply_losscodegen(model)
    finally:
        from losscodegen.integrations import transformers as integration
        integration._MODEL_TYPES.pop("my_qwen2_finetune")
    with pytest.raises(TypeError, match="model_type"):
        register_model_type("")


def test_the_docs_list_the_supported_model_types():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "integrations-transformers.md").read_text()
    listed = re.search(r"<!-- SUPPORTED_MODEL_TYPES -->\n(.*?)\n<!-- end -->", docs, re.S)
    assert listed, "docs/integrations-transformers.md: the list between <!-- SUPPORTED_MODEL_TYPES --> and <!-- end -->"
    assert listed.group(1) == ", ".join(f"`{t}`" for t in SUPPORTED_MODEL_TYPES)
