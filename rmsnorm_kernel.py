"""Fused RMSNorm in Triton: a drop-in replacement for transformers' LlamaRMSNorm. Read this kernel file first.

What it computes
----------------
For each row x of length H (the hidden size), in LlamaRMSNorm's order: upcast, normalize, round BACK to x's dtype,
and only then multiply by the weight (the output dtype is PyTorch's promotion of weight and x):
    rstd = 1 / sqrt(mean(x.float() ** 2) + eps)    normed = (x.float() * rstd).to(x.dtype)    y = weight * normed
Backward, with n = x.float() * rstd and g = dy * weight (the gradient reaching `normed`):
    dx = rstd * (g - n * mean(g * n))  per row;    dw = sum over all rows of dy * normed

Options (argument names as in Liger-Kernel's LigerRMSNormFunction)
-------------------------------------------------------------------
- casting_mode: where values round to x's dtype, after each model family's own code. "llama" (default): as above.
  "gemma" (GemmaRMSNorm): everything in fp32, one rounding at the end, output in x's dtype:
  y = (x.float() * rstd * (offset + weight.float())).to(x.dtype). "none": every step in x's dtype, as PyTorch runs
  these ops on a bf16 tensor without upcasting (x ** 2, the mean, + eps, rsqrt, x * rstd and * weight each round).
- offset: y = normed * (offset + weight). Gemma stores its weight as w - 1 and uses offset 1.0.
- weight None (elementwise_affine=False in the module): y = normed, and no dw.
- in_place: the backward writes dx into dy's buffer (one [rows, H] buffer less) when dy is laid out like x and of
  x's dtype. Only for a dy that nothing else reads afterwards: a residual branch that also receives dy would see dx.
Each option is a compile-time constant of the kernels (tl.constexpr): the default path compiles to the same machine
code as before the options existed, and each other combination compiles once. The backward computes in fp32 in every
mode and rounds once (eager's extra roundings in a backward are artifacts of running separate ops, not of the model).

Bytes it must move
------------------
Unfused, PyTorch runs pow, mean, add, rsqrt, mul, cast and mul as separate kernels, each a trip of a [rows, H] tensor
through memory; at ~4 FLOPs per byte, memory traffic sets the time. Fused, the minimum is what remains: the forward
reads x and writes y (2 * rows * H elements), the backward reads x and dy and writes dx (3 * rows * H). The weight,
one fp32 rstd per row and a few rows of fp32 partial sums for dw are small next to that.

Triton concepts introduced here
-------------------------------
- A kernel runs as many programs at once; tl.program_id(0) says which one this is, the grid (`kernel[grid](...)`)
  how many there are.
- tl.arange(0, BLOCK) is a block of indices (BLOCK a power of two); a mask switches off those past the row's end.
- Pointer arithmetic: element (r, c) of a [rows, H] tensor lives at ptr + r * row_stride + c; the offsets are int64,
  since rows * H can pass 2**31.
- tl.load(ptrs, mask=, other=) / tl.store(ptrs, values, mask=): masked lanes read `other` and write nothing.
- tl.constexpr parameters are compile-time constants (block shapes); each new value compiles a new kernel.
- Reductions: tl.sum(block, axis=1) sums each row of a 2-D block.
- num_warps: how many groups of 32 GPU threads run one program.
- Persistent programs: the backward runs one program per multiprocessor, each looping over many row blocks with
  tl.range(..., num_stages=3), which loads the next block while the current one is computed.

Limits
------
A whole row lives in one program's registers: H <= MAX_HIDDEN_SIZE (65536; LLaMA-3.1-8B uses 4096). x is fp32, bf16 or
fp16 with any leading dimensions, strided (non-contiguous) or empty; y and dx are dense, their dimensions in x's memory
order (rows read in that order, section 2): laid out like x wherever x is dense; eps and offset are finite, eps >= 0.
Without a GPU the same kernels run on Triton's CPU interpreter (slow: toy sizes).

torch.compile traces the kernels as custom operators (torch.ops.playbook.*, section 3); eager calls keep the
autograd.Function, which costs less host time.
"""
import contextlib
import math
import os
import sys
from typing import Optional

import torch

# Without a GPU the kernels run on Triton's CPU interpreter. Triton reads TRITON_INTERPRET when @triton.jit decorates a
# function, so it is set before `import triton`; the first kernel module imported prints the one-line notice.
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
    print("No CUDA device: Triton kernels run on the CPU interpreter (toy sizes; times are not meaningful).",
          file=sys.stderr)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# The one device rule: the kernels run on the GPU when there is one, on the CPU interpreter otherwise.
INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
KERNEL_DEVICE = "cpu" if INTERPRETER else "cuda"


