"""Correctness tests for cross_entropy_kernel.py, cross_entropy_smem_kernel.py and linear_cross_entropy_kernel.py: the
fused cross-entropy, the fused linear cross-entropy (with Liger's accum_dtype and use_token_scaling), their extras
(class weights, z-loss, softcap, token accuracy, predicted tokens), and the launcher's choice of kernel.

    pytest cross_entropy_test.py -q      # or: python cross_entropy_test.py (pytest with a PASSED/FAILED line per check)

Reference: PyTorch in float64 on the SAME rounded inputs (the bf16 logits, converted up exactly). How a check passes:
our error against that reference is no worse than PyTorch's own error in the same dtype (measured in the same check)
times ERROR_FACTOR, or below a per-dtype floor of about one rounding of that dtype. Gradients are compared on the whole
tensor with a relative norm error ||ours - ref|| / ||ref||, so a zero or a wrong-sign gradient (error >= 1) cannot pass,
and so is their softmax part (every entry but the target's), which the target entries would outweigh in the whole
tensor's norm; ignored rows must be exactly 0; a mean over no rows must be NaN as in PyTorch. Both kernels are checked
on the CPU: the row kernel, and the shared-memory kernel through its interpreter stand-in, with schedules (streamed
chunks, ring slots) small enough for toy shapes. On the CPU the kernels run on Triton's interpreter, whose bf16 stores
round to nearest even as the GPU's do, so the tolerances are the GPU's; an interpreter RuntimeWarning fails the test.
The extras' reference is F.cross_entropy with its own `weight` and label smoothing on softcap * tanh(logits / softcap),
plus Liger's z-loss, in float64, by the same rule; the predicted tokens must equal the reference argmax (logits with a
unique maximum; equal maxima are a test of their own: the lowest column wins) and the token accuracy the fraction
derived from it. The GPU-only checks (int64 offsets past 2^31 elements, peak memory, LLaMA-3 sizes, the row kernel where
the shared-memory kernel is the default, the extras at LLaMA-3 sizes) are skipped there.
"""
import argparse
import re
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import cross_entropy_kernel as ck
import linear_cross_entropy_kernel as lce

ON_GPU = torch.cuda.is_available()
DEVICE = ck.KERNEL_DEVICE
# Where the shared-memory kernel may run: the CPU interpreter, and compute capability 9.x GPUs (the dispatch rule).
SMEM_RUNS_HERE = ck._smem_kernel_allowed(torch.cuda.get_device_properties(0) if ON_GPU else None)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Our gradient error may be at most ERROR_FACTOR x PyTorch's same-dtype error, or under the dtype's floor. The floors
# sit far below the error of any wrong gradient (~1), at about one rounding of the dtype (2^-8 relative for bf16, which
# keeps 8 significant bits, 2^-11 for fp16): what storing an exact gradient in that dtype costs.
ERROR_FACTOR = 3.0
GRAD_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}
LOSS_FP32_TOL = 1e-5  # the loss is computed and returned in fp32 whatever the logits dtype
# numpy's "invalid value encountered in subtract" and the like, printed by the interpreter, are failures here.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # reproducible failures; every check still draws its own fresh inputs


def rel_err(x, ref):
    """||x - ref|| / ||ref|| in float64 over the whole tensor (ref must not be all zeros)."""
    ref = ref.double()
    norm = ref.norm()
    assert norm > 0, "reference is all zeros: relative error undefined"
    return ((x.double() - ref).norm() / norm).item()


def assert_no_worse(name, ours, torch_err, floor):
    limit = max(ERROR_FACTOR * torch_err, floor)
    assert ours <= limit, f"{name}: error {ours:.3e} > limit {limit:.3e} (torch same dtype {torch_err:.3e})"


def rel_err_off_target(x, ref, targets, ignore_index=-100):
    """rel_err over the entries of a gradient ([..., V]) outside each row's target column: the softmax part. In the
    whole gradient's norm the target entries (about -1 per row) outweigh the thousands of small softmax entries, so an
    error in those alone (a wrong exponent, say) could stay under the tolerance; compared on their own it cannot. The
    target entries' share is subtracted from the squared norms (no masked copy of a LLaMA-size gradient)."""
    V = ref.shape[-1]
    x, ref, flat_targets = x.reshape(-1, V), ref.reshape(-1, V), targets.reshape(-1).long()
    rows = (flat_targets != ignore_index).nonzero().squeeze(1)
    x_t, ref_t = x[rows, flat_targets[rows]].double(), ref[rows, flat_targets[rows]].double()
    diff_sq = (x.double() - ref.double()).pow(2).sum() - (x_t - ref_t).pow(2).sum()
    ref_sq = ref.double().pow(2).sum() - ref_t.pow(2).sum()
    assert ref_sq > 0, "reference is zero off the targets: relative error undefined"
    return (diff_sq.clamp_min(0) / ref_sq).sqrt().item()


def assert_gradient_no_worse(grad, torch_grad, ref_grad, targets, dtype, ignore_index=-100):
    """Our gradient against the float64 reference by the rule of assert_no_worse: the whole tensor, and its softmax
    part on its own (see rel_err_off_target)."""
    assert_no_worse("grad", rel_err(grad, ref_grad), rel_err(torch_grad, ref_grad), GRAD_FLOOR[dtype])
    assert_no_worse("grad off the target", rel_err_off_target(grad, ref_grad, targets, ignore_index),
                    rel_err_off_target(torch_grad, ref_grad, targets, ignore_index), GRAD_FLOOR[dtype])


def make_targets(shape, V, ignore_frac, ignore_index=-100, dtype=torch.int64):
    """Random classes with round(ignore_frac * n) positions set to ignore_index (exactly, so 20 % is never 0 rows)."""
    n = 1
    for size in shape:
        n *= size
    targets = torch.randint(0, V, (n,))
    n_ignored = round(ignore_frac * n)
    targets[torch.randperm(n)[:n_ignored]] = ignore_index
    return targets.view(shape).to(dtype)


def with_layout(values, layout):
    """A fresh tensor equal to `values` ([N, V] or [B, T, V]) but with the memory layout named by `layout`."""
    if layout == "contiguous":
        return values.clone()
    if layout == "sliced":  # logits[:, :-1, :] of a causal LM: row stride (T+1)*V, no copy
        B, T, V = values.shape
        base = torch.randn(B, T + 1, V, dtype=values.dtype, device=values.device)
        base[:, :-1, :] = values
        return base[:, :-1, :]
    if layout == "transposed":  # [T, B, V] storage seen as [B, T, V]: stride_b = V, stride_t = B*V
        return values.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "strided_rows":  # every other row of a [2N, V] buffer
        N, V = values.shape
        base = torch.randn(2 * N, V, dtype=values.dtype, device=values.device)
        base[::2] = values
        return base[::2]
    if layout == "column_strided":  # last-dim stride != 1: the launcher must make it contiguous
        return values.t().contiguous().t()
    raise ValueError(layout)


def reference_cross_entropy(logits, targets, grad_output, **kwargs):
    """F.cross_entropy on [N, V] views (class dim last), returning (loss, grad of logits)."""
    x = logits.detach().clone().requires_grad_()
    V = x.shape[-1]
    loss = F.cross_entropy(x.reshape(-1, V), targets.reshape(-1).long(), **kwargs)
    if kwargs.get("reduction") == "none":
        loss = loss.view(targets.shape)
    loss.backward(grad_output.to(loss.dtype))
    return loss.detach(), x.grad


# ----------------------------------------------------------------------------------------------------------------------
# Fused cross-entropy against float64 PyTorch
# ----------------------------------------------------------------------------------------------------------------------
def case(**kwargs):
    return kwargs


CE_CASES = [
    # every dtype x every reduction, 20 % ignored rows, V = 1000 = 3 full CPU chunks + a partial one
    *[case(dtype=d, shape=(16, 1000), reduction=r, ignore_frac=0.2) for d in DTYPES for r in ("mean", "sum", "none")],
    # ignore fractions 0 and 100 % (mean over zero rows is NaN in PyTorch, its gradient zero)
    case(dtype="bf16", shape=(12, 700), reduction="mean", ignore_frac=0.0),
    *[case(dtype="fp32", shape=(8, 300), reduction=r, ignore_frac=1.0) for r in ("mean", "sum", "none")],
    # label smoothing, including on ignored rows
    *[case(dtype=d, shape=(12, 900), reduction=r, ignore_frac=0.25, label_smoothing=0.1)
      for d, r in (("fp32", "mean"), ("bf16", "mean"), ("bf16", "sum"), ("fp32", "none"))],
    case(dtype="fp32", shape=(8, 500), reduction="mean", ignore_frac=0.2, label_smoothing=1.0),
    # logits of magnitude 1e4 in fp32: exp would overflow without the running max
    case(dtype="fp32", shape=(12, 1000), reduction="mean", ignore_frac=0.2, magnitude=1e4),
    # odd vocabularies relative to the CPU block of 256: one partial chunk, one full + 1 column, 16 + 1 chunks
    case(dtype="bf16", shape=(6, 100), reduction="mean", ignore_frac=0.2),
    case(dtype="fp32", shape=(6, 257), reduction="sum", ignore_frac=0.2),
    case(dtype="bf16", shape=(4, 4097), reduction="mean", ignore_frac=0.25),
    # a whole number of chunks: the kernel's masked partial chunk is empty
    case(dtype="bf16", shape=(6, 512), reduction="mean", ignore_frac=0.2),
    case(dtype="fp32", shape=(6, 512), reduction="sum", ignore_frac=0.2, label_smoothing=0.1),
    # 3-D logits and non-contiguous layouts (targets non-contiguous too)
    case(dtype="bf16", shape=(2, 7, 500), reduction="mean", ignore_frac=0.2),
    case(dtype="bf16", shape=(3, 5, 700), reduction="mean", ignore_frac=0.2, layout="sliced"),
    case(dtype="fp32", shape=(2, 6, 600), reduction="none", ignore_frac=0.2, layout="transposed",
         transposed_targets=True),
    case(dtype="fp16", shape=(10, 600), reduction="sum", ignore_frac=0.2, layout="strided_rows"),
    case(dtype="fp32", shape=(8, 300), reduction="mean", ignore_frac=0.2, layout="column_strided"),
    # upstream gradient != 1 (a scaled loss), int32 targets, a different ignore_index that is a valid class
    case(dtype="bf16", shape=(12, 800), reduction="mean", ignore_frac=0.2, upstream=3.5),
    case(dtype="fp32", shape=(12, 800), reduction="sum", ignore_frac=0.2, upstream=-0.25, targets_dtype=torch.int32),
    case(dtype="fp32", shape=(12, 400), reduction="mean", ignore_frac=0.2, ignore_index=0),
    # the same on the shared-memory kernel, whose target-column store must skip ignored rows when ignore_index is a
    # class (on the interpreter an ignored row's placeholder statistics make that store 0; on a GPU, NaN)
    case(dtype="bf16", shape=(9, 1520), reduction="mean", ignore_frac=0.25, ignore_index=0, kernel="smem",
         block_v=256, n_streamed=3, n_ring=2),
    # the module, in-place mode, and explicit chunk widths through the launcher cross_entropy_forward
    case(dtype="bf16", shape=(12, 600), reduction="mean", ignore_frac=0.2, use_module=True),
    case(dtype="bf16", shape=(2, 6, 600), reduction="none", ignore_frac=0.2, inplace=True, layout="sliced"),
    case(dtype="fp32", shape=(10, 500), reduction="mean", ignore_frac=0.2, inplace=True),  # the leaf itself
    case(dtype="bf16", shape=(3, 4, 500), reduction="none", ignore_frac=0.2, upstream="expanded"),  # loss.sum()
    case(dtype="fp32", shape=(8, 1000), reduction="mean", ignore_frac=0.2, block_v=64),
    case(dtype="fp32", shape=(8, 1000), reduction="mean", ignore_frac=0.2, block_v=1024),
    # both loop forms of the row kernel (16-bit logits take two chunks per step, fp32 one): two per step with an odd
    # number of whole chunks (chunk 0 left over after the pairs), with label smoothing, with an even number and no
    # partial chunk, in fp16; one per step over 7 whole chunks and a partial one, with label smoothing
    case(dtype="bf16", shape=(8, 1000), reduction="mean", ignore_frac=0.2, kernel="rows", block_v=256),
    case(dtype="bf16", shape=(8, 1000), reduction="sum", ignore_frac=0.2, label_smoothing=0.1, kernel="rows",
         block_v=256),
    case(dtype="bf16", shape=(6, 1024), reduction="mean", ignore_frac=0.2, kernel="rows", block_v=256),
    case(dtype="fp16", shape=(8, 1000), reduction="mean", ignore_frac=0.2, kernel="rows", block_v=128),
    case(dtype="fp32", shape=(8, 1000), reduction="sum", ignore_frac=0.2, label_smoothing=0.1, block_v=128),
    # the shared-memory kernel (16-bit logits with a gradient) with 256-wide chunks, so that the same schedules run on
    # the CPU and the GPU: K streamed chunks through Q ring slots, from one of each to a ring that does not divide
    # the 2K loads per row (its slots rotate from row to row); ignored rows, smoothing, 3-D strides, in place. Row
    # strides are multiples of 16 elements, as the GPU's 16-byte copies need (the launcher checks).
    *[case(dtype=d, shape=(13, 2000), reduction=r, ignore_frac=0.2, kernel="smem", block_v=256, n_streamed=k,
           n_ring=q) for d, r, k, q in (("bf16", "mean", 1, 1), ("fp16", "sum", 3, 2), ("bf16", "none", 5, 3),
                                        ("bf16", "mean", 6, 6))],
    case(dtype="bf16", shape=(9, 1520), reduction="mean", ignore_frac=0.3, label_smoothing=0.1, kernel="smem",
         block_v=256, n_streamed=2, n_ring=2, upstream=-2.0),
    case(dtype="bf16", shape=(8, 1008), reduction="mean", ignore_frac=1.0, kernel="smem", block_v=256, n_streamed=1,
         n_ring=1),
    case(dtype="bf16", shape=(3, 5, 1104), reduction="sum", ignore_frac=0.2, layout="sliced", inplace=True,
         kernel="smem", block_v=256, n_streamed=2, n_ring=1),
    case(dtype="fp16", shape=(12, 1008), reduction="mean", ignore_frac=0.2, layout="strided_rows", kernel="smem",
         block_v=256, n_streamed=2, n_ring=2),
    # 16-bit logits with a gradient forced through the row kernel (by default they take the shared-memory kernel on
    # the CPU and on an H100/H200; other GPUs run the row kernel for them): smoothing, 3-D strides
    case(dtype="bf16", shape=(3, 5, 1000), reduction="mean", ignore_frac=0.2, label_smoothing=0.1, layout="sliced",
         kernel="rows"),
]


