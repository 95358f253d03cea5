"""Where a GatedDeltaProduct LM's prefill spends its GPU time: kernels by time, from a profiler trace.

    PYTHONPATH=. python benchmarks/profile_lm_prefill.py [--batches 16 128] [--prompt 512] [--layers 12]

The model is bench_generate.py's ~156M config (random init, bf16, Pallas); ``model.prefill`` is
jitted alone, without generate's sampling. Per batch it prints the median prefill time of 5
calls, the summed GPU kernel time and the top kernels (ms per call, launches per call, name).
No fla needed.
"""
import argparse
import glob
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_gpu import gpu_kernel_times  # noqa: E402

from gdp_jax.models import GatedDeltaProductConfig, GatedDeltaProductForCausalLM  # noqa: E402

# bench_generate.py's CONFIG
CONFIG = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_heads=6,
              head_dim=128, expand_v=1.0, num_householder=2, use_forget_gate=True,
              allow_neg_eigval=True, use_short_conv=True, conv_size=4, use_output_gate=True,
              hidden_ratio=4, norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 128])
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(argv)
    config = GatedDeltaProductConfig(**{**CONFIG, "num_hidden_layers": args.layers})
    model = GatedDeltaProductForCausalLM(config, dtype=jnp.bfloat16,
                                         param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, ids):
        return nnx.merge(graphdef, state).prefill(ids)[0]

    for batch in args.batches:
        ids = jnp.asarray(np.random.default_rng(0).integers(3, CONFIG["vocab_size"],
                                                            (batch, args.prompt)), jnp.int32)
        t = time.time()
        prefill(state, ids).block_until_ready()
        print(f"B={batch}: first call {time.time() - t:.1f} s", flush=True)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            prefill(state, ids).block_until_ready()
            times.append(time.perf_counter() - t)
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for _ in range(3):
                    prefill(state, ids).block_until_ready()
            trace = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                                     recursive=True))[-1]
            rows = gpu_kernel_times(trace, 3)
        print(f"B={batch}: prefill {1e3 * np.median(times):.2f} ms (median of 5), GPU kernels "
              f"{sum(r[1] for r in rows):.2f} ms")
        for name, ms, launches in rows[:args.top]:
            print(f"{ms:9.3f} {launches:4d}  {name[:100]}")


if __name__ == "__main__":
    main()