def _check_device(who, name, tensor):
    """Raise a clear error unless `tensor` lives where the kernels run."""
    if tensor.device.type != KERNEL_DEVICE:
        raise ValueError(f"{who}: {name} is on {tensor.device}, but the Triton kernels run on {KERNEL_DEVICE} here; "
                         f"move it to {KERNEL_DEVICE}")


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


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """x (fp32) rounded to `dtype` and widened back to fp32: the value a tensor of `dtype` would hold."""
    return _round_to(x, dtype).to(tl.float32)


CASTING_MODES = ("llama", "gemma", "none")

__all__ = ["MAX_HIDDEN_SIZE", "CASTING_MODES", "GEMMA_RMSNORM_CLASSES", "rmsnorm_forward", "rmsnorm_backward",
           "RMSNormFunction", "rms_norm", "TritonRMSNorm", "replace_rmsnorm"]


# ----------------------------------------------------------------------------------------------------------------------
# 1. Kernels
# ----------------------------------------------------------------------------------------------------------------------
@triton.jit
def _rmsnorm_forward_kernel(
    x_ptr,          # input rows [n_rows, n_cols], unit stride along a row; fp32, bf16 or fp16
    weight_ptr,     # [n_cols], or None without a weight
    y_ptr,          # output rows [n_rows, n_cols]: PyTorch's promotion of the weight and x dtypes ("gemma": x's)
    rstd_ptr,       # [n_rows] fp32: 1 / rms of each row, saved for the backward
    x_row_stride,   # elements from one row of x to the next (more than n_cols when x is a slice of a wider tensor)
    y_row_stride,   # the same for y
    n_rows,         # rows in this launch
    n_cols,         # the hidden size H
    eps,            # added to the mean square before the square root
    BLOCK_ROWS: tl.constexpr,  # rows per program
    BLOCK_COLS: tl.constexpr,  # n_cols rounded up to a power of two (block shapes must be powers of two)
    CASTING_MODE: tl.constexpr,  # "llama", "gemma" or "none": where values round to x's dtype (module docstring)
    OFFSET: tl.constexpr,        # y = normed * (OFFSET + weight): 0.0, or 1.0 for Gemma's weights stored as w - 1
    HAS_WEIGHT: tl.constexpr,    # False: y = normed
):
    # The options are compile-time constants: an `if` on them is decided while compiling and the branch not taken
    # generates no code, so the default (Llama) kernel is the same machine code as before the options existed.
    # Program p normalizes rows p * BLOCK_ROWS ... p * BLOCK_ROWS + BLOCK_ROWS - 1, each row whole.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows  # the last program may run past the last row
    col_mask = cols < n_cols  # the padding columns up to BLOCK_COLS
    mask = row_mask[:, None] & col_mask[None, :]  # [BLOCK_ROWS, BLOCK_COLS] by broadcasting, as in torch
    # int64 before multiplying by the stride: rows * H passes 2**31 at 524288 tokens of a 4096-wide model.
    rows = rows.to(tl.int64)

    # A [BLOCK_ROWS, BLOCK_COLS] block of pointers. Masked-off elements load as 0, so they add nothing to the sum of
    # squares. The math runs in fp32 whatever the input dtype.
    x_dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if CASTING_MODE == "none":
        # PyTorch rounds the result of every op on a bf16 tensor to bf16 (it computes each in fp32 internally): so
        # does this branch, step by step. The mean's sum is accumulated in fp32, as PyTorch's is.
        mean_square = _rounded(tl.sum(_rounded(x * x, x_dtype), axis=1) / n_cols, x_dtype)
        rstd = _rounded(tl.rsqrt(_rounded(mean_square + eps, x_dtype)), x_dtype)
    else:
        # Divide by the true hidden size, not BLOCK_COLS.
        mean_square = tl.sum(x * x, axis=1) / n_cols
        rstd = tl.rsqrt(mean_square + eps)

    normed = x * rstd[:, None]
    if CASTING_MODE != "gemma":
        # LlamaRMSNorm's cast order: normalize in fp32, round to the input dtype, THEN multiply by the weight. In bf16
        # the weight multiplies the rounded values, so multiplying in fp32 and rounding once would give different
        # bits. GemmaRMSNorm's order is that other one: fp32 to the end, one rounding.
        normed = _rounded(normed, x_dtype)
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if OFFSET != 0.0:
            weight += OFFSET
            if CASTING_MODE == "none":
                weight = _rounded(weight, weight_ptr.dtype.element_ty)  # offset + weight: a tensor of its dtype
        y = weight[None, :] * normed
    else:
        y = normed
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], _round_to(y, y_ptr.dtype.element_ty), mask=mask)
    # One fp32 per row saved for the backward pass, so it need not recompute the sum of squares.
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


