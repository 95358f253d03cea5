from common import *
def mk(variant):
  def kern(o_gmem):
    if variant == "plgpu_iota_nolayout":
      r = plgpu.broadcasted_iota(jnp.int32, (64, 64), 0)
    else:
      r = lax.broadcasted_iota(jnp.int32, (64, 64), 0)
    c = lax.broadcasted_iota(jnp.int32, (64, 64), 1)
    mask = (r >= c).astype(jnp.float32)
    if variant == "layout_cast":
      mask = plgpu.layout_cast(mask, plgpu.Layout.WGMMA)
    s = lax.fori_loop(0, 3, lambda i, s: s * 0.5 + mask, jnp.zeros((64, 64), jnp.float32))
    o_gmem[...] = s
    @pl.when(lax.axis_index("g") == 0)
    def _():
      o_gmem[0:8, :] = jnp.full((8, 64), -1.0, jnp.float32)
  k = plgpu.kernel(kern, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32), grid=(1,), grid_names=("g",), interpret=IP)
  m = np.tril(np.ones((64, 64), np.float32)); exp = m * 1.75; exp[:8] = -1
  return lambda: float(np.max(np.abs(np.asarray(k()) - exp)))
import sys
run_probe("p7 " + sys.argv[1], mk(sys.argv[1]))
