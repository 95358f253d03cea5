#!/usr/bin/env python3
"""Sweep or A/B the launch configs (BlockSizes) of one Pallas kernel stage, time-bounded, on the GPU.

    PYTHONPATH=. python benchmarks/tune.py --stage chunk_o_fwd                       # built-in sweep
    PYTHONPATH=. python benchmarks/tune.py --stage chunk_o_fwd --shapes "B=2,T=16384,H=16,K=256,V=256,M=2" \\
        --configs "s5:num_stages=5;vb2:block_v=128,value_blocks_per_program=2,prefetch_values=False" --rounds 3
    PYTHONPATH=. python benchmarks/tune.py --stage chunk_o_bwd --configs "fused:split=False,num_warps=8"
    PYTHONPATH=. python benchmarks/tune.py --stage walk --list                       # the sweep, no run
    PYTHONPATH=. python benchmarks/tune.py --stage wy --shapes tiny --configs "w4:num_warps=4"  # CPU logic check

Stages (each kernel as the op calls it, on inputs from common.make_problems; ``--list`` prints a
stage's BlockSizes fields, default and sweep):
  chunk_o_fwd  ops.chunk_o.pallas_fwd.chunk_o_fwd_pallas (q, k, v, h, g, runs)
  chunk_o_fwd_mosaic  ops.chunk_o.mosaic_fwd.chunk_o_fwd_mosaic (the same operands; 16-bit,
               --chunk 64; interpreted by Mosaic GPU's interpreter on a CPU)
  chunk_o_bwd  ops.chunk_o.pallas_bwd.chunk_o_bwd_pallas (q, k, v, h, g, runs, do)
  chunk_o_bwd_mosaic  ops.chunk_o.mosaic_bwd.chunk_o_bwd_mosaic (the same operands, as
               chunk_o_fwd_mosaic takes them)
  wy           ops.wy.pallas_fwd.wy_pallas on the full op's sub-chunk grid
  walk         ops.chunk_h.pallas_fwd.chunk_h_pallas on it (w, u from the default WY kernel)
  wy_t         the WY kernel writing T alone (w_and_u=False), as the op's 16-bit forward calls it
  wy_t_l2norm  the same normalising the keys (normalize_keys), as use_qk_l2norm's fused forward does
  walk_t       the walk applying that T itself (inverse=, beta=)
  walk_bwd     ops.chunk_h.pallas_bwd.chunk_h_bwd_pallas (reverse walk + epilogue; the forward's
               residuals from ops.gated_delta_product.states_pallas, random cotangents)
  wy_bwd       ops.wy.pallas_bwd.wy_bwd_pallas (the forward's inverses, random cotangents and the
               other dk shares, as the op adds them)

A config is ``name:field=value,...`` (``name:`` optional), fields of that stage's BlockSizes,
applied as dataclasses.replace(default_block_sizes(...), **fields); values are ints, True/False,
None, floats or strings. A few stages also take kernel options that are not launch sizes (walk:
dot_dtype, every_chunk_too; walk_t: the same; walk_bwd: dot_dtype; wy_bwd: operand_dtype, precision,
rhs_cotangents), given the same way; e.g. ``--stage walk --configs "one:every_chunk_too=1,num_stages=1;two:every_chunk_too=1,num_stages=2"``
times the walk of the backward's forward with one and two stages (its fields override that
walk's own default, ``every_chunk_too=True`` in the launch table). The default always
runs first. Each config: jit, run on input set 0 and compare every output with the default's
(largest relative Frobenius difference; over --max-err or non-finite marks it BAD), then time it.
``--rounds N`` alternates the configs within this process for N rounds (A/B: the same kernel
times up to 4 % apart between processes and cards, more than most config differences), each round
timing every config once in turn; the table has the median, min and max over rounds. SM clock and
power cap per config from nvidia-smi. --budget-s bounds the whole run: a config, a round or a
shape is started only if the slowest config so far still fits. The table is printed last, JSON
at --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import time
import traceback


from common import (HEADLINE_SHAPE, SHAPE_SETS, HEADLINE, GpuMonitor, JaxRunner, Phases,
                    estimate_call_s, pick_n,
                    add_dtype_arg, add_timing_args, copy_bandwidth, floor_ms, fmt, log,
                    make_problems, nbytes, on_cpu, parse_shapes, print_table, relative_errors,
                    run_meta, shape_label, shape_sets_epilog, short_exc, sub_grid_inputs,
                    tile_width, timing_kwargs, write_json)

SETS = {"default": HEADLINE, **SHAPE_SETS}


# ------------------------------------------------------------------------------------------ configs
def parse_value(text: str):
    text = text.strip()
    if text in ("None", "none"):
        return None
    if text in ("True", "true", "False", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_configs(text: str) -> dict:
    """'a:x=1,y=True;z=2' -> {'a': {'x': 1, 'y': True}, 'z=2': {'z': 2}} (a config without a name
    is named by its text)."""
    configs = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, body = part.partition(":")
        if not sep:
            name, body = part, part
        fields = {}
        for item in filter(None, (s.strip() for s in body.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise SystemExit(f"config {part!r}: {item!r} is not field=value")
            fields[key.strip()] = parse_value(value)
        if not fields:
            raise SystemExit(f"config {part!r} sets no field")
        configs[name.strip() or body] = fields
    return configs


def describe(overrides: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in overrides.items()) or "-"


# ------------------------------------------------------------------------------------------ stages
class Stage:
    """One kernel: ``inputs(problems)`` -> operand sets, ``default(shape, p)`` -> BlockSizes,
    ``call(sizes, options, shape, p, interpret)`` -> a function of the operands, ``sweep`` ->
    override dicts, ``options``: kernel keyword arguments that are not BlockSizes fields."""
    op = "full"
    options: dict = {}

    def sweep(self, shape, default):
        return []

    def check(self, sizes, shape):
        """Raises ValueError where ``sizes`` do not tile the shape."""
        if hasattr(sizes, "check"):
            sizes.check(shape["K"], shape["V"])


def _tile_widths(shape):
    return all(n >= 16 and not n & (n - 1) for n in (shape["K"], shape["V"]))


class ChunkOFwd(Stage):
    op = "chunk_o"

    def inputs(self, problems):
        if not _tile_widths(problems[0].shape):
            raise ValueError("chunk_o stages take K and V powers of two >= 16 (the op pads them)")
        return [(p.q, p.k, p.v, p.h, p.g, p.runs) for p in problems]

    def default(self, shape, p):
        from gdp_jax.ops.chunk_o import pallas_fwd
        itemsize = max(p.q.dtype.itemsize, p.h.dtype.itemsize)
        return pallas_fwd.default_block_sizes(shape["K"], shape["V"], p.chunk_size, shape["M"], itemsize)

    def call(self, sizes, options, shape, p, interpret):
        from gdp_jax.ops.chunk_o.pallas_fwd import chunk_o_fwd_pallas
        kw = dict(scale=shape["K"] ** -0.5, chunk_size=p.chunk_size, num_householder=shape["M"])
        return lambda q, k, v, h, g, runs: chunk_o_fwd_pallas(
            q, k, v, h, g, runs, interpret=interpret, block_sizes=sizes, **kw)

    def sweep(self, shape, default):
        K, V = shape["K"], shape["V"]
        out = []
        add = out.append
        no_key_loop = dict(block_k=None, value_step=None, prefetch_values=False)
        if K >= 128:   # the K loop at its step widths and pipeline depths, and without it
            for block_k in (32, 64):
                for stages in (2, 3, 4, 5):
                    add(dict(block_k=block_k, num_stages=stages))
            for step in (32, 64):
                for block_k in (32, 64):
                    add(dict(block_k=block_k, value_step=step, num_stages=2, prefetch_values=False))
            add(dict(prefetch_values=not default.prefetch_values, value_step=None,
                     value_blocks_per_program=1))
            add(dict(no_key_loop, num_stages=2))
            add(dict(no_key_loop, num_stages=2, copy_order="fused"))
        else:          # pipelining over chunks fits shared memory only for narrow tiles
            for cpp in (1, 2, 4, 8):
                for stages in (2, 3):
                    add(dict(chunks_per_program=cpp, num_stages=stages))
        tiles = [(V, 1), (V // 2, 2), (V // 2, 1)] if K < 256 else [(128, 2), (64, 4), (64, 2), (64, 1), (128, 1)]
        for block_v, per_program in tiles:
            if block_v >= 16:
                add(dict(block_v=block_v, value_blocks_per_program=per_program,
                         **({} if per_program == 1 else dict(prefetch_values=False, value_step=None))))
        for warps in (2, 8):
            add(dict(num_warps=warps))
        return out


class ChunkOFwdMosaic(ChunkOFwd):
    """The Mosaic GPU forward (16-bit, chunk 64, K and V multiples of 64); interpreted on a CPU."""

    def inputs(self, problems):
        p = problems[0]
        if p.q.dtype.itemsize != 2 or p.chunk_size != 64 or p.shape["K"] % 64 or p.shape["V"] % 64:
            raise ValueError("chunk_o_fwd_mosaic takes 16-bit inputs, --chunk 64 and K, V multiples "
                             "of 64")
        return super().inputs(problems)

    def default(self, shape, p):
        from gdp_jax.ops.chunk_o import mosaic_fwd
        return mosaic_fwd.default_block_sizes(shape["K"], shape["V"], shape["M"])

    def call(self, sizes, options, shape, p, interpret):
        from gdp_jax.ops.chunk_o.mosaic_fwd import chunk_o_fwd_mosaic
        kw = dict(scale=shape["K"] ** -0.5, chunk_size=p.chunk_size, num_householder=shape["M"])
        return lambda q, k, v, h, g, runs: chunk_o_fwd_mosaic(
            q, k, v, h, g, runs, interpret=interpret, block_sizes=sizes, **kw)

    def check(self, sizes, shape):
        sizes.check(shape["K"], shape["V"], shape["M"])

    def sweep(self, shape, default):
        # Narrower value programs and fewer slots: less SMEM, so more programs share an SM.
        return [dict(block_v=bv, slots=slots) for bv in (64, 128, 256)
                if bv <= shape["V"] and shape["V"] % bv == 0
                for slots in range(1, shape["M"] + 1)
                if (bv, slots) != (default.block_v, default.slots)]


class ChunkOBwd(ChunkOFwd):
    def inputs(self, problems):
        return [args + (p.do,) for args, p in zip(super().inputs(problems), problems)]

    def default(self, shape, p):
        from gdp_jax.ops.chunk_o import pallas_bwd
        return pallas_bwd.default_block_sizes(shape["K"], shape["V"], p.chunk_size, p.q.dtype.itemsize,
                                              gated=p.g is not None)

    def call(self, sizes, options, shape, p, interpret):
        from gdp_jax.ops.chunk_o.pallas_bwd import chunk_o_bwd_pallas
        kw = dict(scale=shape["K"] ** -0.5, chunk_size=p.chunk_size, num_householder=shape["M"])
        return lambda q, k, v, h, g, runs, do: chunk_o_bwd_pallas(
            q, k, v, h, g, runs, do, interpret=interpret, block_sizes=sizes, **kw)

    def sweep(self, shape, default):
        out = [dict(split=split, num_warps=warps, num_stages=stages)
               for split in (True, False) for warps in (4, 8) for stages in (1, 2, 3)]
        out += [dict(block_v=64), dict(block_k=64), dict(block_k=64, block_v=64)]
        if shape["K"] > 128:                        # gated K = 256's default keys are 64 wide
            out.append(dict(block_k=128))
        return out


class ChunkOBwdMosaic(ChunkOFwdMosaic):
    """The Mosaic GPU backward: one kernel or two (``mosaic_bwd.BlockSizes``)."""

    def inputs(self, problems):
        return [args + (p.do,) for args, p in zip(super().inputs(problems), problems)]

    def default(self, shape, p):
        from gdp_jax.ops.chunk_o import mosaic_bwd
        return mosaic_bwd.default_block_sizes(shape["K"], shape["V"], shape["M"])

    def call(self, sizes, options, shape, p, interpret):
        from gdp_jax.ops.chunk_o.mosaic_bwd import chunk_o_bwd_mosaic
        kw = dict(scale=shape["K"] ** -0.5, chunk_size=p.chunk_size, num_householder=shape["M"])
        return lambda q, k, v, h, g, runs, do: chunk_o_bwd_mosaic(
            q, k, v, h, g, runs, do, interpret=interpret, block_sizes=sizes, **kw)

    def check(self, sizes, shape):
        sizes.check(shape["K"], shape["V"], shape["M"])

    def sweep(self, shape, default):
        if default.two_kernels:
            return []
        # A second k / v slot outgrows SMEM at K = V = 128 (229 KiB).
        most = shape["M"] if max(shape["K"], shape["V"]) < 128 else 1
        return ([dict(two_kernels=True, slots=1)]
                + [dict(slots=s) for s in range(1, most + 1) if s != default.slots])


class Wy(Stage):
    def inputs(self, problems):
        keys = ("k_p", "v_p", "beta_p", "gamma", "runs_p")
        self.grid = [sub_grid_inputs(p) for p in problems]
        return [tuple(s[k] for k in keys) for s in self.grid]

    def default(self, shape, p):
        from gdp_jax.ops.wy import pallas_fwd
        return pallas_fwd.BlockSizes()

    def call(self, sizes, options, shape, p, interpret):
        from gdp_jax.ops.wy.pallas_fwd import wy_pallas
        grid = self.grid[0]
        return lambda k, v, beta, gamma, runs: wy_pallas(
            k, v, beta, gamma, runs, sub_chunk=grid["sub"], out_dtype=grid["work_dtype"],
            interpret=interpret, block_sizes=sizes)

    def sweep(self, shape, default):
        return ([dict(num_warps=w, num_stages=s, sub_chunks_per_program=1) for w in (1, 2, 4, 8)
                 for s in (1, 2)]
                + [dict(num_warps=w, num_stages=s, sub_chunks_per_program=n) for w in (2, 4)
                   for s in (2, 3) for n in (2, 4)])


def walk_count(shape, grid) -> dict:
    """The walks' launch-table arguments as the op passes them: B * H walks of one step per
    sub-chunk of the padded expanded stream."""
    return dict(walks=shape["B"] * shape["H"], steps=grid["k_p"].shape[1] // grid["sub"])


class Walk(Wy):
    # dot_dtype None: the op's (the work dtype); every_chunk_too: also store h at every sub-chunk,
    # as the op's backward wants it (compared on the first three outputs)
    options = dict(dot_dtype=None, every_chunk_too=False)
    applies_inverse = False     # reads w and u (WalkT applies T)

    def inputs(self, problems):
        import jax
        from gdp_jax.ops.wy.pallas_fwd import wy_pallas
        wy_sets = super().inputs(problems)
        grid = self.grid[0]
        wy = jax.jit(lambda *a: wy_pallas(*a, sub_chunk=grid["sub"], out_dtype=grid["work_dtype"],
                                          interpret=self.interpret))
        out = []
        for k, v, beta, gamma, runs in wy_sets:
            w, u = wy(k, v, beta, gamma, runs)
            out.append((k, w, u, gamma, runs))
        return out

    def default(self, shape, p, every_chunk_too: bool = False):
        """The op's forward walk's sizes; with ``every_chunk_too`` its backward's (the base a
        config that sets that option overrides)."""
        from gdp_jax.ops.chunk_h import pallas_fwd
        grid = self.grid[0]
        return pallas_fwd.default_block_sizes(shape["K"], shape["V"], grid["sub"], grid["subchunks"],
                                              1, grid["work_dtype"], every_chunk_too,
                                              applies_inverse=self.applies_inverse,
                                              **walk_count(shape, grid))

    def base(self, default, options, shape, p):
        return self.default(shape, p, True) if options.get("every_chunk_too") else default

    def call(self, sizes, options, shape, p, interpret):
        import jax.numpy as jnp
        from gdp_jax.ops.chunk_h.pallas_fwd import chunk_h_pallas
        grid = self.grid[0]
        dot = jnp.dtype(options.get("dot_dtype") or grid["work_dtype"])
        return lambda k, w, u, gamma, runs: chunk_h_pallas(
            k, w, u, gamma, runs, None, chunk_size=grid["sub"], num_householder=1,
            subchunks=grid["subchunks"], h_dtype=grid["work_dtype"], v_new_dtype=p.v.dtype,
            dot_dtype=dot, every_chunk_too=bool(options.get("every_chunk_too")),
            interpret=interpret, block_sizes=sizes)

    def sweep(self, shape, default):
        out = [dict(block_v=bv, num_warps=w) for bv in (16, 32, 64) for w in (2, 4, 8)]
        out += [dict(num_stages=s) for s in (1, 2, 3)] + [dict(dot_dtype="float32")]
        return out


class WyT(Wy):
    """The WY kernel as the op's 16-bit forward calls it where the walk applies T
    (``dispatch.walk_applies_inverse``): T alone, v not read."""
    normalize_keys = False

    def inputs(self, problems):
        return [(k, beta, gamma, runs) for k, _, beta, gamma, runs in super().inputs(problems)]

    def call(self, sizes, options, shape, p, interpret):
        from gdp_jax.ops.wy.pallas_fwd import wy_pallas
        grid = self.grid[0]
        return lambda k, beta, gamma, runs: wy_pallas(
            k, None, beta, gamma, runs, sub_chunk=grid["sub"], out_dtype=grid["work_dtype"],
            interpret=interpret, return_inverse=True, inverse_dtype=grid["work_dtype"],
            w_and_u=False, normalize_keys=self.normalize_keys, block_sizes=sizes)[0]

    def sweep(self, shape, default):
        # one warp (the default) at each sub-chunk loop and stage count; two warps for reference
        return ([dict(num_stages=s, sub_chunks_per_program=n) for s in (1, 2, 3) for n in (1, 2, 4)]
                + [dict(num_warps=2)])


class WyTL2norm(WyT):
    """WyT normalising the keys itself and returning their factors (``normalize_keys``), as the
    undifferentiated forward with use_qk_l2norm calls it where ``dispatch.l2norm_fused`` takes it."""
    normalize_keys = True


class WalkT(Walk):
    """The state walk applying the WY kernel's T itself (v_new = T (beta (v - live 2^gamma k h))),
    as the op's 16-bit forward calls it; with ``every_chunk_too`` as
    bfloat16's differentiable forward calls it (h at every sub-chunk too, for the backward)."""
    options = dict(dot_dtype=None, every_chunk_too=False)
    applies_inverse = True

    def inputs(self, problems):
        import jax
        from gdp_jax.ops.wy.pallas_fwd import wy_pallas
        wy_sets = Wy.inputs(self, problems)
        grid = self.grid[0]
        wy = jax.jit(lambda k, beta, gamma, runs: wy_pallas(
            k, None, beta, gamma, runs, sub_chunk=grid["sub"], out_dtype=grid["work_dtype"],
            interpret=self.interpret, return_inverse=True, inverse_dtype=grid["work_dtype"],
            w_and_u=False)[0])
        return [(k, wy(k, beta, gamma, runs), v, beta, gamma, runs)
                for k, v, beta, gamma, runs in wy_sets]

    def call(self, sizes, options, shape, p, interpret):
        import jax.numpy as jnp
        from gdp_jax.ops.chunk_h.pallas_fwd import chunk_h_pallas
        grid = self.grid[0]
        dot = jnp.dtype(options.get("dot_dtype") or grid["work_dtype"])
        return lambda k, t, v, beta, gamma, runs: chunk_h_pallas(
            k, None, v, gamma, runs, None, chunk_size=grid["sub"], num_householder=1,
            subchunks=grid["subchunks"], h_dtype=grid["work_dtype"], v_new_dtype=p.v.dtype,
            dot_dtype=dot, inverse=t, beta=beta, every_chunk_too=bool(options.get("every_chunk_too")),
            interpret=interpret, block_sizes=sizes)

    def sweep(self, shape, default):
        # the walk applying T has one dot more on its serial chain: more, narrower programs and
        # other warp counts are worth a look, beside the walk's stages and step
        out = [dict(num_stages=s, chunks_per_step=c) for s in (1, 2) for c in (1, None)
               if (s, c) != (default.num_stages, default.chunks_per_step)]
        return out + [dict(block_v=bv, num_warps=w) for bv in (16, 32, 64) for w in (2, 4, 8)
                      if (bv, w) != (64, 4)]


