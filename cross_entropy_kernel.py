"""Fused cross-entropy: loss AND gradient in one pass over the logits, with online softmax (Triton).

What it computes
----------------
For one row of logits x[0..V) and its target class t (PyTorch's `F.cross_entropy`, class-index targets):

    lse    = log(sum_j exp(x_j))                       # log-sum-exp, the softmax normalizer
    loss   = lse - (1 - eps) * x_t - (eps / V) * sum_j x_j
    dx_j   = scale * (softmax(x)_j - (1 - eps) * [j == t] - eps / V)

eps is the label smoothing (0 by default, which leaves the familiar `lse - x_t` and `softmax - onehot`). This is
PyTorch's definition: loss = (1 - eps) * nll + (eps / V) * sum_j (-log p_j), and -log p_j = lse - x_j. `scale` is
1 / (number of non-ignored rows) for reduction="mean" and 1 for "sum"/"none". A row whose target equals
`ignore_index` (padding, masked prompt tokens) has loss 0 and gradient exactly 0, and does not count in the mean.

Why fuse, and why compute the gradient in the forward pass
-----------------------------------------------------------
The logits of an LLM are huge: LLaMA-3's vocabulary has V = 128256 entries, so 16384 tokens make 4.2 GB of bf16 logits.
PyTorch's path (log_softmax, then nll_loss; transformers first upcasts to fp32) writes a full [N, V] fp32 log-softmax
for the backward and reads and writes the rows several times: 26.9 ms and +24 GB on an H200. The arithmetic is
trivial; the cost is memory traffic. The minimum traffic for loss + gradient is: read each logit once, write each
gradient entry once, i.e. 2 * N * V * itemsize bytes (2 * 2 bytes per entry in bf16). We get close to that by
producing the gradient during the forward pass, like Liger-Kernel: the kernel already has the row in hand, so the
backward only has to multiply by the upstream gradient, which is 1 in training (the scale kernel below then returns
immediately). Per row the kernel makes two passes:

    pass 1  read x in chunks of BLOCK_V, keep running maxima and sums (online softmax), x_t, sum(x)
    pass 2  read x again and write dx (chunks in reverse order: the last ones read are the likeliest still in L2)

so it moves 3 * N * V * itemsize bytes unless pass 2 finds the row in L2 (see the launch shape below).

The online softmax (Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018): keep a running max m and
a running sum d of exp(x - m); for each new block of values,

    m_new = max(m, max(block));   d = d * exp(m - m_new) + sum(exp(block - m_new));   m = m_new

so d always equals sum_j exp(x_j - m) over the entries seen so far, the exponent never exceeds 0 (no overflow even for
logits of 1e4), and no [V]-sized buffer is needed: lse = m + log(d). The kernel keeps one (m, d) pair per "lane" of
LANE_WIDTH = 8 neighbouring columns, so each update reduces 8 values that one thread already holds: no communication
between threads in the streaming loop, one exp per value plus one per lane. The lanes are merged once per row, with
the same rule: m = max over lanes, d = sum over lanes of d_lane * exp(m_lane - m). Merging across the whole program
for every chunk instead costs two barriers per chunk, and made pass 1 30 % slower on an H200.

Instructions per logit: the second bottleneck
---------------------------------------------
Memory-bound does not mean the arithmetic is free. Nsight Compute on the first version of this kernel (H200, 16384
rows) showed the schedulers issuing on 72 % of cycles, about 33 instructions per logit, for what is a handful of
operations. The machine code (cuobjdump -sass) showed where they went, and the kernel now avoids each:
- `tl.exp(y)` is a multiply by log2(e) and `ex2.approx.f32`, which ptxas expands into four instructions (a range
  check and two multiplies around MUFU.EX2) so that results below 2^-126 come out exact: five per exp, six with the
  subtraction. `_exp2` below issues the flush-to-zero form, the single MUFU.EX2.
- The one-hot term `where(column == target, 1, 0)` compared 64-bit column indices: five instructions on every value.
  Pass 2 now writes softmax only, and one scalar store after a barrier fixes the target's entry.
- Masks (`offsets < V`) on every chunk: only the last, partial chunk is masked now.
- The gradient's scale (1 / n_valid) is folded into the exponent: scale * 2^y = 2^(y + log2(scale)).
That leaves ~15 instructions per logit (8 in pass 1, 7 in pass 2, counted in the SASS of the two loops) and made room
for the launch shape below.

Precision and sizes
-------------------
- All arithmetic is fp32 whatever the logits dtype: exp/log/sums of 128256 terms in bf16 (8 significant bits) would
  lose the loss entirely. The loss is returned in fp32; the gradient is stored in the logits' dtype.
- Offsets are int64: row * row_stride passes 2^31 elements (the int32 limit) at N * V > 2.1e9, e.g. 16744 rows at
  V = 128256, a single LLaMA-3 batch of 16 k tokens.
- No host synchronization: the mean's 1 / n_valid stays a device tensor that the kernel loads; nothing calls
  `.item()` or branches on a tensor in Python.

Memory: the default allocates one gradient buffer (one logits size). `inplace_backward=True` writes the gradient
into the logits buffer itself (+0 bytes).

Two kernels do this: the row kernel (plain Triton, below) and, for 16-bit logits with a gradient on a GPU with
~227 KB of shared memory per multiprocessor (H100, H200), a shared-memory kernel (Gluon) that keeps most of each row
on chip between the two passes instead of re-reading it ("The shared-memory kernel" below). Same results, same
arguments; the launcher picks.

The second half of this file builds the fused *linear* cross-entropy on top of the kernel: loss from hidden states and
the lm_head weight, never materializing the full [N, V] logits (see "Linear cross-entropy" below).
"""
import os
import sys

import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
    print("No CUDA device: Triton kernels run on the CPU interpreter (toy sizes; times are not meaningful).", file=sys.stderr)

import triton  # noqa: E402  (must come after TRITON_INTERPRET is set)
import triton.language as tl  # noqa: E402

_REDUCTIONS = ("mean", "sum", "none")
# exp(y) = 2^(y * log2(e)): the kernels work in base 2 (see _exp2). A tl.constexpr so that @triton.jit code can read it.
LOG2E = tl.constexpr(1.4426950408889634)


