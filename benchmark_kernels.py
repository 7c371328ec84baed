"""Benchmark the fused kernels against PyTorch eager, torch.compile, Liger-Kernel and Cut-Cross-Entropy.

    python benchmark_kernels.py                        # every kernel at the playbook's sizes (GPU) or toy sizes (CPU)
    python benchmark_kernels.py --kernel rmsnorm --tokens 4096 16384 65536 --plot
    python benchmark_kernels.py --kernel rope --plot   # q [1, 32, T, 128], k [1, 8, T, 128] (LLaMA-3.1-8B)

What one run does
-----------------
1. Measures the device's copy bandwidth: a large device-to-device `copy_` (bytes read + bytes written, divided by the
   median time). No kernel that must read and write its data once can beat it, so it is the ceiling that every
   "% of copy" column is relative to. The vendor's datasheet figure is higher than any real copy reaches.
2. For every kernel, size and provider (an implementation: ours, PyTorch eager, torch.compile, Liger, ...):
   - a correctness check BEFORE timing: the forward output (or loss) and every gradient against a float64 reference
     built from the same rounded inputs. The error is a relative norm, |got - ref| / |ref| (an all-zero result scores
     1.0). The rule is the project's: no worse than PyTorch eager in the same dtype times ERROR_FACTOR, plus a small
     floor. A failing provider is marked FAIL in the table and the JSON; a failure of one of OUR providers makes the
     exit code non-zero (other providers are reported, e.g. Liger's bf16 loss, not judged).
   - peak memory above inputs: inputs are created first, then `reset_peak_memory_stats`, then one forward+backward;
     the peak minus what was allocated before. It includes the gradients the step produces.
   - forward, backward and forward+backward times: `triton.testing.do_bench` medians with p20/p80 (the L2 cache is
     flushed before every call, gradients are reset to None so no accumulation kernel is timed). The backward is
     timed by calling `backward(retain_graph=True)` repeatedly on one fixed forward; providers whose backward can run
     only once (ours and Liger compute the cross-entropy gradient inside the forward) get "fwd+bwd - fwd" instead,
     marked "derived".
   - host time: the CPU time of one forward and one forward+backward call while the GPU runs behind (median of ten
     calls back to back, no synchronization). When it approaches the GPU time, the op is host-bound: Python, autograd
     and kernel launches set its speed, and a faster kernel would not show.
   - effective bandwidth from the MINIMAL bytes each phase must move (formulas below, also in every JSON row), and its
     percentage of the measured copy bandwidth. Extra traffic a provider makes (fp32 copies, saved intermediates)
     shows up as a lower GB/s, which is the point.
3. Prints one table per kernel with a legend, writes a JSON file (header: GPU, copy bandwidth, versions, commit,
   command, date; one row per kernel x provider x size x phase) and, with --plot, one PNG per kernel.

Minimal bytes (s = bytes per element of the dtype; N = tokens)
--------------------------------------------------------------
rmsnorm [N, H]          fwd 2*N*H*s (read x, write y)     bwd 3*N*H*s (read x, dy; write dx)      fwd+bwd 5*N*H*s
cross_entropy [N, V]    fwd N*V*s (read the logits once: the loss alone)                          fwd+bwd 2*N*V*s
                        (read the logits, write their gradient). Ours and Liger already write the gradient in the
                        forward, so their "fwd" moves 2*N*V*s and their "bwd" is nearly empty: compare fwd+bwd.
linear_cross_entropy    compute-bound (three [N, H] x [H, V] matmuls): TFLOP/s from 6*N*H*V for fwd+bwd, and memory.
swiglu [N, I]           fwd 3*N*I*s (read gate, up; write out)   bwd 5*N*I*s (read gate, up, dy; write dgate, dup)
                        fwd+bwd 8*N*I*s (the sum: the true minimum for a separate forward and backward) and, labelled
                        "issue-8 count", 6*N*I*s (read gate, up, dy; write out, dgate, dup: as if the forward's reads
                        were free). Under the 6*N*I*s count no implementation can pass 75 % of copy.
rope q [1, Hq, N, D],   fwd (2*(Hq+Hk)+2)*N*D*s (read q, k, cos, sin; write q_embed, k_embed)   bwd the same
k [1, Hk, N, D]         (read dq_embed, dk_embed, cos, sin; write dq, dk)   fwd+bwd (4*(Hq+Hk)+4)*N*D*s. q and k are
                        the transposed views LlamaAttention passes; cos/sin [1, N, D] like LlamaRotaryEmbedding's.

Without a GPU everything runs on Triton's CPU interpreter at toy sizes; times come from time.perf_counter and are
interpreter times, not meaningful, but the correctness checks and the output files are real (CI runs it that way).
"""
import argparse
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "TRITON_INTERPRET" not in os.environ:
    # Must happen before triton (or a kernel module) is imported: @triton.jit reads it at decoration time.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (after TRITON_INTERPRET)
import triton.testing  # noqa: E402
from tabulate import tabulate  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REPO = Path(__file__).resolve().parent
RMSNORM_EPS = 1e-5  # LLaMA-3.1-8B's released config
IGNORE_INDEX = -100

# Default sizes: the playbook's tables on a GPU, toy sizes on the interpreter (~1 ms per Triton program there).
GPU_TOKENS = {
    "rmsnorm": [256, 512, 1024, 2048, 4096, 8192, 16384, 65536],       # + issue 2's rows 4096, 16384, 65536
    "cross_entropy": [128, 256, 512, 1024, 2048, 4096, 8192, 16384],  # issue 3's rows are 4096 and 16384
    "linear_cross_entropy": [1024, 4096, 16384],
    "swiglu": [256, 512, 1024, 2048, 4096, 8192, 16384],
    "rope": [512, 2048, 8192, 16384],  # sequence length T at batch 1
}
CPU_TOKENS = {kernel: [4, 8] for kernel in GPU_TOKENS}
GPU_DIMS = {"hidden": 4096, "vocab": 128256, "intermediate": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128}
CPU_DIMS = {"hidden": 64, "vocab": 500, "intermediate": 100, "heads": 4, "kv_heads": 2, "head_dim": 16}