def backward_residuals(p, interpret: bool):
    """The shapes of what the op's differentiable forward on Problem p keeps for its backward,
    ``states_pallas(every_sub_chunk=True)``'s (w, inverse, h_sub, v_new), None where it keeps
    none (jax.eval_shape: nothing runs)."""
    import jax
    from gdp_jax.ops.gated_delta_product import states_pallas
    return jax.eval_shape(lambda k, v, beta, g, runs: states_pallas(
        k, v, beta, g, runs, None, chunk_size=p.chunk_size, num_householder=p.shape["M"],
        interpret=interpret, every_sub_chunk=True), p.k, p.v, p.beta, p.g, p.runs)[3]


def backward_from_inverse(p, interpret: bool) -> bool:
    """Whether the op's backward on Problem p works from the WY stage's T (its differentiable
    forward keeps no w)."""
    return backward_residuals(p, interpret)[0] is None


def walk_key_gate_terms(p, interpret: bool) -> bool:
    """Whether the op's epilogue forms the gate terms of the walk's dk share itself (reading k):
    only where the WY VJP kernel, which otherwise forms them, does not run, i.e. where the
    differentiable forward keeps no inverses for it."""
    return backward_residuals(p, interpret)[1] is None


class WalkBwd(Wy):
    """The walk's VJP (reverse walk and epilogue) as the op's backward calls it: from w, or from
    the WY stage's T and beta where the op's backward works from T (``backward_from_inverse``;
    the second operand is then T and the last beta)."""
    options = dict(dot_dtype=None)      # None: the op's (bfloat16 for bfloat16 inputs, else float32)

    def inputs(self, problems):
        import jax
        import jax.numpy as jnp
        from gdp_jax.ops.gated_delta_product import states_pallas
        super().inputs(problems)
        p0 = problems[0]
        fwd = jax.jit(lambda k, v, beta, g, runs: states_pallas(
            k, v, beta, g, runs, None, chunk_size=p0.chunk_size, num_householder=p0.shape["M"],
            interpret=self.interpret, every_sub_chunk=True))
        subchunks = self.grid[0]["subchunks"]

        @jax.jit
        def cotangents(key, h_sub, v_new_p):   # of h (at token-chunk boundaries), v_new, final state
            keys = jax.random.split(key, 3)
            stored = h_sub.shape[1] // subchunks
            return ((1e-2 * jax.random.normal(keys[0], (h_sub.shape[0], stored) + h_sub.shape[2:])).astype(h_sub.dtype),
                    (1e-2 * jax.random.normal(keys[1], v_new_p.shape)).astype(v_new_p.dtype),
                    1e-2 * jax.random.normal(keys[2], h_sub.shape[:1] + h_sub.shape[2:], jnp.float32))

        out = []
        for i, (grid, p) in enumerate(zip(self.grid, problems)):
            _, _, _, (w, inverse, h_sub, v_new_p) = fwd(p.k, p.v, p.beta, p.g, p.runs)
            self.from_inverse = w is None
            dh, dv_new, dfinal = cotangents(jax.random.PRNGKey(77 + i), h_sub, v_new_p)
            out.append((grid["k_p"], inverse if w is None else w, grid["gamma"], grid["runs_p"],
                        h_sub, v_new_p, dh, dv_new, dfinal, grid["beta_p"]))
        return out

    def walk_operands(self, w, beta) -> dict:
        """chunk_h_bwd_*'s w and, where the op's backward works from T, inverse and beta."""
        return dict(w=None, inverse=w, beta=beta) if self.from_inverse else dict(w=w)

    def _dot(self, options):
        import jax.numpy as jnp
        return jnp.dtype(options.get("dot_dtype") or self.grid[0]["walk_bwd_dot_dtype"])

    def default(self, shape, p):
        from gdp_jax.ops.chunk_h import pallas_bwd
        grid = self.grid[0]
        # inputs() records whether the backward works from T; --list runs no inputs
        from_inverse = getattr(self, "from_inverse", None)
        if from_inverse is None:
            from_inverse = backward_from_inverse(p, self.interpret)
        return pallas_bwd.default_block_sizes(tile_width(shape["K"]), tile_width(shape["V"]), grid["sub"],
                                              grid["sub"] * grid["subchunks"], self._dot({}),
                                              applies_inverse=from_inverse,
                                              **walk_count(shape, grid))

    def call(self, sizes, options, shape, p, interpret):
        from gdp_jax.ops.chunk_h.pallas_bwd import chunk_h_bwd_pallas
        grid = self.grid[0]
        dot = self._dot(options)
        return lambda k, w, gamma, runs, h_sub, v_new, dh, dv_new, dfinal, beta: chunk_h_bwd_pallas(
            k=k, g=gamma, runs=runs, h=h_sub, v_new=v_new, dh=dh, dv_new=dv_new, dfinal=dfinal,
            chunk_size=grid["sub"], num_householder=1, with_initial_state=False,
            subchunks=grid["subchunks"], dot_dtype=dot, interpret=interpret, block_sizes=sizes,
            key_gate_terms=walk_key_gate_terms(p, interpret), **self.walk_operands(w, beta))

    def sweep(self, shape, default):
        out = [dict(block_v=bv, num_warps=w) for bv in (16, 32, 64) for w in (4, 8)]
        out += [dict(block_k=64), dict(block_k=64, block_v=32), dict(num_stages=2)]
        out += [dict(epilogue_warps=w) for w in (2, 8)] + [dict(dot_dtype="float32")]
        return out