def case_id(c):
    keys = [f"{c['dtype']}", "x".join(map(str, c["shape"])), c["reduction"], f"ign{c['ignore_frac']}"]
    keys += [f"{k}={v}" for k, v in c.items() if k not in ("dtype", "shape", "reduction", "ignore_frac")]
    return "-".join(str(k) for k in keys).replace("torch.", "")


def check_cross_entropy(dtype, shape, reduction, ignore_frac, label_smoothing=0.0, magnitude=3.0, layout="contiguous",
                        upstream=1.0, targets_dtype=torch.int64, ignore_index=-100, use_module=False, inplace=False,
                        block_v=None, transposed_targets=False, kernel=None, n_streamed=None, n_ring=None):
    """One case of CE_CASES (also run at LLaMA sizes on a GPU): loss and gradient against the float64 reference."""
    if kernel == "smem" and not SMEM_RUNS_HERE:
        pytest.skip("the shared-memory kernel runs only on compute capability 9.x GPUs (and the CPU interpreter)")
    dtype = DTYPES[dtype]
    V = shape[-1]
    values = (torch.randn(shape, device=DEVICE) * magnitude).to(dtype)
    targets = make_targets(shape[:-1], V, ignore_frac, ignore_index, targets_dtype).to(DEVICE)
    if transposed_targets:
        targets = targets.t().contiguous().t()
    kwargs = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    if reduction == "none" and upstream == "expanded":  # what loss.sum().backward() sends: stride 0, no copy
        grad_output = torch.ones((), device=DEVICE).expand(shape[:-1])
    elif reduction == "none":
        grad_output = torch.randn(shape[:-1], device=DEVICE)  # an arbitrary upstream gradient per row
    else:
        grad_output = torch.tensor(upstream, device=DEVICE)

    ref_loss, ref_grad = reference_cross_entropy(values.double(), targets, grad_output.double(), **kwargs)
    torch_loss, torch_grad = reference_cross_entropy(values, targets, grad_output, **kwargs)

    leaf = values.clone().requires_grad_()
    logits = with_layout(leaf, layout)  # a differentiable view (or copy) of the leaf with the requested strides
    if logits is not leaf:
        logits.retain_grad()
    if block_v is not None or kernel is not None:
        # The launchers: same result whatever the kernel and its shape (chunk width, streamed chunks, ring slots).
        loss, grad = ck.cross_entropy_forward(logits.detach(), targets, compute_grad=True, inplace_backward=inplace,
                                              kernel=kernel, block_v=block_v, n_streamed=n_streamed, n_ring=n_ring,
                                              **kwargs)
        if inplace:
            assert grad.data_ptr() == logits.data_ptr(), "in-place mode must write into the logits' storage"
        grad = ck.cross_entropy_backward(grad, grad_output)  # what the autograd backward does with grad_output
    else:
        if use_module:
            loss = ck.TritonCrossEntropyLoss(inplace_backward=inplace, **kwargs)(logits, targets)
        else:
            loss = ck.cross_entropy(logits, targets, inplace_backward=inplace, **kwargs)
        loss.backward(grad_output)
        grad = logits.grad
    assert loss.dtype == torch.float32, f"loss dtype {loss.dtype}, expected float32"
    assert loss.shape == ref_loss.shape, f"loss shape {tuple(loss.shape)} != {tuple(ref_loss.shape)}"
    assert grad.dtype == dtype and grad.shape == values.shape, f"grad {grad.dtype} {tuple(grad.shape)}"

    ignored = targets == ignore_index
    assert torch.all(grad[ignored] == 0), "ignored rows must get an exactly zero gradient"
    if reduction == "none":
        assert torch.all(loss[ignored] == 0), "ignored rows must have loss 0"
    if bool(ignored.all()):
        # PyTorch: mean over zero rows is NaN, sum is 0; the gradient is zero everywhere.
        if reduction == "mean":
            assert torch.isnan(loss) and torch.isnan(ref_loss), f"mean over no rows: ours {loss}, torch {ref_loss}"
        else:
            assert torch.all(loss == 0) and torch.all(ref_loss == 0)
        assert torch.all(ref_grad == 0)
        return

    loss_err = rel_err(loss, ref_loss)
    assert loss_err <= LOSS_FP32_TOL, f"loss error {loss_err:.3e} > {LOSS_FP32_TOL:.0e} (torch {dtype}: " \
                                      f"{rel_err(torch_loss, ref_loss):.3e})"
    assert_gradient_no_worse(grad, torch_grad, ref_grad, targets, dtype, ignore_index)


@pytest.mark.parametrize("params", CE_CASES, ids=[case_id(c) for c in CE_CASES])
def test_cross_entropy_matches_float64(params):
    check_cross_entropy(**params)


# ----------------------------------------------------------------------------------------------------------------------
# In-place contract, no-grad path, out-of-range targets, bad inputs, empty inputs
# ----------------------------------------------------------------------------------------------------------------------
def test_inplace_contract():
    """inplace_backward=True: the gradient lands in the logits' own storage (sliced [:, :-1, :] view of an lm_head
    output), the untouched last position stays intact, and the gradient is right. Default mode keeps the logits."""
    B, T, H, V = 2, 6, 16, 500
    hidden = torch.randn(B, T + 1, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(V, H, device=DEVICE) / H**0.5).to(torch.bfloat16).requires_grad_()
    full_logits = hidden @ weight.t()  # like lm_head: matmul backward needs hidden and weight, not these logits
    logits = full_logits[:, :-1, :]
    targets = make_targets((B, T), V, 0.2).to(DEVICE)
    _, ref_grad = reference_cross_entropy(logits.double(), targets, torch.tensor(1.0, device=DEVICE))
    _, torch_grad = reference_cross_entropy(logits, targets, torch.tensor(1.0, device=DEVICE))
    last_position = full_logits[:, -1, :].detach().clone()
    ref_hidden_grad = torch.zeros_like(hidden, dtype=torch.float64)
    ref_hidden_grad[:, :-1] = ref_grad @ weight.double()

    captured = []
    logits.register_hook(captured.append)  # before the call: the in-place write bumps the view's version
    loss = ck.cross_entropy(logits, targets, inplace_backward=True)
    torch.autograd.grad(loss, hidden, retain_graph=True)
    grad = captured[0]
    assert grad.data_ptr() == logits.data_ptr() and grad.stride() == logits.stride(), "gradient not in the logits"
    assert torch.equal(full_logits[:, -1, :], last_position), "in-place wrote outside the sliced view"
    assert torch.equal(logits.detach(), grad), "contract: the logits now hold their gradient"
    grad_err = rel_err(grad, ref_grad)
    assert_no_worse("in-place grad", grad_err, rel_err(torch_grad, ref_grad), GRAD_FLOOR[torch.bfloat16])
    with pytest.raises(RuntimeError, match="can run once"):  # its backward scales in place: it refuses a rerun
        torch.autograd.grad(loss, hidden)

    # The full chain still works (matmul backward through the in-place gradient), as well as eager bf16.
    hidden.grad = None
    F.cross_entropy((hidden @ weight.t())[:, :-1, :].transpose(1, 2), targets).backward()
    eager_hidden_grad, hidden.grad = hidden.grad, None
    ck.cross_entropy((hidden @ weight.t())[:, :-1, :], targets, inplace_backward=True).backward()
    assert_no_worse("hidden grad through lm_head", rel_err(hidden.grad, ref_hidden_grad),
                    rel_err(eager_hidden_grad, ref_hidden_grad), GRAD_FLOOR[torch.bfloat16])

    # Default mode: logits untouched, gradient in a separate buffer.
    logits = torch.randn(8, 300, device=DEVICE, requires_grad=True)
    before = logits.detach().clone()
    (grad,) = torch.autograd.grad(ck.cross_entropy(logits, make_targets((8,), 300, 0.2).to(DEVICE)), logits)
    assert torch.equal(logits.detach(), before) and grad.data_ptr() != logits.data_ptr()

    # If another op saved the logits for its backward, in-place mode makes autograd complain instead of corrupting it.
    source = torch.randn(8, 300, device=DEVICE, requires_grad=True)
    saved_by_exp = source.exp()  # exp's backward reuses its output
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ck.cross_entropy(saved_by_exp, make_targets((8,), 300, 0.0).to(DEVICE), inplace_backward=True).backward()


def test_no_grad_path():
    """Without grad (no_grad or logits not requiring it): loss only, logits untouched even with inplace_backward."""
    logits = torch.randn(10, 700, device=DEVICE).to(torch.bfloat16)
    targets = make_targets((10,), 700, 0.2).to(DEVICE)
    before = logits.clone()
    ref_loss, _ = reference_cross_entropy(logits.double(), targets, torch.tensor(1.0, device=DEVICE))
    loss = ck.cross_entropy(logits, targets, inplace_backward=True)
    assert torch.equal(logits, before)
    with torch.no_grad():
        loss_no_grad = ck.cross_entropy(logits.clone().requires_grad_(), targets, inplace_backward=True)
    assert not loss.requires_grad and not loss_no_grad.requires_grad
    for value in (loss, loss_no_grad):
        assert rel_err(value, ref_loss) <= LOSS_FP32_TOL


def test_out_of_range_targets():
    """Targets outside [0, V) that are not ignore_index: no out-of-bounds access, NaN loss and gradient on those rows
    only (others exact), and check_targets=True raises a ValueError naming the value."""
    N, V = 8, 300
    logits = torch.randn(N, V, device=DEVICE, requires_grad=True)
    targets = make_targets((N,), V, 0.0).to(DEVICE)
    targets[2], targets[5], targets[6] = V, -7, -100
    loss = ck.cross_entropy(logits, targets, reduction="none")
    loss.backward(torch.ones_like(loss))
    bad = torch.zeros(N, dtype=torch.bool, device=DEVICE)
    bad[[2, 5]] = True
    assert torch.all(torch.isnan(loss[bad])) and torch.all(torch.isnan(logits.grad[bad])), "bad rows must be NaN"
    assert torch.all(torch.isfinite(loss[~bad])) and torch.all(torch.isfinite(logits.grad[~bad]))
    good = ~bad
    ref_loss, ref_grad = reference_cross_entropy(logits[good].double(), targets[good],
                                                 torch.ones(int(good.sum()), device=DEVICE), reduction="none")
    assert rel_err(loss[good], ref_loss) <= LOSS_FP32_TOL
    assert rel_err(logits.grad[good], ref_grad) <= GRAD_FLOOR[torch.float32]
    assert torch.isnan(ck.cross_entropy(logits.detach(), targets)), "a NaN row must make the mean NaN"
    with pytest.raises(ValueError, match=f"target {V} "):
        ck.cross_entropy(logits, targets, check_targets=True)
    with pytest.raises(ValueError, match="target -7 "):
        ck.TritonCrossEntropyLoss(check_targets=True)(logits, torch.where(targets == V, 0, targets))
    hidden = torch.randn(N, 16, device=DEVICE)
    with pytest.raises(ValueError, match=f"target {V} "):
        lce.linear_cross_entropy(hidden, torch.randn(V, 16, device=DEVICE), targets, check_targets=True)
    ck.cross_entropy(logits, torch.where(bad, 0, targets), check_targets=True)  # valid targets pass the check

    # The shared-memory kernel (16-bit logits) as well: NaN on the bad rows, exact zeros on the ignored one.
    if not SMEM_RUNS_HERE:
        return
    logits16 = torch.randn(N, 1008, device=DEVICE).to(torch.bfloat16)
    losses16, grad16 = ck.cross_entropy_forward(logits16, torch.where(targets == V, 1008, targets), reduction="none",
                                                kernel="smem", block_v=256)
    assert torch.all(torch.isnan(losses16[bad])) and torch.all(torch.isnan(grad16[bad]))
    assert torch.all(torch.isfinite(losses16[~bad])) and torch.all(torch.isfinite(grad16[~bad]))
    assert losses16[6] == 0 and torch.all(grad16[6] == 0), "the ignored row"


