"""Fused cross-entropy in Triton: loss AND gradient in one kernel over the logits, with online softmax.

What it computes
----------------
For a row of logits x[0..V), its target class t and label smoothing eps (PyTorch's `F.cross_entropy`):

    lse  = log(sum_j exp(x_j))                                # log-sum-exp, the softmax normalizer
    loss = lse - (1 - eps) * x_t - (eps / V) * sum_j x_j
    dx_j = scale * (softmax(x)_j - (1 - eps) * [j == t] - eps / V)

scale is 1 / (number of non-ignored rows) for reduction="mean", 1 otherwise; a row whose target is `ignore_index`
has loss 0 and gradient exactly 0. The online softmax (Milakov & Gimelshein, 2018) keeps a running max m and a
running sum d of exp(x - m), rescaling d whenever m grows, so lse = m + log(d) comes out of one streaming pass.
Optional extras with Liger-Kernel's names, compile-time switches of the same kernel: class weights, z-loss, logit
softcapping and the argmax per row (token accuracy, predicted tokens); see "Extras" in section 2.

Bytes it must move, and why fusion wins
---------------------------------------
At least one read of every logit and one write of every gradient entry: 2 * N * V * itemsize bytes (16384 LLaMA-3
tokens, V = 128256, bf16: 4.2 GB each way). PyTorch's path writes an fp32 log-softmax of all the logits, reads the rows
several times, and keeps that fp32 copy for the backward (+24 GB at that size). Here the gradient is made in the forward
pass, so the backward only multiplies it by grad_output (nothing to do when that is 1); each row is read twice (pass 1:
statistics, pass 2: gradient), the second time mostly from L2. On an H100/H200 the launcher runs, where it pays, a Gluon
variant that keeps the row in shared memory between the passes (cross_entropy_smem_kernel.py).
linear_cross_entropy_kernel.py runs this launcher on chunks of hidden @ W.T, never holding all the logits.

Triton concepts introduced here (new relative to rmsnorm_kernel.py)
-------------------------------------------------------------------
- a loop over chunks inside one program (a row of 128256 values is much longer than one block); online softmax
- lanes: a chunk as a [BLOCK_V // 8, 8] tile whose rows each thread holds whole: reducing axis 1 needs no shuffle
- eviction policies on loads and stores (evict_last / evict_first: which lines L2 should keep)
- inline PTX with tl.inline_asm_elementwise (one-instruction exp2 and reciprocal), and tl.debug_barrier
- bitcasts, .to(..., bitcast=True): an exp2 on the FMA pipe where the multi-function unit is the bottleneck (softcap)
- optional features as constexpr switches with None arguments (the extras): code that is off is not compiled

Limits
------
Class-index targets only; fp32 arithmetic and loss, gradient in the logits' dtype; targets outside [0, V) give NaN rows
(check_targets=True raises instead); the backward scales the stored gradient in place, so it runs once. The
shared-memory kernel needs compute capability 9.x and 16-bit logits. torch.compile traces the loss as the operator
torch.ops.playbook.cross_entropy (section 3), extras included; inplace_backward=True cannot be compiled (a clear error).
"""
import contextlib
import functools
import importlib
import math
import os
import sys
from typing import NamedTuple, Optional

import torch

# Without a GPU the kernels run on Triton's CPU interpreter. Triton reads TRITON_INTERPRET when @triton.jit decorates a
# function, so it is set before `import triton`; the first kernel module imported prints the one-line notice.
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
    print("No CUDA device: Triton kernels run on the CPU interpreter (toy sizes; times are not meaningful).",
          file=sys.stderr)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# The online softmax's building blocks (online_softmax.py), which the shared-memory kernel shares, and the one device
# rule: the kernels run on the GPU when there is one, on the CPU interpreter otherwise.
from online_softmax import (INTERPRETER, LOG2E, _LANE_WIDTH, _argmax_lane, _capped_softmax_update,  # noqa: E402
                            _gradient_scales, _lane_argmax_update, _merge_lanes, _online_softmax_update,
                            _round_to, _row_loss, _row_start, _softcap, _softcap_slope, _softmax_gradient,
                            _store_argmax, _tanh)

KERNEL_DEVICE = "cpu" if INTERPRETER else "cuda"

__all__ = ["cross_entropy", "CrossEntropyFunction", "TritonCrossEntropyLoss", "cross_entropy_forward",
           "cross_entropy_backward", "CrossEntropyOutput"]


# ----------------------------------------------------------------------------------------------------------------------
# 1. Kernels
# ----------------------------------------------------------------------------------------------------------------------
# Memory-bound does not mean the arithmetic is free: at ~4 TB/s there is room for a handful of instructions per logit.
# Hence a one-instruction exp2, masks on the partial chunk only, the one-hot term written by one scalar store, and the
# gradient's scale folded into the exponent: about 15 instructions per logit in the two loops (see results/NOTES.md).