# ---------------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------------
@triton.jit
def _exp2(x, FAST_EXP2: tl.constexpr):
    """2^x. On the GPU one MUFU.EX2 instruction with flush-to-zero: tl.exp2 (and tl.exp) lower to ex2.approx.f32,
    which ptxas expands into four instructions to produce results below 2^-126 exactly. Those are softmax values
    under 1e-38, far below what any gradient check can see, so flushing them to 0 is harmless. The interpreter has
    no inline PTX and uses tl.exp2."""
    if FAST_EXP2:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _online_softmax_update(x, lane_max, lane_sum, FAST_EXP2: tl.constexpr):
    """Fold one [N_LANES, LANE_WIDTH] chunk into each lane's running max and running sum of exp(x - max).

    exp(y) is computed as 2^(y * log2(e)). The max is subtracted first, in natural units: x - max is exact for the
    values that matter (those close to the max), whereas folding the shift into one multiply-add (x*log2(e) - c)
    would round c = max*log2(e), an error of 1e-3 in the exponent for logits of 1e4. A lane that has only seen
    padding (-inf) keeps max -inf; shifting by 0 then avoids -inf - (-inf) = NaN (every term is 2^-inf = 0 anyway).
    The old sum is rescaled to the new max BEFORE this chunk is added: every exponent is <= 0, so nothing
    overflows."""
    new_max = tl.maximum(lane_max, tl.max(x, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    chunk_sum = tl.sum(_exp2((x - shift[:, None]) * LOG2E, FAST_EXP2), axis=1)
    return new_max, lane_sum * _exp2((lane_max - shift) * LOG2E, FAST_EXP2) + chunk_sum


@triton.jit
def _softmax_gradient(x, row_max, exponent_offset, scale, smoothing_term, POSITIVE_SCALE: tl.constexpr,
                      HAS_SMOOTHING: tl.constexpr, FAST_EXP2: tl.constexpr):
    """scale * (softmax(x) - eps / V) without the one-hot term (added once per row by the caller).

    softmax(x) = exp(x - lse) = 2^((x - row_max) * log2(e) - log2(sum)), with sum = sum_j exp(x_j - row_max): a
    subtraction, one fused multiply-add and one exp2. With a positive scale the caller folds log2(scale) into the
    offset as well (scale * 2^y = 2^(y + log2(scale))); otherwise the scale is a multiply."""
    grad = _exp2((x - row_max) * LOG2E - exponent_offset, FAST_EXP2)
    if not POSITIVE_SCALE:
        grad = grad * scale
    if HAS_SMOOTHING:
        grad = grad - smoothing_term
    return grad


@triton.jit
def _row_start(base_ptr, row, rows_per_batch, stride_b, stride_t):
    """Address of flat row `row` (int64) of a [N, V] (stride_b = 0, rows_per_batch = N) or [B, T, V] tensor."""
    b = row // rows_per_batch
    return base_ptr + b * stride_b + (row - b * rows_per_batch) * stride_t


@triton.jit
def _merge_lanes(lane_max, lane_sum, FAST_EXP2: tl.constexpr):
    """Combine the lanes once per row: the row max, and every lane's sum rescaled to it."""
    row_max = tl.max(lane_max, axis=0)
    row_sum = tl.sum(lane_sum * _exp2((lane_max - row_max) * LOG2E, FAST_EXP2), axis=0)
    return row_max, row_sum


@triton.jit
def _row_loss(row_max, row_sum, x_target, sum_x_tile, label_smoothing, V, HAS_SMOOTHING: tl.constexpr):
    """(1 - eps) * (lse - x_target) + (eps / V) * sum_j (lse - x_j), with lse = row_max + log(row_sum)."""
    lse = row_max + tl.log(row_sum)
    if HAS_SMOOTHING:
        sum_x = tl.sum(tl.sum(sum_x_tile, axis=1), axis=0)
        return lse - (1.0 - label_smoothing) * x_target - (label_smoothing / V) * sum_x
    else:
        return lse - x_target


@triton.jit
def _cross_entropy_kernel(
    logits_ptr,  # [N, V] rows (any row strides, unit column stride), fp32/bf16/fp16
    grad_ptr,  # where dlogits goes: its own buffer, or logits_ptr itself (in-place mode)
    targets_ptr,  # [N] integer class indices (any integer dtype)
    losses_ptr,  # [N] fp32 per-row losses (output)
    scale_ptr,  # fp32 gradient scale: one value (scale_stride = 0) or one per row
    n_rows,
    V,  # vocabulary size (row length)
    rows_per_batch,  # T for [B, T, V] logits (N for 2-D), to turn a flat row index into (b, t)
    logits_stride_b, logits_stride_t,  # element strides of dims b and t of the logits
    grad_stride_b, grad_stride_t,  # same for the gradient buffer
    targets_stride,
    scale_stride,
    ignore_index,
    label_smoothing,
    BLOCK_V: tl.constexpr,  # vocabulary chunk handled per loop step (power of 2)
    LANE_WIDTH: tl.constexpr,  # consecutive columns that share one running max/sum (power of 2, divides BLOCK_V)
    HAS_SMOOTHING: tl.constexpr,  # label_smoothing > 0: also accumulate sum(x)
    COMPUTE_GRAD: tl.constexpr,  # run pass 2 (logits need a gradient); otherwise only the loss
    POSITIVE_SCALE: tl.constexpr,  # the scale is known to be > 0 (a reduction's 1/n or 1), so it folds into exp2
    FAST_EXP2: tl.constexpr,  # one-instruction exp2 (GPU); tl.exp2 on the interpreter
    CHUNKS_PER_STEP: tl.constexpr,  # 1 or 2 chunks loaded per loop step, i.e. in flight per thread (see the launcher)
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
    # it just read: the fewer rows in flight, the more of it is still in L2 (60 MiB on an H200); see the launch
    # comment for the measured trade-off.
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
            if COMPUTE_GRAD:
                zeros = tl.zeros([N_LANES, LANE_WIDTH], dtype=grad_ptr.dtype.element_ty)
                for start in tl.range(0, V, BLOCK_V):
                    tl.store(grad_row + start + chunk_offsets, zeros, mask=start + chunk_offsets < V)
        else:
            # A target outside [0, V) is never used as an address (the one load at x + target is masked off), so it
            # cannot read or write out of bounds; instead its loss and gradient become NaN, loudly.
            target_ok = (target >= 0) & (target < V)
            x_target = tl.load(logits_row + target, mask=target_ok, other=0.0).to(tl.float32)

            # ---- pass 1: online softmax statistics, one running max and sum per lane ----------------------------
            lane_max = tl.full([N_LANES], float("-inf"), dtype=tl.float32)
            lane_sum = tl.zeros([N_LANES], dtype=tl.float32)  # sum of exp(x - lane_max) over the lane's columns
            # Label smoothing needs sum(x): kept per element and reduced once at the end, not once per chunk.
            sum_x_tile = tl.zeros([N_LANES, LANE_WIDTH], dtype=tl.float32)
            # loop_unroll_factor=2 puts the loads of two chunks in flight before either is used.
            for i in tl.range(0, n_full, loop_unroll_factor=CHUNKS_PER_STEP):
                # evict_last: keep the row in L2 for pass 2.
                x = tl.load(logits_row + i * BLOCK_V + chunk_offsets, eviction_policy="evict_last").to(tl.float32)
                lane_max, lane_sum = _online_softmax_update(x, lane_max, lane_sum, FAST_EXP2)
                if HAS_SMOOTHING:
                    sum_x_tile += x
            # The partial chunk; masked columns read -inf so they count as exp(-inf) = 0. Pass 2 reuses these values.
            x_partial = tl.load(logits_row + partial_offsets, mask=partial_mask, other=float("-inf"),
                                eviction_policy="evict_last").to(tl.float32)
            lane_max, lane_sum = _online_softmax_update(x_partial, lane_max, lane_sum, FAST_EXP2)
            if HAS_SMOOTHING:
                sum_x_tile += tl.where(partial_mask, x_partial, 0.0)
            row_max, row_sum = _merge_lanes(lane_max, lane_sum, FAST_EXP2)
            loss = _row_loss(row_max, row_sum, x_target, sum_x_tile, label_smoothing, V, HAS_SMOOTHING)
            tl.store(losses_ptr + row, tl.where(target_ok, loss, float("nan")))

            # ---- pass 2: gradient, dx_j = scale * (softmax_j - eps / V), the target's entry fixed last ------------
            if COMPUTE_GRAD:
                scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
                exponent_offset = tl.log2(row_sum)
                if POSITIVE_SCALE:
                    exponent_offset -= tl.log2(scale)
                exponent_offset = tl.where(target_ok, exponent_offset, float("nan"))  # bad target: NaN gradient
                smoothing_term = scale * (label_smoothing / V)
                grad = _softmax_gradient(x_partial, row_max, exponent_offset, scale, smoothing_term, POSITIVE_SCALE,
                                         HAS_SMOOTHING, FAST_EXP2)
                # evict_first on the loads: this is the last use of the logits; on the stores: this kernel never
                # reads the gradient back. Both leave L2 to the rows that pass 2 has still to re-read.
                tl.store(grad_row + partial_offsets, grad.to(grad_ptr.dtype.element_ty), mask=partial_mask,
                         eviction_policy="evict_first")
                # Whole chunks in reverse order: the chunks pass 1 read last are the likeliest to still be in L2.
                # In in-place mode grad_row == logits_row: each chunk is overwritten only after it was read.
                # With CHUNKS_PER_STEP = 2, chunks top-1 and top-2 per step, both loaded before either is stored:
                # the compiler cannot tell that a store does not alias a later load, so it keeps them in program
                # order and unrolling alone would not put a second load in flight.
                for i in tl.range(0, n_full // CHUNKS_PER_STEP):
                    offsets_a = (n_full - 1 - CHUNKS_PER_STEP * i) * BLOCK_V + chunk_offsets
                    x_a = tl.load(logits_row + offsets_a, eviction_policy="evict_first").to(tl.float32)
                    if CHUNKS_PER_STEP == 2:
                        x_b = tl.load(logits_row + offsets_a - BLOCK_V, eviction_policy="evict_first").to(tl.float32)
                    grad_a = _softmax_gradient(x_a, row_max, exponent_offset, scale, smoothing_term, POSITIVE_SCALE,
                                               HAS_SMOOTHING, FAST_EXP2)
                    if CHUNKS_PER_STEP == 2:
                        grad_b = _softmax_gradient(x_b, row_max, exponent_offset, scale, smoothing_term,
                                                   POSITIVE_SCALE, HAS_SMOOTHING, FAST_EXP2)
                    tl.store(grad_row + offsets_a, grad_a.to(grad_ptr.dtype.element_ty), eviction_policy="evict_first")
                    if CHUNKS_PER_STEP == 2:
                        tl.store(grad_row + offsets_a - BLOCK_V, grad_b.to(grad_ptr.dtype.element_ty),
                                 eviction_policy="evict_first")
                if CHUNKS_PER_STEP == 2:
                    if n_full % 2 == 1:  # chunk 0 is left over
                        x = tl.load(logits_row + chunk_offsets, eviction_policy="evict_first").to(tl.float32)
                        grad = _softmax_gradient(x, row_max, exponent_offset, scale, smoothing_term, POSITIVE_SCALE,
                                                 HAS_SMOOTHING, FAST_EXP2)
                        tl.store(grad_row + chunk_offsets, grad.to(grad_ptr.dtype.element_ty),
                                 eviction_policy="evict_first")
                # The one-hot term, -scale * (1 - eps) at the target only: one store instead of a comparison on every
                # value. The barrier orders it after every thread's store of this row (one of which wrote that entry).
                tl.debug_barrier()
                target_softmax_term = _softmax_gradient(x_target, row_max, exponent_offset, scale, smoothing_term,
                                                        POSITIVE_SCALE, HAS_SMOOTHING, FAST_EXP2)
                target_grad = target_softmax_term - scale * (1.0 - label_smoothing)
                tl.store(grad_row + target, target_grad.to(grad_ptr.dtype.element_ty), mask=target_ok)


@triton.jit
def _scale_rows_kernel(
    x_ptr,  # [rows, n_cols] tensor scaled in place (any row strides, unit column stride)
    scale_ptr,  # fp32-convertible scale: one value (scale_stride = 0) or one per row
    n_cols,
    rows_per_batch,
    stride_b, stride_t,
    scale_stride,
    BLOCK: tl.constexpr,
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
            tl.store(x_row + start + cols, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------------
# The shared-memory kernel: the row stays on chip between the two passes (16-bit logits with a gradient)
# ---------------------------------------------------------------------------------------------------------------------
# Why a second kernel. The kernel above reads each row twice: pass 2 finds only part of it in L2, and on an H200 at
# 16384 x 128256 bf16 it reads 6.2 GB for 4.2 GB of logits. A multiprocessor has 227 KB of shared memory, most of a
# 250 KB row of LLaMA-3's vocabulary, so this kernel keeps the row there: pass 2 reads it from shared memory, not HBM.
#
# Plain Triton decides on its own what goes to shared memory, so this kernel is written in Gluon, Triton's
# lower-level dialect (triton.experimental.gluon, Triton 3.6): the same Python-embedded language, but with explicit
# register layouts, explicit shared-memory buffers and explicit asynchronous copies (`cp.async`, global -> shared
# without passing through registers). The arithmetic is the kernel above's: the same online softmax, exp2 and
# gradient helpers.
#
# The schedule. One program per multiprocessor (it takes all the shared memory) walks over rows p, p + P, ... A row
# is N_CHUNKS chunks of BLOCK_V columns plus a partial chunk (kept in registers). Chunks 0..K-1 are "streamed":
# loaded into a small ring of Q shared-memory slots for pass 1 (evict_last, so that the second load, for pass 2,
# finds them in L2) and loaded again for pass 2. The other chunks are "kept": each has its own slot, loaded once and
# read by both passes. Each pass visits the chunks in the same order (streamed ones spread evenly among the kept), one
# chunk per "step". A slot is refilled by the step that frees it:
# - pass 2 of row r, once done with a kept chunk, loads the same chunk of row r + P into that slot, so the next row
#   is in flight while this row's gradient is written (these loads were issued N_CHUNKS steps before their use);
# - a ring slot is refilled with the streamed item Q items further on (the next load for pass 1 or pass 2, of this
#   row or the next).
# Each step commits one group of cp.async copies (possibly empty), so how many groups separate a load from its use is
# known when the kernel is compiled, and `wait_group(n)` ("wait until at most n groups are in flight") waits for
# exactly the data the step needs. Each thread copies and then reads the same 8 columns, so it only waits for its own
# copies (Gluon still adds a barrier per step, which it cannot prove unnecessary).
#
# Measured on the H200 (16384 x 128256 bf16, loss + gradient in place; the row kernel above took 2.50 ms in the same
# runs). 8192-wide chunks with 32 warps (one thread per 8 columns), K = 4 streamed chunks through Q = 2 ring slots:
# 2.27 ms = 87 % of copy bandwidth (kernel alone; 2.28 ms = 86 % through autograd in benchmark_kernels.py at 30dd20d);
# ncu (results/ncu_cross_entropy_h200_30dd20d.csv): 4.4 GB read instead of 6.2, HBM 80 % busy. Other K, Q in the
# same run: K = 3-4 with Q = 2-3 took 2.27 ms, K = 5-6 2.30 ms; a single ring slot (K = 4, Q = 1) 2.62 ms, and
# streaming more (K = 7-8 with Q = 2, an earlier run) 2.56-2.63 ms: a streamed chunk's load is then issued too few
# steps before its use. 16 warps or 4096-wide chunks: 2.58-2.80 ms. Three details were worth 1.5-2.5 % each: the
# copies of an ignored row are skipped with a branch rather than masked (masked cp.async: 2.37 -> 2.43 ms); each
# row's target is loaded one row ahead (the loads that need it no longer stall the row's start: 2.37 -> 2.32 ms); and
# a chunk is used before its slot is refilled. An ignored row reads nothing: its pass 1 only commits its (empty)
# groups, which keeps the wait counts fixed, and its pass 2 stores zeros. With ignored rows as fine-tuning data has
# them this kernel stays ahead of the row kernel (same run, 2.28 against 2.49 ms with none): prompts masked in 8
# sequences of 2048 tokens (39 % of rows) 1.87 against 1.98 ms, prompts and right padding in 16 x 1024 (44 %) 1.83
# against 1.94, a random half of the rows 1.82 against 1.86. A program takes every P-th row (P = multiprocessors),
# so a mask with a period that divides P unbalances the programs: with every other row ignored, half the programs
# get all the work and this kernel takes 2.19 ms against the row kernel's 1.86. Rotating the rows (iteration i of
# program p on row i * P + (p + i) % P, commit 98e6387) balanced that case (1.76 ms) but cost 5 % without ignored rows
# (2.41 against 2.28 ms, the row kernel at 2.50 in both runs; ncu: the same 4.4 GB read, HBM 75 % busy instead of 80),
# so it was reverted: masks come in runs of prompt and padding tokens, not every other row. With few rows per program
# the first row's loads are not hidden: 768 rows took 247 us against the row kernel's 156, 1536 rows 264 against 274,
# so the launcher keeps the row kernel under 8 rows per multiprocessor (the linear cross-entropy's 768-row chunks too).
#
# On the CPU interpreter Gluon does not run, so the same kernel source runs as a Triton kernel through a small
# stand-in for the Gluon names it uses (_InterpretedGluon below): layouts are ignored, a shared-memory slot is a
# Python value, and an asynchronous copy is a load done at once. The CPU tests thus check the schedule's data flow
# (which chunk is in which slot at each step); the GPU tests check the timing (the wait counts).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
    def thread_barrier():
        return tl.debug_barrier()

    # cp.async: the copy happens at once, so commit and wait have nothing to do.
    @staticmethod
    def async_copy_global_to_shared(slot, pointer, eviction_policy=""):
        slot.store(tl.load(pointer))

    @staticmethod
    def commit_group():
        pass

    @staticmethod
    def wait_group(num_outstanding):
        pass


# Gluon is experimental and its names change between Triton releases; this kernel is written and tested against
# Triton 3.6. Under another version the row kernel above does all the work.
_HAVE_GLUON = triton.__version__.startswith("3.6.")
if _INTERPRET or not _HAVE_GLUON:
    gl = async_copy = _InterpretedGluon()
    _gluon_jit = triton.jit
else:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    _gluon_jit = gluon.jit


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
                     BLOCK_V: tl.constexpr, HAS_SMOOTHING: tl.constexpr, FAST_EXP2: tl.constexpr):
    if valid:  # an ignored row's slots were never filled: nothing to wait for or read, only the group to commit
        if _is_streamed(U, N, K):
            ITEM: tl.constexpr = _streamed_chunk(U, N, K)  # pass-1 item ITEM is chunk ITEM
            slot = ring.index((ring_base + ITEM) % Q)
            async_copy.wait_group(_item_wait_count(ITEM, N, K, Q))
            x = slot.load(tile).to(tl.float32)
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
            lane_max, lane_sum = _online_softmax_update(x, lane_max, lane_sum, FAST_EXP2)
        if HAS_SMOOTHING:
            sum_x_tile += x
    async_copy.commit_group()
    return lane_max, lane_sum, sum_x_tile


@_gluon_jit
def _smem_store_gradient(x, valid, grad_row, CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, chunk_offsets, row_max,
                         exponent_offset, scale, smoothing_term, POSITIVE_SCALE: tl.constexpr,
                         HAS_SMOOTHING: tl.constexpr, FAST_EXP2: tl.constexpr):
    if valid:
        grad = _softmax_gradient(x, row_max, exponent_offset, scale, smoothing_term, POSITIVE_SCALE, HAS_SMOOTHING,
                                 FAST_EXP2)
    else:  # an ignored row: its slots were never filled (they hold an older row), the gradient is exactly 0
        grad = gl.zeros_like(x)
    tl.store(grad_row + CHUNK * BLOCK_V + chunk_offsets, grad.to(grad_row.dtype.element_ty),
             eviction_policy="evict_first")


@_gluon_jit
def _smem_pass2_step(U: tl.constexpr, ring, ring_base, kept, logits_row, valid, next_row_ptr, next_valid, grad_row,
                     chunk_offsets, row_max, exponent_offset, scale, smoothing_term, tile: tl.constexpr,
                     N: tl.constexpr, K: tl.constexpr, Q: tl.constexpr, BLOCK_V: tl.constexpr,
                     POSITIVE_SCALE: tl.constexpr, HAS_SMOOTHING: tl.constexpr, FAST_EXP2: tl.constexpr):
    if _is_streamed(U, N, K):
        ITEM: tl.constexpr = K + _streamed_chunk(U, N, K)  # pass-2 item ITEM re-loads chunk ITEM - K
        CHUNK: tl.constexpr = ITEM - K
        slot = ring.index((ring_base + ITEM) % Q)
        async_copy.wait_group(_item_wait_count(ITEM, N, K, Q))
        x = slot.load(tile).to(tl.float32)
        _smem_store_gradient(x, valid, grad_row, CHUNK, BLOCK_V, chunk_offsets, row_max, exponent_offset, scale,
                             smoothing_term, POSITIVE_SCALE, HAS_SMOOTHING, FAST_EXP2)
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
                             smoothing_term, POSITIVE_SCALE, HAS_SMOOTHING, FAST_EXP2)
        # The slot's last use in this row: load the next row's chunk into it.
        if next_valid:
            async_copy.async_copy_global_to_shared(kept.index(CHUNK - K),
                                                   next_row_ptr + CHUNK * BLOCK_V + chunk_offsets,
                                                   eviction_policy="evict_first")
    async_copy.commit_group()


@_gluon_jit
def _cross_entropy_smem_kernel(
    logits_ptr, grad_ptr, targets_ptr, losses_ptr, scale_ptr,  # as in _cross_entropy_kernel
    n_rows, V, rows_per_batch, logits_stride_b, logits_stride_t, grad_stride_b, grad_stride_t, targets_stride,
    scale_stride, ignore_index, label_smoothing,
    BLOCK_V: tl.constexpr,  # chunk width (power of 2)
    LANE_WIDTH: tl.constexpr,  # columns per lane, i.e. per thread and chunk (8 x 2 bytes = one 16-byte copy)
    N_CHUNKS: tl.constexpr,  # V // BLOCK_V whole chunks per row (the partial rest stays in registers)
    K: tl.constexpr,  # streamed chunks per row (1 <= K < N_CHUNKS)
    Q: tl.constexpr,  # ring slots for them (1 <= Q <= K)
    HAS_SMOOTHING: tl.constexpr, POSITIVE_SCALE: tl.constexpr, FAST_EXP2: tl.constexpr,
    NUM_WARPS: tl.constexpr,  # = num_warps: Gluon layouts name the warps explicitly
):
    N: tl.constexpr = N_CHUNKS
    N_LANES: tl.constexpr = BLOCK_V // LANE_WIDTH
    # Register layout of a chunk, [N_LANES, LANE_WIDTH]: each thread holds whole lanes (8 contiguous columns), so a
    # lane's reduction stays in the thread, as in the kernel above. The same layout serves the copies, so each
    # thread reads back exactly the bytes its own cp.async wrote.
    tile: tl.constexpr = gl.BlockedLayout([1, LANE_WIDTH], [32, 1], [NUM_WARPS, 1], [1, 0])
    lanes: tl.constexpr = gl.SliceLayout(1, tile)
    columns: tl.constexpr = gl.SliceLayout(0, tile)
    unswizzled: tl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])  # a thread's 16 bytes stay contiguous
    kept = gl.allocate_shared_memory(logits_ptr.dtype.element_ty, [N - K, N_LANES, LANE_WIDTH], unswizzled)
    ring = gl.allocate_shared_memory(logits_ptr.dtype.element_ty, [Q, N_LANES, LANE_WIDTH], unswizzled)
    lane_index = gl.arange(0, N_LANES, layout=lanes)[:, None]
    chunk_offsets = lane_index * LANE_WIDTH + gl.arange(0, LANE_WIDTH, layout=columns)[None, :]
    partial_offsets = N * BLOCK_V + chunk_offsets
    partial_mask = partial_offsets < V
    n_programs = gl.num_programs(0)

    # An ignored row's logits are never read: the copies of a row are skipped (a branch taken by the whole program,
    # not a copy mask: masked cp.async made the kernel 2.5 % slower) when its target is ignore_index, and past the
    # last row. Each row's target is loaded one row ahead, so the row can start without waiting for it.
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
        for u in gl.static_range(N):
            lane_max, lane_sum, sum_x_tile = _smem_pass1_step(
                u, ring, ring_base, kept, logits_row, valid, chunk_offsets, lane_max, lane_sum, sum_x_tile, tile,
                N, K, Q, BLOCK_V, HAS_SMOOTHING, FAST_EXP2)
        lane_max, lane_sum = _online_softmax_update(x_partial, lane_max, lane_sum, FAST_EXP2)
        if HAS_SMOOTHING:
            sum_x_tile += gl.where(partial_mask, x_partial, 0.0)
        # An ignored row read nothing (every lane max -inf): its statistics are NaN, discarded by the `valid` selects.
        row_max, row_sum = _merge_lanes(lane_max, lane_sum, FAST_EXP2)
        loss = _row_loss(row_max, row_sum, x_target, sum_x_tile, label_smoothing, V, HAS_SMOOTHING)
        gl.store(losses_ptr + row, gl.where(valid, gl.where(target_ok, loss, float("nan")), 0.0))

        # ---- pass 2: gradient (zeros for an ignored row) ----
        row_scale = gl.load(scale_ptr + row * scale_stride).to(tl.float32)
        scale = gl.where(valid, row_scale, 0.0)
        exponent_offset = gl.log2(row_sum)
        if POSITIVE_SCALE:
            exponent_offset -= gl.log2(gl.where(valid, row_scale, 1.0))
        exponent_offset = gl.where(target_ok, exponent_offset, float("nan"))  # bad target: NaN gradient
        exponent_offset = gl.where(valid, exponent_offset, float("inf"))
        smoothing_term = scale * (label_smoothing / V)
        grad = _softmax_gradient(x_partial, row_max, exponent_offset, scale, smoothing_term, POSITIVE_SCALE,
                                 HAS_SMOOTHING, FAST_EXP2)
        gl.store(grad_row + partial_offsets, gl.where(valid, grad, 0.0).to(grad_ptr.dtype.element_ty),
                 mask=partial_mask, eviction_policy="evict_first")
        for u in gl.static_range(N):
            _smem_pass2_step(u, ring, ring_base, kept, logits_row, valid, next_row_ptr, next_valid, grad_row,
                             chunk_offsets, row_max, exponent_offset, scale, smoothing_term, tile, N, K, Q, BLOCK_V,
                             POSITIVE_SCALE, HAS_SMOOTHING, FAST_EXP2)
        # The one-hot term, after every thread's stores of this row (as in the kernel above).
        gl.thread_barrier()
        target_grad = _softmax_gradient(x_target, row_max, exponent_offset, scale, smoothing_term, POSITIVE_SCALE,
                                        HAS_SMOOTHING, FAST_EXP2) - scale * (1.0 - label_smoothing)
        gl.store(grad_row + target, target_grad.to(grad_ptr.dtype.element_ty), mask=target_ok & valid)
        ring_base = (ring_base + 2 * K) % Q
        target = next_target
    async_copy.wait_group(0)  # no copy may still be writing shared memory when the program exits


# ---------------------------------------------------------------------------------------------------------------------
# Launchers: validate, pick BLOCK_V / num_warps, allocate, launch
# ---------------------------------------------------------------------------------------------------------------------
def _kernel_device_type():
    """Where the Triton kernels run: CUDA when present, else the CPU interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# Launch shape of the row kernel, measured on an H200 (16384 x 128256 bf16 logits, loss + gradient in place). It runs
# fp32 logits, the loss alone, and whatever the shared-memory kernel above does not take (see _smem_plan); for 16-bit
# logits with a gradient that kernel is faster. What limits this kernel is HBM traffic and how much of it is in
# flight; Nsight Compute (ncu) counts both.
# - Shipped until this shape (16384-wide chunks, 32 warps, 56 registers, so one program per multiprocessor and 132 rows
#   in flight): 2.69 ms = 73 % of copy bandwidth. ncu: 4.5 GB read for 4.2 GB of logits (pass 2 almost always hits
#   L2) but HBM only 67 % busy: one 16-byte load per thread in flight is too little.
# - 8192-wide chunks with pass 1 unrolled by two (CHUNKS_PER_STEP = 2): 32 registers, so two 32-warp programs fit per
#   multiprocessor, each thread with two loads in flight. Pass 1 alone (the loss-only launch) then reads the 4.2 GB in
#   1.0 ms, at copy speed (was 1.45 ms). Loss + gradient 2.57 ms; ncu: HBM 86 % busy, but 6.3 GB read: with 264 rows
#   in flight (66 MB) pass 2 finds only part of each row in L2.
# - Pass 2 two chunks per step as well, capped at 32 registers (maxnreg; ptxas spills nothing in the bf16 loops), and
#   the gradient stored with evict_first: 2.50 ms = 79 % of copy, 4096 rows 0.66 ms (sweep of 2026-12-03); ncu on
#   this shape (results/ncu_cross_entropy_h200_b408427.csv): 6.2 GB read, 4.2 GB written, HBM 88 % busy, so the
#   2 GB re-read is now the limit. benchmark_kernels.py at 9b3c258: 2.51 ms, 78 %.
# Tried in the same sweeps, none faster: Triton's software pipelining (tl.range num_stages, cp.async into shared memory:
# 2.90-3.80 ms), L2 prefetch instructions for the row or the next row (2.62-3.16 ms), a skewed loop that writes row r's
# gradient while reading row r + P's statistics (one program per SM, one row each in L2: 2.82 ms), unrolling pass 1 by
# four (2.51 ms), lanes of 4 or 16 columns (2.49-2.50 ms), 16 warps with 64 registers (2.51 ms), other cache policies
# (2.54-2.58 ms), one tl.reduce over (max, sum) pairs instead of two reductions per row (2.49 ms here; it helps the
# one-program-per-SM shape, 2.81 -> 2.67 ms, whose row-to-row bubbles nothing else covers), a persistent grid that loads
# the next row's target early (2.54 ms). The earlier sweeps (42571a1 and before): 16-warp and 4096-wide shapes,
# persistent grids of 2-3 programs per SM, rows split over several programs, the head of the row kept in registers: none
# of them under 2.77 ms.
# Re-measured with this kernel's loops (2026-12-03, second session; same run, shipped 2.51 ms):
# - Rows split over 2-16 programs (4-32 warps each), each publishing its segment's log-sum-exp and waiting for the
#   row's other segments before its pass 2, so that only 132 rows' worth of logits wait in L2: 2.54-5.5 ms in place.
#   Out of place the two-way split beat this kernel (2.46 against 2.56 ms), in place it did not (2.64 ms). Nsight
#   Compute on it: the split does remove the re-read (4.4 GB read instead of 6.2), but HBM is then busy only
#   68-75 % of the time: per segment, the wait for the other half and the row's start-up latency leave the program
#   with no load in flight, and the shorter the segments the more that costs. Loading the first pass-2 chunks before
#   the wait spilled registers and was slower (2.63-2.76 ms). Without any wait (each of 2-8 programs runs pass 1 on
#   its segment and publishes; the one whose atomic count completes the row runs pass 2 over the whole row): 2.57-3.06
#   ms; with four segments ncu again shows the re-read gone (4.5 GB read) and HBM 68 % busy.
# - The first 2-6 chunks of each row kept in shared memory between the passes (a Gluon prototype of this kernel, two
#   programs per SM with 32-96 KB each, so that L2 only has to hold the rest): 2.53-2.96 ms. ncu with 96 KB: 5.5 GB
#   read instead of 6.2, but HBM 78 % busy instead of 88.
# - Reserving L2 for persisting lines (cudaLimitPersistingL2CacheSize, which evict_last loads count against): 2.9 ms
#   with half the allowed 37.5 MiB, 5.3 ms with all of it, because the reserved part fills with lines of finished rows.
#   evict_first instead of evict_last on pass 1's first 2-16 chunks of each row (so that its tail has L2 to itself):
#   2.50-3.13 ms, no gain.
# A thread-block cluster (num_ctas=2: one row split over two multiprocessors, 132 rows in flight with 2048 threads per
# multiprocessor) would be the natural next step, but Triton 3.6 fails to compile this kernel with it (an error in
# its TritonGPUPlanCTAPass). What did work is the shared-memory kernel above: the same head-of-row stash as the Gluon
# prototype, but with the whole row but K chunks kept, one program per multiprocessor, and cp.async loads issued a
# row ahead, so that the stash does not cost loads in flight.
# fp32 logits keep 16384-wide chunks, one per step and no register cap: the unrolled bf16 shape spills there and took
# 1.50 ms against 1.30 ms at 4096 rows (9b3c258: 1.29 ms).
_SMEM_MIN_ROWS_PER_SM = 8  # fewer rows than this per multiprocessor go to the row kernel (see the launcher)
_PROGRAMS_PER_SM = 128  # no persistent grid: one program per row, as many resident as the registers allow
_LANE_WIDTH = 8


def _launch_shape(V, itemsize, device_type):
    """(BLOCK_V, num_warps, CHUNKS_PER_STEP, maxnreg): the vocabulary chunk per step, the warps per program, how
    many chunks each step loads, and the register cap that makes two 32-warp programs fit per multiprocessor (see
    above).

    CPU interpreter: 256-wide chunks and 4 warps, because every chunk costs ~1 ms of Python there and tests want
    several chunks per row; CHUNKS_PER_STEP by dtype as on the GPU, so that the tests run both loop forms.
    """
    chunks_per_step = 2 if itemsize <= 2 else 1
    if device_type != "cuda":
        return min(256, triton.next_power_of_2(max(V, 1))), 4, chunks_per_step, None
    if chunks_per_step == 2:
        return min(8192, triton.next_power_of_2(max(V, 1))), 32, 2, 32
    return min(16384, triton.next_power_of_2(max(V, 1))), 32, 1, None


def _smem_plan(V, itemsize, properties, block_v=None, n_streamed=None, n_ring=None):
    """(BLOCK_V, num_warps, N_CHUNKS, K, Q) for the shared-memory kernel, or None where it does not apply: fp32
    logits (half as much of the row would fit), vocabularies under two chunks, a GPU without ~200 KB of shared memory
    per program or without cp.async (compute capability < 8), a Triton without Gluon. The keywords are for tests and
    sweeps. `properties`: torch.cuda.get_device_properties of the logits' GPU, None on the CPU interpreter.

    GPU: 8192-wide chunks, 32 warps, K = 4 streamed chunks through Q = 2 ring slots (measured, see above), more
    streamed chunks when the kept ones would not fit. CPU interpreter: 256-wide chunks (one warp of 8-column lanes)
    and about half the chunks streamed through two slots, so that the tests run every kind of step.
    """
    if itemsize != 2 or not _HAVE_GLUON:
        return None
    if properties is not None:
        shared_bytes = getattr(properties, "shared_memory_per_block_optin", 0)
        if properties.major < 8 or shared_bytes < 200 * 1024:
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
        raise ValueError(f"need 1 <= n_ring ({n_ring}) <= n_streamed ({n_streamed}) < V // block_v ({n_chunks})")
    num_warps = max(1, block_v // (_LANE_WIDTH * 32))  # one thread per 8-column lane
    return block_v, num_warps, n_chunks, n_streamed, n_ring


def _pick_num_warps(block):
    """One warp (32 threads) per 1024 chunk elements, i.e. 32 values per thread, between 4 and 32 warps."""
    return min(32, max(4, block // 1024))


def _check_device(name, tensor, device):
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the logits are on {device}; put them on the same device")


def _check_targets_dtype(targets):
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer class indices, got dtype {targets.dtype}")


def _check_common_args(reduction, label_smoothing):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def _check_target_range(targets, V, ignore_index):
    """Debug mode (`check_targets=True`): one host sync to report the first target outside [0, V)."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
    if bad.any():
        position = bad.reshape(-1).nonzero()[0, 0].item()
        value = targets.reshape(-1)[position].item()
        raise ValueError(
            f"target {value} at flat position {position} is outside [0, {V}) and is not ignore_index={ignore_index}"
        )


def _row_layout(x):
    """(rows_per_batch, stride_b, stride_t) that map flat row i of a 2-D/3-D tensor to i//T*stride_b + i%T*stride_t."""
    if x.dim() == 3:
        return max(x.shape[1], 1), x.stride(0), x.stride(1)
    return max(x.shape[0], 1), 0, x.stride(0)


def _launch_cross_entropy(logits, targets_flat, losses, grad, scale, scale_stride, ignore_index, label_smoothing,
                          positive_scale=True, block_v=None, lane_width=None, num_warps=None, programs_per_sm=None,
                          chunks_per_step=None, maxnreg=None, kernel=None, n_streamed=None, n_ring=None):
    """Launch a kernel on prepared tensors: logits [N, V] or [B, T, V] (unit last stride), targets_flat [N],
    losses [N] fp32, grad (same shape as logits, or None for loss only), scale fp32 device tensor.
    positive_scale=False when the scale can be <= 0 (a user's grad_output). The keyword overrides are for tests and
    tuning sweeps: kernel="rows" forces the row kernel (as does any of its own overrides: lane_width, num_warps,
    programs_per_sm, chunks_per_step, maxnreg), "smem" the shared-memory kernel (block_v, n_streamed and n_ring
    shape it), None picks."""
    V = logits.shape[-1]
    n_rows = targets_flat.numel()
    if n_rows == 0:
        return
    compute_grad = grad is not None
    on_gpu = logits.device.type == "cuda"
    properties = torch.cuda.get_device_properties(logits.device) if on_gpu else None
    rows_per_batch, stride_b, stride_t = _row_layout(logits)
    grad_rows_per_batch, grad_stride_b, grad_stride_t = _row_layout(grad) if compute_grad else (rows_per_batch, 0, 0)
    assert grad_rows_per_batch == rows_per_batch
    # With a gradient to write, 16-bit logits go to the shared-memory kernel where it applies (see above).
    row_kernel_overrides = (lane_width, num_warps, programs_per_sm, chunks_per_step, maxnreg)
    # cp.async copies 16 bytes per thread, so on the GPU every row must start 16-byte aligned (Triton compiles the
    # 16-byte form when the base address and the row strides are multiples of 16; e.g. V = 50257 does not qualify).
    rows_aligned = not on_gpu or (logits.data_ptr() % 16 == 0 and stride_b % 16 == 0 and stride_t % 16 == 0)
    # Few rows per multiprocessor: the row kernel, whose first rows start at once (the shared-memory kernel's first
    # row per program waits for all its loads, e.g. 247 against 156 us at 768 rows, a linear cross-entropy chunk).
    enough_rows = not on_gpu or n_rows >= _SMEM_MIN_ROWS_PER_SM * properties.multi_processor_count
    smem_plan = None
    if compute_grad and rows_aligned and (kernel == "smem" or kernel is None and enough_rows and
                                          all(o is None for o in row_kernel_overrides)):
        smem_plan = _smem_plan(V, logits.element_size(), properties, block_v, n_streamed, n_ring)
    if kernel == "smem" and smem_plan is None:
        raise ValueError(f"the shared-memory kernel does not apply here (V={V}, {logits.dtype}, {logits.device}, "
                         f"gradient: {compute_grad}, rows 16-byte aligned: {rows_aligned})")
    if smem_plan is not None:
        block_v, num_warps, n_chunks, n_streamed, n_ring = smem_plan
        # One program per multiprocessor on the GPU (it takes the shared memory); the interpreter runs them in turn.
        n_programs = min(n_rows, properties.multi_processor_count if on_gpu else 4)
        _cross_entropy_smem_kernel[(n_programs,)](
            logits, grad, targets_flat, losses, scale,
            n_rows, V, rows_per_batch, stride_b, stride_t, grad_stride_b, grad_stride_t,
            targets_flat.stride(0), scale_stride, ignore_index, float(label_smoothing),
            BLOCK_V=block_v, LANE_WIDTH=_LANE_WIDTH, N_CHUNKS=n_chunks, K=n_streamed, Q=n_ring,
            HAS_SMOOTHING=label_smoothing > 0.0, POSITIVE_SCALE=positive_scale,
            FAST_EXP2=on_gpu, NUM_WARPS=num_warps, num_warps=num_warps,
        )
        return
    auto_block_v, auto_num_warps, auto_chunks_per_step, auto_maxnreg = _launch_shape(V, logits.element_size(),
                                                                                     logits.device.type)
    if block_v is None and num_warps is None and chunks_per_step is None:
        maxnreg = maxnreg or auto_maxnreg  # the register cap belongs to the measured shape, not to a sweep's
    block_v = block_v or auto_block_v
    num_warps = num_warps or auto_num_warps
    chunks_per_step = chunks_per_step or auto_chunks_per_step
    if on_gpu:
        n_programs = min(n_rows, (programs_per_sm or _PROGRAMS_PER_SM) * properties.multi_processor_count)
    else:
        n_programs = min(n_rows, 4)  # the interpreter runs programs one after another anyway
    _cross_entropy_kernel[(n_programs,)](
        logits, grad if compute_grad else logits, targets_flat, losses, scale,
        n_rows, V, rows_per_batch, stride_b, stride_t, grad_stride_b, grad_stride_t,
        targets_flat.stride(0), scale_stride, ignore_index, float(label_smoothing),
        BLOCK_V=block_v, LANE_WIDTH=min(lane_width or _LANE_WIDTH, block_v), HAS_SMOOTHING=label_smoothing > 0.0,
        COMPUTE_GRAD=compute_grad, POSITIVE_SCALE=positive_scale, FAST_EXP2=logits.device.type == "cuda",
        CHUNKS_PER_STEP=chunks_per_step, num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}),
    )


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
    block = min(4096 if x.device.type == "cuda" else 256, triton.next_power_of_2(n_cols))
    _scale_rows_kernel[(n_rows,)](x, scale, n_cols, rows_per_batch, stride_b, stride_t, scale_stride,
                                  BLOCK=block, num_warps=_pick_num_warps(block))
    return x