# Correctness rule: error <= ERROR_FACTOR * (eager's error) + ERROR_FLOOR[dtype of that output]. The interpreter
# truncates fp32 -> bf16/fp16 casts instead of rounding to nearest (error up to one unit in the last place, biased),
# which makes a correct kernel's error several times PyTorch's: there the floor is one such unit (2**-8 in bf16), still
# far below the error of an all-zero or wrong result (~1).
ERROR_FACTOR = 2.0 if ON_GPU else 5.0
ERROR_FLOOR = ({torch.float32: 1e-6, torch.bfloat16: 1e-4, torch.float16: 1e-5} if ON_GPU else
               {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11})
MIN_TIMED_CALLS = 5  # slow providers (100 ms linear CE) still get this many timed calls
CPU_TIMED_CALLS = 3
# Host time: calls back to back without synchronizing. Ten calls launch at most a few hundred kernels, far from the
# 1024 that fill CUDA's launch queue (past that the host would wait for the GPU and time it instead).
HOST_TIMED_CALLS = 10 if ON_GPU else 1


# ---------------------------------------------------------------------------------------------------------------------
# The kernels: inputs, float64 references, providers, byte counts
# ---------------------------------------------------------------------------------------------------------------------
# A "case" holds the inputs of one size: `args` are passed positionally to every provider, `grad_inputs` names the
# arguments whose gradients are checked ({"dx": 0} = the gradient of args[0] is reported as "dx"), `dy` is the
# upstream gradient (None for a scalar loss). A kernel with several outputs (rope: q_embed, k_embed) has a tuple of
# output names and a tuple of upstream gradients, one each.
class Case:
    def __init__(self, args, grad_inputs, dy, out_name, shape):
        self.args, self.grad_inputs, self.dy, self.out_name, self.shape = args, grad_inputs, dy, out_name, shape

    def fresh(self):
        """A private copy of the inputs: in-place providers (Liger, ours_inplace) overwrite their logits / dy.
        clone() keeps the strides, so transposed views stay transposed."""
        args = [a.detach().clone().requires_grad_(a.requires_grad) for a in self.args]
        if isinstance(self.dy, tuple):
            return args, tuple(d.clone() for d in self.dy)
        return args, None if self.dy is None else self.dy.clone()


def run_backward(out, dy, retain_graph=False):
    """out.backward(dy), also for a tuple of outputs with a tuple of upstream gradients."""
    if isinstance(out, tuple):
        torch.autograd.backward(out, dy, retain_graph=retain_graph)
    else:
        out.backward(dy, retain_graph=retain_graph)


def _randn(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32) * scale).to(dtype)


def _reference_chunks(n_rows, row_elems):
    """Row chunks of at most 2**27 float64 elements (1 GiB), so the float64 references fit at N = 16384, V = 128256."""
    step = max(1, (2**27) // max(row_elems, 1))
    return [(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


# --- RMSNorm ---------------------------------------------------------------------------------------------------------
def rmsnorm_case(tokens, dims, dtype, gen):
    hidden = dims["hidden"]
    x = _randn(tokens, hidden, dtype=dtype, gen=gen).requires_grad_()
    weight = (1.0 + 0.1 * _randn(hidden, dtype=torch.float32, gen=gen)).to(dtype).requires_grad_()  # never all ones
    dy = _randn(tokens, hidden, dtype=dtype, gen=gen)
    return Case([x, weight], {"dx": 0, "dw": 1}, dy, "y", {"tokens": tokens, "hidden": hidden})


def rmsnorm_reference(case):
    x, weight = (a.detach().double().requires_grad_() for a in case.args)
    y = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMSNORM_EPS))
    y.backward(case.dy.double())
    return {"y": y.detach(), "dx": x.grad, "dw": weight.grad}


def llama_rmsnorm_math(x, weight):
    """transformers' LlamaRMSNorm.forward: upcast, normalize, cast back to the input dtype, then multiply."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + RMSNORM_EPS)
    return weight * hidden.to(x.dtype)


def rmsnorm_providers():
    def ours():
        from rmsnorm_kernel import rms_norm
        return lambda x, weight: rms_norm(x, weight, RMSNORM_EPS)

    def liger():
        from liger_kernel.ops import LigerRMSNormFunction
        # LigerRMSNorm's defaults for LLaMA: casting_mode="llama", in_place=True (dx overwrites dy in the backward).
        return lambda x, weight: LigerRMSNormFunction.apply(x, weight, RMSNORM_EPS, 0.0, "llama", True, None)

    return {"ours": ours, "eager": lambda: llama_rmsnorm_math, "torch_compile": lambda: _compiled(llama_rmsnorm_math),
            "liger": liger}


# --- Cross-entropy ---------------------------------------------------------------------------------------------------
def cross_entropy_case(tokens, dims, dtype, gen):
    vocab = dims["vocab"]
    logits = _randn(tokens, vocab, dtype=dtype, gen=gen, scale=2.0).requires_grad_()
    # Every target is a real class: an ignored row need not be read, which would flatter the bytes-based GB/s.
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device=DEVICE)
    return Case([logits, targets], {"dlogits": 0}, None, "loss", {"tokens": tokens, "vocab": vocab})


def cross_entropy_reference(case):
    logits, targets = case.args
    n_rows, vocab = logits.shape
    loss = torch.zeros((), dtype=torch.float64, device=DEVICE)
    grad = torch.empty(n_rows, vocab, dtype=torch.float64, device=DEVICE)
    for start, end in _reference_chunks(n_rows, vocab):
        chunk = logits[start:end].detach().double().requires_grad_()
        part = F.cross_entropy(chunk, targets[start:end], reduction="sum") / n_rows  # "mean": all targets are valid
        part.backward()
        loss += part.detach()
        grad[start:end] = chunk.grad
    return {"loss": loss, "dlogits": grad}


def torch_fp32_cross_entropy(logits, targets):
    """What transformers' loss does: upcast the logits to fp32, then F.cross_entropy."""
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)


def torch_lowp_cross_entropy(logits, targets):
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)


def cross_entropy_providers(dtype_name):
    def ours():
        from cross_entropy_kernel import cross_entropy
        return lambda logits, targets: cross_entropy(logits, targets)

    def ours_inplace():
        from cross_entropy_kernel import cross_entropy
        return lambda logits, targets: cross_entropy(logits, targets, inplace_backward=True)

    def liger():
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
        return LigerCrossEntropyLoss(ignore_index=IGNORE_INDEX)

    providers = {"ours": ours, "ours_inplace": ours_inplace, "torch_fp32": lambda: torch_fp32_cross_entropy}
    if dtype_name != "fp32":  # in fp32 the "low precision" path is the fp32 path
        providers[f"torch_{dtype_name}"] = lambda: torch_lowp_cross_entropy
    providers["torch_compile"] = lambda: _compiled(torch_fp32_cross_entropy)
    providers["liger"] = liger
    return providers


