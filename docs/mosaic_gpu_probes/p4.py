from common import *

def p4a():  # emit_pipeline elementwise over 4 column blocks
  x = jnp.arange(64*256, dtype=jnp.float32).reshape(64, 256)
  def body(_, x_smem, o_smem):
    o_smem[...] = x_smem[...] + 1.0
  def kern(x_gmem, o_gmem):
    plgpu.emit_pipeline(body, grid=(4,),
        in_specs=[pl.BlockSpec((64, 64), lambda i: (0, i))],
        out_specs=[pl.BlockSpec((64, 64), lambda i: (0, i))],
        max_concurrent_steps=2)(x_gmem, o_gmem)
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=IP)
  return float(np.max(np.abs(np.asarray(k(x)) - (np.asarray(x) + 1))))

def p4b():  # emit_pipeline K-loop matmul with wgmma into ACC (carry-free), swizzled plgpu.BlockSpec
  M, K, N = 64, 256, 64
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, (M, K), jnp.bfloat16); b = jax.random.normal(kb, (K, N), jnp.bfloat16)
  def kern(a_gmem, b_gmem, o_gmem):
    def acc_scope(acc):
      def body(_, a_smem, b_smem):
        plgpu.wgmma(acc, a_smem, b_smem)
        plgpu.wgmma_wait(0)
      plgpu.emit_pipeline(body, grid=(K // 64,),
          in_specs=[plgpu.BlockSpec((M, 64), lambda k: (0, k), transforms=TR),
                    plgpu.BlockSpec((64, N), lambda k: (k, 0), transforms=TR)],
          max_concurrent_steps=2)(a_gmem, b_gmem)
      o_gmem[...] = acc[...]
    pl.run_scoped(acc_scope, plgpu.ACC((M, N), jnp.float32))
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((M, N), jnp.float32), interpret=IP)
  ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  return float(np.max(np.abs(np.asarray(k(a, b)) - ref)))

def p4c():  # jax's own hopper_matmul_mgpu example (warp-specialized pipeline, 3 threads, cluster)
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  from jax._src.pallas.mosaic_gpu.interpret.params import force_gpu_interpret_mode
  m = n = k = 256
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  a = jax.random.uniform(k1, (m, k), jnp.float16); b = jax.random.uniform(k2, (k, n), jnp.float16)
  c = jax.random.uniform(k3, (m, n), jnp.float32)
  spec = hm.TuningConfig(tile_m=64, tile_n=64, tile_k=64, max_concurrent_steps=2,
      epi_tile_m=64, epi_tile_n=64, wg_dimension=hm.MatmulDimension.M)
  dev = jax.sharding.AbstractDevice(device_kind='NVIDIA H100 80GB HBM3', platform='gpu', num_cores=2)
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)), \
       force_gpu_interpret_mode(IP):
    res = hm.matmul(a, b, c, spec).block_until_ready()
  exp = np.asarray(a, np.float32) @ np.asarray(b, np.float32) + np.asarray(c)
  return float(np.max(np.abs(np.asarray(res) - exp)))

import sys
for n in sys.argv[1:]:
  run_probe(n, globals()[n])