# The weight gradient sums over ALL rows. Writing dy * normed to an fp32 [rows, H] buffer and summing it with torch
# costs 8 more bytes per element. Instead a fixed number of "persistent" programs each walk over a share of the rows,
# keep a running fp32 sum in registers and write ONE row of partial sums at the end; torch adds those few rows. The
# same rows always go to the same program in the same order, so dw is deterministic.
@triton.jit
def _rmsnorm_backward_kernel(
    dy_ptr,          # upstream gradient rows [n_rows, n_cols], unit stride along a row
    x_ptr,           # the forward's input rows
    weight_ptr,      # [n_cols], or None without a weight
    rstd_ptr,        # [n_rows] fp32, from the forward
    dx_ptr,          # output rows [n_rows, n_cols], in x's dtype. In place it is dy_ptr itself: safe, because each
                     # row block is loaded whole before its dx is stored, and no other program touches those rows
    dw_partial_ptr,  # output [number of programs, n_cols] fp32: one row of partial weight-gradient sums per program
                     # (None without a weight, or when its gradient is not wanted)
    dy_row_stride,   # each tensor has its own row stride: the upstream gradient need not be laid out like x
    x_row_stride,
    dx_row_stride,
    n_rows,          # rows in this launch
    n_cols,          # the hidden size H
    BLOCK_ROWS: tl.constexpr,  # rows per loop step
    BLOCK_COLS: tl.constexpr,  # n_cols rounded up to a power of two
    NUM_STAGES: tl.constexpr,  # row blocks in flight: loads of the next ones overlap the math on this one
    CASTING_MODE: tl.constexpr,  # the forward's options
    OFFSET: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    WANT_DW: tl.constexpr,  # False for a frozen weight (LoRA): dx still needs the weight, its gradient is not summed
):
    # Program p handles row blocks p, p + P, p + 2P, ... (P programs in the grid).
    program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        # The factor the forward multiplied by, loaded once per program and reused for every row block it handles.
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        if OFFSET != 0.0:
            weight += OFFSET
            if CASTING_MODE == "none":
                weight = _rounded(weight, weight_ptr.dtype.element_ty)
        if WANT_DW:
            dw_acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)

    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    # tl.range is range() with pipelining hints: num_stages lets the compiler start loading the next row blocks while
    # this one is being computed.
    for row_block in tl.range(program, n_row_blocks, n_programs, num_stages=NUM_STAGES):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)

        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        normed = x * rstd[:, None]  # "none": with the rounded rstd its forward used
        if HAS_WEIGHT:
            # dw sums dy times what the forward multiplied the weight by: the ROUNDED normalized values, except in
            # Gemma's order, which keeps them in fp32.
            if WANT_DW:
                if CASTING_MODE == "gemma":
                    dw_acc += dy * normed
                else:
                    dw_acc += dy * _rounded(normed, x_ptr.dtype.element_ty)
            dnormed = dy * weight[None, :]
        else:
            dnormed = dy

        # dx = rstd * (g - n * mean(g * n)): the second term is the gradient flowing through rstd's dependence on x.
        mean_dnormed_normed = tl.sum(dnormed * normed, axis=1) / n_cols
        dx = (dnormed - normed * mean_dnormed_normed[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], _round_to(dx, dx_ptr.dtype.element_ty),
                 mask=mask)

    if HAS_WEIGHT and WANT_DW:
        # One row of fp32 partial sums per program; the launcher adds the rows.
        dw_partial = tl.sum(dw_acc, axis=0)
        tl.store(dw_partial_ptr + program.to(tl.int64) * n_cols + cols, dw_partial, mask=col_mask)


# ----------------------------------------------------------------------------------------------------------------------
# 2. Launchers
# ----------------------------------------------------------------------------------------------------------------------
# A whole row lives in one program's registers (LLaMA-3.1-8B: 4096, 70B: 8192).
MAX_HIDDEN_SIZE = 65536


