"""Fused RMSNorm in Triton: a drop-in replacement for transformers' LlamaRMSNorm.

What it computes
----------------
For every row x of length H (the hidden size), exactly as LlamaRMSNorm does it:

    x32    = x.to(float32)                                # upcast
    rstd   = 1 / sqrt(mean(x32 ** 2) + eps)               # one number per row
    normed = (x32 * rstd).to(x.dtype)                     # cast BACK to the input dtype ...
    y      = weight * normed                              # ... and only then multiply by the weight

The cast order matters: in bf16 the weight multiplies the *rounded* normalized values, so a kernel that multiplies
in fp32 and rounds once gives (slightly) different numbers from the model it replaces. The output dtype is what
PyTorch's type promotion gives for `weight * normed` (bf16 weight and bf16 input -> bf16; fp32 weight -> fp32).

Backward, with g = dy * weight (the gradient reaching `normed`) and n = x32 * rstd:

    dx = rstd * (g - n * mean(g * n))                     # per row
    dw = sum over rows of dy * normed                     # a reduction over ALL rows

Why fuse: bytes moved
---------------------
Unfused, PyTorch runs pow, mean, add, rsqrt, mul, to, mul as separate kernels: each reads and/or writes a full
[rows, H] tensor, about five round trips through memory per row in the forward pass alone, and autograd saves the
intermediates for the backward. RMSNorm does ~4 FLOPs per byte, so its time is set by memory traffic, not by
arithmetic. The fused kernels move the minimum:

    forward : read x, write y                    -> 2 * rows * H * bytes_per_element
    backward: read x and dy, write dx            -> 3 * rows * H * bytes_per_element
    (weight, the per-row rstd and the small dw partial sums are a rounding error next to that)

The weight gradient: per-program partial sums
---------------------------------------------
dw sums over every row. Writing dy * normed to an fp32 [rows, H] buffer and summing it with torch (what the original
playbook does) costs an extra 8 bytes per element. Instead the backward kernel runs a fixed number of programs
("persistent" programs, one per streaming multiprocessor); each walks over its share of the rows and keeps its own
running fp32 sum in registers, writing ONE row of partial sums at the end. torch then adds those few rows. The
result is deterministic: the same rows always go to the same program in the same order.

Limits
------
The whole row lives in registers, so the hidden size is capped at MAX_HIDDEN_SIZE (65536; LLaMA-3.1-8B uses 4096,
70B 8192). Any number of leading dimensions, hidden sizes that are not powers of two, fp32 / bf16 / fp16, strided
(non-contiguous) inputs and upstream gradients, and empty inputs are supported. Offsets are computed in int64, so
rows * H may exceed 2**31.

Without a GPU the same kernels run on Triton's CPU interpreter (slow; for learning and CI at toy sizes).
"""
import os
import sys

import torch
from torch import nn

# The interpreter flag is read when a kernel is decorated with @triton.jit, so it must be set before that happens.
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
    print("No CUDA device: Triton kernels run on the CPU interpreter (toy sizes; times are not meaningful).",
          file=sys.stderr)

import triton
import triton.language as tl

MAX_HIDDEN_SIZE = 65536
ON_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------------
@triton.jit
def _rmsnorm_forward_kernel(
    x_ptr, weight_ptr, y_ptr, rstd_ptr,
    x_row_stride, y_row_stride,
    n_rows, n_cols, eps,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    # Each program normalizes BLOCK_ROWS whole rows. BLOCK_COLS is the hidden size rounded up to a power of two
    # (Triton block shapes must be powers of two); the mask switches off the padding columns.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    # int64 before multiplying by the stride: rows * H passes 2**31 at 524288 tokens of a 4096-wide model.
    rows = rows.to(tl.int64)

    # Masked-off elements load as 0, so they add nothing to the sum of squares.
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # Divide by the true hidden size, not BLOCK_COLS.
    mean_square = tl.sum(x * x, axis=1) / n_cols
    rstd = tl.rsqrt(mean_square + eps)

    # LlamaRMSNorm's cast order: normalize in fp32, round to the input dtype, THEN multiply by the weight.
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0)
    y = weight.to(tl.float32)[None, :] * normed.to(tl.float32)
    tl.store(y_ptr + rows[:, None] * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    # One fp32 per row saved for the backward pass, so it need not recompute the sum of squares.
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _rmsnorm_backward_kernel(
    dy_ptr, x_ptr, weight_ptr, rstd_ptr, dx_ptr, dw_partial_ptr,
    dy_row_stride, x_row_stride, dx_row_stride,
    n_rows, n_cols,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    # A fixed number of programs ("persistent"): program p handles row blocks p, p + P, p + 2P, ... and keeps a running
    # fp32 sum of its rows' weight gradient in registers.
    program = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)

    n_row_blocks = tl.cdiv(n_rows, BLOCK_ROWS)
    # num_stages lets the compiler start loading the next row block while this one is being computed.
    for row_block in tl.range(program, n_row_blocks, n_programs, num_stages=NUM_STAGES):
        rows = row_block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows = rows.to(tl.int64)

        # Each tensor is read with ITS OWN row stride: the upstream gradient need not be laid out like x.
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)

        normed = x * rstd[:, None]
        # The forward pass multiplied the weight by the ROUNDED normalized values; its gradient sees those too.
        dw_acc += dy * normed.to(x_ptr.dtype.element_ty).to(tl.float32)

        # dx = rstd * (g - n * mean(g * n)): the second term is the gradient flowing through rstd's dependence on x.
        dnormed = dy * weight[None, :]
        mean_dnormed_normed = tl.sum(dnormed * normed, axis=1) / n_cols
        dx = (dnormed - normed * mean_dnormed_normed[:, None]) * rstd[:, None]
        tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)

    # One row of fp32 partial sums per program; the launcher adds the rows.
    dw_partial = tl.sum(dw_acc, axis=0)
    tl.store(dw_partial_ptr + program.to(tl.int64) * n_cols + cols, dw_partial, mask=col_mask)


