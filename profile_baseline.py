"""Profile one LLaMA training step and say where the time goes.

The playbook's step 3 (and its re-profiles, steps 7 and 10): run one full training step -- forward, loss, backward,
AdamW step, zero_grad -- under torch.profiler and print

  1. the top-N operators and kernels by self device time (self CPU time without a GPU), from the profiler's own
     key_averages() table, with the driver's "Command Buffer Full" events removed from the event list first;
  2. a category summary (matmul, attention, RMSNorm, SwiGLU, loss, optimizer, memory copies, other elementwise) in ms
     and % of the step's device time, so that e.g. AdamW's share at 1x512 is visible at a glance (without a GPU: of
     the ops' CPU self time; the Python between the ops is printed on its own line, outside the categories);
  3. the profiled step's peak memory and how many modules the kernel flags replaced.

It writes exactly one Chrome trace per run to traces/ (open it at https://ui.perfetto.dev) and a small JSON summary
beside it (and to --summary-out). With --tensorboard the trace goes to traces/tensorboard/<run>/ instead, for
TensorBoard's PyTorch Profiler tab (the torch-tb-profiler package): `tensorboard --logdir traces/tensorboard`, then open
http://localhost:6006 and pick PYTORCH_PROFILER. `--compare A.json B.json` prints a before/after table of two summaries.

    python profile_baseline.py                                     # baseline
    python profile_baseline.py --use-custom-rmsnorm --use-linear-ce --use-swiglu --use-rope
    python profile_baseline.py --lora 16 [--use-...]                # the step of a LoRA fine-tune (peft)
    python profile_baseline.py --compare results/a.json results/b.json

Without a GPU the default model is a tiny LLaMA of the same structure, and the Triton kernels run on the CPU
interpreter: the run takes seconds and its times say nothing about a GPU.
"""
import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

# The kernel modules come BEFORE transformers: without a GPU they switch Triton to its CPU interpreter, which only
# works if that happens before anything (transformers' LLaMA code does) imports Triton.
from cross_entropy_kernel import cross_entropy
from linear_cross_entropy_kernel import linear_cross_entropy
from lora_adapters import add_adapters
from rmsnorm_kernel import apply_rmsnorm
from rope_kernel import apply_rope
from swiglu_kernel import apply_glu_mlp

# transformers imports torchao where it is installed (for finetune_optimized.py --fp8); torchao's notice that its CUDA
# extensions do not load and torch's about torchao's enums concern no run here: those two loggers show errors only.
for noisy_logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(noisy_logger).setLevel(logging.ERROR)

import transformers
from transformers import AutoConfig, AutoModelForCausalLM