def _check_eps(who, eps):
    """eps must be a real number, finite and >= 0 (0 is allowed; LLaMA uses 1e-5). A negative eps gives NaN rows."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{who}: eps must be a float, got {type(eps).__name__}")
    if not 0 <= eps < float("inf"):  # also False for NaN
        raise ValueError(f"{who}: eps must be a finite number >= 0 (LLaMA uses 1e-5), got {eps}")


def _check_options(who, offset, casting_mode):
    """offset: a finite real number; casting_mode: one of CASTING_MODES."""
    if isinstance(offset, bool) or not isinstance(offset, (int, float)):
        raise TypeError(f"{who}: offset must be a float, got {type(offset).__name__}")
    if not -float("inf") < offset < float("inf"):  # also False for NaN
        raise ValueError(f"{who}: offset must be a finite number (0.0, or Gemma's 1.0), got {offset}")
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"{who}: casting_mode must be one of {', '.join(map(repr, CASTING_MODES))}, "
                         f"got {casting_mode!r}")


def _validate(x, weight, eps, offset=0.0, casting_mode="llama"):
    if not isinstance(x, torch.Tensor) or not isinstance(weight, (torch.Tensor, type(None))):
        raise TypeError("rms_norm: x and weight must be torch.Tensors (weight may be None)")
    if not x.is_floating_point() or (weight is not None and not weight.is_floating_point()):
        raise TypeError(f"rms_norm: x and weight must be floating point, got x {x.dtype} and weight "
                        f"{None if weight is None else weight.dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"rms_norm: x must be float32, bfloat16 or float16, got {x.dtype}")
    _check_eps("rms_norm", eps)
    _check_options("rms_norm", offset, casting_mode)
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have at least one dimension (the hidden size)")
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != x.shape[-1]):
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} does not match the last dimension of x "
                         f"({x.shape[-1]}); expected a weight of shape ({x.shape[-1]},)")
    if x.shape[-1] > MAX_HIDDEN_SIZE:
        raise ValueError(f"rms_norm: hidden size {x.shape[-1]} is above the maximum of {MAX_HIDDEN_SIZE} "
                         f"(a whole row must fit in one program's registers)")
    if weight is not None and x.device != weight.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight is on {weight.device}")
    _check_device("rms_norm", "x", x)


def _output_dtype(x, weight, casting_mode):
    """y's dtype: x's in Gemma's order (`.type_as(x)`) or without a weight, else what `weight * normed` gives."""
    if weight is None or casting_mode == "gemma":
        return x.dtype
    return torch.promote_types(weight.dtype, x.dtype)


def _row_order(t):
    """The dimensions of t in the order its memory runs, the last (H) last: t.permute(order) is contiguous wherever t
    is dense, whatever its layout. Qwen3's and Gemma 3's q_norm/k_norm get [B, heads, T, head_dim] views of a
    [B, T, heads, head_dim] projection; rows taken in memory order need no copy, and an output laid out like the input
    keeps attention's strides as eager's norm leaves them (a [B, heads, T, D]-ordered q would make attention's output
    that order too, and transformers then copies it back: one more [T, hidden] tensor per layer)."""
    leading = sorted(range(t.dim() - 1), key=lambda dim: -t.stride(dim))  # stable: size-1 dims keep their place
    return [*leading, t.dim() - 1]


