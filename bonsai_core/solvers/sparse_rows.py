"""Index arithmetic and a sparse-row collector for MILPs built from whole index arrays.

The op-level MILP (``checkmate``) has one variable per (stage, node) pair of a triangular matrix and
families of constraints, each a vectorised set of rows: these helpers enumerate index ranges,
number triangular pairs, and collect rows as COO triples into scipy.sparse matrices.
"""

from __future__ import annotations

import numpy as np


def ranges(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For items with half-open ranges ``[lo, hi)``: (item index, value) of every value in every
    range, item by item. O(total length), vectorised."""
    lengths = np.maximum(hi - lo, 0)
    item = np.repeat(np.arange(len(lo), dtype=np.int64), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return item, np.arange(len(item), dtype=np.int64) - starts + np.repeat(lo, lengths)


def lower_offset(t: np.ndarray, i: np.ndarray) -> np.ndarray:
    """Index of the strictly-lower pair (t, i), i < t, in row-major order."""
    return t * (t - 1) // 2 + i


def tri_offset(t: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Index of the lower pair (t, k), k <= t, in row-major order."""
    return t * (t + 1) // 2 + k


class Rows:
    """Sparse rows ``A_x @ x + A_u @ u  (<= or ==)  b``, collected as COO triples."""

    def __init__(self) -> None:
        self.rows = 0
        self.x: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.u: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.rhs: list[np.ndarray] = []

    def add(self, count: int, rhs: np.ndarray | float) -> int:
        """Reserve ``count`` rows with right-hand side ``rhs``; returns the first row's index."""
        first = self.rows
        self.rows += count
        self.rhs.append(np.broadcast_to(np.asarray(rhs, dtype=np.float64), (count,)).copy())
        return first

    def x_terms(self, row: np.ndarray, col: np.ndarray, val: np.ndarray | float) -> None:
        self.x.append((row, col, np.broadcast_to(np.asarray(val, dtype=np.float64), row.shape)))

    def u_terms(self, row: np.ndarray, col: np.ndarray, val: np.ndarray | float) -> None:
        self.u.append((row, col, np.broadcast_to(np.asarray(val, dtype=np.float64), row.shape)))

    def matrices(self, nx: int, nu: int):
        import scipy.sparse as sp

        def mat(parts, ncols):
            if not parts:
                return sp.csr_matrix((self.rows, ncols))
            r, c, v = (np.concatenate(p) for p in zip(*parts))
            return sp.csr_matrix((v, (r, c)), shape=(self.rows, ncols))  # duplicates are summed

        return mat(self.x, nx), mat(self.u, nu), np.concatenate(self.rhs) if self.rhs else np.zeros(0)