def test_out_of_range_targets_softcap():
    """The same with a softcap in bf16 on the row kernel, whose pass 2 takes every other chunk's exp2 on the FMA pipe
    (a clamp there must not turn the bad row's NaN into a number): NaN on the whole bad row, finite elsewhere."""
    N, V = 6, 1100  # several whole chunks on the CPU (256 wide) and a partial one
    logits = (torch.randn(N, V, device=DEVICE) * 3).to(torch.bfloat16)
    targets = make_targets((N,), V, 0.0).to(DEVICE)
    targets[1] = V + 3
    loss, grad = ck.cross_entropy_forward(logits, targets, reduction="none", softcap=5.0, kernel="rows")
    assert torch.isnan(loss[1]) and torch.all(torch.isnan(grad[1])), "the bad row must be NaN in every column"
    assert torch.all(torch.isfinite(loss[[0, 2, 3, 4, 5]])) and torch.all(torch.isfinite(grad[[0, 2, 3, 4, 5]]))


def test_target_term_reads_no_weight_out_of_bounds(monkeypatch):
    """The one-hot term of a row whose target is ignored or outside [0, V) addresses no class weight outside the
    weights' buffer. Here that buffer lies between +inf values: on the interpreter, an ignored row's out-of-bounds read
    would make inf * 0 (its smoothing term is 0), a RuntimeWarning and so a failure. Both kernels, with label smoothing
    and class weights (the only case that reads a weight per column), in bf16."""
    packed_weight = ck._packed_weight

    def fenced(weight):
        packed = packed_weight(weight)
        fence = torch.full((4096,), float("inf"), device=packed.device)
        return torch.cat([fence, packed, fence])[4096:4096 + packed.numel()]

    monkeypatch.setattr(ck, "_packed_weight", fenced)
    V = 1520
    logits = (torch.randn(9, V, device=DEVICE) * 3).to(torch.bfloat16)
    targets = make_targets((9,), V, 0.3).to(DEVICE)
    targets[0] = -7  # outside [0, V) and not ignore_index: a NaN row
    ignored = targets == -100
    for kernel in ["rows", "smem"] if SMEM_RUNS_HERE else ["rows"]:
        loss, grad = ck.cross_entropy_forward(logits, targets, reduction="none", label_smoothing=0.1,
                                              weight=class_weights(V, torch.bfloat16), kernel=kernel, block_v=256)
        assert torch.isnan(loss[0]) and torch.all(torch.isnan(grad[0])), kernel
        assert torch.all(loss[ignored] == 0) and torch.all(grad[ignored] == 0), kernel
        kept = ~ignored
        kept[0] = False
        assert torch.all(torch.isfinite(loss[kept])) and torch.all(torch.isfinite(grad[kept])), kernel


@pytest.mark.skipif(ON_GPU, reason="the CPU interpreter's model of cp.async; the GPU runs the real copies")
@pytest.mark.parametrize("wrong_wait", ["streamed", "kept"])
def test_cpu_model_of_async_copies_catches_a_short_wait(monkeypatch, wrong_wait):
    """On the CPU the shared-memory kernel's copies complete only at the wait_group that covers them (see the
    interpreter's stand-in), so the CPU tests check its schedule: here each streamed (or kept) chunk's wait allows one
    group more in flight than the schedule needs, the step reads its slot before the copy lands, and the loss is NaN.
    With the right counts, the same call matches the row kernel."""
    V = 1520
    logits = (torch.randn(7, V, device=DEVICE) * 3).to(torch.bfloat16)
    targets = torch.randint(0, V, (7,), device=DEVICE)
    kw = dict(reduction="none", kernel="smem", block_v=256, n_streamed=3, n_ring=2)
    expected, _ = ck.cross_entropy_forward(logits.clone(), targets, reduction="none", kernel="rows", block_v=256)
    loss, _ = ck.cross_entropy_forward(logits.clone(), targets, **kw)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    import cross_entropy_smem_kernel as smem  # the launcher has imported it for the call above

    if wrong_wait == "streamed":
        item_wait_count = smem._item_wait_count
        monkeypatch.setattr(smem, "_item_wait_count", lambda item, N, K, Q: item_wait_count(item, N, K, Q) + 1)
    else:
        async_copy = smem.async_copy

        class LateKeptWait:  # the waits for N - 1 groups (pass 1's for a kept chunk) allow one more in flight
            def __getattr__(self, name):
                return getattr(async_copy, name)

            @staticmethod
            def wait_group(num_outstanding):
                return async_copy.wait_group(num_outstanding + int(num_outstanding == n_chunks - 1))

        n_chunks = V // 256
        monkeypatch.setattr(smem, "async_copy", LateKeptWait())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN arithmetic on the interpreter
        loss, _ = ck.cross_entropy_forward(logits.clone(), targets, **kw)
    assert torch.isnan(loss).any(), "a read before its copy landed went unnoticed on the CPU"


def _bad_input_cases():
    x = torch.randn(4, 50, device=DEVICE)
    t = torch.randint(0, 50, (4,), device=DEVICE)
    h = torch.randn(4, 8, device=DEVICE)
    w = torch.randn(50, 8, device=DEVICE)
    return [
        ("1-D logits", ValueError, lambda: ck.cross_entropy(x[0], t[0])),
        ("4-D logits", ValueError, lambda: ck.cross_entropy(x.view(1, 1, 4, 50), t.view(1, 1, 4))),
        ("integer logits", TypeError, lambda: ck.cross_entropy(x.long(), t)),
        ("float targets", TypeError, lambda: ck.cross_entropy(x, t.float())),
        ("bool targets", TypeError, lambda: ck.cross_entropy(x, t > 3)),
        ("targets wrong shape", ValueError, lambda: ck.cross_entropy(x, t[:3])),
        ("targets [B, T] for [N, V]", ValueError, lambda: ck.cross_entropy(x, t.view(2, 2))),
        ("targets on another device", ValueError, lambda: ck.cross_entropy(x, t.to("meta"))),
        ("logits off the kernel device", ValueError, lambda: ck.cross_entropy(x.to("meta"), t.to("meta"))),
        ("unknown reduction", ValueError, lambda: ck.cross_entropy(x, t, reduction="avg")),
        ("label_smoothing > 1", ValueError, lambda: ck.cross_entropy(x, t, label_smoothing=1.5)),
        ("label_smoothing < 0", ValueError, lambda: ck.cross_entropy(x, t, label_smoothing=-0.1)),
        ("module: unknown reduction", ValueError, lambda: ck.TritonCrossEntropyLoss(reduction="batchmean")),
        ("vocabulary of size 0", ValueError, lambda: ck.cross_entropy(x[:, :0], t)),
        ("unknown kernel", ValueError, lambda: ck.cross_entropy_forward(x, t, kernel="fast")),
        ("linear: 1-D hidden", ValueError, lambda: lce.linear_cross_entropy(h[0], w, t[0])),
        ("linear: weight H mismatch", ValueError, lambda: lce.linear_cross_entropy(h, w[:, :7], t)),
        ("linear: weight dtype", TypeError, lambda: lce.linear_cross_entropy(h, w.double(), t)),
        ("linear: bias shape", ValueError,
         lambda: lce.linear_cross_entropy(h, w, t, bias=torch.randn(49, device=DEVICE))),
        ("linear: float targets", TypeError, lambda: lce.linear_cross_entropy(h, w, t.float())),
        ("linear: targets shape", ValueError, lambda: lce.linear_cross_entropy(h, w, t[:2])),
        ("linear: weight device", ValueError, lambda: lce.linear_cross_entropy(h, w.to("meta"), t)),
        ("linear: chunk_size 0", ValueError, lambda: lce.linear_cross_entropy(h, w, t, chunk_size=0)),
        ("linear: vocabulary of size 0", ValueError, lambda: lce.linear_cross_entropy(h, w[:0], t)),
        ("linear: unknown reduction", ValueError, lambda: lce.linear_cross_entropy(h, w, t, reduction="max")),
        ("linear module: label_smoothing", ValueError, lambda: lce.TritonLinearCrossEntropyLoss(label_smoothing=2.0)),
        # the extras
        ("weight of V - 1 classes", ValueError, lambda: ck.cross_entropy(x, t, weight=torch.rand(49, device=DEVICE))),
        ("weight [1, V]", ValueError, lambda: ck.cross_entropy(x, t, weight=torch.rand(1, 50, device=DEVICE))),
        ("integer weight", TypeError, lambda: ck.cross_entropy(x, t, weight=torch.ones(50, dtype=torch.long,
                                                                                       device=DEVICE))),
        ("weight not a tensor", TypeError, lambda: ck.cross_entropy(x, t, weight=[1.0] * 50)),
        ("weight on another device", ValueError, lambda: ck.cross_entropy(x, t, weight=torch.rand(50, device="meta"))),
        ("negative lse_square_scale", ValueError, lambda: ck.cross_entropy(x, t, lse_square_scale=-1e-4)),
        ("NaN lse_square_scale", ValueError, lambda: ck.cross_entropy(x, t, lse_square_scale=float("nan"))),
        ("infinite lse_square_scale", ValueError, lambda: ck.cross_entropy(x, t, lse_square_scale=float("inf"))),
        ("tensor lse_square_scale", TypeError, lambda: ck.cross_entropy(x, t, lse_square_scale=torch.tensor(0.1))),
        ("softcap 0", ValueError, lambda: ck.cross_entropy(x, t, softcap=0.0)),
        ("negative softcap", ValueError, lambda: ck.cross_entropy(x, t, softcap=-30.0)),
        ("infinite softcap", ValueError, lambda: ck.cross_entropy(x, t, softcap=float("inf"))),
        ("NaN softcap", ValueError, lambda: ck.cross_entropy(x, t, softcap=float("nan"))),
        ("softcap whose square underflows fp32", ValueError, lambda: ck.cross_entropy(x, t, softcap=1e-20)),
        ("softcap whose square overflows fp32", ValueError, lambda: ck.cross_entropy(x, t, softcap=1e20)),
        ("lse_square_scale beyond fp32", ValueError, lambda: ck.cross_entropy(x, t, lse_square_scale=1e39)),
        ("uint8 targets", TypeError, lambda: ck.cross_entropy(x, t.to(torch.uint8))),
        ("int16 targets", TypeError, lambda: ck.cross_entropy(x, t.to(torch.int16))),
        ("label_smoothing a string", TypeError, lambda: ck.cross_entropy(x, t, label_smoothing="0.1")),
        ("linear: bias a list", TypeError, lambda: lce.linear_cross_entropy(h, w, t, bias=[0.0] * 50)),
        ("return flag not a bool", TypeError, lambda: ck.cross_entropy(x, t, return_token_accuracy=1)),
        ("launcher: weight shape", ValueError,
         lambda: ck.cross_entropy_forward(x, t, weight=torch.rand(5, device=DEVICE))),
        ("module: softcap", ValueError, lambda: ck.TritonCrossEntropyLoss(softcap=-1.0)),
        ("module: integer weight", TypeError,
         lambda: ck.TritonCrossEntropyLoss(weight=torch.ones(50, dtype=torch.int))),
        ("module: return flag", TypeError, lambda: ck.TritonCrossEntropyLoss(return_z_loss="yes")),
        ("linear: ce_weight shape", ValueError,
         lambda: lce.linear_cross_entropy(h, w, t, ce_weight=torch.rand(8, device=DEVICE))),
        ("linear: ce_weight dtype", TypeError,
         lambda: lce.linear_cross_entropy(h, w, t, ce_weight=torch.ones(50, dtype=torch.bool, device=DEVICE))),
        ("linear: lse_square_scale", ValueError, lambda: lce.linear_cross_entropy(h, w, t, lse_square_scale=-1.0)),
        ("linear: softcap", ValueError, lambda: lce.linear_cross_entropy(h, w, t, softcap=0)),
        ("linear module: lse_square_scale", ValueError,
         lambda: lce.TritonLinearCrossEntropyLoss(lse_square_scale=float("nan"))),
        ("linear: accum_dtype fp16", ValueError, lambda: lce.linear_cross_entropy(h, w, t, accum_dtype=torch.float16)),
        ("linear: accum_dtype a string", TypeError, lambda: lce.linear_cross_entropy(h, w, t, accum_dtype="float32")),
        ("linear: use_token_scaling 1", TypeError, lambda: lce.linear_cross_entropy(h, w, t, use_token_scaling=1)),
        ("linear module: accum_dtype", ValueError,
         lambda: lce.TritonLinearCrossEntropyLoss(accum_dtype=torch.float64)),
    ] + ([  # on a GPU machine the kernels run on CUDA: CPU tensors must be refused, not sent to a GPU kernel
        ("CPU logits with CUDA kernels", ValueError, lambda: ck.cross_entropy(x.cpu(), t.cpu())),
        ("CPU targets with CUDA logits", ValueError, lambda: ck.cross_entropy(x, t.cpu())),
        ("linear: CPU inputs with CUDA kernels", ValueError,
         lambda: lce.linear_cross_entropy(h.cpu(), w.cpu(), t.cpu())),
        ("CPU class weights with CUDA logits", ValueError, lambda: ck.cross_entropy(x, t, weight=torch.rand(50))),
    ] if ON_GPU else [])


