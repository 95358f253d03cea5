from common import *
from p5 import mm, matmul, a, b, ref_f, TR, M, N, K
import p3

def p6a():  # vmap over the kernel
  A = jnp.stack([a, a*2]); B = jnp.stack([b, b])
  y = jax.vmap(mm)(A, B)
  r = jax.vmap(ref_f)(A, B)
  return float(np.max(np.abs(np.asarray(y) - np.asarray(r))))

def p6b():  # plgpu.broadcasted_iota + lax.broadcasted_iota + pl.when + fori carry of register arrays
  def kern(o_gmem):
    r = plgpu.broadcasted_iota(jnp.int32, (64, 64), 0, layout=plgpu.Layout.WGMMA)
    c = lax.broadcasted_iota(jnp.int32, (64, 64), 1)
    mask = (r >= c).astype(jnp.float32)
    def step(i, s):
      return s * 0.5 + mask
    s = lax.fori_loop(0, 3, step, jnp.zeros((64, 64), jnp.float32))
    o_gmem[...] = s
    @pl.when(lax.axis_index("g") == 0)
    def _():
      o_gmem[0:8, :] = jnp.full((8, 64), -1.0, jnp.float32)
  # grid of 1 just to get an axis name
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32), grid=(1,), grid_names=("g",), interpret=IP)
  m = np.tril(np.ones((64, 64), np.float32)); exp = m * (1 + 0.5 + 0.25); exp[:8] = -1
  return float(np.max(np.abs(np.asarray(k()) - exp)))

def p6c():  # 2 warpgroups (num_threads=2), each computes one 64-row half with its own wgmma
  M2 = 128
  a2 = jnp.concatenate([a, a * 3]); 
  def kern(a_gmem, b_gmem, o_gmem, a_smem, b_smem, bar):
    wg = lax.axis_index("wg")
    plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(wg*64, 64)], a_smem.at[wg], bar.at[wg])
    plgpu.barrier_wait(bar.at[wg])
    plgpu.copy_gmem_to_smem(b_gmem, b_smem.at[wg], bar.at[2 + wg])
    plgpu.barrier_wait(bar.at[2 + wg])
    def f(acc):
      plgpu.wgmma(acc, a_smem.at[wg], b_smem.at[wg]); plgpu.wgmma_wait(0)
      o_gmem[pl.ds(wg*64, 64)] = acc[...]
    pl.run_scoped(f, plgpu.ACC((64, N), jnp.float32))
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((M2, N), jnp.float32),
      num_threads=2, thread_name="wg",
      scratch_types=dict(a_smem=plgpu.SMEM((2, 64, K), jnp.bfloat16, transforms=TR),
                         b_smem=plgpu.SMEM((2, K, N), jnp.bfloat16, transforms=TR),
                         bar=plgpu.Barrier(num_arrivals=1, num_barriers=4)), interpret=IP)
  r = np.asarray(a2, np.float32) @ np.asarray(b, np.float32)
  return float(np.max(np.abs(np.asarray(k(a2, b)) - r)))

def p6d():  # cold vs warm timing for a bigger grid/loop: G=4 programs x KT=16 K-steps
  import importlib
  T = 64; G = 4; KT = 16
  Mx, Kx = G*T, KT*T
  ka, kb = jax.random.split(jax.random.key(3))
  A = jax.random.normal(ka, (Mx, Kx), jnp.bfloat16); B = jax.random.normal(kb, (Kx, T), jnp.bfloat16)
  p3.T, p3.KT = T, KT
  def kern(*refs, **kw): p3.body(lax.axis_index("g"), *refs, **kw)
  k = jax.jit(plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((Mx, T), jnp.float32),
                   grid=(G,), grid_names=("g",), scratch_types=p3.scratch, interpret=IP))
  t0 = time.perf_counter(); y = k(A, B).block_until_ready(); t1 = time.perf_counter()
  y = k(A, B).block_until_ready(); t2 = time.perf_counter()
  print(f"  G={G} KT={KT} (64 wgmma steps): cold {t1-t0:.2f}s warm {t2-t1:.2f}s")
  r = np.asarray(A, np.float32) @ np.asarray(B, np.float32)
  return float(np.max(np.abs(np.asarray(y) - r)))

def p6e():  # detect_races=True on the grid matmul
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  def kern(*refs, **kw): p3.body(lax.axis_index("g"), *refs, **kw)
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((p3.M, p3.N), jnp.float32),
                   grid=(p3.G,), grid_names=("g",), scratch_types=p3.scratch,
                   interpret=InterpretGPUParams(detect_races=True))
  y = k(p3.a, p3.b)
  print("  races_found:", mgi.get_races().races_found)
  return float(np.max(np.abs(np.asarray(y) - p3.ref)))

import sys
for n in sys.argv[1:]:
  run_probe(n, globals()[n])
