"""Rows cached by cp.async (kernels/async_row.cuh), planned alike for softmax
and the norms: the shared memory a block's share of a row takes, the register
tails a row allows, and the first tail a ladder's rung can take."""
from __future__ import annotations

PACK_BYTES = 16   # cp.async's packs


def share_bytes(num_inputs: int, row_bytes: int, block_size: int, tail_packs: int, cluster_size: int = 1) -> int:
    """Shared memory a block caches a stage: its share of the row's 16-byte
    packs outside the blocks' register tails (a cluster_size-th, rounded up),
    of every input (row_bytes: one input's row)."""
    cached_packs = row_bytes // PACK_BYTES - cluster_size * tail_packs * block_size
    return num_inputs * -(-cached_packs // cluster_size) * PACK_BYTES


def tails(num_inputs: int, row_bytes: int, block_size: int, smem_optin: int, cluster_size: int,
          most: int) -> range:
    """Register tails (packs of each input a thread holds) of a row shared by
    cluster_size blocks: from the fewest (at least one) that leave the rest
    within the opt-in limit `smem_optin` up to `most`, the tails within the row."""
    row_packs = row_bytes // PACK_BYTES
    excess_packs = row_packs - cluster_size * (smem_optin // (PACK_BYTES * num_inputs))
    fewest = max(1, -(-excess_packs // (cluster_size * block_size)))
    return range(fewest, min(most, row_packs // (cluster_size * block_size)) + 1)


def largest_tails_first(num_inputs: int, row_bytes: int, block_size: int, smem_optin: int, cluster_size: int,
                        most: int):
    """A ladder rung's tails to try, largest first: tails(...) reversed, or
    none (0) when most is 0."""
    if not most:
        return (0,)
    return reversed(tails(num_inputs, row_bytes, block_size, smem_optin, cluster_size, most))


def rung_spec(spec_of, num_inputs: int, row_bytes: int, target, cluster_size: int, block_size: int,
              tail_candidates, min_blocks: int):
    """A ladder rung's kernel: (spec_of(tail_packs), its shared memory) for
    the first of tail_candidates that leaves the rest of the row within the
    opt-in limit, does not spill, and leaves min_blocks blocks resident an
    SM; None when none does."""
    optin = target.facts.smem_per_block_optin
    for tail_packs in tail_candidates:
        smem = share_bytes(num_inputs, row_bytes, block_size, tail_packs, cluster_size)
        if smem > optin:
            continue
        spec = spec_of(tail_packs)
        if tail_packs and target.resources(spec)["local_bytes"]:
            continue
        if target.max_active_blocks(spec, block_size, smem, True) >= min_blocks:
            return spec, smem
    return None