# --- Linear cross-entropy --------------------------------------------------------------------------------------------
def linear_cross_entropy_case(tokens, dims, dtype, gen):
    hidden, vocab = dims["hidden"], dims["vocab"]
    h = _randn(tokens, hidden, dtype=dtype, gen=gen).requires_grad_()
    weight = _randn(vocab, hidden, dtype=dtype, gen=gen, scale=hidden ** -0.5).requires_grad_()  # logits ~ N(0, 1)
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device=DEVICE)
    return Case([h, weight, targets], {"dh": 0, "dW": 1}, None, "loss",
                {"tokens": tokens, "hidden": hidden, "vocab": vocab})


def linear_cross_entropy_reference(case):
    h, weight, targets = case.args
    n_rows, vocab = h.shape[0], weight.shape[0]
    weight64 = weight.detach().double().requires_grad_()
    loss = torch.zeros((), dtype=torch.float64, device=DEVICE)
    dh = torch.empty(h.shape, dtype=torch.float64, device=DEVICE)
    for start, end in _reference_chunks(n_rows, vocab):
        h64 = h[start:end].detach().double().requires_grad_()
        part = F.cross_entropy(h64 @ weight64.t(), targets[start:end], reduction="sum") / n_rows
        part.backward()  # weight64.grad accumulates over the chunks
        loss += part.detach()
        dh[start:end] = h64.grad
    return {"loss": loss, "dh": dh, "dW": weight64.grad}


def eager_linear_cross_entropy(h, weight, targets):
    """transformers: lm_head makes [N, V] logits in the model dtype, the loss upcasts them to fp32."""
    return F.cross_entropy((h @ weight.t()).float(), targets, ignore_index=IGNORE_INDEX)


def linear_cross_entropy_providers(chunk_sizes):
    def ours(chunk_size=None):
        from cross_entropy_kernel import linear_cross_entropy
        return lambda h, weight, targets: linear_cross_entropy(h, weight, targets, chunk_size=chunk_size)

    def liger():
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
        return lambda h, weight, targets: loss(weight, h, targets)  # Liger takes (lm_head weight, hidden, targets)

    def cce():
        from cut_cross_entropy import linear_cross_entropy as cce_linear_cross_entropy
        # Defaults kept (impl="cce", filter_eps="high": gradient entries below a threshold are skipped).
        return lambda h, weight, targets: cce_linear_cross_entropy(h, weight, targets, ignore_index=IGNORE_INDEX)

    providers = {"ours": ours}
    for size in chunk_sizes or []:
        providers[f"ours_chunk{size}"] = lambda size=size: ours(size)
    providers.update({"eager": lambda: eager_linear_cross_entropy, "liger": liger, "cce": cce})
    return providers


# --- SwiGLU ----------------------------------------------------------------------------------------------------------
def swiglu_case(tokens, dims, dtype, gen):
    inter = dims["intermediate"]
    gate = _randn(tokens, inter, dtype=dtype, gen=gen, scale=2.0).requires_grad_()
    up = _randn(tokens, inter, dtype=dtype, gen=gen).requires_grad_()
    dy = _randn(tokens, inter, dtype=dtype, gen=gen)
    return Case([gate, up], {"dgate": 0, "dup": 1}, dy, "y", {"tokens": tokens, "intermediate": inter})


def swiglu_reference(case):
    gate, up = (a.detach().double().requires_grad_() for a in case.args)
    y = F.silu(gate) * up
    y.backward(case.dy.double())
    return {"y": y.detach(), "dgate": gate.grad, "dup": up.grad}


def eager_swiglu(gate, up):
    """transformers' LlamaMLP: act_fn(gate_proj(x)) * up_proj(x), silu applied in the model dtype."""
    return F.silu(gate) * up


def swiglu_providers():
    def ours():
        from swiglu_kernel import swiglu
        return swiglu

    def liger():
        from liger_kernel.ops import LigerSiLUMulFunction
        return lambda gate, up: LigerSiLUMulFunction.apply(gate, up, 1.0, 1.0)

    return {"ours": ours, "eager": lambda: eager_swiglu, "torch_compile": lambda: _compiled(eager_swiglu),
            "liger": liger}


