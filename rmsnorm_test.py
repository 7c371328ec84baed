"""Correctness tests for rmsnorm_kernel.py (pytest; `python rmsnorm_test.py` runs them and prints a PASSED/FAILED
line per check).

How a check passes: the forward output y, dx and dw are compared with a float64 reference computed from the SAME
rounded inputs. PyTorch's own LlamaRMSNorm math in the same dtype is measured against that reference too, and ours must
be no worse than PyTorch's error times 1.5 plus a tiny floor (plus the dtype's eps for tensors of fewer than 1000
numbers, whose errors are noisy statistics): the same rule on the GPU and on the CPU interpreter, whose casts round like
the GPU's through the kernel's _round_to. All-zero or wrong outputs have a relative error near 1 and fail. Every check
draws fresh random data (the seed is in the failure message) and a random weight (not ones, which would hide a missing
multiply in the backward pass).

Covered: odd hidden sizes, 3-D inputs, rows with gaps and transposed (non-contiguous) inputs and upstream gradients,
fp32 / bf16 / fp16 and an fp32 weight with a bf16 input, eps = 0, empty inputs, a deterministic weight gradient, bf16
outputs equal to LlamaRMSNorm's bit for bit, the kernels' rounding, a clear error for every bad input,
TritonRMSNorm.from_llama_rmsnorm and replace_rmsnorm on a tiny LLaMA, the kernel file's script mode; on a GPU also
LLaMA shapes and int64 offsets past 2**31. The options, each in fp32, bf16 and fp16: Gemma's casting mode and offset
(against GemmaRMSNorm's math), casting mode "none" (against the same ops run in the input dtype), no weight, and the
in-place backward (dx written into dy's buffer, or a new one where dy cannot take it); the bf16 bits of each casting
mode; TritonRMSNorm.from_gemma_rmsnorm, and replace_rmsnorm on Gemma's norm.
"""
import argparse
import os
import sys

import pytest
import torch

# The kernel module comes before `import triton`: without a GPU it switches Triton to the CPU interpreter, which must
# happen before Triton decorates anything.
import rmsnorm_kernel
from rmsnorm_kernel import KERNEL_DEVICE, MAX_HIDDEN_SIZE, TritonRMSNorm, replace_rmsnorm, rms_norm, rmsnorm_backward
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = KERNEL_DEVICE
ON_CPU = KERNEL_DEVICE == "cpu"
HAS_CUDA = torch.cuda.is_available()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Ours may be this many times PyTorch's error in the same dtype (fp32 accumulation in a different order, rsqrt's last
# bit), plus a floor for errors that are tiny anyway.
ERROR_FACTOR = 1.5
ERROR_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-4, torch.float16: 1e-5}
# Over fewer numbers than this, a relative error is a noisy statistic, and so is the budget: dw shares the rounding of
# normed with PyTorch's, whose rounded products can cancel it by chance and leave PyTorch's error small (dw at hidden
# size 17 reaches 4.7x it, at 64 1.6x: no factor bounds the ratio). Such tensors may add the dtype's eps (two
# roundings) to the limit, which ours then stays far below whatever PyTorch's error (under 0.57 of it in 500,000 draws
# of each of the smallest shapes); a dw 2 % off still fails.
SMALL_TENSOR_NUMEL = 1000

# (leading shape, hidden): odd hidden sizes, 3-D inputs, and 600 rows of 96: five row blocks on the interpreter, more
# than its four backward programs, so a program's loop runs twice and adds to its weight-gradient sum. LLaMA's shape
# only on the GPU (the interpreter is slow).
SHAPES = [((5,), 17), ((2, 3), 1000), ((7,), 5120), ((3, 1, 4), 64), ((3, 200), 96)]
if not ON_CPU:
    SHAPES += [((4, 512), 4096), ((1000,), 8192), ((3, 2049), 4096)]
LAYOUTS = ["contiguous", "row_strided", "transposed"]


def fresh_seed():
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


