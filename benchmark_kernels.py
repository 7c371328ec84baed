"""Benchmark the fused kernels against PyTorch eager, torch.compile, Liger-Kernel and Cut-Cross-Entropy.

    python benchmark_kernels.py                        # every kernel at the playbook's sizes (GPU) or toy sizes (CPU)
    python benchmark_kernels.py --kernel rmsnorm --tokens 4096 16384 65536 --plot
    python benchmark_kernels.py --kernel all --out 'results/bench_{kernel}_h200.json' --plot   # one file per kernel

What one run does
-----------------
1. Measures the device's copy bandwidth: a large device-to-device `copy_` (bytes read + bytes written, divided by the
   median time). No kernel that must read and write its data once can beat it, so it is the ceiling that every
   "% of copy" column is relative to. The vendor's datasheet figure is higher than any real copy reaches.
2. For every kernel, size and provider (an implementation: ours, PyTorch eager, torch.compile, Liger, ...):
   - a correctness check BEFORE timing: the forward output (or loss) and every gradient against a float64 reference
     built from the same rounded inputs. The error is a relative norm, |got - ref| / |ref| (an all-zero result scores
     1.0). The rule: no worse than the kernel's rule provider (PyTorch in the same dtype) times ERROR_FACTOR, plus a
     small floor. One of OUR providers above it is a FAIL and makes the exit code non-zero; any other provider above
     it is reported as "above rule (peer)" and not judged (e.g. Liger's bf16 loss). Where the rule provider alone runs
     out of memory at a size, its errors at a smaller size of the run set the limits (the row names that size).
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
   - effective bandwidth from the MINIMAL bytes each phase must move (the formula is in the legend and in every JSON
     row), and its percentage of the measured copy bandwidth. Extra traffic a provider makes (fp32 copies, saved
     intermediates) shows up as a lower GB/s, which is the point. Compute-bound kernels report TFLOP/s instead.
3. Prints one table per kernel with a legend, writes a JSON file (header: GPU, copy bandwidth, versions, commit,
   command, date; one row per kernel x provider x size x phase) and, with --plot, one PNG per kernel.

Outputs: without --out the JSON goes to the git-ignored runs/ folder, named after what distinguishes the run (kernel,
device, and dtype, sizes, dims, providers when not the defaults). Measured results are kept in results/ only when
--out says so; "{kernel}" in --out writes one file per kernel. The PNGs are named after the JSON path.

Registry: every kernel is one `register(KernelSpec(...))` entry (sizes, dims, case builder, float64 reference,
providers, byte or FLOP counts, legend lines); the loop, tables, JSON, plots and legends read only the registry.
A variant of ours (e.g. a loss option) is one more `Provider` in its kernel's list: its `options` are passed to it,
to the float64 reference and to the rule provider, so it is judged against the same math.

Without a GPU everything runs on Triton's CPU interpreter at toy sizes; times come from time.perf_counter over a few
calls and are interpreter times, not meaningful, but the correctness checks and the output files are real (CI runs it
that way).
"""
import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Optional

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
DEFAULT_DTYPE = "bf16"
REPO = Path(__file__).resolve().parent
RUNS_DIR = REPO / "runs"  # git-ignored: default outputs never dirty the checkout
PHASES = ("fwd", "bwd", "fwd+bwd")
RMSNORM_EPS = 1e-5  # LLaMA-3.1-8B's released config
IGNORE_INDEX = -100

# Correctness rule: error <= ERROR_FACTOR * (rule provider's error) + ERROR_FLOOR[dtype of that output], the same on
# the GPU and on the CPU interpreter (the kernels round their 16-bit results to nearest even on both).
ERROR_FACTOR = 2.0
ERROR_FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-4, torch.float16: 1e-5}
# The "check" column: ours are judged, every other provider (a peer or the rule provider itself) is only reported.
PASS, FAIL, PEER_ABOVE, PEER_FAILED, UNCHECKED = "pass", "FAIL", "above rule (peer)", "failed (peer)", "unchecked"
MIN_TIMED_CALLS = 5  # slow providers (100 ms linear CE) still get this many timed calls
CPU_TIMED_CALLS = 3
CPU_COPY_BYTES = 64 * 2**20
# Host time: calls back to back without synchronizing. Ten calls launch at most a few hundred kernels, far from the
# 1024 that fill CUDA's launch queue (past that the host would wait for the GPU and time it instead).
HOST_TIMED_CALLS = 10 if ON_GPU else 1


# ----------------------------------------------------------------------------------------------------------------------
# The registry: one KernelSpec per kernel
# ----------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    """The inputs of one size. `args` are passed positionally to every provider; `grad_inputs` names the arguments
    whose gradients are checked ({"dx": 0}: the gradient of args[0] is reported as "dx"); `dy` is the upstream
    gradient (None for a scalar loss). A kernel with several outputs (rope: q_embed, k_embed) has a tuple of output
    names and a tuple of upstream gradients, one each. `shape` goes into the JSON rows and the byte counts."""
    args: list
    grad_inputs: dict
    dy: object
    out_name: object
    shape: dict

    def fresh(self):
        """A private copy of the inputs: in-place providers (Liger, ours_inplace) overwrite their logits / dy.
        clone() keeps the strides, so transposed views stay transposed."""
        args = [a.detach().clone().requires_grad_(a.requires_grad) for a in self.args]
        if isinstance(self.dy, tuple):
            return args, tuple(d.clone() for d in self.dy)
        return args, None if self.dy is None else self.dy.clone()


@dataclasses.dataclass(frozen=True)
class Count:
    """Bytes (or FLOPs) one phase must move (or compute). `formula` is what the legend and the JSON rows show;
    `value(shape, s)` evaluates it for a case's shape dict and s bytes per element (FLOP counts ignore s)."""
    formula: str
    value: Callable[[dict, int], int]


@dataclasses.dataclass(frozen=True)
class Provider:
    """One implementation, one row per size in the table. `load(**options)` returns the callable that takes the
    case's args (it may import an optional package: ImportError gives a "not installed" row; SkipProvider a row with
    its reason). Providers with `ours` are judged (their FAIL fails the run); the others are peers, only reported.
    `options` are keyword options of the math (e.g. a loss option of a variant of ours): the float64 reference and
    the rule provider are called with the same ones. `dtypes` limits the provider to these --dtype values. A
    `ceiling` is not an implementation but the work no implementation can skip (e.g. the matmuls alone): it is timed,
    not checked, and its row is the yardstick for the others."""
    name: str
    load: Callable[..., Callable]
    note: Optional[str] = None
    ours: bool = False
    options: dict = dataclasses.field(default_factory=dict)
    dtypes: tuple = ()
    ceiling: bool = False


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything the benchmark knows about one kernel."""
    name: str
    tokens_gpu: tuple             # default token counts N (rows) on a GPU ...
    tokens_cpu: tuple             # ... and on the CPU interpreter (~1 ms per Triton program there: toy sizes)
    dims_gpu: dict                # the other dimensions by name (each becomes a --<name> option) on a GPU ...
    dims_cpu: dict                # ... and on the CPU
    make_case: Callable           # (tokens, dims, dtype, torch.Generator) -> Case
    reference: Callable           # (case, **options) -> {output or gradient name: float64 tensor}
    providers: tuple              # Provider entries, in table order
    rule_provider: str            # whose error (times ERROR_FACTOR, plus a floor) every provider must not exceed
    bytes: dict = dataclasses.field(default_factory=dict)  # phase -> Count: minimal bytes, GB/s and % of copy
    flops: dict = dataclasses.field(default_factory=dict)  # phase -> Count: FLOPs, TFLOP/s (compute-bound kernels)
    legend: tuple = ()            # legend lines of this kernel alone
    fp32_outputs: tuple = ()      # outputs returned in fp32 whatever the input dtype (losses): they get the fp32 floor
    extra_providers: Optional[Callable] = None  # argparse args -> more Provider entries chosen by options

    def providers_for(self, args):
        """The providers that apply to this run's dtype (and options), in table order."""
        listed = [*self.providers, *(self.extra_providers(args) if self.extra_providers else [])]
        return [p for p in listed if not p.dtypes or args.dtype in p.dtypes]

    def provider(self, name):
        return next(p for p in self.providers if p.name == name)