def _reduction_scale(targets, ignore_index, reduction):
    """(gradient scale as a 0-dim fp32 device tensor, count for the mean or None).

    "mean": 1 / (number of non-ignored targets), inf when every row is ignored (no row is then scaled, since ignored
    rows get zeros), plus that count for the mean of the losses. "sum"/"none": 1."""
    if reduction != "mean":
        return torch.ones((), dtype=torch.float32, device=targets.device), None
    n_valid = (targets != ignore_index).sum()
    return 1.0 / n_valid.to(torch.float32), n_valid


def _reduce(losses, reduction, n_valid, targets_shape):
    if reduction == "mean":
        return losses.sum() / n_valid  # 0 / 0 = NaN when every row is ignored, as in PyTorch
    if reduction == "sum":
        return losses.sum()
    return losses.view(targets_shape)


def _validate_cross_entropy(logits, targets, reduction, label_smoothing):
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError("logits and targets must be torch.Tensor")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be [N, V] or [B, T, V], got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be floating point, got dtype {logits.dtype}")
    _check_targets_dtype(targets)
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets must have shape {tuple(logits.shape[:-1])} (logits shape without the vocabulary dim), "
            f"got {tuple(targets.shape)}"
        )
    _check_device("targets", targets, logits.device)
    if logits.device.type != _kernel_device_type():
        raise ValueError(f"logits are on {logits.device} but the Triton kernels run on {_kernel_device_type()}")
    _check_common_args(reduction, label_smoothing)


