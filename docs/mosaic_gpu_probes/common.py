import time, functools, sys, traceback
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mgi
IP = InterpretGPUParams()

def run_probe(name, fn):
  t0 = time.perf_counter()
  try:
    err = fn()
    print(f"[{name}] PASS max_abs_err={err:.3g} wall={time.perf_counter()-t0:.2f}s", flush=True)
  except Exception as e:
    print(f"[{name}] FAIL wall={time.perf_counter()-t0:.2f}s {type(e).__name__}: {str(e)[:1500]}", flush=True)
    traceback.print_exc()
    mgi.reset_gpu_interpret_mode_state()

# SMEM tiles of 64 bf16 columns (128 bytes): 8-row tiling and 128-byte swizzle, as jax's examples
SW = 128; SWE = SW // 2
TR = (plgpu.TilingTransform((8, SWE)), plgpu.SwizzleTransform(SW))
