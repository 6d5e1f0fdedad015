"""Model types against their unpatched forward (which computes its own loss, transformers' code): a tiny
model of each family from its config (1 layer, 2 where experts follow a dense one, hidden 32, vocabulary
96, random weights, fp32, CPU), the training loss with num_items_in_batch and every parameter's
gradient; mixture-of-experts models with their router's load-balancing loss (output_router_logits,
router_aux_loss_coef); *ForConditionalGeneration models through their language model. No type is
registered: each is patched because its forward reads as transformers' standard causal-LM loss path.
Liger-Kernel's 50 types, and the newest Gemma, Qwen and Mistral families of the installed transformers,
among them. And forwards that differ are refused naming the line; register_model_type's misuse."""
import copy
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from losscodegen.integrations import transformers_model_types as integration  # noqa: E402
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
MROPE_DEFAULT = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
QWEN_VL_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                      spatial_merge_size=1, temporal_patch_size=1, deepstack_visual_indexes=[0],
                      num_position_embeddings=16)
LINEAR_ATTENTION = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2)
PER_LAYER_INPUT = dict(vocab_size_per_layer_input=V, hidden_size_per_layer_input=8)    # (Gemma 3n, Gemma 4)
MLA = dict(n_routed_experts=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
           num_key_value_heads=4)
