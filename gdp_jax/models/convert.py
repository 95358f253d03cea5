"""fla (Hugging Face format) checkpoints <-> GatedDeltaProductForCausalLM, without torch.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``), as fla's ``save_pretrained`` writes them. Tensors are read and
written with ``safetensors.numpy`` (bfloat16 through ml_dtypes).

Names: our parameter paths mirror fla's module names; ``fla_name`` maps one to the other:

    ours                                         fla                                   layout
    model.embeddings.embedding                   model.embeddings.weight               same
    model.layers.i.{attn_norm,mlp_norm}.scale    model.layers.i.{...}.weight           same
    model.layers.i.attn.q_proj.kernel [D, C]     model.layers.i.attn.q_proj.weight     [C, D]
      (every nnx.Linear kernel: k_proj, v_proj, b_proj, a_proj, g_proj, o_proj, mlp.*_proj,
       lm_head; biases keep their name and layout)
    model.layers.i.attn.q_conv.conv.kernel       model.layers.i.attn.q_conv1d.weight
      [W, 1, C]                                    [C, 1, W]   (k_conv, v_conv too; .bias same)
    model.layers.i.attn.{A_log, dt_bias}         same names                            same
    model.layers.i.attn.o_norm.scale             model.layers.i.attn.o_norm.weight     same
    model.norm.scale                             model.norm.weight                     same
    lm_head.kernel [D, V]                        lm_head.weight [V, D] (absent when tied)

Loading checks the file's names against the model's: unknown or missing names raise a
ValueError listing them; so does a shape that does not match. fla's rotary tables are buffers that
fla does not save, so attention layers add no names beyond their projections.
"""
from __future__ import annotations

import json
import os
import pathlib
from typing import Dict, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdp_jax.models.configuration import GatedDeltaProductConfig
from gdp_jax.models.modeling import GatedDeltaProductForCausalLM

__all__ = ["fla_name", "fla_state_dict", "from_fla_layout", "from_pretrained",
           "load_fla_state_dict", "read_safetensors", "save_pretrained", "to_fla_layout"]

PathLike = Union[str, os.PathLike]
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
                "float64": jnp.float64}


def _safetensors_numpy():
    try:
        import safetensors.numpy as st
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("gdp_jax.models checkpoints need the `safetensors` package "
                          "(pip install safetensors)") from e
    return st


def fla_name(path) -> str:
    """Our parameter path (tuple of str/int) -> fla's state-dict name."""
    parts = [str(p) for p in path]
    out = []
    i = 0
    while i < len(parts):
        p = parts[i]
        if p.endswith("_conv") and i + 1 < len(parts) and parts[i + 1] == "conv":
            out.append(p[:-len("_conv")] + "_conv1d")   # q_conv.conv -> q_conv1d
            i += 2
            continue
        out.append(p)
        i += 1
    if out[-1] in ("kernel", "embedding", "scale"):
        out[-1] = "weight"
    return ".".join(out)


def to_fla_layout(path, value: np.ndarray) -> np.ndarray:
    """An array at our parameter path (or a gradient of it) -> fla's layout: Linear kernels
    [in, out] -> [out, in], conv kernels [W, 1, C] -> [C, 1, W], everything else unchanged."""
    if str(path[-1]) == "kernel":
        return np.ascontiguousarray(np.transpose(value, tuple(range(value.ndim))[::-1]))
    return value


def from_fla_layout(path, value: np.ndarray) -> np.ndarray:
    """fla's layout -> ours at ``path`` (the inverse of to_fla_layout: both reverse the axes)."""
    return to_fla_layout(path, value)