def test_bad_inputs():
    for name, error, call in _bad_input_cases():
        with pytest.raises(error):
            call()
        try:
            call()
        except error as exc:
            assert len(str(exc)) > 10, f"{name}: error message too terse: {exc}"
            assert str(exc).split(":")[0] in ("cross_entropy", "cross_entropy_forward", "linear_cross_entropy",
                                              "TritonCrossEntropyLoss", "TritonLinearCrossEntropyLoss"), \
                f"{name}: the message should start with the function's name: {exc}"


@pytest.mark.parametrize("module, argv", [(ck, ["--vocab", "0"]), (ck, ["--rows", "-1"]), (lce, ["--hidden", "0"]),
                                          (lce, ["--vocab", "0"])],
                         ids=["ce-vocab", "ce-rows", "lce-hidden", "lce-vocab"])
def test_kernel_script_refuses_bad_sizes(module, argv, capsys):
    """Run as a script, a kernel file answers a size it cannot run with one usage error (exit code 2)."""
    with pytest.raises(SystemExit) as exit_info:
        module._main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(0,), (2, 0)], ids=["N=0", "B=2,T=0"])
def test_empty_input(reduction, shape):
    """No rows at all: PyTorch's answers (mean NaN, sum 0, none an empty tensor of the targets' shape) and gradients
    of the inputs' shapes, for cross_entropy and linear_cross_entropy."""
    V, H = 50, 8
    targets = torch.empty(shape, dtype=torch.int64, device=DEVICE)
    logits = torch.randn(*shape, V, device=DEVICE, requires_grad=True)
    ref = F.cross_entropy(logits.detach().reshape(-1, V), targets.reshape(-1), reduction=reduction)
    loss = ck.cross_entropy(logits, targets, reduction=reduction)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    hidden = torch.randn(*shape, H, device=DEVICE, requires_grad=True)
    weight = torch.randn(V, H, device=DEVICE, requires_grad=True)
    linear_loss = lce.linear_cross_entropy(hidden, weight, targets, reduction=reduction)
    dh, dw = torch.autograd.grad(linear_loss.sum(), (hidden, weight))
    for value in (loss, linear_loss):
        assert value.dtype == torch.float32
        if reduction == "mean":
            assert value.shape == () and torch.isnan(value) and torch.isnan(ref), f"mean over no rows: {value}"
        elif reduction == "sum":
            assert value.shape == () and value == 0 and ref == 0, f"sum over no rows: {value}"
        else:
            assert value.shape == shape and ref.numel() == 0, f"none: shape {tuple(value.shape)}"
    assert grad.shape == logits.shape and dh.shape == hidden.shape and dw.shape == weight.shape
    assert torch.all(dw == 0), "no rows: the weight gradient is zero"
    # With the extras: the z-loss reduces like the loss, the token accuracy of no row is NaN (0 / 0) or empty.
    extras = dict(weight=torch.rand(V, device=DEVICE), lse_square_scale=1e-3, softcap=5.0, return_z_loss=True,
                  return_token_accuracy=True, return_predicted_tokens=True)
    for out in (ck.cross_entropy(logits, targets, reduction=reduction, **extras),
                lce.linear_cross_entropy(hidden, weight, targets, reduction=reduction,
                                        ce_weight=extras.pop("weight"), **extras)):
        assert out.predicted_tokens.shape == shape and out.z_loss.shape == out.loss.shape
        if reduction == "none":
            assert out.token_accuracy.shape == shape and out.z_loss.shape == shape
        else:
            assert torch.isnan(out.token_accuracy) and torch.isnan(out.z_loss) == (reduction == "mean")


# ----------------------------------------------------------------------------------------------------------------------
# The launcher's choice of kernel, with the properties of real GPUs (no GPU needed)
# ----------------------------------------------------------------------------------------------------------------------
def gpu_properties(major, minor, shared_kib, sms):
    """What torch.cuda.get_device_properties reports, for the fields the launcher reads."""
    return SimpleNamespace(major=major, minor=minor, shared_memory_per_block_optin=shared_kib * 1024,
                           multi_processor_count=sms)


GPUS = {  # compute capability, opt-in shared memory per block (KiB), multiprocessors
    "A100": gpu_properties(8, 0, 163, 108),
    "H100": gpu_properties(9, 0, 227, 132),
    "H200": gpu_properties(9, 0, 227, 132),
    "B200": gpu_properties(10, 0, 227, 148),
    "GB300": gpu_properties(10, 3, 227, 160),
    "RTX5090": gpu_properties(12, 0, 99, 170),
}


@pytest.mark.parametrize("gpu", list(GPUS))
def test_dispatch_rule(gpu):
    """The shared-memory kernel runs only on compute capability 9.x (where it was verified); every other GPU takes
    the row kernel, even with as much shared memory (Blackwell). LLaMA-3 shape: 16384 x 128256 bf16 with a gradient."""
    properties = GPUS[gpu]
    plan = ck._pick_smem_plan(128256, 2, 16384, True, True, properties)
    if properties.major == 9:
        assert plan == (8192, 32, 15, 4, 2), plan  # 8192-wide chunks, 32 warps, 15 chunks, K = 4 streamed, Q = 2
    else:
        assert plan is None, f"{gpu}: the row kernel must run, got the shared-memory plan {plan}"
        with pytest.raises(ValueError, match="does not apply"):  # and it cannot be forced there
            ck._pick_smem_plan(128256, 2, 16384, True, True, properties, kernel="smem")
    # Whatever the GPU: kernel="rows" forces the row kernel.
    assert ck._pick_smem_plan(128256, 2, 16384, True, True, properties, kernel="rows") is None


def test_dispatch_extras():
    """Launches with extras take the shared-memory kernel, except with a softcap: the row kernel then (forcing the
    shared-memory kernel still works). Checked on the plan, and end to end on this machine's kernels."""
    h200 = GPUS["H200"]
    assert ck._pick_smem_plan(128256, 2, 16384, True, True, h200) == (8192, 32, 15, 4, 2)
    assert ck._pick_smem_plan(128256, 2, 16384, True, True, h200, softcap=True) is None
    assert ck._pick_smem_plan(128256, 2, 16384, True, True, h200, kernel="smem", softcap=True) is not None
    check_extras("bf16", (9, 1520), "mean", 0.2, weight=True, lse_square_scale=1e-2, softcap=4.0,
                 returns=("z", "acc", "pred"), block_v=256)


def test_dispatch_row_kernel_cases(monkeypatch):
    """On an H200, what still goes to the row kernel: fp32 logits, the loss alone, rows not 16-byte aligned, fewer
    than 8 rows per multiprocessor (the linear cross-entropy's 768-row chunks), a vocabulary under two chunks, and a
    Triton whose Gluon lacks a name the shared-memory kernel uses."""
    h200 = GPUS["H200"]
    assert ck._pick_smem_plan(128256, 4, 16384, True, True, h200) is None  # fp32
    assert ck._pick_smem_plan(128256, 2, 16384, False, True, h200) is None  # loss only
    assert ck._pick_smem_plan(128256, 2, 16384, True, False, h200) is None  # misaligned rows (e.g. V = 50257)
    assert ck._pick_smem_plan(128256, 2, 768, True, True, h200) is None  # 768 < 8 * 132 rows
    assert ck._pick_smem_plan(128256, 2, 8 * 132, True, True, h200) is not None
    assert ck._pick_smem_plan(16000, 2, 16384, True, True, h200) is None  # one 8192-wide chunk
    # A larger vocabulary (151936: 18 chunks) streams more chunks so that the kept ones fit: 11 kept + 2 ring slots.
    assert ck._pick_smem_plan(151936, 2, 16384, True, True, h200)[2:] == (18, 7, 2)
    monkeypatch.setattr(ck, "_missing_gluon_names", lambda: ("triton.experimental.gluon.language.barrier",))
    assert ck._pick_smem_plan(128256, 2, 16384, True, True, h200) is None


def test_gluon_gate_lists_every_name_the_kernel_uses():
    """The dispatch gates the shared-memory kernel on the Gluon names it uses (_GLUON_NAMES, plus the barrier under
    either of its names): every gl.*, async_copy.* and gluon.* name in cross_entropy_smem_kernel.py must be listed."""
    lines = (Path(ck.__file__).parent / "cross_entropy_smem_kernel.py").read_text().splitlines()
    source = "\n".join(line for line in lines if not re.match(r"\s*(from|import) ", line))
    listed = {(module.rsplit(".", 1)[-1], name) for module, names in ck._GLUON_NAMES.items() for name in names}
    aliases = {"language": "gl", "async_copy": "async_copy", "gluon": "gluon"}
    listed = {(aliases[module], name) for module, name in listed}
    used = {(prefix, name) for prefix, name in re.findall(r"\b(gl|async_copy|gluon)\.(\w+)", source)}
    used -= {("gl", "barrier"), ("gl", "thread_barrier")}
    assert used and used <= listed, f"not checked by the dispatch: {sorted(used - listed)}"


def test_gluon_gate_reports_what_is_missing(monkeypatch):
    """_missing_gluon_names (uncached here) names each missing name, and every name of a module that cannot be
    imported: the dispatch then takes the row kernel (see test_dispatch_row_kernel_cases)."""
    names = dict(ck._GLUON_NAMES)
    names["triton.experimental.gluon.language"] += ("no_such_name",)
    names["triton.experimental.gluon.no_such_module"] = ("a", "b")
    monkeypatch.setattr(ck, "_GLUON_NAMES", names)
    assert ck._missing_gluon_names.__wrapped__() == ("triton.experimental.gluon.language.no_such_name",
                                                     "triton.experimental.gluon.no_such_module.a",
                                                     "triton.experimental.gluon.no_such_module.b")


# ----------------------------------------------------------------------------------------------------------------------
# Fused linear cross-entropy against float64 F.linear + F.cross_entropy
# ----------------------------------------------------------------------------------------------------------------------
LCE_CASES = [
    case(dtype="fp32", hidden_shape=(40, 24), V=300, reduction="mean", ignore_frac=0.2, bias=True, chunk_size=17),
    case(dtype="bf16", hidden_shape=(40, 24), V=300, reduction="mean", ignore_frac=0.2, chunk_size=None),
    case(dtype="bf16", hidden_shape=(40, 24), V=300, reduction="sum", ignore_frac=0.2, chunk_size=16, upstream=2.5),
    case(dtype="fp32", hidden_shape=(30, 16), V=200, reduction="none", ignore_frac=0.2, bias=True, chunk_size=7),
    case(dtype="bf16", hidden_shape=(30, 16), V=200, reduction="none", ignore_frac=0.2, chunk_size=12),
    case(dtype="bf16", hidden_shape=(24, 16), V=300, reduction="mean", ignore_frac=0.0, chunk_size=10),
    case(dtype="fp32", hidden_shape=(16, 16), V=100, reduction="mean", ignore_frac=1.0, bias=True, chunk_size=5),
    case(dtype="bf16", hidden_shape=(32, 16), V=500, reduction="mean", ignore_frac=0.25, chunk_size=11,
         label_smoothing=0.1),
    case(dtype="bf16", hidden_shape=(32, 16), V=300, reduction="mean", ignore_frac=0.2, chunk_size=9,
         weight_grad=False),
    case(dtype="fp32", hidden_shape=(32, 16), V=300, reduction="sum", ignore_frac=0.2, chunk_size=9,
         hidden_grad=False, bias=True),
    case(dtype="bf16", hidden_shape=(2, 13, 24), V=300, reduction="mean", ignore_frac=0.2, chunk_size=10,
         use_module=True),
    case(dtype="fp16", hidden_shape=(2, 9, 16), V=260, reduction="none", ignore_frac=0.2, chunk_size=8),
    case(dtype="fp32", hidden_shape=(3, 7, 16), V=200, reduction="none", ignore_frac=0.2, chunk_size=4,
         upstream="expanded"),
]