KERNELS = {}


def register(spec):
    """Add a kernel to the benchmark (its name becomes a --kernel choice)."""
    if spec.rule_provider not in {p.name for p in spec.providers}:
        raise ValueError(f"register: {spec.name}'s rule provider {spec.rule_provider!r} is not one of its providers")
    KERNELS[spec.name] = spec
    return spec


class SkipProvider(Exception):
    """Raised by a provider's load() when it cannot run here; its message becomes the row's status."""


def _compiled(fn):
    """torch.compile of the eager math, compiled afresh for every size (static shapes, like the playbook's runs)."""
    if not ON_GPU:
        raise SkipProvider("skipped on CPU")
    from torch import _dynamo

    _dynamo.reset()  # drop the previous size's graphs: no recompile limit, no dynamic-shape fallback
    return torch.compile(fn, dynamic=False)


def _randn(*shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32) * scale).to(dtype)


def _reference_chunks(n_rows, row_elems):
    """Row chunks of at most 2**27 float64 elements (1 GiB), so the float64 references fit at N = 16384, V = 128256."""
    step = max(1, (2**27) // max(row_elems, 1))
    return [(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]


def _per_row(factor, *dims):
    """Count factor * N * dims... * s, e.g. _per_row(5, "hidden") for 5*N*H*s."""
    return lambda shape, s: factor * shape["tokens"] * math.prod(shape[d] for d in dims) * s


# --- RMSNorm ----------------------------------------------------------------------------------------------------------
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


def _ours_rmsnorm():
    from rmsnorm_kernel import rms_norm
    return lambda x, weight: rms_norm(x, weight, RMSNORM_EPS)


def _liger_rmsnorm():
    from liger_kernel.ops import LigerRMSNormFunction
    # LigerRMSNorm's defaults for LLaMA: casting_mode="llama", in_place=True (dx overwrites dy in the backward).
    return lambda x, weight: LigerRMSNormFunction.apply(x, weight, RMSNORM_EPS, 0.0, "llama", True, None)


register(KernelSpec(
    name="rmsnorm",
    tokens_gpu=(256, 512, 1024, 2048, 4096, 8192, 16384, 65536), tokens_cpu=(4, 8),
    dims_gpu={"hidden": 4096}, dims_cpu={"hidden": 64},
    make_case=rmsnorm_case, reference=rmsnorm_reference, rule_provider="eager",
    providers=(
        Provider("ours", _ours_rmsnorm, ours=True),
        Provider("eager", lambda: llama_rmsnorm_math, "transformers' LlamaRMSNorm math"),
        Provider("torch_compile", lambda: _compiled(llama_rmsnorm_math), "torch.compile of the eager math"),
        Provider("liger", _liger_rmsnorm, "casting_mode='llama', in_place=True (dx overwrites dy)"),
    ),
    bytes={"fwd": Count("2*N*H*s", _per_row(2, "hidden")), "bwd": Count("3*N*H*s", _per_row(3, "hidden")),
           "fwd+bwd": Count("5*N*H*s", _per_row(5, "hidden"))},
    legend=("fwd reads x, writes y; bwd reads x, dy, writes dx (the weight and dw, H elements each, are left out)",),
))


# --- Cross-entropy ----------------------------------------------------------------------------------------------------
def cross_entropy_case(tokens, dims, dtype, gen):
    vocab = dims["vocab"]
    logits = _randn(tokens, vocab, dtype=dtype, gen=gen, scale=2.0).requires_grad_()
    # Every target is a real class: an ignored row need not be read, which would flatter the bytes-based GB/s.
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device=DEVICE)
    return Case([logits, targets], {"dlogits": 0}, None, "loss", {"tokens": tokens, "vocab": vocab})


def _loss_sum(logits, targets, lse_square_scale=0.0, softcap=None, return_token_accuracy=False):
    """Sum over rows of the loss with the extras a variant asks for (Liger's meaning): logits softcapped to
    softcap * tanh(logits / softcap) first, plus lse_square_scale * lse^2 per row (z-loss). Token accuracy changes
    nothing in the loss. Every target is valid in these cases, so "mean" is this sum over the rows."""
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    if lse_square_scale:
        loss = loss + lse_square_scale * (torch.logsumexp(logits, dim=-1) ** 2).sum()
    return loss


def cross_entropy_reference(case, **options):
    logits, targets = case.args
    n_rows, vocab = logits.shape
    loss = torch.zeros((), dtype=torch.float64, device=DEVICE)
    grad = torch.empty(n_rows, vocab, dtype=torch.float64, device=DEVICE)
    for start, end in _reference_chunks(n_rows, vocab):
        chunk = logits[start:end].detach().double().requires_grad_()
        part = _loss_sum(chunk, targets[start:end], **options) / n_rows  # "mean": all targets are valid
        part.backward()
        loss += part.detach()
        grad[start:end] = chunk.grad
    return {"loss": loss, "dlogits": grad}


def torch_fp32_cross_entropy(logits, targets, **options):
    """What transformers' loss does: upcast the logits to fp32, then F.cross_entropy (with a variant's extras)."""
    if not options:
        return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)
    return _loss_sum(logits.float(), targets, **options) / targets.numel()


def torch_lowp_cross_entropy(logits, targets):
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)


def _loss_of(output):
    """The loss tensor of a call that may return it with extras (ours and Liger: an output object with .loss, or a
    tuple whose first entry is the loss)."""
    if isinstance(output, torch.Tensor):
        return output
    return output.loss if hasattr(output, "loss") else output[0]


def _ours_cross_entropy(**options):
    from cross_entropy_kernel import cross_entropy
    return lambda logits, targets: _loss_of(cross_entropy(logits, targets, **options))


def _liger_cross_entropy(**options):
    from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
    loss = LigerCrossEntropyLoss(ignore_index=IGNORE_INDEX, **options)
    return lambda logits, targets: _loss_of(loss(logits, targets))


