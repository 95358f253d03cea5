"""What the Mosaic GPU kernels of gdp_jax share: the interpreter switch and the few operations
whose compiled form Mosaic GPU's CPU interpreter does not run (docs/mosaic_gpu.md).

Each helper takes ``interpret``. Compiled, it is the Mosaic GPU form: register layouts given
where Hopper's wgmma fragments need them, the transposed wgmma operand as a transposed SMEM view.
Interpreted, it is the same arithmetic in plain jnp on the loaded values, so that CPU tests check
a kernel's indexing, masks and sums; lowering for CUDA checks the compiled form's layouts and SMEM
budget, and only a GPU its synchronisation.
"""
from __future__ import annotations

import functools
import inspect

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# SMEM tiles of 16-bit elements: 8-row tiles of 64 columns (128 bytes), 128-byte swizzle: the
# layout wgmma reads without bank conflicts and TMA writes, as in jax's Mosaic GPU examples.
SWIZZLE_BYTES = 128


def tile_transforms(dtype):
    """The SMEM transforms of a 2-D wgmma operand or TMA tile of ``dtype``."""
    columns = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(SWIZZLE_BYTES))


@functools.lru_cache(maxsize=None)
def interpret_params():
    """Mosaic GPU's interpreter parameters: ``plgpu.InterpretGPUParams`` (jax >= 0.11) or its
    private home in jax 0.10; None where this jax has no interpreter."""
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        try:
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
        except ImportError:
            return None
    return params()


def has_interpreter() -> bool:
    return interpret_params() is not None


# jax 0.10's plgpu.load takes the index as a second argument; 0.11 deprecates it (index the ref).
_LOAD_TAKES_INDEX = (inspect.signature(plgpu.load).parameters["idx"].default
                     is inspect.Parameter.empty)


def _load(ref, layout):
    if _LOAD_TAKES_INDEX:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def row_vector(ref, interpret: bool):
    """A [N] f32 / int32 SMEM vector laid out for broadcasting along the columns of an [N, *]
    wgmma accumulator (one value per row)."""
    if interpret:
        return ref[...]
    return _load(ref, plgpu.Layout.WGMMA.reduce(1))


def column_vector(ref, interpret: bool):
    """A [N] SMEM vector laid out for broadcasting along the rows of an [*, N] accumulator."""
    if interpret:
        return ref[...]
    return _load(ref, plgpu.Layout.WGMMA.reduce(0))


def iota(shape, dimension: int, interpret: bool):
    """int32 indices along ``dimension`` of a ``shape`` accumulator-layout array."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dimension)
    return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)


def tile(ref, interpret: bool):
    """A 2-D SMEM tile loaded into registers in the wgmma accumulator's layout."""
    if interpret:
        return ref[...]
    return _load(ref, plgpu.Layout.WGMMA)


def _operand(ref, transposed: bool, interpret: bool):
    if interpret:
        return ref[...].T if transposed else ref[...]
    return ref.transpose((1, 0)) if transposed else ref


def accumulate(shape, body, interpret: bool, *, with_aux: bool = False):
    """Runs ``body(mma)`` with one float32 accumulator of ``shape`` and returns its value (and,
    ``with_aux``, what ``body`` returns: values made inside the accumulator's scope must leave it
    that way, not by closure).

    ``mma(a, b, transpose_a=False, transpose_b=False)`` adds a @ b of two 16-bit SMEM tiles (either
    one read transposed) and waits for it, so that the body may overwrite a and b afterwards.
    Other accumulators may be scoped inside the body.
    """
    if interpret:
        total = [jnp.zeros(shape, jnp.float32)]

        def mma(a, b, transpose_a=False, transpose_b=False):
            total[0] = total[0] + jnp.dot(_operand(a, transpose_a, True),
                                          _operand(b, transpose_b, True),
                                          preferred_element_type=jnp.float32)
        aux = body(mma)
        return (total[0], aux) if with_aux else total[0]

    def scope(acc):
        def mma(a, b, transpose_a=False, transpose_b=False):
            plgpu.wgmma(acc, _operand(a, transpose_a, False), _operand(b, transpose_b, False))
            plgpu.wgmma_wait(0)
        aux = body(mma)
        return (acc[...], aux) if with_aux else acc[...]
    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def dot(a_smem, b_smem, interpret: bool):
    """a @ b of two SMEM tiles [M, K] and [K, N] (16-bit), accumulated in float32 -> [M, N]."""
    shape = (a_smem.shape[0], b_smem.shape[1])
    return accumulate(shape, lambda mma: mma(a_smem, b_smem), interpret)


