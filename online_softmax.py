"""The online softmax's building blocks, shared by the two cross-entropy kernels (Triton @jit functions).

cross_entropy_kernel.py's row kernel and cross_entropy_smem_kernel.py's shared-memory kernel compute the same thing in
the same arithmetic: per row, the running maximum m and the running sum d of exp(x - m) over chunks of the vocabulary
(Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018), the loss log d + m - x[target], and the
gradient softmax(x) - onehot(target) rebuilt from m and d. They differ in where the row waits between its two passes
(L2 or shared memory), so the steps they share live here, and each kernel file imports them: neither kernel file
imports the other. Read them in cross_entropy_kernel.py's order: that file explains each where its kernel uses it.

Memory-bound does not mean the arithmetic is free: at ~4 TB/s there is room for a handful of instructions per logit,
hence exp2 in base 2 (one instruction), masks on the partial chunk only, and the gradient's scale folded into the
exponent.
"""
import os
import sys

import torch

# Without a GPU the kernels run on Triton's CPU interpreter. Triton reads TRITON_INTERPRET when @triton.jit decorates a
# function, so it is set before `import triton`; the first kernel module imported prints the one-line notice.
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
    print("No CUDA device: Triton kernels run on the CPU interpreter (toy sizes; times are not meaningful).",
          file=sys.stderr)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
_LANE_WIDTH = 8  # columns per lane: 8 x 2 bytes = one 16-byte load per thread for bf16


LOG2E = tl.constexpr(1.442_695_040_888_963_4)  # exp(y) = 2^(y * log2(e)): the kernels work in base 2