# The loss extras timed as variants (same names and values a Liger user passes).
Z_LOSS_AND_ACCURACY = {"lse_square_scale": 1e-4, "return_token_accuracy": True}
SOFTCAP = {"softcap": 30.0}


_OURS_CE_NOTE = ("forward computes loss AND gradient (moves 2*N*V*s); backward only scales it by grad_output "
                 "(a no-op at 1)")
register(KernelSpec(
    name="cross_entropy",
    tokens_gpu=(128, 256, 512, 1024, 2048, 4096, 8192, 16384), tokens_cpu=(4, 8),
    dims_gpu={"vocab": 128256}, dims_cpu={"vocab": 500},
    make_case=cross_entropy_case, reference=cross_entropy_reference, rule_provider="torch_fp32",
    fp32_outputs=("loss",),
    providers=(
        Provider("ours", _ours_cross_entropy, _OURS_CE_NOTE, ours=True),
        Provider("ours_inplace", lambda: _ours_cross_entropy(inplace_backward=True),
                 "as ours, gradient written into the logits buffer (+0 MiB); timed calls reuse the overwritten buffer "
                 "(same bytes and work), correctness uses fresh logits", ours=True),
        Provider("torch_fp32", lambda **options: functools.partial(torch_fp32_cross_entropy, **options),
                 "logits.float() copy, fp32 log_softmax saved for the backward"),
        # In fp32 the low-precision path is the fp32 path: these two exist only in their own dtype.
        Provider("torch_bf16", lambda: torch_lowp_cross_entropy,
                 "F.cross_entropy in bf16: bf16 loss, so it is above the fp32-loss rule by design", dtypes=("bf16",)),
        Provider("torch_fp16", lambda: torch_lowp_cross_entropy,
                 "F.cross_entropy in fp16: fp16 loss, so it is above the fp32-loss rule by design", dtypes=("fp16",)),
        Provider("torch_compile", lambda: _compiled(torch_fp32_cross_entropy), "torch.compile of the fp32 path"),
        Provider("liger", _liger_cross_entropy, "gradient written into the logits buffer during the forward; host "
                 "syncs (.item()) in forward and torch.equal in backward; loss in the logits' dtype"),
        Provider("ours_zloss_acc", lambda **options: _ours_cross_entropy(inplace_backward=True, **options),
                 "ours_inplace with z-loss (lse_square_scale=1e-4) and token accuracy", ours=True,
                 options=Z_LOSS_AND_ACCURACY),
        Provider("liger_zloss_acc", _liger_cross_entropy, "liger with the same options", options=Z_LOSS_AND_ACCURACY),
        Provider("ours_softcap", lambda **options: _ours_cross_entropy(inplace_backward=True, **options),
                 "ours_inplace with logit softcapping at 30 (Gemma-2)", ours=True, options=SOFTCAP),
        Provider("liger_softcap", _liger_cross_entropy, "liger with the same option", options=SOFTCAP),
    ),
    bytes={"fwd": Count("N*V*s", _per_row(1, "vocab")), "fwd+bwd": Count("2*N*V*s", _per_row(2, "vocab"))},
    legend=("fwd reads the logits once (the loss alone); fwd+bwd also writes their gradient",
            "ours, ours_inplace and liger write the gradient in the forward: their fwd GB/s counts only N*V*s of the "
            "2*N*V*s they move, and their bwd is nearly empty: compare fwd+bwd"),
))


# --- Linear cross-entropy ---------------------------------------------------------------------------------------------
def linear_cross_entropy_case(tokens, dims, dtype, gen):
    hidden, vocab = dims["hidden"], dims["vocab"]
    h = _randn(tokens, hidden, dtype=dtype, gen=gen).requires_grad_()
    weight = _randn(vocab, hidden, dtype=dtype, gen=gen, scale=hidden ** -0.5).requires_grad_()  # logits ~ N(0, 1)
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device=DEVICE)
    return Case([h, weight, targets], {"dh": 0, "dW": 1}, None, "loss",
                {"tokens": tokens, "hidden": hidden, "vocab": vocab})


def linear_cross_entropy_reference(case, return_token_accuracy=False):
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


def eager_linear_cross_entropy(h, weight, targets, return_token_accuracy=False):
    """transformers: lm_head makes [N, V] logits in the model dtype, the loss upcasts them to fp32."""
    return F.cross_entropy((h @ weight.t()).float(), targets, ignore_index=IGNORE_INDEX)


def _ours_linear_cross_entropy(**options):
    from linear_cross_entropy_kernel import linear_cross_entropy
    return lambda h, weight, targets: _loss_of(linear_cross_entropy(h, weight, targets, **options))


class _LinearCrossEntropyMatmuls(torch.autograd.Function):
    """The three matmuls of a linear cross-entropy and nothing else, unchunked: logits = h W^T in the forward,
    dh = G W and dW = G^T h in the backward, with the logits standing in for their gradient G. No loss is computed, so
    its time is what any fused linear cross-entropy must spend at least."""

    @staticmethod
    def forward(ctx, h, weight):
        logits = h @ weight.t()
        ctx.save_for_backward(h, weight, logits)
        return logits.new_zeros((), dtype=torch.float32)  # a scalar "loss" that backward() can start from

    @staticmethod
    def backward(ctx, _):
        h, weight, logits = ctx.saved_tensors
        return logits @ weight, logits.t() @ h


def _linear_cross_entropy_matmuls():
    return lambda h, weight, targets: _LinearCrossEntropyMatmuls.apply(h, weight)


def _liger_linear_cross_entropy():
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
    return lambda h, weight, targets: loss(weight, h, targets)  # Liger takes (lm_head weight, hidden, targets)


def _cce_linear_cross_entropy():
    from cut_cross_entropy import linear_cross_entropy as cce_linear_cross_entropy
    # Defaults kept (impl="cce", filter_eps="high": gradient entries below a threshold are skipped).
    return lambda h, weight, targets: cce_linear_cross_entropy(h, weight, targets, ignore_index=IGNORE_INDEX)


def _ours_linear_cross_entropy_chunks(args):
    """--chunk-sizes C...: ours again with an explicit chunk_size, one row each (ours_chunk<C>)."""
    return [Provider(f"ours_chunk{size}", lambda size=size: _ours_linear_cross_entropy(chunk_size=size),
                     f"as ours, chunk_size={size}", ours=True) for size in args.chunk_sizes or []]


