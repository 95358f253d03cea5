"""Causal LMs on gdp_jax's layers, loadable from and savable to fla checkpoints (needs ``flax``;
checkpoints need ``safetensors``; never torch).

    from gdp_jax.models import GatedDeltaProductForCausalLM, generate
    model = GatedDeltaProductForCausalLM.from_pretrained("path/to/fla_checkpoint")
    logits = model(input_ids)                                  # [B, T] -> [B, T, vocab]
    out = generate(model, input_ids, max_new_tokens=32)        # greedy; out.tokens [B, 32]
    model.save_pretrained("path/to/copy")                      # fla's from_pretrained loads it

``import gdp_jax`` does not import this package (nor flax).
"""
from gdp_jax.models.attention import Attention, KVCache
from gdp_jax.models.configuration import GatedDeltaProductConfig
from gdp_jax.models.convert import (fla_name, fla_state_dict, from_pretrained,
                                    load_fla_state_dict, read_safetensors, save_pretrained)
from gdp_jax.models.generation import GenerateOutput, generate, pad_prompts, sample_logits
from gdp_jax.models.modeling import (Block, GatedDeltaProductForCausalLM, GatedDeltaProductModel,
                                     GatedMLP, LMCache, init_model)

__all__ = ["Attention", "Block", "GatedDeltaProductConfig", "GatedDeltaProductForCausalLM",
           "GatedDeltaProductModel", "GatedMLP", "GenerateOutput", "KVCache", "LMCache",
           "fla_name", "fla_state_dict", "from_pretrained", "generate", "init_model",
           "load_fla_state_dict",
           "pad_prompts", "read_safetensors", "sample_logits", "save_pretrained"]
