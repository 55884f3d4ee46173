"""How the row kernels of softmax and the norms read a row: vectors of up to
16 bytes, and rows off the 16-byte grid read in 16-byte packs between
single-element edges (peeled), shortest first in register blocks of a warp
or two."""
from __future__ import annotations

from ..device import WARP_SIZE

# Rows off the 16-byte grid (odd cols, offset views) of at least
# AUTO_PEELED_SMALL_MIN_COLS, before the warp path (whose packs would narrow
# to the rows' alignment): a peeled register block of the first of
# AUTO_PEELED_SMALL_BLOCKS giving a thread at most AUTO_PEELED_SMALL_MAX_PACKS
# 16-byte packs; blocks of one warp a row hold AUTO_PEELED_SMALL_WARP_ROWS
# rows (twice the warps resident: an SM runs at most 32 blocks); softmax and
# the norms' forward alike. H200, rows 49152, % of copy, against the plan before
# (the warp path in narrow packs up to 1024 cols, then 128-thread blocks):
#   softmax f16 255 / 385 / 513 / 777 / 1023 / 1025 / 1500 cols 60.1 / 68.2
#     / 79.0 / 84.1 / 87.9 / 88.2 / 92.2 against 54.9 / 59.4 / 64.4 / 68.4 /
#     69.2 / 75.3 / 82.2; log_softmax f16 1023 88.3 against 59.7;
#     softmax_backward f16 255 / 513 / 1023 72.5 / 84.6 / 92.0 against 63.9
#     / 74.4 / 79.3; f32 385 / 1023 87.4 / 94.4 against 86.5 / 92.1 (257 /
#     301 80.4 / 83.4 against 81.0 / 84.1); f64 255 88.7 against 81.6;
#   LayerNorm f16 385 / 513 / 1023 / 1025 54.2 / 67.3 / 84.8 / 86.0 against
#     51.1 / 55.2 / 62.4 / 70.6; f32 257 / 385 / 1023 75.3 / 83.4 / 92.5
#     against 70.2 / 74.4 / 71.0; RMSNorm f16 255 / 513 / 1023 56.9 / 75.1 /
#     87.3 against 50.1 / 58.4 / 64.7, f32 257 / 513 78.3 / 87.9 against
#     71.9 / 78.6;
#   shorter rows lose (the warp path's groups take several rows a warp):
#   softmax f16 193 cols 46.3 against 53.3, f32 129 61.8 against 67.2, f64
#   97 55.9 against 61.5.
# One row a block of one warp: softmax f16 513 cols 69.1, LayerNorm f16 513
# 65.6, f32 257 66.1 (four rows: within 1 of two; eight lose up to 4);
# 128 threads a row: softmax f16 1023 74.9; LayerNorm f32 1023 takes two
# warps (four packs a thread): 92.5 against 89.4 at one warp and eight.
# AUTO_PEELED_SMALL_BLOCKS: a value of the device profile (cupyops/profiles/*.json).
# AUTO_PEELED_SMALL_MAX_PACKS: a value of the device profile (cupyops/profiles/*.json).
AUTO_PEELED_SMALL_WARP_ROWS = 2
# AUTO_PEELED_SMALL_MIN_COLS: a value of the device profile (cupyops/profiles/*.json).


def vector_pack_size(cols: int, itemsize: int, align: int) -> int:
    """Largest power of two with pack * itemsize <= 16 bytes that divides cols
    and that every operand's address and row stride allow."""
    pack = max(1, min(16, align) // itemsize)
    while cols % pack:
        pack //= 2
    return pack


def peeled_pack(pack_size: int, itemsize: int, same_phase: bool) -> tuple:
    """(pack, peel) of a row path that can peel: rows off the 16-byte grid
    (pack_size, vector_pack_size, under 16 bytes) whose operands share each
    row's phase read 16-byte packs between single-element edges; others keep
    pack_size."""
    peel = same_phase and pack_size * itemsize < 16
    return (16 // itemsize if peel else pack_size), peel


def peeled_small_rows_per_block(block_size: int) -> int:
    """Rows a block of AUTO_PEELED_SMALL_BLOCKS holds: blocks of one warp
    AUTO_PEELED_SMALL_WARP_ROWS (a warp each), wider blocks one."""
    return AUTO_PEELED_SMALL_WARP_ROWS if block_size == WARP_SIZE else 1

