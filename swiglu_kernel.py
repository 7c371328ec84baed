"""Fused SwiGLU for the LLaMA MLP: silu(gate) * up in one pass, and its backward in one pass.

What it computes
----------------
LLaMA's MLP is down_proj(silu(gate_proj(x)) * up_proj(x)), with silu(g) = g * sigmoid(g). The three projections are
matmuls (they stay in cuBLAS); between them sits elementwise work on [tokens, intermediate] tensors (intermediate =
14336 in LLaMA-3.1-8B). This file fuses it, with transformers' cast order ("round" = cast to gate's dtype):
    forward:   out   = round(round(silu(gate)) * up)
    backward:  dup   = dy * round(silu(gate))
               dgate = dy * up * silu'(gate),   silu'(g) = s * (1 + g * (1 - s)),  s = sigmoid(g)
The backward recomputes silu from gate instead of saving it; TritonLlamaMLP swaps it into a transformers model.

Options (compile-time constants of the kernels: the default SwiGLU compiles to the same machine code as without them)
--------------------------------------------------------------------------------------------------------------------
- GeGLU (`geglu`, TritonGemmaMLP for Gemma's MLP): the same kernels with the tanh approximation of GELU as the gate's
  activation (transformers' "gelu_pytorch_tanh"): gelu(g) = 0.5 * g * (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3).
  Since 1 + tanh(z) = 2 sigmoid(2z), both activations are g * sigmoid(s): s = g for silu, s = 2z for GELU, and
      act'(g) = sigmoid(s) * (1 + g * (1 - sigmoid(s)) * s'(g)),  s' = 1 (silu),  s' = 2 sqrt(2/pi) (1 + 0.134145 g^2)
- gate_multiplier (Falcon-H1, Liger's name): out = act(round(gate * gate_multiplier)) * up, and dgate gains the
  factor. Falcon-H1 also multiplies the MLP's output, down_proj(out), by a down_multiplier: one scalar on the module's
  output, done in plain torch by TritonLlamaMLP (a Linear with a bias would not commute with it, so it stays there).

Bytes it must move
------------------
With N = tokens * intermediate elements: the forward reads gate and up and writes out (3 N), the backward reads gate,
up and dy and writes dgate and dup (5 N). Eager PyTorch runs silu and mul (forward) and mul, mul and silu_backward
(backward) as separate kernels, each reading and writing whole tensors: 5 N forward and 9 N backward, 14 N against our
8 N. A few FLOPs per byte: time follows bytes, so fusing is the whole win.

Triton concepts introduced here (new relative to rmsnorm_kernel.py, which introduces the basics)
------------------------------------------------------------------------------------------------
- A 2-D grid: tl.program_id(0) numbers blocks of rows, tl.program_id(1) blocks of columns; a program's tile is
  their product, and [:, None] / [None, :] broadcast the two index blocks into a 2-D block of pointers.
- Tensors read through their own row strides: gate and up may be the two halves of one fused gate_up projection
  (`gate_up.chunk(2, dim=-1)`, row stride 2 * intermediate), read in place without a copy.
- A backward that writes its outputs over its inputs (in place): each program loads its whole tile before it stores
  to the same addresses, and no other program touches that tile.
- Elementwise math in fp32 between 16-bit loads and stores, with an extra rounding where the model has one.
- String and float tl.constexpr arguments (ACTIVATION, GATE_MULTIPLIER): an `if` on them is decided while compiling,
  and each value used compiles its own kernel once.

Limits
------
gate and up: same shape, dtype (fp32, bf16, fp16) and device, at least one dimension, any leading dimensions; rows
may be strided, a last dimension that is not contiguous is copied. Offsets are int64 (tensors may exceed 2**31
elements). Without a GPU the same kernels run on Triton's CPU interpreter (slow: toy sizes).

torch.compile traces the kernels as custom operators (section 3, as in rmsnorm_kernel.py), in-place backward included.
"""
import contextlib
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


__all__ = ["ACTIVATIONS", "swiglu_forward", "swiglu_backward", "geglu_forward", "geglu_backward", "SwiGLUFunction",
           "swiglu", "geglu", "TritonLlamaMLP", "TritonGemmaMLP", "replace_llama_mlp", "replace_gemma_mlp"]


@triton.jit
def _sigmoid_argument(g, ACTIVATION: tl.constexpr):
    """s(g) in act(g) = g * sigmoid(s(g)): g itself for silu; 2 z = 2 sqrt(2/pi) (g + 0.044715 g^3) for the tanh GELU.
    Written with sigmoid, the GELU needs no tanh, and 1 + tanh(z) loses no digits to cancellation where tanh is
    near -1 (very negative g)."""
    if ACTIVATION == "gelu_tanh":
        return 1.5957691216057308 * (g + 0.044715 * g * g * g)  # 2 * sqrt(2 / pi) = 1.5957691216...
    else:
        return g


