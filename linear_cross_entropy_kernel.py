"""Fused linear cross-entropy: cross_entropy(hidden @ weight.T + bias, targets) and its gradients, without the [N, V]
logits. Read cross_entropy_kernel.py first: this file adds no kernel, only a loop around that file's launcher.

What it computes
----------------
The loss of `cross_entropy` (same semantics, extras and errors) on the logits of lm_head, and the gradients of hidden,
weight and bias. The lm_head matmul turns hidden [N, H] into logits [N, V]; at N = 16384, V = 128256 those are 4.2 GB
in bf16, plus the same again for their gradient. Instead the tokens are walked in chunks of C rows; per chunk:

    logits_c  = h_c @ W.T (+ b)                  cuBLAS (torch.mm/addmm), C x V values, the only big buffer
    logits_c <- dlogits_c                        the fused cross-entropy kernel, IN PLACE, already scaled by 1/n_valid
    dh[c]     = dlogits_c @ W                    written straight into the preallocated dh (mm out=)
    dW       += dlogits_c.T @ h_c                addmm into dW in place (the first chunk writes it: no zero-fill)
    db       += sum over rows of dlogits_c       fp32 accumulator

so the whole loss AND all gradients are computed in the forward (Liger's approach); the backward only multiplies
dh/dW/db by grad_output with the device-side scale kernel, a no-op when it is 1. The FLOPs are those of eager (three
matmuls); the extra memory is one chunk of logits plus the gradients themselves.

reduction="none" is different: the gradient of each row's loss is weighted by its own grad_output, which dW mixes
across rows, so it cannot be applied afterwards. Then the forward computes only the losses and the backward redoes the
chunks with the per-row grad_output as the kernel's scale (one extra logits matmul).

dW precision: dW is kept in the weight's dtype. Each chunk's product is accumulated in fp32 inside cuBLAS and rounded
once when added to dW, so a bf16 dW sees one rounding per chunk (N / C roundings in total) instead of the single
rounding of eager's one big matmul; the tests measure the effect against eager's own error. accum_dtype=torch.float32
(Liger's option) keeps dW in an fp32 buffer instead, rounded to the weight's dtype once at the end, for 4 more bytes
per weight element during the call (2 GiB for LLaMA-3-8B's lm_head). db is summed in fp32 always.

use_token_scaling (Liger's option) multiplies each row's loss, z-loss and gradient by p, the row's softmax probability
of its target (after the softcap), treated as a constant. p must be known before the kernel's gradient pass, so each
chunk first gets a loss-only launch without smoothing or class weights, whose loss lse - x_target is -log(p); p times
the reduction's scale then becomes a per-row scale of the main launch. One more read of the chunk's logits, and no
change to the kernels.

Chunk size: the peak above the inputs is dW (1 GiB in bf16 for LLaMA-3-8B's lm_head) + dh + one chunk, and every chunk
re-reads and re-writes dW. That read and write (4·V·H bytes) buys 2·V·H·C FLOP of dW matmul, so from about C = 512
rows on Hopper the matmul, not the memory traffic, sets the chunk's time, and more rows only hold more memory. The
default is 512 rows (125 MiB at V = 128256 in bf16), fewer where 512 rows of logits would pass 128 MiB (384 rows at
Qwen's V = 151936, 256 at Gemma's 256000): the loss then holds at most dW + dh + 128 MiB, whatever the vocabulary.
"""
import sys
from typing import Optional

import torch

# cross_entropy_kernel first: without a GPU it switches Triton to its CPU interpreter before triton is imported.
from cross_entropy_kernel import (INTERPRETER, KERNEL_DEVICE, CrossEntropyOutput, _check_common_args, _check_extras,
                                  _check_target_range, _empty, _Extras, _fake_fields, _fields, _from_fields,
                                  _function_output, _launch_cross_entropy, _LossModule, _LossTerms, _max_rel_err,
                                  _scale_rows_, _validate_rows)

__all__ = ["linear_cross_entropy", "LinearCrossEntropyFunction", "TritonLinearCrossEntropyLoss",
           "LCE_CHUNK_ROWS", "LCE_CHUNK_BUDGET_BYTES"]