# model type -> config arguments (beyond TEXT for text models): the final-logit transforms made to matter,
# experts few and small
CASES = {
    **{t: {} for t in ("llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "gemma", "phi", "phi3", "olmo",
                       "olmo2", "olmo3", "starcoder2", "smollm3", "glm", "glm4", "helium", "exaone4", "ernie4_5",
                       "seed_oss", "apertus", "arcee", "nemotron", "stablelm", "hunyuan_v1_dense")},
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
                     first_k_dense_replace=1, num_hidden_layers=2),
    "olmoe": MOE,
    "phimoe": MOE,
    "ernie4_5_moe": dict(MOE, moe_num_experts=4, moe_k=2, moe_layer_start_index=0),
    "minimax": dict(MOE, layer_types=["full_attention"]),
    "granitemoe": dict(MOE, logits_scaling=4.0),
    "gemma2": dict(final_logit_softcapping=3.0),
    "gemma3_text": dict(final_logit_softcapping=2.5),
    "gemma3n_text": dict(final_logit_softcapping=3.0, layer_types=["full_attention"], intermediate_size=[64],
                         altup_num_inputs=2, laurel_rank=4, num_kv_shared_layers=0, activation_sparsity_pattern=[0.0],
                         **PER_LAYER_INPUT),
    "gemma4_text": dict(final_logit_softcapping=3.0, layer_types=["full_attention"], **PER_LAYER_INPUT),
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
    "qwen3_5_text": dict(LINEAR_ATTENTION, layer_types=["full_attention"]),
    "qwen3_5_moe_text": dict(MOE, shared_expert_intermediate_size=16, layer_types=["full_attention"],
                             **LINEAR_ATTENTION),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, q_lora_rank=16,
                        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1,
                        topk_group=1, first_k_dense_replace=1, n_shared_experts=1, head_dim=4, num_hidden_layers=2,
                        num_key_value_heads=4),
    "deepseek_v4": dict(MOE, n_routed_experts=4, q_lora_rank=16, num_key_value_heads=1, layer_types=["sliding_attention"],
                        mlp_layer_types=["moe"], o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8,
                        index_topk=4, hc_mult=2),
    "mistral4": dict(MOE, **MLA),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64),
    "mllama_text_model": dict(cross_attention_layers=[]),
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
    "mistral3": dict(text_config={**TEXT, "model_type": "mistral"}, image_token_index=90, spatial_merge_size=1,
                     vision_config={**VISION, "model_type": "pixtral", "head_dim": 8}),
    "mistral_large4": dict(text_config={**TEXT, **MOE, **MLA, "final_logit_softcapping": 3.0}, image_token_index=90,
                           vision_config={**VISION, "head_dim": 8}, spatial_merge_size=1),
    "qwen3_vl": dict(text_config={**TEXT, "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2]}},
                     image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_config=QWEN_VL_VISION),
    "qwen3_vl_moe": dict(text_config={**TEXT, **MOE, "rope_parameters": MROPE_DEFAULT}, image_token_id=90,
                         video_token_id=91, vision_start_token_id=92, vision_config=QWEN_VL_VISION),
    "qwen3_5": dict(text_config={**TEXT, **LINEAR_ATTENTION, "layer_types": ["full_attention"],
                                 "rope_parameters": {**MROPE_DEFAULT, "partial_rotary_factor": 0.25}},
                    image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_config=QWEN_VL_VISION),
    "qwen3_5_moe": dict(text_config={**TEXT, **MOE, **LINEAR_ATTENTION, "shared_expert_intermediate_size": 16,
                                     "layer_types": ["full_attention"],
                                     "rope_parameters": {**MROPE_DEFAULT, "partial_rotary_factor": 0.25}},
                        image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_config=QWEN_VL_VISION),
    "internvl": dict(text_config={**TEXT, "model_type": "qwen2"}, image_token_id=90,
                     vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                        image_size=[16, 16], patch_size=[8, 8])),
    "smolvlm": dict(text_config={**TEXT, "model_type": "llama"}, image_token_id=90, scale_factor=1,
                    vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=16, patch_size=8)),
    "paligemma": dict(text_config={**TEXT, "model_type": "gemma2", "final_logit_softcapping": 3.0}, image_token_index=90,
                      vision_config={**VISION, "model_type": "siglip_vision_model", "projection_dim": 32},
                      projection_dim=32, hidden_size=32),
    "gemma4": dict(text_config={**TEXT, **PER_LAYER_INPUT, "final_logit_softcapping": 3.0,
                                "layer_types": ["full_attention"]},
                   vision_config=None, audio_config=None, image_token_id=90, boi_token_id=91, eoi_token_id=92,
                   video_token_id=93, boa_token_id=94, eoa_token_index=95, audio_token_id=89),
    "llama4": dict(text_config=dict(TEXT, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64),
                   vision_config=dict(VISION, vision_output_dim=16, projector_input_dim=16, projector_output_dim=32)),
    "mllama": dict(text_config=dict(TEXT, cross_attention_layers=[]),
                   vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_global_layers=1,
                                      attention_heads=2, image_size=16, patch_size=8, vision_output_dim=32,
                                      intermediate_layers_indices=[0])),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, moe_intermediate_size=16),
    "falcon_h1": dict(lm_head_multiplier=0.5, mamba_d_ssm=16, mamba_n_heads=4, mamba_d_head=4, mamba_d_state=8,
                      mamba_n_groups=1, mamba_chunk_size=8),
    "glm4v": dict(text_config={**TEXT, "rope_scaling": {"rope_type": "default", "mrope_section": [1, 1, 2]}},
                  image_token_id=90, video_token_id=91, image_start_token_id=92, image_end_token_id=93,
                  vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                                     patch_size=4, spatial_merge_size=1, temporal_patch_size=1)),
    "glm4v_moe": dict(text_config={**TEXT, **MOE, "n_routed_experts": 4, "n_group": 1, "topk_group": 1,
                                   "first_k_dense_replace": 0,
                                   "rope_parameters": {**MROPE_DEFAULT, "partial_rotary_factor": 1.0}},
                      image_token_id=90, video_token_id=91, image_start_token_id=92, image_end_token_id=93,
                      vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                                         patch_size=4, spatial_merge_size=1, temporal_patch_size=1)),
}
# (config arguments given whole: the composite configs; and the class where no Auto class maps the type)
COMPOSITE = ("gemma3", "glm4v", "glm4v_moe", "llava", "qwen2_5_vl", "qwen2_vl", "mistral3", "mistral_large4", "qwen3_vl",
             "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "internvl", "smolvlm", "paligemma", "gemma4", "llama4", "mllama")
CLASS = {"mistral4": "Mistral4ForCausalLM", "mllama_text_model": "MllamaForCausalLM",
         "llama4": "AutoModelForCausalLM"}   # (Llama4ForCausalLM: its ForConditionalGeneration's language_model computes
#                                              the logits, and the loss from them outside: refused)

# Liger-Kernel's model types: MODEL_TYPE_TO_APPLY_LIGER_FN in src/liger_kernel/transformers/monkey_patch.py of
# linkedin/Liger-Kernel (commit ead96b618e5c, 2026-08-21), as listed there.
LIGER_MODEL_TYPES = (
    "deepseek_v4", "gemma", "gemma2", "gemma3_text", "gemma3", "gemma4_text", "gemma4", "glm4", "glm4v", "glm4v_moe",
    "gpt_oss", "internvl", "llama", "llama4_text", "llama4", "llava", "granite", "mllama", "mllama_text_model",
    "ministral", "mistral", "mixtral", "nemotron", "olmo2", "pixtral", "olmo3", "qwen2", "qwen3", "qwen3_moe",
    "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text", "qwen3_next", "qwen3_5", "qwen3_5_text",
    "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text", "smollm3",
    "phi3", "paligemma", "falcon_h1", "smolvlm", "hunyuan_v1_dense", "hunyuan_v1_moe", "exaone4")
# Liger's types that are no model with an output layer in transformers: the text model of a vision-language
# model (which has no lm_head of its own), and Pixtral, a vision encoder. Each is covered by the type whose
# model holds it (its config's text_config or vision_config), checked above.
LIGER_PARTS = {"qwen2_vl_text": "qwen2_vl", "qwen2_5_vl_text": "qwen2_5_vl", "qwen3_vl_text": "qwen3_vl",
               "qwen3_vl_moe_text": "qwen3_vl_moe", "pixtral": "mistral3"}
# AutoModelForCausalLM loads a Llama 4 checkpoint (model type llama4) as Llama4ForCausalLM of its text config
LOADED_AS = {"llama4": "llama4_text"}


def config_of(model_type, **over):
    kwargs = CASES[model_type] if model_type in COMPOSITE else {**TEXT, **CASES[model_type]}
    return transformers.AutoConfig.for_model(model_type, **{**kwargs, **over})


def tiny(model_type, **over):
    config = config_of(model_type, **over)
    torch.manual_seed(0)
    if model_type in CLASS:
        cls = getattr(transformers, CLASS[model_type])
        model = cls.from_config(config) if CLASS[model_type].startswith("Auto") else cls(config)
    else:
        auto = transformers.AutoModelForImageTextToText if model_type in COMPOSITE else transformers.AutoModelForCausalLM
        model = auto.from_config(config)
    model = model.float()
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


def assert_patched_equals_unpatched(ref, **kwargs):
    """The patched copy of ``ref`` trains on what ``ref``'s own forward computes: loss, router loss, every
    gradient. Returns the patched model."""
    model = apply_losscodegen(copy.deepcopy(ref))
    want, want_grads = _loss_and_grads(ref, {**batch(), **kwargs})
    got, grads = _loss_and_grads(model, {**batch(), **kwargs})
    assert got.logits is None and want.logits is not None
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    if getattr(want, "aux_loss", None) is not None:       # (the router loss is in both)
        torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-6, atol=1e-7)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item() + 1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
    return model