register(KernelSpec(
    name="linear_cross_entropy",
    tokens_gpu=(1024, 4096, 8192, 16384), tokens_cpu=(4, 8),
    dims_gpu={"hidden": 4096, "vocab": 128256}, dims_cpu={"hidden": 64, "vocab": 500},
    make_case=linear_cross_entropy_case, reference=linear_cross_entropy_reference, rule_provider="eager",
    fp32_outputs=("loss",),
    providers=(
        Provider("ours", _ours_linear_cross_entropy,
                 "loss and all gradients computed in the forward (token chunks); backward scales", ours=True),
        Provider("eager", lambda **options: functools.partial(eager_linear_cross_entropy, **options),
                 "bf16 [N, V] logits, fp32 copy for the loss"),
        Provider("liger", _liger_linear_cross_entropy, "loss and all gradients computed in the forward (token chunks)"),
        Provider("cce", _cce_linear_cross_entropy,
                 "filter_eps='high' (default): small gradient entries skipped (approximate)"),
        Provider("ours_acc", _ours_linear_cross_entropy, "ours, also returning the token accuracy", ours=True,
                 options={"return_token_accuracy": True}),
        Provider("matmuls", _linear_cross_entropy_matmuls,
                 "ceiling: the three matmuls alone (cuBLAS, unchunked, bf16 [N, V] logits), no loss", ceiling=True),
    ),
    extra_providers=_ours_linear_cross_entropy_chunks,
    flops={"fwd+bwd": Count("6*N*H*V", lambda shape, s: 6 * shape["tokens"] * shape["hidden"] * shape["vocab"])},
    legend=("three [N, H] x [H, V] matmuls (logits, dh, dW): compute-bound, so TFLOP/s instead of GB/s",),
))


# --- SwiGLU -----------------------------------------------------------------------------------------------------------
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


def _ours_swiglu():
    from swiglu_kernel import swiglu
    return swiglu


def _liger_swiglu():
    from liger_kernel.ops import LigerSiLUMulFunction
    return lambda gate, up: LigerSiLUMulFunction.apply(gate, up, 1.0, 1.0)


register(KernelSpec(
    name="swiglu",
    tokens_gpu=(256, 512, 1024, 2048, 4096, 8192, 16384), tokens_cpu=(4, 8),
    dims_gpu={"intermediate": 14336}, dims_cpu={"intermediate": 100},
    make_case=swiglu_case, reference=swiglu_reference, rule_provider="eager",
    providers=(
        Provider("ours", _ours_swiglu, ours=True),
        Provider("eager", lambda: eager_swiglu, "transformers' LlamaMLP: silu(gate) * up in the model dtype"),
        Provider("torch_compile", lambda: _compiled(eager_swiglu), "torch.compile of the eager math"),
        Provider("liger", _liger_swiglu, "LigerSiLUMulFunction"),
    ),
    bytes={"fwd": Count("3*N*I*s", _per_row(3, "intermediate")), "bwd": Count("5*N*I*s", _per_row(5, "intermediate")),
           "fwd+bwd": Count("8*N*I*s", _per_row(8, "intermediate"))},
    legend=("fwd reads gate, up, writes out; bwd reads gate, up, dy, writes dgate, dup: 8*N*I*s is the minimum of a "
            "separate forward and backward",),
))


# --- RoPE -------------------------------------------------------------------------------------------------------------
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


def _ours_rope():
    from rope_kernel import apply_rotary_pos_emb
    return apply_rotary_pos_emb


def _liger_rope():
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    # Some Liger versions return (q, k, cos, sin): keep the two embeddings.
    return lambda q, k, cos, sin: tuple(liger_rotary_pos_emb(q, k, cos, sin)[:2])


def _rope_bytes(passes):
    """`passes` passes of RoPE: each reads q and k (or their gradients), writes their rotations, reads cos and sin."""
    return lambda d, s: passes * (2 * (d["heads"] + d["kv_heads"]) + 2) * d["tokens"] * d["head_dim"] * s


register(KernelSpec(
    name="rope",
    tokens_gpu=(512, 2048, 8192, 16384), tokens_cpu=(4, 8),
    dims_gpu={"heads": 32, "kv_heads": 8, "head_dim": 128}, dims_cpu={"heads": 4, "kv_heads": 2, "head_dim": 16},
    make_case=rope_case, reference=rope_reference, rule_provider="eager",
    providers=(
        Provider("ours", _ours_rope, "one launch for q and k; strided (transposed) inputs read in place; fp32 math, "
                 "one rounding", ours=True),
        Provider("eager", eager_rope, "transformers' apply_rotary_pos_emb: separate mul/neg/cat/mul/add kernels, a "
                 "rounding after each"),
        Provider("torch_compile", lambda: _compiled(eager_rope()), "torch.compile of transformers' function"),
        Provider("liger", _liger_rope, "liger_rotary_pos_emb: rotates q and k in their own buffers (and the "
                 "gradients in dq_embed's); reads only the first half of cos/sin (assumes their halves are equal, "
                 "as in LLaMA)"),
    ),
    bytes={"fwd": Count("(2*(Hq+Hk)+2)*N*D*s", _rope_bytes(1)), "bwd": Count("(2*(Hq+Hk)+2)*N*D*s", _rope_bytes(1)),
           "fwd+bwd": Count("(4*(Hq+Hk)+4)*N*D*s", _rope_bytes(2))},
    legend=("tokens = sequence length T at batch 1; q [1, Hq, T, D] and k [1, Hk, T, D] are the transposed views "
            "LlamaAttention passes, cos/sin [1, T, D] as LlamaRotaryEmbedding builds them",
            "fwd reads q, k, cos, sin, writes q_embed, k_embed; bwd the same with the gradients"),
))


# ----------------------------------------------------------------------------------------------------------------------
# Measuring: errors, memory, time
# ----------------------------------------------------------------------------------------------------------------------
def run_backward(out, dy, retain_graph=False):
    """out.backward(dy), also for a tuple of outputs with a tuple of upstream gradients."""
    if isinstance(out, tuple):
        torch.autograd.backward(out, dy, retain_graph=retain_graph)
    else:
        out.backward(dy, retain_graph=retain_graph)


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


def peak_mib_above_inputs(fn, case):
    """Peak memory of one forward+backward above what was allocated before it (inputs exist already), in MiB."""
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
        bwd_method = timing_method()
    else:
        # Two medians' difference: a near-empty backward can come out slightly negative; that is noise, shown as 0.
        phases["bwd"] = (max(0.0, phases["fwd+bwd"][0] - phases["fwd"][0]), None, None)
        bwd_method = "derived: max(0, fwd+bwd - fwd) (the backward can run only once)"
    return phases, bwd_method, host


def timing_method():
    return "do_bench" if ON_GPU else "perf_counter"


