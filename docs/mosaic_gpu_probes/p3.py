from common import *
T = 64; G = 4; KT = 4  # grid of G row tiles; K loop of KT chunks
M, K, N = G*T, KT*T, T
ka, kb = jax.random.split(jax.random.key(0))
a = jax.random.normal(ka, (M, K), jnp.bfloat16)
b = jax.random.normal(kb, (K, N), jnp.bfloat16)
ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)

def body(i, a_gmem, b_gmem, o_gmem, a_smem, b_smem, o_smem, bar):
  def acc_scope(acc):
    def step(kk, carry):
      plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(i*T, T), pl.ds(kk*T, T)], a_smem, bar.at[0])
      plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(kk*T, T), :], b_smem, bar.at[1])
      plgpu.barrier_wait(bar.at[0]); plgpu.barrier_wait(bar.at[1])
      plgpu.wgmma(acc, a_smem, b_smem)
      plgpu.wgmma_wait(0)
      return carry
    lax.fori_loop(0, KT, step, None)
    o_smem[...] = acc[...]
  pl.run_scoped(acc_scope, plgpu.ACC((T, N), jnp.float32))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(i*T, T)])
  plgpu.wait_smem_to_gmem(0)

scratch = dict(a_smem=plgpu.SMEM((T, T), jnp.bfloat16, transforms=TR),
               b_smem=plgpu.SMEM((T, N), jnp.bfloat16, transforms=TR),
               o_smem=plgpu.SMEM((T, N), jnp.float32),
               bar=plgpu.Barrier(num_arrivals=1, num_barriers=2))

def p3a():  # plgpu.kernel grid + axis_index
  def kern(*refs, **kw):
    body(lax.axis_index("g"), *refs, **kw)
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
                   grid=(G,), grid_names=("g",), scratch_types=scratch, interpret=IP)
  return float(np.max(np.abs(np.asarray(k(a, b)) - ref)))

def p3b():  # pallas_call grid + program_id, GMEM specs
  def kern(a_gmem, b_gmem, o_gmem):
    pl.run_scoped(functools.partial(body, pl.program_id(0), a_gmem, b_gmem, o_gmem), **scratch)
  gm = pl.BlockSpec(memory_space=plgpu.GMEM)
  k = pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32), grid=(G,),
                     in_specs=[gm, gm], out_specs=gm, interpret=IP)
  return float(np.max(np.abs(np.asarray(k(a, b)) - ref)))

def p3c():  # 2-D grid via plgpu.kernel
  def kern(a_gmem, b_gmem, o_gmem, a_smem, b_smem, o_smem, bar):
    i = lax.axis_index("x") * 2 + lax.axis_index("y")
    body(i, a_gmem, b_gmem, o_gmem, a_smem, b_smem, o_smem, bar)
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
                   grid=(2, 2), grid_names=("x", "y"), scratch_types=scratch, interpret=IP)
  return float(np.max(np.abs(np.asarray(k(a, b)) - ref)))

def p3d():  # dynamic (loop-index) slicing of an SMEM ref on load/store (not via copy)
  x = jnp.arange(64*64, dtype=jnp.float32).reshape(64, 64)
  def kern(x_gmem, o_gmem, smem, bar):
    plgpu.copy_gmem_to_smem(x_gmem, smem, bar); plgpu.barrier_wait(bar)
    def step(j, c):
      smem[pl.ds(j*8, 8), :] = smem[pl.ds(j*8, 8), :] * 2.0
      return c
    lax.fori_loop(0, 8, step, None)
    plgpu.commit_smem(); plgpu.copy_smem_to_gmem(smem, o_gmem); plgpu.wait_smem_to_gmem(0)
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=dict(smem=plgpu.SMEM(x.shape, x.dtype), bar=plgpu.Barrier(num_arrivals=1)), interpret=IP)
  return float(np.max(np.abs(np.asarray(k(x)) - 2*np.asarray(x))))

def p3e():  # dynamic index into a stacked SMEM buffer (slot = j % 2) + python-unrolled static slices
  x = jnp.arange(64*64, dtype=jnp.float32).reshape(64, 64)
  def kern(x_gmem, o_gmem, smem, bar):
    def step(j, c):
      slot = j % 2
      plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(j*8, 8)], smem.at[slot], bar.at[slot])
      plgpu.barrier_wait(bar.at[slot])
      v = smem[slot] * 3.0
      o_gmem[pl.ds(j*8, 8)] = v
      return c
    lax.fori_loop(0, 8, step, None)
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
      scratch_types=dict(smem=plgpu.SMEM((2, 8, 64), x.dtype), bar=plgpu.Barrier(num_arrivals=1, num_barriers=2)), interpret=IP)
  return float(np.max(np.abs(np.asarray(k(x)) - 3*np.asarray(x))))

import sys

for n in (sys.argv[1:] if __name__ == "__main__" else []):
  run_probe(n, globals()[n])