@pytest.fixture
def declarations():
    """register_model_type's declarations made in a test, undone after it."""
    before = dict(integration._MODEL_TYPES), integration.SUPPORTED_MODEL_TYPES
    yield
    integration._MODEL_TYPES.clear()
    integration._MODEL_TYPES.update(before[0])
    integration.SUPPORTED_MODEL_TYPES = before[1]


def test_every_verified_type_has_a_case():
    assert set(CASES) == set(integration._VERIFIED_MODEL_TYPES) <= set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_patched_training_loss_and_gradients_equal_the_models_own(model_type):
    ref = tiny(model_type)
    assert model_type not in integration._MODEL_TYPES        # (read from its forward, not declared)
    assert_patched_equals_unpatched(ref)


def test_ligers_50_model_types_are_all_covered():
    assert len(set(LIGER_MODEL_TYPES)) == 50
    for model_type in LIGER_MODEL_TYPES:
        if model_type in LIGER_PARTS:
            config = config_of(LIGER_PARTS[model_type])
            assert model_type in (config.text_config.model_type, config.vision_config.model_type), model_type
        else:
            assert model_type in CASES and model_type in SUPPORTED_MODEL_TYPES, model_type
            assert tiny(model_type).config.model_type == LOADED_AS.get(model_type, model_type)


def test_a_new_qwen_moe_model_is_patched_without_registering():
    ref = tiny("qwen3_5_moe_text")
    model = apply_losscodegen(copy.deepcopy(ref)).train()
    ref.train()
    for flag in (False, True):    # the router's loss as the forward adds it, with output_router_logits or not
        want, got = ref(**batch(), output_router_logits=flag), model(**batch(), output_router_logits=flag)
        torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
        assert (got.aux_loss is None) == (not flag) == (want.aux_loss is None)
    assert ref(**batch(), output_router_logits=True).loss > ref(**batch(), output_router_logits=False).loss


