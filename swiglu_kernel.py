"""Fused SwiGLU for the LLaMA MLP: silu(gate) * up in one pass, and its backward in one pass.

What it computes
----------------
LLaMA's MLP is  down_proj( silu(gate_proj(x)) * up_proj(x) ),  with silu(g) = g * sigmoid(g).
The three projections are matmuls (they stay in cuBLAS); between them sits pure elementwise work on two
[tokens, intermediate] tensors (intermediate = 14336 for LLaMA-3.1-8B). That is what this file fuses:

    forward:   out   = silu(gate) * up
    backward:  dup   = dy * silu(gate)
               dgate = dy * up * silu'(gate),   silu'(g) = s * (1 + g * (1 - s)),  s = sigmoid(g)

Cast order (checked in transformers 5.17, models/llama/modeling_llama.py and activations.py)
-----------------------------------------------------------------------------------------
`LlamaMLP.forward` is `self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))` with
`act_fn = ACT2FN[config.hidden_act]`; "silu" maps to `SiLUActivation` (its forward is `nn.functional.silu`; the
`@use_kernel_forward_from_hub("SiLU")` decorator only swaps in a Hub kernel when a model is explicitly kernelized) and
"swish" to `nn.SiLU`. So in a bf16 model the activation runs on the bf16 gate tensor: PyTorch computes silu in fp32
internally and ROUNDS the result to bf16, and the `*` with up rounds once more. We reproduce exactly that:
    out = round( round(silu(gate)) * up )          (all arithmetic in fp32, "round" = cast to the input dtype)
In the backward PyTorch's autograd also rounds dy * up to bf16 before applying silu'(gate); that rounding is an
artifact of running two separate ops, not part of the function, so we keep dy * up * silu'(gate) in fp32 and round
once (slightly more accurate). dup = dy * round(silu(gate)) uses the ROUNDED silu, because that is the value the
forward really multiplied up with.

Bytes moved (2 bytes per element in bf16, N = tokens * intermediate elements)
---------------------------------------------------------------------------
    forward:  read gate, up; write out                  = 3 tensors = 6 N bytes
    backward: read gate, up, dy; write dgate, dup       = 5 tensors = 10 N bytes
Eager PyTorch runs silu, mul (forward) and mul, mul, silu_backward (backward) as separate kernels, each reading and
writing full tensors: 5 tensors forward and 9 backward, 14 against our 8. The work is far too light to be
compute-bound, so time ~ bytes, and fusing is the whole win.

Why recompute silu in the backward instead of saving it
-------------------------------------------------------
Eager autograd saves gate (for silu's backward) AND silu(gate) and up (for the product's backward): three
[tokens, intermediate] tensors per layer. We save only gate and up and recompute sigmoid/silu from gate in the
backward; it costs a few arithmetic instructions per element (free in a memory-bound kernel) and saves one tensor per
layer: 8192 tokens * 14336 * 2 bytes = 235 MB per layer, 7.5 GB over LLaMA-3.1-8B's 32 layers.
TritonLlamaMLP also lets the backward write dgate and dup over gate and up, whose last use it is
(`inplace_backward`): the backward then allocates nothing, two such tensors fewer at the moment the backward of the
first MLP starts, when every layer's activations are still alive (470 MB at 8192 tokens).

Layout of this file: kernels -> launchers (validate, pick block sizes, launch) -> autograd Function -> `swiglu()` ->
`TritonLlamaMLP` (drop-in for transformers' LlamaMLP) -> `replace_llama_mlp(model)`.
"""
import contextlib
import os
import sys

import torch
from torch import nn

# Without a GPU, Triton's CPU interpreter runs the kernels (slowly, with numpy). It must be switched on before
# `import triton`, so the first kernel module imported sets the variable and prints a one-line notice.
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
    print("No CUDA device: Triton kernels run on the CPU interpreter (toy sizes; times are not meaningful).", file=sys.stderr)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------
# Both kernels see their tensors as 2-D [n_rows, n_cols] (all leading dims flattened into rows, n_cols = the
# intermediate size). Each program handles one tile of BLOCK_ROWS x BLOCK_COLS elements; the grid is
# (row tiles, column tiles). On the GPU a tile is typically 1 row x 8192 columns (enough bytes in flight per program
# to saturate HBM); on the CPU interpreter a tile covers many rows, because the interpreter pays ~1 ms per program.
#
# Every tensor has its own row stride (elements between the starts of consecutive rows) and a column stride of 1.
# That lets gate and up be the two halves of one fused gate_up projection (`gate_up.chunk(2, dim=-1)` gives views
# whose row stride is 2 * n_cols) without copying them.


