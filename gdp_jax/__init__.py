"""gdp_jax: Gated DeltaProduct linear-attention kernels for JAX (Pallas/Triton on GPU, jnp elsewhere)."""
from gdp_jax import reference
from gdp_jax._src.segments import segment_runs
from gdp_jax.ops.chunk_o import chunk_gdp_fwd_o
from gdp_jax.ops.decode import recurrent_gdp_step
from gdp_jax.ops.gated_delta_product import chunk_gated_delta_product
from gdp_jax.sharding import sharded_chunk_gated_delta_product, sharded_chunk_gdp_fwd_o

__all__ = ["chunk_gated_delta_product", "chunk_gdp_fwd_o", "recurrent_gdp_step", "reference",
           "segment_runs", "sharded_chunk_gated_delta_product", "sharded_chunk_gdp_fwd_o"]
__version__ = "0.1.0"