@triton.jit
def _exp2(x, FAST_EXP2: tl.constexpr):
    """2^x. On the GPU one MUFU.EX2 instruction with flush-to-zero: tl.exp2 (and tl.exp) lower to ex2.approx.f32,
    which ptxas expands into four instructions to get results below 2^-126 exactly; those are softmax values under
    1e-38, so flushing them to 0 is harmless. The interpreter has no inline PTX and uses tl.exp2."""
    if FAST_EXP2:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def _online_softmax_update(x, lane_max, lane_sum, FAST_EXP2: tl.constexpr):
    """Fold one [N_LANES, LANE_WIDTH] chunk into each lane's running max and running sum of exp(x - max). The max is
    subtracted first, in natural units: x - max is exact for the values close to the max, whereas one multiply-add
    x*log2(e) - c would round c = max*log2(e) (1e-3 off in the exponent for logits of 1e4). A lane that has seen only
    padding (-inf) keeps max -inf; shifting by 0 avoids -inf - (-inf) = NaN. The old sum is rescaled to the new max
    before the chunk is added: every exponent is <= 0, so nothing overflows."""
    new_max = tl.maximum(lane_max, tl.max(x, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    chunk_sum = tl.sum(_exp2((x - shift[:, None]) * LOG2E, FAST_EXP2), axis=1)
    return new_max, lane_sum * _exp2((lane_max - shift) * LOG2E, FAST_EXP2) + chunk_sum


@triton.jit
def _row_start(base_ptr, row, rows_per_batch, stride_b, stride_t):
    """Address of flat row `row` (int64) of a [N, V] (stride_b = 0, rows_per_batch = N) or [B, T, V] tensor."""
    b = row // rows_per_batch
    return base_ptr + b * stride_b + (row - b * rows_per_batch) * stride_t


@triton.jit
def _merge_lanes(lane_max, lane_sum, FAST_EXP2: tl.constexpr, lane_start=None, past_end=None,
                 TRACK_ARGMAX: tl.constexpr = False, log2_unit=LOG2E):
    """Combine the lanes once per row, by the same rule: the row max, and every lane's sum rescaled to it (log2_unit:
    log2 of e per unit of the maxima, softcap * log2(e) for the softcap's t, see _capped_softmax_update).
    Returns (row_max, row_sum, argmax_start). Extra, TRACK_ARGMAX: argmax_start is the lowest lane_start (a lane's
    first column) among the lanes whose max is the row's, i.e. the lane of the row's first maximal logit, or past_end
    (a column >= V) if there is none (a NaN max); 0 otherwise. It is reduced together with the sum, in one tuple
    reduction: across warps, each reduction is a round trip through shared memory between barriers."""
    row_max = tl.max(lane_max, axis=0)
    rescaled_sum = lane_sum * _exp2((lane_max - row_max) * log2_unit, FAST_EXP2)
    if TRACK_ARGMAX:
        row_sum, argmax_start = tl.reduce((rescaled_sum, tl.where(lane_max == row_max, lane_start, past_end)), 0,
                                          _sum_and_min)
    else:
        row_sum = tl.sum(rescaled_sum, axis=0)
        argmax_start = 0
    return row_max, row_sum, argmax_start


@triton.jit
def _sum_and_min(sum_a, start_a, sum_b, start_b):
    """_merge_lanes' combine function: the sums add up, the lane starts keep the lowest."""
    return sum_a + sum_b, tl.minimum(start_a, start_b)


@triton.jit
def _row_loss(row_max, row_sum, x_target, sum_x_tile, label_smoothing, V, HAS_SMOOTHING: tl.constexpr,
              weight_target=None, weight_total=None, HAS_WEIGHT: tl.constexpr = False):
    """(1 - eps) * (lse - x_target) + (eps / V) * sum_j (lse - x_j), with lse = row_max + log(row_sum).
    Extra, class weights w (PyTorch's rule): w_target * (1 - eps) * (lse - x_target) + (eps / V) * sum_j w_j (lse -
    x_j); then sum_x_tile holds w_j * x_j and weight_total is sum_j w_j."""
    lse = row_max + tl.log(row_sum)
    if HAS_WEIGHT:
        loss = weight_target * (lse - x_target)
        if HAS_SMOOTHING:
            sum_wx = tl.sum(tl.sum(sum_x_tile, axis=1), axis=0)
            loss = (1.0 - label_smoothing) * loss + (label_smoothing / V) * (weight_total * lse - sum_wx)
        return loss
    elif HAS_SMOOTHING:
        sum_x = tl.sum(tl.sum(sum_x_tile, axis=1), axis=0)
        return lse - (1.0 - label_smoothing) * x_target - (label_smoothing / V) * sum_x
    else:
        return lse - x_target


@triton.jit
def _softmax_gradient(x, row_max, exponent_offset, scale, smoothing_term, POSITIVE_SCALE: tl.constexpr,
                      HAS_SMOOTHING: tl.constexpr, FAST_EXP2: tl.constexpr, columns=None, weight_ptr=None,
                      softcap=None, HAS_WEIGHT: tl.constexpr = False, HAS_SOFTCAP: tl.constexpr = False,
                      FAST_TANH: tl.constexpr = False, EXP2_ON_FMA: tl.constexpr = False):
    """scale * (softmax(x) - eps / V) without the one-hot term (added once per row by the caller). softmax(x) =
    2^((x - row_max) * log2(e) - log2(sum)): a subtraction, one fused multiply-add and one exp2. With a positive scale
    the caller folds log2(scale) into the offset too (scale * 2^y = 2^(y + log2(scale))); else it is a multiply.
    Extras: class weights make the smoothing term of column j smoothing_term * w_j; a softcap replaces x by the
    capped logit softcap * t, t = tanh(x / softcap), and multiplies the result by the cap's slope 1 - t^2 (the chain
    rule). Both come from t: one multiply-add takes t to the exponent, another gives the slope. EXP2_ON_FMA (softcap
    only): the exp2 runs on the FMA pipe (see _row_gradient)."""
    if HAS_SOFTCAP:
        t = _tanh(x * (1.0 / softcap), FAST_EXP2, FAST_TANH)
        exponent = t * (softcap * LOG2E) - (row_max * LOG2E + exponent_offset)
        if EXP2_ON_FMA:
            grad = _exp2_on_fma(exponent)
        else:
            grad = _exp2(exponent, FAST_EXP2)
    else:
        grad = _exp2((x - row_max) * LOG2E - exponent_offset, FAST_EXP2)
    if not POSITIVE_SCALE:
        grad = grad * scale
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            grad = grad - smoothing_term * tl.load(weight_ptr + columns)
        else:
            grad = grad - smoothing_term
    if HAS_SOFTCAP:
        grad = grad * (1.0 - t * t)
    return grad


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """x (fp32) cast to `dtype`, rounding to nearest even as the GPU does. Triton's CPU interpreter truncates
    fp32 -> bf16 instead (and mangles subnormal results), so there the bf16 bits are made directly: adding 0x7FFF, plus
    1 when the last kept bit is odd (ties to even), carries into the upper 16 bits exactly when rounding up, and those
    16 bits are the result; NaN becomes the canonical bf16 NaN. fp16 casts already round there, and on the GPU this is
    a plain cast."""
    if INTERPRETER and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        upper = tl.where(x != x, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
        return upper.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


# ---- The extras' helpers: softcap, class weights and z-loss in the gradient, argmax ----
@triton.jit
def _exp2_on_fma(y):
    """2^y without the multi-function unit, on the FMA pipe: y = j + f with j = round(y), f in [-0.5, 0.5]. Adding
    1.5 * 2^23 rounds y to j (the float's ulp is then 1) and leaves j in the low mantissa bits; a degree-4 polynomial
    gives 2^f (relative error 2.8e-6, fitted on [-0.5, 0.5]); j << 23 added to its bits multiplies it by 2^j. About
    nine instructions for the one MUFU.EX2 they replace. y is clamped at -126 (smaller j would wrap the exponent
    field: 2^-126 for 0 is harmless), but a NaN goes through."""
    y = tl.maximum(y, -126.0, propagate_nan=tl.PropagateNan.ALL)
    rounded = y + 12582912.0
    f = y - (rounded - 12582912.0)
    p = 1.0 + f * (0.6931241750717163 + f * (0.24024100601673126 + f * (0.055906426161527634
                                                                          + f * 0.00958279799669981)))
    return ((rounded.to(tl.int32, bitcast=True) << 23) + p.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def _reciprocal(x, FAST_EXP2: tl.constexpr):
    """1 / x. On the GPU one MUFU.RCP instruction (rcp.approx.ftz, within 1 ulp) instead of the IEEE division's
    dozen; used by the softcap extra only. The interpreter divides."""
    if FAST_EXP2:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


@triton.jit
def _capped_softmax_update(t, lane_max, lane_sum, cap_log2e, FAST_EXP2: tl.constexpr):
    """_online_softmax_update for the softcap's capped logits softcap * t, kept in units of t = tanh(x / softcap):
    exp(softcap * t - softcap * max) = 2^(t * cap_log2e - max * cap_log2e) with cap_log2e = softcap * log2(e), so one
    fused multiply-add per logit takes t to the exponent and the capped logit is never formed. t lies in [-1, 1]
    (masked columns: -inf), so a lane's max starts at -1 and is never -inf: no guard against -inf - (-inf)."""
    new_max = tl.maximum(lane_max, tl.max(t, axis=1))
    shift = new_max * cap_log2e
    chunk_sum = tl.sum(_exp2(t * cap_log2e - shift[:, None], FAST_EXP2), axis=1)
    return new_max, lane_sum * _exp2(lane_max * cap_log2e - shift, FAST_EXP2) + chunk_sum


@triton.jit
def _tanh(z, FAST_EXP2: tl.constexpr, FAST_TANH: tl.constexpr):
    """tanh(z). FAST_TANH (16-bit logits on the GPU): one tanh.approx.f32 instruction, relative error about 2^-11,
    below the logits' own rounding (2^-9 for bf16). Otherwise 1 - 2 / (exp(2z) + 1), one exp2 and one reciprocal,
    and for |z| < 0.4, where that difference cancels (a large softcap makes every z small), tanh's Taylor series to
    z^13 (the next term is below 1e-8 of tanh there): relative error about 2e-7. The multi-function unit that runs
    tanh, exp2 and reciprocal does 16 per cycle per multiprocessor, an eighth of the FMA rate: with a tanh and an exp2
    per logit in each pass it sets the softcap's pace, not memory (see results/NOTES.md). -inf gives -1."""
    if FAST_TANH:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [z], dtype=tl.float32, is_pure=True,
                                         pack=1)
    y = z * (2.0 * LOG2E)
    if INTERPRETER:
        y = tl.minimum(y, 126.0)  # numpy warns when exp2 overflows to inf (on the GPU: inf, then 1, silently)
    tanh_far = 1.0 - 2.0 * _reciprocal(_exp2(y, FAST_EXP2) + 1.0, FAST_EXP2)
    z2 = z * z
    # z - z^3/3 + 2z^5/15 - 17z^7/315 + 62z^9/2835 - 1382z^11/155925 + 21844z^13/6081075, by Horner's rule in z^2
    series = (21844.0 / 6081075.0) * z2 - 1382.0 / 155925.0
    series = ((series * z2 + 62.0 / 2835.0) * z2 - 17.0 / 315.0) * z2 + 2.0 / 15.0
    tanh_near = z + z * z2 * (series * z2 - 1.0 / 3.0)
    return tl.where(tl.abs(z) < 0.4, tanh_near, tanh_far)


@triton.jit
def _softcap(x, softcap, FAST_EXP2: tl.constexpr, FAST_TANH: tl.constexpr):
    """softcap * tanh(x / softcap), the capped logit. -inf gives -softcap."""
    return softcap * _tanh(x * (1.0 / softcap), FAST_EXP2, FAST_TANH)


@triton.jit
def _softcap_slope(x, softcap):
    """d(softcap * tanh(z / softcap)) / dz = 1 - tanh^2 = 1 - (x / softcap)^2, from the capped logit x."""
    return 1.0 - (x * x) * (1.0 / (softcap * softcap))


@triton.jit
def _gradient_scales(scale, label_smoothing, V, weight_target, weight_total, lse, lse_square_scale, z_scale_ptr,
                     z_scale_offset, HAS_WEIGHT: tl.constexpr, HAS_Z_LOSS: tl.constexpr):
    """(softmax_scale, target_scale): the coefficients of softmax(x) and of (1 - eps) * one-hot in a row's gradient,
    both `scale` without extras. Class weights w (W = their sum): dx_j = scale * ((1 - eps) * w_t * (p_j - [j == t])
    + eps / V * (W * p_j - w_j)). The z-loss adds z_scale * 2 * lse_square_scale * lse * p_j. Either can make the
    softmax coefficient <= 0, so the launcher does not fold it into the exponent (POSITIVE_SCALE off)."""
    softmax_scale = scale
    target_scale = scale
    if HAS_WEIGHT:
        target_scale = scale * weight_target
        softmax_scale = (1.0 - label_smoothing) * target_scale + (label_smoothing / V) * weight_total * scale
    if HAS_Z_LOSS:
        z_scale = tl.load(z_scale_ptr + z_scale_offset).to(tl.float32)
        softmax_scale += 2.0 * lse_square_scale * lse * z_scale
    return softmax_scale, target_scale


# The argmax per row, in pass 1: each lane keeps, besides its running max, the lowest chunk index where that max occurs
# (a compare and a select per lane and chunk, nothing per logit). The lowest (chunk, lane) whose max is the row's then
# holds the row's first maximal column, found by re-reading its LANE_WIDTH logits (torch.argmax's rule).
@triton.jit
def _lane_argmax_update(x, chunk, lane_max, lane_chunk, IN_ORDER: tl.constexpr):
    """lane_chunk after chunk `chunk` of tile x, given the lanes' max before it; the compiler computes tl.max(x) once
    for this and for the online-softmax update. IN_ORDER (every chunk seen before has a lower index: the row
    kernel's chunks, lane_chunk starting at 0, and the shared-memory kernel's kept and partial chunks, which come after
    every streamed chunk below them): a lane moves on only to a larger max. The shared-memory kernel's streamed chunks
    come after higher kept chunks, so there an equal max moves a lane to a lower chunk as well; its lanes start at
    _NO_CHUNK, and chunk 0, always streamed, moves every lane still there (an equal max of -inf included)."""
    chunk_max = tl.max(x, axis=1)
    if IN_ORDER:
        better = chunk_max > lane_max
    else:
        better = (chunk_max > lane_max) | ((chunk_max == lane_max) & (chunk < lane_chunk))
    return tl.where(better, chunk, lane_chunk)


@triton.jit
def _argmax_lane(argmax_start, lane_index, chunk_offsets, BLOCK_V: tl.constexpr, LANE_WIDTH: tl.constexpr):
    """(columns, is_argmax_lane): the columns of the chunk that holds column argmax_start, as a [N_LANES,
    LANE_WIDTH] tile, and which lane starts at argmax_start ([N_LANES]; lane_index = arange(0, N_LANES)). A load
    mask that is one value per lane lets the compiler read the lane with one 16-byte load; a mask that compares each
    column with the lane's bounds takes one 2-byte load per column."""
    chunk_start = (argmax_start // BLOCK_V) * BLOCK_V
    return chunk_start + chunk_offsets, chunk_start + lane_index * LANE_WIDTH == argmax_start


@triton.jit
def _store_argmax(x, columns, is_argmax_lane, predicted_row_ptr, V, softcap, HAS_SOFTCAP: tl.constexpr,
                  FAST_EXP2: tl.constexpr, FAST_TANH: tl.constexpr):
    """Store the row's argmax: x is a chunk's tile holding only the argmax lane's logits (-inf elsewhere), columns
    their column indices, is_argmax_lane that lane (see _argmax_lane). The lane's first largest column is found
    inside the thread that holds the lane (a lane never spans threads) and stored by that thread alone: no shuffle, no
    barrier. (Rows with NaN logits are left undefined by the public API: Triton's max skips NaN, unlike
    torch.argmax.)"""
    if HAS_SOFTCAP:  # the argmax of the capped logits: capping can tie values that differ
        x = tl.where(columns < V, _softcap(x, softcap, FAST_EXP2, FAST_TANH), float("-inf"))
    lane_top = tl.max(x, axis=1)
    first = tl.min(tl.where(x == lane_top[:, None], columns, V), axis=1)
    tl.store(predicted_row_ptr + first * 0, first, mask=is_argmax_lane)
