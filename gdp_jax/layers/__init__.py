"""Flax NNX layers around gdp_jax's ops (need ``flax``; ``import gdp_jax`` does not)."""
from gdp_jax.layers.gated_delta_product import GatedDeltaProduct, GDPCache
from gdp_jax.layers.short_conv import ShortConvolution

__all__ = ["GDPCache", "GatedDeltaProduct", "ShortConvolution"]