def dot_nt(a_smem, b_smem, interpret: bool):
    """a @ b^T of two SMEM tiles [M, K] and [N, K] -> [M, N] float32."""
    shape = (a_smem.shape[0], b_smem.shape[0])
    return accumulate(shape, lambda mma: mma(a_smem, b_smem, transpose_b=True), interpret)


def dot_tn(a_smem, b_smem, interpret: bool):
    """a^T @ b of two SMEM tiles [K, M] and [K, N] -> [M, N] float32."""
    shape = (a_smem.shape[1], b_smem.shape[1])
    return accumulate(shape, lambda mma: mma(a_smem, b_smem, transpose_a=True), interpret)


def aliased(*groups, interpret: bool):
    """Scratch whose groups of refs share SMEM (``plgpu.RefUnion``): the kernel must use them in
    disjoint lifetimes, a group's data read only through the refs that wrote it. The interpreter
    (which has no SMEM limit and no RefUnion) gets the groups as separate refs, the same tree."""
    return tuple(groups) if interpret else plgpu.RefUnion(*groups)


def wait_stores_read():
    """Waits until every SMEM -> GMEM copy the program issued has read its SMEM tile, not until its
    writes land: the tile may then be overwritten and the program may exit, and the writes complete
    before the kernel does (as in jax's Mosaic GPU matmuls and CUTLASS's TMA-store epilogues)."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def broadcast_rows(x, shape):
    """[N] per-row values -> ``shape`` = [N, *]."""
    return lax.broadcast_in_dim(x, shape, (0,))


def broadcast_columns(x, shape):
    """[N] per-column values -> ``shape`` = [*, N]."""
    return lax.broadcast_in_dim(x, shape, (1,))


def chunk_grid(batch: int, num_chunks: int, heads: int, tiles: int = 0, tile_name: str = ""):
    """(grid, grid_names) for one program per (batch row, chunk, head[, tile]). Mosaic GPU's grid
    runs its last axis fastest. The tiles of one chunk therefore run side by side and share its
    q, k or do reads through L2. The head comes next, so the programs in flight read and write
    whole token rows across heads, not one head's slice of many rows (RESULTS.md, "The Mosaic
    grids' fastest axis", "The Mosaic grids' head axis")."""
    grid, names = (batch, num_chunks, heads), ("batch", "chunk", "head")
    return (grid + (tiles,), names + (tile_name,)) if tiles else (grid, names)


def kernel(body, *, out_type, scratch_types, grid, grid_names, interpret: bool, **body_kwargs):
    """``plgpu.kernel`` on one warpgroup per program, interpreted where asked.
    It calls ``body(*operand_and_output_refs, scratch=scratch_refs, interpret=interpret,
    **body_kwargs)``."""
    if interpret and interpret_params() is None:
        raise NotImplementedError("this jax has no Mosaic GPU interpreter; "
                                  "run implementation='mosaic' on a GPU")

    def split(*refs):
        n = len(refs) - len(scratch_types)
        return body(*refs[:n], scratch=refs[n:], interpret=interpret, **body_kwargs)
    return plgpu.kernel(split, out_type=out_type, scratch_types=scratch_types, grid=grid,
                        grid_names=grid_names,
                        interpret=interpret_params() if interpret else None)

