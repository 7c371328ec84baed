"""Fused rotary position embedding (RoPE) for LLaMA attention: q and k rotated in one kernel, forward and backward.

What it computes
----------------
Before attention, LLaMA rotates every query and key head by an angle that depends on the token's position
(transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`; rotate_half(x) = cat(-x[..., D/2:],
x[..., :D/2])):  q_embed = q * cos + rotate_half(q) * sin,  and k_embed likewise.  q is [B, n_q_heads, T, D], k is
[B, n_kv_heads, T, D] (LLaMA-3.1-8B: 32 and 8 heads of D = 128), cos and sin are [B or 1, T, D], one row per token
shared by all heads. Per half (x1 = x[..., :D/2], x2 = x[..., D/2:], likewise c1, c2, s1, s2 of cos and sin):
    forward:   out1 = x1 * c1 - x2 * s1             out2 = x2 * c2 + x1 * s2
    backward:  dx1  = g1 * c1 + g2 * s2             dx2  = g2 * c2 - g1 * s1          (g = upstream gradient)
The whole expression runs in fp32 and is rounded once. cos and sin get no gradient (LLaMA computes them under no_grad).

cos and sin may also be a 2-D [T, D] table, shared by every sequence of the batch (as vision RoPE passes it;
Liger-Kernel's LigerRopeFunction takes it the same way): the launchers view it as [1, T, D], so the kernel is the same.
transformers' own apply_rotary_pos_emb would broadcast such a table differently (cos.unsqueeze(1) is [T, 1, D], which
lines the tokens up with q's heads axis), so for 2-D tables this is Liger's meaning, not a drop-in. An odd head_dim is
refused: RoPE rotates pairs of columns (i, i + D/2), and with D odd one column has no partner. transformers has no
meaning for it either (LlamaRotaryEmbedding then builds D + 1 cos columns, which do not broadcast against q), nor has
Liger-Kernel (its kernel rotates halves of D // 2 columns and leaves the last column as it was). A model that rotates
only part of each head (partial_rotary_factor) rotates an even-width slice and passes the rest through, as
transformers' models do.

Bytes it must move
------------------
With N = B * T tokens and H = n_q_heads + n_kv_heads: the forward reads q, k, cos, sin and writes q_embed, k_embed;
the backward reads dq_embed, dk_embed, cos, sin and writes dq, dk: (2 * H + 2) * N * D elements each way. Eager runs
mul, slice/neg/cat, mul and add per tensor (more in the backward), writing a full-size intermediate after each: about
5x the bytes. RoPE does a few FLOPs per byte, so time follows bytes and fusing is the win. Memory is no gain: eager
autograd, like this backward, keeps only cos and sin, which LLaMA shares between all layers of a step.

Triton concepts introduced here (new relative to rmsnorm_kernel.py, which introduces the basics)
------------------------------------------------------------------------------------------------
- 3-D tiles and broadcasting: a program holds [tokens, heads, columns] tiles of q, and cos/sin tiles shaped
  [tokens, 1, columns], whose size-1 axis broadcasts them over the heads ([T, 1, D] against [T, H, D]).
- Compile-time shape constants: head counts and D/2 are tl.constexpr, so the compiler knows LLaMA's tiles need no
  masks and vectorizes every load (one compilation per model; the token count stays a run-time argument).
- A @triton.jit helper, `_rotate_heads`, called twice (for q and for k); Triton inlines it into the kernel.
- Transposed views read through their batch, head and token strides: LlamaAttention passes
  `q_proj(x).view(B, T, heads, D).transpose(1, 2)`, which the kernel reads without a copy.
- A cached launch config: functools.lru_cache remembers the tile shape per input shape (host time counts here).

Limits
------
q and k 4-D with the same batch and token count, head_dim even and the same in q, k, cos and sin; cos and sin
[B or 1, T or 1, D] or [T, D]; one dtype for all four (fp32, bf16, fp16), one device; unsqueeze_dim 1 or 2. A
last dimension that is not contiguous is copied. Offsets are int64. Without a GPU the same kernel runs on Triton's CPU
interpreter (slow: toy sizes).

torch.compile traces the kernel as a custom operator (section 3, as in rmsnorm_kernel.py).
"""
import contextlib
import functools
import os
import sys
import types

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


__all__ = ["rope_forward", "rope_backward", "RoPEFunction", "apply_rotary_pos_emb", "apply_rope", "ROPE_FAMILIES"]