def _as_rows(t, order):
    """View t as [rows, H], rows in `order` (see _row_order), with unit stride along H. Copies only when no such view
    exists (an expanded or overlapping t). The row count is explicit because reshape(-1, 0) cannot infer it when H
    is 0."""
    rows = t.permute(order).reshape(math.prod(t.shape[:-1]), t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _empty_rows(like, order, dtype):
    """(t, rows): a new tensor shaped like `like` whose [rows, H] view in `order` is contiguous, and that view."""
    inverse = sorted(range(len(order)), key=order.__getitem__)
    rows = torch.empty([like.shape[dim] for dim in order], dtype=dtype, device=like.device)
    return rows.permute(inverse), rows.view(math.prod(like.shape[:-1]), like.shape[-1])


def _on_tensor_device(t):
    """Triton launches on the CURRENT CUDA device and its stream: switch to t's GPU when it is another one (a model
    spread over GPUs with device_map), and only then, because entering torch.cuda.device() on every call costs host
    time in a host-bound step."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _forward_config(n_cols):
    """(BLOCK_ROWS, BLOCK_COLS, num_warps) for the forward kernel."""
    block_cols = triton.next_power_of_2(n_cols)
    if INTERPRETER:
        # The interpreter pays ~1 ms per program: give each program many rows.
        return max(1, 16384 // block_cols), block_cols, 1
    # ~16K elements per program, 32 per thread (4 rows x 16 warps at H=4096; measured on an H200, see results/NOTES.md).
    block_rows = max(1, 16384 // block_cols)
    num_warps = min(32, max(4, block_rows * block_cols // 1024))
    return block_rows, block_cols, num_warps


def _backward_config(n_cols):
    """(BLOCK_ROWS, BLOCK_COLS, num_warps, num_stages) for the backward kernel."""
    block_cols = triton.next_power_of_2(n_cols)
    if INTERPRETER:
        return max(1, 16384 // block_cols), block_cols, 1, 1
    # ~8K elements per loop step, 32 per thread, 3 pipeline stages (2 rows x 8 warps at H=4096; measured on an H200,
    # see results/NOTES.md).
    block_rows = max(1, 8192 // block_cols)
    num_warps = min(32, max(4, block_rows * block_cols // 1024))
    return block_rows, block_cols, num_warps, 3


def rmsnorm_forward(x, weight, eps, offset=0.0, casting_mode="llama"):
    """Launch the forward kernel. Returns (y, rstd): y shaped like x, rstd one fp32 per row. weight may be None."""
    _validate(x, weight, eps, offset, casting_mode)
    order = _row_order(x)
    x_rows = _as_rows(x, order)
    if weight is not None:
        weight = weight.contiguous()  # the kernels read the weight with unit stride; a copy only for a strided view
    n_rows, n_cols = x_rows.shape
    y, y_rows = _empty_rows(x, order, _output_dtype(x, weight, casting_mode))
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)  # per row, in the rows' (memory) order
    if y.numel() > 0:  # no rows or no columns: nothing to normalize (a grid dimension of 0 is not allowed)
        block_rows, block_cols, num_warps = _forward_config(n_cols)
        # The grid: one program per block of rows.
        with _on_tensor_device(x):
            _rmsnorm_forward_kernel[(triton.cdiv(n_rows, block_rows),)](
                x_rows, weight, y_rows, rstd,
                x_rows.stride(0), y_rows.stride(0),
                n_rows, n_cols, eps,
                BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
                # A float offset, so that 1 and 1.0 are the same compiled kernel.
                CASTING_MODE=casting_mode, OFFSET=float(offset), HAS_WEIGHT=weight is not None,
                num_warps=num_warps,
            )
    return y, rstd


def rmsnorm_backward(dy, x, weight, rstd, offset=0.0, casting_mode="llama", in_place=False, want_dw=True):
    """Launch the backward kernel. Returns (dx, dw); dw is None when weight is None or want_dw is False (a frozen
    weight: its gradient is not summed at all). in_place=True writes dx into dy when dy is laid out like x and of x's
    dtype (dx is then dy), else into a new buffer laid out like x."""
    if dy.shape != x.shape:
        raise ValueError(f"rmsnorm_backward: dy of shape {tuple(dy.shape)} does not match x of shape {tuple(x.shape)}")
    _check_options("rmsnorm_backward", offset, casting_mode)
    order = _row_order(x)  # the forward's, so that row i of x, dy, dx and rstd[i] are the same row
    x_rows = _as_rows(x, order)
    dy_rows = _as_rows(dy, order)
    if weight is not None:
        weight = weight.contiguous()
    n_rows, n_cols = x_rows.shape
    # dy dense in x's row order: one row per H elements, each written once (an expanded dy, stride 0, has rows that
    # share memory); dx is in x's dtype, dy in the output's, which differs for a bf16 x with an fp32 weight.
    if in_place and dy.permute(order).is_contiguous() and dy.dtype == x.dtype:
        dx, dx_rows = dy, dy_rows
    else:
        dx, dx_rows = _empty_rows(x, order, x.dtype)
    if dx.numel() == 0:
        return dx, None if weight is None or not want_dw else torch.zeros_like(weight)
    block_rows, block_cols, num_warps, num_stages = _backward_config(n_cols)
    n_row_blocks = triton.cdiv(n_rows, block_rows)
    if INTERPRETER:
        n_programs = min(4, n_row_blocks)
    else:
        # One persistent program per multiprocessor: enough to fill the GPU, and each extra program would cost one
        # more row of partial sums to write and add.
        sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
        n_programs = min(n_row_blocks, sm_count)
    want_dw = weight is not None and want_dw
    dw_partial = torch.empty((n_programs, n_cols), dtype=torch.float32, device=x.device) if want_dw else None
    with _on_tensor_device(x):
        _rmsnorm_backward_kernel[(n_programs,)](
            dy_rows, x_rows, weight, rstd, dx_rows, dw_partial,
            dy_rows.stride(0), x_rows.stride(0), dx_rows.stride(0),
            n_rows, n_cols,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, NUM_STAGES=num_stages,
            CASTING_MODE=casting_mode, OFFSET=float(offset), HAS_WEIGHT=weight is not None, WANT_DW=want_dw,
            num_warps=num_warps,
        )
    # A [n_programs, H] fp32 sum: a few MB at most, and deterministic.
    dw = dw_partial.sum(dim=0).to(weight.dtype) if want_dw else None
    return dx, dw


# ----------------------------------------------------------------------------------------------------------------------
# 3. Autograd Function, custom operators (torch.compile), functional API, module, model patching
# ----------------------------------------------------------------------------------------------------------------------
class RMSNormFunction(torch.autograd.Function):
    """RMSNormFunction.apply(x, weight, eps, offset=0.0, casting_mode="llama", in_place=False): the arguments of
    Liger-Kernel's LigerRMSNormFunction, whose row_mode (a choice between two of its kernels) has no counterpart here.
    in_place defaults to False here, True there."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset=0.0, casting_mode="llama", in_place=False):
        y, rstd = rmsnorm_forward(x, weight, eps, offset, casting_mode)
        # x (not y) and the per-row rstd are all the backward needs: nothing of size [rows, H] in fp32 is kept.
        ctx.save_for_backward(x, weight, rstd)
        ctx.options = (offset, casting_mode, in_place)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rmsnorm_backward(dy, x, weight, rstd, *ctx.options, want_dw=ctx.needs_input_grad[1])
        return dx, dw, None, None, None, None


# torch.compile cannot look inside a launcher (host Python that checks inputs, picks block sizes and launches a Triton
# kernel), so it would break the graph there. Registered as a custom operator, the launcher becomes one opaque node of
# the graph instead: register_fake says what the operator returns (shapes, dtypes, strides) without running it, since
# the compiler traces with "fake" tensors that have no data, and register_autograd gives its backward, itself a custom
# operator so that the backward graph can be traced too. Every kernel of this project lives in the "playbook"
# namespace: torch.ops.playbook.rms_norm, torch.ops.playbook.swiglu, ...
# The options are trailing arguments with defaults, so that a call without them reads as before. in_place has no
# operator: under torch.compile the compiler plans the buffers itself, and an operator that overwrote its incoming
# gradient would have to declare it mutated, which makes the compiler copy it wherever anything else still reads it.
@torch.library.custom_op("playbook::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, offset: float = 0.0,
                 casting_mode: str = "llama") -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm_forward as an operator: (y, rstd)."""
    return rmsnorm_forward(x, weight, eps, offset, casting_mode)


@_rms_norm_op.register_fake
def _(x, weight, eps, offset=0.0, casting_mode="llama"):
    _validate(x, weight, eps, offset, casting_mode)  # bad input fails while tracing, with the launcher's message
    n_rows = math.prod(x.shape[:-1])
    y, _ = _empty_rows(x, _row_order(x), _output_dtype(x, weight, casting_mode))  # laid out as the launcher does
    return y, torch.empty(n_rows, dtype=torch.float32, device=x.device)


# An operator cannot return None (its schema has no optional outputs): without a weight, dw is an empty tensor.
@torch.library.custom_op("playbook::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], rstd: torch.Tensor,
                          offset: float = 0.0, casting_mode: str = "llama",
                          want_dw: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm_backward as an operator: (dx, dw), dw empty without a weight or when not wanted."""
    dx, dw = rmsnorm_backward(dy, x, weight, rstd, offset, casting_mode, want_dw=want_dw)
    return dx, x.new_empty(0) if dw is None else dw


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, offset=0.0, casting_mode="llama", want_dw=True):
    dw = (torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if weight is not None and want_dw
          else x.new_empty(0))
    return _empty_rows(x, _row_order(x), x.dtype)[0], dw


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, _, offset, casting_mode = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)  # what RMSNormFunction saves
    ctx.options = (offset, casting_mode)


