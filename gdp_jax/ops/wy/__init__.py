"""Stage 2: the WY (UT) representation of each chunk, w and u with v_new = u - w h.

``xla`` (jnp, any backend; its docstring derives the system), ``pallas_fwd`` (the kernel on
sub-chunks of at most 64 positions) and ``pallas_bwd`` (its exact VJP).
"""
from gdp_jax.ops.wy.pallas_bwd import wy_bwd_pallas
from gdp_jax.ops.wy.pallas_fwd import wy_pallas
from gdp_jax.ops.wy.xla import unit_lower_inverse, wy_bwd_xla, wy_xla

__all__ = ["unit_lower_inverse", "wy_bwd_pallas", "wy_bwd_xla", "wy_pallas", "wy_xla"]