def _cross_entropy_forward(logits, targets, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                           compute_grad=True, inplace_backward=False, check_targets=False, **launch_overrides):
    """Internal API (benchmark sweeps call it directly): returns (loss, grad_logits or None), no autograd.

    The gradient is already scaled for the reduction (1/n_valid for "mean") as if grad_output were 1.
    `launch_overrides` (kernel, block_v, n_streamed, n_ring, lane_width, num_warps, programs_per_sm, chunks_per_step,
    maxnreg; see _launch_cross_entropy) override the launch heuristics.
    """
    _validate_cross_entropy(logits, targets, reduction, label_smoothing)
    if check_targets:
        _check_target_range(targets, logits.shape[-1], ignore_index)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # the kernel needs unit column stride; any row strides are fine
    targets_flat = targets.reshape(-1)
    scale, n_valid = _reduction_scale(targets_flat, ignore_index, reduction)
    losses = torch.empty(targets_flat.numel(), dtype=torch.float32, device=logits.device)
    grad = None
    if compute_grad:
        grad = logits if inplace_backward else torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _launch_cross_entropy(logits, targets_flat, losses, grad, scale, 0, ignore_index, label_smoothing,
                          **launch_overrides)
    return _reduce(losses, reduction, n_valid, targets.shape), grad