def _rms_norm_op_backward(ctx, dy, _):  # rstd, the second output, passes no gradient on
    x, weight, rstd = ctx.saved_tensors
    want_dw = ctx.needs_input_grad[1]
    dx, dw = torch.ops.playbook.rms_norm_backward(dy, x, weight, rstd, *ctx.options, want_dw)
    return dx, dw if weight is not None and want_dw else None, None, None, None


_rms_norm_op.register_autograd(_rms_norm_op_backward, setup_context=_rms_norm_setup_context)


def rms_norm(x, weight, eps=1e-6, offset=0.0, casting_mode="llama", in_place=False):
    """RMSNorm of x over its last dimension, by default with LlamaRMSNorm's math and cast order; differentiable, and
    traced by torch.compile as the operator torch.ops.playbook.rms_norm. weight may be None (no scaling). offset,
    casting_mode ("llama", "gemma", "none") and in_place: see the module docstring; in_place is ignored under
    torch.compile."""
    # Eager calls take the autograd.Function: a custom operator's dispatch costs more host time per call (41 against
    # 8 us for the same trivial op, measured on a 2-core CPU), which a host-bound training step would feel at 65 norms
    # forward and backward. Under torch.compile only the operator can be traced, and the compiled graph calls it
    # below autograd.
    if torch.compiler.is_compiling():
        return torch.ops.playbook.rms_norm(x, weight, eps, offset, casting_mode)[0]
    return RMSNormFunction.apply(x, weight, eps, offset, casting_mode, in_place)