HERE = Path(__file__).resolve().parent
HAS_CUDA = torch.cuda.is_available()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CATEGORIES = ["matmul", "attention", "RMSNorm", "SwiGLU", "loss", "optimizer", "memory copies", "other elementwise"]
# The attention implementations transformers trains LLaMA with (its "paged|..." variants serve generation).
ATTN_IMPLEMENTATIONS = ["sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # expanduser here, once, as the fine-tune scripts do (the shell expands a ~ only at the start of a word)
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B" if HAS_CUDA else "tiny", type=os.path.expanduser,
                        help='Hub id or local folder (save_pretrained, or just a config.json); a name in configs/ '
                             '(tiny, tiny-<family>, qwen3-8b, gemma-2-9b, ...) builds that architecture with random '
                             'weights')
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto = bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS, default="sdpa",
                        help="transformers' attention: sdpa = torch's scaled_dot_product_attention; eager = matmul, "
                             "softmax, matmul; flash_attention_2/3 need the flash-attn package; flex_attention a GPU")
    parser.add_argument("--allow-download", action="store_true",
                        help="let from_pretrained reach the Hub (default: the local cache only)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=512 if HAS_CUDA else 32,
                        help="tokens per sequence, at least 2 (32 without a GPU: the Triton interpreter is slow)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights and the synthetic tokens")
    parser.add_argument("--optimizer", choices=["adamw_foreach", "adamw_fused"], default="adamw_fused",
                        help="torch AdamW: one fused kernel (the default, as in every comparison in the README) or "
                             "multi-tensor (foreach)")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    parser.add_argument("--use-custom-rmsnorm", action="store_true", help="replace every LlamaRMSNorm (rmsnorm_kernel)")
    loss = parser.add_mutually_exclusive_group()
    loss.add_argument("--use-custom-ce", action="store_true",
                      help="fused cross-entropy on the lm_head logits (cross_entropy_kernel, in-place backward)")
    loss.add_argument("--use-linear-ce", action="store_true",
                      help="fused linear cross-entropy from the hidden states: no [B*T, V] logits at all")
    parser.add_argument("--use-swiglu", action="store_true", help="replace every LlamaMLP (swiglu_kernel)")
    parser.add_argument("--use-rope", action="store_true",
                        help="patch LLaMA's apply_rotary_pos_emb with the fused RoPE kernel (rope_kernel)")
    parser.add_argument("--lora", type=int, default=None, metavar="R",
                        help="peft's LoRA adapters of rank R (alpha 2R) on every Linear of the decoder layers, the "
                             "rest frozen, as the fine-tune scripts' --lora R: the step of a LoRA fine-tune")
    parser.add_argument("--row-limit", type=int, default=20, help="rows of the top-N table")
    parser.add_argument("--tensorboard", action="store_true",
                        help="write the trace with tensorboard_trace_handler into traces/tensorboard/<run>/ instead, "
                             "for TensorBoard's PyTorch Profiler tab: tensorboard --logdir traces/tensorboard")
    parser.add_argument("--trace-dir", default=str(HERE / "traces"), help="where the trace and its summary go")
    parser.add_argument("--summary-out", default=None, help="also write the JSON summary here (e.g. results/...json)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                        help="print a before/after table of two JSON summaries and exit")
    args = parser.parse_args(argv)
    for name in ("batch_size", "seq_len", "row_limit", "lora"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.seq_len < 2:  # position t learns to predict token t+1: a single token leaves nothing to predict
        parser.error("--seq-len must be at least 2: the loss predicts each next token, so 1 token has none")
    if not 0 < args.lr < math.inf:  # also false for nan
        parser.error(f"--lr must be a positive finite number, got {args.lr}")
    if args.attn_implementation == "flex_attention" and not HAS_CUDA:
        parser.error("--attn-implementation flex_attention needs a GPU: FlexAttention has no backward on the CPU")
    # Checked now: the trace and the summaries are written only after the profiled step.
    if Path(args.trace_dir).exists() and not Path(args.trace_dir).is_dir():
        parser.error(f"--trace-dir {args.trace_dir} is a file: give a folder (it is created if it does not exist)")
    if args.summary_out and Path(args.summary_out).is_dir():
        parser.error(f"--summary-out {args.summary_out} is a directory: give the path of the JSON file to write")
    return args


# ----------------------------------------------------------------------------------------------------------------------
# What ran, where, with which versions (every header and JSON)

def run_info():
    """What ran, where, with which versions. GIT_COMMIT and GIT_DIRTY, where set, name the commit of a copied tree (a
    copy on a GPU box may carry no .git); the host's CPU sets the pace of host-bound steps."""
    import triton
    commit, dirty = os.environ.get("GIT_COMMIT"), os.environ.get("GIT_DIRTY", "0") != "0"
    if commit is None:  # the checkout's HEAD, dirty where git status lists anything; "uncommitted": no git, no checkout
        git = subprocess.run("git rev-parse --short HEAD && git status --porcelain", shell=True, cwd=HERE, text=True,
                             capture_output=True)
        commit, *status = git.stdout.splitlines() or ["uncommitted"]
        dirty = bool(status)
    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text() if sys.platform == "linux" else "")
    return {"device": torch.cuda.get_device_name() if HAS_CUDA else "cpu (Triton interpreter; toy sizes)",
            "host": platform.node(), "host_cpu": f"{cpu[1] if cpu else platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "git_commit": commit, "git_dirty": dirty,
            "command": [sys.executable, *sys.argv], "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


# ----------------------------------------------------------------------------------------------------------------------
# Model: real weights where from_pretrained can load them, otherwise the same architecture with random weights

# configs/<name>/config.json: the published architecture of each supported family's common size (llama-3.1-8b,
# mistral-7b-v0.3, qwen2.5-7b, qwen3-8b, gemma-2-9b, gemma-3-12b's text decoder, phi-3-mini-4k-instruct) and a tiny
# one of the same structure per family for CPU runs ("tiny" is LLaMA's, "tiny-<family>" the others').
CONFIGS = HERE / "configs"
# The attention implementations that apply Gemma 2's attention logit softcapping (sdpa has no such argument).
SOFTCAP_ATTENTION = ["eager", "flex_attention", "flash_attention_2"]


def first_line(err):
    """An error's message in one line: its first, or the error's type where it has no message."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def builtin_config(name):
    """The config in configs/ named like the model (its Hub id's last part, in any case), or None."""
    folder = CONFIGS / Path(name).name.lower()
    return AutoConfig.from_pretrained(folder) if (folder / "config.json").is_file() else None


def load_model(args, device, dtype):
    """(model, "real" | "random"). from_pretrained loads the weights straight onto `device` (device_map). A bare name
    of configs/, or weights it cannot load (not in the local cache, a gated repo), give the architecture with random
    weights, from the folder's own config.json or from configs/, said so. The Hub is asked only with --allow-download:
    without a network, huggingface_hub retries each file for ~20 s before it gives up."""
    name, attention, weights = args.model, args.attn_implementation, "random"
    config = builtin_config(name) if "/" not in name and not Path(name).exists() else None
    try:
        if config is None:
            try:
                model, weights = AutoModelForCausalLM.from_pretrained(
                    name, dtype=dtype, device_map=device, attn_implementation=attention,
                    local_files_only=not args.allow_download), "real"
            except (OSError, ValueError) as err:  # missing files, gated repo, no network: all surface as one of these
                local_config = (Path(name) / "config.json").is_file()
                # A path that does not exist is a typo, not a request for configs/' architecture of the same name.
                path_like = name.startswith(("/", ".", "~"))
                config = (AutoConfig.from_pretrained(name) if local_config else None if path_like
                          else builtin_config(name))
                if config is None:
                    raise SystemExit(f"error: --model {name}: no such directory, no weights to load "
                                     f"({first_line(err)}) and no config of that name in configs/")
                print(f"weights for {name} not available ({first_line(err)}): the same architecture with RANDOM "
                      f"weights")
        if weights == "random":  # built on the device in the dtype: 8B parameters never pass through the host in fp32
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    except ImportError as err:  # the attention implementation's package (flash-attn) is not installed
        raise SystemExit(f"error: --attn-implementation {attention}: {first_line(err)}")
    # A model whose attention logits are softcapped (Gemma 2) would train another function on an attention without it.
    softcap = getattr(model.config, "attn_logit_softcapping", None)
    if softcap and attention not in SOFTCAP_ATTENTION:
        raise SystemExit(f"error: --attn-implementation {attention} cannot apply {model.config.model_type}'s "
                         f"attention logit softcapping ({softcap}); use {' or '.join(SOFTCAP_ATTENTION)}")
    return model, weights


# ----------------------------------------------------------------------------------------------------------------------
# Category heuristic
#
# Every unit of device time (a CUDA kernel, memcpy or memset) is linked by the profiler to the CPU op that launched it;
# on CPU we use each op's self time instead. We classify it from
#   kernel: the kernel's name (GPU only),
#   chain:  the launching op and its enclosing ops/ranges, innermost first (e.g. aten::mm < aten::linear < ...),
#   labels: chain, plus -- for ops run by autograd's backward -- the chain of the FORWARD op that created the
#           backward node (matched by the profiler's sequence number), so that e.g. PowBackward0 inherits the
#           "module::LlamaRMSNorm" range its forward pow ran in.
# Ranges come from torch itself ("Optimizer.step#AdamW.step", "autograd::engine::evaluate_function: XBackward0") and
# from this script: a record_function "loss" around the loss, and "module::<Class>" around every *RMSNorm and *MLP
# module's forward (forward hooks). The first matching rule wins:
#   optimizer  - inside an Optimizer.* range (AdamW's foreach/fused kernels, zero_grad);
#   attention  - flash/fmha/attention kernels or scaled_dot_product ops;
#   matmul     - cuBLAS/CUTLASS kernel names (gemm, nvjet, xmma, ...) or mm/addmm/bmm/linear ops, wherever they run
#                (so lm_head counts as matmul in every variant, also inside the fused linear cross-entropy);
#   RMSNorm    - anything labelled rmsnorm/rms_norm (the eager pow/mean/rsqrt/mul ops or the Triton kernels);
#   loss       - the "loss" range or cross-entropy/log_softmax/nll ops and kernels;
#   SwiGLU     - the non-matmul work of the MLP modules (silu, mul and their backward) or swiglu/silu kernels;
#   memory copies - memcpy/memset, and copy_/_to_copy/clone/cat ops not claimed above;
#   other elementwise - everything else (RoPE, eager or the fused kernel of --use-rope, residual adds, embedding,
#                grad accumulation, ...).

ATTENTION_WORDS = ("flash", "fmha", "attention", "scaled_dot_product")
MATMUL_KERNEL_WORDS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv", "splitk", "wgmma")
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::mv",
              "aten::addmv", "aten::_scaled_mm"}
LOSS_WORDS = ("cross_entropy", "crossentropy", "nll_loss", "log_softmax")
COPY_OPS = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat"}
BACKWARD_PREFIX = "autograd::engine::evaluate_function:"


def classify(kernel, chain, labels):
    kernel = (kernel or "").lower()
    chain_low = [name.lower() for name in chain]
    labels_low = [name.lower() for name in labels]
    if any(name.startswith("Optimizer.") for name in chain):
        return "optimizer"
    if any(w in kernel for w in ATTENTION_WORDS) or any(w in n for n in chain_low for w in ATTENTION_WORDS):
        return "attention"
    if any(w in kernel for w in MATMUL_KERNEL_WORDS) or any(name in MATMUL_OPS for name in chain):
        return "matmul"
    if any("rmsnorm" in n or "rms_norm" in n for n in labels_low + [kernel]):
        return "RMSNorm"
    if "loss" in labels or any(w in n for n in labels_low + [kernel] for w in LOSS_WORDS):
        return "loss"
    if any(n.startswith("module::") and n.endswith("mlp") or "swiglu" in n or "silu" in n
           for n in labels_low + [kernel]):
        return "SwiGLU"
    if kernel.startswith(("memcpy", "memset")) or (chain and chain[0] in COPY_OPS):
        return "memory copies"
    return "other elementwise"


def _ancestors(event):
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def category_summary(events):
    """({category: microseconds} over the profiled step, their total, microseconds left out): device time on GPU, CPU
    self time on CPU. Left out on CPU: the self time of the profiler's ProfilerStep range, which encloses the whole
    step, so its self time is what ran between the ops (Python, hooks, autograd's bookkeeping), not any op's work.
    On GPU: None, as every kernel counts in the category of the op that launched it."""
    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]

    # Forward ops by autograd sequence number. A backward node carries the sequence number of the forward op that
    # created it; ops that create no node reuse the next number, so the LATEST forward op with a number is its creator.
    forward_by_seq = {}
    for e in sorted(cpu_ops, key=lambda e: e.time_range.start):
        if e.sequence_nr >= 0 and not any(n.startswith(BACKWARD_PREFIX) for n in _ancestors(e)):
            forward_by_seq[e.sequence_nr] = e

    def chain_and_labels(op):
        chain = _ancestors(op) if op is not None else []
        labels = list(chain)
        node = next((e for e in _iter_up(op) if e.name.startswith(BACKWARD_PREFIX)), None)
        if node is not None and node.sequence_nr in forward_by_seq:
            labels += _ancestors(forward_by_seq[node.sequence_nr])
        return chain, labels

    totals, outside_ops_us = dict.fromkeys(CATEGORIES, 0.0), None
    if HAS_CUDA:
        # Every op that launched device work lists those kernels (name, duration) in `kernels`: that is how torch's
        # own table attributes device time to ops. Device-side copies of record_function ranges carry the range's own
        # name and span many kernels: skipped, as torch's own table does.
        for op in cpu_ops:
            kernels = [k for k in op.kernels if k.name != op.name]
            if kernels:
                chain, labels = chain_and_labels(op)
                for kernel in kernels:
                    totals[classify(kernel.name, chain, labels)] += kernel.duration
    else:
        outside_ops_us = 0.0
        for e in cpu_ops:
            if e.name.startswith("ProfilerStep"):  # "ProfilerStep*" in the event list, "ProfilerStep#1" in the trace
                outside_ops_us += e.self_cpu_time_total
                continue
            chain, labels = chain_and_labels(e)
            totals[classify(None, chain, labels)] += e.self_cpu_time_total
    return totals, sum(totals.values()), outside_ops_us


def device_idle_ms(events):
    """Milliseconds the GPU sat idle between the profiled step's first kernel and its last: the span minus the union of
    all device activity (kernels, copies, memsets). Idle time is the GPU waiting for the host to launch work; a
    host-bound step shows it here, while the categories count only time spent in kernels."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    if not intervals:
        return None
    idle_us, busy_until = 0.0, intervals[0][1]
    for start, end in intervals[1:]:
        idle_us += max(0.0, start - busy_until)
        busy_until = max(busy_until, end)
    return idle_us / 1e3


def _iter_up(event):
    while event is not None:
        yield event
        event = event.cpu_parent


# ----------------------------------------------------------------------------------------------------------------------
# --compare: before/after table of two summaries

SUMMARY_KEYS = ("categories", "step_ms", "time_unit", "variant", "shape", "weights")


def read_summary(path):
    """The JSON summary at `path`, or one error line that names the file and says what it is instead."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"error: --compare {path}: no such file")
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SystemExit(f"error: --compare {path}: not a JSON file ({err})")
    categories = summary.get("categories") if isinstance(summary, dict) else None
    if not (all(key in summary for key in SUMMARY_KEYS) and isinstance(categories, dict)
            and all(isinstance(categories.get(cat), dict) and {"ms", "pct"} <= categories[cat].keys()
                    for cat in CATEGORIES)):
        what = ("a trace; its summary is the .summary.json beside it" if isinstance(summary, dict)
                and "traceEvents" in summary else "JSON, but not a summary written by profile_baseline.py")
        raise SystemExit(f"error: --compare {path}: {what}")
    return summary


def compare(path_before, path_after):
    before, after = read_summary(path_before), read_summary(path_after)
    if before["time_unit"] != after["time_unit"]:  # a CPU run's op times and a GPU run's kernel times
        raise SystemExit(f"error: --compare: {path_before} is in {before['time_unit']}, {path_after} in "
                         f"{after['time_unit']}; compare two runs on the same kind of device")
    rows = []
    for cat in CATEGORIES:
        b, a = before["categories"][cat], after["categories"][cat]
        rows.append([cat, f"{b['ms']:.2f}", f"{b['pct']:.1f}", f"{a['ms']:.2f}", f"{a['pct']:.1f}",
                     f"{a['ms'] - b['ms']:+.2f}"])
    b, a = before["step_ms"], after["step_ms"]
    rows.append(["step total", f"{b:.2f}", "100.0", f"{a:.2f}", "100.0", f"{a - b:+.2f}"])
    ib, ia = before.get("device_idle_ms"), after.get("device_idle_ms")
    if ib is not None and ia is not None:
        rows.append(["GPU idle (host-bound)", f"{ib:.2f}", "", f"{ia:.2f}", "", f"{ia - ib:+.2f}"])
    pb, pa = before.get("peak_memory_gib"), after.get("peak_memory_gib")
    if pb is not None and pa is not None:
        rows.append(["peak memory (GiB)", f"{pb:.2f}", "", f"{pa:.2f}", "", f"{pa - pb:+.2f}"])
    unit = before["time_unit"]
    print(f"before: {path_before}  [{before['variant']}, {before['shape']}, {before['weights']} weights]")
    print(f"after:  {path_after}  [{after['variant']}, {after['shape']}, {after['weights']} weights]")
    print(tabulate(rows, headers=["category", f"before {unit}", "%", f"after {unit}", "%", "change"],
                   tablefmt="github", disable_numparse=True))
    if b > 0 and a > 0:
        print(f"step {unit}: {b:.2f} -> {a:.2f} ({b / a:.2f}x)")


# ----------------------------------------------------------------------------------------------------------------------
# Profiler noise: lines torch's C++ profiler prints on every run that tell the reader nothing -- kineto's markers around
# the recorded step, and the allocator's note that memory allocated before profiling began (the model, here) has no
# recorded allocation event.

PROFILER_NOISE = ("] profiler_start", "] profiler_stop",
                  "Memory block of unknown size was allocated before the profiling started")


@contextlib.contextmanager
def without_profiler_noise():
    """Drop PROFILER_NOISE lines from stderr. C++ code writes to file descriptor 2 directly, past sys.stderr, so the
    descriptor itself goes to a temporary file for the block; every other line is passed on when the block ends."""
    sys.stderr.flush()
    saved_stderr = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved_stderr, 2)
            os.close(saved_stderr)
            captured.seek(0)
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                if not any(noise in line for noise in PROFILER_NOISE):
                    sys.stderr.write(line)
            sys.stderr.flush()