# ---------------------------------------------------------------------------------------------------------------------
# Launchers: validate, flatten to [rows, H], pick block sizes, allocate, launch
# ---------------------------------------------------------------------------------------------------------------------
def _kernel_device_check(name, tensor):
    """The kernels run where Triton runs: on the GPU when there is one, on the CPU interpreter otherwise."""
    expected = "cpu" if ON_INTERPRETER else "cuda"
    if tensor.device.type != expected:
        raise ValueError(f"rms_norm: {name} is on {tensor.device}, but the Triton kernels run on {expected} here; "
                         f"move the tensors to {expected}")


def _validate(x, weight):
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError("rms_norm: x and weight must be torch.Tensors")
    if not x.is_floating_point() or not weight.is_floating_point():
        raise TypeError(f"rms_norm: x and weight must be floating point, got x {x.dtype} and weight {weight.dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"rms_norm: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("rms_norm: x must have at least one dimension (the hidden size)")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight of shape {tuple(weight.shape)} does not match the last dimension of x "
                         f"({x.shape[-1]}); expected a weight of shape ({x.shape[-1]},)")
    if x.shape[-1] > MAX_HIDDEN_SIZE:
        raise ValueError(f"rms_norm: hidden size {x.shape[-1]} is above the maximum of {MAX_HIDDEN_SIZE} "
                         f"(a whole row must fit in one program's registers)")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight is on {weight.device}")
    _kernel_device_check("x", x)