def measure_copy_bandwidth(copy_gib):
    """GB/s of a device-to-device copy: (bytes read + bytes written) / median time."""
    n_bytes = int(copy_gib * 2**30) if ON_GPU else CPU_COPY_BYTES
    src = torch.empty(n_bytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    median_ms = time_ms(lambda: dst.copy_(src), [], 100, 25)[0]
    return 2 * n_bytes / (median_ms * 1e-3) / 1e9, n_bytes


# ----------------------------------------------------------------------------------------------------------------------
# One kernel: check, measure, make rows
# ----------------------------------------------------------------------------------------------------------------------
def kernel_dims(spec, args):
    """The kernel's dimensions: a --<dim> option when given, else the kernel's GPU or CPU default."""
    defaults = spec.dims_gpu if ON_GPU else spec.dims_cpu
    return {name: default if getattr(args, name, None) is None else getattr(args, name)
            for name, default in defaults.items()}


def kernel_tokens(spec, args):
    return list(args.tokens or (spec.tokens_gpu if ON_GPU else spec.tokens_cpu))


def _short(exc):
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def check_label(provider, passed):
    """pass, FAIL for ours, "above rule (peer)" for any other provider: only ours are judged."""
    if passed:
        return PASS
    return FAIL if provider.ours else PEER_ABOVE


def correctness_rule(spec, case, options, dtype, tokens, smaller=None):
    """(float64 reference, the rule provider's errors, limits, the size those errors come from) for one case and one
    set of options, or the exception that prevented them (e.g. out of memory at a size too large for this device).

    smaller: (tokens, errors) of the rule provider at a smaller size of this run. Where the rule provider alone runs
    out of memory at this size (PyTorch's fp32 path holds several fp32 copies of the logits: with a softcap at 16384 x
    128256 it does not fit beside the float64 reference on an 80 GB card), those errors set the limits: they are
    relative norms, which do not grow with the number of rows."""
    try:
        ref = spec.reference(case, **options)
    except Exception as exc:
        if ON_GPU:
            torch.cuda.empty_cache()
        return exc
    try:
        rule_provider = spec.provider(spec.rule_provider).load(**options)
        rule_errors, rule_tokens = errors_of(run_once(rule_provider, case), ref), tokens
    except Exception as exc:
        if ON_GPU:
            torch.cuda.empty_cache()
        if not isinstance(exc, torch.OutOfMemoryError) or smaller is None:
            return exc
        rule_tokens, rule_errors = smaller
    # The floor follows the dtype of the output: losses are fp32 (what transformers' loss returns), the rest dtype.
    limits = {name: ERROR_FACTOR * err + ERROR_FLOOR[torch.float32 if name in spec.fp32_outputs else dtype]
              for name, err in rule_errors.items()}
    return ref, rule_errors, limits, rule_tokens


def benchmark_kernel(kernel, args, copy_gbps):
    """Check and time every provider of KERNELS[kernel] at every size: (JSON rows, failures of our providers)."""
    spec = KERNELS[kernel]
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    dims = kernel_dims(spec, args)
    selected = [p for p in spec.providers_for(args) if not args.providers or p.name in args.providers]
    rows, failures = [], []

    def base_row(provider, status):
        row = {"kernel": kernel, "provider": provider.name, "status": status, "dtype": args.dtype,
               "note": provider.note, "judged": provider.ours, "error": None, "check": None}
        if provider.options:
            row["options"] = provider.options
        return row

    # Providers that cannot load at all (not installed, skipped on CPU) give one row and are dropped.
    loadable = []
    for provider in selected:
        try:
            provider.load(**provider.options)
            loadable.append(provider)
            continue
        except SkipProvider as reason:
            status = str(reason)
        except Exception as exc:  # ImportError: the package is absent; anything else: it is there but broken
            status = (f"not installed ({exc.name or exc})" if isinstance(exc, ImportError) else
                      f"failed to load: {_short(exc)}")
            if provider.ours:
                failures.append(f"{kernel}/{provider.name}: {status}")
        rows.append(base_row(provider, status))
        print(f"  {kernel:<21} {provider.name:<14} {status}")

    measured_rules = {}  # options (as JSON) -> (tokens, the rule provider's errors) at the last size it ran at
    for tokens in kernel_tokens(spec, args):
        gen = torch.Generator(device=DEVICE).manual_seed(args.seed + tokens)  # fresh data for every size
        try:
            case, missing = spec.make_case(tokens, dims, dtype, gen), None
        except Exception as exc:  # e.g. out of memory at a size too large for this device
            case, missing = None, f"failed: inputs: {_short(exc)}"
            failures.append(f"{kernel} N={tokens}: {missing}")
            print(f"  {kernel:<21} N={tokens:<6} {missing}")
        # options (as JSON) -> (reference, rule provider's errors, limits), or why no provider can be checked
        rules = {}
        for provider in loadable:
            key = json.dumps(provider.options, sort_keys=True)
            if provider.ceiling:  # timed, not checked: it needs no reference
                rule = missing or (None, None, None, None)
            else:
                if key not in rules:
                    rules[key] = missing or correctness_rule(spec, case, provider.options, dtype, tokens,
                                                             measured_rules.get(key))
                    if isinstance(rules[key], Exception):
                        rules[key] = f"failed: reference/{spec.rule_provider}: {_short(rules[key])}"
                        failures.append(f"{kernel} N={tokens}{' ' + key if provider.options else ''}: {rules[key]}")
                        print(f"  {kernel:<21} N={tokens:<6} {rules[key]}")
                    elif not isinstance(rules[key], str):  # a rule, measured here or borrowed from a smaller size
                        _, rule_errors, _, rule_tokens = rules[key]
                        if rule_tokens == tokens:
                            measured_rules[key] = (tokens, rule_errors)
                        else:
                            print(f"  {kernel:<21} N={tokens:<6} {spec.rule_provider} out of memory here: the limits "
                                  f"{'of ' + key + ' ' if provider.options else ''}come from its errors at "
                                  f"N={rule_tokens}")
                rule = rules[key]
            if isinstance(rule, str):
                rows.append(dict(base_row(provider, rule), tokens=tokens, check=FAIL if provider.ours else UNCHECKED))
                continue
            ref, rule_errors, limits, rule_tokens = rule
            row_head = dict(base_row(provider, "ok"), tokens=tokens, shape=case.shape,
                            what=None, error_baseline=rule_errors, error_limit=limits)
            if rule_tokens not in (None, tokens):  # the rule provider did not fit at this size
                row_head["error_baseline_tokens"] = rule_tokens
            try:
                fn = provider.load(**provider.options)
                err = {} if provider.ceiling else errors_of(run_once(fn, case), ref)
                passed = all(err[name] <= limits[name] for name in err)
                check = UNCHECKED if provider.ceiling else check_label(provider, passed)
                row_head.update(error=err or None, check=check)
                if not passed and provider.ours:
                    failures.append(f"{kernel}/{provider.name} N={tokens}: error {err} above the limit {limits}")
                row_head["peak_mb"] = peak_mib_above_inputs(fn, case)  # in MiB; the name the results/ files use
                phases, bwd_method, host = time_phases(fn, case, args.rep_ms, args.warmup_ms)
            except Exception as exc:  # a provider that breaks is a row, not a crash
                if ON_GPU and isinstance(exc, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
                row_head.update(status=f"failed: {_short(exc)}", check=FAIL if provider.ours else PEER_FAILED)
                rows.append(row_head)
                if provider.ours:
                    failures.append(f"{kernel}/{provider.name} N={tokens}: {row_head['status']}")
                print(f"  {kernel:<21} {provider.name:<14} N={tokens:<6} {row_head['status']}")
                continue
            for phase in PHASES:
                median, p20, p80 = phases[phase]
                row = dict(row_head, what=f"{kernel} {phase}", phase=phase, median_ms=median, p20_ms=p20, p80_ms=p80,
                           timing=bwd_method if phase == "bwd" else timing_method(), host_ms=host.get(phase))
                add_throughput(row, spec, phase, case.shape, itemsize, copy_gbps)
                rows.append(row)
            if provider.ceiling:
                checked = "(ceiling, not checked)"
            else:
                worst = worst_output(err, limits)
                checked = f"(worst error {worst} {err[worst]:.1e}, limit {limits[worst]:.1e})"
            print(f"  {kernel:<21} {provider.name:<14} N={tokens:<6} {row_head['check']:<4} {checked}  "
                  f"fwd+bwd {phases['fwd+bwd'][0]:.3f} ms")
        del case, rules
        if ON_GPU:
            torch.cuda.empty_cache()
    return rows, failures


def worst_output(errors, limits):
    """The output (or gradient) closest to, or furthest past, its limit."""
    return max(errors, key=lambda name: errors[name] / limits[name])


def add_throughput(row, spec, phase, shape, itemsize, copy_gbps):
    """The phase's byte count, GB/s and % of copy (or FLOP count and TFLOP/s), with the formula, into the row."""
    seconds = row["median_ms"] * 1e-3
    usable = seconds > 0  # a derived backward can come out at (or below) zero
    count = spec.bytes.get(phase)
    if count:
        n_bytes = count.value(shape, itemsize)
        gbps = n_bytes / seconds / 1e9 if usable else None
        row.update(bytes_formula=count.formula, bytes=n_bytes, gbps=gbps,
                   pct_of_copy=None if gbps is None else 100 * gbps / copy_gbps)
    count = spec.flops.get(phase)
    if count:
        n_flops = count.value(shape, itemsize)
        row.update(flops_formula=count.formula, flops=n_flops, tflops=n_flops / seconds / 1e12 if usable else None)


# ----------------------------------------------------------------------------------------------------------------------
# Output: tables, legends, plots
# ----------------------------------------------------------------------------------------------------------------------
def _fmt(value, spec=".3f"):
    return "-" if value is None else format(value, spec)


def print_table(kernel, rows):
    spec = KERNELS[kernel]
    baseline = spec.rule_provider
    timed = [r for r in rows if r["kernel"] == kernel and r.get("phase")]
    by_key = {(r["provider"], r["tokens"], r["phase"]): r for r in timed}
    order = list(dict.fromkeys(r["provider"] for r in timed))
    keys = sorted({(r["tokens"], r["provider"]) for r in timed}, key=lambda k: (k[0], order.index(k[1])))
    table = []
    for tokens, provider in keys:
        fwd, bwd, both = (by_key.get((provider, tokens, p), {}) for p in PHASES)
        base = by_key.get((baseline, tokens, "fwd+bwd"))
        speedup = base["median_ms"] / both["median_ms"] if base and both.get("median_ms") else None
        reduction = None
        if base and base.get("peak_mb") and both.get("peak_mb") is not None:
            reduction = 100 * (1 - both["peak_mb"] / base["peak_mb"])
        err = both["error"]
        worst_error = "-"
        if err:  # a ceiling row has no errors
            worst = worst_output(err, both["error_limit"])
            worst_error = f"{worst} {err[worst]:.1e}"
        line = [provider, tokens, _fmt(fwd.get("median_ms")),
                _fmt(bwd.get("median_ms")) + ("*" if bwd.get("timing", "").startswith("derived") else ""),
                _fmt(both.get("median_ms")), _fmt(both.get("host_ms"))]
        if spec.flops:
            line += [_fmt(both.get("tflops"), ".1f")]
        if spec.bytes:
            line += [_fmt(fwd.get("gbps"), ".0f"), _fmt(fwd.get("pct_of_copy"), ".1f"),
                     _fmt(both.get("gbps"), ".0f"), _fmt(both.get("pct_of_copy"), ".1f")]
        line += [_fmt(speedup, ".2f"), _fmt(both.get("peak_mb"), ".0f"), _fmt(reduction, ".0f"),
                 worst_error, both["check"]]
        table.append(line)
    headers = ["provider", "tokens", "fwd ms", "bwd ms", "fwd+bwd ms", "f+b host ms"]
    headers += ["fwd+bwd TFLOP/s"] if spec.flops else []
    headers += ["fwd GB/s", "fwd % copy", "fwd+bwd GB/s", "fwd+bwd % copy"] if spec.bytes else []
    headers += [f"speedup vs {baseline}", "peak MiB", "mem. red. %", "max error", "check"]
    dtype = next((r["dtype"] for r in rows if r["kernel"] == kernel), "")
    print(f"\n=== {kernel} ({dtype}) ===")
    if table:
        print(tabulate(table, headers=headers, tablefmt="github"))
    for r in rows:
        if r["kernel"] == kernel and not r.get("phase"):
            print(f"{r['provider']}" + (f" N={r['tokens']}" if r.get("tokens") else "") + f": {r['status']}")
    fixed = ", ".join(f"{k}={v}" for k, v in timed[0]["shape"].items() if k != "tokens") if timed else ""
    print(legend(kernel, fixed))


def legend(kernel, fixed_dims):
    """How to read the kernel's table: what each column measured on this device, the kernel's own lines."""
    spec = KERNELS[kernel]
    baseline = spec.rule_provider
    derived = "* = derived as fwd+bwd - fwd (0 if negative: noise) because that backward can run only once"
    if ON_GPU:
        timing = [("fwd ms", "forward median (do_bench, L2 flushed; p20/p80 in the JSON)"),
                  ("bwd ms", f"backward median on one fixed forward (retain_graph); {derived}"),
                  ("fwd+bwd ms", "one training step of this op: forward then backward, the number to compare"),
                  ("f+b host ms", f"CPU time of one fwd+bwd call, the GPU left to run behind (median of "
                                  f"{HOST_TIMED_CALLS} calls back to back): close to fwd+bwd ms, the host (Python, "
                                  "autograd, launches) sets the time, not the kernels")]
        copy = "the device-to-device copy measured in this run"
        peak = [("peak MiB", "peak memory of one fwd+bwd above the inputs (gradients included), in MiB (2**20 bytes; "
                             "peak_mb in the JSON rows)"),
                ("mem. red.", f"1 - peak / {baseline}'s peak, in %")]
    else:
        timing = [("fwd ms", f"forward median of {CPU_TIMED_CALLS} time.perf_counter calls on the CPU, our kernels on "
                             "the Triton interpreter (p20/p80 in the JSON): not meaningful"),
                  ("bwd ms", f"backward on one fixed forward (retain_graph), timed the same way; {derived}"),
                  ("fwd+bwd ms", "forward then backward, timed the same way"),
                  ("f+b host ms", f"time.perf_counter of {HOST_TIMED_CALLS} more fwd+bwd call (no GPU runs behind: "
                                  "the same as fwd+bwd ms)")]
        copy = f"a {CPU_COPY_BYTES >> 20} MiB CPU copy timed the same way (not meaningful either)"
        peak = [("peak MiB", "- (not measured on the CPU)"), ("mem. red.", "- (not measured on the CPU)")]
    entries = [("provider", "the implementation (ours = this repo's kernel module; the JSON rows' notes say more)"),
               ("tokens", f"N, the rows of the inputs ({fixed_dims}; dtype in the title)"), *timing]
    if spec.flops:
        formulas = ", ".join(f"{phase} {count.formula}" for phase, count in spec.flops.items())
        entries.append(("TFLOP/s", f"FLOPs / median time; FLOPs: {formulas}"))
    if spec.bytes:
        formulas = ", ".join(f"{phase} {count.formula}" for phase, count in spec.bytes.items())
        entries += [("GB/s", f"minimal bytes / median time; bytes: {formulas} (s = bytes per element)"),
                    ("% copy", f"that GB/s as a percentage of {copy}")]
    entries += [("notes" if i == 0 else "", line) for i, line in enumerate(spec.legend)]
    entries += [("speedup", f"{baseline}'s fwd+bwd time / this provider's (> 1 = faster)"), *peak,
                ("max error", "|got - ref| / |ref| (norms; float64 reference) of the output or gradient closest to "
                              "its limit"),
                ("check", f"pass = every error <= {ERROR_FACTOR:g} x {baseline}'s error + a dtype floor; FAIL = one of "
                          f"ours above it (fails the run); '{PEER_ABOVE}' = another provider above it, reported, not "
                          f"judged; '{UNCHECKED}' on a ceiling row = the work every implementation must do, timed "
                          "only")]
    lines = ["How to read this table:"]
    for key, text in entries:
        lines.append(textwrap.fill(text, width=118, initial_indent=f"  {key:<12} ", subsequent_indent=" " * 15))
    return "\n".join(lines)


def plot(kernel, rows, path, header):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = KERNELS[kernel]
    timed = [r for r in rows if r["kernel"] == kernel and r.get("phase") == "fwd+bwd"]
    if not timed:
        return None
    compute_bound = bool(spec.flops)
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
        ax_rate.set(ylabel=f"TFLOP/s ({spec.flops['fwd+bwd'].formula} / time)", title="throughput")
    else:
        ax_rate.axhline(100, color="gray", linestyle="--", linewidth=1)
        ax_rate.set(ylabel=f"% of copy bandwidth (bytes {spec.bytes['fwd+bwd'].formula})",
                    title=f"bandwidth (100 % = copy, {header['copy_gbps']:.0f} GB/s)")
    if with_memory:
        axes[2].set(ylabel="peak MiB above inputs (one fwd+bwd)", title="memory")
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


# ----------------------------------------------------------------------------------------------------------------------
# The run: header, output paths, command line
# ----------------------------------------------------------------------------------------------------------------------
def host_cpu():
    """The host's CPU model and core count (Linux: /proc/cpuinfo): it sets the pace of host-bound steps, so figures
    from different hosts differ."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


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
    """(short commit, dirty?) of the checkout. The GIT_COMMIT and GIT_DIRTY environment variables, when set, say
    which commit a copied tree was taken from and take precedence: a copy on a GPU box may carry no .git, or a stale
    one."""
    if "GIT_COMMIT" in os.environ:
        return os.environ["GIT_COMMIT"], os.environ.get("GIT_DIRTY") not in (None, "0")

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain")
        if head.returncode == 0:
            return head.stdout.strip(), bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return "uncommitted", False


def device_name():
    return torch.cuda.get_device_name() if ON_GPU else "cpu (Triton interpreter)"


def device_slug():
    if not ON_GPU:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", device_name().lower().replace("nvidia", "")).strip("_")


def _slug(text):
    return re.sub(r"[^A-Za-z0-9.]+", "-", str(text)).strip("-")


def default_out_path(kernels, args):
    """runs/bench_<kernel or all>_<device>[_<dtype>][_n<tokens>][_<dim><value>][_<provider>+<provider>...]
    [_chunk<sizes>][_seed<seed>].json: every choice that differs from the defaults is in the name."""
    parts = ["bench", "all" if kernels == list(KERNELS) else "-".join(kernels), device_slug()]
    if args.dtype != DEFAULT_DTYPE:
        parts.append(args.dtype)
    if args.tokens:
        parts.append("n" + "-".join(map(str, args.tokens)))
    parts += [f"{name.replace('_', '')}{getattr(args, name)}" for name in all_dims() if getattr(args, name) is not None]
    if args.providers:
        parts.append("+".join(_slug(p) for p in args.providers))
    if args.chunk_sizes:
        parts.append("chunk" + "-".join(map(str, args.chunk_sizes)))
    if args.seed:
        parts.append(f"seed{args.seed}")
    return RUNS_DIR / ("_".join(parts) + ".json")


def out_paths(args):
    """{kernel: the JSON path its rows go to}: --out with "{kernel}" filled in, --out, or the default name."""
    if args.out and "{kernel}" in args.out:
        return {kernel: Path(args.out.replace("{kernel}", kernel)) for kernel in args.kernel}
    single = Path(args.out) if args.out else default_out_path(args.kernel, args)
    return {kernel: single for kernel in args.kernel}


def png_path(json_path, kernel):
    """<JSON path without .json>_<kernel>.png"""
    return json_path.with_name(json_path.with_suffix("").name + f"_{kernel}.png")


def shown(path):
    """The path relative to the working directory when it lies below it (e.g. runs/...), else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def all_dims():
    """Every dimension name of the registered kernels, with {kernel: (GPU default, CPU default)} each."""
    dims = {}
    for spec in KERNELS.values():
        for name in spec.dims_gpu:
            dims.setdefault(name, {})[spec.name] = (spec.dims_gpu[name], spec.dims_cpu[name])
    return dims


def registry_summary():
    """The --help epilog: every registered kernel's sizes, dims, counts and providers."""
    lines = ["kernels (from the registry; s = bytes per element, N = tokens):"]
    for spec in KERNELS.values():
        dims = ", ".join(f"{name} {value} (CPU {spec.dims_cpu[name]})" for name, value in spec.dims_gpu.items())
        counts = "; ".join(f"{what} " + ", ".join(f"{phase} {c.formula}" for phase, c in table.items())
                           for what, table in (("bytes", spec.bytes), ("FLOPs", spec.flops)) if table)
        text = (f"GPU tokens {' '.join(map(str, spec.tokens_gpu))} (CPU {' '.join(map(str, spec.tokens_cpu))}); "
                f"{dims}; {counts}; providers "
                f"{', '.join(p.name for p in spec.providers)} (error rule: {spec.rule_provider})")
        lines.append(textwrap.fill(text, width=118, initial_indent=f"  {spec.name:<21} ", subsequent_indent=" " * 24))
    return "\n".join(lines)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after each option; the docstring and the kernel list printed as written."""


def positive(kind):
    """An argparse type: a number of `kind` (int or float) above 0 and finite, for the options that give a size, a
    count or a time. Zero or less would time nothing, or fail inside the run as if a kernel had failed."""
    def parse(text):
        value = kind(text)  # a ValueError makes argparse say "invalid positive int value: 'x'"
        if not 0 < value < math.inf:  # also false for nan
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, epilog=registry_summary(), formatter_class=_HelpFormatter)
    parser.add_argument("--kernel", nargs="+", default=["all"], choices=[*KERNELS, "all"], metavar="KERNEL",
                        help=f"which kernel(s) to benchmark: {', '.join(KERNELS)} or all")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE, choices=list(DTYPES), help="dtype of the inputs")
    parser.add_argument("--tokens", type=positive(int), nargs="+", default=None,
                        help="token counts N (rows) for every selected kernel; None = each kernel's GPU or CPU tokens "
                             "(listed below)")
    for name, defaults in all_dims().items():
        per_kernel = ", ".join(f"{kernel} {gpu} (CPU {cpu})" for kernel, (gpu, cpu) in defaults.items())
        parser.add_argument(f"--{name.replace('_', '-')}", type=positive(int), default=None,
                            help=f"{name} for every kernel that has it; None = {per_kernel}")
    parser.add_argument("--chunk-sizes", type=positive(int), nargs="+", default=None,
                        help="linear_cross_entropy: also time ours with these explicit chunk_size values "
                             "(providers ours_chunk<C>)")
    parser.add_argument("--providers", nargs="+", default=None,
                        help="only these providers (names as in the list below); the rule provider still runs for "
                             "the correctness rule")
    parser.add_argument("--out", default=None,
                        help="JSON path; '{kernel}' in it writes one file per kernel (e.g. "
                             "results/bench_{kernel}_h200.json). None = runs/bench_<kernel or all>_<device>[_<dtype>]"
                             "[_n<tokens>]...json (git-ignored; the name lists every option that differs from the "
                             "defaults)")
    parser.add_argument("--plot", action="store_true",
                        help="also write one PNG per kernel, named after the JSON path: <JSON path without "
                             ".json>_<kernel>.png")
    parser.add_argument("--copy-gib", type=positive(float), default=2.0, help="GPU copy-bandwidth buffer size (GiB)")
    parser.add_argument("--rep-ms", type=positive(float), default=100,
                        help="do_bench rep (ms of timed calls, per phase)")
    parser.add_argument("--warmup-ms", type=positive(float), default=25, help="do_bench warmup (ms)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (the size is added: fresh data per size)")
    args = parser.parse_args(argv)
    args.kernel = list(KERNELS) if "all" in args.kernel else list(dict.fromkeys(args.kernel))
    if args.chunk_sizes and "linear_cross_entropy" not in args.kernel:
        parser.error("--chunk-sizes times linear_cross_entropy with those chunk sizes: add it to --kernel")
    if args.providers:
        # Each kernel runs the named providers that are its own: a name no chosen kernel has, or a kernel left with
        # none of the names, would time nothing and still report PASSED.
        valid = {kernel: [p.name for p in KERNELS[kernel].providers_for(args)] for kernel in args.kernel}
        unknown = [name for name in args.providers if not any(name in names for names in valid.values())]
        idle = [kernel for kernel, names in valid.items() if not set(args.providers) & set(names)]
        if unknown or idle:
            problem = (f"{' '.join(unknown)}: not a provider of --kernel {' '.join(args.kernel)}" if unknown else
                       f"{' '.join(args.providers)}: none is a provider of {' '.join(idle)}, which would time nothing")
            listing = "; ".join(f"{kernel}: {', '.join(names)}" for kernel, names in valid.items())
            parser.error(f"--providers {problem}. The providers at --dtype {args.dtype}: {listing}")
    for path in dict.fromkeys(out_paths(args).values()):  # checked now: the first file is written after a kernel
        if path.is_dir():
            parser.error(f"--out {path} is a directory: give the path of the JSON file to write")
    return args


def main(argv=None):
    args = parse_args(argv)
    kernels = args.kernel
    paths = out_paths(args)
    if ON_GPU:
        # torch.compile's AOTAutograd "donates" saved buffers to the backward, which then refuses retain_graph=True
        # (needed to time the backward alone). Off for the compiled providers; it changes memory reuse, not kernels.
        from torch._functorch import config as functorch_config

        if hasattr(functorch_config, "donated_buffer"):
            functorch_config.donated_buffer = False
    else:
        print("No CUDA device: Triton kernels run on the CPU interpreter at toy sizes; the times below are "
              "interpreter times and NOT meaningful (the correctness checks are).")

    started = time.perf_counter()
    commit, dirty = git_state()
    copy_gbps, copy_bytes = measure_copy_bandwidth(args.copy_gib)
    command = shlex.join([Path(sys.executable).name, Path(__file__).name,
                          *(sys.argv[1:] if argv is None else argv)])
    header = {"gpu": device_name(), "host_cpu": host_cpu(), "copy_gbps": copy_gbps, "copy_bytes_each_way": copy_bytes,
              "versions": versions(), "git_commit": commit, "git_dirty": dirty, "command": command, "date":
              datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "dtype": args.dtype,
              "timing": "triton.testing.do_bench median/p20/p80, L2 flushed, grads reset" if ON_GPU else
              f"time.perf_counter over {CPU_TIMED_CALLS} calls on the CPU, our kernels on the Triton interpreter: "
              "NOT meaningful",
              "error_rule": f"error <= {ERROR_FACTOR} * baseline error + floor "
                            + str({str(k).replace("torch.", ""): v for k, v in ERROR_FLOOR.items()}),
              "notes": ["torch._functorch.config.donated_buffer=False (so compiled backwards accept retain_graph)"]
              if ON_GPU else []}
    print(f"device: {header['gpu']} | copy bandwidth {copy_gbps:.0f} GB/s (device-to-device copy of "
          f"{copy_bytes / 2**30:.2f} GiB, read + written) | torch {torch.__version__}, triton {triton.__version__}, "
          f"transformers {header['versions']['transformers']}, liger {header['versions']['liger']}, "
          f"cce {header['versions']['cce']} | commit {commit}{' (dirty)' if dirty else ''} | {args.dtype}")

    rows, failures = {}, {}
    for kernel in kernels:
        rows[kernel], failures[kernel] = benchmark_kernel(kernel, args, copy_gbps)
        # Written after every kernel, so a run cut short (time limit, crash) still leaves its finished kernels.
        for path in dict.fromkeys(paths.values()):
            mine = [k for k in kernels if paths[k] == path]
            done = [k for k in mine if k in rows]
            file_failures = [f for k in done for f in failures[k]]
            dims = {name: value for k in mine for name, value in kernel_dims(KERNELS[k], args).items()}
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**header, "kernels": mine, "dims": dims, "complete": done == mine,
                                        "elapsed_s": round(time.perf_counter() - started, 1),
                                        "passed": not file_failures, "failures": file_failures,
                                        "rows": [r for k in done for r in rows[k]]}, indent=1))
    all_rows = [r for kernel in kernels for r in rows[kernel]]
    all_failures = [f for kernel in kernels for f in failures[kernel]]
    for kernel in kernels:
        print_table(kernel, all_rows)
    print()
    for path in dict.fromkeys(paths.values()):
        print(f"wrote {shown(path)}")
    if args.plot:
        for kernel in kernels:
            written = plot(kernel, all_rows, png_path(paths[kernel], kernel), header)
            if written:
                print(f"wrote {shown(written)}")

    print("\nSUMMARY: " + ("all correctness checks of our kernels PASSED" if not all_failures else
                           f"{len(all_failures)} FAILED:\n  " + "\n  ".join(all_failures)))
    return 0 if not all_failures else 1


if __name__ == "__main__":
    sys.exit(main())