def _param_vars(model: nnx.Module):
    """[(path, Variable)] of the model's parameters, in a stable order."""
    return list(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def fla_state_dict(model: GatedDeltaProductForCausalLM, dtype=None) -> Dict[str, np.ndarray]:
    """The model's parameters as fla's state dict: name -> numpy array in fla's layout (in
    ``dtype``, default each parameter's own)."""
    out = {}
    for path, var in _param_vars(model):
        value = np.asarray(jax.device_get(var.get_value()))
        if dtype is not None:
            value = value.astype(jnp.dtype(dtype))
        out[fla_name(path)] = to_fla_layout(path, value)
    return out


def load_fla_state_dict(model: GatedDeltaProductForCausalLM,
                        tensors: Dict[str, np.ndarray]) -> GatedDeltaProductForCausalLM:
    """Set the model's parameters (in place) from fla's state dict; returns the model.

    Each array is cast to its parameter's dtype. Unknown names, missing names and shape
    mismatches raise ValueError naming them. With tie_word_embeddings an ``lm_head.weight``
    is accepted when it equals the embedding matrix (it is the same tensor in fla).
    """
    tensors = dict(tensors)
    if model.config.tie_word_embeddings and "lm_head.weight" in tensors:
        head = tensors.pop("lm_head.weight")
        emb = tensors.get("model.embeddings.weight")
        if emb is None or head.shape != emb.shape or not np.array_equal(
                np.asarray(head, np.float32), np.asarray(emb, np.float32)):
            raise ValueError("tensors: lm_head.weight differs from model.embeddings.weight but "
                             "the config ties them (tie_word_embeddings=True)")
    params = _param_vars(model)
    expected = {fla_name(path): (path, var) for path, var in params}
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unknown or missing:
        lines = []
        if unknown:
            lines.append(f"unknown (in the checkpoint, not in the model): {unknown}")
        if missing:
            lines.append(f"missing (in the model, not in the checkpoint): {missing}")
        raise ValueError("checkpoint parameter names do not match the model's config:\n  "
                         + "\n  ".join(lines))
    bad = []
    for name, (path, var) in expected.items():
        want = tuple(var.get_value().shape)
        got = tuple(from_fla_layout(path, np.asarray(tensors[name])).shape)
        if got != want:
            bad.append(f"{name}: checkpoint {tuple(np.shape(tensors[name]))}, expected "
                       f"{tuple(to_fla_layout(path, np.zeros(want, np.int8)).shape)}")
    if bad:
        raise ValueError("checkpoint parameter shapes do not match the model's config:\n  "
                         + "\n  ".join(bad))
    for name, (path, var) in expected.items():
        value = from_fla_layout(path, np.asarray(tensors[name]))
        var.set_value(jnp.asarray(value, dtype=var.get_value().dtype))
    nnx.update(model, nnx.from_flat_state(params))
    return model


def read_safetensors(directory: PathLike) -> Dict[str, np.ndarray]:
    """All tensors of a checkpoint directory (model.safetensors, or the shards its index
    names) as numpy arrays, by name."""
    st = _safetensors_numpy()
    directory = pathlib.Path(directory)
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    if single.is_file():
        return dict(st.load_file(str(single)))
    if index.is_file():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for name in files:
            out.update(st.load_file(str(directory / name)))
        return out
    raise ValueError(f"directory: no {WEIGHTS_NAME} or {INDEX_NAME} in {str(directory)!r}")


def _checkpoint_dtype(config: GatedDeltaProductConfig, tensors: Dict[str, np.ndarray]):
    name = config.extra.get("dtype", config.extra.get("torch_dtype"))
    if isinstance(name, str) and name in _DTYPE_NAMES:
        return _DTYPE_NAMES[name]
    for value in tensors.values():
        if jnp.issubdtype(value.dtype, jnp.floating):
            return value.dtype
    return jnp.float32


def from_pretrained(directory: PathLike, *, dtype=None, param_dtype=None, chunk_size: int = 64,
                    implementation: Optional[str] = None) -> GatedDeltaProductForCausalLM:
    """Load a fla GatedDeltaProduct checkpoint directory (config.json + safetensors).

    Args:
      directory: the checkpoint directory.
      dtype: computation dtype (default: param_dtype).
      param_dtype: parameter dtype (default: the checkpoint's, from config.json's ``dtype`` /
        ``torch_dtype`` or else its tensors).
      chunk_size, implementation: for the GatedDeltaProduct layers.

    The parameters are never randomly initialised (the model is built abstractly, then filled).
    ValueError for a missing directory or file and for unknown, missing or misshapen names.
    """
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        raise ValueError(f"directory: {str(directory)!r} is not a directory")
    if not (directory / CONFIG_NAME).is_file():
        raise ValueError(f"directory: no {CONFIG_NAME} in {str(directory)!r}")
    config = GatedDeltaProductConfig.from_json_file(directory / CONFIG_NAME)
    tensors = read_safetensors(directory)
    if param_dtype is None:
        param_dtype = _checkpoint_dtype(config, tensors)
    if dtype is None:
        dtype = param_dtype
    abstract = nnx.eval_shape(lambda: GatedDeltaProductForCausalLM(
        config, dtype=dtype, param_dtype=param_dtype, chunk_size=chunk_size,
        implementation=implementation, rngs=nnx.Rngs(0)))
    return load_fla_state_dict(abstract, tensors)


def save_pretrained(model: GatedDeltaProductForCausalLM, directory: PathLike, *,
                    dtype=None) -> None:
    """Write config.json and model.safetensors (fla's names and layouts, metadata format "pt")
    so that fla's ``GatedDeltaProductForCausalLM.from_pretrained(directory)`` loads them.

    dtype: the tensors' dtype (default: each parameter's); config.json's ``dtype`` says it.
    With tie_word_embeddings no ``lm_head.weight`` is written (as Hugging Face does).
    """
    if not isinstance(model, GatedDeltaProductForCausalLM):
        raise TypeError(f"model: expected a GatedDeltaProductForCausalLM, got "
                        f"{type(model).__name__}")
    st = _safetensors_numpy()
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = fla_state_dict(model, dtype)
    st.save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    config = model.config
    stored = {np.dtype(v.dtype).name for v in tensors.values()}
    extra = dict(config.extra)
    if len(stored) == 1:
        extra["dtype"] = stored.pop()
        if "torch_dtype" in extra:
            extra["torch_dtype"] = extra["dtype"]
    GatedDeltaProductConfig.from_dict({**config.to_dict(), **extra}).to_json_file(
        directory / CONFIG_NAME)