def rel_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def eager_rmsnorm_math(x, weight, eps, offset=0.0, casting_mode="llama"):
    """The model code each casting mode follows, written out: the reference for cast order and dtype. "llama":
    transformers' LlamaRMSNorm.forward; "gemma": GemmaRMSNorm.forward (weight stored as w - offset); "none": the same
    ops on x's dtype, without upcasting."""
    if casting_mode == "gemma":
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
        return (hidden if weight is None else hidden * (offset + weight.float())).type_as(x)
    if casting_mode == "none":
        # rsqrt through fp32 and back: on a bf16 tensor, PyTorch's GPU kernel rounds rsqrt once, as the Triton kernel
        # does, but its CPU kernel rounds sqrt to bf16 and then the reciprocal (two bf16 steps off in 9 rows of 16).
        normed = x * torch.rsqrt((x.pow(2).mean(-1, keepdim=True) + eps).float()).to(x.dtype)
    else:
        hidden = x.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + eps)
        normed = hidden.to(x.dtype)
    if weight is None:
        return normed
    return (offset + weight if offset else weight) * normed


def make_tensor(lead, hidden, dtype, layout, row_gap=9):
    """A random [*lead, hidden] tensor laid out as asked: contiguous, rows with a gap between them (a slice of a wider
    buffer, read in place through its row stride), or a transposed view (hidden is not the contiguous dimension)."""
    shape = (*lead, hidden)
    if layout == "contiguous":
        return torch.randn(shape, device=DEVICE, dtype=dtype)
    if layout == "row_strided":
        return torch.randn((*lead, hidden + row_gap), device=DEVICE, dtype=dtype)[..., :hidden]
    if layout == "transposed":
        # The hidden dimension is not the contiguous one: the launcher must gather the rows (its copy path).
        return torch.randn((hidden, *lead), device=DEVICE, dtype=dtype).movedim(0, -1)
    if layout == "heads_transposed":
        # Qwen3's and Gemma 3's q_norm input: a [B, T, heads, D] projection viewed as [B, heads, T, D]. Dense, rows
        # contiguous, but not in the shape's order: the launcher reads them in memory order, without a copy.
        return torch.randn((lead[1], lead[0], *lead[2:], hidden), device=DEVICE, dtype=dtype).transpose(0, 1)
    raise ValueError(layout)


def leaf_like(t):
    """A fresh leaf tensor equal to t with t's strides, gaps between rows included (clone() would close the gaps of a
    tensor that is not dense, and the kernels' row strides would go untested)."""
    leaf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return leaf.copy_(t).requires_grad_()


def check_against_reference(lead, hidden, dtype, layout, eps=1e-5, weight_dtype=None, weight_step=1, offset=0.0,
                            casting_mode="llama", has_weight=True, in_place=False):
    """Run ours and PyTorch's math on the same inputs; compare both with float64. Returns the errors. weight_step > 1
    makes the weight a strided view (every weight_step-th element of a longer buffer). in_place=True also checks that
    dx was written into dy's buffer (the caller passes a layout in which dy can take it)."""
    seed = fresh_seed()
    weight_dtype = weight_dtype or dtype
    x = make_tensor(lead, hidden, dtype, layout)
    # The weight: random (ones would hide a missing multiply); around 1 - offset, so that offset + weight is near 1.
    weight = (1.0 - offset + 0.5 * torch.randn(hidden * weight_step, device=DEVICE)).to(weight_dtype)[::weight_step]
    weight = weight if has_weight else None
    # The upstream gradient gets a different row stride from x: the kernel must not read one with the other's.
    y_dtype = eager_rmsnorm_math(x[..., :0], None if weight is None else weight[:0], eps, offset, casting_mode).dtype
    dy = make_tensor(lead, hidden, y_dtype, layout, row_gap=0 if in_place else 3)

    # float64 reference on the same (already rounded) values.
    x64 = x.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if has_weight:
        w64 = weight.detach().double().requires_grad_()
        y64 = (offset + w64) * y64
    y64.backward(dy.double())

    # PyTorch in the same dtype: the error budget.
    x_t = x.detach().clone().requires_grad_()
    w_t = weight.detach().clone().requires_grad_() if has_weight else None
    y_t = eager_rmsnorm_math(x_t, w_t, eps, offset, casting_mode)
    y_t.backward(dy)

    # Ours, on leaves laid out as x and the weight are; dy copied, since in place it is overwritten.
    x_o, w_o = leaf_like(x), leaf_like(weight) if has_weight else None
    assert x_o.stride() == x.stride() and (not has_weight or w_o.stride() == weight.stride())
    dy_o = dy.clone()
    y_o = rms_norm(x_o, w_o, eps, offset, casting_mode, in_place)
    y_o.backward(dy_o)
    if in_place:
        assert torch.equal(dy_o, x_o.grad), "in_place=True: dx was not written into dy's buffer"

    assert y_o.dtype == y_t.dtype, f"output dtype {y_o.dtype}, the eager math gives {y_t.dtype}"
    if layout in ("contiguous", "heads_transposed"):  # laid out like x, as eager's elementwise ops leave it
        assert y_o.stride() == x.stride(), f"y strides {y_o.stride()}, x's {x.stride()}"
    assert y_o.shape == y_t.shape and x_o.grad.shape == x.shape
    checks = [("y", y_o, y_t, y64), ("dx", x_o.grad, x_t.grad, x64.grad)]
    if has_weight:
        assert w_o.grad.shape == weight.shape
        checks.append(("dw", w_o.grad, w_t.grad, w64.grad))
    errors = {}
    for name, ours, torchs, ref in checks:
        ours_err, torch_err = rel_error(ours, ref), rel_error(torchs, ref)
        limit = ERROR_FACTOR * torch_err + ERROR_FLOOR[ours.dtype]
        if ours.numel() < SMALL_TENSOR_NUMEL:
            limit += torch.finfo(ours.dtype).eps
        errors[name] = ours_err
        assert ours_err <= limit, (f"{name}: relative error {ours_err:.3e} > limit {limit:.3e} "
                                   f"(PyTorch same dtype: {torch_err:.3e}; seed {seed})")
    return errors