def lce_case_id(c):
    keys = [c["dtype"], "x".join(map(str, c["hidden_shape"])), f"V{c['V']}", c["reduction"], f"ign{c['ignore_frac']}"]
    keys += [f"{k}={v}" for k, v in c.items() if k not in ("dtype", "hidden_shape", "V", "reduction", "ignore_frac")]
    return "-".join(str(k) for k in keys)


def _linear_ce(h, w, b, targets, grad_output, kwargs, ours=False, chunk_size=None, use_module=False):
    """Loss and gradients (dh, dW, db; None where not required) of our fused op or of eager F.linear+F.cross_entropy."""
    inputs = [x for x in (h, w, b) if x is not None and x.requires_grad]
    if ours and use_module:
        loss = lce.TritonLinearCrossEntropyLoss(chunk_size=chunk_size, **kwargs)(h, w, targets, b)
    elif ours:
        loss = lce.linear_cross_entropy(h, w, targets, b, chunk_size=chunk_size, **kwargs)
    else:
        logits = F.linear(h, w, b)
        loss = F.cross_entropy(logits.reshape(-1, w.shape[0]), targets.reshape(-1).long(), **kwargs)
        if kwargs["reduction"] == "none":
            loss = loss.view(targets.shape)
    grads = iter(torch.autograd.grad(loss, inputs, grad_output.to(loss.dtype)))
    return loss.detach(), [next(grads) if x is not None and x.requires_grad else None for x in (h, w, b)]


def check_linear_cross_entropy(dtype, hidden_shape, V, reduction, ignore_frac, bias=False, chunk_size=None,
                               label_smoothing=0.0, weight_grad=True, hidden_grad=True, upstream=1.0,
                               use_module=False):
    dtype = DTYPES[dtype]
    H = hidden_shape[-1]
    hidden = torch.randn(hidden_shape, device=DEVICE).to(dtype)
    weight = (torch.randn(V, H, device=DEVICE) * 2 / H**0.5).to(dtype)
    bias_values = torch.randn(V, device=DEVICE).to(dtype) if bias else None
    targets = make_targets(hidden_shape[:-1], V, ignore_frac).to(DEVICE)
    kwargs = dict(reduction=reduction, label_smoothing=label_smoothing)
    if reduction == "none" and upstream == "expanded":
        grad_output = torch.ones((), device=DEVICE).expand(hidden_shape[:-1])
    elif reduction == "none":
        grad_output = torch.randn(hidden_shape[:-1], device=DEVICE)
    else:
        grad_output = torch.tensor(upstream, device=DEVICE)

    def leaves(target_dtype):
        flags = (hidden_grad, weight_grad, True)
        return [None if x is None else x.to(target_dtype).requires_grad_(flag)
                for x, flag in zip((hidden, weight, bias_values), flags)]

    ref_loss, ref_grads = _linear_ce(*leaves(torch.float64), targets, grad_output.double(), kwargs)
    eager_loss, eager_grads = _linear_ce(*leaves(dtype), targets, grad_output, kwargs)
    loss, grads = _linear_ce(*leaves(dtype), targets, grad_output, kwargs, ours=True, chunk_size=chunk_size,
                             use_module=use_module)

    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape, f"loss {loss.dtype} {tuple(loss.shape)}"
    for name, ours, ref in zip(("dh", "dW", "db"), grads, ref_grads):
        assert (ours is None) == (ref is None), f"{name}: computed {ours is not None}, expected {ref is not None}"
        if ours is not None:
            assert ours.dtype == dtype and ours.shape == ref.shape, f"{name}: {ours.dtype} {tuple(ours.shape)}"
    ignored = targets == -100
    if grads[0] is not None:
        assert torch.all(grads[0][ignored] == 0), "dh of ignored rows must be exactly zero"
    if bool(ignored.all()):
        if reduction == "mean":
            assert torch.isnan(loss) and torch.isnan(ref_loss)
        for ours in grads:
            assert ours is None or torch.all(ours == 0), "all rows ignored: every gradient must be zero"
        return

    # The loss inherits the rounding of the dtype's logits (the matmul output), which eager shares: same rule.
    assert_no_worse("loss", rel_err(loss, ref_loss), rel_err(eager_loss, ref_loss), LOSS_FP32_TOL)
    for name, ours, eager, ref in zip(("dh", "dW", "db"), grads, eager_grads, ref_grads):
        if ours is not None:
            assert_no_worse(name, rel_err(ours, ref), rel_err(eager, ref), GRAD_FLOOR[dtype])


@pytest.mark.parametrize("params", LCE_CASES, ids=[lce_case_id(c) for c in LCE_CASES])
def test_linear_cross_entropy_matches_float64(params):
    check_linear_cross_entropy(**params)


def test_linear_dw_accumulation():
    """dW in bf16 is rounded once per chunk (16 chunks here); measure its error against eager's single rounding."""
    N, H, V = 256, 32, 200
    hidden = torch.randn(N, H, device=DEVICE).to(torch.bfloat16)
    weight = (torch.randn(V, H, device=DEVICE) / H**0.5).to(torch.bfloat16)
    targets = make_targets((N,), V, 0.1).to(DEVICE)
    kwargs = dict(reduction="mean", label_smoothing=0.0)
    one = torch.tensor(1.0, device=DEVICE)
    _, (_, ref_dw, _) = _linear_ce(hidden.double().requires_grad_(), weight.double().requires_grad_(), None, targets,
                                   one.double(), kwargs)
    _, (_, eager_dw, _) = _linear_ce(hidden.clone().requires_grad_(), weight.clone().requires_grad_(), None, targets,
                                     one, kwargs)
    _, (_, dw, _) = _linear_ce(hidden.clone().requires_grad_(), weight.clone().requires_grad_(), None, targets, one,
                               kwargs, ours=True, chunk_size=16)
    err, eager_err = rel_err(dw, ref_dw), rel_err(eager_dw, ref_dw)
    assert_no_worse("dW over 16 chunks", err, eager_err, GRAD_FLOOR[torch.bfloat16])


def test_linear_chunk_rows():
    """The default chunk: LCE_CHUNK_ROWS rows, fewer (a multiple of 64, at least 64) where they would hold more than
    LCE_CHUNK_BUDGET_BYTES of logits, never more than N."""
    budget, rows = lce.LCE_CHUNK_BUDGET_BYTES, lce.LCE_CHUNK_ROWS
    assert lce._lce_chunk_rows(16384, 32768, 2, None) == rows  # a small vocabulary: the row count decides
    assert rows * 128256 * 2 <= budget  # LLaMA-3's vocabulary still gets all of them
    large = lce._lce_chunk_rows(16384, 262144, 2, None)  # Gemma's: the budget decides
    assert large % 64 == 0 and large * 262144 * 2 <= budget < (large + 64) * 262144 * 2, large
    assert lce._lce_chunk_rows(16384, 10**9, 2, None) == 64  # a huge vocabulary still gets 64 rows
    assert lce._lce_chunk_rows(100, 1000, 4, None) == 100  # small inputs: one chunk
    assert lce._lce_chunk_rows(100, 1000, 4, 33) == 33 and lce._lce_chunk_rows(10, 1000, 4, 33) == 10


def test_linear_no_grad_and_errors():
    """No grad anywhere: loss only; the backward runs once (it scales stored gradients in place)."""
    hidden = torch.randn(12, 16, device=DEVICE)
    weight = torch.randn(100, 16, device=DEVICE)
    targets = make_targets((12,), 100, 0.2).to(DEVICE)
    ref = F.cross_entropy(F.linear(hidden.double(), weight.double()), targets)
    loss = lce.linear_cross_entropy(hidden, weight, targets, chunk_size=5)
    assert not loss.requires_grad and rel_err(loss, ref) <= LOSS_FP32_TOL
    loss = lce.linear_cross_entropy(hidden.requires_grad_(), weight, targets, chunk_size=5)
    torch.autograd.grad(loss, hidden, retain_graph=True)
    with pytest.raises(RuntimeError, match="can run once"):
        torch.autograd.grad(loss, hidden)


# ----------------------------------------------------------------------------------------------------------------------
# Extras (class weights, z-loss, softcap, token accuracy, predicted tokens) against float64 PyTorch
# ----------------------------------------------------------------------------------------------------------------------
RETURN_FLAGS = {"z": "return_z_loss", "acc": "return_token_accuracy", "pred": "return_predicted_tokens"}


def extras_loss(logits, targets, weight=None, lse_square_scale=0.0, softcap=None, ignore_index=-100,
                reduction="mean", label_smoothing=0.0, use_token_scaling=False):
    """The extras in PyTorch, differentiable, in the logits' dtype: F.cross_entropy (its own class weights and label
    smoothing) on softcap * tanh(logits / softcap), plus Liger's z-loss (lse_square_scale * logsumexp^2 per
    non-ignored row, reduced like the loss, unweighted, "mean" over the non-ignored rows). use_token_scaling (Liger's
    linear cross-entropy): each row's cross-entropy and z-loss times p = softmax(capped logits)[target], detached, 0
    on ignored rows; the means' denominators stay the same. Returns (loss, z_loss, argmax per row or -1 where
    ignored)."""
    V = logits.shape[-1]
    capped = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    rows, flat_targets = capped.reshape(-1, V), targets.reshape(-1).long()
    valid = flat_targets != ignore_index
    class_weight = None if weight is None else weight.to(logits.dtype)
    ce_options = dict(weight=class_weight, ignore_index=ignore_index, label_smoothing=label_smoothing)
    z_rows = torch.where(valid, lse_square_scale * torch.logsumexp(rows, dim=-1) ** 2, 0.0)
    if use_token_scaling:
        p = rows.detach().softmax(dim=-1).gather(-1, flat_targets.clamp_min(0)[:, None]).squeeze(-1)
        p = torch.where(valid, p, 0.0)
        ce_rows, z_rows = F.cross_entropy(rows, flat_targets, reduction="none", **ce_options) * p, z_rows * p
        counted = valid.sum() if weight is None else class_weight[flat_targets[valid]].sum()
        ce = {"mean": ce_rows.sum() / counted, "sum": ce_rows.sum(), "none": ce_rows}[reduction]
    else:
        ce = F.cross_entropy(rows, flat_targets, reduction=reduction, **ce_options)
    z_loss = {"mean": z_rows.sum() / valid.sum(), "sum": z_rows.sum(), "none": z_rows}[reduction]
    if reduction == "none":
        ce, z_loss = ce.view(targets.shape), z_loss.view(targets.shape)
    predicted = torch.where(targets != ignore_index, capped.detach().argmax(dim=-1), -1)
    return ce + z_loss, z_loss.detach(), predicted


def reference_extras(logits, targets, grad_output, dtype, **options):
    """extras_loss on logits converted to `dtype`: (loss, grad of logits, z_loss, predicted)."""
    x = logits.detach().to(dtype).requires_grad_()
    loss, z_loss, predicted = extras_loss(x, targets, **options)
    loss.backward(grad_output.to(dtype))
    return loss.detach(), x.grad, z_loss, predicted


def untie(values):
    """Raise each row's largest value by 1 (in place, rounded to the dtype): a unique argmax, so that the predicted
    tokens have one right answer."""
    rows = values.view(-1, values.shape[-1])
    index = torch.arange(rows.shape[0], device=rows.device)
    top = rows.float().argmax(dim=-1)
    rows[index, top] = (rows[index, top].float() + 1.0).to(rows.dtype)
    return values


def plant_argmax(targets, values, ignore_index=-100):
    """Every other non-ignored row's target becomes its argmax, so that the token accuracy is neither 0 nor 1."""
    flat = targets.view(-1)
    kept = (flat != ignore_index).nonzero().flatten()[::2]
    flat[kept] = values.reshape(-1, values.shape[-1]).float().argmax(dim=-1)[kept].to(flat.dtype)
    return targets


def class_weights(V, dtype, signed=False):
    """Random class weights exact in `dtype`, so that PyTorch in that dtype and our fp32 copy use the same values."""
    w = torch.rand(V, device=DEVICE) * 2 + (-0.5 if signed else 0.1)
    return w.to(dtype).to(torch.float32)


def check_output_fields(out, returns):
    if not returns:
        assert isinstance(out, torch.Tensor), f"no return_* flag: a tensor, got {type(out).__name__}"
        return out
    assert isinstance(out, ck.CrossEntropyOutput), f"a return_* flag: a CrossEntropyOutput, got {type(out).__name__}"
    for key, field in (("z", "z_loss"), ("acc", "token_accuracy"), ("pred", "predicted_tokens")):
        assert (getattr(out, field) is None) == (key not in returns), f"{field} should be None iff not asked for"
        if key in returns and field != "predicted_tokens":
            assert getattr(out, field).dtype == torch.float32 and not getattr(out, field).requires_grad, field
    if "pred" in returns:
        assert out.predicted_tokens.dtype == torch.int64
    return out.loss


