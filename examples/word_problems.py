"""Group word problems: the state-tracking task of DeltaProduct's paper (Siems et al., 2025).

A group G acts on the points {0, ..., n-1}; its elements are permutations, stored as arrays
``perm`` with ``perm[i]`` the image of point i. Composition is the composition of functions,

    (a ∘ b)[i] = a[b[i]]          (apply b first, then a),  in numpy: a[b]

An input row is a sequence of random elements g_1 ... g_T (drawn uniformly from G), and the
target at position t is the running product, each new element applied after the previous ones:

    p_0 = identity,   p_t = g_t ∘ p_{t-1} = g_t ∘ g_{t-1} ∘ ... ∘ g_1

Elements are indices into ``Group.perms`` (sorted lexicographically; index 0 is the identity for
every group here), and ``Group.table[a, b]`` is the index of perms[a] ∘ perms[b]. Since g_t is
uniform and independent of p_{t-1}, every p_t (t >= 1) is uniform on G: guessing gives 1/|G|.

Groups: "Z2" (parity: the swap of two points; the running product is the parity of the number
of swaps), "Z<n>" (cyclic, rotations of n points), "S<n>" (all permutations of n points), "A<n>"
(the even ones), "D<n>" (the dihedral group of the n-gon, 2n elements).

Needs numpy only; ``jax_word_problems`` (the same rows, sampled inside a jitted function) needs jax.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import re
from typing import Tuple

import numpy as np

__all__ = ["Group", "GROUPS", "compose", "get_group", "parity", "running_products",
           "word_problems", "jax_word_problems", "min_reflections", "transposition_count"]


def compose(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a ∘ b: apply b, then a (``(a ∘ b)[i] = a[b[i]]``)."""
    return np.asarray(a)[np.asarray(b)]


def parity(perm) -> int:
    """0 for an even permutation, 1 for an odd one (inversion count mod 2)."""
    perm = list(perm)
    return sum(1 for i in range(len(perm)) for j in range(i + 1, len(perm))
               if perm[i] > perm[j]) % 2


def transposition_count(perm) -> int:
    """The fewest transpositions whose product is perm: n minus its number of cycles."""
    perm, seen, cycles = list(perm), set(), 0
    for start in range(len(perm)):
        if start not in seen:
            cycles += 1
            i = start
            while i not in seen:
                seen.add(i)
                i = perm[i]
    return len(perm) - cycles


def min_reflections(perm) -> int:
    """The fewest reflections of R^n whose product is perm's permutation matrix P (P e_i =
    e_{perm[i]}): the codimension of P's fixed space (Cartan-Dieudonné), rank(P - I). For a
    permutation this equals ``transposition_count`` (a transposition (i j) is the reflection
    across e_i - e_j)."""
    n = len(perm)
    matrix = np.eye(n)[:, list(perm)]
    return int(np.linalg.matrix_rank(matrix - np.eye(n)))


@dataclasses.dataclass(frozen=True)
class Group:
    """A permutation group. perms [|G|, n] int (row 0 the identity), table [|G|, |G|] int32 with
    table[a, b] = index of perms[a] ∘ perms[b]."""
    name: str
    perms: np.ndarray
    table: np.ndarray

    @property
    def order(self) -> int:
        return int(self.perms.shape[0])

    @property
    def degree(self) -> int:
        return int(self.perms.shape[1])

    def index(self, perm) -> int:
        """The index of a permutation (tuple, list or array) of this group."""
        return self._lookup[tuple(int(i) for i in perm)]

    @functools.cached_property
    def _lookup(self):
        return {tuple(int(i) for i in p): j for j, p in enumerate(self.perms)}

    def max_transpositions(self) -> int:
        """The most transpositions any element needs (n - 1 for S_n, n - 2 for A_n, ...)."""
        return max(transposition_count(p) for p in self.perms)


def _from_perms(name: str, perms) -> Group:
    perms = sorted({tuple(int(i) for i in p) for p in perms})
    n = len(perms[0])
    assert perms[0] == tuple(range(n)), "the identity must be an element"
    arr = np.array(perms, dtype=np.int64)
    lookup = {p: j for j, p in enumerate(perms)}
    table = np.array([[lookup[tuple(compose(a, b))] for b in arr] for a in arr], dtype=np.int32)
    return Group(name, arr, table)


def _generate(n: int, generators) -> list:
    """Closure of the generators under composition (breadth-first)."""
    identity = tuple(range(n))
    found, frontier = {identity}, [identity]
    while frontier:
        new = []
        for p in frontier:
            for g in generators:
                q = tuple(compose(g, p))
                if q not in found:
                    found.add(q)
                    new.append(q)
        frontier = new
    return sorted(found)


def get_group(name: str) -> Group:
    """"Z2" (also "parity"), "Z<n>", "S<n>", "A<n>", "D<n>" (n >= 3 for D)."""
    key = {"parity": "Z2"}.get(name.lower(), name.upper())
    match = re.fullmatch(r"([ZSAD])(\d+)", key)
    if not match:
        raise ValueError(f"unknown group {name!r}: use Z<n>, S<n>, A<n>, D<n> or parity")
    kind, n = match.group(1), int(match.group(2))
    if n < 2 or (kind == "D" and n < 3) or (kind in "SA" and n > 7):
        raise ValueError(f"group {name!r} out of range")
    if kind in "SA":
        perms = [p for p in itertools.permutations(range(n)) if kind == "S" or parity(p) == 0]
    elif kind == "Z":
        perms = _generate(n, [np.roll(np.arange(n), -1)])
    else:   # dihedral: a rotation and a reflection of the n-gon
        perms = _generate(n, [np.roll(np.arange(n), -1), (-np.arange(n)) % n])
    return _from_perms(key, perms)


GROUPS = ("Z2", "S3", "S4", "S5", "A4", "A5")


def running_products(group: Group, elements: np.ndarray) -> np.ndarray:
    """elements [..., T] int -> targets [..., T]: p_t = g_t ∘ p_{t-1}, p_0 = identity (index 0)."""
    elements = np.asarray(elements)
    out = np.empty_like(elements)
    prev = np.zeros(elements.shape[:-1], dtype=elements.dtype)
    for t in range(elements.shape[-1]):
        prev = group.table[elements[..., t], prev]
        out[..., t] = prev
    return out


def word_problems(group: Group, batch: int, length: int,
                  rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """(elements [batch, length] int32 uniform on G, targets [batch, length] int32 running products)."""
    elements = rng.integers(0, group.order, size=(batch, length)).astype(np.int32)
    return elements, running_products(group, elements).astype(np.int32)


def jax_word_problems(key, table, batch: int, length: int):
    """The same rows inside jax (jit-friendly): table is ``Group.table`` (numpy or jax array);
    returns (elements, targets), both [batch, length] int32."""
    import jax
    import jax.numpy as jnp

    table = jnp.asarray(table, jnp.int32)
    elements = jax.random.randint(key, (batch, length), 0, table.shape[0], dtype=jnp.int32)

    def step(prev, g):
        new = table[g, prev]
        return new, new

    _, targets = jax.lax.scan(step, jnp.zeros((batch,), jnp.int32), elements.T)
    return elements, targets.T