@triton.jit
def _cross_entropy_kernel(
    logits_ptr,  # [N, V] rows (any row strides, unit column stride), fp32/bf16/fp16
    grad_ptr,  # where dlogits goes: its own buffer, or logits_ptr itself (in-place mode)
    targets_ptr,  # [N] class indices, int64 or int32
    losses_ptr,  # [N] fp32 per-row losses (output)
    scale_ptr,  # fp32 gradient scale: one value (scale_stride = 0) or one per row
    n_rows,  # N, the rows of all programs together
    V,  # vocabulary size (row length)
    rows_per_batch,  # T for [B, T, V] logits (N for 2-D), to turn a flat row index into (b, t)
    logits_stride_b, logits_stride_t,  # element strides of dims b and t of the logits
    grad_stride_b, grad_stride_t,  # same for the gradient buffer
    targets_stride,  # element stride of the targets (a non-contiguous [N] view is fine)
    scale_stride,  # 0: one scale for all rows (a reduction's 1/n, or a scalar grad_output); else per row
    ignore_index,  # rows with this target get loss 0 and gradient 0
    label_smoothing,  # eps in [0, 1]
    # Extras, None when off (see "Extras" in section 2); each switched on by a constexpr below.
    weight_ptr,  # class weights: fp32, V of them, their sum at index V, zeros after (to a multiple of BLOCK_V)
    z_losses_ptr,  # [N] fp32 per-row z-loss, lse_square_scale * lse^2 (output)
    z_scale_ptr,  # fp32 gradient scale of the z-loss, with scale_stride (differs from scale_ptr's with weights)
    predicted_ptr,  # [N] int64 argmax per row, -1 on ignored rows (output)
    lse_square_scale,  # the z-loss coefficient
    softcap,  # logits -> softcap * tanh(logits / softcap)
    BLOCK_V: tl.constexpr,  # vocabulary chunk handled per loop step (power of 2)
    LANE_WIDTH: tl.constexpr,  # consecutive columns that share one running max/sum (power of 2, divides BLOCK_V)
    HAS_SMOOTHING: tl.constexpr,  # label_smoothing > 0: also accumulate sum(x)
    COMPUTE_GRAD: tl.constexpr,  # run pass 2 (logits need a gradient); otherwise only the loss
    POSITIVE_SCALE: tl.constexpr,  # the scale is known to be > 0 (a reduction's 1/n or 1), so it folds into exp2
    FAST_EXP2: tl.constexpr,  # one-instruction exp2 and reciprocal (GPU); tl.exp2 and `/` on the interpreter
    CHUNKS_PER_STEP: tl.constexpr,  # 1 or 2 chunks loaded per loop step, i.e. in flight per thread (see the launcher)
    HAS_WEIGHT: tl.constexpr, HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,  # the extras' switches
    TRACK_ARGMAX: tl.constexpr,  # the argmax per row (predicted tokens and token accuracy)
    FAST_TANH: tl.constexpr,  # the softcap with the one-instruction tanh (16-bit logits on the GPU, see _softcap)
):
    # A chunk of BLOCK_V columns is handled as a [BLOCK_V // LANE_WIDTH, LANE_WIDTH] tile: row r of the tile holds
    # columns r*LANE_WIDTH .. r*LANE_WIDTH + LANE_WIDTH - 1 of the chunk. Each tile row is one "lane" with its own
    # running max and sum. Triton gives each thread whole tile rows (8 bf16 = one 16-byte load), so reducing a tile
    # row (axis=1) stays inside one thread: no shuffles, no shared memory, no barrier in the streaming loops.
    N_LANES: tl.constexpr = BLOCK_V // LANE_WIDTH
    chunk_offsets = tl.arange(0, N_LANES)[:, None] * LANE_WIDTH + tl.arange(0, LANE_WIDTH)[None, :]
    # The row is n_full whole chunks, read without masks (a mask costs instructions on every value), then one
    # partial chunk, masked (all masked off when V is a multiple of BLOCK_V).
    n_full = V // BLOCK_V
    full_cols = n_full * BLOCK_V
    partial_offsets = full_cols + chunk_offsets
    partial_mask = partial_offsets < V

    # Program p walks over rows p, p + P, ... (P = number of programs, capped by the launcher). Pass 2 re-reads the row
    # it just read: the fewer rows in flight, the more of it is still in L2 (60 MiB on an H200).
    for row_index in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        # int64 BEFORE multiplying by strides: row * V overflows int32 once the logits hold more than 2^31 elements,
        # and the pointer arithmetic would silently wrap to another row.
        row = tl.cast(row_index, tl.int64)
        logits_row = _row_start(logits_ptr, row, rows_per_batch, logits_stride_b, logits_stride_t)
        grad_row = _row_start(grad_ptr, row, rows_per_batch, grad_stride_b, grad_stride_t)
        target = tl.load(targets_ptr + row * targets_stride).to(tl.int64)

        if target == ignore_index:
            # Ignored row: loss 0 and a gradient of exact zeros, written without reading the logits.
            tl.store(losses_ptr + row, 0.0)
            if HAS_Z_LOSS:
                tl.store(z_losses_ptr + row, 0.0)
            if TRACK_ARGMAX:
                tl.store(predicted_ptr + row, -1)
            if COMPUTE_GRAD:
                zeros = tl.zeros([N_LANES, LANE_WIDTH], dtype=grad_ptr.dtype.element_ty)
                for start in tl.range(0, V, BLOCK_V):
                    tl.store(grad_row + start + chunk_offsets, zeros, mask=start + chunk_offsets < V)
        else:
            # A target outside [0, V) is never used as an address (the one load at x + target is masked off), so it
            # cannot read or write out of bounds; instead its loss and gradient become NaN, loudly.
            target_ok = (target >= 0) & (target < V)
            x_target = tl.load(logits_row + target, mask=target_ok, other=0.0).to(tl.float32)
            # ---- pass 1: online softmax statistics ----
            row_max, row_sum, sum_x_tile, x_partial, argmax_start = _row_statistics(
                logits_row, chunk_offsets, n_full, partial_offsets, partial_mask, BLOCK_V, LANE_WIDTH, HAS_SMOOTHING,
                FAST_EXP2, CHUNKS_PER_STEP, weight_ptr, softcap, HAS_WEIGHT, HAS_SOFTCAP, FAST_TANH, TRACK_ARGMAX)
            # ---- the loss ----
            lse = row_max + tl.log(row_sum)
            logit_target = x_target
            weight_target = 1.0
            weight_total = 1.0
            if HAS_SOFTCAP:  # extra: the loss sees the capped logit
                logit_target = _softcap(x_target, softcap, FAST_EXP2, FAST_TANH)
            if HAS_WEIGHT:  # extra: the target's class weight, and the sum of all weights (stored at index V)
                weight_target = tl.load(weight_ptr + target, mask=target_ok, other=0.0)
                weight_total = tl.load(weight_ptr + V)
            loss = _row_loss(row_max, row_sum, logit_target, sum_x_tile, label_smoothing, V, HAS_SMOOTHING,
                             weight_target, weight_total, HAS_WEIGHT)
            tl.store(losses_ptr + row, tl.where(target_ok, loss, float("nan")))
            if HAS_Z_LOSS:  # extra: the z-loss, kept apart from the loss (a mean divides them differently)
                tl.store(z_losses_ptr + row, lse_square_scale * lse * lse)
            if TRACK_ARGMAX:
                # Extra: the lane that holds the argmax (see _merge_lanes), read now, before pass 2 can overwrite it
                # in place, and used at the end of the row, so that the read's latency hides behind pass 2. Triton
                # chooses which thread holds which lane, so a barrier puts every thread's read before any store.
                argmax_columns, is_argmax_lane = _argmax_lane(argmax_start, tl.arange(0, N_LANES), chunk_offsets,
                                                              BLOCK_V, LANE_WIDTH)
                x_argmax = tl.load(logits_row + argmax_columns, mask=is_argmax_lane[:, None] & (argmax_columns < V),
                                   other=float("-inf"))
                if COMPUTE_GRAD:
                    tl.debug_barrier()
            # ---- pass 2: the gradient ----
            if COMPUTE_GRAD:
                scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
                softmax_scale, target_scale = _gradient_scales(
                    scale, label_smoothing, V, weight_target, weight_total, lse, lse_square_scale, z_scale_ptr,
                    row * scale_stride, HAS_WEIGHT, HAS_Z_LOSS)
                _row_gradient(logits_row, grad_row, target, target_ok, x_target, x_partial, row_max, row_sum, scale,
                              label_smoothing, V, chunk_offsets, n_full, partial_offsets, partial_mask, BLOCK_V,
                              HAS_SMOOTHING, POSITIVE_SCALE, FAST_EXP2, CHUNKS_PER_STEP, softmax_scale, target_scale,
                              weight_ptr, softcap, HAS_WEIGHT, HAS_SOFTCAP, FAST_TANH)
            if TRACK_ARGMAX:
                _store_argmax(x_argmax.to(tl.float32), argmax_columns, is_argmax_lane, predicted_ptr + row, V,
                              softcap, HAS_SOFTCAP, FAST_EXP2, FAST_TANH)



@triton.jit
def _row_statistics(logits_row, chunk_offsets, n_full, partial_offsets, partial_mask, BLOCK_V: tl.constexpr,
                    LANE_WIDTH: tl.constexpr, HAS_SMOOTHING: tl.constexpr, FAST_EXP2: tl.constexpr,
                    CHUNKS_PER_STEP: tl.constexpr, weight_ptr=None, softcap=None, HAS_WEIGHT: tl.constexpr = False,
                    HAS_SOFTCAP: tl.constexpr = False, FAST_TANH: tl.constexpr = False,
                    TRACK_ARGMAX: tl.constexpr = False):
    """Pass 1 over one row: the online softmax, one running max and sum per lane, merged at the end.
    Returns (row_max, row_sum, sum_x_tile, x_partial, argmax_start); sum_x_tile holds sum(x) per element (label
    smoothing only), x_partial the row's last, partial chunk, which pass 2 reuses from registers (before the softcap:
    pass 2 applies it again), row_max in logit units (with a softcap: softcap times the max of t), argmax_start (extra,
    else 0) the first of the LANE_WIDTH columns that hold the row's argmax (see _merge_lanes)."""
    N_LANES: tl.constexpr = BLOCK_V // LANE_WIDTH
    if HAS_SOFTCAP:  # extra: the lanes keep the max of t = tanh(x / softcap) >= -1 (see _capped_softmax_update)
        lane_max = tl.full([N_LANES], -1.0, dtype=tl.float32)
        log2_unit = softcap * LOG2E
    else:
        lane_max = tl.full([N_LANES], float("-inf"), dtype=tl.float32)
        log2_unit = LOG2E
    lane_sum = tl.zeros([N_LANES], dtype=tl.float32)  # sum of exp(x - lane_max) over the lane's columns
    # Label smoothing needs sum(x): kept per element and reduced once at the end, not once per chunk.
    sum_x_tile = tl.zeros([N_LANES, LANE_WIDTH], dtype=tl.float32)
    lane_chunk = tl.zeros([N_LANES], dtype=tl.int32)  # extra: see _lane_argmax_update
    # loop_unroll_factor=2 puts the loads of two chunks in flight before either is used.
    for i in tl.range(0, n_full, loop_unroll_factor=CHUNKS_PER_STEP):
        # evict_last: keep the row in L2 for pass 2.
        x = tl.load(logits_row + i * BLOCK_V + chunk_offsets, eviction_policy="evict_last").to(tl.float32)
        x, lane_max, lane_sum, lane_chunk = _fold_chunk(x, i, lane_max, lane_sum, lane_chunk, log2_unit, FAST_EXP2,
                                                        softcap, HAS_SOFTCAP, FAST_TANH, TRACK_ARGMAX)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:  # extra: sum(w * x)
                sum_x_tile += x * tl.load(weight_ptr + i * BLOCK_V + chunk_offsets)
            else:
                sum_x_tile += x
    # The partial chunk; masked columns read -inf so they count as exp(-inf) = 0.
    x_partial = tl.load(logits_row + partial_offsets, mask=partial_mask, other=float("-inf"),
                        eviction_policy="evict_last").to(tl.float32)
    x, lane_max, lane_sum, lane_chunk = _fold_chunk(x_partial, n_full, lane_max, lane_sum, lane_chunk, log2_unit,
                                                    FAST_EXP2, softcap, HAS_SOFTCAP, FAST_TANH, TRACK_ARGMAX,
                                                    partial_mask)
    row_max, row_sum, argmax_start = _merge_lanes(lane_max, lane_sum, FAST_EXP2,
                                                  lane_chunk * BLOCK_V + tl.arange(0, N_LANES) * LANE_WIDTH,
                                                  (n_full + 1) * BLOCK_V, TRACK_ARGMAX, log2_unit)
    if HAS_SOFTCAP:
        row_max = softcap * row_max  # from t back to logit units, as without a softcap
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            sum_x_tile += tl.where(partial_mask, x, 0.0) * tl.load(weight_ptr + partial_offsets)
        else:
            sum_x_tile += tl.where(partial_mask, x, 0.0)
    return row_max, row_sum, sum_x_tile, x_partial, argmax_start