class TritonRMSNorm(torch.nn.Module):
    """Drop-in replacement for transformers' LlamaRMSNorm (the defaults) and GemmaRMSNorm (offset=1.0,
    casting_mode="gemma"), backed by the fused Triton kernels; the arguments are LigerRMSNorm's. The weight starts
    at 1 - offset, so that offset + weight = 1: ones as LlamaRMSNorm's, zeros as GemmaRMSNorm's."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", in_place=False,
                 elementwise_affine=True):
        super().__init__()
        _check_eps("TritonRMSNorm", eps)
        _check_options("TritonRMSNorm", offset, casting_mode)
        self.hidden_size = hidden_size
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.full((hidden_size,), 1.0 - offset))
        else:
            self.register_parameter("weight", None)
        self.variance_epsilon, self.offset, self.casting_mode, self.in_place = eps, offset, casting_mode, in_place

    @classmethod
    def _wrap(cls, who, expected, module, eps_names, **options):
        """A TritonRMSNorm around module's own weight Parameter (the SAME object, not a copy: optimizer state,
        state_dict keys and tied references keep pointing at the one tensor the rest of the program knows)."""
        weight = getattr(module, "weight", None)
        eps = next((getattr(module, name) for name in eps_names if hasattr(module, name)), None)
        if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1 or eps is None:
            raise TypeError(f"{who}: {type(module).__name__} has no 1-D weight Parameter and epsilon; expected a "
                            f"{expected}-like module")
        _check_eps(who, eps)
        new = cls(weight.shape[0], eps, elementwise_affine=False, **options)
        new.weight = weight
        return new

    @classmethod
    def from_llama_rmsnorm(cls, module):
        """Wrap an existing LlamaRMSNorm, reusing the SAME weight Parameter object and its epsilon."""
        return cls._wrap("from_llama_rmsnorm", "LlamaRMSNorm", module, ("variance_epsilon", "eps"))

    @classmethod
    def from_gemma_rmsnorm(cls, module):
        """Wrap an existing GemmaRMSNorm (or Gemma2's, Gemma3's: y = x_hat * (1 + w) in fp32), reusing the SAME
        weight Parameter object and its epsilon."""
        return cls._wrap("from_gemma_rmsnorm", "GemmaRMSNorm", module, ("eps",), offset=1.0, casting_mode="gemma")

    def forward(self, hidden_states):
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"TritonRMSNorm was built for hidden size {self.hidden_size} but got an input whose "
                             f"last dimension is {hidden_states.shape[-1]}")
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting_mode,
                        self.in_place)

    def extra_repr(self):
        options = "" if self.weight is not None else ", elementwise_affine=False"
        if (self.offset, self.casting_mode, self.in_place) != (0.0, "llama", False):
            options += f", offset={self.offset}, casting_mode={self.casting_mode!r}, in_place={self.in_place}"
        return f"({self.hidden_size},), eps={self.variance_epsilon}{options}"


# RMSNorm classes of transformers whose math is GemmaRMSNorm's: fp32 throughout and a weight stored as w - 1.
GEMMA_RMSNORM_CLASSES = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")


def replace_rmsnorm(model, expected=None):
    """Swap every *RMSNorm submodule of `model` (LlamaRMSNorm in LLaMA) for a TritonRMSNorm sharing its weight: with
    Gemma's options for the classes in GEMMA_RMSNORM_CLASSES, with LlamaRMSNorm's math for any other.

    Modules are collected first and replaced afterwards: changing a module's children while iterating over
    named_modules() would skip or revisit some; and every replacement is built before any is installed, so a module
    that cannot be wrapped leaves the model untouched. Returns how many were replaced (65 for Llama-3.1-8B: two per
    decoder layer plus the final norm). With `expected`, a different count raises ValueError before anything is
    replaced: a swap that silently misses modules (another architecture, a renamed class) is an error."""
    targets = [
        (name, module) for name, module in model.named_modules()
        if type(module).__name__.endswith("RMSNorm") and not isinstance(module, TritonRMSNorm)
    ]
    if expected is not None and len(targets) != expected:
        raise ValueError(f"replace_rmsnorm: found {len(targets)} RMSNorm modules to replace, expected {expected}")
    replacements = [(name, TritonRMSNorm.from_gemma_rmsnorm(module) if type(module).__name__ in GEMMA_RMSNORM_CLASSES
                     else TritonRMSNorm.from_llama_rmsnorm(module)) for name, module in targets]
    for name, new in replacements:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, new)
    return len(replacements)


# The RMSNorm class of each supported model family (transformers' config.model_type) and how many a decoder layer
# holds: one before attention and one before the MLP; Gemma 2 and 3 add one after each; Qwen3 and Gemma 3 normalize
# each head of q and of k before the rotation (q_norm, k_norm: two more, over head_dim instead of the hidden size).
RMSNORM_FAMILIES = {"llama": ("LlamaRMSNorm", 2), "mistral": ("MistralRMSNorm", 2), "qwen2": ("Qwen2RMSNorm", 2),
                    "qwen3": ("Qwen3RMSNorm", 4), "gemma2": ("Gemma2RMSNorm", 4),
                    "gemma3_text": ("Gemma3RMSNorm", 6), "phi3": ("Phi3RMSNorm", 2)}


def apply_rmsnorm(model):
    """The patch entry point: swaps every RMSNorm of a transformers model of a family in RMSNORM_FAMILIES for a
    TritonRMSNorm with that family's math (Gemma's offset and fp32 casting for Gemma 2 and 3); returns how many.
    A model of another family, or one whose count differs from what its config implies (a renamed class, a new kind
    of layer), raises ValueError before anything is replaced."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in RMSNORM_FAMILIES:
        raise ValueError(f"apply_rmsnorm: {family or type(model).__name__} models are not supported; supported: "
                         f"{', '.join(RMSNORM_FAMILIES)}")
    class_name, per_layer = RMSNORM_FAMILIES[family]
    expected = per_layer * model.config.num_hidden_layers + 1  # + the final norm
    found = sum(type(module).__name__ == class_name for module in model.modules())
    if found != expected:
        raise ValueError(f"apply_rmsnorm: found {found} {class_name} modules in this {family} model, expected "
                         f"{expected}")
    return replace_rmsnorm(model, expected=expected)


