from common import *
M = N = K = 64
ka, kb = jax.random.split(jax.random.key(0))
a = jax.random.normal(ka, (M, K), jnp.bfloat16)
b = jax.random.normal(kb, (K, N), jnp.bfloat16)
ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)

def mk(bT):
  def kern(a_gmem, b_gmem, o_gmem, a_smem, b_smem, bar):
    plgpu.copy_gmem_to_smem(a_gmem, a_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar.at[1])
    plgpu.barrier_wait(bar.at[0]); plgpu.barrier_wait(bar.at[1])
    def f(acc_ref):
      plgpu.wgmma(acc_ref, a_smem, b_smem.T if bT else b_smem)
      plgpu.wgmma(acc_ref, a_smem, b_smem.T if bT else b_smem)  # accumulate twice
      plgpu.wgmma_wait(0)
      o_gmem[...] = acc_ref[...]
    pl.run_scoped(f, plgpu.ACC((M, N), jnp.float32))
  return plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
      scratch_types=dict(a_smem=plgpu.SMEM((M, K), jnp.bfloat16, transforms=TR),
                         b_smem=plgpu.SMEM((K, N), jnp.bfloat16, transforms=TR),
                         bar=plgpu.Barrier(num_arrivals=1, num_barriers=2)),
      interpret=IP)

def p2b():  # two wgmmas accumulate, acc -> gmem directly
  return float(np.max(np.abs(np.asarray(mk(False)(a, b)) - 2*ref)))
def p2c():  # B transposed view
  return float(np.max(np.abs(np.asarray(mk(True)(a, b.T)) - 2*ref)))

def p2d():  # LHS from registers
  def kern(a_gmem, b_gmem, o_gmem, b_smem, bar):
    plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar)
    plgpu.barrier_wait(bar)
    a_regs = a_gmem[...]
    def f(acc_ref):
      plgpu.wgmma(acc_ref, a_regs, b_smem)
      o_gmem[...] = acc_ref[...]
    pl.run_scoped(f, plgpu.ACC((M, N), jnp.float32))
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
      scratch_types=dict(b_smem=plgpu.SMEM((K, N), jnp.bfloat16, transforms=TR),
                         bar=plgpu.Barrier(num_arrivals=1)), interpret=IP)
  return float(np.max(np.abs(np.asarray(k(a, b)) - ref)))

def p2e():  # sub-tile views: acc.at / a_smem.at static slices (2 x 32-row halves) + transposed smem read
  def kern(a_gmem, b_gmem, o_gmem, a_smem, b_smem, bar):
    plgpu.copy_gmem_to_smem(a_gmem, a_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar.at[1])
    plgpu.barrier_wait(bar.at[0]); plgpu.barrier_wait(bar.at[1])
    def f(acc_ref):
      plgpu.wgmma(acc_ref, a_smem.at[:, :32], b_smem.at[:32, :])
      plgpu.wgmma(acc_ref, a_smem.at[:, 32:], b_smem.at[32:, :])
      o_gmem[...] = acc_ref[...]
    pl.run_scoped(f, plgpu.ACC((M, N), jnp.float32))
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
      scratch_types=dict(a_smem=plgpu.SMEM((M, K), jnp.bfloat16, transforms=TR),
                         b_smem=plgpu.SMEM((K, N), jnp.bfloat16, transforms=TR),
                         bar=plgpu.Barrier(num_arrivals=1, num_barriers=2)), interpret=IP)
  return float(np.max(np.abs(np.asarray(k(a, b)) - ref)))

def p2f():  # transposed read of smem into registers (k.T pattern without wgmma)
  def kern(x_gmem, o_gmem, smem, bar):
    plgpu.copy_gmem_to_smem(x_gmem, smem, bar)
    plgpu.barrier_wait(bar)
    o_gmem[...] = smem.T[...].astype(jnp.float32)
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((N, K), jnp.float32),
      scratch_types=dict(smem=plgpu.SMEM((K, N), jnp.bfloat16), bar=plgpu.Barrier(num_arrivals=1)), interpret=IP)
  return float(np.max(np.abs(np.asarray(k(b)) - np.asarray(b, np.float32).T)))

import sys
for n in sys.argv[1:]:
  run_probe(n, globals()[n])
