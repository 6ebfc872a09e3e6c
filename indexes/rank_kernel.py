"""The device first pass's masks in one Triton kernel (``indexes.gpu.DeviceFleet``): for each
block of ``BLOCK`` slots and every order of a batch, the circle test, the constraint bits, the
cargo limits and the ranking value, written once, with each block's maximum and counts.

In plain torch the same work is about twenty kernels over (orders x slots) arrays, each read
and written through device memory (float64 cosines alone are 8 bytes per order and slot);
here each slot's columns are read once for the whole batch and only the ranking values are
written. Imported only where triton is installed (it ships with torch's CUDA wheels);
``DeviceFleet`` falls back to the torch operations elsewhere, with the same results
(tests/test_index_gpu.py).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

BLOCK = 1024  # slots a program takes; ``DeviceFleet``'s capacity is a multiple of it
# float32 max: near the circle's edge, not eligible (a constexpr: a kernel reads no other global)
_NOT_ELIGIBLE = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _rank(
    scores_ptr,  # (orders, capacity) float32 device scores
    ranked_ptr,  # out (orders, capacity) float32
    top_ptr,  # out (orders, blocks) float32: each block's largest ranked value
    inside_ptr,  # out (orders, blocks) int32: available drivers surely inside
    near_ptr,  # out (orders, blocks) int32: available drivers near the edge
    xyz_ptr,  # (3, capacity) float64 unit positions, NaN where no available driver is
    cbits_ptr,  # (capacity,) int64 constraint bits
    cargo_ptr,  # (3, capacity) float64 weight, volume, height limits
    params_ptr,  # per order: centre x, y, z, hi, lo, need weight, volume, height (float64)
    mask_ptr,  # per order: the constraint bits it needs (int64)
    orders,
    capacity,
    params_stride,
    mask_stride,
    BLOCK: tl.constexpr,
) -> None:
    block = tl.program_id(0)
    blocks = capacity // BLOCK
    at = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(xyz_ptr + at)
    y = tl.load(xyz_ptr + capacity + at)
    z = tl.load(xyz_ptr + 2 * capacity + at)
    bits = tl.load(cbits_ptr + at)
    weight = tl.load(cargo_ptr + at)
    volume = tl.load(cargo_ptr + capacity + at)
    height = tl.load(cargo_ptr + 2 * capacity + at)
    for m in range(orders):
        p = params_ptr + m * params_stride
        dots = tl.load(p) * x + tl.load(p + 1) * y + tl.load(p + 2) * z  # cos(d / R)
        hi = tl.load(p + 3)
        inside = dots >= hi  # NaN: False
        near = (dots > tl.load(p + 4)) & (dots < hi)
        need = tl.load(mask_ptr + m * mask_stride)
        eligible = ((bits & need) == need) & (weight >= tl.load(p + 5))
        eligible = eligible & (volume >= tl.load(p + 6)) & (height >= tl.load(p + 7))
        score = tl.load(scores_ptr + m * capacity + at)
        value = tl.where(inside & eligible, score, float("-inf"))
        value = tl.where(near, tl.where(eligible, float("inf"), _NOT_ELIGIBLE), value)
        tl.store(ranked_ptr + m * capacity + at, value)
        tl.store(top_ptr + m * blocks + block, tl.max(value, axis=0))
        tl.store(inside_ptr + m * blocks + block, tl.sum(inside.to(tl.int32), axis=0))
        tl.store(near_ptr + m * blocks + block, tl.sum(near.to(tl.int32), axis=0))


def rank(
    torch: Any, scores: Any, xyz: Any, cbits: Any, cargo: Any, params: Any, mask: Any
) -> tuple[Any, Any, Any, Any]:
    """The ranking values (orders, capacity), each block's largest (orders, blocks), and the
    counts inside and near per order; ``params`` (orders, 8) float64 and ``mask`` (orders, 1)
    int64 may be strided views of the batch's input buffer."""
    orders, capacity = scores.shape
    blocks = capacity // BLOCK
    ranked = torch.empty_like(scores)
    top = torch.empty((orders, blocks), dtype=torch.float32, device=scores.device)
    inside = torch.empty((orders, blocks), dtype=torch.int32, device=scores.device)
    near = torch.empty_like(inside)
    _rank[(blocks,)](
        scores,
        ranked,
        top,
        inside,
        near,
        xyz,
        cbits,
        cargo,
        params,
        mask,
        orders,
        capacity,
        params.stride(0),
        mask.stride(0),
        BLOCK=BLOCK,
        num_warps=8,
        enable_fp_fusion=True,  # said, not defaulted: triton 3.9 warns of a default to come
    )
    return ranked, top, inside.sum(dim=1), near.sum(dim=1)