# ----------------------------------------------------------------------------------------------------------------------
# 4. Run as a script
# ----------------------------------------------------------------------------------------------------------------------
def main(argv=None):
    """One forward+backward on random inputs against LlamaRMSNorm's math in float64; one line; exit code 0/1."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=37 if INTERPRETER else 4 * 512,
                        help="rows (tokens); default 37 on the CPU interpreter, 2048 (4x512) on a GPU")
    parser.add_argument("--hidden", type=int, default=1000 if INTERPRETER else 4096,
                        help="hidden size H; default 1000 on the CPU interpreter, 4096 (LLaMA-3.1-8B) on a GPU")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16",
                        help="dtype of x and weight (default bf16)")
    parser.add_argument("--eps", type=float, default=1e-5, help="epsilon (default 1e-5, LLaMA-3.1's)")
    args = parser.parse_args(argv)
    if not (args.rows >= 1 and 1 <= args.hidden <= MAX_HIDDEN_SIZE and 0 <= args.eps < float("inf")):
        parser.error(f"need --rows >= 1, 1 <= --hidden <= {MAX_HIDDEN_SIZE} and a finite --eps >= 0")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]

    x = torch.randn(args.rows, args.hidden, device=KERNEL_DEVICE).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(args.hidden, device=KERNEL_DEVICE)).to(dtype)  # random: ones hide bugs
    dy = torch.randn(args.rows, args.hidden, device=KERNEL_DEVICE).to(dtype)

    def run(norm, cast):
        xc, wc = cast(x).requires_grad_(), cast(weight).requires_grad_()
        y = norm(xc, wc)
        y.backward(cast(dy))
        return y.detach(), xc.grad, wc.grad

    def llama_math(x_, w_):  # transformers' LlamaRMSNorm.forward, written out
        hidden = x_.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + args.eps)
        return w_ * hidden.to(x_.dtype)

    reference = run(lambda x_, w_: w_ * (x_ * torch.rsqrt(x_.pow(2).mean(-1, keepdim=True) + args.eps)),
                    lambda t: t.detach().double())
    ours = run(lambda x_, w_: rms_norm(x_, w_, args.eps), lambda t: t.detach().clone())
    torchs = run(llama_math, lambda t: t.detach().clone())

    def rel_error(a, b):
        return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()

    # The tests' rule: no worse than PyTorch in the same dtype times 1.5, plus a small floor, plus the dtype's eps for
    # tensors of fewer than 1000 numbers, whose errors are noisy statistics (rmsnorm_test.py says why).
    floor = {torch.float32: 1e-6, torch.bfloat16: 1e-4, torch.float16: 1e-5}[dtype]
    ok, parts = True, []
    for name, a, b, ref in zip(("y", "dx", "dw"), ours, torchs, reference):
        ours_err, torch_err = rel_error(a, ref), rel_error(b, ref)
        small = torch.finfo(a.dtype).eps if a.numel() < 1000 else 0.0
        ok &= ours_err <= 1.5 * torch_err + floor + small
        parts.append(f"{name} {ours_err:.2e} (PyTorch {torch_err:.2e})")
    where = "CPU interpreter" if INTERPRETER else torch.cuda.get_device_name()
    print(f"rms_norm {args.rows}x{args.hidden} {args.dtype} on {where}, relative error vs float64: "
          f"{', '.join(parts)}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