# ----------------------------------------------------------------------------------------------------------------------
# Forward and both gradients against the float64 reference
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("lead,hidden", SHAPES, ids=[f"{'x'.join(map(str, l))}x{h}" for l, h in SHAPES])
def test_matches_reference(lead, hidden, dtype_name, layout):
    check_against_reference(lead, hidden, DTYPES[dtype_name], layout)


def test_fp32_weight_with_bf16_input_promotes_like_llama():
    # LlamaRMSNorm with an fp32 weight returns fp32 for a bf16 input: ours must too.
    check_against_reference((4,), 300, torch.bfloat16, "contiguous", weight_dtype=torch.float32)


# The padding rows of the last row block load as zeros: with eps = 0 their rstd is inf and their normed values NaN,
# never stored. The interpreter computes them with numpy, which warns.
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_eps_zero_is_allowed():
    # eps = 0 is a valid (if unusual) choice: no row of random data has a zero mean square.
    check_against_reference((6,), 130, torch.bfloat16, "contiguous", eps=0.0)


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_strided_weight(dtype_name):
    # rms_norm takes any weight tensor, e.g. a strided slice of a bigger parameter: the kernels read it with unit
    # stride, so the launcher must hand them a contiguous one.
    check_against_reference((2, 9), 200, DTYPES[dtype_name], "contiguous", weight_step=3)


# (casting_mode, offset, has_weight, in_place): every option at least once, in combinations models use (Gemma's mode
# with its offset, with and without a weight) or that share a code path (no weight, in place).
OPTIONS = [("gemma", 1.0, True, False), ("none", 0.0, True, True), ("llama", 0.0, False, True),
           ("gemma", 1.0, False, False), ("llama", 0.5, True, False)]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("casting_mode,offset,has_weight,in_place", OPTIONS,
                         ids=["-".join(map(str, option)) for option in OPTIONS])
def test_options_match_reference(casting_mode, offset, has_weight, in_place, dtype_name):
    # 3 x 5 rows of 130: an odd hidden size; contiguous, so that an in-place backward can write into dy.
    check_against_reference((3, 5), 130, DTYPES[dtype_name], "contiguous", offset=offset, casting_mode=casting_mode,
                            has_weight=has_weight, in_place=in_place)


def test_gemma_mode_keeps_x_dtype_with_an_fp32_weight():
    # GemmaRMSNorm returns x's dtype (`.type_as(x)`) where LlamaRMSNorm promotes to the weight's: a bf16 model with
    # fp32 norm weights (mixed precision) gets bf16 out of Gemma's norms.
    check_against_reference((4,), 300, torch.bfloat16, "contiguous", weight_dtype=torch.float32, offset=1.0,
                            casting_mode="gemma")


