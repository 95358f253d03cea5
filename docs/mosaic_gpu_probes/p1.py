from common import *

def probe_kernel():
  x = jnp.arange(128*64, dtype=jnp.float32).reshape(128, 64)
  @functools.partial(plgpu.kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=dict(smem=plgpu.SMEM(x.shape, x.dtype), bar=plgpu.Barrier(num_arrivals=1)),
      interpret=IP)
  def k(x_gmem, o_gmem, smem, bar):
    plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
    plgpu.barrier_wait(bar)
    smem[...] = smem[...] * 2.0 + 1.0
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)
  y = k(x)
  return float(np.max(np.abs(np.asarray(y) - (np.asarray(x)*2+1))))

def probe_pallas_call():
  x = jnp.arange(128*64, dtype=jnp.float32).reshape(128, 64)
  def body(x_gmem, o_gmem):
    def scoped(smem, bar):
      plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
      plgpu.barrier_wait(bar)
      smem[...] = jnp.exp(smem[...] * 1e-4)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(smem, o_gmem)
      plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(scoped, plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier(num_arrivals=1))
  y = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      in_specs=[pl.BlockSpec(memory_space=plgpu.GMEM)],
      out_specs=pl.BlockSpec(memory_space=plgpu.GMEM), interpret=IP)(x)
  return float(np.max(np.abs(np.asarray(y) - np.exp(np.asarray(x)*1e-4))))

run_probe("p1a plgpu.kernel elementwise", probe_kernel)
run_probe("p1b pallas_call GMEM elementwise", probe_pallas_call)
