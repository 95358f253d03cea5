"""GatedDeltaProductConfig: fla's model configuration (flash-linear-attention 0.6.0), field for field.

The fields, their names, order and defaults are those of
``fla.models.gated_deltaproduct.configuration_gated_deltaproduct.GatedDeltaProductConfig``; a
config.json that fla (through Hugging Face's ``PretrainedConfig``) wrote reads back here, and one
written here reads in fla. Keys Hugging Face adds (``architectures``, ``transformers_version``,
``dtype``, ...) and any other unknown key are kept in ``extra`` and written back unchanged.
No torch, no transformers.

What the model does with each field is in ``gdp_jax.models.modeling``. Fields that change only
how fla computes (``attn_mode``, ``fuse_norm``, ``fuse_swiglu``, ``fuse_cross_entropy``,
``fuse_linear_cross_entropy``, ``use_l2warp``, ``use_cache``) are kept for the round trip and
change nothing here. ``attnres_block_size`` (fla's attention residuals) is not implemented: a
config that sets it raises NotImplementedError.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from typing import Any, Optional, Union

__all__ = ["GatedDeltaProductConfig", "parse_attention_config"]

MODEL_TYPE = "gated_deltaproduct"
ARCHITECTURE = "GatedDeltaProductForCausalLM"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_attention_config(attn, *, num_hidden_layers: int):
    """fla's ``parse_attention_config``: validate the hybrid-attention spec and fill its defaults.

    attn: None, a dict ``{"layers": [...], "num_heads": int, "num_kv_heads"?: int,
    "qkv_bias"?: bool, "window_size"?: int | None, "rope_theta"?: float}`` or a list of such
    dicts (each layer index at most once). Returns the same form with defaults filled
    (num_kv_heads = num_heads, qkv_bias False, window_size None, rope_theta 10000.0); unknown
    keys are kept. ValueError naming the field otherwise.
    """
    if attn is None:
        return None
    if not isinstance(attn, (dict, list)):
        raise ValueError(f"attn: expected None, a dict or a list of dicts, got {attn!r}")
    specs, assigned = [], {}
    for i, spec in enumerate([attn] if isinstance(attn, dict) else attn):
        where = "attn" if isinstance(attn, dict) else f"attn[{i}]"
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: expected a dict, got {spec!r}")
        spec = dict(spec)
        for name in ("layers", "num_heads"):
            if name not in spec:
                raise ValueError(f"{where}: field {name!r} is required")
        layers = spec["layers"]
        if not isinstance(layers, (list, tuple)):
            raise ValueError(f"{where}.layers: expected a list of layer indices, got {layers!r}")
        for layer in layers:
            if not _is_int(layer) or not 0 <= layer < num_hidden_layers:
                raise ValueError(f"{where}.layers: expected ints in [0, {num_hidden_layers}), "
                                 f"got {layer!r}")
            if layer in assigned:
                raise ValueError(f"{where}.layers: layer {layer} is already assigned "
                                 f"(by attn spec {assigned[layer]})")
            assigned[layer] = i
        spec["layers"] = list(layers)
        if spec.get("num_kv_heads") is None:
            spec["num_kv_heads"] = spec["num_heads"]
        for name in ("num_heads", "num_kv_heads"):
            if not _is_int(spec[name]) or spec[name] <= 0:
                raise ValueError(f"{where}.{name}: expected a positive int, got {spec[name]!r}")
        if spec["num_heads"] % spec["num_kv_heads"]:
            raise ValueError(f"{where}.num_kv_heads: must divide num_heads={spec['num_heads']}, "
                             f"got {spec['num_kv_heads']}")
        if not isinstance(spec.setdefault("qkv_bias", False), bool):
            raise ValueError(f"{where}.qkv_bias: expected a bool, got {spec['qkv_bias']!r}")
        window = spec.setdefault("window_size", None)
        if window is not None and (not _is_int(window) or window <= 0):
            raise ValueError(f"{where}.window_size: expected a positive int or None, got "
                             f"{window!r}")
        theta = spec.setdefault("rope_theta", 10000.0)
        if (isinstance(theta, bool) or not isinstance(theta, (int, float))
                or not math.isfinite(theta) or theta <= 0):
            raise ValueError(f"{where}.rope_theta: expected a positive finite number, got "
                             f"{theta!r}")
        specs.append(spec)
    return specs[0] if isinstance(attn, dict) else specs


@dataclasses.dataclass
class GatedDeltaProductConfig:
    """fla's GatedDeltaProductConfig (same fields, names and defaults; see the module docstring).

    Derived sizes: ``head_v_dim = int(head_dim * expand_v)``; the MLP's
    ``resolved_intermediate_size`` (fla's GatedMLP rule: ``intermediate_size``, or
    ``int(hidden_size * hidden_ratio * 2 / 3)`` rounded up to a multiple of 256, hidden_ratio
    defaulting to 4); ``attention_spec(i)``: the hybrid softmax-attention spec of layer i, or
    None for a GatedDeltaProduct layer.
    """
    attn_mode: str = "chunk"
    conv_size: int = 4
    head_dim: int = 256
    num_heads: int = 6
    hidden_size: int = 2048
    expand_v: float = 2.0
    use_output_gate: bool = True
    use_short_conv: bool = True
    max_position_embeddings: int = 2048
    hidden_ratio: Optional[int] = 4
    intermediate_size: Optional[int] = None
    hidden_act: str = "swish"
    num_hidden_layers: int = 21
    norm_eps: float = 1e-6
    attn: Any = None
    use_cache: bool = True
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = 1
    eos_token_id: Union[int, list, None] = 2
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    fuse_norm: bool = True
    fuse_swiglu: bool = True
    fuse_cross_entropy: bool = True
    fuse_linear_cross_entropy: bool = False
    use_l2warp: bool = False
    vocab_size: int = 32000
    use_forget_gate: bool = False
    allow_neg_eigval: bool = False
    num_householder: int = 1
    attnres_block_size: Optional[int] = None
    extra: dict = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name in ("conv_size", "head_dim", "num_heads", "hidden_size", "num_hidden_layers",
                     "vocab_size", "num_householder"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.max_position_embeddings is not None and not _is_int(self.max_position_embeddings):
            raise ValueError(f"max_position_embeddings: expected an int or None, got "
                             f"{self.max_position_embeddings!r}")
        for name in ("hidden_ratio", "intermediate_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float))
                                      or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name}: expected a positive number or None, got {value!r}")
        if (isinstance(self.expand_v, bool) or not isinstance(self.expand_v, (int, float))
                or self.expand_v <= 0
                or not math.isclose(self.head_dim * self.expand_v,
                                    round(self.head_dim * self.expand_v), rel_tol=1e-5)):
            raise ValueError(f"expand_v: head_dim * expand_v must be a positive integer, got "
                             f"{self.head_dim} * {self.expand_v!r}")
        if self.hidden_act not in ("swish", "powlu"):
            raise ValueError(f"hidden_act: expected 'swish' or 'powlu' (fla's GatedMLP), got "
                             f"{self.hidden_act!r}")
        if self.attn_mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"attn_mode: expected 'chunk' or 'fused_recurrent', got "
                             f"{self.attn_mode!r}")
        if (isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float))
                or self.norm_eps < 0):
            raise ValueError(f"norm_eps: expected a non-negative number, got {self.norm_eps!r}")
        if self.fuse_cross_entropy and self.fuse_linear_cross_entropy:
            raise ValueError("fuse_cross_entropy and fuse_linear_cross_entropy cannot both be "
                             "True (fla's rule)")
        if self.attnres_block_size is not None:
            raise NotImplementedError(
                f"attnres_block_size={self.attnres_block_size!r}: fla's attention residuals are "
                "not implemented in gdp_jax.models (expected None)")
        for name in ("use_output_gate", "use_short_conv", "tie_word_embeddings",
                     "use_forget_gate", "allow_neg_eigval"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        self.attn = parse_attention_config(self.attn, num_hidden_layers=self.num_hidden_layers)
        for spec in self._attention_specs():
            if self.hidden_size % spec["num_heads"]:
                raise ValueError(f"attn.num_heads: must divide hidden_size={self.hidden_size}, "
                                 f"got {spec['num_heads']}")
            if (self.hidden_size // spec["num_heads"]) % 2:
                raise ValueError(f"attn.num_heads: the attention head dim hidden_size // "
                                 f"num_heads must be even (RoPE), got "
                                 f"{self.hidden_size // spec['num_heads']}")

    def __hash__(self):
        # Hashable (by value) so that a model holding its config can be a static jit argument.
        return hash(json.dumps(self.to_dict(), sort_keys=True, default=repr))

    # -- derived sizes --------------------------------------------------------------------------

    @property
    def head_v_dim(self) -> int:
        return int(round(self.head_dim * self.expand_v))

    @property
    def resolved_intermediate_size(self) -> int:
        """fla's GatedMLP: intermediate_size, else 2/3 * hidden_ratio * hidden_size rounded up to
        a multiple of 256."""
        if self.intermediate_size is not None:
            return int(self.intermediate_size)
        ratio = 4 if self.hidden_ratio is None else self.hidden_ratio
        size = int(self.hidden_size * ratio * 2 / 3)
        return 256 * ((size + 255) // 256)

    def _attention_specs(self) -> list:
        if self.attn is None:
            return []
        return [self.attn] if isinstance(self.attn, dict) else list(self.attn)

    def attention_spec(self, layer_idx: int) -> Optional[dict]:
        """The hybrid softmax-attention spec of layer ``layer_idx``, or None (GatedDeltaProduct)."""
        for spec in self._attention_specs():
            if layer_idx in spec["layers"]:
                return spec
        return None

    @property
    def eos_token_ids(self) -> tuple:
        """eos_token_id as a tuple (it may be an int, a list or None)."""
        eos = self.eos_token_id
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)

    # -- (de)serialisation ----------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list:
        return [f.name for f in dataclasses.fields(cls) if f.name != "extra"]

    @classmethod
    def from_dict(cls, config: dict) -> "GatedDeltaProductConfig":
        """A config.json's dict -> config. Missing fields take fla's defaults (Hugging Face
        omits fields equal to its own defaults); unknown keys go to ``extra``."""
        if not isinstance(config, dict):
            raise TypeError(f"config: expected a dict, got {type(config).__name__}")
        model_type = config.get("model_type", MODEL_TYPE)
        if model_type != MODEL_TYPE:
            raise ValueError(f"config: model_type {model_type!r} is not {MODEL_TYPE!r}")
        names = set(cls.field_names())
        known = {k: copy.deepcopy(v) for k, v in config.items() if k in names}
        extra = {k: copy.deepcopy(v) for k, v in config.items()
                 if k not in names and k != "model_type"}
        return cls(**known, extra=extra)

    def to_dict(self) -> dict:
        """Every field (fla's), then ``model_type`` and ``extra``'s keys (``architectures``
        defaults to fla's class name)."""
        out = {name: copy.deepcopy(getattr(self, name)) for name in self.field_names()}
        out["model_type"] = MODEL_TYPE
        out.update(copy.deepcopy(self.extra))
        out.setdefault("architectures", [ARCHITECTURE])
        return out

    @classmethod
    def from_json_file(cls, path: Union[str, os.PathLike]) -> "GatedDeltaProductConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_json_file(self, path: Union[str, os.PathLike]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