# ---------------------------------------------------------------------------------------------------------------------
# Autograd Function and module
# ---------------------------------------------------------------------------------------------------------------------
class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction, label_smoothing, inplace_backward, check_targets):
        if inplace_backward:
            # The kernel is about to overwrite the logits with their gradient. Bump their version counter so that if
            # some other op saved these logits for its backward, autograd raises its usual "modified by an inplace
            # operation" error instead of silently using the gradient as logits.
            torch.autograd.graph.increment_version(logits)
        loss, grad = _cross_entropy_forward(logits, targets, ignore_index, reduction, label_smoothing,
                                            compute_grad=True, inplace_backward=inplace_backward,
                                            check_targets=check_targets)
        # Kept on ctx (not save_for_backward): in in-place mode it IS the logits, whose version we just bumped.
        # detach() gives a new tensor object over the same memory; once backward drops ctx's reference, autograd
        # holds the only one and can hand the buffer on as the gradient instead of copying it.
        ctx.grad_logits = grad.detach()
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad = ctx.grad_logits
        if grad is None:
            raise RuntimeError("the fused cross-entropy backward scales its stored gradient in place and can run once; "
                               "recompute the loss instead of using retain_graph=True")
        ctx.grad_logits = None
        # grad_output is 0-dim ("mean"/"sum") or one value per row ("none"); 1.0 makes the kernel a no-op.
        _scale_rows_(grad, grad_output)
        return grad, None, None, None, None, None, None


