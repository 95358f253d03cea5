from common import *
M = N = K = 64

def matmul_kernel(a_gmem, b_gmem, o_gmem, a_smem, b_smem, o_smem, bar):
  plgpu.copy_gmem_to_smem(a_gmem, a_smem, bar.at[0])
  plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar.at[1])
  plgpu.barrier_wait(bar.at[0]); plgpu.barrier_wait(bar.at[1])
  def acc_scope(acc):
    plgpu.wgmma(acc, a_smem, b_smem)
    plgpu.wgmma_wait(0)
    o_smem[...] = acc[...]
  pl.run_scoped(acc_scope, plgpu.ACC((M, N), jnp.float32))
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_smem, o_gmem)
  plgpu.wait_smem_to_gmem(0)

mm = plgpu.kernel(matmul_kernel, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
    scratch_types=dict(
        a_smem=plgpu.SMEM((M, K), jnp.bfloat16, transforms=TR),
        b_smem=plgpu.SMEM((K, N), jnp.bfloat16, transforms=TR),
        o_smem=plgpu.SMEM((M, N), jnp.float32),
        bar=plgpu.Barrier(num_arrivals=1, num_barriers=2)),
    interpret=IP)

ka, kb = jax.random.split(jax.random.key(0))
a = jax.random.normal(ka, (M, K), jnp.bfloat16)
b = jax.random.normal(kb, (K, N), jnp.bfloat16)
ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)

def p2a():
  return float(np.max(np.abs(np.asarray(mm(a, b)) - ref)))

# variant: B transposed (a @ bt.T) via b_smem.T, accumulate twice into ACC initialized, no transforms
def p2b():
  bt = b.T
  def kern(a_gmem, bt_gmem, o_gmem, a_smem, b_smem, bar):
    plgpu.copy_gmem_to_smem(a_gmem, a_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(bt_gmem, b_smem, bar.at[1])
    plgpu.barrier_wait(bar.at[0]); plgpu.barrier_wait(bar.at[1])
    acc = plgpu.ACC.init(jnp.ones((M, N), jnp.float32))
    def f(acc_ref):
      plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
      plgpu.wgmma(acc_ref, a_smem, b_smem.T)
    acc = pl.run_state(f)(acc)
    o_gmem[...] = acc[...]
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
      scratch_types=dict(a_smem=plgpu.SMEM((M, K), jnp.bfloat16, transforms=TR),
                         b_smem=plgpu.SMEM((N, K), jnp.bfloat16, transforms=TR),
                         bar=plgpu.Barrier(num_arrivals=1, num_barriers=2)),
      interpret=IP)
  return float(np.max(np.abs(np.asarray(k(a, bt)) - (1 + 2*ref))))

# variant: register operand LHS (a from registers) - wgmma with a value lhs
def p2c():
  def kern(a_gmem, b_gmem, o_gmem, b_smem, bar):
    plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar)
    plgpu.barrier_wait(bar)
    a_regs = plgpu.load(a_gmem, (), layout=plgpu.Layout.WGMMA) if False else a_gmem[...]
    def f(acc_ref):
      plgpu.wgmma(acc_ref, a_regs, b_smem)
    acc = pl.run_state(f)(plgpu.ACC.init(jnp.zeros((M, N), jnp.float32)))
    o_gmem[...] = acc[...]
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
      scratch_types=dict(b_smem=plgpu.SMEM((K, N), jnp.bfloat16, transforms=TR),
                         bar=plgpu.Barrier(num_arrivals=1)),
      interpret=IP)
  return float(np.max(np.abs(np.asarray(k(a, b)) - ref)))

run_probe("p2a wgmma bf16 64x64x64 swizzle128", p2a)
run_probe("p2b wgmma B^T + ACC.init + run_state", p2b)
run_probe("p2c wgmma lhs from registers", p2c)