LCE_CHUNK_ROWS = 512  # the default chunk's rows (see "Chunk size" above)
LCE_CHUNK_BUDGET_BYTES = 128 * 2**20  # the most logits a default chunk holds, in bytes


# ----------------------------------------------------------------------------------------------------------------------
# 1. The chunk loop
# ----------------------------------------------------------------------------------------------------------------------
def _lce_chunk_rows(n_rows, V, itemsize, chunk_size):
    if chunk_size is not None:
        if not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"linear_cross_entropy: chunk_size must be a positive int, got {chunk_size!r}")
        return max(1, min(chunk_size, n_rows))
    rows = min(LCE_CHUNK_ROWS, LCE_CHUNK_BUDGET_BYTES // (V * itemsize))
    rows = max(64, rows // 64 * 64)  # a multiple of 64 keeps the matmul tiles full
    return max(1, min(rows, n_rows))


def _linear_cross_entropy_chunks(hidden, weight, bias, targets_flat, losses, scale, scale_stride, want_dh, want_dw,
                                 want_db, chunk_rows, ignore_index, label_smoothing, positive_scale=True,
                                 extras=_Extras(), accum_dtype=None, use_token_scaling=False):
    """The chunk loop. Fills losses [N] (and the extras' outputs) and returns (dh in hidden's shape, dW, db), None
    where not wanted, scaled by `scale` (positive_scale=False when it is a user's grad_output, which may be <= 0)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if h.stride(-1) != 1:
        h = h.contiguous()  # torch.mm's out= and the row slices below want rows of unit stride
    n_rows, V = h.shape[0], weight.shape[0]
    compute_grad = want_dh or want_dw or want_db
    dh = torch.empty_like(h) if want_dh else None
    fp32_dw = want_dw and accum_dtype == torch.float32 and weight.dtype != torch.float32
    if fp32_dw:
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # every chunk adds to it
    else:
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
        chunk_extras = _chunk_extras(extras, start, end, scale_stride != 0)
        chunk_scale_stride, chunk_positive_scale = scale_stride, positive_scale
        if use_token_scaling:
            probs = _target_probabilities(logits_c, targets_flat[start:end], ignore_index, extras.softcap)
            chunk_scale = _rows_times(scale, start, end, probs)
            if extras.z_scale is not None:
                chunk_extras = chunk_extras._replace(z_scale=_rows_times(extras.z_scale, start, end, probs))
            # One scale per row now. It is not folded into the exponent (POSITIVE_SCALE): that takes its log2, and a
            # probability can underflow to 0.
            chunk_scale_stride, chunk_positive_scale = 1, False
        _launch_cross_entropy(logits_c, targets_flat[start:end], losses[start:end],
                              logits_c if compute_grad else None, chunk_scale, chunk_scale_stride, ignore_index,
                              label_smoothing, chunk_positive_scale, extras=chunk_extras)
        if use_token_scaling:
            losses[start:end] *= probs
            if chunk_extras.z_losses is not None:
                chunk_extras.z_losses.mul_(probs)
        if not compute_grad:
            continue
        dlogits_c = logits_c  # the kernel overwrote the chunk's logits with their gradient
        if want_dh:
            torch.mm(dlogits_c, weight, out=dh[start:end])
        if fp32_dw:
            _add_product_in_fp32(dw, dlogits_c.t(), h_c)
        elif want_dw:
            if start == 0:
                torch.mm(dlogits_c.t(), h_c, out=dw)
            else:
                dw.addmm_(dlogits_c.t(), h_c)
        if want_db:
            db += dlogits_c.sum(dim=0, dtype=torch.float32)
    if fp32_dw:
        dw = dw.to(weight.dtype)
    return None if dh is None else dh.view(hidden.shape), dw, None if db is None else db.to(weight.dtype)


def _chunk_extras(extras, start, end, per_row_scale):
    """The extras of rows start..end-1; per_row_scale: z_scale has one value per row."""
    def cut(x):
        return None if x is None else x[start:end]
    return extras._replace(z_losses=cut(extras.z_losses), predicted=cut(extras.predicted),
                           z_scale=cut(extras.z_scale) if per_row_scale else extras.z_scale)


def _add_product_in_fp32(acc, a, b):
    """acc += a @ b for 16-bit a, b and an fp32 acc, without rounding the product to 16 bits. On a GPU, cuBLAS adds
    its fp32 result straight into acc (addmm's out_dtype, as Liger does); elsewhere (the CPU interpreter, older GPUs)
    the operands are widened first, exact for 16-bit values but an fp32 copy of the chunk."""
    if acc.is_cuda and torch.cuda.get_device_capability(acc.device)[0] >= 8:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _target_probabilities(logits_c, targets_c, ignore_index, softcap):
    """p = softmax(logits)[target] per row (of the capped logits with a softcap), 0 on ignored rows: token scaling's
    factor. A loss-only launch without label smoothing or class weights gives lse - x_target = -log(p)."""
    neg_log_p = torch.empty(targets_c.numel(), dtype=torch.float32, device=logits_c.device)
    # The scale argument is not read without a gradient: any fp32 tensor will do.
    _launch_cross_entropy(logits_c, targets_c, neg_log_p, None, neg_log_p, 0, ignore_index, 0.0,
                          extras=_Extras(softcap=softcap))
    return torch.where(targets_c != ignore_index, torch.exp(-neg_log_p), 0.0)


def _rows_times(scale, start, end, probs):
    """Rows start..end-1 of a scale (0-dim, or one per row of the whole call, possibly expanded) times probs: one
    contiguous value per row."""
    return (scale[start:end] if scale.dim() else scale) * probs


# ----------------------------------------------------------------------------------------------------------------------
# 2. Checks, the forward, and the backward of reduction="none"
# ----------------------------------------------------------------------------------------------------------------------
def _validate_linear_cross_entropy(hidden, weight, targets, bias, reduction, label_smoothing, extras, accum_dtype,
                                   use_token_scaling):
    who = "linear_cross_entropy"
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{who}: weight must be a torch.Tensor")
    if weight.dim() != 2:
        raise ValueError(f"{who}: weight must be [V, H], got shape {tuple(weight.shape)}")
    _validate_rows(who, hidden, targets, reduction, label_smoothing, V=weight.shape[0], name="hidden",
                   shapes="[N, H] or [B, T, H]")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{who}: weight must be [V, H] with H = {hidden.shape[-1]}, got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{who}: weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"{who}: bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{who}: bias must be [V] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"{who}: bias dtype {bias.dtype} differs from hidden dtype {hidden.dtype}")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(f"{who}: {name} is on {tensor.device} but hidden is on {hidden.device}")
    _check_extras(who, extras, V=weight.shape[0], device=hidden.device, weight_name="ce_weight")
    _check_linear_options(who, accum_dtype, use_token_scaling)


def _check_linear_options(who, accum_dtype, use_token_scaling):
    """Liger's two options of the linear cross-entropy (see the notes at the top)."""
    if accum_dtype is not None and accum_dtype != torch.float32:
        kind = TypeError if not isinstance(accum_dtype, torch.dtype) else ValueError
        raise kind(f"{who}: accum_dtype must be None (dW in the weight's dtype) or torch.float32, got {accum_dtype!r}")
    if not isinstance(use_token_scaling, bool):
        raise TypeError(f"{who}: use_token_scaling must be True or False, got {use_token_scaling!r}")


def _linear_forward(hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, chunk_size,
                    check_targets, wants, extras, accum_dtype, use_token_scaling):
    """The forward of the autograd Function, of the operator and of a call without gradients: (the call's _LossTerms,
    its losses and the extras' outputs filled, (dh, dW, db)). wants: (want_dh, want_dw, want_db), ignored for
    reduction="none", whose gradients wait for the backward; extras: the extras' keyword arguments."""
    if check_targets:
        _check_target_range("linear_cross_entropy", targets, weight.shape[0], ignore_index)
    terms = _LossTerms(targets, ignore_index, reduction, hidden.device, **extras)
    grads = _linear_cross_entropy_chunks(
        hidden, weight, bias, terms.targets_flat, terms.losses, terms.scale, 0,
        *(wants if reduction != "none" else (False, False, False)),
        _lce_chunk_rows(terms.targets_flat.numel(), weight.shape[0], weight.element_size(), chunk_size),
        ignore_index, label_smoothing, extras=terms.extras, accum_dtype=accum_dtype,
        use_token_scaling=use_token_scaling)
    return terms, grads


def _linear_none_backward(hidden, weight, bias, targets, grad_output, wants, ignore_index, label_smoothing,
                          chunk_size, ce_weight, lse_square_scale, softcap, accum_dtype, use_token_scaling):
    """reduction="none"'s backward, of the autograd Function and of the operator: (dh, dW, db), None where not
    wanted, from the chunks again with the per-row grad_output as the kernel's scale (it may be <= 0)."""
    # The losses and z-losses the chunks write here are scratch; the z-loss's gradient takes grad_output too.
    terms = _LossTerms(targets, ignore_index, "none", hidden.device, ce_weight, lse_square_scale, softcap)
    scale = grad_output.reshape(-1)  # an expanded grad_output (loss.sum().backward()) keeps stride 0: fine
    extras = terms.extras if terms.extras.z_losses is None else terms.extras._replace(z_scale=scale)
    return _linear_cross_entropy_chunks(
        hidden, weight, bias, terms.targets_flat, terms.losses, scale, scale.stride(0), *wants,
        _lce_chunk_rows(terms.targets_flat.numel(), weight.shape[0], weight.element_size(), chunk_size),
        ignore_index, label_smoothing, positive_scale=False, extras=extras, accum_dtype=accum_dtype,
        use_token_scaling=use_token_scaling)


# ----------------------------------------------------------------------------------------------------------------------
# 3. Autograd Function, custom operators (torch.compile), functional API, module
# ----------------------------------------------------------------------------------------------------------------------
class LinearCrossEntropyFunction(torch.autograd.Function):
    """Forward: loss and all gradients, chunk by chunk (mean/sum), or the losses only ("none"). Backward: scales the
    stored gradients by grad_output, or ("none") recomputes the chunks with the per-row grad_output as the scale."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, chunk_size,
                check_targets, want_dh, want_dw, want_db, ce_weight=None, lse_square_scale=0.0, softcap=None,
                return_z_loss=False, return_token_accuracy=False, return_predicted_tokens=False, accum_dtype=None,
                use_token_scaling=False):
        wants = (want_dh, want_dw, want_db)
        terms, grads = _linear_forward(
            hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, chunk_size, check_targets, wants,
            dict(weight=ce_weight, lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
                 return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens),
            accum_dtype, use_token_scaling)
        ctx.reduction = reduction
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, bias, targets, ce_weight)
            ctx.args = (wants, ignore_index, label_smoothing, chunk_size, lse_square_scale, softcap, accum_dtype,
                        use_token_scaling)
        else:
            ctx.grads = grads
        return _function_output(ctx, terms.result())

    @staticmethod
    def backward(ctx, grad_output, *extras_grads):  # the extras (z_loss, accuracy, predicted) pass no gradient on
        if ctx.reduction == "none":
            hidden, weight, bias, targets, ce_weight = ctx.saved_tensors
            wants, ignore_index, label_smoothing, chunk_size, *options = ctx.args
            grads = _linear_none_backward(hidden, weight, bias, targets, grad_output, wants, ignore_index,
                                          label_smoothing, chunk_size, ce_weight, *options)
        else:
            if ctx.grads is None:
                raise RuntimeError("linear_cross_entropy: the fused backward scales its stored gradients in place and "
                                   "can run once; recompute the loss instead of using retain_graph=True")
            grads, ctx.grads = ctx.grads, None
            for grad in grads:
                if grad is not None:
                    _scale_rows_(grad.view(1, -1) if grad.dim() == 1 else grad, grad_output)  # db is one row
        return (*grads, *(None,) * 17)


# The custom operators, as those of `cross_entropy`: the forward returns the four CrossEntropyOutput fields and dh, dW,
# db, already scaled for the reduction; the backward scales them in place by grad_output (playbook::scale_rows_).
# reduction="none" computes no gradient in the forward: its backward operator recomputes the chunks with the per-row
# grad_output.
@torch.library.custom_op("playbook::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             targets: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float,
                             chunk_size: Optional[int], check_targets: bool, want_dh: bool, want_dw: bool,
                             want_db: bool, ce_weight: Optional[torch.Tensor], lse_square_scale: float,
                             softcap: Optional[float], return_z_loss: bool, return_token_accuracy: bool,
                             return_predicted_tokens: bool, accum_dtype: Optional[torch.dtype] = None,
                             use_token_scaling: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
    """LinearCrossEntropyFunction's forward as an operator: (loss, z_loss, token_accuracy, predicted_tokens, dh, dW,
    db), placeholders for the fields and gradients not asked for (and for every gradient with reduction="none")."""
    terms, grads = _linear_forward(
        hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, chunk_size, check_targets,
        (want_dh, want_dw, want_db),
        dict(weight=ce_weight, lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
             return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens),
        accum_dtype, use_token_scaling)
    return *_fields(terms.result(), hidden.device), *(_empty(hidden.device) if g is None else g for g in grads)


def _fake_linear_grads(hidden, weight, want_dh, want_dw, want_db):
    """Empty (dh, dW, db) as _linear_cross_entropy_chunks allocates them, placeholders where not wanted (one each:
    outputs that are one tensor would alias each other, which the real operator's never do)."""
    device = hidden.device
    return (torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if want_dh else _empty(device),
            torch.empty_like(weight) if want_dw else _empty(device),
            torch.empty(weight.shape[0], dtype=weight.dtype, device=device) if want_db else _empty(device))


@_linear_cross_entropy_op.register_fake
def _(hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, chunk_size, check_targets, want_dh,
      want_dw, want_db, ce_weight, lse_square_scale, softcap, return_z_loss, return_token_accuracy,
      return_predicted_tokens, accum_dtype=None, use_token_scaling=False):
    grads = reduction != "none"
    return (*_fake_fields(targets, reduction, return_z_loss, return_token_accuracy, return_predicted_tokens),
            *_fake_linear_grads(hidden, weight, want_dh and grads, want_dw and grads, want_db and grads))


@torch.library.custom_op("playbook::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward_op(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                      targets: torch.Tensor, grad_output: torch.Tensor, ignore_index: int,
                                      label_smoothing: float, chunk_size: Optional[int], want_dh: bool, want_dw: bool,
                                      want_db: bool, ce_weight: Optional[torch.Tensor], lse_square_scale: float,
                                      softcap: Optional[float], accum_dtype: Optional[torch.dtype] = None,
                                      use_token_scaling: bool = False
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none"'s backward as an operator: (dh, dW, db), placeholders where not wanted."""
    grads = _linear_none_backward(hidden, weight, bias, targets, grad_output, (want_dh, want_dw, want_db),
                                  ignore_index, label_smoothing, chunk_size, ce_weight, lse_square_scale, softcap,
                                  accum_dtype, use_token_scaling)
    return tuple(_empty(hidden.device) if g is None else g for g in grads)


@_linear_cross_entropy_backward_op.register_fake
def _(hidden, weight, bias, targets, grad_output, ignore_index, label_smoothing, chunk_size, want_dh, want_dw,
      want_db, ce_weight, lse_square_scale, softcap, accum_dtype=None, use_token_scaling=False):
    return _fake_linear_grads(hidden, weight, want_dh, want_dw, want_db)


def _linear_cross_entropy_setup_context(ctx, inputs, output):
    (hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, chunk_size, _, want_dh, want_dw, want_db,
     ce_weight, lse_square_scale, softcap, _, _, _, accum_dtype, use_token_scaling) = inputs
    ctx.mark_non_differentiable(*output[1:])  # only the loss has a gradient
    ctx.reduction, ctx.wants = reduction, (want_dh, want_dw, want_db)
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, bias, targets, ce_weight)
        ctx.args = (ignore_index, label_smoothing, chunk_size, lse_square_scale, softcap, accum_dtype,
                    use_token_scaling)
    else:
        ctx.save_for_backward(*output[4:])  # dh, dW, db, already scaled for the reduction


def _linear_cross_entropy_op_backward(ctx, grad_output, *extras_grads):
    if ctx.reduction == "none":
        hidden, weight, bias, targets, ce_weight = ctx.saved_tensors
        ignore_index, label_smoothing, chunk_size, lse_square_scale, softcap, accum_dtype, use_token_scaling = ctx.args
        grads = torch.ops.playbook.linear_cross_entropy_backward(
            hidden, weight, bias, targets, grad_output, ignore_index, label_smoothing, chunk_size, *ctx.wants,
            ce_weight, lse_square_scale, softcap, accum_dtype, use_token_scaling)
    else:
        grads = ctx.saved_tensors
        for grad, wanted in zip(grads, ctx.wants):
            if wanted:  # in place, as in cross_entropy's backward: a second backward fails instead of scaling twice
                torch.ops.playbook.scale_rows_(grad, grad_output)
    return tuple(grad if wanted else None for grad, wanted in zip(grads, ctx.wants)) + (None,) * 17


_linear_cross_entropy_op.register_autograd(_linear_cross_entropy_op_backward,
                                           setup_context=_linear_cross_entropy_setup_context)


def linear_cross_entropy(hidden, weight, targets, bias=None, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                         chunk_size=None, check_targets=False, *, ce_weight=None, lse_square_scale=0.0, softcap=None,
                         return_z_loss=False, return_token_accuracy=False, return_predicted_tokens=False,
                         accum_dtype=None, use_token_scaling=False):
    """`F.cross_entropy(F.linear(hidden, weight, bias), targets, ...)` without materializing the [N, V] logits.

    hidden [N, H] or [B, T, H]; weight [V, H] (lm_head.weight as stored); bias [V] or None; targets [N] or [B, T].
    Same semantics, errors and fp32 loss as `cross_entropy` (including NaN for a mean over no rows). Gradients flow to
    hidden, weight and bias as far as they require grad (a frozen weight, as in LoRA, costs no dW matmul).
    chunk_size = rows per chunk; by default LCE_CHUNK_ROWS, fewer where they would hold more than LCE_CHUNK_BUDGET_BYTES
    of logits (a multiple of 64 rows). For mean/sum the gradients are computed in this call (its backward only scales
    them); for "none" the backward recomputes the chunks. The extras are those of `cross_entropy`, the class weights
    named ce_weight (as in Liger's fused linear cross-entropy); the token accuracy and predicted tokens come without the
    logits ever being held.
    Two more options with Liger's names and meaning: accum_dtype=torch.float32 sums dW over the chunks in fp32 and
    rounds it to the weight's dtype once (None: in the weight's dtype, one rounding per chunk); use_token_scaling=True
    multiplies each row's loss, z-loss and gradient by the softmax probability of its target (after the softcap),
    without a gradient through that factor; "mean" still divides by the non-ignored rows (or their class weights).
    torch.compile traces the call as the operator torch.ops.playbook.linear_cross_entropy.
    """
    extras = dict(weight=ce_weight, lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
                  return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens)
    _validate_linear_cross_entropy(hidden, weight, targets, bias, reduction, label_smoothing, extras, accum_dtype,
                                   use_token_scaling)
    grad_enabled = torch.is_grad_enabled()
    wants = (grad_enabled and hidden.requires_grad, grad_enabled and weight.requires_grad,
             grad_enabled and bias is not None and bias.requires_grad)
    # Eager calls take the autograd.Function (cheaper to dispatch, see `cross_entropy`); torch.compile traces the
    # operator.
    if torch.compiler.is_compiling():
        fields = torch.ops.playbook.linear_cross_entropy(hidden, weight, bias, targets, ignore_index, reduction,
                                                         label_smoothing, chunk_size, check_targets, *wants,
                                                         *extras.values(), accum_dtype, use_token_scaling)
        return _from_fields(fields[:4], return_z_loss, return_token_accuracy, return_predicted_tokens)
    if any(wants):
        result = LinearCrossEntropyFunction.apply(hidden, weight, bias, targets, ignore_index, reduction,
                                                  label_smoothing, chunk_size, check_targets, *wants,
                                                  *extras.values(), accum_dtype, use_token_scaling)
        return CrossEntropyOutput(*result) if isinstance(result, tuple) else result
    terms, _ = _linear_forward(hidden, weight, bias, targets, ignore_index, reduction, label_smoothing, chunk_size,
                               check_targets, wants, extras, accum_dtype, use_token_scaling)
    return terms.result()


class TritonLinearCrossEntropyLoss(_LossModule):
    """Loss module taking (hidden, weight, targets[, bias]); use it with lm_head.weight instead of calling lm_head.
    The keyword-only arguments are the extras and options of `linear_cross_entropy` (ce_weight is a buffer), as
    Liger's LigerFusedLinearCrossEntropyLoss takes them."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, chunk_size=None, check_targets=False,
                 *, ce_weight=None, lse_square_scale=0.0, softcap=None, return_z_loss=False,
                 return_token_accuracy=False, return_predicted_tokens=False, accum_dtype=None,
                 use_token_scaling=False):
        who = "TritonLinearCrossEntropyLoss"
        extras = dict(weight=ce_weight, lse_square_scale=lse_square_scale, softcap=softcap, return_z_loss=return_z_loss,
                      return_token_accuracy=return_token_accuracy, return_predicted_tokens=return_predicted_tokens)
        _check_common_args(who, reduction, label_smoothing)
        _check_extras(who, extras, weight_name="ce_weight")
        _check_linear_options(who, accum_dtype, use_token_scaling)
        super().__init__("ce_weight", extras.pop("weight"), dict(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, chunk_size=chunk_size,
            check_targets=check_targets, **extras, accum_dtype=accum_dtype, use_token_scaling=use_token_scaling))

    def forward(self, hidden, weight, targets, bias=None):
        return linear_cross_entropy(hidden, weight, targets, bias, **self._options())


# ----------------------------------------------------------------------------------------------------------------------
# 4. Run as a script
# ----------------------------------------------------------------------------------------------------------------------
def _main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    big = not INTERPRETER
    parser.add_argument("--rows", type=int, default=4096 if big else 64,
                        help="tokens (default: 4096 on a GPU, 64 on the CPU interpreter)")
    parser.add_argument("--vocab", type=int, default=128256 if big else 1000,
                        help="vocabulary size V (default: 128256 on a GPU, 1000 on the CPU interpreter)")
    parser.add_argument("--hidden", type=int, default=4096 if big else 32,
                        help="hidden size H (default: 4096 on a GPU, 32 on the CPU interpreter)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="hidden and weight dtype")
    args = parser.parse_args(argv)
    if min(args.rows, args.vocab, args.hidden) < 1:
        parser.error(f"need --rows, --vocab and --hidden >= 1, got {args.rows}, {args.vocab} and {args.hidden}")
    import torch.nn.functional as F

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    N, V, H = args.rows, args.vocab, args.hidden
    targets = torch.randint(0, V, (N,), device=KERNEL_DEVICE)
    targets[torch.rand(N, device=KERNEL_DEVICE) < 0.2] = -100  # 20 % ignored rows, as masked prompt tokens
    hidden = torch.randn(N, H, device=KERNEL_DEVICE).to(dtype)
    weight = (torch.randn(V, H, device=KERNEL_DEVICE) * 2 / H**0.5).to(dtype)

    def loss_and_grads(fn, leaves):
        copies = [x.detach().clone().requires_grad_() for x in leaves]
        loss = fn(*copies)
        return [loss.detach(), *torch.autograd.grad(loss, copies)]

    # The tests' rule: our error no worse than eager's in the same dtype times 3, or under about 1 ulp.
    floor = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    ref = loss_and_grads(lambda h, w: F.cross_entropy(F.linear(h, w), targets), [hidden.double(), weight.double()])
    eager = loss_and_grads(lambda h, w: F.cross_entropy(F.linear(h, w), targets), [hidden, weight])
    ours = loss_and_grads(lambda h, w: linear_cross_entropy(h, w, targets), [hidden, weight])
    errs = [_max_rel_err(x, r) for x, r in zip(ours, ref)]
    eager_errs = [_max_rel_err(x, r) for x, r in zip(eager, ref)]
    ok = all(e <= max(3 * t, f) for e, t, f in zip(errs, eager_errs, (1e-5, floor, floor)))
    print(f"linear_cross_entropy {args.dtype} [{N}, {H}] -> {V}: max rel err loss {errs[0]:.1e}, dh {errs[1]:.1e}, "
          f"dW {errs[2]:.1e} (eager {args.dtype}: {eager_errs[0]:.1e}, {eager_errs[1]:.1e}, {eager_errs[2]:.1e}) "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_main())