class WyBwd(Wy):
    """The WY VJP kernel as the op's backward calls it: with the two other shares of dk added in
    (the walk's, in its dots' dtype, whose gate terms it forms, and the output stage's, in k's
    dtype); ``rhs_cotangents`` None: the op's (True where its backward works from T,
    ``backward_from_inverse``); ``l2norm=True``: with the keys' l2norm factors (``key_factor``),
    as use_qk_l2norm's backward calls it at K <= 128 (``keys_l2norm_vjp_in_wy_kernel``). Random
    cotangents and factors, so a config that flips ``rhs_cotangents`` or ``l2norm`` computes
    another VJP: its check fails, its time stands."""
    options = dict(operand_dtype=None, precision=None, rhs_cotangents=None, l2norm=False)

    def inputs(self, problems):
        import jax
        import jax.numpy as jnp
        from gdp_jax.ops.wy.pallas_fwd import wy_pallas
        self.op_rhs_cotangents = backward_from_inverse(problems[0], self.interpret)
        wy_sets = super().inputs(problems)
        grid = self.grid[0]
        # T in the dtype the op keeps it in for this VJP (its 16-bit operand dtype, else float32)
        inverse_dtype = grid["wy_bwd"]["operand_dtype"] or jnp.float32
        wy = jax.jit(lambda *a: wy_pallas(*a, sub_chunk=grid["sub"], out_dtype=grid["work_dtype"],
                                          interpret=self.interpret, return_inverse=True,
                                          inverse_dtype=inverse_dtype))
        work = grid["work_dtype"]

        share_dtype = grid["walk_bwd_dot_dtype"]

        @jax.jit
        def cotangents(key, k, v):   # of w and u; the walk's and the output stage's dk; factors
            keys = jax.random.split(key, 5)
            normal = lambda i, shape: 1e-2 * jax.random.normal(keys[i], shape)
            factor = jax.random.uniform(keys[4], k.shape[:3], minval=0.5, maxval=2.0)
            return (normal(0, k.shape).astype(work), normal(1, v.shape).astype(work),
                    normal(2, k.shape).astype(share_dtype), normal(3, k.shape).astype(k.dtype),
                    factor)

        out = []
        for i, (k, v, beta, gamma, runs) in enumerate(wy_sets):
            _, _, inverse = wy(k, v, beta, gamma, runs)
            out.append((k, v, beta, gamma, runs, inverse,
                        *cotangents(jax.random.PRNGKey(99 + i), k, v)))
        return out

    def default(self, shape, p):
        from gdp_jax.ops.wy import pallas_bwd
        return pallas_bwd.BlockSizes()

    def call(self, sizes, options, shape, p, interpret):
        import jax
        import jax.numpy as jnp
        from gdp_jax.ops.wy.pallas_bwd import wy_bwd_pallas
        grid = self.grid[0]
        precision, operand = grid["wy_bwd"]["precision"], grid["wy_bwd"]["operand_dtype"]
        if options.get("precision") is not None:
            precision = {"highest": jax.lax.Precision.HIGHEST, "default": None,
                         "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3}[str(options["precision"]).lower()]
        if options.get("operand_dtype") is not None:
            operand = None if options["operand_dtype"] == "float32" else jnp.dtype(options["operand_dtype"])
        rhs = options.get("rhs_cotangents")
        rhs = self.op_rhs_cotangents if rhs is None else bool(rhs)
        l2norm = bool(options.get("l2norm"))
        return lambda k, v, beta, gamma, runs, inverse, dw, du, dk_walk, dk_out, factor=None: wy_bwd_pallas(
            k, v, beta, gamma, runs, inverse, dw, du, sub_chunk=grid["sub"], precision=precision,
            operand_dtype=operand, dk_accumulate=(dk_walk, dk_out), out_dtype=k.dtype,
            rhs_cotangents=rhs, walk_share_gates=True, key_factor=factor if l2norm else None,
            interpret=interpret, block_sizes=sizes)

    def sweep(self, shape, default):
        out = [dict(num_warps=w, block_cols=c, num_stages=s)
               for w, c, s in ((4, 32, 1), (4, 64, 2), (4, 32, 2), (4, 64, 3), (4, 128, 1), (8, 64, 1))]
        out += [dict(operand_dtype="float32")]
        return out


STAGES = dict(chunk_o_fwd=ChunkOFwd, chunk_o_fwd_mosaic=ChunkOFwdMosaic, chunk_o_bwd=ChunkOBwd,
              chunk_o_bwd_mosaic=ChunkOBwdMosaic,
              wy=Wy, walk=Walk, wy_t=WyT, wy_t_l2norm=WyTL2norm, walk_t=WalkT, walk_bwd=WalkBwd, wy_bwd=WyBwd)


def make_sizes(stage, default, overrides, shape, p):
    """(BlockSizes, options) for overrides, or raises ValueError (unknown field, a size that does not
    tile the problem). A stage's ``base(default, options, shape, p)``, where it has one, replaces
    the default the overrides apply to (the walk's backward form takes other sizes than its
    forward)."""
    fields = {f.name for f in dataclasses.fields(default)}
    unknown = set(overrides) - fields - set(stage.options)
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}; {type(default).__module__}.BlockSizes "
                         f"has {sorted(fields)}" + (f", options {sorted(stage.options)}" if stage.options else ""))
    options = {k: v for k, v in overrides.items() if k in stage.options}
    base = stage.base(default, options, shape, p) if hasattr(stage, "base") else default
    sizes = dataclasses.replace(base, **{k: v for k, v in overrides.items() if k in fields})
    return sizes, options