def cross_entropy(logits, targets, ignore_index=-100, reduction="mean", label_smoothing=0.0, inplace_backward=False,
                  check_targets=False):
    """`F.cross_entropy(logits, targets, ...)` for class-index targets, fused; returns the loss in fp32.

    logits [N, V] or [B, T, V] (any row strides) with targets [N] or [B, T] of any integer dtype.
    reduction "mean" (over non-ignored rows; NaN if all are ignored, like PyTorch), "sum" or "none" (per-row losses in
    the targets' shape, 0 for ignored rows). Ignored rows get an exactly zero gradient.

    inplace_backward=True writes the gradient into the logits' own memory during the forward pass (no extra [N, V]
    buffer). Contract: after this call the logits tensor holds the gradient, so it must not be used again (fine for
    lm_head's output: a matmul's backward needs its inputs, not its output; if another op saved the logits for its
    backward, autograd raises). Otherwise one gradient buffer of the logits' size is allocated.

    Targets outside [0, V) other than ignore_index are never used as addresses; their rows' loss and gradient are NaN.
    check_targets=True validates them on the host first and raises ValueError (a device sync: a debug mode).
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        return _CrossEntropyFunction.apply(logits, targets, ignore_index, reduction, label_smoothing, inplace_backward,
                                           check_targets)
    loss, _ = _cross_entropy_forward(logits, targets, ignore_index, reduction, label_smoothing, compute_grad=False,
                                     check_targets=check_targets)
    return loss


class TritonCrossEntropyLoss(torch.nn.Module):
    """Drop-in for `nn.CrossEntropyLoss` (class-index targets, no class weights) backed by `cross_entropy`."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, inplace_backward=False,
                 check_targets=False):
        super().__init__()
        _check_common_args(reduction, label_smoothing)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.inplace_backward = inplace_backward
        self.check_targets = check_targets

    def forward(self, logits, targets):
        return cross_entropy(logits, targets, self.ignore_index, self.reduction, self.label_smoothing,
                             self.inplace_backward, self.check_targets)

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, inplace_backward={self.inplace_backward}")