def check_extra_outputs(out, returns, reduction, targets, ref_z, ref_predicted, lse_square_scale, predicted_ok=None,
                        eager_z=None):
    """z_loss, token_accuracy and predicted_tokens against the reference. predicted_ok: the rows whose argmax is
    unambiguous (all by default); eager_z: PyTorch's z-loss from the same rounded logits, where ours has them too
    (the linear cross-entropy's matmul output)."""
    valid = targets != -100
    if "z" in returns:
        assert out.z_loss.shape == ref_z.shape
        if lse_square_scale == 0 or not bool(valid.any()):
            assert torch.equal(torch.isnan(out.z_loss), torch.isnan(ref_z)), f"z_loss {out.z_loss} vs {ref_z}"
            assert torch.all((out.z_loss == 0) | torch.isnan(out.z_loss))
        elif eager_z is None:
            assert rel_err(out.z_loss, ref_z) <= LOSS_FP32_TOL
        else:
            assert_no_worse("z_loss", rel_err(out.z_loss, ref_z), rel_err(eager_z, ref_z), LOSS_FP32_TOL)
    predicted = out.predicted_tokens if "pred" in returns else None
    if predicted is not None:
        ok = torch.ones_like(valid) if predicted_ok is None else predicted_ok | ~valid
        assert predicted.shape == targets.shape
        assert torch.equal(predicted[ok], ref_predicted[ok]), "predicted tokens differ from the reference argmax"
        assert torch.all(predicted[~valid] == -1), "ignored rows predict -1"
    if "acc" in returns:
        if predicted is None:
            predicted = ref_predicted
        correct = ((predicted == targets) & valid).float()
        expected = correct if reduction == "none" else correct.sum() / valid.sum()
        assert out.token_accuracy.shape == expected.shape
        assert torch.allclose(out.token_accuracy, expected, rtol=1e-6, atol=0, equal_nan=True), \
            f"token accuracy {out.token_accuracy} != {expected}"
        if reduction != "none" and bool(valid.any()):
            assert 0 < out.token_accuracy < 1, "the planted targets make the accuracy neither 0 nor 1"


EXTRA_CASES = [
    # each extra alone, with 20 % ignored rows, by dtype, reduction and kernel (chunk widths as in CE_CASES)
    case(dtype="bf16", shape=(10, 1000), reduction="mean", ignore_frac=0.2, weight=True),
    case(dtype="fp32", shape=(3, 4, 700), reduction="none", ignore_frac=0.2, weight=True),
    case(dtype="bf16", shape=(9, 1520), reduction="sum", ignore_frac=0.2, weight="signed", kernel="smem",
         block_v=256, n_streamed=3, n_ring=2),
    case(dtype="bf16", shape=(10, 1000), reduction="mean", ignore_frac=0.2, lse_square_scale=1e-2, returns=("z",)),
    case(dtype="fp32", shape=(8, 257), reduction="sum", ignore_frac=0.2, lse_square_scale=1e-3, returns=("z",)),
    case(dtype="bf16", shape=(2, 5, 1008), reduction="none", ignore_frac=0.2, lse_square_scale=1e-2, returns=("z",),
         kernel="smem", block_v=256, n_streamed=2, n_ring=1),
    case(dtype="fp32", shape=(10, 1000), reduction="mean", ignore_frac=0.2, softcap=5.0),
    case(dtype="bf16", shape=(9, 1520), reduction="mean", ignore_frac=0.2, softcap=3.0, kernel="smem", block_v=256,
         n_streamed=3, n_ring=2),
    case(dtype="fp16", shape=(2, 6, 600), reduction="none", ignore_frac=0.2, softcap=4.0, kernel="rows", block_v=128),
    # a large softcap makes tanh's argument small, where 1 - 2 / (exp(2z) + 1) cancels (fp32 logits take that form)
    case(dtype="fp32", shape=(8, 300), reduction="mean", ignore_frac=0.2, softcap=1e3, kernel="rows", block_v=128),
    case(dtype="fp32", shape=(2, 3, 520), reduction="none", ignore_frac=0.2, softcap=1e5),
    case(dtype="bf16", shape=(12, 1000), reduction="mean", ignore_frac=0.2, returns=("acc", "pred")),
    case(dtype="fp32", shape=(3, 4, 300), reduction="none", ignore_frac=0.25, returns=("acc",)),
    case(dtype="bf16", shape=(13, 2000), reduction="sum", ignore_frac=0.2, returns=("acc", "pred"), kernel="smem",
         block_v=256, n_streamed=5, n_ring=3),
    # with label smoothing: class weights change its term (sum_j w_j (lse - x_j)), and the others must compose
    case(dtype="fp32", shape=(10, 900), reduction="mean", ignore_frac=0.25, label_smoothing=0.1, weight=True),
    case(dtype="bf16", shape=(9, 1520), reduction="mean", ignore_frac=0.25, label_smoothing=0.1, weight=True,
         kernel="smem", block_v=256, n_streamed=2, n_ring=2),
    case(dtype="bf16", shape=(10, 900), reduction="sum", ignore_frac=0.25, label_smoothing=0.2, softcap=4.0,
         lse_square_scale=1e-2, returns=("z",)),
    # everything at once (mean divides the cross-entropy by sum w[target] and the z-loss by the row count), both
    # kernels, a gradient from upstream, in place, 3-D, the module
    *[case(dtype=d, shape=(9, 1520), reduction=r, ignore_frac=0.25, label_smoothing=0.1, weight=True,
           lse_square_scale=1e-2, softcap=4.0, returns=("z", "acc", "pred"), kernel=k, block_v=256, upstream=u,
           **({"n_streamed": 3, "n_ring": 2} if k == "smem" else {}))
      for d, r, k, u in (("bf16", "mean", "smem", -1.5), ("bf16", "none", "smem", 1.0), ("fp32", "mean", "rows", 2.0),
                         ("bf16", "sum", "rows", 1.0))],
    case(dtype="bf16", shape=(3, 5, 1104), reduction="mean", ignore_frac=0.2, weight=True, lse_square_scale=1e-2,
         softcap=5.0, returns=("z", "acc", "pred"), kernel="smem", block_v=256, n_streamed=2, n_ring=1, inplace=True),
    case(dtype="bf16", shape=(2, 6, 700), reduction="mean", ignore_frac=0.2, weight=True, lse_square_scale=1e-2,
         softcap=5.0, returns=("z", "acc", "pred"), inplace=True),
    case(dtype="bf16", shape=(10, 800), reduction="mean", ignore_frac=0.2, weight=True, lse_square_scale=1e-2,
         returns=("acc",), use_module=True),
    # every row ignored: mean NaN (loss, z-loss, accuracy), sum 0, predicted -1, gradients 0
    *[case(dtype=d, shape=(8, 1008), reduction=r, ignore_frac=1.0, weight=True, lse_square_scale=1e-2, softcap=4.0,
           label_smoothing=0.1, returns=("z", "acc", "pred"), kernel=k, block_v=256,
           **({"n_streamed": 1, "n_ring": 1} if k == "smem" else {}))
      for d, r, k in (("bf16", "mean", "smem"), ("fp32", "sum", "rows"), ("bf16", "none", "rows"))],
    # z_loss asked for with lse_square_scale = 0: zeros, as in Liger
    case(dtype="fp32", shape=(6, 300), reduction="mean", ignore_frac=0.2, returns=("z",)),
]


def check_extras(dtype, shape, reduction, ignore_frac, weight=False, lse_square_scale=0.0, softcap=None, returns=(),
                 label_smoothing=0.0, kernel=None, block_v=None, n_streamed=None, n_ring=None, inplace=False,
                 upstream=1.0, use_module=False):
    """One case of EXTRA_CASES: loss, gradient and the returned extras against the float64 reference."""
    if kernel == "smem" and not SMEM_RUNS_HERE:
        pytest.skip("the shared-memory kernel runs only on compute capability 9.x GPUs (and the CPU interpreter)")
    dtype = DTYPES[dtype]
    V = shape[-1]
    values = untie((torch.randn(shape, device=DEVICE) * 3).to(dtype))
    targets = plant_argmax(make_targets(shape[:-1], V, ignore_frac).to(DEVICE), values)
    w = class_weights(V, dtype, signed=weight == "signed") if weight else None
    kwargs = dict(reduction=reduction, label_smoothing=label_smoothing)
    extras = dict(weight=w, lse_square_scale=lse_square_scale, softcap=softcap,
                  **{flag: key in returns for key, flag in RETURN_FLAGS.items()})
    if reduction == "none":
        grad_output = torch.randn(shape[:-1], device=DEVICE)
    else:
        grad_output = torch.tensor(upstream, device=DEVICE)
    options = dict(weight=w, lse_square_scale=lse_square_scale, softcap=softcap, **kwargs)
    ref_loss, ref_grad, ref_z, ref_predicted = reference_extras(values, targets, grad_output, torch.float64, **options)
    _, torch_grad, _, _ = reference_extras(values, targets, grad_output, dtype, **options)

    leaf = values.clone().requires_grad_()
    if block_v is not None or kernel is not None:
        out, grad = ck.cross_entropy_forward(leaf.detach(), targets, compute_grad=True, inplace_backward=inplace,
                                             kernel=kernel, block_v=block_v, n_streamed=n_streamed, n_ring=n_ring,
                                             **kwargs, **extras)
        grad = ck.cross_entropy_backward(grad, grad_output)
    else:
        if use_module:
            out = ck.TritonCrossEntropyLoss(inplace_backward=inplace, **kwargs, **extras)(leaf, targets)
        else:
            out = ck.cross_entropy(leaf, targets, inplace_backward=inplace, **kwargs, **extras)
        check_output_fields(out, returns).backward(grad_output)
        grad = leaf.grad
    loss = check_output_fields(out, returns)
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape, f"loss {loss.dtype} {tuple(loss.shape)}"
    check_extra_outputs(out, returns, reduction, targets, ref_z, ref_predicted, lse_square_scale)

    ignored = targets == -100
    assert torch.all(grad[ignored] == 0), "ignored rows must get an exactly zero gradient"
    if bool(ignored.all()):
        if reduction == "mean":
            assert torch.isnan(loss) and torch.isnan(ref_loss), f"mean over no rows: ours {loss}, torch {ref_loss}"
        else:
            assert torch.all(loss == 0) and torch.all(ref_loss == 0)
        return
    if reduction == "none":
        assert torch.all(loss[ignored] == 0), "ignored rows must have loss 0"
    assert rel_err(loss, ref_loss) <= LOSS_FP32_TOL, f"loss error {rel_err(loss, ref_loss):.3e}"
    assert_gradient_no_worse(grad, torch_grad, ref_grad, targets, dtype)


def extra_case_id(c):
    return case_id({k: (v if k != "returns" else "+".join(v)) for k, v in c.items()})


@pytest.mark.parametrize("params", EXTRA_CASES, ids=[extra_case_id(c) for c in EXTRA_CASES])
def test_extras_match_float64(params):
    check_extras(**params)


@pytest.mark.parametrize("kernel", ["rows", "smem"])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_argmax_ties(kernel, softcap):
    """Equal maxima in one row: the lowest column wins, as in torch.argmax, in both kernels. The shared-memory kernel
    visits chunks out of order (here 7 chunks of 256, 3 streamed), so the tie rule must not depend on the order."""
    if kernel == "smem" and not SMEM_RUNS_HERE:
        pytest.skip("the shared-memory kernel runs only on compute capability 9.x GPUs (and the CPU interpreter)")
    V, block = 1904, 256  # 7 whole chunks and a partial one of 112 columns
    ties = [[5 * block + 9, 1 * block + 9],  # same lane and position in a kept and a streamed chunk
            [3, 4, 1000],  # two columns of one lane
            [7 * block + 100, 7 * block + 101],  # in the partial chunk only
            [7 * block + 3, 2 * block + 3 + 8],  # partial chunk and a neighbouring lane of chunk 2
            [17, 4 * block + 17, 6 * block + 17, 7 * block + 17],
            [4 * block + 30, 6 * block + 30, 7 * block + 30],  # kept chunks only (the shared-memory kernel's slots)
            [V - 1]]
    values = (torch.randn(len(ties), V, device=DEVICE) * 3).to(torch.bfloat16)
    for row, columns in enumerate(ties):
        values[row, columns] = 20.0
    targets = torch.tensor([max(columns) for columns in ties], device=DEVICE)  # not the first tied column
    expected = torch.tensor([min(columns) for columns in ties], device=DEVICE)
    out, _ = ck.cross_entropy_forward(values, targets, softcap=softcap, return_predicted_tokens=True,
                                      return_token_accuracy=True, kernel=kernel, block_v=block,
                                      **({"n_streamed": 3, "n_ring": 2} if kernel == "smem" else {}))
    assert torch.equal(out.predicted_tokens, expected), f"{out.predicted_tokens} != {expected}"
    assert out.token_accuracy == 1 / len(ties)  # only the one-column row predicts its target