@triton.jit
def _fold_chunk(x, chunk, lane_max, lane_sum, lane_chunk, log2_unit, FAST_EXP2: tl.constexpr, softcap=None,
                HAS_SOFTCAP: tl.constexpr = False, FAST_TANH: tl.constexpr = False, TRACK_ARGMAX: tl.constexpr = False,
                mask=None):
    """One chunk of pass 1 into the lanes' running max and sum (and, extra, their argmax chunk). Returns (x as the loss
    sees it, lane_max, lane_sum, lane_chunk). Extra, softcap: the lanes work on t = tanh(x / softcap), which orders
    the columns as the capped logits do, log2_unit = softcap * log2(e) (see _capped_softmax_update), and x comes back
    capped (label smoothing's sum(x) reads it). mask: the partial chunk's columns, whose masked ones hold -inf."""
    if HAS_SOFTCAP:
        t = _tanh(x * (1.0 / softcap), FAST_EXP2, FAST_TANH)
        if mask is not None:
            t = tl.where(mask, t, float("-inf"))  # tanh(-inf) = -1 would count the masked columns
        if TRACK_ARGMAX:
            lane_chunk = _lane_argmax_update(t, chunk, lane_max, lane_chunk, IN_ORDER=True)
        lane_max, lane_sum = _capped_softmax_update(t, lane_max, lane_sum, log2_unit, FAST_EXP2)
        x = softcap * t
    else:
        if TRACK_ARGMAX:
            lane_chunk = _lane_argmax_update(x, chunk, lane_max, lane_chunk, IN_ORDER=True)
        lane_max, lane_sum = _online_softmax_update(x, lane_max, lane_sum, FAST_EXP2)
    return x, lane_max, lane_sum, lane_chunk