# ----------------------------------------------------------------------------------------------------------------------

def main(argv=None):
    args = parse_args(argv)
    if args.compare:
        compare(*args.compare)
        return

    device = "cuda" if HAS_CUDA else "cpu"
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if HAS_CUDA else torch.float32)
    info = run_info()
    torch.manual_seed(args.seed)
    model, weights = load_model(args, device, dtype)
    model.config.use_cache = False  # training: no KV cache
    model.train()
    config = model.config
    n_layers, vocab = config.num_hidden_layers, config.vocab_size
    if args.lora:  # before the kernels, as in the fine-tune scripts: they run on the peft-wrapped model
        add_adapters(model, args.lora)

    # --- kernel replacements: each kernel module's entry point checks the count for the model's family (65 RMSNorms
    # for 8B: two per decoder layer plus the final norm; one MLP and one attention per layer), so a flag that replaces
    # nothing is an error
    replaced = {}
    try:
        if args.use_custom_rmsnorm:
            replaced["rmsnorm"] = apply_rmsnorm(model)
        if args.use_swiglu:
            replaced["swiglu_mlp"] = apply_glu_mlp(model)
        if args.use_rope:
            replaced["rope_attention"] = apply_rope(model)  # process-wide: the family's attention looks it up per call
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    variant = "+".join(name for flag, name in [(args.use_custom_rmsnorm, "rmsnorm"), (args.use_custom_ce, "ce"),
                                               (args.use_linear_ce, "linear_ce"), (args.use_swiglu, "swiglu"),
                                               (args.use_rope, "rope")]
                       if flag) or "baseline"
    variant += f"+lora{args.lora}" if args.lora else ""

    # --- named ranges for the category summary: one per RMSNorm / MLP module call ----------------------------------
    def enter_range(module, inputs):
        module._profile_range = record_function(f"module::{type(module).__name__}")
        module._profile_range.__enter__()

    def exit_range(module, inputs, output):
        module._profile_range.__exit__(None, None, None)

    for module in model.modules():
        if type(module).__name__.endswith(("RMSNorm", "MLP")):
            module.register_forward_pre_hook(enter_range)
            module.register_forward_hook(exit_range)

    # the trained parameters: all of them, or the adapters under --lora
    optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=args.lr,
                                  foreach=args.optimizer == "adamw_foreach",
                                  fused=args.optimizer == "adamw_fused")

    # Synthetic tokens like the playbook; labels = input_ids, shifted the way transformers does it (no logits slice).
    generator = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=generator).to(device)
    shift_labels = F.pad(input_ids, (0, 1), value=-100)[..., 1:].contiguous()

    def train_step():
        if args.use_linear_ce:
            hidden = model.model(input_ids=input_ids).last_hidden_state
            with record_function("loss"):
                # with Gemma 2's final logit softcap, which the model's own forward applies to the logits
                loss = linear_cross_entropy(hidden, model.lm_head.weight, shift_labels,
                                            softcap=getattr(config, "final_logit_softcapping", None))
        else:
            logits = model(input_ids=input_ids).logits
            with record_function("loss"):
                if args.use_custom_ce:
                    # lm_head's backward needs its input, not its output, so the gradient may overwrite the logits.
                    loss = cross_entropy(logits, shift_labels, inplace_backward=True)
                else:  # what transformers' ForCausalLMLoss does: upcast to fp32, mean over non-ignored tokens
                    loss = F.cross_entropy(logits.float().view(-1, vocab), shift_labels.view(-1), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    # --- header ------------------------------------------------------------------------------------------------------
    shape = f"{args.batch_size}x{args.seq_len}"
    print(f"device: {info['device']} | torch {info['torch']} | triton {info['triton']} | "
          f"transformers {info['transformers']} | commit {info['git_commit']}{'+dirty' if info['git_dirty'] else ''}")
    print(f"model: {args.model} ({weights} weights), {n_layers} layers, hidden {config.hidden_size}, vocab {vocab}, "
          f"{str(dtype).replace('torch.', '')}, attn {args.attn_implementation}")
    print(f"step: batch x seq = {shape}, optimizer {args.optimizer}, variant {variant}"
          + (f", replaced {replaced}" if replaced else ""))

    # --- one warm-up step + one profiled step -------------------------------------------------------------------------
    # The schedule's warm-up step runs the training step once with the profiler on but discarding (Triton compiles,
    # cuBLAS picks its algorithms, AdamW allocates its state); only the second step is recorded. on_trace_ready fires
    # exactly once, after it, and is the only place a trace is written: no "Trace is already saved".
    trace_dir = Path(args.trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    model_tag = Path(args.model).name
    stem = (f"profile_{model_tag}_{weights}_{shape}_{variant}_{args.optimizer}_"
            f"{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}")
    if args.tensorboard:  # one TensorBoard run (a folder under --logdir) per profiled step
        write_trace = tensorboard_trace_handler(str(trace_dir / "tensorboard" / stem))
    else:
        def write_trace(prof):
            prof.export_chrome_trace(str(trace_dir / f"{stem}.json"))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if HAS_CUDA else [])
    with without_profiler_noise(), profile(activities=activities, record_shapes=True, profile_memory=True,
                                           schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                                           on_trace_ready=write_trace) as prof:
        for step in range(2):
            if step == 1 and HAS_CUDA:  # peak memory of the profiled step only
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            loss = train_step()
            if HAS_CUDA:
                torch.cuda.synchronize()
            prof.step()
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if HAS_CUDA else None

    if args.tensorboard:
        trace_files = sorted((trace_dir / "tensorboard" / stem).glob("*.pt.trace.json"))
        trace_path = trace_files[-1] if trace_files else None
    else:
        trace_path = trace_dir / f"{stem}.json"

    # --- top-N table ------------------------------------------------------------------------------------------------
    # Drop the driver's "Command Buffer Full" events BEFORE aggregating, and the device-side copies of record_function
    # ranges (they span many kernels; the CPU-side range stays, with its kernels' time). The kept events still carry
    # the parent/child links the profiler built, which is all key_averages() needs, so we mark the tree as built.
    events = EventList([e for e in prof.events() if e.name != "Command Buffer Full"
                        and not (e.device_type != DeviceType.CPU and e.is_user_annotation)],
                       use_device="cuda" if HAS_CUDA else None, profile_memory=True)
    events._tree_built = True
    sort_key = "self_device_time_total" if HAS_CUDA else "self_cpu_time_total"
    averages = events.key_averages()
    print(averages.table(sort_by=sort_key, row_limit=args.row_limit, max_name_column_width=60))
    top_ops = sorted(averages, key=lambda a: getattr(a, sort_key), reverse=True)[:args.row_limit]

    # --- category summary ---------------------------------------------------------------------------------------
    totals_us, step_us, outside_ops_us = category_summary(events)
    time_unit = "device ms" if HAS_CUDA else "CPU self ms"
    categories = {cat: {"ms": us / 1e3, "pct": 100.0 * us / step_us if step_us else 0.0}
                  for cat, us in totals_us.items()}
    print(tabulate([[cat, f"{v['ms']:.3f}", f"{v['pct']:.1f}"] for cat, v in categories.items()]
                   + [["step total", f"{step_us / 1e3:.3f}", "100.0"]],
                   headers=["category", time_unit, "% of step"], tablefmt="github", disable_numparse=True))
    if outside_ops_us is not None:
        print(f"not in the table: {outside_ops_us / 1e3:.3f} CPU ms of the step outside every op (the self time of "
              f"the profiler's ProfilerStep range: Python, hooks, autograd's bookkeeping between the ops)")
    idle_ms = device_idle_ms(events) if HAS_CUDA else None
    if idle_ms is not None:
        print(f"GPU idle between the step's first and last kernel: {idle_ms:.3f} ms (waiting for the host)")
    print(f"loss {loss.item():.4f} | peak memory of the profiled step: "
          + (f"{peak_gib:.2f} GiB" if peak_gib is not None else "n/a (CPU)")
          + f" | trace: {trace_path}")

    summary = {
        **info,
        "script": "profile_baseline.py",
        "model": args.model,
        "weights": weights,
        "dtype": str(dtype).replace("torch.", ""),
        "shape": shape,
        "variant": variant,
        "options": vars(args),
        "replaced": replaced,
        "loss": loss.item(),
        "time_unit": time_unit,
        "step_ms": step_us / 1e3,
        "categories": categories,
        "device_idle_ms": idle_ms,
        "outside_ops_ms": None if outside_ops_us is None else outside_ops_us / 1e3,
        "peak_memory_gib": peak_gib,
        "top_ops": [{"name": a.key, "calls": a.count, "self_device_ms": a.self_device_time_total / 1e3,
                     "self_cpu_ms": a.self_cpu_time_total / 1e3} for a in top_ops],
        "trace": str(trace_path),
    }
    summary_paths = [trace_dir / f"{stem}.summary.json"] + ([Path(args.summary_out)] if args.summary_out else [])
    for path in summary_paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
    print("summary: " + ", ".join(str(p) for p in summary_paths))


if __name__ == "__main__":
    main()