@pytest.mark.parametrize("kernel", ["rows", "smem"])
def test_argmax_of_capped_logits(kernel):
    """The argmax is taken after the softcap, which makes large logits equal: 40 and 60 (and 50 and 80) both cap to
    4.0 in fp32 at softcap 4, so the lower column wins, although its raw logit is the smaller."""
    if kernel == "smem" and not SMEM_RUNS_HERE:
        pytest.skip("the shared-memory kernel runs only on compute capability 9.x GPUs (and the CPU interpreter)")
    V, block = 1904, 256
    values = (torch.randn(2, V, device=DEVICE) * 3).to(torch.bfloat16)
    values[0, 16], values[0, 17] = 40.0, 60.0  # one lane of one chunk
    values[1, 2 * block + 3], values[1, 6 * block + 3] = 50.0, 80.0  # the same lane position in two chunks
    expected = (4.0 * torch.tanh(values.float() / 4.0)).argmax(dim=-1)
    assert expected.tolist() == [16, 2 * block + 3]
    targets = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    out, _ = ck.cross_entropy_forward(values, targets, softcap=4.0, return_predicted_tokens=True, kernel=kernel,
                                      block_v=block, **({"n_streamed": 3, "n_ring": 2} if kernel == "smem" else {}))
    assert torch.equal(out.predicted_tokens, expected), f"{out.predicted_tokens} != {expected}"


@pytest.mark.parametrize("kernel", ["rows", "smem"])
def test_argmax_ignores_columns_past_the_row(kernel):
    """Logits that are a slice of a wider buffer ([:, :901] of a row of 1024 whose tail holds 1e4): the last lane
    reads past column 900 into the tail, and the argmax must stop at V."""
    if kernel == "smem" and not SMEM_RUNS_HERE:
        pytest.skip("the shared-memory kernel runs only on compute capability 9.x GPUs (and the CPU interpreter)")
    V, block = 901, 256
    wide = (torch.randn(3, 1024, device=DEVICE) * 3).to(torch.bfloat16)
    wide[:, V:] = 1e4
    wide[:, V - 1] = 30.0  # the row's maximum, in the last column
    targets = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    out, _ = ck.cross_entropy_forward(wide[:, :V], targets, return_predicted_tokens=True, kernel=kernel, block_v=block,
                                      **({"n_streamed": 2, "n_ring": 1} if kernel == "smem" else {}))
    assert out.predicted_tokens.tolist() == [V - 1] * 3


@pytest.mark.parametrize("kernel", ["rows", "smem"])
def test_mean_over_zero_class_weight_is_nan(kernel):
    """Every non-ignored target's class weight is 0: "mean" divides by 0 and PyTorch returns NaN, with label smoothing
    too (whose term leaves positive losses on those rows, which alone would give inf), and a gradient that is not
    finite on the counted rows and 0 on the ignored ones."""
    if kernel == "smem" and not SMEM_RUNS_HERE:
        pytest.skip("the shared-memory kernel runs only on compute capability 9.x GPUs (and the CPU interpreter)")
    V = 528  # rows of a multiple of 16 elements: the shared-memory kernel's cp.async needs them on the GPU
    logits = (torch.randn(6, V, device=DEVICE) * 3).to(torch.bfloat16)
    targets = make_targets((6,), V, 0.3).to(DEVICE)
    weight = torch.rand(V, device=DEVICE) + 0.5
    weight[targets[targets != -100]] = 0.0
    expected = F.cross_entropy(logits.double(), targets, weight=weight.double(), label_smoothing=0.1)
    with warnings.catch_warnings():  # the gradient's scale is 1 / 0: the interpreter warns about inf * 0
        warnings.simplefilter("ignore", RuntimeWarning)
        loss, grad = ck.cross_entropy_forward(logits, targets, weight=weight, label_smoothing=0.1, kernel=kernel,
                                              block_v=256)
    assert torch.isnan(expected) and torch.isnan(loss), f"ours {loss}, PyTorch {expected}"
    ignored = targets == -100
    assert torch.all(grad[ignored] == 0) and not torch.any(torch.isfinite(grad[~ignored].float()).all(dim=-1))


def test_extras_output_and_autograd():
    """Without a return_* flag: a tensor, as without extras. With one: a CrossEntropyOutput whose loss includes the
    z-loss and carries the only gradient; the module returns the same; no_grad gives the same fields."""
    V = 500
    logits = untie(torch.randn(12, V, device=DEVICE) * 3).requires_grad_()
    targets = plant_argmax(make_targets((12,), V, 0.2).to(DEVICE), logits.detach())
    plain = ck.cross_entropy(logits, targets)
    out = ck.cross_entropy(logits, targets, lse_square_scale=1e-3, return_z_loss=True, return_token_accuracy=True)
    assert isinstance(plain, torch.Tensor) and isinstance(out, ck.CrossEntropyOutput)
    assert out.predicted_tokens is None and out.z_loss is not None and out.token_accuracy is not None
    assert torch.allclose(out.loss, plain + out.z_loss, rtol=1e-6), "the loss includes the z-loss"
    loss, z_loss, accuracy, predicted = out  # a named tuple: unpacks like Liger's four outputs
    assert loss.requires_grad and not z_loss.requires_grad and not accuracy.requires_grad
    (grad,) = torch.autograd.grad(loss, logits)
    ref_loss, ref_grad, _, _ = reference_extras(logits, targets, torch.tensor(1.0, device=DEVICE), torch.float64,
                                                lse_square_scale=1e-3)
    assert rel_err(out.loss, ref_loss) <= LOSS_FP32_TOL, "the loss with its z-loss term"
    assert rel_err(grad, ref_grad) <= GRAD_FLOOR[torch.float32] * 10
    module = ck.TritonCrossEntropyLoss(lse_square_scale=1e-3, return_z_loss=True, return_token_accuracy=True)
    module_out = module(logits, targets)
    assert torch.allclose(module_out.loss, out.loss) and torch.equal(module_out.token_accuracy, out.token_accuracy)
    with torch.no_grad():
        no_grad_out = ck.cross_entropy(logits, targets, lse_square_scale=1e-3, return_z_loss=True,
                                       return_token_accuracy=True)
    assert torch.allclose(no_grad_out.loss, out.loss) and torch.equal(no_grad_out.z_loss, out.z_loss)
    weighted = ck.TritonCrossEntropyLoss(weight=torch.rand(V, device=DEVICE))
    assert "weight" in dict(weighted.named_buffers()), "the class weights are a buffer (they move with .to())"


LCE_EXTRA_CASES = [
    case(dtype="fp32", hidden_shape=(40, 24), V=300, reduction="mean", ignore_frac=0.2, bias=True, chunk_size=17,
         weight=True, label_smoothing=0.1),
    case(dtype="bf16", hidden_shape=(40, 24), V=300, reduction="sum", ignore_frac=0.2, chunk_size=16,
         lse_square_scale=1e-2, softcap=4.0, returns=("z",)),
    case(dtype="bf16", hidden_shape=(2, 13, 24), V=300, reduction="mean", ignore_frac=0.2, chunk_size=10,
         returns=("acc", "pred")),
    case(dtype="fp32", hidden_shape=(30, 16), V=200, reduction="none", ignore_frac=0.2, bias=True, chunk_size=7,
         weight=True, lse_square_scale=1e-2, softcap=4.0, label_smoothing=0.1, returns=("z", "acc", "pred")),
    case(dtype="bf16", hidden_shape=(32, 16), V=500, reduction="mean", ignore_frac=0.25, chunk_size=11,
         weight=True, lse_square_scale=1e-2, softcap=5.0, returns=("z", "acc", "pred"), use_module=True),
    case(dtype="fp32", hidden_shape=(16, 16), V=100, reduction="mean", ignore_frac=1.0, chunk_size=5, weight=True,
         lse_square_scale=1e-2, returns=("z", "acc", "pred")),
    # 16-bit logits over five 256-wide chunks: on the interpreter, the chunks' logits take the shared-memory kernel
    # (see the test below; a GPU sends chunks of 7 rows to the row kernel)
    case(dtype="bf16", hidden_shape=(2, 9, 24), V=1040, reduction="mean", ignore_frac=0.2, bias=True, chunk_size=7,
         weight=True, lse_square_scale=1e-2, label_smoothing=0.1, returns=("z", "acc", "pred")),
    # Liger's options: token scaling alone, with every extra, by reduction ("none": the backward's recomputed
    # chunks scale too), 3-D, a vocabulary that is no multiple of the 256-wide block, the module; fp32 dW accumulation
    case(dtype="fp32", hidden_shape=(2, 7, 16), V=300, reduction="mean", ignore_frac=0.2, bias=True, chunk_size=5,
         use_token_scaling=True),
    case(dtype="bf16", hidden_shape=(24, 16), V=300, reduction="sum", ignore_frac=0.2, chunk_size=7,
         use_token_scaling=True, accum_dtype=torch.float32, upstream=-1.5),
    case(dtype="fp32", hidden_shape=(3, 6, 16), V=200, reduction="none", ignore_frac=0.2, bias=True, chunk_size=4,
         use_token_scaling=True, weight=True, lse_square_scale=1e-2, softcap=4.0, label_smoothing=0.1,
         returns=("z", "acc")),
    case(dtype="bf16", hidden_shape=(2, 9, 16), V=520, reduction="mean", ignore_frac=0.25, bias=True, chunk_size=6,
         use_token_scaling=True, accum_dtype=torch.float32, weight=True, lse_square_scale=1e-2, softcap=5.0,
         label_smoothing=0.1, returns=("z", "acc", "pred"), use_module=True),
    case(dtype="bf16", hidden_shape=(2, 8, 16), V=300, reduction="none", ignore_frac=0.2, bias=True, chunk_size=5,
         accum_dtype=torch.float32, lse_square_scale=1e-2, returns=("z",)),
    case(dtype="fp32", hidden_shape=(12, 16), V=100, reduction="mean", ignore_frac=1.0, chunk_size=5,
         use_token_scaling=True, accum_dtype=torch.float32, returns=("z",)),
]


def test_linear_extras_cases_cover_both_kernels_on_the_interpreter():
    """The launcher's choice for the last two LCE_EXTRA_CASES chunks on the interpreter (no GPU properties): the last
    (bf16, V = 1040, 7-row chunks) takes the shared-memory kernel, the one before it (fp32) the row kernel."""
    assert ck._pick_smem_plan(1040, 2, 7, True, True, None) is not None
    assert ck._pick_smem_plan(100, 4, 5, True, True, None) is None


def check_linear_extras(dtype, hidden_shape, V, reduction, ignore_frac, bias=False, chunk_size=None, weight=False,
                        lse_square_scale=0.0, softcap=None, returns=(), label_smoothing=0.0, use_module=False,
                        use_token_scaling=False, accum_dtype=None, upstream=1.0):
    """linear_cross_entropy with extras and options against float64 F.linear + the extras' reference. Predicted
    tokens are compared on the rows whose two largest float64 logits are further apart than the dtype's matmul
    rounding."""
    dtype = DTYPES[dtype]
    H = hidden_shape[-1]
    hidden = torch.randn(hidden_shape, device=DEVICE).to(dtype)
    lm_weight = (torch.randn(V, H, device=DEVICE) * 2 / H**0.5).to(dtype)
    bias_values = torch.randn(V, device=DEVICE).to(dtype) if bias else None
    logits64 = F.linear(hidden.double(), lm_weight.double(), None if bias_values is None else bias_values.double())
    targets = plant_argmax(make_targets(hidden_shape[:-1], V, ignore_frac).to(DEVICE), logits64)
    w = class_weights(V, dtype) if weight else None
    kwargs = dict(reduction=reduction, label_smoothing=label_smoothing)
    if reduction == "none":
        grad_output = torch.randn(hidden_shape[:-1], device=DEVICE)
    else:
        grad_output = torch.tensor(upstream, device=DEVICE)

    def reference(target_dtype):
        leaves = [None if x is None else x.to(target_dtype).requires_grad_() for x in (hidden, lm_weight, bias_values)]
        loss, z_loss, predicted = extras_loss(F.linear(*leaves), targets, w, lse_square_scale, softcap, **kwargs,
                                              use_token_scaling=use_token_scaling)
        grads = torch.autograd.grad(loss, [x for x in leaves if x is not None], grad_output.to(target_dtype))
        return loss.detach(), grads, z_loss, predicted

    ref_loss, ref_grads, ref_z, ref_predicted = reference(torch.float64)
    eager_loss, eager_grads, eager_z, _ = reference(dtype)
    # The loss's error is the rounding of the logits (the matmul's output), which eager shares, and then the loss's own
    # arithmetic: eager's loss is taken in fp32 from its rounded logits (as transformers upcasts them), where a 16-bit
    # loss would add a rounding of the result that can land it near the float64 value or far from it by chance.
    eager_loss = extras_loss(F.linear(hidden, lm_weight, bias_values).float(), targets, w, lse_square_scale, softcap,
                             **kwargs, use_token_scaling=use_token_scaling)[0]
    leaves = [None if x is None else x.clone().requires_grad_() for x in (hidden, lm_weight, bias_values)]
    extras = dict(ce_weight=w, lse_square_scale=lse_square_scale, softcap=softcap, accum_dtype=accum_dtype,
                  use_token_scaling=use_token_scaling, **{flag: key in returns for key, flag in RETURN_FLAGS.items()})
    if use_module:
        out = lce.TritonLinearCrossEntropyLoss(chunk_size=chunk_size, **kwargs, **extras)(*leaves[:2], targets,
                                                                                         leaves[2])
    else:
        out = lce.linear_cross_entropy(*leaves[:2], targets, leaves[2], chunk_size=chunk_size, **kwargs, **extras)
    loss = check_output_fields(out, returns)
    inputs = [x for x in leaves if x is not None]
    grads = torch.autograd.grad(loss, inputs, grad_output)

    top2 = (logits64.float() if softcap is None else softcap * torch.tanh(logits64 / softcap)).topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.1  # well above the dtype's rounding of a logit of magnitude ~5
    check_extra_outputs(out, returns, reduction, targets, ref_z, ref_predicted, lse_square_scale, predicted_ok=clear,
                        eager_z=eager_z)
    ignored = targets == -100
    if bool(ignored.all()):
        if reduction == "mean":
            assert torch.isnan(loss) and torch.isnan(ref_loss)
        assert all(torch.all(g == 0) for g in grads), "all rows ignored: every gradient must be zero"
        return
    assert_no_worse("loss", rel_err(loss.detach(), ref_loss), rel_err(eager_loss, ref_loss), LOSS_FP32_TOL)
    for name, ours, eager, ref in zip(("dh", "dW", "db"), grads, eager_grads, ref_grads):
        assert ours.dtype == dtype and ours.shape == ref.shape, f"{name}: {ours.dtype} {tuple(ours.shape)}"
        assert_no_worse(name, rel_err(ours, ref), rel_err(eager, ref), GRAD_FLOOR[dtype])