# --------------------------------------------------------------------------------------------- run
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=shape_sets_epilog(SETS))
    p.add_argument("--stage", required=True, choices=list(STAGES))
    p.add_argument("--shapes", default=HEADLINE_SHAPE,
                   help=f"a named set or 'B=..,T=..,...;...' (default {HEADLINE_SHAPE})")
    p.add_argument("--configs", default=None,
                   help="'name:field=value,...;...' BlockSizes overrides (default: the stage's sweep)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of alternation (A/B); 1: a sweep (default)")
    add_dtype_arg(p)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--no-g", action="store_true", help="without the decay g")
    p.add_argument("--interpret", action="store_true",
                   help="Pallas' interpreter (the default on a CPU; logic check only)")
    p.add_argument("--budget-s", type=float, default=600.0,
                   help="wall-clock bound on the whole run, seconds (default 600)")
    p.add_argument("--min-config-s", type=float, default=8.0,
                   help="assumed cost of a config before one has been measured")
    p.add_argument("--max-err", type=float, default=2e-2,
                   help="largest relative difference from the default's output for a config to count")
    p.add_argument("--top", type=int, default=4,
                   help="with the built-in sweep and several shapes: later shapes get the default and "
                        "the first shape's TOP fastest good configs (0: the whole sweep everywhere)")
    p.add_argument("--list", action="store_true", help="print the stage's fields, default and sweep, and exit")
    add_timing_args(p, reps=3, target_ms=40.0, max_iters=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write JSON results here")
    args = p.parse_args(argv)
    args.sets = max(1, args.sets)
    return args


def main(argv=None):
    t_start = time.perf_counter()
    elapsed = lambda: time.perf_counter() - t_start
    args = parse_args(argv)
    shapes = parse_shapes(args.shapes, SETS)
    given = parse_configs(args.configs) if args.configs else None
    stage = STAGES[args.stage]()

    cpu = on_cpu()
    stage.interpret = interpret = args.interpret or cpu
    if args.list:
        shp = shapes[0]
        problems = make_problems(shp, op=stage.op, dtype=args.dtype, sets=1, chunk_size=args.chunk,
                                 gated=not args.no_g)
        if stage.op == "full":            # the grid's sizes only, nothing compiled
            stage.grid = [sub_grid_inputs(problems[0])]
        default = stage.default(shp, problems[0])
        print(f"{args.stage} at {shape_label(shp)} {args.dtype}: default {default}")
        print(f"options: {stage.options or '-'}")
        for i, over in enumerate(stage.sweep(shp, default)):
            print(i, describe(over))
        return None

    meta = run_meta(args, interpret=interpret)
    log(f"jax {meta['jax']} on {meta['device']}; stage {args.stage}; dtype {args.dtype}; chunk "
        f"{args.chunk}; rounds {args.rounds}; budget {args.budget_s:.0f} s; interpret {interpret}")
    torch_mod = None
    if not cpu:
        try:
            import torch as torch_mod
        except Exception:  # noqa: BLE001 - only for a second copy-bandwidth figure
            torch_mod = None
    bandwidth = copy_bandwidth(args, cpu, torch_mod)
    log(f"copy bandwidth {bandwidth['GBps']:.0f} GB/s")
    phases = Phases(cpu)
    timing = timing_kwargs(args)
    rows, skipped, slowest = [], [], args.min_config_s
    ranked = []                                     # the first shape's good overrides, fastest first
    try:
        for si, shp in enumerate(shapes):
            label = shape_label(shp)
            if elapsed() + 15.0 + slowest > args.budget_s:
                skipped.append(dict(shape=label, config="(all)"))
                log(f"\n=== {label}: skipped (budget)")
                continue
            log(f"\n=== [{si + 1}/{len(shapes)}] {label} {args.dtype}, {args.stage}, {elapsed():.0f} s elapsed")
            try:
                problems = make_problems(shp, op=stage.op, dtype=args.dtype, sets=args.sets,
                                         chunk_size=args.chunk, gated=not args.no_g,
                                         seed=args.seed * 1000 + si)
                sets = stage.inputs(problems)
                default = stage.default(shp, problems[0])
            except Exception as e:  # noqa: BLE001
                log(f"setup failed: {short_exc(e)}")
                traceback.print_exc(limit=4)
                rows.append(dict(shape=label, config="-", error=f"setup: {short_exc(e)}"))
                continue
            if given is not None:
                plan = dict(given)
            elif si > 0 and args.top:
                plan = {describe(o): o for o in ranked[:args.top]}
            else:
                plan = {describe(o): o for o in stage.sweep(shp, default)}
            plan = {"default": {}, **{n: o for n, o in plan.items() if o}}
            log(f"default {default}; {len(plan)} configs")
            shape_rows = run_configs(stage, plan, default, sets, shp, problems[0], args, phases,
                                     timing, bandwidth, elapsed, skipped, label, slowest)
            slowest = max([slowest] + [r.get("setup_s", 0.0) for r in shape_rows])
            rows += shape_rows
            if si == 0:
                good = sorted((r for r in shape_rows if r.get("ok") and not r["default"]),
                              key=lambda r: r["ms"])
                ranked = [r["overrides"] for r in good]
            del problems, sets
            gc.collect()
    finally:
        phases.close()
    result = dict(meta=meta, stage=args.stage, copy_bandwidth=bandwidth, rows=rows, skipped=skipped,
                  total_s=elapsed())
    write_json(args.out, result)
    print_results(rows, meta, args, bandwidth, skipped, elapsed())
    return result


def run_configs(stage, plan, default, sets, shp, p0, args, phases, timing, bandwidth, elapsed,
                skipped, label, slowest):
    """Every config of ``plan`` on one shape: built, checked against the default's output, sized,
    then timed over --rounds rounds in turn. Returns the rows."""
    import jax
    rows, live, reference = {}, {}, None
    for name, over in plan.items():
        row = dict(shape=label, **shp, dtype=args.dtype, chunk=args.chunk, stage=args.stage,
                   config=name, overrides=over, default=name == "default")
        rows[name] = row
        try:
            sizes, options = make_sizes(stage, default, over, shp, p0)
            stage.check(sizes, shp)
        except (ValueError, TypeError) as e:
            row["error"] = f"does not fit: {e}"
            log(f"  {name:32s} does not fit: {e}")
            continue
        row["block_sizes"] = dataclasses.asdict(sizes)
        row["options"] = options
        if elapsed() + slowest > args.budget_s:
            skipped.append(dict(shape=label, config=name))
            row["error"] = "skipped (budget)"
            log(f"  {name:32s} skipped (budget)")
            continue
        start = time.perf_counter()
        try:
            runner = JaxRunner(jax.jit(stage.call(sizes, options, shp, p0, stage.interpret)), sets)
            row["first_call_s"] = runner.warm()
            out = jax.block_until_ready(runner.fn(*sets[0]))
            if reference is None:
                if name != "default":
                    raise RuntimeError("the default config failed, nothing to compare with")
                reference = out
                row["bytes"] = nbytes(sets[0], out)
                row["floor_ms"] = floor_ms(row["bytes"], bandwidth)
            errors = relative_errors(out, reference)
            row["relerr"] = max(errors) if errors else 0.0
            row["finite"] = all(e != float("inf") for e in errors)
            row["ok"] = row["finite"] and row["relerr"] <= args.max_err
            del out
            ns = len(sets)
            row["n"] = pick_n(estimate_call_s(runner, ns), timing["target_s"], ns, args.max_iters)
            live[name] = runner
            log(f"  {name:32s} built in {row['first_call_s']:.1f} s; rel diff from default "
                f"{row['relerr']:.2e}{'' if row['ok'] else '  BAD'}")
        except Exception as e:  # noqa: BLE001
            row["error"] = short_exc(e)
            log(f"  {name:32s} FAILED {short_exc(e, 300)}")
            if name == "default":
                traceback.print_exc(limit=6)
                break
        row["setup_s"] = time.perf_counter() - start
        slowest = max(slowest, row["setup_s"])
    floor = rows["default"].get("floor_ms")
    times = {name: [] for name in live}
    round_s = 0.0
    for round_ in range(args.rounds):
        if round_ and elapsed() + round_s > args.budget_s:
            log(f"  budget: rounds {round_ + 1}-{args.rounds} skipped")
            break
        start = time.perf_counter()
        for name, runner in live.items():
            phase = f"{label}/{name}"
            with phases.during(phase) or _null():
                loops = [runner.loop(rows[name]["n"]) for _ in range(timing["reps"])]
            times[name].append(statistics.median(loops))
            summary = phases.summary(phase)
            pct = f"  {100 * floor / times[name][-1]:5.1f} % floor" if floor == floor and floor else ""
            log(f"  round {round_} {name:32s} {times[name][-1]:8.4g} ms{pct}  {GpuMonitor.describe(summary)}")
        round_s = time.perf_counter() - start
    for name, runner in live.items():
        runner.close()
        row = rows[name]
        row["round_ms"] = times[name]
        if times[name]:
            row.update(ms=statistics.median(times[name]), min_ms=min(times[name]), max_ms=max(times[name]))
            if floor == floor and floor:
                row["pct_floor"] = 100.0 * floor / row["ms"]
        summary = phases.summary(f"{label}/{name}")
        if summary:
            row["gpu"] = summary
    default_ms = rows["default"].get("ms")
    for row in rows.values():
        if default_ms and row.get("ms"):
            row["vs_default"] = row["ms"] / default_ms
    return list(rows.values())


def _null():
    import contextlib
    return contextlib.nullcontext()


def print_results(rows, meta, args, bandwidth, skipped, total_s):
    hdr = ["shape", "config", "ms", "min", "max", "x default", "% floor", "rel diff", "SM MHz", "note",
           "overrides"]
    order = {s: i for i, s in enumerate(dict.fromkeys(r["shape"] for r in rows))}
    lines = []
    for r in sorted(rows, key=lambda r: (order[r["shape"]], r.get("ms", float("inf")))):
        note = ("default " if r.get("default") else "") + (
            r["error"][:60] if "error" in r else ("" if r.get("ok") else "BAD"))
        gpu = r.get("gpu")
        lines.append([r["shape"], r["config"][:40], fmt(r.get("ms"), ".4f"), fmt(r.get("min_ms"), ".4f"),
                      fmt(r.get("max_ms"), ".4f"), fmt(r.get("vs_default"), ".3f"),
                      fmt(r.get("pct_floor"), ".1f"), fmt(r.get("relerr"), ".1e"),
                      f"{gpu['sm_mhz_median']:.0f}" if gpu else "-", note.strip(),
                      describe(r.get("overrides") or {})])
    print_table(hdr, lines,
                f"{args.stage} | device {meta['device']} | jax {meta['jax']} | {args.dtype} | copy "
                f"bandwidth {bandwidth['GBps']:.0f} GB/s | {args.rounds} round(s) | {total_s:.0f} s | "
                "ms = median over rounds; rel diff = largest relative difference of an output from "
                "the default's")
    if skipped:
        print(f"skipped for the time budget: {len(skipped)} configs "
              f"({', '.join(sorted({s['shape'] for s in skipped}))})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