@pytest.mark.parametrize("casting_mode", ["gemma", "none"])
def test_bf16_bits_of_each_casting_mode(casting_mode):
    # The error rule cannot tell where the roundings happen (computing everything in fp32 would pass it in every
    # mode), so compare bits: each mode gives its model code's bf16 outputs except for rare last-bit flips (rsqrt's
    # last bit, the order of the fp32 sum), and differs from the other modes' in many more. How many more depends on
    # each row: "none" rounds the row's rstd to bf16, and a row whose rstd lies near a bf16 value gives nearly llama's
    # outputs; over 16 rows, 5 % to 41 % differ. 256 rows average the rows out, so that every fraction stays far from
    # both thresholds (20 % or more differ from another mode's, at most 0.01 % from the same mode's).
    fresh_seed()
    offset = 1.0 if casting_mode == "gemma" else 0.0
    x = torch.randn(256, 1024, device=DEVICE, dtype=torch.bfloat16)
    weight = (1.0 - offset + 0.5 * torch.randn(1024, device=DEVICE)).to(torch.bfloat16)
    y = rms_norm(x, weight, 1e-5, offset, casting_mode)
    for mode in rmsnorm_kernel.CASTING_MODES:
        differing = (y != eager_rmsnorm_math(x, weight, 1e-5, offset, mode)).float().mean().item()
        if mode == casting_mode:
            assert differing < 0.02, f"{differing:.1%} of the outputs differ from the {mode!r} model code's"
        else:
            assert differing > 0.1, f"only {differing:.1%} of the outputs differ from the {mode!r} model code's"


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("casting_mode", ["llama", "gemma"])
def test_heads_transposed_rows_keep_their_layout(casting_mode, in_place):
    # Gemma 3's q_norm: [1, heads, T, head_dim] over a [1, T, heads, head_dim] projection. The output keeps that layout
    # (checked inside), so RoPE and attention see eager's strides; in place, dx is written over dy laid out alike.
    offset = 1.0 if casting_mode == "gemma" else 0.0
    check_against_reference((5, 3, 1), 96, torch.bfloat16, "heads_transposed", offset=offset,
                            casting_mode=casting_mode, in_place=in_place)
    check_against_reference((4, 7), 40, torch.float32, "heads_transposed", in_place=in_place)


def test_in_place_backward_takes_a_new_buffer_where_dy_cannot_hold_dx():
    # A dy broadcast over the rows (one row of memory shared by all, stride 0) cannot take each row's own dx, and a dy
    # of another dtype than x (an fp32 weight makes y, and so dy, fp32 for a bf16 x) cannot hold dx in x's dtype: the
    # backward writes a new buffer instead, with the same results.
    fresh_seed()
    x = torch.randn(6, 40, device=DEVICE).to(torch.bfloat16)
    for weight in ((1.0 + 0.5 * torch.randn(40, device=DEVICE)).to(torch.bfloat16),
                   1.0 + torch.randn(40, device=DEVICE)):
        dy_row = torch.randn(1, 40, device=DEVICE).to(torch.promote_types(x.dtype, weight.dtype))
        grads = []
        for in_place in (False, True):
            x_leaf = x.clone().requires_grad_()
            rms_norm(x_leaf, weight, 1e-5, in_place=in_place).backward(dy_row.expand(6, 40))
            grads.append(x_leaf.grad)
        assert torch.equal(grads[0], grads[1])
    y, rstd = rmsnorm_kernel.rmsnorm_forward(x, weight, 1e-5)
    dx, _ = rmsnorm_backward(torch.randn_like(y), x, weight, rstd, in_place=True)
    assert dx.dtype == x.dtype


def test_zero_hidden_size_gives_empty_output():
    # LlamaRMSNorm(0) returns an empty [rows, 0] tensor: nothing to normalize, nothing to launch.
    x = torch.randn(4, 0, device=DEVICE, requires_grad=True)
    weight = torch.randn(0, device=DEVICE, requires_grad=True)
    y = rms_norm(x, weight)
    assert y.shape == (4, 0)
    y.sum().backward()
    assert x.grad.shape == (4, 0) and weight.grad.shape == (0,)