# ---------------------------------------------------------------------------------------------------------------------
# Linear cross-entropy: loss(hidden @ weight.T + bias, targets) without the [N, V] logits
# ---------------------------------------------------------------------------------------------------------------------
# The lm_head matmul turns hidden [N, H] into logits [N, V]; at N = 16384, V = 128256 those are 4.2 GB in bf16, plus
# the same again for their gradient. We instead walk the tokens in chunks of C rows; per chunk:
#
#     logits_c  = h_c @ W.T (+ b)                  cuBLAS (torch.mm/addmm), C x V values, the only big buffer
#     logits_c <- dlogits_c                        the fused kernel above, IN PLACE, already scaled by 1/n_valid
#     dh[c]     = dlogits_c @ W                    written straight into the preallocated dh (mm out=)
#     dW       += dlogits_c.T @ h_c                addmm into dW in place (the first chunk writes it: no zero-fill)
#     db       += sum over rows of dlogits_c       fp32 accumulator
#
# so the whole loss AND all gradients are computed in the forward (Liger's approach); the backward only multiplies
# dh/dW/db by grad_output with the device-side scale kernel, a no-op when it is 1. The FLOPs are those of eager
# (three matmuls); the extra memory is one chunk of logits plus the gradients themselves.
#
# reduction="none" is different: the gradient of each row's loss is weighted by its own grad_output, which dW mixes
# across rows, so it cannot be applied afterwards. Then the forward computes only the losses and the backward redoes
# the chunks with the per-row grad_output as the kernel's scale (one extra logits matmul).
#
# dW precision: dW is kept in the weight's dtype. Each chunk's product is accumulated in fp32 inside cuBLAS and
# rounded once when added to dW, so a bf16 dW sees one rounding per chunk (N / C roundings in total) instead of the
# single rounding of eager's one big matmul; the tests measure the effect against eager's own error.
#
# Chunk size: LCE_CHUNK_BUDGET_BYTES of chunk logits, 192 MiB = 768 rows at V = 128256 in bf16. The peak above the
# inputs is dW (1 GiB in bf16 for LLaMA-3-8B's lm_head) + dh + one chunk, so the budget trades memory for speed:
# every chunk re-reads and re-writes dW (dW += chunk product), so small chunks spend more time on that traffic.
# Measured on an H200 (H=4096, V=128256, bf16, 16384 tokens): 512 rows 94.3 ms / 1.23 GiB, 640 rows 92.5 ms /
# 1.26 GiB, 768 rows 89.7 ms / 1.29 GiB, 1024 rows 86.5 ms / 1.35 GiB (eager 103 ms / 23.5 GiB, Liger 94.7 ms /
# 1.23 GiB in the same run). 768 rows is the largest chunk that keeps the peak under 1.3 GiB.
LCE_CHUNK_BUDGET_BYTES = 192 * 2**20