@triton.jit
def _swiglu_forward_kernel(
    gate_ptr, up_ptr, out_ptr,
    gate_row_stride, up_row_stride, out_row_stride,
    n_rows, n_cols,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)  # the last tiles hang over the tensor's edges
    # int64 before multiplying by the stride: rows * row_stride passes 2^31 once a tensor holds more than 2^31
    # elements (e.g. 150k tokens x 14336), and an int32 product would silently wrap to a wrong address.
    rows64 = rows.to(tl.int64)[:, None]

    # Load in the storage dtype and compute in fp32 (bf16 has only 8 bits of mantissa).
    g = tl.load(gate_ptr + rows64 * gate_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows64 * up_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    # silu(g) = g / (1 + exp(-g)), the same formula PyTorch uses. For very negative g, exp(-g) = inf and the
    # result is -0.0, which is the correct limit.
    act = g / (1.0 + tl.exp(-g))
    # Round silu to the tensor dtype first, as transformers does (F.silu returns a bf16 tensor), then multiply
    # and round again. For fp32 inputs both casts are no-ops.
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = act * u
    tl.store(out_ptr + rows64 * out_row_stride + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    gate_ptr, up_ptr, dy_ptr, dgate_ptr, dup_ptr,
    gate_row_stride, up_row_stride, dy_row_stride, dgate_row_stride, dup_row_stride,
    n_rows, n_cols,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    rows64 = rows.to(tl.int64)[:, None]  # int64 offsets, as in the forward

    g = tl.load(gate_ptr + rows64 * gate_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows64 * up_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # dy has its own row stride: an upstream gradient need not be laid out like the inputs.
    dy = tl.load(dy_ptr + rows64 * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    # Recompute instead of saving: sigmoid and silu cost a few instructions, a saved tensor costs HBM traffic.
    one_plus_exp = 1.0 + tl.exp(-g)
    sig = 1.0 / one_plus_exp
    # d(out)/d(up) is the silu value the forward actually used: the forward's expression, bit for bit, rounded to
    # the tensor dtype (g * sig could differ from g / (1 + exp(-g)) in the last fp32 bit and round differently).
    act = (g / one_plus_exp).to(dup_ptr.dtype.element_ty).to(tl.float32)
    dup = dy * act
    # d(out)/d(gate) = up * silu'(g), silu'(g) = s + g * s * (1 - s) = s * (1 + g * (1 - s)); kept in fp32 until
    # the single final rounding.
    dgate = dy * u * sig * (1.0 + g * (1.0 - sig))

    tl.store(dgate_ptr + rows64 * dgate_row_stride + cols[None, :], dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + rows64 * dup_row_stride + cols[None, :], dup.to(dup_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Launchers: validate, view as 2-D, pick tile sizes, launch
# ----------------------------------------------------------------------------------------------------------------
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
    _check_kernel_device(gate.device, who)


def _check_kernel_device(device, who):
    # Compiled Triton kernels need CUDA tensors; only the CPU interpreter reads CPU (numpy-backed) memory.
    if device.type == "cuda" or (device.type == "cpu" and INTERPRETING):
        return
    where = "the CPU interpreter (TRITON_INTERPRET=1)" if INTERPRETING else "CUDA (move the tensors with .cuda())"
    raise ValueError(f"{who}: tensors are on {device}, but the Triton kernel runs on {where}")


def _on_tensor_device(t):
    """Triton launches on the CURRENT CUDA device; switch to t's GPU only when it is another one. Entering
    torch.cuda.device() on every call is not free: while this launcher did so, swapping in the fused MLPs raised a
    host-bound 8B fine-tune step at 1x512 from 148 to 192 ms on the H200 machine."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _as_rows(t):
    """View t [..., n_cols] as [n_rows, n_cols] with unit column stride; copies only when no such view exists."""
    t2d = t.reshape(-1, t.shape[-1])  # a view whenever the leading dims can be merged (e.g. chunk views), else a copy
    if t2d.stride(-1) != 1:           # e.g. a transposed tensor: the kernels assume neighbouring columns in memory
        t2d = t2d.contiguous()
    return t2d


def _launch_config(n_rows, n_cols, block_size, block_rows, num_warps):
    """Tile shape and warps. block_size (columns per tile), block_rows and num_warps override the defaults
    (for a block-size sweep on the GPU); tile dimensions must be powers of two (tl.arange needs them)."""
    for name, value in (("block_size", block_size), ("block_rows", block_rows)):
        if value is not None and (value < 1 or value & (value - 1)):
            raise ValueError(f"{name} must be a positive power of two, got {value}")
    # GPU: 8192 elements and 8 warps per program. Measured on an H200 at [16384, 14336] bf16 (24 tile shapes): this
    # one moved 99% of copy bandwidth forward and 98% backward; 1024-4096-element tiles 96-98%; 8192 x 2 rows with
    # 4 warps only 48% backward (register spills). CPU interpreter: big tiles, because each program costs ~1 ms.
    elements_per_tile = 16384 if INTERPRETING else 8192
    block_cols = block_size or min(triton.next_power_of_2(n_cols), elements_per_tile)
    block_rows = block_rows or max(1, min(elements_per_tile // block_cols, triton.next_power_of_2(n_rows)))
    num_warps = num_warps or (8 if block_rows * block_cols >= 2048 else 4)
    grid = (triton.cdiv(n_rows, block_rows), triton.cdiv(n_cols, block_cols))  # rows on axis 0 (limit 2^31 - 1)
    return grid, block_rows, block_cols, num_warps


def swiglu_forward(gate, up, *, block_size=None, block_rows=None, num_warps=None):
    """out = round(round(silu(gate)) * up), same shape and dtype as gate. Not differentiable (see `swiglu`)."""
    _check_pair(gate, up, "swiglu_forward")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)  # contiguous, whatever gate's layout
    if gate.numel() == 0:
        return out
    gate2d, up2d, out2d = _as_rows(gate), _as_rows(up), out.view(-1, out.shape[-1])
    n_rows, n_cols = gate2d.shape
    grid, block_r, block_c, warps = _launch_config(n_rows, n_cols, block_size, block_rows, num_warps)
    with _on_tensor_device(gate):
        _swiglu_forward_kernel[grid](
            gate2d, up2d, out2d,
            gate2d.stride(0), up2d.stride(0), out2d.stride(0),
            n_rows, n_cols,
            BLOCK_ROWS=block_r, BLOCK_COLS=block_c, num_warps=warps,
        )
    return out


def swiglu_backward(gate, up, dy, *, inplace=False, block_size=None, block_rows=None, num_warps=None):
    """(dgate, dup) for out = silu(gate) * up, in gate's dtype.

    By default in fresh contiguous buffers (the inputs are untouched, so anything else still holding gate or up stays
    valid). inplace=True writes dgate over gate and dup over up when both are contiguous and in separate storages
    (each program reads its tile before writing the same addresses), so the backward allocates nothing: for a caller
    whose gate and up are private intermediates, dead after this backward (TritonLlamaMLP's)."""
    _check_pair(gate, up, "swiglu_backward")
    if not isinstance(dy, torch.Tensor) or dy.shape != gate.shape:
        got = tuple(dy.shape) if isinstance(dy, torch.Tensor) else type(dy).__name__
        raise ValueError(f"swiglu_backward: dy must be a tensor of shape {tuple(gate.shape)}, got {got}")
    if dy.dtype != gate.dtype or dy.device != gate.device:
        raise TypeError(f"swiglu_backward: dy must be {gate.dtype} on {gate.device}, got {dy.dtype} on {dy.device}")
    # In place only into two contiguous tensors of separate storages (dgate and dup must not collide). The storage
    # lookups run only when asked for in-place: the default path is a hot path too.
    if (inplace and gate.is_contiguous() and up.is_contiguous()
            and gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()):
        dgate, dup = gate, up
    else:
        dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        dup = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return dgate, dup
    gate2d, up2d, dy2d = _as_rows(gate), _as_rows(up), _as_rows(dy)
    dgate2d, dup2d = dgate.view(-1, dgate.shape[-1]), dup.view(-1, dup.shape[-1])
    n_rows, n_cols = gate2d.shape
    grid, block_r, block_c, warps = _launch_config(n_rows, n_cols, block_size, block_rows, num_warps)
    with _on_tensor_device(gate):
        _swiglu_backward_kernel[grid](
            gate2d, up2d, dy2d, dgate2d, dup2d,
            gate2d.stride(0), up2d.stride(0), dy2d.stride(0), dgate2d.stride(0), dup2d.stride(0),
            n_rows, n_cols,
            BLOCK_ROWS=block_r, BLOCK_COLS=block_c, num_warps=warps,
        )
    return dgate, dup


# ----------------------------------------------------------------------------------------------------------------
# Autograd Function and functional entry point
# ----------------------------------------------------------------------------------------------------------------
class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, inplace_backward):
        out = swiglu_forward(gate, up)
        # Save the inputs only; silu(gate) is recomputed in the backward (one tensor per layer less than eager).
        ctx.save_for_backward(gate, up)
        ctx.inplace_backward = inplace_backward
        ctx.backward_done = False
        return out

    @staticmethod
    def backward(ctx, dy):
        if ctx.inplace_backward and ctx.backward_done:
            raise RuntimeError("swiglu(inplace_backward=True) overwrote its saved gate and up with their gradients in "
                               "the first backward; recompute the forward instead of using retain_graph=True")
        gate, up = ctx.saved_tensors
        dgate, dup = swiglu_backward(gate, up, dy, inplace=ctx.inplace_backward)
        ctx.backward_done = True
        if dgate is gate:
            # The saved tensors now hold gradients: bump their version counters, so that anything else that saved
            # them for its own backward fails loudly instead of reading gradients as activations.
            torch.autograd.graph.increment_version(gate)
            torch.autograd.graph.increment_version(up)
        return dgate, dup, None


def swiglu(gate, up, inplace_backward=False):
    """silu(gate) * up with transformers' LlamaMLP cast order, differentiable. gate, up: [..., intermediate] of the
    same shape, dtype (float32/bfloat16/float16) and device; rows may be strided (e.g. halves of a fused gate_up
    projection). Returns a new contiguous tensor of gate's shape and dtype.

    inplace_backward=True lets the backward write the gradients over gate and up (contiguous ones): two
    [tokens, intermediate] buffers less at the start of each MLP's backward. Contract: gate and up are not used after
    the backward (true of the projections' outputs inside an MLP), and the graph is not backpropagated twice."""
    return SwiGLUFunction.apply(gate, up, inplace_backward)


# ----------------------------------------------------------------------------------------------------------------
# nn.Module: a drop-in replacement for transformers' LlamaMLP
# ----------------------------------------------------------------------------------------------------------------
_SILU_CLASS_NAMES = ("SiLUActivation", "SiLU")  # transformers' ACT2FN["silu"] and ACT2FN["swish"] (= nn.SiLU)


class TritonLlamaMLP(nn.Module):
    """down_proj(swiglu(gate_proj(x), up_proj(x))): LlamaMLP with the elementwise middle fused; the three Linear
    layers (cuBLAS matmuls) and their parameter names are the same as LlamaMLP's."""

    def __init__(self, hidden_size, intermediate_size, bias=False, device=None, dtype=None):
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_llama_mlp(cls, mlp):
        """Wrap an existing LlamaMLP, REUSING its gate_proj/up_proj/down_proj modules (the same Parameter objects),
        so optimizer state, state_dict keys and tied references stay valid."""
        for name in ("gate_proj", "up_proj", "down_proj", "act_fn"):
            if not hasattr(mlp, name):
                raise TypeError(f"from_llama_mlp: {type(mlp).__name__} has no '{name}'; expected a LlamaMLP")
        act_name = type(mlp.act_fn).__name__
        if act_name not in _SILU_CLASS_NAMES and mlp.act_fn is not nn.functional.silu:
            raise ValueError(f"from_llama_mlp: the fused kernel computes silu(gate) * up, but this MLP's act_fn is "
                             f"{act_name} (config.hidden_act must be 'silu')")
        gate_proj = mlp.gate_proj
        # Build the shell on the meta device (no memory), then put the original Linear modules in place.
        new = cls(gate_proj.in_features, gate_proj.out_features, bias=gate_proj.bias is not None, device="meta")
        new.gate_proj, new.up_proj, new.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        new.train(mlp.training)
        return new

    def forward(self, x):
        # gate_proj(x) and up_proj(x) exist only here, so the backward may overwrite them with their gradients.
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), inplace_backward=True))


def _is_llama_mlp(module):
    # isinstance(module, LlamaMLP) without importing transformers here: match the class or any base by name.
    return any(cls.__name__ == "LlamaMLP" for cls in type(module).__mro__)


def replace_llama_mlp(model, expected=None):
    """Swap every LlamaMLP inside model for a TritonLlamaMLP that reuses its Linear layers; returns how many.
    All targets are collected first (replacing while iterating named_modules would mutate what we iterate) and all
    replacements are built before any is installed, so an unsupported MLP leaves the model untouched. With
    `expected`, a different count raises ValueError before anything is replaced."""
    targets = [(name, module) for name, module in model.named_modules() if _is_llama_mlp(module)]
    if expected is not None and len(targets) != expected:
        raise ValueError(f"replace_llama_mlp: found {len(targets)} LlamaMLP modules to replace, expected {expected}")
    if any(name == "" for name, _ in targets):
        raise ValueError("replace_llama_mlp: the model itself is a LlamaMLP; use TritonLlamaMLP.from_llama_mlp(mlp)")
    replacements = [(name, TritonLlamaMLP.from_llama_mlp(module)) for name, module in targets]
    for name, new in replacements:
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, new)
    return len(replacements)