# ----------------------------------------------------------------------------------------------------------------------
# 1. Kernels
# ----------------------------------------------------------------------------------------------------------------------
# One program handles BLOCK_T consecutive tokens of one sequence: it loads those tokens' cos and sin rows once, then
# rotates ALL query heads and ALL key heads of those tokens (one launch for q and k, so cos and sin are read once per
# token instead of once per tensor). The grid is (token blocks, batch). A tile is 3-D:
# [BLOCK_T tokens, BLOCK_H heads, BLOCK_HALF columns of one half of the head]; the two halves are loaded as two tiles,
# because each output half needs both input halves. On the GPU BLOCK_T is 1 at LLaMA-3.1-8B's shape (32 heads x 64
# columns = 2048 elements per half tile); on the CPU interpreter a program covers many tokens.
#
# Cast order: eager runs separate elementwise ops in the model dtype: q * cos, rotate_half(q) (a negation and a
# concatenation: exact), its product with sin, and the sum. Each product and the sum compute in fp32 and ROUND to
# bf16, so q_embed = round(round(q * cos) + round(rotate_half(q) * sin)): three roundings. Those intermediate roundings
# are an artifact of running separate ops, not part of the function (unlike LlamaRMSNorm's cast back to the input
# dtype, which the model's code asks for), so this kernel computes the whole expression in fp32 and rounds ONCE: at
# most half a unit in the last place from the exact result, where eager's three roundings can lose more (bf16,
# 2 x 8 x 512 x 128: max error 0.015 against eager's 0.027). About a fifth of the bf16 outputs then differ from eager's
# in the last bit; in fp32 the two agree to rounding.
#
# The backward is the transpose of the rotation: dx = g * cos + rotate_half^T(g * sin), rotate_half^T(y) =
# cat(y[..., D/2:], -y[..., :D/2]). LlamaRotaryEmbedding builds cos and sin from cat(freqs, freqs), so their halves are
# equal (c1 = c2, s1 = s2) and the backward is the forward with sin negated; the kernel uses the exact formula, which
# is right for any cos and sin.
@triton.jit
def _rotate_heads(
    x_ptr,             # q or k (or their upstream gradients in the backward): [B, heads, T, D], unit stride along D
    out_ptr,           # the rotated result, same shape and dtype, its own strides
    x_batch_stride,    # x's strides in elements: LLaMA's transposed views have head stride D and token stride heads * D
    x_head_stride,
    x_token_stride,
    out_batch_stride,  # out's strides
    out_head_stride,
    out_token_stride,
    batch,             # this program's sequence (int64)
    tokens,            # [BLOCK_T] this program's token indices (int64)
    token_mask,        # [BLOCK_T] False past the end of the sequence
    cos1, cos2, sin1, sin2,  # [BLOCK_T, 1, BLOCK_HALF] fp32 halves of cos and sin, loaded once by the kernel
    N_HEADS: tl.constexpr,     # heads of x (32 for q, 8 for k in LLaMA-3.1-8B)
    HALF: tl.constexpr,        # D / 2
    BLOCK_H: tl.constexpr,     # heads per tile (a power of two)
    BLOCK_HALF: tl.constexpr,  # HALF rounded up to a power of two
    BACKWARD: tl.constexpr,    # True: apply the transposed rotation
):
    """Rotate every head of x for this program's tokens. A @triton.jit function called from a kernel is inlined."""
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF  # BLOCK_HALF is D/2 rounded up to a power of two (D = 10 gives HALF 5, BLOCK_HALF 8)
    tok = tokens[:, None, None]  # [BLOCK_T, 1, 1]: [:, None, None] adds two size-1 axes that broadcast
    # A loop over head blocks with a compile-time bound: one step for LLaMA (all 32 heads fit one tile); more for very
    # wide models, whose whole row of heads would not fit in registers.
    for head_start in range(0, N_HEADS, BLOCK_H):
        heads = head_start + tl.arange(0, BLOCK_H)
        # [BLOCK_T, BLOCK_H, BLOCK_HALF] by broadcasting three 1-D masks, one per axis.
        mask = token_mask[:, None, None] & (heads < N_HEADS)[None, :, None] & col_mask[None, None, :]
        # heads are int64 too: every term of the offset is int64, so no product can wrap at 2^31.
        head = heads.to(tl.int64)[None, :, None]
        x_first = x_ptr + batch * x_batch_stride + tok * x_token_stride + head * x_head_stride + cols[None, None, :]
        # Load in the storage dtype and compute in fp32 (bf16 keeps only 8 bits of mantissa). The second half starts
        # HALF elements after the first: the column stride is 1 (the launcher guarantees it).
        x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_first + HALF, mask=mask, other=0.0).to(tl.float32)
        # cos1 ... sin2 are [BLOCK_T, 1, BLOCK_HALF]: the size-1 axis repeats each token's row over the heads.
        if BACKWARD:  # the transposed rotation: note the swapped sin halves and signs
            y1 = x1 * cos1 + x2 * sin2
            y2 = x2 * cos2 - x1 * sin1
        else:
            y1 = x1 * cos1 - x2 * sin1
            y2 = x2 * cos2 + x1 * sin2
        out_first = (out_ptr + batch * out_batch_stride + tok * out_token_stride + head * out_head_stride
                     + cols[None, None, :])
        # One rounding to the output dtype, after the whole expression (see "Cast order" above).
        tl.store(out_first, _round_to(y1, out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_first + HALF, _round_to(y2, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr,          # inputs [B, n_q_heads, T, D] and [B, n_kv_heads, T, D] (upstream gradients in the backward)
    cos_ptr, sin_ptr,      # [B or 1, T, D]
    q_out_ptr, k_out_ptr,  # outputs, shaped like q and k
    q_batch_stride, q_head_stride, q_token_stride,  # every tensor's own strides, in elements
    k_batch_stride, k_head_stride, k_token_stride,
    q_out_batch_stride, q_out_head_stride, q_out_token_stride,
    k_out_batch_stride, k_out_head_stride, k_out_token_stride,
    cos_batch_stride, cos_token_stride,  # 0 along a broadcast (size-1) dimension of cos / sin
    sin_batch_stride, sin_token_stride,
    n_tokens,                    # T: varies from batch to batch, so a run-time argument
    N_Q_HEADS: tl.constexpr,     # head counts and D / 2 are compile-time constants (one compilation per model): the
    N_KV_HEADS: tl.constexpr,    # compiler then knows that LLaMA's tiles need no column or head mask and that the
    HALF: tl.constexpr,          # second half starts 64 elements after the first, and it vectorizes every load
    BLOCK_T: tl.constexpr,       # tokens per program
    BLOCK_QH: tl.constexpr,      # heads per tile for q and for k
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,    # HALF rounded up to a power of two
    BACKWARD: tl.constexpr,      # False: forward rotation; True: its transpose
):
    # int64 before any multiplication by a stride: at 8B's shape q holds 4096 elements per token, so token * stride
    # passes 2^31 at 524288 tokens, and an int32 product would silently wrap to a wrong address.
    batch = tl.program_id(1).to(tl.int64)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < n_tokens  # the last token block may hang over the end of the sequence
    tokens = tokens.to(tl.int64)

    # cos and sin rows of these tokens, both halves, as [BLOCK_T, 1, BLOCK_HALF]: the size-1 axis broadcasts them
    # over the heads. A batch stride of 0 makes every sequence read the same rows (cos shaped [1, T, D]).
    cols = tl.arange(0, BLOCK_HALF)
    cs_mask = token_mask[:, None, None] & (cols < HALF)[None, None, :]
    cos_first = cos_ptr + batch * cos_batch_stride + tokens[:, None, None] * cos_token_stride + cols[None, None, :]
    sin_first = sin_ptr + batch * sin_batch_stride + tokens[:, None, None] * sin_token_stride + cols[None, None, :]
    cos1 = tl.load(cos_first, mask=cs_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_first + HALF, mask=cs_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_first, mask=cs_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_first + HALF, mask=cs_mask, other=0.0).to(tl.float32)

    # The same helper twice: q's heads, then k's, with the cos/sin tiles already in registers.
    _rotate_heads(q_ptr, q_out_ptr, q_batch_stride, q_head_stride, q_token_stride,
                  q_out_batch_stride, q_out_head_stride, q_out_token_stride,
                  batch, tokens, token_mask, cos1, cos2, sin1, sin2,
                  N_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF, BACKWARD)
    _rotate_heads(k_ptr, k_out_ptr, k_batch_stride, k_head_stride, k_token_stride,
                  k_out_batch_stride, k_out_head_stride, k_out_token_stride,
                  batch, tokens, token_mask, cos1, cos2, sin1, sin2,
                  N_KV_HEADS, HALF, BLOCK_KH, BLOCK_HALF, BACKWARD)


# ----------------------------------------------------------------------------------------------------------------------
# 2. Launchers
# ----------------------------------------------------------------------------------------------------------------------
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _validate(q, k, cos, sin, who):
    """Raise a clear error for inputs the kernel cannot take (instead of reading garbage or crashing).
    Only attribute reads: no torch ops, no host syncs (this runs twice per layer per step)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{who}: {name} must be floating point, got {t.dtype}")
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ValueError(f"{who}: {name} must be 4-D [batch, heads, tokens, head_dim], got shape {tuple(t.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() not in (2, 3):
            raise ValueError(f"{who}: {name} must be 3-D [batch or 1, tokens, head_dim] or 2-D [tokens, head_dim], "
                             f"got shape {tuple(t.shape)}")
    batch, _, n_tokens, head_dim = q.shape
    if head_dim == 0 or head_dim % 2:
        raise ValueError(f"{who}: head_dim must be even and positive, got {head_dim}: RoPE rotates column pairs "
                         f"(i, i + head_dim/2), and an odd head_dim leaves one column without a partner (to rotate "
                         f"part of a head, pass an even-width slice and concatenate the rest)")
    if k.shape[0] != batch or k.shape[2] != n_tokens:
        raise ValueError(f"{who}: q {tuple(q.shape)} and k {tuple(k.shape)} must have the same batch (dim 0) and "
                         f"tokens (dim 2)")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.shape[-1] != head_dim:
            raise ValueError(f"{who}: head_dim mismatch: q has {head_dim}, {name} has {t.shape[-1]} "
                             f"(shape {tuple(t.shape)})")
    for name, t in (("cos", cos), ("sin", sin)):
        if (t.dim() == 3 and t.shape[0] not in (1, batch)) or t.shape[-2] not in (1, n_tokens):
            raise ValueError(f"{who}: {name} of shape {tuple(t.shape)} does not broadcast to [batch, tokens, head_dim]"
                             f" = [{batch}, {n_tokens}, {head_dim}] (batch and tokens must match q's or be 1)")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{who}: q has dtype {q.dtype}; supported: float32, bfloat16, float16")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.dtype != q.dtype:
            raise TypeError(f"{who}: q, k, cos and sin must have the same dtype, got q {q.dtype} and {name} {t.dtype} "
                            f"(LlamaRotaryEmbedding returns cos/sin in the model dtype)")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{who}: q, k, cos and sin must be on the same device, got q on {q.device} and {name} "
                             f"on {t.device}")
    _check_device(who, "q", q)


def _on_tensor_device(t):
    """Triton launches on the CURRENT CUDA device: switch to t's GPU only when it is another one, because entering
    torch.cuda.device() on every call costs host time, and this kernel runs twice per layer per step (measured with
    the SwiGLU launcher on an H200, see results/NOTES.md)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _unit_column_stride(t):
    """t itself when its last dimension is contiguous in memory (LLaMA's transposed views are), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _as_3d(t):
    """A [T, D] cos/sin table as the [1, T, D] view the kernel reads (batch stride 0: shared by every sequence)."""
    return t.unsqueeze(0) if t.dim() == 2 else t


def _broadcast_strides(t):
    """(batch stride, token stride) of a [B or 1, T or 1, D] cos/sin; 0 along a broadcast (size-1) dimension, so
    every sequence (or token) reads the same row."""
    return (0 if t.shape[0] == 1 else t.stride(0)), (0 if t.shape[1] == 1 else t.stride(1))


# The same few shapes come every step, so the arithmetic below is cached per shape (~8 us of host time a call saved;
# the kernel runs twice per layer per step).
@functools.lru_cache(maxsize=256)
def _launch_config(n_tokens, n_q_heads, n_kv_heads, head_dim, block_t, block_heads):
    """(BLOCK_T, BLOCK_QH, BLOCK_KH, BLOCK_HALF, num_warps). block_t (tokens per program) and block_heads (heads per
    tile) override the defaults, for tests: they make a small input span many token blocks and loop over several head
    blocks. Tile dimensions are powers of two (tl.arange)."""
    for name, value in (("block_t", block_t), ("block_heads", block_heads)):
        if value is not None and (value < 1 or value & (value - 1)):
            raise ValueError(f"{name} must be a positive power of two, got {value}")
    block_half = triton.next_power_of_2(head_dim // 2)
    # Elements per half tile: GPU 2048 = all 32 heads x 64 columns of one LLaMA-3.1-8B token (8 KB of bf16 in flight
    # per program for q, both halves, 16 elements per thread at 4 warps; no register spills), within 1 % of the best
    # launch shape measured on an H200 (see results/NOTES.md). Interpreter: big tiles, because it pays ~1 ms per
    # program.
    elements_per_tile = 16384 if INTERPRETER else 2048
    max_heads = block_heads or max(1, elements_per_tile // block_half)
    block_qh = min(triton.next_power_of_2(max(n_q_heads, 1)), max_heads)
    block_kh = min(triton.next_power_of_2(max(n_kv_heads, 1)), max_heads)
    block_t = block_t or max(1, min(triton.next_power_of_2(n_tokens), elements_per_tile // (block_qh * block_half)))
    num_warps = 4 if block_t * block_qh * block_half <= 2048 else 8
    return block_t, block_qh, block_kh, block_half, num_warps


def _launch(q, k, cos, sin, q_out, k_out, backward, block_t, block_heads):
    batch, n_q_heads, n_tokens, head_dim = q.shape
    n_kv_heads = k.shape[1]
    block_t, block_qh, block_kh, block_half, warps = _launch_config(n_tokens, n_q_heads, n_kv_heads, head_dim,
                                                                    block_t, block_heads)
    cos_batch_stride, cos_token_stride = _broadcast_strides(cos)
    sin_batch_stride, sin_token_stride = _broadcast_strides(sin)
    grid = (triton.cdiv(n_tokens, block_t), batch)  # tokens on axis 0 (limit 2^31 - 1), batch on axis 1 (65535)
    with _on_tensor_device(q):
        _rope_kernel[grid](
            q, k, cos, sin, q_out, k_out,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            q_out.stride(0), q_out.stride(1), q_out.stride(2),
            k_out.stride(0), k_out.stride(1), k_out.stride(2),
            cos_batch_stride, cos_token_stride, sin_batch_stride, sin_token_stride,
            n_tokens, N_Q_HEADS=n_q_heads, N_KV_HEADS=n_kv_heads, HALF=head_dim // 2,
            BLOCK_T=block_t, BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_HALF=block_half, BACKWARD=backward,
            num_warps=warps,
        )


def rope_forward(q, k, cos, sin, *, block_t=None, block_heads=None):
    """(q_embed, k_embed) = (q * cos + rotate_half(q) * sin, same for k), for q [B, Hq, T, D], k [B, Hkv, T, D],
    cos/sin [B or 1, T, D] or [T, D]. The outputs keep q's and k's memory layout. Not differentiable (see
    `apply_rotary_pos_emb`). block_t / block_heads: tile overrides for tests."""
    _validate(q, k, cos, sin, "rope_forward")
    q, k, cos, sin = (_unit_column_stride(t) for t in (q, k, _as_3d(cos), _as_3d(sin)))
    # empty_like keeps the strides of a dense tensor: LLaMA's transposed q gives a transposed q_embed, so attention
    # sees the same strides as in eager.
    q_embed, k_embed = torch.empty_like(q), torch.empty_like(k)
    if q.shape[0] * q.shape[2] > 0:  # no tokens: nothing to launch (a grid dimension of 0 is not allowed)
        _launch(q, k, cos, sin, q_embed, k_embed, False, block_t, block_heads)
    return q_embed, k_embed


def rope_backward(dq_embed, dk_embed, cos, sin, *, block_t=None, block_heads=None):
    """(dq, dk) from the upstream gradients, in fresh buffers laid out like those gradients. The gradients may be
    strided any way (attention's backward decides); a gradient whose last dimension is not contiguous is copied.
    block_t / block_heads: tile overrides for tests."""
    _validate(dq_embed, dk_embed, cos, sin, "rope_backward")
    dq_embed, dk_embed, cos, sin = (_unit_column_stride(t) for t in (dq_embed, dk_embed, _as_3d(cos), _as_3d(sin)))
    dq, dk = torch.empty_like(dq_embed), torch.empty_like(dk_embed)
    if dq_embed.shape[0] * dq_embed.shape[2] > 0:
        _launch(dq_embed, dk_embed, cos, sin, dq, dk, True, block_t, block_heads)
    return dq, dk


# ----------------------------------------------------------------------------------------------------------------------
# 3. Autograd Function, custom operators (torch.compile), functional API, module, model patching
# ----------------------------------------------------------------------------------------------------------------------
class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        q_embed, k_embed = rope_forward(q, k, cos, sin)
        # The backward needs only cos and sin, not q or k. LLaMA passes every layer the SAME cos/sin tensors, so
        # saving them costs no extra memory.
        ctx.save_for_backward(cos, sin)
        return q_embed, k_embed

    @staticmethod
    def backward(ctx, dq_embed, dk_embed):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_backward(dq_embed, dk_embed, cos, sin)
        return dq, dk, None, None  # no gradient for cos and sin (checked in apply_rotary_pos_emb)


# torch.compile cannot look inside a launcher, so the kernel becomes a custom operator, an opaque node of the graph
# (see rmsnorm_kernel.py, where this is introduced): register_fake gives its outputs' shapes and strides without
# running it, register_autograd its backward, a custom operator too.
@torch.library.custom_op("playbook::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_forward as an operator: (q_embed, k_embed)."""
    return rope_forward(q, k, cos, sin)


def _like_launcher_output(t):
    """An empty tensor laid out as the launchers allocate their outputs: empty_like of t, copied first when t's last
    dimension is not contiguous. The strides matter: attention reads q_embed through them."""
    return torch.empty_like(_unit_column_stride(t))


@_rope_op.register_fake
def _(q, k, cos, sin):
    _validate(q, k, cos, sin, "apply_rotary_pos_emb")  # bad input fails while tracing, with the launcher's message
    return _like_launcher_output(q), _like_launcher_output(k)


@torch.library.custom_op("playbook::rope_backward", mutates_args=())
def _rope_backward_op(dq_embed: torch.Tensor, dk_embed: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_backward as an operator: (dq, dk)."""
    return rope_backward(dq_embed, dk_embed, cos, sin)


@_rope_backward_op.register_fake
def _(dq_embed, dk_embed, cos, sin):
    return _like_launcher_output(dq_embed), _like_launcher_output(dk_embed)


def _rope_setup_context(ctx, inputs, output):
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)  # what RoPEFunction saves


def _rope_op_backward(ctx, dq_embed, dk_embed):
    cos, sin = ctx.saved_tensors
    dq, dk = torch.ops.playbook.rope_backward(dq_embed, dk_embed, cos, sin)
    return dq, dk, None, None  # no gradient for cos and sin, as in RoPEFunction


_rope_op.register_autograd(_rope_op_backward, setup_context=_rope_setup_context)


def _rope(q, k, cos, sin):
    """(q_embed, k_embed) for q [B, Hq, T, D], k [B, Hkv, T, D], differentiable in q and k."""
    # Eager calls take the autograd.Function, whose dispatch costs tens of microseconds less host time per call than a
    # custom operator's (see rms_norm in rmsnorm_kernel.py); under torch.compile only the operator can be traced.
    if torch.compiler.is_compiling():
        return torch.ops.playbook.rope(q, k, cos, sin)
    return RoPEFunction.apply(q, k, cos, sin)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """Drop-in for transformers' `apply_rotary_pos_emb`, same signature and result (one rounding instead of three,
    see "Cast order" above the kernels), differentiable in q and k, and traced by torch.compile as the operator
    torch.ops.playbook.rope.

    unsqueeze_dim=1 (LLaMA): q [B, Hq, T, D], k [B, Hkv, T, D]; unsqueeze_dim=2: q [B, T, Hq, D], k [B, T, Hkv, D]
    (the same kernel on the transposed views). cos, sin: [B or 1, T, D] in q's dtype, not requiring grad, or a
    [T, D] table shared by the batch (Liger's meaning; see the module docstring)."""
    if torch.is_grad_enabled() and (getattr(cos, "requires_grad", False) or getattr(sin, "requires_grad", False)):
        raise ValueError("apply_rotary_pos_emb: the fused RoPE kernel computes no gradient for cos and sin, but they "
                         "require grad; compute them under torch.no_grad() (as LlamaRotaryEmbedding does) or detach "
                         "them")
    if unsqueeze_dim in (1, -3):  # where cos.unsqueeze(dim) puts the head axis of a 4-D q: 1 and -3 are the same
        return _rope(q, k, cos, sin)
    if unsqueeze_dim in (2, -2):
        for name, t in (("q", q), ("k", k)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"apply_rotary_pos_emb: with unsqueeze_dim=2, {name} must be 4-D "
                                 f"[batch, tokens, heads, head_dim], got {got}")
        # [B, T, H, D] -> [B, H, T, D] views: only the strides change, so the same kernel applies, and the outputs
        # (allocated like these views) transpose back to the caller's layout.
        q_embed, k_embed = _rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_embed.transpose(1, 2), k_embed.transpose(1, 2)
    raise NotImplementedError(f"apply_rotary_pos_emb: unsqueeze_dim={unsqueeze_dim} is not supported; use 1 "
                              f"(q, k as [batch, heads, tokens, head_dim], LLaMA's layout) or 2 "
                              f"([batch, tokens, heads, head_dim])")


class SplitQKVFunction(torch.autograd.Function):
    """SplitQKVFunction.apply(qkv, sizes): the column blocks of one fused projection's output, qkv [..., sum(sizes)],
    as views (Phi-3's q, k and v). Phi3Attention takes them by indexing qkv three times; each index's backward writes
    its gradient into a zeroed buffer of qkv's full size, and autograd adds the three: seven full-size passes over
    [tokens, (n_q_heads + 2 n_kv_heads) x head_dim] per layer. This backward is one cat of the three gradients."""

    @staticmethod
    def forward(ctx, qkv, sizes):
        return qkv.split(sizes, dim=-1)

    @staticmethod
    def backward(ctx, *grads):
        # A block the loss does not use arrives as zeros (autograd materializes its gradient), as indexing gives.
        return torch.cat(grads, dim=-1), None


def split_qkv(qkv, sizes):
    """qkv.split(sizes, dim=-1), differentiable with one cat as the backward (see SplitQKVFunction). Under
    torch.compile the plain split: the compiler plans the gradient's buffer itself."""
    if torch.compiler.is_compiling():
        return qkv.split(sizes, dim=-1)
    return SplitQKVFunction.apply(qkv, tuple(sizes))


def phi3_attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    """Phi3Attention.forward of transformers 5.x with q, k and v taken from qkv_proj's output by split_qkv instead of
    three indexings, and the fused RoPE (the modeling module's apply_rotary_pos_emb, patched by apply_rope). The rest,
    line for line transformers': the attention implementation the config names, o_proj."""
    modeling = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q_size = self.config.num_attention_heads * self.head_dim
    kv_size = self.num_key_value_heads * self.head_dim
    query, key, value = (t.view(hidden_shape).transpose(1, 2)
                         for t in split_qkv(self.qkv_proj(hidden_states), (q_size, kv_size, kv_size)))
    cos, sin = position_embeddings
    query, key = modeling.apply_rotary_pos_emb(query, key, cos, sin)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, self.layer_idx)
    attention = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                               modeling.eager_attention_forward)
    output, weights = attention(self, query, key, value, attention_mask,
                                dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                sliding_window=getattr(self.config, "sliding_window", None), **kwargs)
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


# The attention class of each supported model family (transformers' config.model_type). Each family's modeling file
# has its own module-level copy of apply_rotary_pos_emb, with LLaMA's signature and math, which its attention looks up
# at call time.
ROPE_FAMILIES = {"llama": "LlamaAttention", "mistral": "MistralAttention", "qwen2": "Qwen2Attention",
                 "qwen3": "Qwen3Attention", "gemma2": "Gemma2Attention", "gemma3_text": "Gemma3Attention",
                 "phi3": "Phi3Attention"}


def apply_rope(model):
    """The patch entry point: makes the attention of a transformers model of a family in ROPE_FAMILIES call the fused
    kernel; returns how many attention modules now do (one per decoder layer).

    The patch replaces the name `apply_rotary_pos_emb` in the family's modeling module, so it is process-wide: every
    model of that family in this process, built before or after, uses the kernel (to undo it, assign the original
    back). Phi-3's attention modules of this model also get phi3_attention_forward (its fused q/k/v split). A model
    of another family, an attention count that differs from the config's layer count, an odd head_dim or a partial
    rotation (partial_rotary_factor < 1) raises ValueError before anything is patched."""
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    if family not in ROPE_FAMILIES:
        raise ValueError(f"apply_rope: {family or type(model).__name__} models are not supported; supported: "
                         f"{', '.join(ROPE_FAMILIES)}")
    attention = [module for module in model.modules() if type(module).__name__ == ROPE_FAMILIES[family]]
    if len(attention) != config.num_hidden_layers:
        raise ValueError(f"apply_rope: found {len(attention)} {ROPE_FAMILIES[family]} modules in this {family} model, "
                         f"expected {config.num_hidden_layers}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 2:
        raise ValueError(f"apply_rope: head_dim {head_dim} is odd; RoPE rotates the two halves of each head, so the "
                         f"fused kernel (like transformers) needs an even head_dim")
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    partial = getattr(config, "partial_rotary_factor", None) or rope_parameters.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"apply_rope: partial_rotary_factor {partial}: the fused kernel rotates whole heads")
    sys.modules[type(attention[0]).__module__].apply_rotary_pos_emb = apply_rotary_pos_emb
    if family == "phi3":  # its fused q/k/v projection is split by split_qkv (per module: this model only)
        for module in attention:
            module.forward = types.MethodType(phi3_attention_forward, module)
    return len(attention)


# ----------------------------------------------------------------------------------------------------------------------
# 4. Run as a script
# ----------------------------------------------------------------------------------------------------------------------
def main(argv=None):
    """One forward+backward on random inputs against float64; one line; exit code 0/1."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2, help="sequences")
    parser.add_argument("--tokens", type=int, default=13 if INTERPRETER else 2048,
                        help="tokens per sequence; default: a toy size on the CPU interpreter, 2048 on a GPU")
    parser.add_argument("--q-heads", type=int, default=4 if INTERPRETER else 32, help="query heads (LLaMA-3.1-8B: 32)")
    parser.add_argument("--kv-heads", type=int, default=2 if INTERPRETER else 8, help="key heads (LLaMA-3.1-8B: 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head_dim D (even)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="bf16", help="dtype of q, k, cos, sin")
    args = parser.parse_args(argv)
    if min(args.batch, args.tokens, args.q_heads, args.kv_heads) < 1:
        parser.error("need --batch, --tokens, --q-heads and --kv-heads >= 1")
    if args.head_dim < 2 or args.head_dim % 2:
        parser.error(f"--head-dim must be even and positive (RoPE rotates pairs of columns), got {args.head_dim}")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    B, T, D = args.batch, args.tokens, args.head_dim

    def rotate_half(x):
        return torch.cat((-x[..., D // 2:], x[..., :D // 2]), dim=-1)

    def eager_rope(q, k, cos, sin):  # transformers' apply_rotary_pos_emb, written out
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    torch.manual_seed(0)
    # q and k as LlamaAttention passes them: [B, T, heads, D] projections viewed as [B, heads, T, D]. cos and sin as
    # LlamaRotaryEmbedding builds them: equal halves, angles position / 10000^(2i/D) from a random start position.
    q = torch.randn(B, T, args.q_heads, D, device=KERNEL_DEVICE).to(dtype).transpose(1, 2)
    k = torch.randn(B, T, args.kv_heads, D, device=KERNEL_DEVICE).to(dtype).transpose(1, 2)
    positions = torch.randint(1, 4096, (B, 1), device=KERNEL_DEVICE) + torch.arange(T, device=KERNEL_DEVICE)
    inv_freq = 10000.0 ** -(torch.arange(0, D, 2, device=KERNEL_DEVICE).float() / D)
    angles = (positions[..., None].float() * inv_freq).repeat(1, 1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    dq_embed, dk_embed = (torch.randn(t.shape, device=KERNEL_DEVICE).to(dtype) for t in (q, k))

    def run(fn, cast):
        qc, kc = cast(q).requires_grad_(), cast(k).requires_grad_()
        q_embed, k_embed = fn(qc, kc, cast(cos), cast(sin))
        torch.autograd.backward((q_embed, k_embed), (cast(dq_embed), cast(dk_embed)))
        return q_embed.detach(), k_embed.detach(), qc.grad, kc.grad

    reference = run(eager_rope, lambda t: t.detach().double())
    torchs = run(eager_rope, lambda t: t.detach())
    ours = run(apply_rotary_pos_emb, lambda t: t.detach())

    def rel_error(a, ref):
        return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()

    # The tests' rule: no worse than PyTorch in the same dtype times 2, plus one unit in the last place.
    ok, parts = True, []
    for name, a, b, ref in zip(("q_embed", "k_embed", "dq", "dk"), ours, torchs, reference):
        ours_err, torch_err = rel_error(a, ref), rel_error(b, ref)
        ok &= ours_err <= 2 * torch_err + torch.finfo(dtype).eps
        parts.append(f"{name} {ours_err:.2e} (PyTorch {torch_err:.2e})")
    where = "CPU interpreter" if INTERPRETER else torch.cuda.get_device_name()
    print(f"rope q [{B}, {args.q_heads}, {T}, {D}], k [{B}, {args.kv_heads}, {T}, {D}] {args.dtype} on {where}, "
          f"max relative error vs float64: {', '.join(parts)}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