# --- RoPE ------------------------------------------------------------------------------------------------------------
def rope_case(tokens, dims, dtype, gen):
    heads, kv_heads, head_dim = dims["heads"], dims["kv_heads"], dims["head_dim"]

    def llama_view(n_heads):  # q_proj(x).view(1, T, heads, D).transpose(1, 2): what LlamaAttention passes
        return _randn(1, tokens, n_heads, head_dim, dtype=dtype, gen=gen).transpose(1, 2)

    q, k = llama_view(heads).requires_grad_(), llama_view(kv_heads).requires_grad_()
    # cos/sin as LlamaRotaryEmbedding builds them (llama3's rope_theta; both halves equal), in the model dtype.
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE, dtype=torch.float32) / head_dim)
    freqs = torch.arange(tokens, device=DEVICE, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)[None]  # [1, T, D]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    dy = (llama_view(heads), llama_view(kv_heads))  # laid out like q and k, as attention's backward returns them
    return Case([q, k, cos, sin], {"dq": 0, "dk": 1}, dy, ("q_embed", "k_embed"),
                {"tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim})


def rope_reference(case):
    q, k, cos, sin = case.args
    q64, k64 = (a.detach().double().requires_grad_() for a in (q, k))
    cos64, sin64 = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    half = q.shape[-1] // 2

    def rotate_half(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    q_embed, k_embed = q64 * cos64 + rotate_half(q64) * sin64, k64 * cos64 + rotate_half(k64) * sin64
    torch.autograd.backward((q_embed, k_embed), tuple(d.double() for d in case.dy))
    return {"q_embed": q_embed.detach(), "k_embed": k_embed.detach(), "dq": q64.grad, "dk": k64.grad}


def eager_rope():
    """transformers' own apply_rotary_pos_emb (what LlamaAttention runs): mul, slice, neg, cat, mul, add."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    return apply_rotary_pos_emb


def rope_providers():
    def ours():
        from rope_kernel import apply_rotary_pos_emb
        return apply_rotary_pos_emb

    def liger():
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        # Some Liger versions return (q, k, cos, sin): keep the two embeddings.
        return lambda q, k, cos, sin: tuple(liger_rotary_pos_emb(q, k, cos, sin)[:2])

    return {"ours": ours, "eager": eager_rope, "torch_compile": lambda: _compiled(eager_rope()), "liger": liger}


def _compiled(fn):
    """torch.compile of the eager math, compiled afresh for every size (static shapes, like the playbook's runs)."""
    if not ON_GPU:
        raise SkipProvider("skipped on CPU")
    from torch import _dynamo

    _dynamo.reset()  # drop the previous size's graphs: no recompile limit, no dynamic-shape fallback
    return torch.compile(fn, dynamic=False)


class SkipProvider(Exception):
    pass


def _rope_bytes(d, s):
    """One pass of RoPE: read q and k, write their rotations, read the cos and sin rows ([1, N, D] each)."""
    return (2 * (d["heads"] + d["kv_heads"]) + 2) * d["tokens"] * d["head_dim"] * s


# Byte / FLOP counts per phase: (formula text, function of the case's shape dict and bytes per element).
KERNELS = {
    "rmsnorm": {
        "case": rmsnorm_case, "reference": rmsnorm_reference, "baseline": "eager",
        "bytes": {"fwd": ("2*N*H*s", lambda d, s: 2 * d["tokens"] * d["hidden"] * s),
                  "bwd": ("3*N*H*s", lambda d, s: 3 * d["tokens"] * d["hidden"] * s),
                  "fwd+bwd": ("5*N*H*s", lambda d, s: 5 * d["tokens"] * d["hidden"] * s)},
    },
    "cross_entropy": {
        "case": cross_entropy_case, "reference": cross_entropy_reference, "baseline": "torch_fp32",
        "bytes": {"fwd": ("N*V*s", lambda d, s: d["tokens"] * d["vocab"] * s),
                  "fwd+bwd": ("2*N*V*s", lambda d, s: 2 * d["tokens"] * d["vocab"] * s)},
    },
    "linear_cross_entropy": {
        "case": linear_cross_entropy_case, "reference": linear_cross_entropy_reference, "baseline": "eager",
        "flops": {"fwd+bwd": ("6*N*H*V", lambda d: 6 * d["tokens"] * d["hidden"] * d["vocab"])},
    },
    "swiglu": {
        "case": swiglu_case, "reference": swiglu_reference, "baseline": "eager",
        "bytes": {"fwd": ("3*N*I*s", lambda d, s: 3 * d["tokens"] * d["intermediate"] * s),
                  "bwd": ("5*N*I*s", lambda d, s: 5 * d["tokens"] * d["intermediate"] * s),
                  "fwd+bwd": ("8*N*I*s", lambda d, s: 8 * d["tokens"] * d["intermediate"] * s)},
        "issue_bytes": {"fwd+bwd": ("6*N*I*s", lambda d, s: 6 * d["tokens"] * d["intermediate"] * s)},
    },
    "rope": {
        "case": rope_case, "reference": rope_reference, "baseline": "eager",
        "bytes": {"fwd": ("(2*(Hq+Hk)+2)*N*D*s", lambda d, s: _rope_bytes(d, s)),
                  "bwd": ("(2*(Hq+Hk)+2)*N*D*s", lambda d, s: _rope_bytes(d, s)),
                  "fwd+bwd": ("(4*(Hq+Hk)+4)*N*D*s", lambda d, s: 2 * _rope_bytes(d, s))},
    },
}

# What each phase means for providers that do not split the work the obvious way (copied into the JSON rows).
NOTES = {
    ("cross_entropy", "ours"): "forward computes loss AND gradient (moves 2*N*V*s); backward only scales it by "
                               "grad_output (a no-op at 1)",
    ("cross_entropy", "ours_inplace"): "as ours, gradient written into the logits buffer (+0 MB); timed calls reuse "
                                       "the overwritten buffer (same bytes and work), correctness uses fresh logits",
    ("cross_entropy", "liger"): "gradient written into the logits buffer during the forward; host syncs (.item()) "
                                "in forward and torch.equal in backward; loss in the logits' dtype",
    ("cross_entropy", "torch_fp32"): "logits.float() copy, fp32 log_softmax saved for the backward",
    ("cross_entropy", "torch_compile"): "torch.compile of the fp32 path",
    ("cross_entropy", "torch_bf16"): "F.cross_entropy in bf16: bf16 loss, so it fails the fp32-loss rule by design",
    ("cross_entropy", "torch_fp16"): "F.cross_entropy in fp16: fp16 loss, so it fails the fp32-loss rule by design",
    ("linear_cross_entropy", "ours"): "loss and all gradients computed in the forward (token chunks); backward scales",
    ("linear_cross_entropy", "liger"): "loss and all gradients computed in the forward (token chunks)",
    ("linear_cross_entropy", "cce"): "filter_eps='high' (default): small gradient entries skipped (approximate)",
    ("linear_cross_entropy", "eager"): "bf16 [N, V] logits, fp32 copy for the loss",
    ("rmsnorm", "liger"): "casting_mode='llama', in_place=True (dx overwrites dy)",
    ("rope", "ours"): "one launch for q and k; strided (transposed) inputs read in place; fp32 math, one rounding",
    ("rope", "eager"): "transformers' apply_rotary_pos_emb: separate mul/neg/cat/mul/add kernels, a rounding after each",
    ("rope", "liger"): "liger_rotary_pos_emb: rotates q and k in their own buffers (and the gradients in dq_embed's); "
                       "reads only the first half of cos/sin (assumes their halves are equal, as in LLaMA)",
}


def providers_for(kernel, args):
    if kernel == "rmsnorm":
        return rmsnorm_providers()
    if kernel == "cross_entropy":
        return cross_entropy_providers(args.dtype)
    if kernel == "linear_cross_entropy":
        return linear_cross_entropy_providers(args.chunk_sizes)
    if kernel == "rope":
        return rope_providers()
    return swiglu_providers()


# ---------------------------------------------------------------------------------------------------------------------
# Measuring: errors, memory, time
# ---------------------------------------------------------------------------------------------------------------------
def run_once(fn, case):
    """One forward + backward on fresh inputs; returns the output and the gradients by name."""
    args, dy = case.fresh()
    out = fn(*args)
    run_backward(out, dy)
    if isinstance(out, tuple):
        results = {name: o.detach() for name, o in zip(case.out_name, out)}
    else:
        results = {case.out_name: out.detach()}
    for name, index in case.grad_inputs.items():
        results[name] = args[index].grad
    return results


def relative_error(got, ref):
    """|got - ref| / |ref| (Frobenius norms), summed over row chunks so a 16 GB float64 temporary is never made."""
    if got is None:
        return float("inf")  # a missing gradient
    got, ref = got.detach().reshape(-1), ref.reshape(-1)
    step = 2**26
    diff_sq = sum(((got[i:i + step].double() - ref[i:i + step]) ** 2).sum() for i in range(0, ref.numel(), step))
    return math.sqrt(float(diff_sq)) / max(float(ref.norm()), 1e-30)


def errors_of(results, ref):
    return {name: relative_error(results.get(name), ref_value) for name, ref_value in ref.items()}


def peak_mb_above_inputs(fn, case):
    """Peak memory of one forward+backward above what was allocated before it (inputs exist already)."""
    if not ON_GPU:
        return None
    args, dy = case.fresh()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run_backward(fn(*args), dy)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del args, dy
    return peak / 2**20


def time_ms(fn, grad_to_none, rep_ms, warmup_ms):
    """(median, p20, p80) in ms. GPU: do_bench (L2 flushed before each call). CPU: a few perf_counter calls."""
    if ON_GPU:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        estimate_ms = (time.perf_counter() - start) * 1e3
        # do_bench fits its call count into `rep` ms: stretch it so slow providers get MIN_TIMED_CALLS calls.
        rep = max(rep_ms, MIN_TIMED_CALLS * estimate_ms)
        median, p20, p80 = triton.testing.do_bench(fn, warmup=max(warmup_ms, estimate_ms), rep=rep,
                                                   grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
        return median, p20, p80
    fn()
    median, p20, p80 = np.quantile(call_times_ms(fn, grad_to_none, CPU_TIMED_CALLS), [0.5, 0.2, 0.8])
    return float(median), float(p20), float(p80)


def call_times_ms(fn, grad_to_none, n_calls):
    """perf_counter time (ms) of each of n_calls calls in a row, gradients reset before each, no synchronization."""
    times = []
    for _ in range(n_calls):
        for tensor in grad_to_none:
            tensor.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def host_ms(fn, grad_to_none):
    """Median CPU time of one call (ms) while the GPU runs behind: what Python, autograd and the launches cost the
    host. When it comes close to the GPU time, the host sets the pace and faster kernels would not show. A provider
    that synchronizes (Liger's cross-entropy calls .item()) waits for its own kernels here too. Called right after
    time_ms on the same fn, which has warmed it up; the synchronization starts the timed calls on an idle GPU."""
    if ON_GPU:
        torch.cuda.synchronize()
    times = call_times_ms(fn, grad_to_none, HOST_TIMED_CALLS)
    if ON_GPU:
        torch.cuda.synchronize()
    return float(np.median(times))


def time_phases(fn, case, rep_ms, warmup_ms):
    """({"fwd": (median, p20, p80), "bwd": ..., "fwd+bwd": ...}, how bwd was obtained, {"fwd": host ms,
    "fwd+bwd": host ms})."""
    args, dy = case.fresh()
    leaves = [a for a in args if a.requires_grad]
    forward, step = (lambda: fn(*args)), (lambda: run_backward(fn(*args), dy))
    phases = {"fwd": time_ms(forward, leaves, rep_ms, warmup_ms), "fwd+bwd": time_ms(step, leaves, rep_ms, warmup_ms)}
    host = {"fwd": host_ms(forward, leaves), "fwd+bwd": host_ms(step, leaves)}
    out = fn(*args)

    def backward_again():
        # Reset inside the call too (do_bench resets only before its timed calls): Liger's logits gradient aliases
        # the logits themselves, and accumulating into it would bump the version of a tensor saved for backward.
        for leaf in leaves:
            leaf.grad = None
        run_backward(out, dy, retain_graph=True)

    try:  # can this provider's backward run twice on one forward?
        backward_again()
        backward_again()
    except Exception:  # e.g. "can run once; recompute the loss instead of using retain_graph=True"
        out = None
    if out is not None:
        phases["bwd"] = time_ms(backward_again, leaves, rep_ms, warmup_ms)
        bwd_method = "do_bench" if ON_GPU else "perf_counter"
    else:
        # Two medians' difference: a near-empty backward can come out slightly negative; that is noise, shown as 0.
        phases["bwd"] = (max(0.0, phases["fwd+bwd"][0] - phases["fwd"][0]), None, None)
        bwd_method = "derived: max(0, fwd+bwd - fwd) (the backward can run only once)"
    return phases, bwd_method, host


def measure_copy_bandwidth(copy_gib):
    """GB/s of a device-to-device copy: (bytes read + bytes written) / median time."""
    n_bytes = int(copy_gib * 2**30) if ON_GPU else 64 * 2**20
    src = torch.empty(n_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    median_ms = time_ms(lambda: dst.copy_(src), [], 100, 25)[0]
    return 2 * n_bytes / (median_ms * 1e-3) / 1e9, n_bytes


# ---------------------------------------------------------------------------------------------------------------------
# One kernel: check, measure, make rows
# ---------------------------------------------------------------------------------------------------------------------
def benchmark_kernel(kernel, args, copy_gbps):
    spec = KERNELS[kernel]
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    dims = {name: getattr(args, name) for name in GPU_DIMS}
    all_providers = providers_for(kernel, args)
    selected = [p for p in all_providers if not args.providers or p in args.providers]
    rows, failures = [], []

    def base_row(provider, status):
        return {"kernel": kernel, "provider": provider, "status": status, "dtype": args.dtype,
                "note": NOTES.get((kernel, provider)), "error": None, "check": None}

    # Factories that cannot work at all (not installed, skipped on CPU) give one row and are dropped.
    factories = {}
    for provider in selected:
        try:
            all_providers[provider]()
            factories[provider] = all_providers[provider]
        except SkipProvider as reason:
            rows.append(base_row(provider, str(reason)))
        except Exception as exc:  # ImportError: the package is absent; anything else: it is there but broken
            status = (f"not installed ({exc.name or exc})" if isinstance(exc, ImportError) else
                      f"failed to load: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            rows.append(base_row(provider, status))
            if provider.startswith("ours"):
                failures.append(f"{kernel}/{provider}: {status}")
        if provider not in factories:
            print(f"  {kernel:<21} {provider:<14} {rows[-1]['status']}")

    for tokens in args.tokens or (GPU_TOKENS if ON_GPU else CPU_TOKENS)[kernel]:
        gen = torch.Generator(device=DEVICE).manual_seed(args.seed + tokens)  # fresh data for every size
        baseline = spec["baseline"]
        try:
            case = spec["case"](tokens, dims, dtype, gen)
            ref = spec["reference"](case)
            baseline_errors = errors_of(run_once(all_providers[baseline](), case), ref)
        except Exception as exc:  # e.g. out of memory at a size too large for this device: no provider can be checked
            status = f"failed: reference/baseline: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows += [dict(base_row(provider, status), tokens=tokens, check="FAIL") for provider in factories]
            failures.append(f"{kernel} N={tokens}: {status}")
            print(f"  {kernel:<21} N={tokens:<6} {status}")
            case = ref = None
            if ON_GPU:
                torch.cuda.empty_cache()
            continue
        # The floor follows the dtype of the output: losses are fp32 (what transformers' loss returns), the rest dtype.
        limits = {name: ERROR_FACTOR * err + ERROR_FLOOR[torch.float32 if name == "loss" else dtype]
                  for name, err in baseline_errors.items()}
        for provider, factory in factories.items():
            row_head = dict(base_row(provider, "ok"), tokens=tokens, shape=case.shape,
                            what=None, error_baseline=baseline_errors, error_limit=limits)
            try:
                fn = factory()
                err = errors_of(run_once(fn, case), ref)
                passed = all(err[name] <= limits[name] for name in err)
                row_head.update(error=err, check="pass" if passed else "FAIL")
                if not passed and provider.startswith("ours"):
                    failures.append(f"{kernel}/{provider} N={tokens}: error {err} above the limit {limits}")
                row_head["peak_mb"] = peak_mb_above_inputs(fn, case)
                phases, bwd_method, host = time_phases(fn, case, args.rep_ms, args.warmup_ms)
            except Exception as exc:  # a provider that breaks is a row, not a crash
                if ON_GPU and isinstance(exc, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
                row_head.update(status=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                                check="FAIL")
                rows.append(row_head)
                if provider.startswith("ours"):
                    failures.append(f"{kernel}/{provider} N={tokens}: {row_head['status']}")
                print(f"  {kernel:<21} {provider:<14} N={tokens:<6} {row_head['status']}")
                continue
            for phase in ("fwd", "bwd", "fwd+bwd"):
                median, p20, p80 = phases[phase]
                row = dict(row_head, what=f"{kernel} {phase}", phase=phase, median_ms=median, p20_ms=p20, p80_ms=p80,
                           timing=bwd_method if phase == "bwd" else ("do_bench" if ON_GPU else "perf_counter"),
                           host_ms=host.get(phase))
                add_throughput(row, spec, phase, case.shape, itemsize, copy_gbps)
                rows.append(row)
            worst = worst_output(err, limits)
            print(f"  {kernel:<21} {provider:<14} N={tokens:<6} {row_head['check']:<4} (worst error {worst} "
                  f"{err[worst]:.1e}, limit {limits[worst]:.1e})  fwd+bwd {phases['fwd+bwd'][0]:.3f} ms")
        del case, ref
        if ON_GPU:
            torch.cuda.empty_cache()
    return rows, failures


def worst_output(errors, limits):
    """The output (or gradient) closest to, or furthest past, its limit."""
    return max(errors, key=lambda name: errors[name] / limits[name])


def add_throughput(row, spec, phase, shape, itemsize, copy_gbps):
    seconds = row["median_ms"] * 1e-3
    usable = seconds > 0  # a derived backward can come out at (or below) zero
    # The minimal byte count, and for SwiGLU also issue 8's count (its keys get the suffix "_issue8").
    for key, suffix in (("bytes", ""), ("issue_bytes", "_issue8")):
        formula = spec.get(key, {}).get(phase)
        if formula:
            n_bytes = formula[1](shape, itemsize)
            gbps = n_bytes / seconds / 1e9 if usable else None
            row.update({f"bytes_formula{suffix}": formula[0], f"bytes{suffix}": n_bytes, f"gbps{suffix}": gbps,
                        f"pct_of_copy{suffix}": None if gbps is None else 100 * gbps / copy_gbps})
    flops = spec.get("flops", {}).get(phase)
    if flops:
        n_flops = flops[1](shape)
        row.update(flops_formula=flops[0], flops=n_flops, tflops=n_flops / seconds / 1e12 if usable else None)


# ---------------------------------------------------------------------------------------------------------------------
# Output: tables, JSON, plots
# ---------------------------------------------------------------------------------------------------------------------
def _fmt(value, spec=".3f"):
    return "-" if value is None else format(value, spec)


def print_table(kernel, rows):
    spec = KERNELS[kernel]
    baseline = spec["baseline"]
    timed = [r for r in rows if r["kernel"] == kernel and r.get("phase")]
    by_key = {(r["provider"], r["tokens"], r["phase"]): r for r in timed}
    order = list(dict.fromkeys(r["provider"] for r in timed))
    keys = sorted({(r["tokens"], r["provider"]) for r in timed}, key=lambda k: (k[0], order.index(k[1])))
    compute_bound = "flops" in spec
    table = []
    for tokens, provider in keys:
        fwd, bwd, both = (by_key.get((provider, tokens, p), {}) for p in ("fwd", "bwd", "fwd+bwd"))
        base = by_key.get((baseline, tokens, "fwd+bwd"))
        speedup = base["median_ms"] / both["median_ms"] if base and both.get("median_ms") else None
        reduction = None
        if base and base.get("peak_mb") and both.get("peak_mb") is not None:
            reduction = 100 * (1 - both["peak_mb"] / base["peak_mb"])
        err = both["error"]
        worst = worst_output(err, both["error_limit"])
        line = [provider, tokens, _fmt(fwd.get("median_ms")),
                _fmt(bwd.get("median_ms")) + ("*" if bwd.get("timing", "").startswith("derived") else ""),
                _fmt(both.get("median_ms")), _fmt(both.get("host_ms"))]
        if compute_bound:
            line += [_fmt(both.get("tflops"), ".1f")]
        else:
            line += [_fmt(fwd.get("gbps"), ".0f"), _fmt(fwd.get("pct_of_copy"), ".1f"),
                     _fmt(both.get("gbps"), ".0f"), _fmt(both.get("pct_of_copy"), ".1f")]
            if "issue_bytes" in spec:
                line += [_fmt(both.get("pct_of_copy_issue8"), ".1f")]
        line += [_fmt(speedup, ".2f"), _fmt(both.get("peak_mb"), ".0f"), _fmt(reduction, ".0f"),
                 f"{worst} {err[worst]:.1e}", both["check"]]
        table.append(line)
    headers = ["provider", "tokens", "fwd ms", "bwd ms", "fwd+bwd ms", "f+b host ms"]
    headers += (["fwd+bwd TFLOP/s"] if compute_bound else
                ["fwd GB/s", "fwd % copy", "fwd+bwd GB/s", "fwd+bwd % copy"]
                + (["f+b % copy (6NIs)"] if "issue_bytes" in spec else []))
    headers += [f"speedup vs {baseline}", "peak MB", "mem. red. %", "max error", "check"]
    print(f"\n=== {kernel} ({rows[0]['dtype'] if rows else ''}) ===")
    if table:
        print(tabulate(table, headers=headers, tablefmt="github"))
    for r in rows:
        if r["kernel"] == kernel and not r.get("phase"):
            print(f"{r['provider']}" + (f" N={r['tokens']}" if r.get("tokens") else "") + f": {r['status']}")
    fixed = ", ".join(f"{k}={v}" for k, v in timed[0]["shape"].items() if k != "tokens") if timed else ""
    print(legend(kernel, fixed))


def legend(kernel, fixed_dims):
    spec = KERNELS[kernel]
    baseline = spec["baseline"]
    lines = ["How to read this table:",
             "  provider     the implementation (ours = this repo's kernel module; the JSON rows' notes say more)",
             f"  tokens       N, the rows of the inputs ({fixed_dims}; dtype in the title)",
             "  fwd ms       forward median (do_bench, L2 flushed; p20/p80 in the JSON)",
             "  bwd ms       backward median on one fixed forward (retain_graph); * = derived as fwd+bwd - fwd "
             "(0 if negative: noise) because that backward can run only once",
             "  fwd+bwd ms   one training step of this op: forward then backward, the number to compare",
             f"  f+b host ms  CPU time of one fwd+bwd call, the GPU left to run behind (median of {HOST_TIMED_CALLS} "
             "calls back to back): close to fwd+bwd ms, the host (Python, autograd, launches) sets the time, not "
             "the kernels"]
    if "flops" in spec:
        lines.append(f"  TFLOP/s      {spec['flops']['fwd+bwd'][0]} / fwd+bwd time (three matmuls); compute-bound: "
                     "no GB/s")
    else:
        formulas = ", ".join(f"{phase} {f[0]}" for phase, f in spec["bytes"].items())
        lines += [f"  GB/s         minimal bytes / median time; bytes: {formulas} (s = bytes per element)",
                  "  % copy       that GB/s as a percentage of the device-to-device copy measured in this run"]
        if "issue_bytes" in spec:
            lines.append("  (6NIs)       fwd+bwd % of copy with issue 8's count 6*N*I*s (ceiling 75 %, since the "
                         "true minimum is 8*N*I*s)")
        if kernel == "cross_entropy":
            lines.append("               ours/ours_inplace/liger write the gradient in the forward: their fwd GB/s "
                         "counts only N*V*s of the 2*N*V*s they move")
    lines += [f"  speedup      {baseline}'s fwd+bwd time / this provider's (> 1 = faster)",
              "  peak MB      peak memory of one fwd+bwd above the inputs (gradients included); - on CPU",
              f"  mem. red.    1 - peak / {baseline}'s peak, in %",
              "  max error    |got - ref| / |ref| (norms; float64 reference) of the output or gradient closest to "
              "its limit",
              f"  check        pass = every error <= {ERROR_FACTOR:g} x {baseline}'s error + a dtype floor; only "
              "our providers' FAIL fails the run"]
    return "\n".join(lines)


def plot(kernel, rows, path, header):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r["kernel"] == kernel and r.get("phase") == "fwd+bwd"]
    if not timed:
        return None
    compute_bound = "flops" in KERNELS[kernel]
    with_memory = any(r.get("peak_mb") is not None for r in timed)  # no memory figures on the CPU
    fig, axes = plt.subplots(1, 3 if with_memory else 2, figsize=(18 if with_memory else 12, 4.5))
    ax_time, ax_rate = axes[:2]
    for provider in dict.fromkeys(r["provider"] for r in timed):
        mine = sorted((r for r in timed if r["provider"] == provider), key=lambda r: r["tokens"])
        tokens = [r["tokens"] for r in mine]
        medians = [r["median_ms"] for r in mine]
        low = [r["median_ms"] - r["p20_ms"] for r in mine]
        high = [r["p80_ms"] - r["median_ms"] for r in mine]
        ax_time.errorbar(tokens, medians, yerr=[low, high], marker="o", label=provider, capsize=2)
        rate = [r.get("tflops") if compute_bound else r.get("pct_of_copy") for r in mine]
        ax_rate.plot(tokens, [np.nan if v is None else v for v in rate], marker="o", label=provider)
        if with_memory:
            peak = [r.get("peak_mb") for r in mine]
            axes[2].plot(tokens, [np.nan if v is None else v for v in peak], marker="o", label=provider)
    ax_time.set(yscale="log", ylabel="fwd+bwd median (ms), bars p20-p80", title="latency")
    if compute_bound:
        ax_rate.set(ylabel="TFLOP/s (6*N*H*V / time)", title="throughput")
    else:
        formula = KERNELS[kernel]["bytes"]["fwd+bwd"][0]
        ax_rate.axhline(100, color="gray", linestyle="--", linewidth=1)
        ax_rate.set(ylabel=f"% of copy bandwidth (bytes {formula})",
                    title=f"bandwidth (100 % = copy, {header['copy_gbps']:.0f} GB/s)")
    if with_memory:
        axes[2].set(ylabel="peak MB above inputs (one fwd+bwd)", title="memory")
    all_tokens = sorted({r["tokens"] for r in timed})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_tokens, [str(t) for t in all_tokens])
        ax.set_xlabel("tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    shape = ", ".join(f"{k}={v}" for k, v in timed[0]["shape"].items() if k != "tokens")
    fig.suptitle(f"{kernel} fwd+bwd, {header['dtype']}, {shape}, {header['gpu']}, {header['date'][:10]}"
                 + (" (interpreter: times not meaningful)" if not ON_GPU else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def versions():
    found = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
             "cuda": torch.version.cuda}
    for name, package in (("transformers", "transformers"), ("liger", "liger-kernel"), ("cce", "cut-cross-entropy")):
        try:
            found[name] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def git_state():
    """(short commit, dirty?) of the checkout; outside a git checkout (a copied tree on a GPU box), the GIT_COMMIT and
    GIT_DIRTY environment variables say which commit the copy was taken from."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain")
        if head.returncode == 0:
            return head.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("GIT_COMMIT", "uncommitted"), os.environ.get("GIT_DIRTY") not in (None, "0")


def device_name():
    return torch.cuda.get_device_name() if ON_GPU else "cpu (Triton interpreter)"


def device_slug():
    if not ON_GPU:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", device_name().lower().replace("nvidia", "")).strip("_")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--kernel", default="all", choices=[*KERNELS, "all"], help="which kernel to benchmark")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="dtype of the inputs")
    gpu_tokens = "; ".join(f"{k} {' '.join(map(str, v))}" for k, v in GPU_TOKENS.items())
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help=f"token counts N (rows) for every selected kernel; None = per kernel: "
                             f"on GPU {gpu_tokens}; on CPU {' '.join(map(str, CPU_TOKENS['rmsnorm']))}")
    for name, what in (("hidden", "hidden size H (rmsnorm, linear_cross_entropy)"), ("vocab", "vocabulary V"),
                       ("intermediate", "intermediate size I (swiglu)"), ("heads", "query heads Hq (rope)"),
                       ("kv_heads", "key/value heads Hk (rope)"), ("head_dim", "head dimension D (rope)")):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"{what}; None = {GPU_DIMS[name]} on GPU, {CPU_DIMS[name]} on CPU")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=None,
                        help="linear_cross_entropy: also time ours with these explicit chunk_size values")
    parser.add_argument("--providers", nargs="+", default=None,
                        help="only these providers (ours ours_inplace ours_chunk<C> eager torch_fp32 torch_bf16 "
                             "torch_compile liger cce); the baseline still runs for the correctness rule")
    parser.add_argument("--out", default=None,
                        help="JSON path; None = results/bench_<kernel>_<gpu or cpu>.json next to this script")
    parser.add_argument("--plot", nargs="?", const="", default=None, metavar="PREFIX",
                        help="write one PNG per kernel, PREFIX_<kernel>.png; bare --plot = the JSON path without .json")
    parser.add_argument("--copy-gib", type=float, default=2.0, help="GPU copy-bandwidth buffer size (GiB)")
    parser.add_argument("--rep-ms", type=float, default=100, help="do_bench rep (ms of timed calls, per phase)")
    parser.add_argument("--warmup-ms", type=float, default=25, help="do_bench warmup (ms)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (the size is added: fresh data per size)")
    args = parser.parse_args(argv)
    for name, value in (GPU_DIMS if ON_GPU else CPU_DIMS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.providers:
        known = set()
        for kernel in KERNELS:
            known |= set(providers_for(kernel, args))
        unknown = sorted(set(args.providers) - known)
        if unknown:
            parser.error(f"unknown provider(s) {unknown}; known: {sorted(known)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    kernels = list(KERNELS) if args.kernel == "all" else [args.kernel]
    out_path = Path(args.out) if args.out else REPO / "results" / f"bench_{args.kernel}_{device_slug()}.json"
    if ON_GPU:
        # torch.compile's AOTAutograd "donates" saved buffers to the backward, which then refuses retain_graph=True
        # (needed to time the backward alone). Off for the compiled providers; it changes memory reuse, not kernels.
        from torch._functorch import config as functorch_config

        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
    else:
        print("No CUDA device: Triton kernels run on the CPU interpreter at toy sizes; the times below are "
              "interpreter times and NOT meaningful (the correctness checks are).")

    commit, dirty = git_state()
    copy_gbps, copy_bytes = measure_copy_bandwidth(args.copy_gib)
    header = {"gpu": device_name(), "copy_gbps": copy_gbps, "copy_bytes_each_way": copy_bytes,
              "versions": versions(), "git_commit": commit, "git_dirty": dirty,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "date":
              datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "dtype": args.dtype, "dims": {k: getattr(args, k) for k in GPU_DIMS},
              "timing": "triton.testing.do_bench median/p20/p80, L2 flushed, grads reset" if ON_GPU else
              "time.perf_counter on the Triton CPU interpreter: NOT meaningful",
              "error_rule": f"error <= {ERROR_FACTOR} * baseline error + floor "
                            + str({str(k).replace("torch.", ""): v for k, v in ERROR_FLOOR.items()}),
              "notes": ["torch._functorch.config.donated_buffer=False (so compiled backwards accept retain_graph)"]
              if ON_GPU else []}
    print(f"device: {header['gpu']} | copy bandwidth {copy_gbps:.0f} GB/s (device-to-device copy of "
          f"{copy_bytes / 2**30:.2f} GiB, read + written) | torch {torch.__version__}, triton {triton.__version__}, "
          f"transformers {header['versions']['transformers']}, liger {header['versions']['liger']}, "
          f"cce {header['versions']['cce']} | commit {commit}{' (dirty)' if dirty else ''} | {args.dtype}")

    rows, failures = [], []
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for done, kernel in enumerate(kernels, start=1):
        kernel_rows, kernel_failures = benchmark_kernel(kernel, args, copy_gbps)
        rows += kernel_rows
        failures += kernel_failures
        # Written after every kernel, so a run cut short (time limit, crash) still leaves its finished kernels.
        out_path.write_text(json.dumps({**header, "complete": done == len(kernels), "passed": not failures,
                                        "failures": failures, "rows": rows}, indent=1))
    for kernel in kernels:
        print_table(kernel, rows)
    print(f"\nwrote {out_path}")
    if args.plot is not None:
        prefix = args.plot or str(out_path.with_suffix(""))
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        for kernel in kernels:
            written = plot(kernel, rows, f"{prefix}_{kernel}.png", header)
            if written:
                print(f"wrote {written}")

    print("\nSUMMARY: " + ("all correctness checks of our kernels PASSED" if not failures else
                           f"{len(failures)} FAILED:\n  " + "\n  ".join(failures)))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