# ----------------------------------------------------------------------------------------------------------------------
# 1. Kernels
# ----------------------------------------------------------------------------------------------------------------------
# Both kernels see their tensors as 2-D [n_rows, n_cols] (leading dims flattened into rows, n_cols = the intermediate
# size). Nothing is reduced along a row, so a row need not sit in one program: each program takes one tile of
# BLOCK_ROWS x BLOCK_COLS elements, and the grid is (row blocks, column blocks). On the GPU a tile is typically 1 row x
# 8192 columns (enough bytes in flight per program to keep HBM busy); on the CPU interpreter a tile covers many rows.
#
# The cast order follows transformers (checked in 5.17, models/llama/modeling_llama.py and activations.py):
# `LlamaMLP.forward` is `self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))` with
# `act_fn = ACT2FN[config.hidden_act]`; "silu" maps to `SiLUActivation` (its forward is `nn.functional.silu`; the
# `@use_kernel_forward_from_hub("SiLU")` decorator only swaps in a Hub kernel when a model is explicitly kernelized) and
# "swish" to `nn.SiLU`. So in a bf16 model silu runs on the bf16 gate tensor: PyTorch computes it in fp32 internally
# and ROUNDS the result to bf16, and the `*` with up rounds once more. The forward kernel does exactly that.
@triton.jit
def _swiglu_forward_kernel(
    gate_ptr,         # [n_rows, n_cols] gate_proj(x), unit stride along a row; fp32, bf16 or fp16
    up_ptr,           # [n_rows, n_cols] up_proj(x), same dtype
    out_ptr,          # [n_rows, n_cols] output, same dtype
    gate_row_stride,  # elements from one row to the next, per tensor (2 * n_cols for a half of a fused gate_up)
    up_row_stride,
    out_row_stride,
    n_rows,           # tokens
    n_cols,           # the intermediate size
    BLOCK_ROWS: tl.constexpr,  # rows per tile (a power of two)
    BLOCK_COLS: tl.constexpr,  # columns per tile (a power of two)
    ACTIVATION: tl.constexpr,       # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    GATE_MULTIPLIER: tl.constexpr,  # gate scaled before the activation (Falcon-H1); 1.0: no scaling
):
    # Axis 0 of the grid picks the block of rows, axis 1 the block of columns.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)  # the last tiles hang over the tensor's edges
    # int64 before multiplying by the stride: rows * row_stride passes 2^31 once a tensor holds more than 2^31
    # elements (e.g. 150k tokens x 14336), and an int32 product would silently wrap to a wrong address.
    rows64 = rows.to(tl.int64)[:, None]

    # Load in the storage dtype and compute in fp32 (bf16 has only 8 bits of mantissa).
    g = tl.load(gate_ptr + rows64 * gate_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows64 * up_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATE_MULTIPLIER != 1.0:
        # Falcon-H1 scales gate_proj's output, a tensor of the model dtype, before the activation: round it as that
        # tensor is rounded.
        g = _round_to(g * GATE_MULTIPLIER, out_ptr.dtype.element_ty).to(tl.float32)

    # silu(g) = g / (1 + exp(-g)), the same formula PyTorch uses; the GELU has the same form (_sigmoid_argument). For
    # very negative g, exp(-s) = inf and the result is -0.0, which is the correct limit.
    act = g / (1.0 + tl.exp(-_sigmoid_argument(g, ACTIVATION)))
    # Round silu to the tensor dtype first, as F.silu does (it returns a bf16 tensor), then multiply and round again.
    # For fp32 inputs both casts are no-ops.
    act = _round_to(act, out_ptr.dtype.element_ty).to(tl.float32)
    out = act * u
    tl.store(out_ptr + rows64 * out_row_stride + cols[None, :], _round_to(out, out_ptr.dtype.element_ty), mask=mask)


# In the backward PyTorch's autograd also rounds dy * up to bf16 before applying silu'(gate); that rounding is an
# artifact of running two separate ops, not part of the function, so this kernel keeps dy * up * silu'(gate) in fp32
# and rounds once (slightly more accurate). dup = dy * round(silu(gate)) uses the ROUNDED silu, because that is the
# value the forward really multiplied up with.
@triton.jit
def _swiglu_backward_kernel(
    gate_ptr,          # [n_rows, n_cols] the forward's inputs
    up_ptr,
    dy_ptr,            # [n_rows, n_cols] upstream gradient
    dgate_ptr,         # [n_rows, n_cols] outputs, in gate's dtype; in place they are gate_ptr and up_ptr themselves:
    dup_ptr,           # safe, because every element of this tile is loaded below before any store to it
    gate_row_stride,   # each tensor has its own row stride: an upstream gradient need not be laid out like the inputs
    up_row_stride,
    dy_row_stride,
    dgate_row_stride,
    dup_row_stride,
    n_rows,            # tokens
    n_cols,            # the intermediate size
    BLOCK_ROWS: tl.constexpr,  # rows per tile
    BLOCK_COLS: tl.constexpr,  # columns per tile
    ACTIVATION: tl.constexpr,       # as in the forward
    GATE_MULTIPLIER: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    rows64 = rows.to(tl.int64)[:, None]  # int64 offsets, as in the forward

    g = tl.load(gate_ptr + rows64 * gate_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows64 * up_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATE_MULTIPLIER != 1.0:
        g = _round_to(g * GATE_MULTIPLIER, dgate_ptr.dtype.element_ty).to(tl.float32)  # the forward's scaled gate

    # Recompute instead of saving: sigmoid and silu cost a few instructions, a saved tensor costs HBM traffic.
    s = _sigmoid_argument(g, ACTIVATION)
    one_plus_exp = 1.0 + tl.exp(-s)
    sig = 1.0 / one_plus_exp
    # d(out)/d(up) is the silu value the forward actually used: the forward's expression, bit for bit, rounded to
    # the tensor dtype (g * sig could differ from g / (1 + exp(-g)) in the last fp32 bit and round differently).
    act = _round_to(g / one_plus_exp, dup_ptr.dtype.element_ty).to(tl.float32)
    dup = dy * act
    # d(out)/d(gate) = up * silu'(g), silu'(g) = s + g * s * (1 - s) = s * (1 + g * (1 - s)); kept in fp32 until
    # the single final rounding.
    if ACTIVATION == "gelu_tanh":
        # The same with the GELU's slope s'(g). 1 - sigmoid(s) is computed as sigmoid(-s): 1 - sig cancels where sig
        # is near 1, and g * s' (10 to 35 for g between 3 and 5) would magnify the lost digits (one exp more costs
        # nothing in a kernel that waits on memory). Beyond |g| = 20 the sigmoid is exactly 0 or 1 in fp32 and the
        # term in g vanishes: clamping g there changes nothing, except that g * s' cannot overflow to inf (0 * inf
        # would be NaN).
        g_clamped = tl.minimum(tl.maximum(g, -20.0), 20.0)
        slope = 1.5957691216057308 * (1.0 + 3.0 * 0.044715 * g_clamped * g_clamped)
        dgate = dy * u * sig * (1.0 + g_clamped * (1.0 / (1.0 + tl.exp(s))) * slope)
    else:
        dgate = dy * u * sig * (1.0 + g * (1.0 - sig))
    if GATE_MULTIPLIER != 1.0:
        dgate = dgate * GATE_MULTIPLIER  # the chain rule through gate * multiplier

    tl.store(dgate_ptr + rows64 * dgate_row_stride + cols[None, :], _round_to(dgate, dgate_ptr.dtype.element_ty),
             mask=mask)
    tl.store(dup_ptr + rows64 * dup_row_stride + cols[None, :], _round_to(dup, dup_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------------------
# 2. Launchers
# ----------------------------------------------------------------------------------------------------------------------
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_pair(gate, up, who):
    """Raise a clear error for inputs the kernels cannot take (instead of reading garbage or crashing)."""
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{who}: {name} has dtype {t.dtype}; supported: float32, bfloat16, float16")
        if t.dim() == 0:
            raise ValueError(f"{who}: {name} must have at least one dimension [..., intermediate], got a scalar")
    if gate.shape != up.shape:
        raise ValueError(f"{who}: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise TypeError(f"{who}: gate and up must have the same dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"{who}: gate and up must be on the same device, got {gate.device} and {up.device}")
    _check_device(who, "gate", gate)


def _on_tensor_device(t):
    """Triton launches on the CURRENT CUDA device: switch to t's GPU only when it is another one, because entering
    torch.cuda.device() on every call costs host time in a host-bound step (measured on an H200, see
    results/NOTES.md)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _as_rows(t):
    """View t [..., n_cols] as [n_rows, n_cols] with unit column stride; copies only when no such view exists."""
    t2d = t.reshape(-1, t.shape[-1])  # a view whenever the leading dims can be merged (e.g. chunk views), else a copy
    if t2d.stride(-1) != 1:           # e.g. a transposed tensor: the kernels assume neighbouring columns in memory
        t2d = t2d.contiguous()
    return t2d


def _writable_in_place(gate, up):
    """Whether the backward may write dgate over gate and dup over up: each must be a view of rows with unit column
    stride (the kernel writes through that view), and writing one must not touch the other: separate storages, or two
    column ranges of the same rows, as the halves of a fused gate_up projection are."""
    try:
        gate2d, up2d = gate.view(-1, gate.shape[-1]), up.view(-1, up.shape[-1])
    except RuntimeError:  # no such view (e.g. a transposed tensor): the launcher reads a copy
        return False
    if gate2d.stride(-1) != 1 or up2d.stride(-1) != 1:
        return False
    if gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr():
        return True
    n_cols, row_stride = gate2d.shape[1], gate2d.stride(0)
    shift = abs(up2d.storage_offset() - gate2d.storage_offset())
    return up2d.stride(0) == row_stride and n_cols <= shift <= row_stride - n_cols


def _launch_config(n_rows, n_cols, block_size, block_rows):
    """(grid, BLOCK_ROWS, BLOCK_COLS, num_warps). block_size (columns per tile) and block_rows override the tile, for
    tests: they make a small tensor span many tiles on both axes. Tile dimensions are powers of two (tl.arange)."""
    for name, value in (("block_size", block_size), ("block_rows", block_rows)):
        if value is not None and (value < 1 or value & (value - 1)):
            raise ValueError(f"{name} must be a positive power of two, got {value}")
    # GPU: 8192 elements and 8 warps per program, the fastest tile shape measured on an H200 (see results/NOTES.md).
    # CPU interpreter: bigger tiles, because it pays ~1 ms per program.
    elements_per_tile = 16384 if INTERPRETER else 8192
    block_cols = block_size or min(triton.next_power_of_2(n_cols), elements_per_tile)
    block_rows = block_rows or max(1, min(elements_per_tile // block_cols, triton.next_power_of_2(n_rows)))
    num_warps = 8 if block_rows * block_cols >= 2048 else 4
    grid = (triton.cdiv(n_rows, block_rows), triton.cdiv(n_cols, block_cols))  # rows on axis 0 (limit 2^31 - 1)
    return grid, block_rows, block_cols, num_warps


ACTIVATIONS = ("silu", "gelu_tanh")  # the gate's activation: SwiGLU's and GeGLU's
_NAMES = {"silu": "swiglu", "gelu_tanh": "geglu"}


def _check_multiplier(who, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{who}: {name} must be a float, got {type(value).__name__}")
    if not -float("inf") < value < float("inf"):  # also False for NaN
        raise ValueError(f"{who}: {name} must be a finite number, got {value}")


def _check_options(who, activation, gate_multiplier):
    if activation not in ACTIVATIONS:
        raise ValueError(f"{who}: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {activation!r}")
    _check_multiplier(who, "gate_multiplier", gate_multiplier)


def _glu_forward(who, gate, up, activation, gate_multiplier, block_size, block_rows):
    """The forward launcher behind swiglu_forward and geglu_forward."""
    _check_pair(gate, up, who)
    _check_options(who, activation, gate_multiplier)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)  # contiguous, whatever gate's layout
    if gate.numel() == 0:
        return out
    gate2d, up2d, out2d = _as_rows(gate), _as_rows(up), out.view(-1, out.shape[-1])
    n_rows, n_cols = gate2d.shape
    grid, block_r, block_c, warps = _launch_config(n_rows, n_cols, block_size, block_rows)
    with _on_tensor_device(gate):
        _swiglu_forward_kernel[grid](
            gate2d, up2d, out2d,
            gate2d.stride(0), up2d.stride(0), out2d.stride(0),
            n_rows, n_cols,
            BLOCK_ROWS=block_r, BLOCK_COLS=block_c,
            # A float multiplier, so that 1 and 1.0 are the same compiled kernel.
            ACTIVATION=activation, GATE_MULTIPLIER=float(gate_multiplier),
            num_warps=warps,
        )
    return out


def _glu_backward(who, gate, up, dy, activation, gate_multiplier, inplace, block_size, block_rows):
    """The backward launcher behind swiglu_backward and geglu_backward."""
    _check_pair(gate, up, who)
    _check_options(who, activation, gate_multiplier)
    if not isinstance(dy, torch.Tensor) or dy.shape != gate.shape:
        got = tuple(dy.shape) if isinstance(dy, torch.Tensor) else type(dy).__name__
        raise ValueError(f"{who}: dy must be a tensor of shape {tuple(gate.shape)}, got {got}")
    if dy.dtype != gate.dtype or dy.device != gate.device:
        raise TypeError(f"{who}: dy must be {gate.dtype} on {gate.device}, got {dy.dtype} on {dy.device}")
    # The checks for in place run only when it is asked for: the default path is a hot path too.
    if inplace and _writable_in_place(gate, up):
        dgate, dup = gate, up
    else:
        dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        dup = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return dgate, dup
    gate2d, up2d, dy2d = _as_rows(gate), _as_rows(up), _as_rows(dy)
    dgate2d, dup2d = dgate.view(-1, dgate.shape[-1]), dup.view(-1, dup.shape[-1])
    n_rows, n_cols = gate2d.shape
    grid, block_r, block_c, warps = _launch_config(n_rows, n_cols, block_size, block_rows)
    with _on_tensor_device(gate):
        _swiglu_backward_kernel[grid](
            gate2d, up2d, dy2d, dgate2d, dup2d,
            gate2d.stride(0), up2d.stride(0), dy2d.stride(0), dgate2d.stride(0), dup2d.stride(0),
            n_rows, n_cols,
            BLOCK_ROWS=block_r, BLOCK_COLS=block_c, ACTIVATION=activation, GATE_MULTIPLIER=float(gate_multiplier),
            num_warps=warps,
        )
    return dgate, dup


def swiglu_forward(gate, up, *, gate_multiplier=1.0, block_size=None, block_rows=None):
    """out = round(round(silu(gate)) * up), same shape and dtype as gate; with gate_multiplier m, silu's argument is
    round(gate * m). Not differentiable (see `swiglu`). block_size / block_rows: tile overrides for tests."""
    return _glu_forward("swiglu_forward", gate, up, "silu", gate_multiplier, block_size, block_rows)


def swiglu_backward(gate, up, dy, *, gate_multiplier=1.0, inplace=False, block_size=None, block_rows=None):
    """(dgate, dup) for out = silu(gate) * up (gate scaled by gate_multiplier first), in gate's dtype.

    By default in fresh contiguous buffers (the inputs are untouched, so anything else still holding gate or up stays
    valid). inplace=True writes dgate over gate and dup over up when both are contiguous and in separate storages,
    so the backward allocates nothing: for a caller whose gate and up are private intermediates, dead after this
    backward (TritonLlamaMLP's). block_size / block_rows: tile overrides for tests."""
    return _glu_backward("swiglu_backward", gate, up, dy, "silu", gate_multiplier, inplace, block_size, block_rows)


def geglu_forward(gate, up, *, block_size=None, block_rows=None):
    """out = round(round(gelu_tanh(gate)) * up), as swiglu_forward with the tanh GELU for silu."""
    return _glu_forward("geglu_forward", gate, up, "gelu_tanh", 1.0, block_size, block_rows)


def geglu_backward(gate, up, dy, *, inplace=False, block_size=None, block_rows=None):
    """(dgate, dup) for out = gelu_tanh(gate) * up; the options as swiglu_backward's."""
    return _glu_backward("geglu_backward", gate, up, dy, "gelu_tanh", 1.0, inplace, block_size, block_rows)


# ----------------------------------------------------------------------------------------------------------------------
# 3. Autograd Function, custom operators (torch.compile), functional API, module, model patching
# ----------------------------------------------------------------------------------------------------------------------
class SwiGLUFunction(torch.autograd.Function):
    """SwiGLUFunction.apply(gate, up, inplace_backward, gate_multiplier=1.0, activation="silu"); activation
    "gelu_tanh" makes it GeGLU, computed by the same kernels."""

    @staticmethod
    def forward(ctx, gate, up, inplace_backward, gate_multiplier=1.0, activation="silu"):
        out = _glu_forward(_NAMES.get(activation, "swiglu"), gate, up, activation, gate_multiplier, None, None)
        # Eager autograd saves gate (for silu's backward) AND silu(gate) and up (for the product's backward): three
        # [tokens, intermediate] tensors per layer. Saving only gate and up and recomputing silu in the backward costs
        # a few instructions per element and saves one tensor per layer: 8192 tokens x 14336 x 2 bytes = 235 MB per
        # layer, 7.5 GB over LLaMA-3.1-8B's 32 layers.
        ctx.save_for_backward(gate, up)
        ctx.inplace_backward = inplace_backward
        ctx.options = (activation, gate_multiplier)
        ctx.backward_done = False
        return out

    @staticmethod
    def backward(ctx, dy):
        activation, gate_multiplier = ctx.options
        if ctx.inplace_backward and ctx.backward_done:
            raise RuntimeError(f"{_NAMES[activation]}(inplace_backward=True) overwrote its saved gate and up with "
                               f"their gradients in the first backward; recompute the forward instead of using "
                               f"retain_graph=True")
        gate, up = ctx.saved_tensors
        dgate, dup = _glu_backward(f"{_NAMES[activation]}_backward", gate, up, dy, activation, gate_multiplier,
                                   ctx.inplace_backward, None, None)
        ctx.backward_done = True
        if dgate is gate:
            # The saved tensors now hold gradients: bump their version counters, so that anything else that saved
            # them for its own backward fails loudly instead of reading gradients as activations.
            torch.autograd.graph.increment_version(gate)
            torch.autograd.graph.increment_version(up)
        return dgate, dup, None, None, None


# torch.compile cannot look inside a launcher, so the kernels become custom operators, opaque nodes of the graph (see
# rmsnorm_kernel.py, where this is introduced): register_fake gives each one's output shapes without running it,
# register_autograd the backward. The in-place backward is an operator that declares what it overwrites
# (mutates_args=("gate", "up")), so the compiler knows: where anything else still reads gate or up it hands the
# operator copies, and where nothing does, as with a backward's saved activations under inductor, the kernel
# overwrites the activations themselves.
# The options are trailing arguments with defaults, so that a call without them reads as before; GeGLU is the same
# operators with activation="gelu_tanh".
@torch.library.custom_op("playbook::swiglu", mutates_args=())
def _swiglu_op(gate: torch.Tensor, up: torch.Tensor, inplace_backward: bool, gate_multiplier: float = 1.0,
               activation: str = "silu") -> torch.Tensor:
    """The forward as an operator; inplace_backward only picks the backward operator (see _swiglu_setup_context)."""
    return _glu_forward("swiglu", gate, up, activation, gate_multiplier, None, None)


@_swiglu_op.register_fake
def _(gate, up, inplace_backward, gate_multiplier=1.0, activation="silu"):
    _check_pair(gate, up, "swiglu")  # bad input fails while tracing, with the launcher's message
    _check_options("swiglu", activation, gate_multiplier)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


@torch.library.custom_op("playbook::swiglu_backward", mutates_args=())
def _swiglu_backward_op(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, gate_multiplier: float = 1.0,
                        activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """The backward into fresh buffers, as an operator: (dgate, dup)."""
    return _glu_backward("swiglu_backward", gate, up, dy, activation, gate_multiplier, False, None, None)


@_swiglu_backward_op.register_fake
def _(gate, up, dy, gate_multiplier=1.0, activation="silu"):
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))


@torch.library.custom_op("playbook::swiglu_backward_", mutates_args=("gate", "up"))
def _swiglu_backward_inplace_op(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, gate_multiplier: float = 1.0,
                                activation: str = "silu") -> None:
    """dgate written over gate and dup over up, as an operator (the trailing underscore: in place, as in torch)."""
    dgate, dup = _glu_backward("swiglu_backward_", gate, up, dy, activation, gate_multiplier, True, None, None)
    if dgate is not gate:  # the launcher wrote fresh buffers (gate and up overlap, or have no row view): copy back
        gate.copy_(dgate)
        up.copy_(dup)


@_swiglu_backward_inplace_op.register_fake
def _(gate, up, dy, gate_multiplier=1.0, activation="silu"):
    return None


def _swiglu_setup_context(ctx, inputs, output):
    gate, up, inplace_backward, gate_multiplier, activation = inputs
    ctx.save_for_backward(gate, up)  # what SwiGLUFunction saves
    ctx.inplace_backward = inplace_backward
    ctx.options = (gate_multiplier, activation)


def _swiglu_op_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    if ctx.inplace_backward:
        # A second backward through this graph fails on the saved tensors' version counters, which the in-place
        # operator bumps: they now hold gradients.
        torch.ops.playbook.swiglu_backward_(gate, up, dy, *ctx.options)
        return gate, up, None, None, None
    dgate, dup = torch.ops.playbook.swiglu_backward(gate, up, dy, *ctx.options)
    return dgate, dup, None, None, None


_swiglu_op.register_autograd(_swiglu_op_backward, setup_context=_swiglu_setup_context)


def _glu(gate, up, activation, gate_multiplier, inplace_backward):
    """act(gate) * up, differentiable: the autograd.Function eagerly, the custom operator under torch.compile."""
    # Eager calls take the autograd.Function, whose dispatch costs tens of microseconds less host time per call than a
    # custom operator's (see rms_norm in rmsnorm_kernel.py); under torch.compile only the operator can be traced.
    if torch.compiler.is_compiling():
        return torch.ops.playbook.swiglu(gate, up, inplace_backward, gate_multiplier, activation)
    return SwiGLUFunction.apply(gate, up, inplace_backward, gate_multiplier, activation)


def swiglu(gate, up, inplace_backward=False, gate_multiplier=1.0):
    """silu(gate) * up with transformers' LlamaMLP cast order, differentiable, and traced by torch.compile as the
    operator torch.ops.playbook.swiglu. gate, up: [..., intermediate] of the same shape, dtype
    (float32/bfloat16/float16) and device; rows may be strided (e.g. halves of a fused gate_up projection). Returns a
    new contiguous tensor of gate's shape and dtype.

    inplace_backward=True lets the backward write the gradients over gate and up (also over the two halves of one
    fused projection; a transposed gate or up, or two that overlap, get fresh buffers): two
    [tokens, intermediate] buffers less at the start of each MLP's backward. Contract: gate and up are not used after
    the backward (true of the projections' outputs inside an MLP), and the graph is not backpropagated twice. Under
    torch.compile the compiler enforces the first part itself (see the custom operators above).

    gate_multiplier (Falcon-H1): silu(round(gate * gate_multiplier)) * up, the gradient of gate included."""
    return _glu(gate, up, "silu", gate_multiplier, inplace_backward)


def geglu(gate, up, inplace_backward=False):
    """gelu_tanh(gate) * up (GemmaMLP's middle, transformers' "gelu_pytorch_tanh"), with the same cast order,
    layouts, in-place contract and torch.compile operator as `swiglu`."""
    return _glu(gate, up, "gelu_tanh", 1.0, inplace_backward)


class _TritonGatedMLP(torch.nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with the elementwise middle fused; the three Linear layers (cuBLAS
    matmuls) and their parameter names are the same as transformers' MLP's. Falcon-H1's multipliers: the gate is
    scaled inside the kernel, and the output by one torch multiply (it must follow down_proj's bias, as in
    FalconH1MLP). Subclasses fix the activation and the transformers classes they replace."""

    ACTIVATION = None
    ACT_CLASS_NAMES = ()  # class names of the act_fn a wrapped transformers MLP must have
    HIDDEN_ACT = None     # the config.hidden_act value that gives that act_fn

    def __init__(self, hidden_size, intermediate_size, bias=False, device=None, dtype=None, gate_multiplier=1.0,
                 down_multiplier=1.0):
        super().__init__()
        for name, value in (("gate_multiplier", gate_multiplier), ("down_multiplier", down_multiplier)):
            _check_multiplier(type(self).__name__, name, value)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.up_proj = torch.nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = torch.nn.Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier

    @classmethod
    def _wrap(cls, who, expected, mlp):
        """A module of this class around mlp's OWN gate_proj/up_proj/down_proj modules (the same Parameter objects),
        so optimizer state, state_dict keys and tied references stay valid; mlp's gate_multiplier and
        down_multiplier (FalconH1MLP's attributes) are kept where it has them."""
        for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            if not hasattr(mlp, name):
                raise TypeError(f"{who}: {type(mlp).__name__} has no '{name}'; expected a {expected}")
        act_name = type(mlp.act_fn).__name__
        if not (act_name in cls.ACT_CLASS_NAMES or cls.ACTIVATION == "silu" and mlp.act_fn is torch.nn.functional.silu):
            raise ValueError(f"{who}: the fused kernel computes {cls.ACTIVATION}(gate) * up, but this MLP's act_fn is "
                             f"{act_name} (config.hidden_act must be '{cls.HIDDEN_ACT}')")
        gate_proj = mlp.gate_proj
        # Build the shell on the meta device (no memory), then put the original Linear modules in place.
        new = cls(gate_proj.in_features, gate_proj.out_features, bias=gate_proj.bias is not None, device="meta",
                  gate_multiplier=getattr(mlp, "gate_multiplier", 1.0),
                  down_multiplier=getattr(mlp, "down_multiplier", 1.0))
        new.gate_proj, new.up_proj, new.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        new.train(mlp.training)
        return new

    def forward(self, x):
        # gate_proj(x) and up_proj(x) exist only here, so the backward may overwrite them with their gradients: it
        # then allocates nothing, two [tokens, intermediate] tensors fewer at the moment the backward of the first MLP
        # starts, when every layer's activations are still alive (470 MB at 8192 tokens of LLaMA-3.1-8B in bf16).
        out = self.down_proj(_glu(self.gate_proj(x), self.up_proj(x), self.ACTIVATION, self.gate_multiplier,
                                  inplace_backward=True))
        return out if self.down_multiplier == 1.0 else out * self.down_multiplier

    def extra_repr(self):
        if (self.gate_multiplier, self.down_multiplier) == (1.0, 1.0):
            return ""
        return f"gate_multiplier={self.gate_multiplier}, down_multiplier={self.down_multiplier}"


class TritonLlamaMLP(_TritonGatedMLP):
    """down_proj(swiglu(gate_proj(x), up_proj(x))): LlamaMLP (and FalconH1MLP, with its multipliers) with the
    elementwise middle fused."""

    ACTIVATION = "silu"
    ACT_CLASS_NAMES = ("SiLUActivation", "SiLU")  # transformers' ACT2FN["silu"] and ACT2FN["swish"] (= nn.SiLU)
    HIDDEN_ACT = "silu"

    @classmethod
    def from_llama_mlp(cls, mlp):
        """Wrap an existing LlamaMLP (or an MLP of its form: FalconH1MLP, whose multipliers are kept), REUSING its
        gate_proj/up_proj/down_proj modules."""
        return cls._wrap("from_llama_mlp", "LlamaMLP", mlp)


class TritonGemmaMLP(_TritonGatedMLP):
    """down_proj(geglu(gate_proj(x), up_proj(x))): GemmaMLP (Gemma, Gemma2, Gemma3: the tanh GELU) with the
    elementwise middle fused."""

    ACTIVATION = "gelu_tanh"
    ACT_CLASS_NAMES = ("GELUTanh", "PytorchGELUTanh")  # transformers' ACT2FN["gelu_pytorch_tanh"], new and old name
    HIDDEN_ACT = "gelu_pytorch_tanh"

    @classmethod
    def from_gemma_mlp(cls, mlp):
        """Wrap an existing GemmaMLP (or Gemma2MLP, Gemma3MLP), REUSING its gate_proj/up_proj/down_proj modules."""
        return cls._wrap("from_gemma_mlp", "GemmaMLP", mlp)


class GateUpSwiGLUFunction(torch.autograd.Function):
    """GateUpSwiGLUFunction.apply(gate_up): silu(gate) * up of [gate | up] = gate_up, the output of one fused gate_up
    projection, with the in-place backward. Taking the two halves apart outside (gate_up.chunk) would make autograd
    put their gradients back together with chunk's backward, a cat: a copy of the whole [tokens, 2 x intermediate]
    gradient into a new buffer. Here the kernel writes dgate and dup over the two halves of gate_up, which is then
    gate_up's gradient exactly as it lies: no cat, no new buffer."""

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)  # views: each row of a half is strided by 2 x intermediate
        out = _glu_forward("swiglu", gate, up, "silu", 1.0, None, None)
        ctx.save_for_backward(gate_up)
        ctx.backward_done = False
        return out

    @staticmethod
    def backward(ctx, dy):
        if ctx.backward_done:
            raise RuntimeError("swiglu_gate_up overwrote its saved gate_up with its gradient in the first backward; "
                               "recompute the forward instead of using retain_graph=True")
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.chunk(2, dim=-1)
        dgate, dup = _glu_backward("swiglu_backward", gate, up, dy, "silu", 1.0, True, None, None)
        ctx.backward_done = True
        if dgate is not gate:  # no row view of the halves to write through (e.g. a transposed gate_up): fresh buffers
            return torch.cat([dgate, dup], dim=-1)
        torch.autograd.graph.increment_version(gate_up)  # it holds gradients now (see SwiGLUFunction.backward)
        return gate_up


def swiglu_gate_up(gate_up):
    """silu(gate) * up for [gate | up] = gate_up [..., 2 x intermediate] (Phi-3's fused projection), differentiable,
    with the gradient written over gate_up itself: swiglu(*gate_up.chunk(2, -1), inplace_backward=True) without the
    copy that putting the halves' gradients back together costs. The in-place contract of `swiglu` holds for gate_up.
    Under torch.compile it is that chunk and the swiglu operator: the compiler plans the gradient's buffer itself."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_gate_up: the last dimension holds [gate | up] and must be even, got "
                         f"{tuple(gate_up.shape)}")
    if torch.compiler.is_compiling():
        return _glu(*gate_up.chunk(2, dim=-1), "silu", 1.0, inplace_backward=True)
    return GateUpSwiGLUFunction.apply(gate_up)


class TritonPhi3MLP(torch.nn.Module):
    """down_proj(swiglu(gate, up)) with [gate | up] = gate_up_proj(x): Phi3MLP, whose gate and up projections are one
    Linear of 2 x intermediate outputs, with the elementwise middle fused. The kernel reads the two halves where they
    lie (each row of one half is strided by 2 x intermediate) and writes their gradients back over them, so neither
    splitting the output nor joining the gradients copies anything (swiglu_gate_up)."""

    def __init__(self, gate_up_proj, down_proj):
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj

    @classmethod
    def from_phi3_mlp(cls, mlp):
        """Wrap an existing Phi3MLP, REUSING its gate_up_proj/down_proj modules."""
        for name in ("gate_up_proj", "down_proj", "activation_fn"):
            if not hasattr(mlp, name):
                raise TypeError(f"from_phi3_mlp: {type(mlp).__name__} has no '{name}'; expected a Phi3MLP")
        act_name = type(mlp.activation_fn).__name__
        if act_name not in TritonLlamaMLP.ACT_CLASS_NAMES:
            raise ValueError(f"from_phi3_mlp: the fused kernel computes silu(gate) * up, but this MLP's activation_fn "
                             f"is {act_name} (config.hidden_act must be 'silu')")
        new = cls(mlp.gate_up_proj, mlp.down_proj)
        new.train(mlp.training)
        return new

    def forward(self, x):
        # In place as in _TritonGatedMLP: the projection's output exists only here, and its gradient goes over it.
        return self.down_proj(swiglu_gate_up(self.gate_up_proj(x)))


def _replace_mlps(who, model, expected, class_names, wrap):
    """Swap every module of model whose class (or a base class: no transformers import needed) is named in
    class_names for wrap(module); returns how many. All targets are collected first (replacing while iterating
    named_modules would mutate what we iterate) and all replacements are built before any is installed, so an
    unsupported MLP leaves the model untouched. With `expected`, a different count raises ValueError before anything
    is replaced."""
    targets = [(name, module) for name, module in model.named_modules()
               if any(cls.__name__ in class_names for cls in type(module).__mro__)]
    if expected is not None and len(targets) != expected:
        raise ValueError(f"{who}: found {len(targets)} {class_names[0]} modules to replace, expected {expected}")
    if any(name == "" for name, _ in targets):
        raise ValueError(f"{who}: the model itself is a {class_names[0]}; wrap it with {wrap.__qualname__}(mlp)")
    replacements = [(name, wrap(module)) for name, module in targets]
    for name, new in replacements:
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, new)
    return len(replacements)


def replace_llama_mlp(model, expected=None):
    """Swap every LlamaMLP inside model for a TritonLlamaMLP that reuses its Linear layers; returns how many (see
    _replace_mlps)."""
    return _replace_mlps("replace_llama_mlp", model, expected, ("LlamaMLP",), TritonLlamaMLP.from_llama_mlp)


def replace_gemma_mlp(model, expected=None):
    """Swap every GemmaMLP (Gemma2MLP, Gemma3MLP) inside model for a TritonGemmaMLP that reuses its Linear layers;
    returns how many (see _replace_mlps)."""
    return _replace_mlps("replace_gemma_mlp", model, expected, ("GemmaMLP", "Gemma2MLP", "Gemma3MLP"),
                         TritonGemmaMLP.from_gemma_mlp)


# The MLP class of each supported model family (transformers' config.model_type) and how to wrap it: LLaMA's form
# (silu gate) in LLaMA, Mistral and Qwen; Gemma's (tanh-GELU gate) in Gemma 2 and 3; Phi-3's fused gate_up_proj.
GLU_MLP_FAMILIES = {"llama": ("LlamaMLP", TritonLlamaMLP.from_llama_mlp),
                    "mistral": ("MistralMLP", TritonLlamaMLP.from_llama_mlp),
                    "qwen2": ("Qwen2MLP", TritonLlamaMLP.from_llama_mlp),
                    "qwen3": ("Qwen3MLP", TritonLlamaMLP.from_llama_mlp),
                    "gemma2": ("Gemma2MLP", TritonGemmaMLP.from_gemma_mlp),
                    "gemma3_text": ("Gemma3MLP", TritonGemmaMLP.from_gemma_mlp),
                    "phi3": ("Phi3MLP", TritonPhi3MLP.from_phi3_mlp)}


def apply_glu_mlp(model):
    """The patch entry point: swaps the MLP of every decoder layer of a transformers model of a family in
    GLU_MLP_FAMILIES for its fused counterpart, which reuses the MLP's Linear layers; returns how many. A model of
    another family, or an MLP count other than the config's layer count, raises ValueError before anything is
    replaced."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in GLU_MLP_FAMILIES:
        raise ValueError(f"apply_glu_mlp: {family or type(model).__name__} models are not supported; supported: "
                         f"{', '.join(GLU_MLP_FAMILIES)}")
    class_name, wrap = GLU_MLP_FAMILIES[family]
    return _replace_mlps("apply_glu_mlp", model, model.config.num_hidden_layers, (class_name,), wrap)


# ----------------------------------------------------------------------------------------------------------------------
# 4. Run as a script
# ----------------------------------------------------------------------------------------------------------------------
def main(argv=None):
    """One forward+backward on random inputs against float64; one line; exit code 0/1."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=37 if INTERPRETER else 4 * 512,
                        help="rows (tokens); default: a toy size on the CPU interpreter, 4x512 on a GPU")
    parser.add_argument("--intermediate", type=int, default=1000 if INTERPRETER else 14336,
                        help="intermediate size (LLaMA-3.1-8B: 14336)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16", help="dtype of gate and up")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.intermediate < 1:
        parser.error(f"need --rows >= 1 and --intermediate >= 1, got {args.rows} and {args.intermediate}")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]

    torch.manual_seed(0)
    # gate and up as the two halves of one fused gate_up projection output (row stride 2 * intermediate).
    gate, up = (torch.randn(args.rows, 2 * args.intermediate, device=KERNEL_DEVICE) * 3).to(dtype).chunk(2, dim=-1)
    dy = torch.randn(args.rows, args.intermediate, device=KERNEL_DEVICE).to(dtype)

    def run(fn, cast):
        g, u = cast(gate).requires_grad_(), cast(up).requires_grad_()
        out = fn(g, u)
        out.backward(cast(dy))
        return out.detach(), g.grad, u.grad

    reference = run(lambda g, u: torch.nn.functional.silu(g) * u, lambda t: t.detach().double())
    torchs = run(lambda g, u: torch.nn.functional.silu(g) * u, lambda t: t.detach())  # transformers' LlamaMLP math
    ours = run(swiglu, lambda t: t.detach())

    def rel_error(a, ref):
        return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()

    # The tests' rule: no worse than PyTorch in the same dtype times 2, plus one unit in the last place.
    ok, parts = True, []
    for name, a, b, ref in zip(("out", "dgate", "dup"), ours, torchs, reference):
        ours_err, torch_err = rel_error(a, ref), rel_error(b, ref)
        ok &= ours_err <= 2 * torch_err + torch.finfo(dtype).eps
        parts.append(f"{name} {ours_err:.2e} (PyTorch {torch_err:.2e})")
    where = "CPU interpreter" if INTERPRETER else torch.cuda.get_device_name()
    print(f"swiglu {args.rows}x{args.intermediate} {args.dtype} on {where}, max relative error vs float64: "
          f"{', '.join(parts)}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
