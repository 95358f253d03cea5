"""Where a GatedDeltaProduct LM's prefill spends its GPU time: kernels by time, from a profiler trace.

    PYTHONPATH=. python benchmarks/profile_lm_prefill.py [--batches 16 128] [--prompt 512] [--layers 12]

The model is common.LM_CONFIG, bench_generate.py's ~156M config (random init, bf16, Pallas);
``model.prefill`` is jitted alone, without generate's sampling. Per batch it prints the prefill's
time (common.time_jax), the summed GPU kernel time and the top kernels (ms per call, launches per
call, name). No fla needed.
"""
import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import LM_CONFIG, time_jax  # noqa: E402
from profile_gpu import traced_kernel_times  # noqa: E402

from gdp_jax.models import GatedDeltaProductConfig, GatedDeltaProductForCausalLM  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 128])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--layers", type=int, default=LM_CONFIG["num_hidden_layers"])
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    config = GatedDeltaProductConfig(**dict(LM_CONFIG, num_hidden_layers=args.layers))
    model = GatedDeltaProductForCausalLM(config, dtype=jnp.bfloat16,
                                         param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, ids):
        return nnx.merge(graphdef, state).prefill(ids)[0]

    for batch in args.batches:
        ids = jnp.asarray(np.random.default_rng(0).integers(3, LM_CONFIG["vocab_size"],
                                                            (batch, args.prompt)), jnp.int32)
        ms, info = time_jax(prefill, [(state, ids)], target_s=0.5, reps=3, max_iters=50)
        print(f"B={batch}: first call {info['first_call_s']:.1f} s", flush=True)
        with tempfile.TemporaryDirectory() as trace_dir:
            rows = traced_kernel_times(prefill, (state, ids), 3, trace_dir) or []
        print(f"B={batch}: prefill {ms:.2f} ms, GPU kernels {sum(r[1] for r in rows):.2f} ms")
        for name, kernel_ms, launches in rows[:args.top]:
            print(f"{kernel_ms:9.3f} {launches:4d}  {name[:100]}")


if __name__ == "__main__":
    main()