def test_empty_input():
    x = torch.randn(0, 3, 64, device=DEVICE, requires_grad=True)
    weight = (1.0 + torch.randn(64, device=DEVICE)).requires_grad_()
    y = rms_norm(x, weight)
    assert y.shape == x.shape
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_weight_gradient_is_deterministic():
    fresh_seed()
    x = torch.randn(300, 96, device=DEVICE, requires_grad=True)
    weight = (1.0 + torch.randn(96, device=DEVICE)).requires_grad_()
    dy = torch.randn(300, 96, device=DEVICE)
    grads = []
    for _ in range(2):
        weight.grad = None
        rms_norm(x, weight).backward(dy)
        grads.append(weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_bf16_cast_order_matches_llama_rmsnorm():
    # Multiplying by the weight in fp32 and rounding once (instead of rounding normed first, as LlamaRMSNorm does)
    # stays within the float64 error budget but changes ~1 element in 5 by one bf16 step. Only the cast order of the
    # original gives (almost) the same bits: allow a few flips from rsqrt's last-bit differences.
    fresh_seed()
    rows = 16 if ON_CPU else 64
    x = torch.randn(rows, 4096, device=DEVICE, dtype=torch.bfloat16)
    weight = (1.0 + 0.5 * torch.randn(4096, device=DEVICE)).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(rows, 4096, device=DEVICE, dtype=torch.bfloat16)
    y = rms_norm(x, weight, 1e-5)
    differing = (y != eager_rmsnorm_math(x, weight.detach(), 1e-5)).float().mean().item()
    assert differing < 0.02, f"{differing:.1%} of bf16 outputs differ from LlamaRMSNorm's"
    # The weight multiplied the ROUNDED normed values, so dw is the sum of dy * (rounded normed): computed exactly
    # (float64) and rounded once, it gives the same bits; with unrounded normed values ~2 elements in 5 differ.
    y.backward(dy)
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    dw_expected = (dy.double() * normed.double()).sum(0).to(torch.bfloat16)
    differing = (weight.grad != dw_expected).float().mean().item()
    assert differing < 0.02, f"{differing:.1%} of dw differ from the sum of dy * (bf16-rounded normed)"


@triton.jit
def _round_to_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(y_ptr + offsets, rmsnorm_kernel._round_to(x, y_ptr.dtype.element_ty), mask=mask)


def _round_to_cases():
    """fp32 values grouped by what they test: random values of every magnitude, exact ties (the upper 16 bits odd and
    even), overflow, inf and NaN; and separately +-0 with fp32 subnormals."""
    # Ties: upper halves of normal, finite numbers of either sign, lower half exactly 0x8000.
    ties = (torch.randint(0, 2, (256,)) << 31) | (torch.randint(0x80, 0x7F80, (256,)) << 16) | 0x8000
    ties = ties.to(torch.int32)  # wraps the sign bit into int32's
    bf16_max = torch.finfo(torch.bfloat16).max
    specials = [1.0, bf16_max, -bf16_max, 3.4e38, 65519.0, 65520.0, 1e-30, 1e-8, -1e-8, float("inf"), -float("inf"),
                float("nan")]
    regular = torch.cat([torch.randn(1000) * 10.0 ** torch.randint(-6, 6, (1000,)), ties.view(torch.float32),
                         torch.tensor(specials)])
    tiny = torch.tensor([0.0, -0.0, 1e-39, -1e-39, 1e-45, 5.9e-39])
    return {"regular": regular, "zeros_subnormals": tiny}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the interpreter's numpy cast to inf
@pytest.mark.parametrize("case", ["regular", "zeros_subnormals"])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_round_to_rounds_like_torch(dtype_name, case):
    # The kernels' fp32 -> 16-bit casts equal torch's (round to nearest even) bit for bit, on the GPU and on the
    # interpreter, so CPU runs show the GPU's numerics.
    fresh_seed()
    dtype = DTYPES[dtype_name]
    x = _round_to_cases()[case].to(DEVICE)
    y = torch.empty(x.shape, dtype=dtype, device=DEVICE)
    _round_to_kernel[(triton.cdiv(x.numel(), 512),)](x, y, x.numel(), BLOCK=512)
    expected = x.to(dtype)
    assert torch.equal(y.isnan(), expected.isnan())
    same = (y.view(torch.int16) == expected.view(torch.int16)) | expected.isnan()
    assert same.all(), f"{(~same).sum().item()} values round differently, e.g. {x[~same][:4].tolist()}"


# ----------------------------------------------------------------------------------------------------------------------
# Bad input: one clear error each
# ----------------------------------------------------------------------------------------------------------------------
def _x(*shape, dtype=torch.float32, device=DEVICE):
    return torch.randn(shape, device=device).to(dtype)


BAD_INPUTS = {
    "weight_too_short": (lambda: (_x(4, 8), _x(7), 1e-5), ValueError, "weight of shape .* does not match"),
    "weight_2d": (lambda: (_x(4, 8), _x(2, 4), 1e-5), ValueError, "weight of shape .* does not match"),
    "x_0d": (lambda: (_x(), _x(1), 1e-5), ValueError, "at least one dimension"),
    "x_int": (lambda: (torch.ones(4, 8, dtype=torch.int32, device=DEVICE), _x(8), 1e-5), TypeError, "floating point"),
    "x_fp64": (lambda: (_x(4, 8, dtype=torch.float64), _x(8), 1e-5), TypeError, "float32, bfloat16 or float16"),
    "x_not_tensor": (lambda: ([[1.0, 2.0]], _x(2), 1e-5), TypeError, "must be torch.Tensors"),
    "weight_elsewhere": (lambda: (_x(4, 8), _x(8, device="meta"), 1e-5), ValueError, "weight is on meta"),
    "both_elsewhere": (lambda: (_x(4, 8, device="meta"), _x(8, device="meta"), 1e-5), ValueError,
                       f"x is on meta, but the Triton kernels run on {KERNEL_DEVICE}"),
    "hidden_too_large": (lambda: (_x(2, MAX_HIDDEN_SIZE + 1), _x(MAX_HIDDEN_SIZE + 1), 1e-5), ValueError,
                         "above the maximum"),
    "eps_negative": (lambda: (_x(4, 8), _x(8), -1e-5), ValueError, "eps must be a finite number >= 0"),
    "eps_nan": (lambda: (_x(4, 8), _x(8), float("nan")), ValueError, "eps must be a finite number >= 0"),
    "eps_inf": (lambda: (_x(4, 8), _x(8), float("inf")), ValueError, "eps must be a finite number >= 0"),
    "eps_not_a_number": (lambda: (_x(4, 8), _x(8), "1e-5"), TypeError, "eps must be a float"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_raise_clear_errors(case):
    make_bad, error, message = BAD_INPUTS[case]
    x, weight, eps = make_bad()
    with pytest.raises(error, match=f"^rms_norm: .*{message}"):
        rms_norm(x, weight, eps)


BAD_OPTIONS = {
    "casting_mode_unknown": (dict(casting_mode="fp32"), ValueError,
                             "casting_mode must be one of 'llama', 'gemma', 'none'"),
    "offset_nan": (dict(offset=float("nan")), ValueError, "offset must be a finite number"),
    "offset_not_a_number": (dict(offset="1"), TypeError, "offset must be a float"),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_options_raise_clear_errors(case):
    options, error, message = BAD_OPTIONS[case]
    with pytest.raises(error, match=f"^rms_norm: {message}"):
        rms_norm(_x(4, 8), _x(8), 1e-5, **options)
    with pytest.raises(error, match=f"^TritonRMSNorm: {message}"):
        TritonRMSNorm(8, **options)


def test_backward_with_a_gradient_of_another_shape_raises():
    x, weight = _x(4, 8), _x(8)
    with pytest.raises(ValueError, match=r"rmsnorm_backward: dy of shape \(4, 9\) does not match x"):
        rmsnorm_backward(_x(4, 9), x, weight, torch.ones(4, device=DEVICE))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU (there is no second device type to mix up on the CPU)")
def test_cpu_tensor_on_gpu_machine_raises():
    with pytest.raises(ValueError, match="is on cpu"):
        rms_norm(torch.randn(4, 8), torch.randn(8))


def test_module_used_with_another_hidden_size_raises():
    norm = TritonRMSNorm(32).to(DEVICE)
    with pytest.raises(ValueError, match="hidden size 32"):
        norm(torch.randn(2, 48, device=DEVICE))


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf")])
def test_module_with_a_bad_eps_raises(eps):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    with pytest.raises(ValueError, match="^TritonRMSNorm: eps must be a finite number >= 0"):
        TritonRMSNorm(8, eps=eps)
    with pytest.raises(ValueError, match="^from_llama_rmsnorm: eps must be a finite number >= 0"):
        TritonRMSNorm.from_llama_rmsnorm(LlamaRMSNorm(8, eps=eps))


def test_from_llama_rmsnorm_refuses_another_module():
    with pytest.raises(TypeError, match="from_llama_rmsnorm: Linear has no 1-D weight Parameter and epsilon"):
        TritonRMSNorm.from_llama_rmsnorm(torch.nn.Linear(4, 4))


# ----------------------------------------------------------------------------------------------------------------------
# The module, model patching and the kernel file's script mode
# ----------------------------------------------------------------------------------------------------------------------
def _tiny_llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=128, hidden_size=72, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)


def test_from_llama_rmsnorm_shares_the_parameter_and_matches():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    fresh_seed()
    llama_norm = LlamaRMSNorm(200, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        llama_norm.weight.copy_(1.0 + 0.5 * torch.randn(200))
    ours = TritonRMSNorm.from_llama_rmsnorm(llama_norm)
    assert ours.weight is llama_norm.weight
    assert ours.variance_epsilon == llama_norm.variance_epsilon == 1e-5
    assert list(ours.state_dict()) == list(llama_norm.state_dict()) == ["weight"]

    x = torch.randn(3, 5, 200, device=DEVICE)
    dy = torch.randn(3, 5, 200, device=DEVICE)
    outputs = []
    for module in (llama_norm, ours):
        module.weight.grad = None
        x_in = x.clone().requires_grad_()
        y = module(x_in)
        y.backward(dy)
        outputs.append((y.detach(), x_in.grad, module.weight.grad.clone()))
    for name, a, b in zip(("y", "dx", "dw"), outputs[0], outputs[1]):
        assert rel_error(b, a) < 1e-5, f"{name} differs from LlamaRMSNorm: {rel_error(b, a):.2e}"


def test_from_gemma_rmsnorm_shares_the_parameter_and_matches():
    # GemmaRMSNorm computes x_hat * (1 + w) in fp32 and rounds once; bf16, where the cast order shows.
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    fresh_seed()
    gemma_norm = GemmaRMSNorm(200, eps=1e-6).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        gemma_norm.weight.copy_(0.5 * torch.randn(200))  # stored as w - 1: around 0
    ours = TritonRMSNorm.from_gemma_rmsnorm(gemma_norm)
    assert ours.weight is gemma_norm.weight and ours.variance_epsilon == 1e-6
    assert (ours.offset, ours.casting_mode) == (1.0, "gemma")
    x = torch.randn(3, 5, 200, device=DEVICE, dtype=torch.bfloat16)
    y_gemma, y_ours = gemma_norm(x), ours(x)
    assert y_ours.dtype == y_gemma.dtype == torch.bfloat16
    differing = (y_ours != y_gemma).float().mean().item()
    assert differing < 0.02, f"{differing:.1%} of the bf16 outputs differ from GemmaRMSNorm's"
    with pytest.raises(TypeError, match="from_gemma_rmsnorm: Linear has no 1-D weight Parameter and epsilon"):
        TritonRMSNorm.from_gemma_rmsnorm(torch.nn.Linear(4, 4))


def test_module_options_and_initial_weight():
    # offset + weight starts at 1 (LlamaRMSNorm's ones, GemmaRMSNorm's zeros); without a weight there is no
    # parameter; the options reach the kernels.
    fresh_seed()
    x = torch.randn(4, 24, device=DEVICE)
    gemma = TritonRMSNorm(24, offset=1.0, casting_mode="gemma").to(DEVICE)
    assert torch.equal(gemma.weight, torch.zeros(24, device=DEVICE))
    with torch.no_grad():
        gemma.weight.normal_()
    assert torch.equal(gemma(x), rms_norm(x, gemma.weight, 1e-6, 1.0, "gemma"))
    plain = TritonRMSNorm(24, eps=1e-5, elementwise_affine=False)
    assert plain.weight is None and list(plain.parameters()) == [] and list(plain.state_dict()) == []
    assert torch.equal(plain(x), rms_norm(x, None, 1e-5))
    assert "elementwise_affine=False" in repr(plain) and "casting_mode='gemma'" in repr(gemma)


def test_replace_rmsnorm_picks_gemma_options_for_gemma_norms():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    fresh_seed()
    model = torch.nn.ModuleDict({"gemma": GemmaRMSNorm(40), "llama": LlamaRMSNorm(40)}).to(DEVICE)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    x = torch.randn(3, 40, device=DEVICE)
    expected = {name: module(x) for name, module in model.items()}
    assert replace_rmsnorm(model, expected=2) == 2
    assert (model["gemma"].offset, model["gemma"].casting_mode) == (1.0, "gemma")
    assert (model["llama"].offset, model["llama"].casting_mode) == (0.0, "llama")
    for name, module in model.items():
        assert rel_error(module(x), expected[name]) < 1e-6, name


def test_replace_rmsnorm_in_a_llama_model():
    from transformers import LlamaForCausalLM
    fresh_seed()
    config = _tiny_llama_config()
    model = LlamaForCausalLM(config).to(DEVICE)
    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            with torch.no_grad():
                module.weight.copy_(1.0 + 0.5 * torch.randn_like(module.weight))
    params_before = {name: p for name, p in model.named_parameters()}
    keys_before = list(model.state_dict())
    input_ids = torch.randint(0, config.vocab_size, (2, 9), device=DEVICE)
    with torch.no_grad():
        logits_before = model(input_ids).logits

    expected = 2 * config.num_hidden_layers + 1
    with pytest.raises(ValueError, match=f"found {expected} RMSNorm modules to replace, expected {expected + 1}"):
        replace_rmsnorm(model, expected=expected + 1)
    assert not any(isinstance(m, TritonRMSNorm) for m in model.modules()), "a refused replace must change nothing"
    replaced = replace_rmsnorm(model, expected=expected)
    assert replaced == expected
    assert sum(isinstance(m, TritonRMSNorm) for m in model.modules()) == replaced
    assert list(model.state_dict()) == keys_before
    assert all(p is params_before[name] for name, p in model.named_parameters())
    assert replace_rmsnorm(model) == 0  # already replaced: nothing left to swap
    with torch.no_grad():
        logits_after = model(input_ids).logits
    assert rel_error(logits_after, logits_before) < 1e-5


def test_kernel_script_prints_one_line_and_help(capsys):
    # dw has 40 numbers, so the script's rule adds bf16's eps to PyTorch's error times 1.5 (PyTorch's error alone can
    # be small by chance, see SMALL_TENSOR_NUMEL): ours stays under 0.36 of that limit in 500,000 draws.
    assert rmsnorm_kernel.main(["--rows", "16", "--hidden", "40", "--dtype", "bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("rms_norm 16x40 bf16") and lines[0].endswith(": OK"), lines
    with pytest.raises(SystemExit) as exit_info:
        rmsnorm_kernel.main(["--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        rmsnorm_kernel.main(["--eps", "-1"])
    assert exit_info.value.code == 2
    assert "finite --eps >= 0" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# GPU only: sizes the interpreter cannot run in reasonable time
# ----------------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU with ~20 GB free")
def test_int64_offsets_past_2_to_the_31():
    # rows * hidden > 2**31: int32 offsets would wrap around and read/write the wrong rows.
    fresh_seed()
    hidden = 4096
    rows = 2**31 // hidden + 1000
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (1.0 + 0.5 * torch.randn(hidden, device="cuda")).to(torch.bfloat16).requires_grad_()
    y = rms_norm(x, weight, 1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    tail = slice(rows - 2000, rows)  # straddles the 2**31 element boundary
    x_t = x.detach()[tail].clone().requires_grad_()
    y_t = eager_rmsnorm_math(x_t, weight.detach(), 1e-5)
    y_t.backward(dy[tail])
    assert rel_error(y.detach()[tail], y_t) < 1e-2
    assert rel_error(x.grad[tail], x_t.grad) < 1e-2


if __name__ == "__main__":
    # `python x_test.py` runs pytest on this file and ends with one PASSED / FAILED / SKIPPED line per check (pytest's
    # -rA summary); other arguments go to pytest (e.g. -k bf16). --help prints what is checked and how it passes.
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _, pytest_args = parser.parse_known_args()
    sys.exit(pytest.main([__file__, "-q", "-rA", "-p", "no:cacheprovider", *pytest_args]))