def _as_rows(t):
    """View t as [rows, H] with unit stride along H. Copies only when no such view exists."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _forward_config(n_cols):
    """(BLOCK_ROWS, BLOCK_COLS, num_warps) for the forward kernel."""
    block_cols = triton.next_power_of_2(n_cols)
    if ON_INTERPRETER:
        # The interpreter pays ~1 ms per program: give each program many rows.
        return max(1, 16384 // block_cols), block_cols, 1
    # ~16K elements per program, 16 per thread. Measured on an H200 (H=4096 bf16, 65536 rows): 4 rows x 16 warps
    # reached 98% of copy bandwidth, 1 row x 8 warps 96%, 1 row x 16 warps 90%.
    block_rows = max(1, 16384 // block_cols)
    num_warps = min(32, max(4, block_rows * block_cols // 1024))
    return block_rows, block_cols, num_warps


def _backward_config(n_cols):
    """(BLOCK_ROWS, BLOCK_COLS, num_warps, num_stages, programs_per_sm) for the backward kernel."""
    block_cols = triton.next_power_of_2(n_cols)
    if ON_INTERPRETER:
        return max(1, 16384 // block_cols), block_cols, 1, 1, None
    # ~8K elements per loop step, 32 per thread, 3 pipeline stages, one persistent program per multiprocessor.
    # Measured on an H200 (H=4096 bf16, 65536 rows, 72 configurations): this one reached 96% of copy bandwidth;
    # without software pipelining (1 stage) the same shape reached 69%, with 2 stages 70%.
    block_rows = max(1, 8192 // block_cols)
    num_warps = min(32, max(4, block_rows * block_cols // 1024))
    return block_rows, block_cols, num_warps, 3, 1


def rmsnorm_forward(x, weight, eps, block_rows=None, num_warps=None):
    """Launch the forward kernel. Returns (y, rstd) with y shaped like x and rstd one fp32 per row.

    block_rows / num_warps override the heuristic (for tuning sweeps)."""
    _validate(x, weight)
    x_rows = _as_rows(x)
    n_rows, n_cols = x_rows.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows > 0:
        auto_rows, block_cols, auto_warps = _forward_config(n_cols)
        block_rows = block_rows or auto_rows
        _rmsnorm_forward_kernel[(triton.cdiv(n_rows, block_rows),)](
            x_rows, weight, y, rstd,
            x_rows.stride(0), y.stride(0),
            n_rows, n_cols, eps,
            BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, num_warps=num_warps or auto_warps,
        )
    return y.view(x.shape), rstd


def rmsnorm_backward(dy, x, weight, rstd, block_rows=None, num_warps=None, num_stages=None, programs_per_sm=None):
    """Launch the backward kernel. Returns (dx, dw). The keyword overrides are for tuning sweeps."""
    if dy.shape != x.shape:
        raise ValueError(f"rms_norm backward: gradient of shape {tuple(dy.shape)} for an input of shape {tuple(x.shape)}")
    x_rows = _as_rows(x)
    dy_rows = _as_rows(dy)
    n_rows, n_cols = x_rows.shape
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    auto_rows, block_cols, auto_warps, auto_stages, auto_programs_per_sm = _backward_config(n_cols)
    block_rows = block_rows or auto_rows
    n_row_blocks = triton.cdiv(n_rows, block_rows)
    if ON_INTERPRETER:
        n_programs = min(4, n_row_blocks)
    else:
        # Enough programs to fill every multiprocessor a few times over, no more: each extra program costs one
        # more row of partial sums to write and add.
        sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count
        n_programs = min(n_row_blocks, (programs_per_sm or auto_programs_per_sm) * sm_count)
    dw_partial = torch.empty((n_programs, n_cols), dtype=torch.float32, device=x.device)
    _rmsnorm_backward_kernel[(n_programs,)](
        dy_rows, x_rows, weight, rstd, dx, dw_partial,
        dy_rows.stride(0), x_rows.stride(0), dx.stride(0),
        n_rows, n_cols,
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, NUM_STAGES=num_stages or auto_stages,
        num_warps=num_warps or auto_warps,
    )
    # A [n_programs, H] fp32 sum: a few MB at most, and deterministic.
    dw = dw_partial.sum(dim=0).to(weight.dtype)
    return dx.view(x.shape), dw


# ---------------------------------------------------------------------------------------------------------------------
# Autograd Function, functional API and module
# ---------------------------------------------------------------------------------------------------------------------
class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rmsnorm_forward(x, weight, eps)
        # x (not y) and the per-row rstd are all the backward needs: nothing of size [rows, H] in fp32 is kept.
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rmsnorm_backward(dy, x, weight, rstd)
        return dx, dw, None


def rms_norm(x, weight, eps=1e-6):
    """RMSNorm of x over its last dimension with LlamaRMSNorm's math and cast order; differentiable."""
    return RMSNormFunction.apply(x, weight, eps)


class TritonRMSNorm(nn.Module):
    """Drop-in replacement for transformers' LlamaRMSNorm, backed by the fused Triton kernels."""

    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    @classmethod
    def from_llama_rmsnorm(cls, module):
        """Wrap an existing LlamaRMSNorm, reusing the SAME weight Parameter object and its epsilon.

        Reusing the Parameter (not a copy) keeps optimizer state, state_dict keys and tied references pointing at
        the one tensor the rest of the program already knows."""
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or eps is None:
            raise TypeError(f"from_llama_rmsnorm: {type(module).__name__} has no 1-D weight Parameter and epsilon; "
                            f"expected a LlamaRMSNorm-like module")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight = weight
        new.variance_epsilon = eps
        return new

    def forward(self, hidden_states):
        if hidden_states.shape[-1] != self.weight.shape[0]:
            raise ValueError(f"TritonRMSNorm was built for hidden size {self.weight.shape[0]} but got an input whose "
                             f"last dimension is {hidden_states.shape[-1]}")
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def replace_rmsnorm(model, expected=None):
    """Swap every *RMSNorm submodule of `model` (LlamaRMSNorm in LLaMA) for a TritonRMSNorm sharing its weight.

    Modules are collected first and replaced afterwards: changing a module's children while iterating over
    named_modules() would skip or revisit some. Returns how many were replaced (65 for Llama-3.1-8B: two per
    decoder layer plus the final norm). With `expected`, a different count raises ValueError before anything is
    replaced: a swap that silently misses modules (another architecture, a renamed class) is an error."""
    targets = [
        (name, module) for name, module in model.named_modules()
        if type(module).__name__.endswith("RMSNorm") and not isinstance(module, TritonRMSNorm)
    ]
    if expected is not None and len(targets) != expected:
        raise ValueError(f"replace_rmsnorm: found {len(targets)} RMSNorm modules to replace, expected {expected}")
    for name, module in targets:
        parent_name, _, child_name = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child_name, TritonRMSNorm.from_llama_rmsnorm(module))
    return len(targets)