def test_a_new_qwen_dense_model_is_patched_without_registering():
    model = assert_patched_equals_unpatched(tiny("qwen3_5_text"))
    assert model.losscodegen.final_logits.softcap is None and model.losscodegen.final_logits.logit_scale == 1


def test_a_new_gemma_model_is_patched_with_the_softcap_its_forward_applies():
    for model_type in ("gemma4_text", "gemma4"):
        model = assert_patched_equals_unpatched(tiny(model_type))
        assert model.losscodegen.head.softcap == 3.0 == model.config.get_text_config().final_logit_softcapping
    # without a softcap in its config, the forward applies none, and neither does the head
    model = assert_patched_equals_unpatched(tiny("gemma4_text", final_logit_softcapping=None))
    assert model.losscodegen.head.softcap is None


def test_a_new_mistral_model_is_patched_without_registering():
    assert_patched_equals_unpatched(tiny("ministral3"))
    assert_patched_equals_unpatched(tiny("mistral4"))
    model = assert_patched_equals_unpatched(tiny("mistral_large4"))     # (it softcaps: self.final_logit_softcapping)
    assert model.losscodegen.head.softcap == 3.0


def test_a_fine_tune_with_its_own_model_type_is_patched_without_registering():
    config = config_of("qwen2")
    config.model_type = "my_qwen2_finetune"      # (a type nobody declared, with Qwen2's forward)
    torch.manual_seed(0)
    assert_patched_equals_unpatched(transformers.Qwen2ForCausalLM(config))


# ---- forwards that differ from the standard path: refused naming the line --------------------------

class ZLossLlama(transformers.LlamaForCausalLM):
    """A forward that adds a term to the loss (Bamba's z-loss): the head would drop it."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
            loss = loss + 1e-4 * logits.logsumexp(-1).pow(2).mean()
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class BiasedLogitsLlama(transformers.LlamaForCausalLM):
    """A final-logit transform the head does not compute (an added bias)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits + self.config.vocab_size
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


class LearnedScaleLlama(transformers.LlamaForCausalLM):
    """A learned logit scale (a Parameter, not a number of the config)."""

    def __init__(self, config):
        super().__init__(config)
        self.temperature = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits * self.temperature
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def _forward_calling_its_parent(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
    """A forward whose code cannot be read as the standard path (it calls its parent class's), whose loss is."""
    return type(self).__mro__[1].forward(self, input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                         logits_to_keep=logits_to_keep, **kwargs)


def test_a_forward_that_adds_to_the_loss_is_refused_naming_the_line():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"ZLossLlama.*line \d+: `loss = loss \+ 0.0001 \* logits.logsumexp.*the loss "
                                         r"is not `self.loss_function\(logits, labels, ...\)` alone.*register_model_type"):
        apply_losscodegen(ZLossLlama(config_of("llama")))


def test_a_logit_transform_the_head_does_not_compute_is_refused_naming_the_line():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"BiasedLogitsLlama.*`logits \+ self.config.vocab_size`: the logits are "
                                         "computed or transformed in a way the head does not compute"):
        apply_losscodegen(BiasedLogitsLlama(config_of("llama")))
    with pytest.raises(ValueError, match=r"multiplied by self.temperature, a Parameter: the head's softcap and "
                                         "logit_scale are finite nonzero numbers"):
        apply_losscodegen(LearnedScaleLlama(config_of("llama")))


def test_a_transformers_model_off_the_standard_path_is_refused_naming_the_line():
    # BART's causal LM: its own CrossEntropyLoss on unshifted labels
    config = transformers.AutoConfig.for_model("bart", vocab_size=V, d_model=32, decoder_layers=1, encoder_layers=1,
                                               decoder_attention_heads=2, encoder_attention_heads=2,
                                               decoder_ffn_dim=32, encoder_ffn_dim=32, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"BartForCausalLM.*line \d+: `loss = loss_fct\(logits.view\(-1, "
                                         r"self.config.vocab_size\), labels.view\(-1\)\)`"):
        apply_losscodegen(transformers.BartForCausalLM(config))
    # Llama 4's multimodal model: its language model computes the logits, and the forward its loss from them
    config = config_of("llama4")
    with pytest.raises(ValueError, match=r"Llama4ForConditionalGeneration.*line \d+: `if \(input_ids is None\) \^"):
        apply_losscodegen(transformers.Llama4ForConditionalGeneration(config))


