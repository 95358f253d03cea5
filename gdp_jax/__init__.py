"""gdp_jax: Gated DeltaProduct linear-attention kernels for JAX (Pallas/Triton on GPU, jnp elsewhere)."""
from gdp_jax import reference
from gdp_jax.chunk_o import chunk_gdp_fwd_o
from gdp_jax.segments import segment_runs
from gdp_jax.sharding import sharded_chunk_gdp_fwd_o

__all__ = ["chunk_gdp_fwd_o", "reference", "segment_runs", "sharded_chunk_gdp_fwd_o"]
__version__ = "0.1.0"