@pytest.mark.parametrize("params", LCE_EXTRA_CASES, ids=[extra_case_id({"dtype": c["dtype"],
                         "shape": c["hidden_shape"] + (c["V"],), **{k: v for k, v in c.items()
                         if k not in ("dtype", "hidden_shape", "V")}}) for c in LCE_EXTRA_CASES])
def test_linear_extras_match_float64(params):
    check_linear_extras(**params)


def test_token_scaling_is_exp_minus_loss():
    """Without smoothing, class weights or z-loss, a row's loss l = -log(p), so token scaling turns it into l * exp(-l)
    exactly: the per-row losses with and without the option, against each other (ignored rows stay 0)."""
    hidden = torch.randn(2, 11, 16, device=DEVICE)
    weight = torch.randn(300, 16, device=DEVICE) * 0.5
    targets = make_targets((2, 11), 300, 0.2).to(DEVICE)
    plain = lce.linear_cross_entropy(hidden, weight, targets, reduction="none", chunk_size=4)
    scaled = lce.linear_cross_entropy(hidden, weight, targets, reduction="none", chunk_size=4, use_token_scaling=True)
    assert torch.allclose(scaled, plain * torch.exp(-plain), rtol=1e-5, atol=0)
    assert torch.all(scaled[targets == -100] == 0) and not torch.allclose(scaled, plain)
    mean = lce.linear_cross_entropy(hidden, weight, targets, chunk_size=4, use_token_scaling=True)
    assert torch.allclose(mean, scaled.sum() / (targets != -100).sum(), rtol=1e-6), "mean over the non-ignored rows"


def test_linear_accum_dtype_fp32():
    """bf16 over 32 chunks: dW summed in fp32 and rounded once must be measurably closer to float64 than dW rounded
    to bf16 after every chunk, and no worse than eager's single matmul. fp32 weights already accumulate in fp32: the
    option then changes nothing, bit for bit."""
    N, H, V = 128, 16, 100
    hidden = torch.randn(N, H, device=DEVICE).to(torch.bfloat16)
    weight = (torch.randn(V, H, device=DEVICE) / H**0.5).to(torch.bfloat16)
    targets = make_targets((N,), V, 0.1).to(DEVICE)
    kwargs = dict(reduction="sum", label_smoothing=0.0)
    one = torch.tensor(1.0, device=DEVICE)

    def dw_of(dtype, ours=False, **options):
        h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
        if ours:
            loss = lce.linear_cross_entropy(h, w, targets, chunk_size=4, reduction="sum", **options)
            return torch.autograd.grad(loss, w)[0]
        return _linear_ce(h, w, None, targets, one.to(dtype), kwargs)[1][1]
    ref_dw, eager_dw = dw_of(torch.float64), dw_of(torch.bfloat16)
    per_chunk, once = dw_of(torch.bfloat16, ours=True), dw_of(torch.bfloat16, ours=True, accum_dtype=torch.float32)
    assert once.dtype == torch.bfloat16
    err_per_chunk, err_once = rel_err(per_chunk, ref_dw), rel_err(once, ref_dw)
    assert err_once < 0.5 * err_per_chunk, f"fp32 accumulation {err_once:.2e} vs per-chunk rounding {err_per_chunk:.2e}"
    assert_no_worse("dW summed in fp32", err_once, rel_err(eager_dw, ref_dw), GRAD_FLOOR[torch.bfloat16])
    assert torch.equal(dw_of(torch.float32, ours=True), dw_of(torch.float32, ours=True, accum_dtype=torch.float32))


def test_linear_options_compile():
    """Both options through torch.compile (the custom operators, "none" with its backward operator) give the eager
    path's loss and gradients bit for bit."""
    hidden = torch.randn(2, 5, 16, device=DEVICE).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(200, 16, device=DEVICE).to(torch.bfloat16).requires_grad_()
    targets = make_targets((2, 5), 200, 0.2).to(DEVICE)
    grad_output = torch.randn(2, 5, device=DEVICE)

    def loss_and_grads(fn):
        loss = fn(hidden, weight)
        return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight), grad_output))

    def fn(h, w):
        return lce.linear_cross_entropy(h, w, targets, reduction="none", chunk_size=3, accum_dtype=torch.float32,
                                       use_token_scaling=True)
    torch._dynamo.reset()
    compiled = loss_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True))
    for ours, eager in zip(compiled, loss_and_grads(fn)):
        assert torch.equal(ours, eager)


# ----------------------------------------------------------------------------------------------------------------------
# GPU only: int64 offsets, peak memory, LLaMA-3 sizes
# ----------------------------------------------------------------------------------------------------------------------
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA (sizes too large for the CPU interpreter)")
LLAMA_V, LLAMA_H = 128256, 4096


@gpu_only
def test_int64_offsets():
    """16900 x 128256 bf16 logits = 2.17e9 elements > 2^31: the last 64 rows start past the int32 range. Compare them
    (loss and per-row-scaled gradient) with float64 PyTorch; int32 offsets would read/write another row."""
    N, V, tail = 16900, LLAMA_V, 64
    assert (N - tail) * V > 2**31
    logits = (torch.randn(N, V, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    targets = make_targets((N,), V, 0.2).cuda()
    grad_output = torch.randn(N, device="cuda")
    loss = ck.cross_entropy(logits, targets, reduction="none")
    (grad,) = torch.autograd.grad(loss, logits, grad_output)
    rows = slice(N - tail, N)
    ref_loss, ref_grad = reference_cross_entropy(logits[rows].double(), targets[rows], grad_output[rows].double(),
                                                 reduction="none")
    _, torch_grad = reference_cross_entropy(logits[rows], targets[rows], grad_output[rows], reduction="none")
    assert rel_err(loss[rows], ref_loss) <= LOSS_FP32_TOL
    assert_no_worse("tail grad", rel_err(grad[rows], ref_grad), rel_err(torch_grad, ref_grad),
                    GRAD_FLOOR[torch.bfloat16])


def _peak_above(fn):
    """Peak CUDA memory allocated while running fn, above what was allocated before, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


@gpu_only
def test_peak_memory():
    """Forward + backward at 16384 x 128256 bf16 (4 GB of logits): in-place +0, default one logits size, PyTorch's
    fp32 path (what transformers does) several times that."""
    N, V = 16384, LLAMA_V
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16).requires_grad_()
    targets = make_targets((N,), V, 0.2).cuda()
    logits_mib = logits.numel() * logits.element_size() / 2**20
    peaks = {
        "inplace": _peak_above(lambda: torch.autograd.grad(ck.cross_entropy(logits, targets, inplace_backward=True),
                                                           logits)),
        "default": _peak_above(lambda: torch.autograd.grad(ck.cross_entropy(logits, targets), logits)),
        "torch_fp32": _peak_above(lambda: torch.autograd.grad(F.cross_entropy(logits.float(), targets), logits)),
    }
    assert peaks["inplace"] <= 8, peaks  # only the per-row losses (64 KB) and scalars
    assert peaks["default"] <= logits_mib + 8, peaks
    assert peaks["torch_fp32"] > peaks["default"], peaks


@gpu_only
def test_llama_sizes():
    """4096 x 128256 bf16 with ignored rows and label smoothing, against float64 and PyTorch bf16."""
    for smoothing in (0.0, 0.1):
        check_cross_entropy("bf16", (4096, LLAMA_V), "mean", 0.2, label_smoothing=smoothing)
    check_cross_entropy("bf16", (2, 2048, LLAMA_V), "mean", 0.2, inplace=True, layout="sliced")


@gpu_only
def test_row_kernel_where_smem_is_default():
    """The row kernel forced on bf16 logits with a gradient, at a LLaMA-3 size where an H100/H200 would pick the
    shared-memory kernel: what every other GPU (Ampere, Blackwell) runs by default, checked on this one."""
    N, V = 2048, LLAMA_V
    if torch.cuda.get_device_capability()[0] == 9:
        properties = torch.cuda.get_device_properties(0)
        assert ck._pick_smem_plan(V, 2, N, True, True, properties) is not None, "the default should be shared memory"
    check_cross_entropy("bf16", (N, V), "mean", 0.2, kernel="rows")
    check_cross_entropy("bf16", (N, V), "none", 0.2, label_smoothing=0.1, kernel="rows", inplace=True)


@gpu_only
def test_linear_llama_sizes():
    """Linear CE at H=4096, V=128256, bf16, 4096 tokens: loss/dh/dW no worse than eager (bf16 matmul + CE), and the
    peak above inputs at 16384 tokens bounded by dW + dh + two chunks of logits."""
    check_linear_cross_entropy("bf16", (4096, LLAMA_H), LLAMA_V, "mean", 0.2)
    N = 16384
    hidden = torch.randn(N, LLAMA_H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(LLAMA_V, LLAMA_H, device="cuda") / LLAMA_H**0.5).to(torch.bfloat16).requires_grad_()
    targets = make_targets((N,), LLAMA_V, 0.2).cuda()
    peak = _peak_above(lambda: torch.autograd.grad(lce.linear_cross_entropy(hidden, weight, targets), (hidden, weight)))
    grads_mib = (hidden.numel() + weight.numel()) * 2 / 2**20
    chunk_mib = lce._lce_chunk_rows(N, LLAMA_V, 2, None) * LLAMA_V * 2 / 2**20
    assert peak <= grads_mib + 2 * chunk_mib + 64, f"peak +{peak:.0f} MiB, gradients {grads_mib:.0f} MiB"


@gpu_only
def test_extras_llama_sizes():
    """Every extra (Gemma-2's softcap 30) at LLaMA-3 sizes in bf16 against float64: the launcher's default kernel
    (the shared-memory one on an H100/H200), the row kernel in place, and the linear cross-entropy. The z-loss scale
    is 1e-2, not PaLM's 1e-4: its gradient, 2 * scale * lse * softmax with lse about 12, must stand well above bf16's
    rounding for a missing or wrong z-loss gradient to fail."""
    options = dict(weight=True, lse_square_scale=1e-2, softcap=30.0, label_smoothing=0.1, returns=("z", "acc", "pred"))
    check_extras("bf16", (4096, LLAMA_V), "mean", 0.2, **options)
    check_extras("bf16", (2048, LLAMA_V), "none", 0.2, kernel="rows", inplace=True, **options)
    check_linear_extras("bf16", (2048, LLAMA_H), LLAMA_V, "mean", 0.2, lse_square_scale=1e-2,
                        returns=("z", "acc", "pred"))


if __name__ == "__main__":
    # `python x_test.py` runs pytest on this file and ends with one PASSED / FAILED / SKIPPED line per check (pytest's
    # -rA summary); other arguments go to pytest (e.g. -k bf16). --help prints what is checked and how it passes.
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _, pytest_args = parser.parse_known_args()
    sys.exit(pytest.main([__file__, "-q", "-rA", "-p", "no:cacheprovider", *pytest_args]))