@triton.jit
def _row_gradient(logits_row, grad_row, target, target_ok, x_target, x_partial, row_max, row_sum, scale,
                  label_smoothing, V, chunk_offsets, n_full, partial_offsets, partial_mask, BLOCK_V: tl.constexpr,
                  HAS_SMOOTHING: tl.constexpr, POSITIVE_SCALE: tl.constexpr, FAST_EXP2: tl.constexpr,
                  CHUNKS_PER_STEP: tl.constexpr, softmax_scale, target_scale, weight_ptr=None, softcap=None,
                  HAS_WEIGHT: tl.constexpr = False, HAS_SOFTCAP: tl.constexpr = False,
                  FAST_TANH: tl.constexpr = False):
    """Pass 2 over one row: dx_j = scale * (softmax_j - eps / V) written chunk by chunk, the target's entry last.
    softmax_scale and target_scale are `scale` but for the extras (see _gradient_scales)."""
    exponent_offset = tl.log2(row_sum)
    if POSITIVE_SCALE:
        exponent_offset -= tl.log2(softmax_scale)
    exponent_offset = tl.where(target_ok, exponent_offset, float("nan"))  # bad target: NaN gradient
    smoothing_term = scale * (label_smoothing / V)
    grad = _softmax_gradient(x_partial, row_max, exponent_offset, softmax_scale, smoothing_term, POSITIVE_SCALE,
                             HAS_SMOOTHING, FAST_EXP2, partial_offsets, weight_ptr, softcap, HAS_WEIGHT, HAS_SOFTCAP,
                             FAST_TANH)
    # evict_first on the loads: this is the last use of the logits; on the stores: this kernel never reads the
    # gradient back. Both leave L2 to the rows that pass 2 has still to re-read.
    tl.store(grad_row + partial_offsets, _round_to(grad, grad_row.dtype.element_ty), mask=partial_mask,
             eviction_policy="evict_first")
    # Whole chunks in reverse order: the chunks pass 1 read last are the likeliest to still be in L2. In in-place mode
    # grad_row == logits_row: each chunk is overwritten only after it was read. With CHUNKS_PER_STEP = 2, chunks
    # top-1 and top-2 per step, both loaded before either is stored: the compiler cannot tell that a store does not
    # alias a later load, so it keeps them in program order and unrolling alone would not put a second load in flight.
    for i in tl.range(0, n_full // CHUNKS_PER_STEP):
        offsets_a = (n_full - 1 - CHUNKS_PER_STEP * i) * BLOCK_V + chunk_offsets
        x_a = tl.load(logits_row + offsets_a, eviction_policy="evict_first").to(tl.float32)
        if CHUNKS_PER_STEP == 2:
            x_b = tl.load(logits_row + offsets_a - BLOCK_V, eviction_policy="evict_first").to(tl.float32)
        grad_a = _softmax_gradient(x_a, row_max, exponent_offset, softmax_scale, smoothing_term, POSITIVE_SCALE,
                                   HAS_SMOOTHING, FAST_EXP2, offsets_a, weight_ptr, softcap, HAS_WEIGHT, HAS_SOFTCAP,
                                   FAST_TANH)
        if CHUNKS_PER_STEP == 2:
            # Extra, softcap: the multi-function unit runs a tanh and an exp2 per logit and pass and sets the pace;
            # the FMA pipe idles. Chunk b's exp2 goes to the FMA pipe, which balances the two (as FlashAttention-4
            # does for attention's softmax; the other splits measured are in results/NOTES.md).
            grad_b = _softmax_gradient(x_b, row_max, exponent_offset, softmax_scale, smoothing_term, POSITIVE_SCALE,
                                       HAS_SMOOTHING, FAST_EXP2, offsets_a - BLOCK_V, weight_ptr, softcap, HAS_WEIGHT,
                                       HAS_SOFTCAP, FAST_TANH, EXP2_ON_FMA=HAS_SOFTCAP)
        tl.store(grad_row + offsets_a, _round_to(grad_a, grad_row.dtype.element_ty), eviction_policy="evict_first")
        if CHUNKS_PER_STEP == 2:
            tl.store(grad_row + offsets_a - BLOCK_V, _round_to(grad_b, grad_row.dtype.element_ty),
                     eviction_policy="evict_first")
    if CHUNKS_PER_STEP == 2:
        if n_full % 2 == 1:  # chunk 0 is left over
            x = tl.load(logits_row + chunk_offsets, eviction_policy="evict_first").to(tl.float32)
            grad = _softmax_gradient(x, row_max, exponent_offset, softmax_scale, smoothing_term, POSITIVE_SCALE,
                                     HAS_SMOOTHING, FAST_EXP2, chunk_offsets, weight_ptr, softcap, HAS_WEIGHT,
                                     HAS_SOFTCAP, FAST_TANH)
            tl.store(grad_row + chunk_offsets, _round_to(grad, grad_row.dtype.element_ty),
                     eviction_policy="evict_first")
    # The one-hot term, -scale * (1 - eps) at the target only: one store instead of a comparison on every value. The
    # barrier orders it after every thread's store of this row (one of which wrote that entry).
    tl.debug_barrier()
    # A target outside [0, V) (its row is NaN) must not address the class weights either: class 0's stands in.
    target_softmax_term = _softmax_gradient(x_target, row_max, exponent_offset, softmax_scale, smoothing_term,
                                            POSITIVE_SCALE, HAS_SMOOTHING, FAST_EXP2, tl.where(target_ok, target, 0),
                                            weight_ptr, softcap, HAS_WEIGHT, HAS_SOFTCAP, FAST_TANH)
    one_hot = target_scale * (1.0 - label_smoothing)
    if HAS_SOFTCAP:  # extra: the chain rule applies to the one-hot term too
        one_hot = one_hot * _softcap_slope(_softcap(x_target, softcap, FAST_EXP2, FAST_TANH), softcap)
    target_grad = target_softmax_term - one_hot
    tl.store(grad_row + target, _round_to(target_grad, grad_row.dtype.element_ty), mask=target_ok)





@triton.jit
def _scale_rows_kernel(
    x_ptr,  # [rows, n_cols] tensor scaled in place (any row strides, unit column stride)
    scale_ptr,  # fp32-convertible scale: one value (scale_stride = 0) or one per row
    n_cols,
    rows_per_batch,  # as in _cross_entropy_kernel: [B, T, n_cols] tensors too
    stride_b, stride_t,
    scale_stride,
    BLOCK: tl.constexpr,  # columns per loop step
):
    # Backward of the fused losses: multiply the gradient computed in the forward pass by grad_output. The scale is
    # read on the device, so there is no host sync; when it is exactly 1 (loss.backward() on a mean or sum loss, the
    # usual case in training) the program only loads one number and exits.
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
    if scale != 1.0:
        x_row = _row_start(x_ptr, row, rows_per_batch, stride_b, stride_t)
        cols = tl.arange(0, BLOCK)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(x_row + start + cols, _round_to(x * scale, x_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------------------
# 2. Launchers
# ----------------------------------------------------------------------------------------------------------------------
_REDUCTIONS = ("mean", "sum", "none")
# (low, high, meaning) of each scalar option: the kernels take them as fp32; the softcap slope divides by softcap^2.
_FP32 = torch.finfo(torch.float32)
_NUMBER_RANGES = {"label_smoothing": (0.0, 1.0, ""), "lse_square_scale": (0.0, _FP32.max, " (finite in float32)"),
                  "softcap": (math.sqrt(_FP32.tiny), math.sqrt(_FP32.max),
                              " (finite in float32, its square too; None: no softcap)")}
_PROGRAMS_PER_SM = 128  # no persistent grid: one program per row, as many resident as the registers allow
_MAX_BLOCK_V = 16384  # the widest chunk of either kernel (fp32 logits on a GPU)
# Below this many rows per multiprocessor the shared-memory kernel's first row per program waits for all its loads and
# the row kernel is faster (e.g. 768 rows, a linear cross-entropy chunk; measured on an H200, see results/NOTES.md).
_SMEM_MIN_ROWS_PER_SM = 8
# The Gluon names cross_entropy_smem_kernel.py uses, by module: Gluon is experimental and renames things between Triton
# releases, so the dispatch checks names, not a version (the barrier's two names: see _missing_gluon_names).
_GLUON_NAMES = {"triton.experimental.gluon": ("jit",),
                "triton.experimental.gluon.language": (
                    "BlockedLayout", "SliceLayout", "SwizzledSharedLayout", "allocate_shared_memory", "arange", "full",
                    "load", "log", "log2", "minimum", "num_programs", "program_id", "static_range", "store", "where",
                    "zeros", "zeros_like"),
                "triton.experimental.gluon.language.nvidia.ampere.async_copy": (
                    "async_copy_global_to_shared", "commit_group", "wait_group")}


def _launch_shape(V, itemsize, on_gpu, block_v=None):
    """(BLOCK_V, num_warps, CHUNKS_PER_STEP, maxnreg) of the row kernel; block_v (tests) overrides the chunk width.
    16-bit logits on a GPU: 8192-wide chunks, 32 warps, two chunks per step, at most 32 registers per thread, so two
    programs fit per multiprocessor with two 16-byte loads in flight per thread (the fastest shape measured on an H200).
    fp32 logits: 16384-wide chunks, one per step, no register cap (the 16-bit shape spills there). CPU interpreter:
    256-wide chunks and 4 warps (a chunk costs ~1 ms of Python; tests want several per row), and both loop forms."""
    chunks_per_step = 2 if itemsize <= 2 else 1
    widest = 256 if not on_gpu else 8192 if chunks_per_step == 2 else 16384
    # The register cap belongs to the measured shape, not to a test's chunk width.
    maxnreg = 32 if on_gpu and chunks_per_step == 2 and not block_v else None
    return block_v or min(widest, triton.next_power_of_2(max(V, 1))), 32 if on_gpu else 4, chunks_per_step, maxnreg


@functools.cache
def _missing_gluon_names():
    """The names of _GLUON_NAMES and a barrier (Triton 3.6's thread_barrier, 3.7's barrier) that the installed Triton
    lacks, as "module.name"; empty when the shared-memory kernel can be compiled. Cached: asked per launch."""
    missing = []
    for module_name, names in _GLUON_NAMES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a Triton without Gluon, or without this part of it
            module = None
        missing += [f"{module_name}.{name}" for name in names if not hasattr(module, name)]
    gluon_language = sys.modules.get("triton.experimental.gluon.language")
    if not (hasattr(gluon_language, "barrier") or hasattr(gluon_language, "thread_barrier")):
        missing.append("triton.experimental.gluon.language.barrier")
    return tuple(missing)


def _smem_kernel_allowed(properties):
    """The dispatch rule: the shared-memory kernel runs only on compute capability 9.x (H100, H200), where it was tuned,
    when the installed Gluon has every name it uses, and on the CPU interpreter (properties None:
    torch.cuda.get_device_properties of the logits' GPU otherwise) through its Gluon stand-in, for the tests."""
    return properties is None or (properties.major == 9 and not _missing_gluon_names())


def _pick_smem_plan(V, itemsize, n_rows, compute_grad, rows_aligned, properties, kernel=None, block_v=None,
                    n_streamed=None, n_ring=None, softcap=False):
    """None for the row kernel, or the shared-memory kernel's plan (cross_entropy_smem_kernel._smem_plan) for 16-bit
    logits with a gradient to write, where _smem_kernel_allowed, with _SMEM_MIN_ROWS_PER_SM rows per multiprocessor,
    rows 16-byte aligned (cp.async copies 16 bytes per thread) and no softcap (its tanh per logit and pass needs more
    warps in flight than one program per multiprocessor has: the row kernel is faster, measured on an H200).
    kernel="rows" / "smem" (tests) forces one, and raises ValueError for "smem" where it cannot run."""
    if kernel not in (None, "rows", "smem"):
        raise ValueError(f"cross_entropy_forward: kernel must be None, 'rows' or 'smem', got {kernel!r}")
    plan = None
    if kernel != "rows" and compute_grad and rows_aligned and _smem_kernel_allowed(properties):
        enough_rows = properties is None or n_rows >= _SMEM_MIN_ROWS_PER_SM * properties.multi_processor_count
        if kernel == "smem" or (enough_rows and not softcap):
            plan = _smem_kernel_module()._smem_plan(V, itemsize, properties, block_v, n_streamed, n_ring)
    if kernel == "smem" and plan is None:
        raise ValueError(f"cross_entropy_forward: the shared-memory kernel does not apply here (V={V}, "
                         f"{itemsize}-byte logits, gradient: {compute_grad}, rows 16-byte aligned: {rows_aligned}, "
                         f"GPU: {'none' if properties is None else f'compute capability {properties.major}.x'})")
    return plan


def _smem_kernel_module():
    """cross_entropy_smem_kernel, imported on first use: the row kernel's path needs neither that module nor Gluon."""
    import cross_entropy_smem_kernel
    return cross_entropy_smem_kernel


def _on_tensor_device(t):
    """Triton launches on the CURRENT CUDA device and its stream: switch to t's GPU when it is another one (a model
    spread over GPUs with device_map), and only then: entering torch.cuda.device() on every call costs host time."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _check_number(who, name, value):
    """A scalar option: a Python number (not a bool, not a tensor) within its _NUMBER_RANGES."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{who}: {name} must be a Python number, got {type(value).__name__}")
    low, high, meaning = _NUMBER_RANGES[name]
    if not low <= value <= high:  # also false for NaN
        raise ValueError(f"{who}: {name} must be in [{low:.3g}, {high:.3g}]{meaning}, got {value}")


def _check_common_args(who, reduction, label_smoothing):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{who}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    _check_number(who, "label_smoothing", label_smoothing)


def _check_extras(who, extras, V=None, device=None, weight_name="weight"):
    """The extras' arguments, a dict of `cross_entropy`'s keywords weight .. return_predicted_tokens (see "Extras"
    below). V and device, which a module's constructor does not know yet, check the class weights' shape and device."""
    weight = extras["weight"]
    if weight is not None:
        what = f"{who}: {weight_name} (class weights)"
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor or None, got {type(weight).__name__}")
        if not weight.dtype.is_floating_point:
            raise TypeError(f"{what} must be floating point, got dtype {weight.dtype}")
        if V is not None and tuple(weight.shape) != (V,):
            raise ValueError(f"{what} must have shape [V] = [{V}], got {tuple(weight.shape)}")
        if device is not None and weight.device != device:
            raise ValueError(f"{what} is on {weight.device}, the other inputs on {device}; put them on one device")
    _check_number(who, "lse_square_scale", extras["lse_square_scale"])
    if extras["softcap"] is not None:
        _check_number(who, "softcap", extras["softcap"])
    for name in ("return_z_loss", "return_token_accuracy", "return_predicted_tokens"):
        if not isinstance(extras[name], bool):
            raise TypeError(f"{who}: {name} must be True or False, got {extras[name]!r}")


def _check_target_range(who, targets, V, ignore_index):
    """Debug mode (`check_targets=True`): one host sync to report the first target outside [0, V)."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
    if bad.any():
        position = bad.reshape(-1).nonzero()[0, 0].item()
        value = targets.reshape(-1)[position].item()
        raise ValueError(f"{who}: target {value} at flat position {position} is outside [0, {V}) and is not "
                         f"ignore_index={ignore_index}")


def _validate_rows(who, rows, targets, reduction, label_smoothing, V=None, name="logits", shapes="[N, V] or [B, T, V]"):
    """The checks both losses make: `rows` (the logits, or the linear cross-entropy's hidden states) 2-D or 3-D,
    floating point, where the kernels run; targets of its shape without the last dim, on its device, int64 (PyTorch's
    class-index dtype) or int32: narrower integers cannot hold ignore_index = -100 next to a 128256-word vocabulary, and
    uint8 would turn -100 into 156, a real class. V (default: the last dim) must not be 0 when there are targets."""
    if not isinstance(rows, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError(f"{who}: {name} and targets must be torch.Tensor")
    if rows.dim() not in (2, 3):
        raise ValueError(f"{who}: {name} must be {shapes}, got shape {tuple(rows.shape)}")
    if not rows.dtype.is_floating_point:
        raise TypeError(f"{who}: {name} must be floating point, got dtype {rows.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{who}: targets must be int64 (or int32) class indices, got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(rows.shape[:-1]):
        raise ValueError(f"{who}: targets must have shape {tuple(rows.shape[:-1])} ({name} shape without the last "
                         f"dim), got {tuple(targets.shape)}")
    if (rows.shape[-1] if V is None else V) == 0 and targets.numel() > 0:
        raise ValueError(f"{who}: the vocabulary has size 0, so no target can be valid")
    if targets.device != rows.device:
        raise ValueError(f"{who}: targets is on {targets.device} but {name} is on {rows.device}; put them on one "
                         f"device")
    if rows.device.type != KERNEL_DEVICE:
        raise ValueError(f"{who}: {name} is on {rows.device}, but the Triton kernels run on {KERNEL_DEVICE} here; "
                         f"move it to {KERNEL_DEVICE}")
    _check_common_args(who, reduction, label_smoothing)


def _validate_cross_entropy(logits, targets, reduction, label_smoothing, extras):
    _validate_rows("cross_entropy", logits, targets, reduction, label_smoothing)
    _check_extras("cross_entropy", extras, V=logits.shape[-1], device=logits.device)


def _row_layout(x):
    """(rows_per_batch, stride_b, stride_t) that map flat row i of a 2-D/3-D tensor to i//T*stride_b + i%T*stride_t."""
    if x.dim() == 3:
        return max(x.shape[1], 1), x.stride(0), x.stride(1)
    return max(x.shape[0], 1), 0, x.stride(0)


# Extras, with Liger-Kernel's names and semantics (see `cross_entropy`), each a constexpr switch of both kernels: with
# all of them off the kernels compile to the same code as without them (a None argument becomes a constexpr).
# - weight, class weights (PyTorch's rule, see _row_loss): all of them are read only with label smoothing.
# - lse_square_scale, the z-loss (PaLM): its gradient 2 * lse_square_scale * lse * softmax is folded into pass 2.
# - softcap (Gemma 2): each logit read becomes softcap * tanh(logit / softcap), in both passes: no extra pass, but a
#   tanh per logit and pass (see _tanh, _capped_softmax_update, and _softmax_gradient for the chain rule).
# - return_token_accuracy, return_predicted_tokens: the argmax per row, from pass 1 (see _lane_argmax_update).
class _Extras(NamedTuple):
    """One launch's extras, None where off: the kernels' extras arguments."""
    weight: Optional[torch.Tensor] = None  # class weights as the kernels read them (_packed_weight)
    lse_square_scale: Optional[float] = None  # the z-loss is on
    z_losses: Optional[torch.Tensor] = None  # [rows] fp32, written: lse_square_scale * lse^2, 0 on ignored rows
    z_scale: Optional[torch.Tensor] = None  # fp32 gradient scale of the z-loss, with the launch's scale_stride
    softcap: Optional[float] = None
    predicted: Optional[torch.Tensor] = None  # [rows] int64, written: argmax per row, -1 on ignored rows


def _packed_weight(weight):
    """Class weights as the kernels read them: fp32, the V weights, their sum at index V, then zeros up to a multiple
    of _MAX_BLOCK_V, so that the partial chunk reads weights without a mask."""
    V = weight.shape[0]
    packed = torch.zeros(triton.cdiv(V + 1, _MAX_BLOCK_V) * _MAX_BLOCK_V, dtype=torch.float32, device=weight.device)
    packed[:V] = weight
    packed[V] = packed[:V].sum()
    return packed


def _launch_cross_entropy(logits, targets_flat, losses, grad, scale, scale_stride, ignore_index, label_smoothing,
                          positive_scale=True, kernel=None, block_v=None, n_streamed=None, n_ring=None,
                          extras=_Extras()):
    """Launch a kernel on prepared tensors: logits [N, V] or [B, T, V] (unit last stride), targets_flat [N], losses [N]
    fp32, grad (logits' shape; None: loss only), scale an fp32 device tensor, extras an _Extras. positive_scale=False
    when the scale can be <= 0 (a user's grad_output); kernel .. n_ring (tests): see _pick_smem_plan."""
    V = logits.shape[-1]
    n_rows = targets_flat.numel()
    if n_rows == 0:
        return
    compute_grad = grad is not None
    on_gpu = not INTERPRETER
    properties = torch.cuda.get_device_properties(logits.device) if on_gpu else None
    rows_per_batch, stride_b, stride_t = _row_layout(logits)
    grad_rows_per_batch, grad_stride_b, grad_stride_t = _row_layout(grad) if compute_grad else (rows_per_batch, 0, 0)
    assert grad_rows_per_batch == rows_per_batch
    # Both kernels take these arguments, in this order; without a gradient the row kernel stores nothing through
    # grad_ptr, which gets the logits as a stand-in.
    args = (logits, grad if compute_grad else logits, targets_flat, losses, scale, n_rows, V, rows_per_batch, stride_b,
            stride_t, grad_stride_b, grad_stride_t, targets_flat.stride(0), scale_stride, ignore_index,
            float(label_smoothing), extras.weight, extras.z_losses, extras.z_scale, extras.predicted,
            extras.lse_square_scale, extras.softcap)
    # Class weights (of any sign) and the z-loss (of the sign of lse) leave the softmax coefficient's sign unknown.
    positive_scale = positive_scale and extras.weight is None and extras.z_losses is None
    switches = dict(HAS_SMOOTHING=label_smoothing > 0.0, POSITIVE_SCALE=positive_scale, FAST_EXP2=on_gpu,
                    HAS_WEIGHT=extras.weight is not None, HAS_Z_LOSS=extras.z_losses is not None,
                    HAS_SOFTCAP=extras.softcap is not None, TRACK_ARGMAX=extras.predicted is not None,
                    FAST_TANH=on_gpu and logits.element_size() == 2)
    # cp.async's 16-byte form needs the base address and the row strides in multiples of 16 bytes (not V = 50257).
    rows_aligned = not on_gpu or (logits.data_ptr() % 16 == 0 and stride_b % 16 == 0 and stride_t % 16 == 0)
    smem_plan = _pick_smem_plan(V, logits.element_size(), n_rows, compute_grad, rows_aligned, properties, kernel,
                                block_v, n_streamed, n_ring, extras.softcap is not None)
    if smem_plan is not None:
        block_v, num_warps, n_chunks, n_streamed, n_ring = smem_plan
        # One program per multiprocessor on the GPU (it takes the shared memory); the interpreter runs them in turn.
        n_programs = min(n_rows, properties.multi_processor_count if on_gpu else 4)
        triton_kernel = _smem_kernel_module()._cross_entropy_smem_kernel
        options = dict(LANE_WIDTH=_LANE_WIDTH, N_CHUNKS=n_chunks, K=n_streamed, Q=n_ring, NUM_WARPS=num_warps)
    else:
        block_v, num_warps, chunks_per_step, maxnreg = _launch_shape(V, logits.element_size(), on_gpu, block_v)
        # The interpreter runs programs one after another anyway: a few suffice there.
        n_programs = min(n_rows, _PROGRAMS_PER_SM * properties.multi_processor_count if on_gpu else 4)
        triton_kernel = _cross_entropy_kernel
        options = dict(LANE_WIDTH=min(_LANE_WIDTH, block_v), COMPUTE_GRAD=compute_grad,
                       CHUNKS_PER_STEP=chunks_per_step, **({"maxnreg": maxnreg} if maxnreg else {}))
    assert extras.weight is None or extras.weight.numel() % block_v == 0, "see _packed_weight"
    with _on_tensor_device(logits):
        triton_kernel[(n_programs,)](*args, BLOCK_V=block_v, num_warps=num_warps, **options, **switches)


def _reduce(losses, reduction, denominator, targets_shape):
    if reduction == "mean":
        # A mean over nothing is NaN, as in PyTorch: no row counts (all ignored, or none), or every counted target's
        # class weight is 0, where label smoothing still leaves positive losses (which would give inf).
        return torch.where(denominator != 0, losses.sum() / denominator, float("nan"))
    if reduction == "sum":
        return losses.sum()
    return losses.view(targets_shape)


class _LossTerms:
    """One call's per-row buffers (the fp32 losses, the extras'), its gradient scales and its result, reduced."""

    def __init__(self, targets, ignore_index, reduction, device, weight=None, lse_square_scale=0.0, softcap=None,
                 return_z_loss=False, return_token_accuracy=False, return_predicted_tokens=False):
        self.targets, self.ignore_index, self.reduction = targets, ignore_index, reduction
        self.targets_flat = targets.reshape(-1)
        n_rows = self.targets_flat.numel()
        self.losses = torch.empty(n_rows, dtype=torch.float32, device=device)
        self.returns = (return_z_loss, return_token_accuracy, return_predicted_tokens)
        # The gradient's scale: 1 for "sum" and "none"; for "mean" 1 / denominator, the number of non-ignored targets
        # or, with class weights, the sum of their weights (PyTorch's rule; a target outside [0, V) adds nothing, its
        # row is NaN anyway), inf when that is 0 (ignored rows get zeros, unscaled). The z-loss's mean and the token
        # accuracy count the non-ignored rows (n_valid) whatever the class weights.
        self.scale = torch.ones((), dtype=torch.float32, device=targets.device)
        self.denominator = self.n_valid = None
        if reduction == "mean" or return_token_accuracy:
            valid = self.targets_flat != ignore_index
            self.n_valid = valid.sum()
        if reduction == "mean":
            self.denominator = self.n_valid
            if weight is not None:
                counted = valid & (self.targets_flat >= 0) & (self.targets_flat < weight.shape[0])
                target_weights = weight.to(torch.float32)[torch.where(counted, self.targets_flat, 0)]
                self.denominator = torch.where(counted, target_weights, 0.0).sum()
            self.scale = 1.0 / self.denominator.to(torch.float32)
        self.extras = _Extras(weight=None if weight is None else _packed_weight(weight),
                              softcap=None if softcap is None else float(softcap))
        if lse_square_scale != 0:  # return_z_loss alone returns zeros, as Liger does, without kernel work
            z_scale = 1.0 / self.n_valid.to(torch.float32) if weight is not None and reduction == "mean" else self.scale
            self.extras = self.extras._replace(lse_square_scale=float(lse_square_scale), z_scale=z_scale,
                                               z_losses=torch.empty(n_rows, dtype=torch.float32, device=device))
        if return_token_accuracy or return_predicted_tokens:
            self.extras = self.extras._replace(predicted=torch.empty(n_rows, dtype=torch.int64, device=device))

    def result(self):
        """The loss (cross-entropy plus z-loss), reduced; with a return_* flag, a CrossEntropyOutput."""
        shape = self.targets.shape
        loss = _reduce(self.losses, self.reduction, self.denominator, shape)
        return_z_loss, return_token_accuracy, _ = self.returns
        z_loss = accuracy = predicted = None
        if self.extras.z_losses is not None:
            z_loss = _reduce(self.extras.z_losses, self.reduction, self.n_valid, shape)
            loss = loss + z_loss
        elif return_z_loss:
            z_loss = _reduce(torch.zeros_like(self.losses), self.reduction, self.n_valid, shape)
        if self.extras.predicted is not None:
            predicted = self.extras.predicted.view(shape)
        if return_token_accuracy:
            # 1.0 where the argmax is the target; ignored rows count 0 ("none") or not at all (mean, sum: a fraction
            # of the non-ignored rows, NaN when there is none, as 0 / 0 in PyTorch).
            correct = ((predicted == self.targets) & (self.targets != self.ignore_index)).to(torch.float32)
            accuracy = correct if self.reduction == "none" else correct.sum() / self.n_valid
        return _from_fields((loss, z_loss, accuracy, predicted), *self.returns)


def cross_entropy_forward(logits, targets, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                          compute_grad=True, inplace_backward=False, check_targets=False, *, weight=None,
                          lse_square_scale=0.0, softcap=None, return_z_loss=False, return_token_accuracy=False,
                          return_predicted_tokens=False, kernel=None, block_v=None, n_streamed=None, n_ring=None):
    """The launcher, without autograd: (loss, grad_logits or None), the loss a CrossEntropyOutput when a return_* flag
    is set. The gradient is already scaled for the reduction (1/n_valid for "mean") as if grad_output were 1; with
    inplace_backward=True it is written into the logits' own storage. weight .. return_predicted_tokens: the extras of
    `cross_entropy`; kernel .. n_ring force a kernel and its shape (tests, see _pick_smem_plan)."""
    extras = dict(weight=weight, lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
                  return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens)
    _validate_cross_entropy(logits, targets, reduction, label_smoothing, extras)
    if check_targets:
        _check_target_range("cross_entropy", targets, logits.shape[-1], ignore_index)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # the kernel needs unit column stride; any row strides are fine
    terms = _LossTerms(targets, ignore_index, reduction, logits.device, **extras)
    grad = None
    if compute_grad:
        grad = logits if inplace_backward else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _launch_cross_entropy(logits, terms.targets_flat, terms.losses, grad, terms.scale, 0, ignore_index,
                          label_smoothing, kernel=kernel, block_v=block_v, n_streamed=n_streamed, n_ring=n_ring,
                          extras=terms.extras)
    return terms.result(), grad


def _scale_rows_(x, scale):
    """x[i, :] *= scale (0-dim) or scale[i] (one per row), in place, on the device; x is 2-D or 3-D (rows = all but
    the last dim, unit last stride). Rows whose scale is exactly 1 cost one load."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    if n_rows == 0:
        return x
    scale = scale.reshape(-1)  # a view when possible: an expanded grad_output keeps stride 0, no copy
    scale_stride = 0 if scale.numel() == 1 else scale.stride(0)
    rows_per_batch, stride_b, stride_t = _row_layout(x)
    block = min(256 if INTERPRETER else 4096, triton.next_power_of_2(n_cols))
    # One warp (32 threads) per 1024 elements of a block, i.e. 32 values per thread, between 4 and 32 warps.
    with _on_tensor_device(x):
        _scale_rows_kernel[(n_rows,)](x, scale, n_cols, rows_per_batch, stride_b, stride_t, scale_stride,
                                      BLOCK=block, num_warps=min(32, max(4, block // 1024)))
    return x


def cross_entropy_backward(grad_logits, grad_output):
    """The backward's only work: grad_logits (from cross_entropy_forward) *= grad_output, in place, returned.
    grad_output is 0-dim ("mean"/"sum") or one value per row ("none"); when it is 1.0 the kernel only reads it."""
    return _scale_rows_(grad_logits, grad_output)


# ----------------------------------------------------------------------------------------------------------------------
# 3. Autograd Function, custom operators (torch.compile), functional API, module
# ----------------------------------------------------------------------------------------------------------------------
class CrossEntropyOutput(NamedTuple):
    """Returned with a return_* flag (Liger-Kernel's fields): None where not asked for; only `loss` has a gradient."""
    loss: torch.Tensor
    z_loss: Optional[torch.Tensor] = None
    token_accuracy: Optional[torch.Tensor] = None
    predicted_tokens: Optional[torch.Tensor] = None


def _function_output(ctx, result):
    """An autograd Function's output: the loss, or the fields of a CrossEntropyOutput, the extras without gradient."""
    if not isinstance(result, CrossEntropyOutput):
        return result
    ctx.mark_non_differentiable(*[value for value in result[1:] if value is not None])
    return tuple(result)


class CrossEntropyFunction(torch.autograd.Function):
    """Forward: the fused kernel computes the loss and the gradient. Backward: scales that gradient by grad_output."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction, label_smoothing, inplace_backward, check_targets,
                weight=None, lse_square_scale=0.0, softcap=None, return_z_loss=False, return_token_accuracy=False,
                return_predicted_tokens=False):
        if inplace_backward:
            # The kernel is about to overwrite the logits with their gradient. Bumping their version counter makes
            # autograd raise "modified by an inplace operation" if another op saved them for its backward.
            torch.autograd.graph.increment_version(logits)
        result, grad = cross_entropy_forward(
            logits, targets, ignore_index, reduction, label_smoothing, True, inplace_backward, check_targets,
            weight=weight, lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
            return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens)
        # Kept on ctx (not save_for_backward): in in-place mode it IS the logits, whose version we just bumped.
        # detach() gives a new tensor object over the same memory; once backward drops ctx's reference, autograd
        # holds the only one and can hand the buffer on as the gradient instead of copying it.
        ctx.grad_logits = grad.detach()
        return _function_output(ctx, result)

    @staticmethod
    def backward(ctx, grad_output, *extras_grads):  # the extras (z_loss, accuracy, predicted) pass no gradient on
        grad = ctx.grad_logits
        if grad is None:
            raise RuntimeError("cross_entropy: the fused backward scales its stored gradient in place and can run "
                               "once; recompute the loss instead of using retain_graph=True")
        ctx.grad_logits = None
        return (cross_entropy_backward(grad, grad_output),) + (None,) * 12


# torch.compile cannot look inside a launcher, so the fused losses become custom operators, opaque nodes of the graph
# (introduced in rmsnorm_kernel.py): register_fake gives their outputs' shapes without running them, register_autograd
# their backward. The forward operator returns the gradient, already scaled for the reduction, as one more
# (non-differentiable) output; the backward multiplies it by grad_output on the device. An operator returns a fixed
# list of tensors, so the CrossEntropyOutput fields not asked for come back as empty tensors, None again in Python.
def _empty(device):
    """The placeholder for an operator output that was not asked for."""
    return torch.empty(0, dtype=torch.float32, device=device)


def _fields(result, device):
    """A loss or CrossEntropyOutput as the four fields an operator returns (placeholders where None)."""
    fields = result if isinstance(result, CrossEntropyOutput) else CrossEntropyOutput(result)
    return tuple(_empty(device) if value is None else value for value in fields)


def _fake_fields(targets, reduction, return_z_loss, return_token_accuracy, return_predicted_tokens):
    """What _fields returns, as empty tensors: fp32, one value or one per row; the predicted tokens int64, per row."""
    shape = targets.shape if reduction == "none" else ()
    fields = ((True, shape, torch.float32), (return_z_loss, shape, torch.float32),
              (return_token_accuracy, shape, torch.float32), (return_predicted_tokens, targets.shape, torch.int64))
    return tuple(torch.empty(field_shape, dtype=dtype, device=targets.device) if wanted else _empty(targets.device)
                 for wanted, field_shape, dtype in fields)


def _from_fields(fields, return_z_loss, return_token_accuracy, return_predicted_tokens):
    """The result from the four fields (an operator's, or _LossTerms'): the loss, or a CrossEntropyOutput."""
    loss, z_loss, accuracy, predicted = fields
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return loss
    return CrossEntropyOutput(loss, z_loss if return_z_loss else None, accuracy if return_token_accuracy else None,
                              predicted if return_predicted_tokens else None)


@torch.library.custom_op("playbook::cross_entropy", mutates_args=())
def _cross_entropy_op(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str,
                      label_smoothing: float, compute_grad: bool, check_targets: bool, weight: Optional[torch.Tensor],
                      lse_square_scale: float, softcap: Optional[float], return_z_loss: bool,
                      return_token_accuracy: bool, return_predicted_tokens: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """cross_entropy_forward as an operator: _fields(result), then grad_logits (a placeholder without compute_grad)."""
    result, grad = cross_entropy_forward(
        logits, targets, ignore_index, reduction, label_smoothing, compute_grad, False, check_targets, weight=weight,
        lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens)
    return *_fields(result, logits.device), _empty(logits.device) if grad is None else grad


@_cross_entropy_op.register_fake
def _(logits, targets, ignore_index, reduction, label_smoothing, compute_grad, check_targets, weight,
      lse_square_scale, softcap, return_z_loss, return_token_accuracy, return_predicted_tokens):
    grad = (torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if compute_grad
            else _empty(logits.device))
    return *_fake_fields(targets, reduction, return_z_loss, return_token_accuracy, return_predicted_tokens), grad


@torch.library.custom_op("playbook::scale_rows_", mutates_args=("x",))
def _scale_rows_op(x: torch.Tensor, scale: torch.Tensor) -> None:
    """x *= scale in place, row by row (cross_entropy_backward), as an operator: the fused losses' backward. It
    declares that it overwrites x (mutates_args), so the compiler knows: it scales the forward's gradient buffer
    itself where nothing else reads that buffer (a backward's saved tensor, under inductor), a copy otherwise."""
    _scale_rows_(x.view(1, -1) if x.dim() == 1 else x, scale)  # a bias gradient is one row


@_scale_rows_op.register_fake
def _(x, scale):
    return None


def _cross_entropy_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])  # only the loss has a gradient
    ctx.save_for_backward(output[4])  # the gradient, already scaled for the reduction


def _cross_entropy_op_backward(ctx, grad_output, *extras_grads):
    (grad_logits,) = ctx.saved_tensors
    # Scaling in place bumps the saved tensor's version counter: a second backward through this graph then fails,
    # as CrossEntropyFunction's does, instead of scaling twice.
    torch.ops.playbook.scale_rows_(grad_logits, grad_output)
    return (grad_logits,) + (None,) * 12


_cross_entropy_op.register_autograd(_cross_entropy_op_backward, setup_context=_cross_entropy_setup_context)


# A `raise` inside code that torch.compile traces makes it quietly run that code eagerly (where the in-place path
# works), so the refusal lives in a function it does not trace: under fullgraph=True the compile fails with its reason.
@torch.compiler.disable(reason="cross_entropy: inplace_backward=True cannot be compiled; pass inplace_backward=False")
def _refuse_compiled_inplace_backward():
    raise ValueError("cross_entropy: inplace_backward=True cannot be compiled: an operator with a registered backward "
                     "may not overwrite its input (the logits); pass inplace_backward=False under torch.compile, "
                     "which gives the gradient its own buffer")


def cross_entropy(logits, targets, ignore_index=-100, reduction="mean", label_smoothing=0.0, inplace_backward=False,
                  check_targets=False, *, weight=None, lse_square_scale=0.0, softcap=None, return_z_loss=False,
                  return_token_accuracy=False, return_predicted_tokens=False):
    """`F.cross_entropy(logits, targets, ...)` for class-index targets, fused; returns the loss in fp32.

    logits [N, V] or [B, T, V] (any row strides) with targets [N] or [B, T], int64 or int32. reduction "mean" (over
    non-ignored rows), "sum" or "none" (per-row losses in the targets' shape, 0 for ignored rows, whose gradient is
    exactly zero). As in PyTorch, a mean over no rows (every target ignored, or N = 0) is NaN, with a zero (or empty)
    gradient; "sum" gives 0 and "none" an empty tensor. Targets outside [0, V) other than ignore_index are never used as
    addresses: their rows are NaN, or check_targets=True raises ValueError (a host sync: a debug mode).

    inplace_backward=True writes the gradient into the logits' own memory during the forward pass (no extra [N, V]
    buffer): the logits must not be used after this call (fine for lm_head's output, which a matmul's backward does not
    need; if another op saved them for its backward, autograd raises). Logits whose last dimension is not contiguous are
    copied first, the gradient going into the copy. Under torch.compile it raises ValueError.

    Extras (Liger-Kernel's names and meaning; how the kernels compute them: "Extras" in section 2):
    - weight: class weights [V], floating point (used in fp32), on the logits' device, as F.cross_entropy's `weight`
      (with label smoothing, and "mean" dividing by the sum of w[target] over non-ignored rows); no gradient.
    - lse_square_scale >= 0: adds the z-loss lse_square_scale * logsumexp(logits)^2 of each non-ignored row,
      unweighted ("mean" divides it by the number of non-ignored rows).
    - softcap > 0 or None: the loss sees softcap * tanh(logits / softcap) instead of the logits.
    - return_z_loss, return_token_accuracy, return_predicted_tokens: the result is then a CrossEntropyOutput (see
      there). z_loss is reduced as the loss, which includes it. token_accuracy: the fraction of non-ignored rows whose
      argmax is the target ("mean", "sum"; NaN when no row counts, as 0 / 0), or 1.0 / 0.0 per row ("none"; 0.0 on
      ignored rows). predicted_tokens: each row's argmax (int64, the targets' shape, -1 on ignored rows, whatever
      ignore_index), the lowest column among equal maxima as torch.argmax, after the softcap (which can make large
      logits equal); undefined for rows with NaN logits."""
    extras = dict(weight=weight, lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
                  return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens)
    compute_grad = torch.is_grad_enabled() and isinstance(logits, torch.Tensor) and logits.requires_grad
    # Eager calls take the autograd.Function, whose dispatch costs tens of microseconds less host time per call than a
    # custom operator's (see rms_norm in rmsnorm_kernel.py); under torch.compile only the operator can be traced.
    if torch.compiler.is_compiling():
        if inplace_backward:
            _refuse_compiled_inplace_backward()
        # Checked here, not in the operator: its schema would turn a flag of 1 into True without a word.
        _validate_cross_entropy(logits, targets, reduction, label_smoothing, extras)
        fields = torch.ops.playbook.cross_entropy(logits, targets, ignore_index, reduction, label_smoothing,
                                                  compute_grad, check_targets, *extras.values())
        return _from_fields(fields[:4], return_z_loss, return_token_accuracy, return_predicted_tokens)
    if compute_grad:
        result = CrossEntropyFunction.apply(logits, targets, ignore_index, reduction, label_smoothing,
                                            inplace_backward, check_targets, *extras.values())
        return CrossEntropyOutput(*result) if isinstance(result, tuple) else result
    return cross_entropy_forward(logits, targets, ignore_index, reduction, label_smoothing, compute_grad=False,
                                 check_targets=check_targets, **extras)[0]


class _LossModule(torch.nn.Module):
    """What both loss modules share: the constructor's options become attributes (the class weights a buffer, so
    that they move with .to()), and each call hands them to the functional loss as keyword arguments."""

    def __init__(self, weight_name, weight, options):
        super().__init__()
        self.register_buffer(weight_name, weight)
        for name, value in options.items():
            setattr(self, name, value)
        self._option_names = (*options, weight_name)

    def _options(self):
        return {name: getattr(self, name) for name in self._option_names}

    def extra_repr(self):
        return ", ".join(f"{name}={getattr(self, name)!r}" for name in self._option_names[:-1])


class TritonCrossEntropyLoss(_LossModule):
    """Drop-in for `nn.CrossEntropyLoss` (class-index targets) and Liger's LigerCrossEntropyLoss, backed by
    `cross_entropy`; the keyword-only arguments are its extras."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, inplace_backward=False,
                 check_targets=False, *, weight=None, lse_square_scale=0.0, softcap=None, return_z_loss=False,
                 return_token_accuracy=False, return_predicted_tokens=False):
        extras = dict(weight=weight, lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
                      return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens)
        _check_common_args("TritonCrossEntropyLoss", reduction, label_smoothing)
        _check_extras("TritonCrossEntropyLoss", extras)
        super().__init__("weight", extras.pop("weight"), dict(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
            inplace_backward=inplace_backward, check_targets=check_targets, **extras))

    def forward(self, logits, targets):
        return cross_entropy(logits, targets, **self._options())


# ----------------------------------------------------------------------------------------------------------------------
# 4. Run as a script
# ----------------------------------------------------------------------------------------------------------------------
def _max_rel_err(x, ref):
    """max |x - ref| / max |ref|, in float64."""
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def _main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64 if INTERPRETER else 4096,
                        help="tokens (default: 4096 on a GPU, 64 on the CPU interpreter)")
    parser.add_argument("--vocab", type=int, default=1000 if INTERPRETER else 128256,
                        help="vocabulary size V (default: 128256 on a GPU, 1000 on the CPU interpreter)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="logits dtype")
    args = parser.parse_args(argv)
    if min(args.rows, args.vocab) < 1:
        parser.error(f"need --rows and --vocab >= 1, got {args.rows} and {args.vocab}")
    import torch.nn.functional as F

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    floor = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    torch.manual_seed(0)
    N, V = args.rows, args.vocab
    targets = torch.randint(0, V, (N,), device=KERNEL_DEVICE)
    targets[torch.rand(N, device=KERNEL_DEVICE) < 0.2] = -100  # 20 % ignored rows, as masked prompt tokens
    logits = (torch.randn(N, V, device=KERNEL_DEVICE) * 3).to(dtype)

    def check(label, loss_fn, reference_fn, extra_ok=True, note=""):
        """Print one line; True if loss_fn passes the tests' rule against reference_fn in float64: the loss within 1e-5,
        the gradient no worse than reference_fn's in the logits' dtype times 3, or under about 1 ulp (floor)."""
        def loss_and_grad(fn, x):
            x = x.detach().clone().requires_grad_()
            loss = fn(x)
            return loss.detach(), torch.autograd.grad(loss, x)[0]
        ref, ours = loss_and_grad(reference_fn, logits.double()), loss_and_grad(loss_fn, logits)
        loss_err, grad_err = _max_rel_err(ours[0], ref[0]), _max_rel_err(ours[1], ref[1])
        torch_err = _max_rel_err(loss_and_grad(reference_fn, logits)[1], ref[1])
        ok = loss_err <= 1e-5 and grad_err <= max(3 * torch_err, floor) and extra_ok
        print(f"{label}: max rel err loss {loss_err:.1e}, grad {grad_err:.1e} (PyTorch {args.dtype}: {torch_err:.1e})"
              f"{note} {'PASS' if ok else 'FAIL'}")
        return ok

    ok = check(f"cross_entropy        {args.dtype} [{N}, {V}]", lambda x: cross_entropy(x, targets),
               lambda x: F.cross_entropy(x, targets))
    # The extras together, and the token accuracy, with every other row's target its argmax.
    class_weights = (torch.rand(V, device=KERNEL_DEVICE) + 0.5).to(dtype)
    argmax = logits.float().argmax(dim=-1)
    valid = targets != -100
    hits = torch.where(valid & (torch.arange(N, device=KERNEL_DEVICE) % 2 == 0), argmax, targets)
    extras = dict(weight=class_weights, lse_square_scale=1e-4, softcap=30.0, label_smoothing=0.1)

    def reference_extras(x):
        capped = 30.0 * torch.tanh(x / 30.0)
        z_loss = torch.where(valid, 1e-4 * torch.logsumexp(capped, dim=-1) ** 2, 0.0).sum() / valid.sum()
        return F.cross_entropy(capped, hits, weight=class_weights.to(x.dtype), label_smoothing=0.1) + z_loss

    accuracy = cross_entropy(logits, hits, return_token_accuracy=True, **extras).token_accuracy
    ok &= check("  + extras           weight, z-loss, softcap, smoothing", lambda x: cross_entropy(x, hits, **extras),
                reference_extras, accuracy == (argmax == hits)[valid].float().mean(),  # the lowest among equal maxima
                f"; token accuracy {accuracy.item():.3f}")
    return 0 if ok else 1


if __name__ == "__main__":
    # cross_entropy_smem_kernel imports its helpers from `cross_entropy_kernel`: it finds this run's module under that
    # name instead of running the file a second time (a second copy of every kernel, operators registered again).
    sys.modules.setdefault("cross_entropy_kernel", sys.modules[__name__])
    sys.exit(_main())
