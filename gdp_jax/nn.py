"""``gdp_jax.nn``: the Flax NNX layers, kept under this name; they live in ``gdp_jax.layers``."""
from gdp_jax.layers import GatedDeltaProduct, GDPCache, ShortConvolution

__all__ = ["GDPCache", "GatedDeltaProduct", "ShortConvolution"]