# ---- register_model_type ----------------------------------------------------------------------

@pytest.mark.parametrize("model_type, declared", [
    ("qwen2", {}), ("gemma2", dict(softcap="final_logit_softcapping")), ("granite", dict(logit_divisor="logits_scaling")),
    ("mixtral", dict(router_aux_loss=True))])
def test_register_model_type_lets_a_forward_that_cannot_be_read_be_patched(declarations, model_type, declared):
    ref = tiny(model_type)
    ref.__class__ = type(f"Wrapped{type(ref).__name__}", (type(ref),), {"forward": _forward_calling_its_parent})
    ref.config.model_type = f"my_wrapped_{model_type}"
    with pytest.raises(ValueError, match=f"'my_wrapped_{model_type}'.*`return type\\(self\\).__mro__.*expected the "
                                         "backbone's call.*register_model_type"):
        apply_losscodegen(copy.deepcopy(ref))
    register_model_type(f"my_wrapped_{model_type}", **declared)
    assert f"my_wrapped_{model_type}" in integration.SUPPORTED_MODEL_TYPES
    assert_patched_equals_unpatched(ref)


def test_register_model_type_with_a_number_for_an_attribute_name_is_a_type_error(declarations):
    with pytest.raises(TypeError, match=r"softcap must be the name of a config attribute .*got 30.0"):
        register_model_type("my_capped", softcap=30.0)
    with pytest.raises(TypeError, match=r"logit_scale must be the name of a config attribute .*got 0.5"):
        register_model_type("my_scaled", logit_scale=0.5)
    with pytest.raises(ValueError, match="logit_divisor must be the name of a config attribute, got 'config.x'"):
        register_model_type("my_divided", logit_divisor="config.x")
    with pytest.raises(TypeError, match="router_aux_loss must be a bool, got 'yes'"):
        register_model_type("my_moe", router_aux_loss="yes")
    with pytest.raises(TypeError, match="model_type"):
        register_model_type("")
    assert not {"my_capped", "my_scaled", "my_divided", "my_moe"} & set(integration._MODEL_TYPES)


def test_declaring_a_supported_type_again_is_refused(declarations):
    for model_type in ("gemma2", "llama", "qwen3_5_moe_text"):     # checked in these tests
        with pytest.raises(ValueError, match=f"register_model_type\\('{model_type}'\\): .*supported already.*"
                                             "replace=True"):
            register_model_type(model_type)
    with pytest.raises(ValueError, match="'gpt_neox' is supported already: GPTNeoXForCausalLM's forward reads"):
        register_model_type("gpt_neox")           # (a transformers type whose forward reads as the standard path)
    register_model_type("my_type")
    with pytest.raises(ValueError, match="'my_type' is declared already"):
        register_model_type("my_type", softcap="final_logit_softcapping")
    assert integration._MODEL_TYPES["my_type"] == integration.ModelType()


def test_a_gemma2_declared_again_with_replace_does_not_train_without_its_softcap(declarations):
    ref = tiny("gemma2")
    register_model_type("gemma2", replace=True)          # (no softcap declared)
    with pytest.raises(ValueError, match=r"register_model_type\('gemma2', ...\) contradicts Gemma2ForCausalLM.forward.*"
                                         "softcap: declared None, the forward's 3.0"):
        apply_losscodegen(copy.deepcopy(ref))
    register_model_type("gemma2", softcap="final_logit_softcapping", replace=True)   # one that agrees
    assert_patched_equals_unpatched(ref)


def test_the_docs_list_the_supported_model_types():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "integrations-transformers.md").read_text()
    listed = re.search(r"<!-- SUPPORTED_MODEL_TYPES -->\n(.*?)\n<!-- end -->", docs, re.S)
    assert listed, "docs/integrations-transformers.md: the list between <!-- SUPPORTED_MODEL_TYPES --> and <!-- end -->"
    assert listed.group(1) == ", ".join(f"`{t}`" for t in SUPPORTED_MODEL_TYPES)
