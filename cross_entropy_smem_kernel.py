"""The shared-memory cross-entropy kernel for Hopper-class GPUs (compute capability 9.x), written in Gluon.

cross_entropy_kernel.py is a complete cross-entropy; read it first. This module makes its launcher faster where the
hardware allows, with the same results and arguments; the launcher imports it only where it may run.

Why shared memory
-----------------
The row kernel reads each row twice (pass 1: softmax statistics, pass 2: gradient), and pass 2 finds only part of
the row still in L2: at 16384 x 128256 bf16 it reads about 6.2 GB for 4.2 GB of logits. A Hopper multiprocessor has
227 KB of shared memory, most of a 250 KB row of LLaMA-3's vocabulary, so this kernel keeps the row there and pass 2
reads it from shared memory, not from HBM (about 4.4 GB read; both figures from Nsight Compute on an H200, see
results/NOTES.md).

Why Gluon
---------
Plain Triton decides on its own what goes to shared memory. Gluon (triton.experimental.gluon), Triton's lower-level
dialect, is the same Python-embedded language with explicit register layouts, explicit shared-memory buffers and
explicit asynchronous copies (`cp.async`: global -> shared without passing through registers). The arithmetic is the
row kernel's: the same online softmax, exp2 and gradient helpers, imported from online_softmax.py (Gluon code can
call @triton.jit functions).

The schedule: a ring of Q slots for K streamed chunks, the rest kept
--------------------------------------------------------------------
One program per multiprocessor (it takes all the shared memory) walks over rows p, p + P, ... A row is N_CHUNKS chunks
of BLOCK_V columns plus a partial chunk (kept in registers). Chunks 0..K-1 are "streamed": loaded into a small ring of
Q shared-memory slots for pass 1 (evict_last, so that the second load, for pass 2, finds them in L2) and loaded again
for pass 2. The other chunks are "kept": each has its own slot, loaded once and read by both passes. Each pass visits
the chunks in the same order (streamed ones spread evenly among the kept), one chunk per "step". A slot is refilled by
the step that frees it:
- pass 2 of row r, once done with a kept chunk, loads the same chunk of row r + P into that slot, so the next row is
  in flight while this row's gradient is written (these loads were issued N_CHUNKS steps before their use);
- a ring slot is refilled with the streamed item Q items further on (the next load for pass 1 or pass 2, of this row
  or the next).
Each step commits one group of cp.async copies (possibly empty), so how many groups separate a load from its use is
known when the kernel is compiled, and `wait_group(n)` ("wait until at most n groups are in flight") waits for exactly
the data the step needs. Each thread copies and then reads the same 8 columns, so its own wait covers what it reads;
Gluon adds a barrier for the whole program after each wait and before each refill as well.

An ignored row reads nothing: its copies are skipped with a branch (not masked: a masked cp.async is slower), its pass 1
only commits its (empty) groups, which keeps the wait counts fixed, and its pass 2 stores zeros. Program p takes every
P-th row, so an ignore mask whose period divides P (every other row ignored) leaves half the programs idle; fine-tuning
masks come in runs of prompt and padding tokens instead.

Where it runs
-------------
The launcher (cross_entropy_kernel._pick_smem_plan) sends it 16-bit logits with a gradient, no softcap, enough rows
and 16-byte-aligned rows, on compute capability 9.x when the installed Gluon has every name this module uses. On the
CPU interpreter the same source runs through a stand-in for those names (the appendix at the end), which models
cp.async closely enough that the CPU tests check the schedule's wait counts.
"""
# online_softmax first: without a GPU it switches Triton to its CPU interpreter before triton is imported.
from online_softmax import (INTERPRETER, _LANE_WIDTH, _argmax_lane, _gradient_scales, _lane_argmax_update,
                            _merge_lanes, _online_softmax_update, _round_to, _row_loss, _row_start, _softcap,
                            _softcap_slope, _softmax_gradient, _store_argmax)
import triton
import triton.language as tl

if INTERPRETER:
    # The CPU interpreter sees this kernel as plain Triton; `gl` and `async_copy` are then the stand-in of the
    # appendix at the end of this file, where `_barrier` is chosen too (Gluon renamed its barrier).
    _gluon_jit = triton.jit
else:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    _gluon_jit = gluon.jit

_NO_CHUNK = tl.constexpr(2**31 - 1)  # a lane's chunk before any (see _lane_argmax_update): larger than every chunk


# ----------------------------------------------------------------------------------------------------------------------
# 1. The schedule: its bookkeeping (fixed when the kernel is compiled) and one step of each pass
# ----------------------------------------------------------------------------------------------------------------------
# The schedule's bookkeeping, evaluated when the kernel is compiled (constexpr functions of the step index u, the
# chunk count N, the streamed count K and the ring size Q). Streamed "items" of a row: 0..K-1 are the pass-1 loads of
# chunks 0..K-1, K..2K-1 their pass-2 re-loads.
@triton.constexpr_function
def _is_streamed(u, N, K):
    """Step u of a pass handles a streamed chunk: K of the N steps, evenly spread."""
    return (u + 1) * K // N > u * K // N


@triton.constexpr_function
def _streamed_chunk(u, N, K):
    return u * K // N


@triton.constexpr_function
def _kept_chunk(u, N, K):
    return K + u - (u + 1) * K // N


@triton.constexpr_function
def _item_step(item, N, K):
    """The step of the row (0..2N-1; pass 2's steps are N..2N-1) that uses streamed item `item`."""
    chunk = item % K
    return (item // K) * N + ((chunk + 1) * N + K - 1) // K - 1


@triton.constexpr_function
def _item_wait_count(item, N, K, Q):
    """Groups committed after item's load, before the step that uses it: the item was loaded by the step that used
    item - Q (same ring slot), in this row or, for the first Q items, in the previous row (2N steps earlier)."""
    if item >= Q:
        loaded_at = _item_step(item - Q, N, K)
    else:
        loaded_at = _item_step(item - Q + 2 * K, N, K) - 2 * N
    return _item_step(item, N, K) - 1 - loaded_at


@_gluon_jit
def _smem_prologue_step(U: tl.constexpr, ring, kept, first_row_ptr, first_valid, chunk_offsets, N: tl.constexpr,
                        K: tl.constexpr, Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pass-2 step U of a row before the first: issue what it would issue for the first row."""
    if first_valid:
        if _is_streamed(U, N, K):
            ITEM: tl.constexpr = K + _streamed_chunk(U, N, K)
            if ITEM + Q >= 2 * K:  # refills its slot with the next row's pass-1 item ITEM + Q - 2K
                async_copy.async_copy_global_to_shared(ring.index((ITEM + Q - 2 * K) % Q),
                                                       first_row_ptr + (ITEM + Q - 2 * K) * BLOCK_V + chunk_offsets,
                                                       eviction_policy="evict_last")
        else:
            CHUNK: tl.constexpr = _kept_chunk(U, N, K)
            async_copy.async_copy_global_to_shared(kept.index(CHUNK - K),
                                                   first_row_ptr + CHUNK * BLOCK_V + chunk_offsets,
                                                   eviction_policy="evict_first")
    async_copy.commit_group()


@_gluon_jit
def _smem_pass1_step(U: tl.constexpr, ring, ring_base, kept, logits_row, valid, chunk_offsets, lane_max, lane_sum,
                     sum_x_tile, tile: tl.constexpr, N: tl.constexpr, K: tl.constexpr, Q: tl.constexpr,
                     BLOCK_V: tl.constexpr, HAS_SMOOTHING: tl.constexpr, FAST_EXP2: tl.constexpr, lane_chunk,
                     weight_ptr, softcap, HAS_WEIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr,
                     TRACK_ARGMAX: tl.constexpr):
    if valid:  # an ignored row's slots were never filled: nothing to wait for or read, only the group to commit
        if _is_streamed(U, N, K):
            ITEM: tl.constexpr = _streamed_chunk(U, N, K)  # pass-1 item ITEM is chunk ITEM
            CHUNK: tl.constexpr = ITEM
            slot = ring.index((ring_base + ITEM) % Q)
            async_copy.wait_group(_item_wait_count(ITEM, N, K, Q))
            x = slot.load(tile).to(tl.float32)
            if HAS_SOFTCAP:  # extras as in _row_statistics
                x = _softcap(x, softcap, FAST_EXP2, FAST_TANH)
            if TRACK_ARGMAX:
                lane_chunk = _lane_argmax_update(x, CHUNK, lane_max, lane_chunk, IN_ORDER=False)
            lane_max, lane_sum = _online_softmax_update(x, lane_max, lane_sum, FAST_EXP2)
            # Refill the slot with item ITEM + Q of this row: a later pass-1 chunk, or a pass-2 re-load.
            if ITEM + Q < K:
                async_copy.async_copy_global_to_shared(slot, logits_row + (ITEM + Q) * BLOCK_V + chunk_offsets,
                                                       eviction_policy="evict_last")
            else:
                async_copy.async_copy_global_to_shared(slot, logits_row + (ITEM + Q - K) * BLOCK_V + chunk_offsets,
                                                       eviction_policy="evict_first")
        else:
            CHUNK: tl.constexpr = _kept_chunk(U, N, K)
            # Loaded at the same step of the previous row's pass 2: 2N - 1 - N groups ago.
            async_copy.wait_group(N - 1)
            x = kept.index(CHUNK - K).load(tile).to(tl.float32)
            if HAS_SOFTCAP:
                x = _softcap(x, softcap, FAST_EXP2, FAST_TANH)
            if TRACK_ARGMAX:
                lane_chunk = _lane_argmax_update(x, CHUNK, lane_max, lane_chunk, IN_ORDER=True)
            lane_max, lane_sum = _online_softmax_update(x, lane_max, lane_sum, FAST_EXP2)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                sum_x_tile += x * gl.load(weight_ptr + CHUNK * BLOCK_V + chunk_offsets)
            else:
                sum_x_tile += x
    async_copy.commit_group()
    return lane_max, lane_sum, sum_x_tile, lane_chunk


@_gluon_jit
def _smem_store_gradient(x, valid, grad_row, CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, chunk_offsets, row_max,
                         exponent_offset, scale, smoothing_term, POSITIVE_SCALE: tl.constexpr,
                         HAS_SMOOTHING: tl.constexpr, FAST_EXP2: tl.constexpr, weight_ptr, softcap,
                         HAS_WEIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr):
    if valid:
        grad = _softmax_gradient(x, row_max, exponent_offset, scale, smoothing_term, POSITIVE_SCALE, HAS_SMOOTHING,
                                 FAST_EXP2, CHUNK * BLOCK_V + chunk_offsets, weight_ptr, softcap, HAS_WEIGHT,
                                 HAS_SOFTCAP, FAST_TANH)
    else:  # an ignored row: its slots were never filled (they hold an older row), the gradient is exactly 0
        grad = gl.zeros_like(x)
    tl.store(grad_row + CHUNK * BLOCK_V + chunk_offsets, _round_to(grad, grad_row.dtype.element_ty),
             eviction_policy="evict_first")


@_gluon_jit
def _smem_pass2_step(U: tl.constexpr, ring, ring_base, kept, logits_row, valid, next_row_ptr, next_valid, grad_row,
                     chunk_offsets, row_max, exponent_offset, scale, smoothing_term, tile: tl.constexpr,
                     N: tl.constexpr, K: tl.constexpr, Q: tl.constexpr, BLOCK_V: tl.constexpr,
                     POSITIVE_SCALE: tl.constexpr, HAS_SMOOTHING: tl.constexpr, FAST_EXP2: tl.constexpr, weight_ptr,
                     softcap, HAS_WEIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr):
    if _is_streamed(U, N, K):
        ITEM: tl.constexpr = K + _streamed_chunk(U, N, K)  # pass-2 item ITEM re-loads chunk ITEM - K
        CHUNK: tl.constexpr = ITEM - K
        slot = ring.index((ring_base + ITEM) % Q)
        async_copy.wait_group(_item_wait_count(ITEM, N, K, Q))
        x = slot.load(tile).to(tl.float32)
        _smem_store_gradient(x, valid, grad_row, CHUNK, BLOCK_V, chunk_offsets, row_max, exponent_offset, scale,
                             smoothing_term, POSITIVE_SCALE, HAS_SMOOTHING, FAST_EXP2, weight_ptr, softcap, HAS_WEIGHT,
                             HAS_SOFTCAP, FAST_TANH)
        if ITEM + Q < 2 * K:  # a later re-load of this row
            if valid:
                async_copy.async_copy_global_to_shared(slot, logits_row + (ITEM + Q - K) * BLOCK_V + chunk_offsets,
                                                       eviction_policy="evict_first")
        else:  # a pass-1 chunk of the next row
            if next_valid:
                async_copy.async_copy_global_to_shared(slot,
                                                       next_row_ptr + (ITEM + Q - 2 * K) * BLOCK_V + chunk_offsets,
                                                       eviction_policy="evict_last")
    else:
        CHUNK: tl.constexpr = _kept_chunk(U, N, K)
        x = kept.index(CHUNK - K).load(tile).to(tl.float32)
        _smem_store_gradient(x, valid, grad_row, CHUNK, BLOCK_V, chunk_offsets, row_max, exponent_offset, scale,
                             smoothing_term, POSITIVE_SCALE, HAS_SMOOTHING, FAST_EXP2, weight_ptr, softcap, HAS_WEIGHT,
                             HAS_SOFTCAP, FAST_TANH)
        # The slot's last use in this row: load the next row's chunk into it.
        if next_valid:
            async_copy.async_copy_global_to_shared(kept.index(CHUNK - K),
                                                   next_row_ptr + CHUNK * BLOCK_V + chunk_offsets,
                                                   eviction_policy="evict_first")
    async_copy.commit_group()


# ----------------------------------------------------------------------------------------------------------------------
# 2. The kernel
# ----------------------------------------------------------------------------------------------------------------------
@_gluon_jit
def _cross_entropy_smem_kernel(
    logits_ptr, grad_ptr, targets_ptr, losses_ptr, scale_ptr,  # as in _cross_entropy_kernel
    n_rows, V, rows_per_batch, logits_stride_b, logits_stride_t, grad_stride_b, grad_stride_t, targets_stride,
    scale_stride, ignore_index, label_smoothing,
    weight_ptr, z_losses_ptr, z_scale_ptr, predicted_ptr, lse_square_scale, softcap,  # extras, as in the row kernel
    BLOCK_V: tl.constexpr,  # chunk width (power of 2)
    LANE_WIDTH: tl.constexpr,  # columns per lane, i.e. per thread and chunk (8 x 2 bytes = one 16-byte copy)
    N_CHUNKS: tl.constexpr,  # V // BLOCK_V whole chunks per row (the partial rest stays in registers)
    K: tl.constexpr,  # streamed chunks per row (1 <= K < N_CHUNKS)
    Q: tl.constexpr,  # ring slots for them (1 <= Q <= K)
    HAS_SMOOTHING: tl.constexpr, POSITIVE_SCALE: tl.constexpr, FAST_EXP2: tl.constexpr,
    NUM_WARPS: tl.constexpr,  # = num_warps: Gluon layouts name the warps explicitly
    HAS_WEIGHT: tl.constexpr, HAS_Z_LOSS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, TRACK_ARGMAX: tl.constexpr,
    FAST_TANH: tl.constexpr,
):
    N: tl.constexpr = N_CHUNKS
    N_LANES: tl.constexpr = BLOCK_V // LANE_WIDTH
    # Register layout of a chunk, [N_LANES, LANE_WIDTH]: each thread holds whole lanes (8 contiguous columns), so a
    # lane's reduction stays in the thread, as in the row kernel. The same layout serves the copies, so each thread
    # reads back exactly the bytes its own cp.async wrote.
    tile: tl.constexpr = gl.BlockedLayout([1, LANE_WIDTH], [32, 1], [NUM_WARPS, 1], [1, 0])
    lanes: tl.constexpr = gl.SliceLayout(1, tile)
    columns: tl.constexpr = gl.SliceLayout(0, tile)
    unswizzled: tl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # a thread's 16 bytes stay contiguous
    kept = gl.allocate_shared_memory(logits_ptr.dtype.element_ty, [N - K, N_LANES, LANE_WIDTH], unswizzled)
    ring = gl.allocate_shared_memory(logits_ptr.dtype.element_ty, [Q, N_LANES, LANE_WIDTH], unswizzled)
    lane_index = gl.arange(0, N_LANES, layout=lanes)
    chunk_offsets = lane_index[:, None] * LANE_WIDTH + gl.arange(0, LANE_WIDTH, layout=columns)[None, :]
    partial_offsets = N * BLOCK_V + chunk_offsets
    partial_mask = partial_offsets < V
    n_programs = gl.num_programs(0)

    # An ignored row's logits are never read: the copies of a row are skipped (a branch taken by the whole program,
    # not a copy mask) when its target is ignore_index, and past the last row. Each row's target is loaded one row
    # ahead, so the row can start without waiting for it.
    row = tl.cast(gl.program_id(0), tl.int64)
    target = gl.load(targets_ptr + row * targets_stride).to(tl.int64)
    logits_row = _row_start(logits_ptr, row, rows_per_batch, logits_stride_b, logits_stride_t)
    # Prologue: the first row's loads, as the pass 2 of a row before it would issue them (one group per step).
    for u in gl.static_range(N):
        async_copy.commit_group()  # that row's pass 1
    for u in gl.static_range(N):
        _smem_prologue_step(u, ring, kept, logits_row, target != ignore_index, chunk_offsets, N, K, Q, BLOCK_V)

    ring_base = 0  # ring slot of this row's item 0: each row moves the ring on by 2K items
    for row_index in range(gl.program_id(0), n_rows, n_programs):
        row = tl.cast(row_index, tl.int64)
        logits_row = _row_start(logits_ptr, row, rows_per_batch, logits_stride_b, logits_stride_t)
        grad_row = _row_start(grad_ptr, row, rows_per_batch, grad_stride_b, grad_stride_t)
        valid = target != ignore_index
        next_row = gl.minimum(row + n_programs, n_rows - 1)  # clamped: a valid address even past the end
        next_target = gl.load(targets_ptr + next_row * targets_stride).to(tl.int64)
        next_valid = (row + n_programs < n_rows) & (next_target != ignore_index)
        next_row_ptr = _row_start(logits_ptr, next_row, rows_per_batch, logits_stride_b, logits_stride_t)

        target_ok = (target >= 0) & (target < V)
        x_target = gl.load(logits_row + target, mask=target_ok & valid, other=0.0).to(tl.float32)
        x_partial = gl.load(logits_row + partial_offsets, mask=partial_mask & valid, other=float("-inf"))
        x_partial = x_partial.to(tl.float32)

        # ---- pass 1: online softmax statistics ----
        lane_max = gl.full([N_LANES], float("-inf"), tl.float32, lanes)
        lane_sum = gl.zeros([N_LANES], tl.float32, lanes)
        sum_x_tile = gl.zeros([N_LANES, LANE_WIDTH], tl.float32, tile)
        lane_chunk = gl.full([N_LANES], _NO_CHUNK, tl.int32, lanes)  # extra: see _lane_argmax_update
        for u in gl.static_range(N):
            lane_max, lane_sum, sum_x_tile, lane_chunk = _smem_pass1_step(
                u, ring, ring_base, kept, logits_row, valid, chunk_offsets, lane_max, lane_sum, sum_x_tile, tile,
                N, K, Q, BLOCK_V, HAS_SMOOTHING, FAST_EXP2, lane_chunk, weight_ptr, softcap, HAS_WEIGHT, HAS_SOFTCAP,
                FAST_TANH, TRACK_ARGMAX)
        x = x_partial
        if HAS_SOFTCAP:  # extras as in _row_statistics
            x = gl.where(partial_mask, _softcap(x_partial, softcap, FAST_EXP2, FAST_TANH), float("-inf"))
        if TRACK_ARGMAX:
            lane_chunk = _lane_argmax_update(x, N, lane_max, lane_chunk, IN_ORDER=True)
        lane_max, lane_sum = _online_softmax_update(x, lane_max, lane_sum, FAST_EXP2)
        if HAS_SMOOTHING:
            if HAS_WEIGHT:
                sum_x_tile += gl.where(partial_mask, x, 0.0) * gl.load(weight_ptr + partial_offsets)
            else:
                sum_x_tile += gl.where(partial_mask, x, 0.0)
        # An ignored row read nothing (every lane max -inf): its statistics are NaN, discarded by the `valid` selects.
        if INTERPRETER:
            # On the interpreter only (a constexpr: the GPU code has no such lines), finite placeholders instead, so
            # that numpy does not warn about the -inf - (-inf) of the merge and of the gradient below.
            lane_max = gl.where(valid, lane_max, 0.0)
            lane_sum = gl.where(valid, lane_sum, 1.0)
        row_max, row_sum, argmax_start = _merge_lanes(lane_max, lane_sum, FAST_EXP2,
                                                      lane_chunk * BLOCK_V + lane_index * LANE_WIDTH, V, TRACK_ARGMAX)
        lse = row_max + gl.log(row_sum)
        logit_target = x_target
        weight_target = 1.0
        weight_total = 1.0
        if HAS_SOFTCAP:  # extras as in the row kernel
            logit_target = _softcap(x_target, softcap, FAST_EXP2, FAST_TANH)
        if HAS_WEIGHT:
            weight_target = gl.load(weight_ptr + target, mask=target_ok & valid, other=0.0)
            weight_total = gl.load(weight_ptr + V)
        loss = _row_loss(row_max, row_sum, logit_target, sum_x_tile, label_smoothing, V, HAS_SMOOTHING,
                         weight_target, weight_total, HAS_WEIGHT)
        gl.store(losses_ptr + row, gl.where(valid, gl.where(target_ok, loss, float("nan")), 0.0))
        if HAS_Z_LOSS:
            gl.store(z_losses_ptr + row, gl.where(valid, lse_square_scale * lse * lse, 0.0))
        if TRACK_ARGMAX:
            # Read before pass 2 overwrites it in place, used at the end of the row (see the row kernel). Here the
            # layout is explicit: the thread that reads a lane is the one that overwrites it in pass 2, so program
            # order alone keeps the read first, with no barrier.
            argmax_columns, is_argmax_lane = _argmax_lane(argmax_start, lane_index, chunk_offsets, BLOCK_V,
                                                          LANE_WIDTH)
            x_argmax = gl.load(logits_row + argmax_columns,
                               mask=is_argmax_lane[:, None] & (argmax_columns < V) & valid, other=float("-inf"))

        # ---- pass 2: gradient (zeros for an ignored row) ----
        row_scale = gl.load(scale_ptr + row * scale_stride).to(tl.float32)
        scale = gl.where(valid, row_scale, 0.0)
        softmax_scale, target_scale = _gradient_scales(scale, label_smoothing, V, weight_target, weight_total, lse,
                                                       lse_square_scale, z_scale_ptr, row * scale_stride, HAS_WEIGHT,
                                                       HAS_Z_LOSS)
        if HAS_Z_LOSS:
            softmax_scale = gl.where(valid, softmax_scale, 0.0)  # an ignored row's lse is NaN (or a placeholder)
        exponent_offset = gl.log2(row_sum)
        if POSITIVE_SCALE:
            exponent_offset -= gl.log2(gl.where(valid, row_scale, 1.0))
        exponent_offset = gl.where(target_ok, exponent_offset, float("nan"))  # bad target: NaN gradient
        exponent_offset = gl.where(valid, exponent_offset, float("inf"))
        smoothing_term = scale * (label_smoothing / V)
        grad = _softmax_gradient(x_partial, row_max, exponent_offset, softmax_scale, smoothing_term, POSITIVE_SCALE,
                                 HAS_SMOOTHING, FAST_EXP2, partial_offsets, weight_ptr, softcap, HAS_WEIGHT,
                                 HAS_SOFTCAP, FAST_TANH)
        gl.store(grad_row + partial_offsets, _round_to(gl.where(valid, grad, 0.0), grad_ptr.dtype.element_ty),
                 mask=partial_mask, eviction_policy="evict_first")
        for u in gl.static_range(N):
            _smem_pass2_step(u, ring, ring_base, kept, logits_row, valid, next_row_ptr, next_valid, grad_row,
                             chunk_offsets, row_max, exponent_offset, softmax_scale, smoothing_term, tile, N, K, Q,
                             BLOCK_V, POSITIVE_SCALE, HAS_SMOOTHING, FAST_EXP2, weight_ptr, softcap, HAS_WEIGHT,
                             HAS_SOFTCAP, FAST_TANH)
        # The one-hot term, after every thread's stores of this row (as in the row kernel).
        _barrier()
        one_hot = target_scale * (1.0 - label_smoothing)
        if HAS_SOFTCAP:
            one_hot = one_hot * _softcap_slope(logit_target, softcap)
        # An ignored row or a target outside [0, V) must not address the class weights: class 0's stands in (the
        # store below is masked off for them).
        target_grad = _softmax_gradient(x_target, row_max, exponent_offset, softmax_scale, smoothing_term,
                                        POSITIVE_SCALE, HAS_SMOOTHING, FAST_EXP2, gl.where(target_ok, target, 0),
                                        weight_ptr, softcap, HAS_WEIGHT, HAS_SOFTCAP, FAST_TANH) - one_hot
        gl.store(grad_row + target, _round_to(target_grad, grad_ptr.dtype.element_ty), mask=target_ok & valid)
        if TRACK_ARGMAX:
            if valid:
                _store_argmax(x_argmax.to(tl.float32), argmax_columns, is_argmax_lane, predicted_ptr + row, V,
                              softcap, HAS_SOFTCAP, FAST_EXP2, FAST_TANH)
            else:
                gl.store(predicted_ptr + row, -1)
        ring_base = (ring_base + 2 * K) % Q
        target = next_target
    async_copy.wait_group(0)  # no copy may still be writing shared memory when the program exits


# ----------------------------------------------------------------------------------------------------------------------
# 3. The plan: chunk width, warps and schedule for a launch
# ----------------------------------------------------------------------------------------------------------------------
def _smem_plan(V, itemsize, properties, block_v=None, n_streamed=None, n_ring=None):
    """(BLOCK_V, num_warps, N_CHUNKS, K, Q) for the shared-memory kernel, or None where it does not apply: fp32
    logits (half as much of the row would fit), vocabularies under two chunks, a GPU without ~200 KB of shared memory
    per block. Which GPUs may run it at all is _smem_kernel_allowed's rule. The keywords are for tests.
    `properties`: torch.cuda.get_device_properties of the logits' GPU, None on the CPU interpreter.

    GPU: 8192-wide chunks, 32 warps, K = 4 streamed chunks through Q = 2 ring slots (the fastest measured on an H200,
    see results/NOTES.md), more streamed chunks when the kept ones would not fit. CPU interpreter: 256-wide chunks
    (one warp of 8-column lanes) and about half the chunks streamed through two slots, so that the tests run every
    kind of step.
    """
    if itemsize != 2:
        return None
    if properties is not None:
        shared_bytes = getattr(properties, "shared_memory_per_block_optin", 0)
        if shared_bytes < 200 * 1024:
            return None
        block_v = block_v or 8192
        slot_budget = (shared_bytes - 4096) // (block_v * itemsize)  # 4 KB for the reductions' scratch
    else:
        block_v = block_v or 256
        slot_budget = None
    n_chunks = V // block_v
    if n_chunks < 2:
        return None
    if properties is not None:
        n_streamed = n_streamed or min(4, n_chunks - 1)
        n_ring = n_ring or min(2, n_streamed)
        n_streamed = max(n_streamed, n_chunks + n_ring - slot_budget)  # the kept chunks must fit
    else:
        n_streamed = n_streamed or (n_chunks + 1) // 2
        n_ring = n_ring or min(2, n_streamed)
    if not 1 <= n_ring <= n_streamed < n_chunks:
        raise ValueError(f"cross_entropy_forward: need 1 <= n_ring ({n_ring}) <= n_streamed ({n_streamed}) "
                         f"< V // block_v ({n_chunks})")
    num_warps = max(1, block_v // (_LANE_WIDTH * 32))  # one thread per 8-column lane
    return block_v, num_warps, n_chunks, n_streamed, n_ring


# ----------------------------------------------------------------------------------------------------------------------
# Appendix: running the Gluon kernel on the CPU interpreter
# ----------------------------------------------------------------------------------------------------------------------
# Gluon does not run on Triton's CPU interpreter, so there the same kernel source runs as a Triton kernel through a
# small stand-in for the Gluon names it uses: layouts are ignored, a shared-memory slot is a Python value, and an
# asynchronous copy lands only when the wait_group that covers it runs. The CPU tests thus check the schedule: which
# chunk is in which slot at each step, and the wait counts.
class _InterpretedGluon:
    """The Gluon names the shared-memory kernel uses, on top of triton.language, for the CPU interpreter."""

    class _Layout:
        def __init__(self, *args, **kwargs):
            pass

    BlockedLayout = SliceLayout = SwizzledSharedLayout = _Layout

    class _SharedSlot:
        def __init__(self, buffer, index):
            self.buffer, self.index = buffer, int(index)

        def store(self, value):
            self.buffer.values[self.index] = value

        def load(self, layout):
            if self.index not in self.buffer.values:  # never filled (an ignored first row): whatever, as on the GPU
                return tl.zeros(self.buffer.slot_shape, self.buffer.dtype)
            return self.buffer.values[self.index]

    class _SharedBuffer:
        def __init__(self, dtype, slot_shape):
            self.dtype, self.slot_shape, self.values = dtype, slot_shape, {}

        def index(self, i):
            return _InterpretedGluon._SharedSlot(self, i)

    def __getattr__(self, name):
        # Looked up at call time: the interpreter patches triton.language's functions while a kernel runs.
        return getattr(tl, name)

    @staticmethod
    def allocate_shared_memory(dtype, shape, layout):
        _InterpretedGluon._open_group, _InterpretedGluon._committed_groups = [], []  # a program starts with no copies
        return _InterpretedGluon._SharedBuffer(dtype, list(shape[1:]))

    @staticmethod
    def arange(start, end, layout=None):
        return tl.arange(start, end)

    @staticmethod
    def full(shape, value, dtype, layout=None):
        return tl.full(shape, value, dtype)

    @staticmethod
    def zeros(shape, dtype, layout=None):
        return tl.zeros(shape, dtype)

    @staticmethod
    def barrier():
        return tl.debug_barrier()

    # cp.async, modelled as the GPU allows it to behave, so that the CPU tests check the kernel's wait counts: a copy
    # fills its slot with NaN when issued (the slot's contents are undefined while the copy is in flight) and reads
    # global memory only when a wait_group completes its group (as late as the GPU may read it). A read before the
    # right wait, or a refill before the slot's last read, then gives NaN losses or gradients.
    _open_group, _committed_groups = [], []  # copies issued since the last commit; committed groups, oldest first

    @staticmethod
    def async_copy_global_to_shared(slot, pointer, eviction_policy=""):
        slot.store(tl.full(slot.buffer.slot_shape, float("nan"), tl.float32).to(slot.buffer.dtype))
        _InterpretedGluon._open_group.append((slot, pointer))

    @staticmethod
    def commit_group():
        _InterpretedGluon._committed_groups.append(_InterpretedGluon._open_group)
        _InterpretedGluon._open_group = []

    @staticmethod
    def wait_group(num_outstanding):
        groups = _InterpretedGluon._committed_groups
        while len(groups) > num_outstanding:  # the interpreter passes constexpr counts as Python ints
            for slot, pointer in groups.pop(0):
                slot.store(tl.load(pointer))



if INTERPRETER:
    gl = async_copy = _InterpretedGluon()  # noqa: F811 (on a GPU, the real ones, imported at the top)
# A barrier for all the threads of a program: Gluon's thread_barrier in Triton 3.6, renamed barrier in Triton 3.7.
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
