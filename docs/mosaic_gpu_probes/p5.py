from common import *
M = N = K = 64

def _mm_kernel(a_gmem, b_gmem, o_gmem, a_smem, b_smem, bar):
  plgpu.copy_gmem_to_smem(a_gmem, a_smem, bar.at[0])
  plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar.at[1])
  plgpu.barrier_wait(bar.at[0]); plgpu.barrier_wait(bar.at[1])
  def f(acc):
    plgpu.wgmma(acc, a_smem, b_smem)
    plgpu.wgmma_wait(0)
    o_gmem[...] = acc[...]
  pl.run_scoped(f, plgpu.ACC((M, N), jnp.float32))

def mm(a, b):  # bf16 (64,64) @ (64,64) -> f32
  return plgpu.kernel(_mm_kernel, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
      scratch_types=dict(a_smem=plgpu.SMEM((M, K), jnp.bfloat16, transforms=TR),
                         b_smem=plgpu.SMEM((K, N), jnp.bfloat16, transforms=TR),
                         bar=plgpu.Barrier(num_arrivals=1, num_barriers=2)),
      interpret=IP)(a, b)

@jax.custom_vjp
def matmul(a, b):
  return mm(a, b)
def fwd(a, b):
  return mm(a, b), (a, b)
def bwd(res, g):
  a, b = res
  g = g.astype(jnp.bfloat16)
  return mm(g, b.T).astype(a.dtype), mm(a.T, g).astype(b.dtype)  # transposes done in XLA
matmul.defvjp(fwd, bwd)

ka, kb, kg = jax.random.split(jax.random.key(0), 3)
a = jax.random.normal(ka, (M, K), jnp.bfloat16); b = jax.random.normal(kb, (K, N), jnp.bfloat16)
g = jax.random.normal(kg, (M, N), jnp.float32)

def ref_f(a, b):
  return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))

def p5a():  # jit
  y = jax.jit(matmul)(a, b)
  return float(np.max(np.abs(np.asarray(y) - np.asarray(ref_f(a, b)))))

def p5b():  # jax.vjp (eager) + jit(vjp)
  y, vjp = jax.vjp(matmul, a, b)
  da, db = vjp(g)
  y_r, vjp_r = jax.vjp(ref_f, a, b); da_r, db_r = vjp_r(g)
  e1 = max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(r, np.float32)))) for x, r in [(da, da_r), (db, db_r)])
  @jax.jit
  def f(a, b, g):
    y, vjp = jax.vjp(matmul, a, b); return (y,) + vjp(g)
  y2, da2, db2 = f(a, b, g)
  e2 = max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(r, np.float32)))) for x, r in [(y2, y_r), (da2, da_r), (db2, db_r)])
  print("  rel scale |da_r|max", float(np.max(np.abs(np.asarray(da_r, np.float32)))), "eager err", e1, "jit err", e2)
  return max(e1, e2)

def p5c():  # jit(grad(loss)) calling kernel 3x, called twice (re-execution)
  loss = jax.jit(jax.grad(lambda a, b: jnp.sum(matmul(a, b) ** 2), argnums=(0, 1)))
  ra, rb = jax.grad(lambda a, b: jnp.sum(ref_f(a, b) ** 2), argnums=(0, 1))(a, b)
  errs = []
  for _ in range(2):
    da, db = loss(a, b)
    errs.append(float(np.max(np.abs(np.asarray(da, np.float32) - np.asarray(ra, np.float32)))) / float(np.max(np.abs(np.asarray(ra, np.float32)))))
  print("  relative errs (bf16 grads)", errs)
  return max(errs)

import sys

for n in (sys.argv[1:] if __name__ == "__main__" else []):
  run_probe(n, globals()[n])