def _lce_chunk_rows(n_rows, V, itemsize, chunk_size):
    if chunk_size is not None:
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        return max(1, min(chunk_size, n_rows))
    rows = LCE_CHUNK_BUDGET_BYTES // (V * itemsize)
    rows = max(64, rows // 64 * 64)  # a multiple of 64 keeps the matmul tiles full
    return max(1, min(rows, n_rows))


def _validate_linear_cross_entropy(hidden, weight, targets, bias, reduction, label_smoothing):
    for name, tensor in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, H] with H = {hidden.shape[-1]}, got shape {tuple(weight.shape)}")
    if not hidden.dtype.is_floating_point:
        raise TypeError(f"hidden must be floating point, got dtype {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} differs from hidden dtype {hidden.dtype}")
    _check_targets_dtype(targets)
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets must have shape {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    for name, tensor in (("weight", weight), ("targets", targets), ("bias", bias)):
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device} but hidden is on {hidden.device}")
    if hidden.device.type != _kernel_device_type():
        raise ValueError(f"hidden is on {hidden.device} but the Triton kernels run on {_kernel_device_type()}")
    _check_common_args(reduction, label_smoothing)


def _linear_cross_entropy_chunks(h, weight, bias, targets_flat, losses, scale, scale_stride, want_dh, want_dw,
                                 want_db, chunk_rows, ignore_index, label_smoothing, positive_scale=True,
                                 **launch_overrides):
    """The chunk loop. Fills losses [N] and returns (dh, dW, db) (None where not wanted), scaled by `scale`
    (positive_scale=False when it is a user's grad_output, which may be <= 0)."""
    n_rows, V = h.shape[0], weight.shape[0]
    compute_grad = want_dh or want_dw or want_db
    dh = torch.empty_like(h) if want_dh else None
    # dW is written by the first chunk's matmul, so it starts uninitialized (unless there is no chunk at all).
    dw = (torch.empty_like(weight) if n_rows else torch.zeros_like(weight)) if want_dw else None
    db = torch.zeros(V, dtype=torch.float32, device=h.device) if want_db else None
    # One chunk buffer reused by every chunk: allocating a fresh one per chunk would briefly hold two (the new
    # product is allocated before the old name is rebound), one chunk more at the peak.
    logits_buffer = torch.empty((min(chunk_rows, n_rows), V), dtype=h.dtype, device=h.device)
    for start in range(0, n_rows, chunk_rows):
        end = min(start + chunk_rows, n_rows)
        h_c = h[start:end]
        logits_c = logits_buffer[:end - start]
        if bias is not None:
            torch.addmm(bias, h_c, weight.t(), out=logits_c)
        else:
            torch.mm(h_c, weight.t(), out=logits_c)
        chunk_scale = scale[start:end] if scale_stride else scale
        _launch_cross_entropy(logits_c, targets_flat[start:end], losses[start:end],
                              logits_c if compute_grad else None, chunk_scale, scale_stride, ignore_index,
                              label_smoothing, positive_scale, **launch_overrides)
        if not compute_grad:
            continue
        dlogits_c = logits_c  # the kernel overwrote the chunk's logits with their gradient
        if want_dh:
            torch.mm(dlogits_c, weight, out=dh[start:end])
        if want_dw:
            if start == 0:
                torch.mm(dlogits_c.t(), h_c, out=dw)
            else:
                dw.addmm_(dlogits_c.t(), h_c)
        if want_db:
            db += dlogits_c.sum(dim=0, dtype=torch.float32)
    return dh, dw, None if db is None else db.to(weight.dtype)


def _prepare_linear(hidden, targets, reduction, ignore_index, check_targets, V):
    if check_targets:
        _check_target_range(targets, V, ignore_index)
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.stride(-1) != 1:
        h = h.contiguous()
    targets_flat = targets.reshape(-1)
    scale, n_valid = _reduction_scale(targets_flat, ignore_index, reduction)
    return h, targets_flat, scale, n_valid


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, chunk_size,
                check_targets, want_dh, want_dw, want_db):
        V = weight.shape[0]
        h, targets_flat, scale, n_valid = _prepare_linear(hidden, targets, reduction, ignore_index, check_targets, V)
        chunk_rows = _lce_chunk_rows(h.shape[0], V, weight.element_size(), chunk_size)
        losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        ctx.hidden_shape = hidden.shape
        ctx.args = (ignore_index, label_smoothing, chunk_rows)
        ctx.reduction = reduction
        if reduction == "none":
            # Gradients need the per-row grad_output: only the losses now, the chunks are recomputed in backward.
            _linear_cross_entropy_chunks(h, weight, bias, targets_flat, losses, scale, 0, False, False, False,
                                         chunk_rows, ignore_index, label_smoothing)
            ctx.save_for_backward(h, weight, bias, targets_flat)
            ctx.wants = (want_dh, want_dw, want_db)
        else:
            ctx.grads = _linear_cross_entropy_chunks(h, weight, bias, targets_flat, losses, scale, 0, want_dh, want_dw,
                                                     want_db, chunk_rows, ignore_index, label_smoothing)
        return _reduce(losses, reduction, n_valid, targets.shape)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.reduction == "none":
            h, weight, bias, targets_flat = ctx.saved_tensors
            ignore_index, label_smoothing, chunk_rows = ctx.args
            scale = grad_output.reshape(-1)  # an expanded grad_output (loss.sum().backward()) keeps stride 0: fine
            scratch_losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
            dh, dw, db = _linear_cross_entropy_chunks(h, weight, bias, targets_flat, scratch_losses, scale,
                                                      scale.stride(0), *ctx.wants, chunk_rows, ignore_index,
                                                      label_smoothing, positive_scale=False)
        else:
            if ctx.grads is None:
                raise RuntimeError("the fused linear cross-entropy backward scales its stored gradients in place and "
                                   "can run once; recompute the loss instead of using retain_graph=True")
            dh, dw, db = ctx.grads
            ctx.grads = None
            for grad in (dh, dw, db):
                if grad is not None:
                    _scale_rows_(grad.view(-1, grad.shape[-1]) if grad.dim() == 1 else grad, grad_output)
        if dh is not None:
            dh = dh.view(ctx.hidden_shape)
        return dh, dw, db, None, None, None, None, None, None, None, None, None


def linear_cross_entropy(hidden, weight, targets, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         chunk_size=None, check_targets=False):
    """`F.cross_entropy(F.linear(hidden, weight, bias), targets, ...)` without materializing the [N, V] logits.

    hidden [N, H] or [B, T, H]; weight [V, H] (lm_head.weight as stored); bias [V] or None; targets [N] or [B, T].
    Same semantics, errors and fp32 loss as `cross_entropy`. Gradients flow to hidden, weight and bias as far as they
    require grad (a frozen weight, as in LoRA, costs no dW matmul). chunk_size = rows per chunk; by default
    LCE_CHUNK_BUDGET_BYTES of chunk logits (a multiple of 64 rows). For mean/sum the gradients are computed in this
    call (its backward only scales them); for "none" the backward recomputes the chunks.
    """
    _validate_linear_cross_entropy(hidden, weight, targets, bias, reduction, label_smoothing)
    grad_enabled = torch.is_grad_enabled()
    want_dh = grad_enabled and hidden.requires_grad
    want_dw = grad_enabled and weight.requires_grad
    want_db = grad_enabled and bias is not None and bias.requires_grad
    if want_dh or want_dw or want_db:
        return _LinearCrossEntropyFunction.apply(hidden, weight, bias, targets, ignore_index, reduction,
                                                 label_smoothing, chunk_size, check_targets, want_dh, want_dw, want_db)
    V = weight.shape[0]
    h, targets_flat, scale, n_valid = _prepare_linear(hidden, targets, reduction, ignore_index, check_targets, V)
    losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    chunk_rows = _lce_chunk_rows(h.shape[0], V, weight.element_size(), chunk_size)
    _linear_cross_entropy_chunks(h, weight, bias, targets_flat, losses, scale, 0, False, False, False, chunk_rows,
                                 ignore_index, label_smoothing)
    return _reduce(losses, reduction, n_valid, targets.shape)


class TritonLinearCrossEntropyLoss(torch.nn.Module):
    """Loss module taking (hidden, weight, targets[, bias]); use it with lm_head.weight instead of calling lm_head."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, chunk_size=None, check_targets=False):
        super().__init__()
        _check_common_args(reduction, label_smoothing)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.chunk_size = chunk_size
        self.check_targets = check_targets

    def forward(self, hidden, weight, targets, bias=None):
        return linear_cross_entropy(hidden, weight, targets, bias, self.ignore_index, self.reduction,
                                    self.label_smoothing, self.chunk_size, self.check_targets)

    def extra_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, chunk_size={self.chunk_size}")
