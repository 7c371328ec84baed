"""Full fine-tuning of LLaMA-3.1-8B with the fused Triton kernels and a memory plan: the OPTIMIZED run.

The playbook's step 11, second half: finetune_baseline.py (the stock reference) plus what is ours, each visible in
`diff finetune_baseline.py finetune_optimized.py`:
  1. the fused kernels, each of which --no-<kernel> turns off: every RMSNorm becomes a TritonRMSNorm sharing the
     same weight (rmsnorm_kernel.py), every MLP's silu(gate) * up (Gemma's GELU) one fused kernel (swiglu_kernel.py),
     the rotary embedding of q and k one fused kernel (rope_kernel.py), and the loss the fused linear cross-entropy,
     fed the decoder's hidden states and lm_head's weight so the [B*T, V] logits never exist (--loss linear_ce;
     --loss ce is the playbook's fused cross-entropy on the logits, --loss eager transformers' own;
     cross_entropy_kernel.py);
  2. the memory plan (--memory-plan auto, the default): before the first step it measures what a token costs in one
     short probe forward, estimates the peak of every combination of the memory levers below, and takes the fastest
     that fits this GPU; if a step still runs out of memory it takes the next plan. --memory-plan manual uses the
     flags alone;
  3. the memory levers: selective or full activation checkpointing of the first N layers, their inputs offloaded to
     pinned host memory, MLP sequence tiles, the optimizer step inside the backward, and AdamW's state offloaded to
     the host;
  4. --cuda-graph: the whole step replayed as one CUDA graph, for steps the host cannot launch fast enough (1x512);
  5. checkpoints written in the background: training waits only for a copy into pinned host buffers that every
     checkpoint reuses (the baseline writes them the stock way, waiting for the disk);
  6. --fp8 RECIPE: every Linear of the decoder layers trains in float8 (torchao's recipes, a GPU of compute
     capability 8.9+), each layer compiled so the casts fuse; the lm_head stays in the fused loss (float8_training.py).
Everything else -- model, data, LoRA (peft), loop, resume, evaluation, JSON -- is the baseline's, line for line.
README.md tells which models and data it takes (without cached weights: the same architecture with RANDOM weights,
said so). Under --lora the kernels run on the peft-wrapped model and spend nothing on a frozen weight's gradient.

    python finetune_optimized.py                                # 20 steps at 1x512 (without a GPU: tiny LLaMA, 1x32)
    python finetune_optimized.py --seq-len 8192                 # the plan picks what fits the GPU
    python finetune_optimized.py --data corpus.txt --output-dir runs/ft --save-steps 200 --eval-split 0.05 [--resume]
    python finetune_optimized.py --seq-len-search 65536,131072,262144   # longest batch-1 sequence, a plan per length
    python finetune_optimized.py --lora 16 [--qlora] --output-dir runs/lora --merge   # peft's LoRA, our kernels
    torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp  # or accelerate launch --multi_gpu ...
"""
import argparse
import dataclasses
import datetime
import functools
import gc
import itertools
import json
import logging
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
import weakref
from pathlib import Path

# Long sequences need large blocks. By default the CUDA caching allocator carves them out of fixed segments and then
# cannot reuse a segment's free space for other sizes ("reserved but unallocated"); expandable segments grow one
# mapping instead. It must be set before torch initializes CUDA, and only when the user has not chosen a setting.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from tqdm import tqdm

# The kernel modules come BEFORE transformers: without a GPU they switch Triton to its CPU interpreter, which only
# works if that happens before anything (transformers' LLaMA code does) imports Triton.
from cross_entropy_kernel import cross_entropy
from float8_training import RECIPES, check_fp8_flags, compile_decoder_layers, convert_decoder_linears, torchao_version
from linear_cross_entropy_kernel import linear_cross_entropy
from rmsnorm_kernel import apply_rmsnorm
from rope_kernel import apply_rope
from swiglu_kernel import apply_glu_mlp

# transformers imports torchao where it is installed (for finetune_optimized.py --fp8); torchao's notice that its CUDA
# extensions do not load and torch's about torchao's enums concern no run here: those two loggers show errors only.
for noisy_logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(noisy_logger).setLevel(logging.ERROR)

import transformers
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler
from transformers.integrations.sdpa_attention import sdpa_attention_forward

HERE = Path(__file__).resolve().parent
HAS_CUDA = torch.cuda.is_available()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The attention implementations transformers trains LLaMA with (its "paged|..." variants serve generation).
ATTN_IMPLEMENTATIONS = ["sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"]
# Without a GPU, --compile uses aot_eager: it traces the step as inductor would but generates no code (inductor's C++
# for the CPU takes ~30 s to compile even the tiny model on 2 cores and would speed up nothing that matters).
COMPILE_BACKEND = "inductor" if HAS_CUDA else "aot_eager"
# transformers' names of the schedules: "constant" holds the rate after the warm-up, the others decay it to 0.
LR_SCHEDULERS = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}
# Checkpoints store the optimizer state keyed by parameter name, one flat entry per tensor: the same layout for one
# AdamW over all parameters and for one AdamW per parameter, and resharded on load under FSDP2. They hold the trained
# parameters only: under LoRA the adapters and their optimizer state, not the frozen base, which --model gives back.
# Loading is not strict about the frozen ones the checkpoint leaves out; dcp.load refuses one that lacks a trained one.
FLAT_STATE = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    # expanduser here, once: the weights and the tokenizer then read the same folder, also for --model=~/models/x
    add("--model", default="meta-llama/Llama-3.1-8B" if HAS_CUDA else "tiny", type=os.path.expanduser,
        help="Hub id or local folder; a name in configs/ (tiny, tiny-<family>, qwen3-8b, ...): random weights")
    add("--dtype", choices=["auto", *DTYPES], default="auto", help="auto = bf16 on CUDA, fp32 on CPU")
    add("--attn-implementation", choices=ATTN_IMPLEMENTATIONS, default="sdpa", help="transformers' attention")
    add("--allow-download", action="store_true", help="let from_pretrained and load_dataset reach the Hub (default: "
        "the local cache only)")
    # -- training --------------------------------------------------------------------------------------------------
    add("--steps", type=int, default=20, help="optimizer steps; the first is a warm-up, not timed")
    add("--batch-size", type=int, default=1, help="sequences per micro-batch (per rank with --fsdp)")
    add("--seq-len", type=int, default=512 if HAS_CUDA else 32, help="tokens per sequence")
    add("--grad-accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    add("--optimizer", choices=["adamw_fused", "adamw_foreach"], default="adamw_fused", help="torch AdamW's kernels")
    add("--lr", type=float, default=1e-5, help="peak learning rate")
    add("--lr-scheduler", choices=list(LR_SCHEDULERS), default="constant", help="after the warm-up: the rate held "
        "(constant) or decayed to 0 at the last step")
    add("--warmup-steps", type=int, default=0, help="steps of linear learning-rate warm-up")
    add("--max-grad-norm", type=float, default=1.0, help="clip the gradients' global norm to this (0: no clipping)")
    add("--seed", type=int, default=0, help="seeds the random weights and the synthetic tokens")
    add("--activation-checkpointing", choices=["none", "full", "selective"], default=None,
        help="recompute the first --checkpoint-layers decoder layers in the backward instead of keeping their "
             "activations: full = the whole layer; selective = all but attention, whose output and log-sum-exp are "
             "kept (attention is the part whose cost grows with T^2). Default: the memory plan's choice")
    # -- data and evaluation ---------------------------------------------------------------------------------------
    add("--data", default="synthetic", help="synthetic (random tokens), a save_to_disk folder, a .txt, .json, "
        ".jsonl, .parquet or .csv file or a folder of them, or a Hub data set")
    add("--text-field", default="text", help="the column of the data that holds the text")
    add("--eval-data", default=None, help="held-out data, read like --data")
    add("--eval-split", type=float, default=None, help="instead of --eval-data: hold out this fraction of --data")
    add("--eval-steps", type=int, default=None, help="evaluate every N steps (and after the last)")
    add("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    # -- saving ----------------------------------------------------------------------------------------------------
    add("--output-dir", default=None, help="gets checkpoint-<step>/, final/ (save_pretrained) and results.json")
    add("--save-steps", type=int, default=None, help="write a checkpoint every N steps")
    add("--save-total-limit", type=int, default=1, help="checkpoints kept")
    add("--resume", action="store_true", help="continue from the latest complete checkpoint in --output-dir")
    add("--tensorboard", default=None, metavar="DIR", help="also log the scalars for TensorBoard here")
    add("--out", default=None, help="results JSON (default: in --output-dir, else runs/<the run's options>.json)")
    # -- LoRA and QLoRA (peft) -------------------------------------------------------------------------------------
    add("--lora", type=int, default=None, metavar="R", help="train peft's LoRA adapters of rank R on --lora-targets "
        "instead of every weight; the base model stays frozen")
    add("--lora-alpha", type=float, default=None, help="the adapters' output is scaled by alpha / R (default: 2 x R)")
    add("--lora-dropout", type=float, default=0.0, help="dropout on the adapters' input")
    add("--lora-targets", nargs="+", default=None, metavar="NAME", help="the Linears of the decoder layers that get "
        "adapters, by name (q_proj v_proj ...); default: every one (peft's all-linear; not the lm_head)")
    add("--qlora", action="store_true", help="with --lora: the base's decoder Linears in 4-bit NF4 (torchao), "
        "dequantized layer by layer for their matmuls")
    add("--merge", action="store_true", help="with --lora: also write the base with the adapters merged into it, "
        "DIR/final-merged")
    # -- measurements ----------------------------------------------------------------------------------------------
    add("--seq-len-search", default=None, metavar="L1,L2,...", help="instead of training: one batch-1 step per "
        "length, after a warm-up step; the longest that trains")
    add("--fsdp", action="store_true", help="shard the model with FSDP2 (under torchrun or accelerate launch)")
    add("--compile", action="store_true", help="torch.compile the model with its loss")
    add("--compile-mode", choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"], default="default",
        help="torch.compile's mode")
    # -- optimized only: the kernels --------------------------------------------------------------------------------
    add("--loss", choices=["linear_ce", "ce", "eager"], default="linear_ce",
        help="linear_ce: fused linear cross-entropy from the hidden states, no logits at all; ce: fused "
             "cross-entropy on the lm_head logits (the playbook's configuration); eager: transformers' own")
    add("--lce-chunk-size", type=int, default=None, help="rows per chunk of the fused linear cross-entropy; None = "
        "its default (LCE_CHUNK_ROWS, fewer for a large vocabulary)")
    for kernel, what in (("rmsnorm", "every RMSNorm"), ("swiglu", "every MLP's silu(gate) * up (GELU for Gemma)"),
                         ("rope", "the rotary embedding of q and k")):
        add(f"--{kernel}", action=argparse.BooleanOptionalAction, default=True, help=f"{what} as a fused kernel")
    add("--fp8", choices=RECIPES, default=None,
        help="float8 training (torchao, float8_training.py) of every Linear in the decoder layers, each layer "
             "compiled so the casts fuse; not the lm_head, whose matmul is inside the fused loss. rowwise: a scale "
             "per row (more accurate); tensorwise: one per tensor (faster); rowwise_with_gw_hp: rowwise with the "
             "weight gradient's matmul in bf16. Needs a GPU of compute capability 8.9+ (H100) and --loss linear_ce")
    add("--fp8-keep-bf16", nargs="+", default=[], metavar="NAME",
        help="with --fp8: decoder Linears left in bf16 in every layer, by name (e.g. k_proj v_proj)")
    # -- optimized only: memory --------------------------------------------------------------------------------------
    add("--memory-plan", choices=["auto", "manual"], default="auto",
        help="auto: before the first step, pick the fastest levers that fit the GPU (levers given by hand are kept, "
             "the plan fills in the rest) and fall back to the next plan if a step runs out of memory; manual: the "
             "flags alone")
    add("--memory-budget-gib", type=float, default=None,
        help="plan for this much GPU memory instead of what the GPU has (a smaller card; without a GPU, the plan "
             "for one)")
    add("--checkpoint-layers", type=int, default=None, metavar="N",
        help="with checkpointing: checkpoint only the first N decoder layers (manual default: all)")
    add("--offload-activations", type=int, default=None, metavar="N",
        help="keep the checkpointed input of the first N decoder layers in pinned host memory")
    add("--tiled-mlp", type=int, default=None, metavar="TOKENS",
        help="run every MLP over sequence tiles of TOKENS tokens (the backward recomputes each tile)")
    add("--optimizer-in-backward", action=argparse.BooleanOptionalAction, default=None,
        help="step each parameter's AdamW as soon as its gradient is ready, then free that gradient")
    add("--offload-optimizer", action=argparse.BooleanOptionalAction, default=None,
        help="AdamW's moments in pinned host memory, streamed through the GPU in the backward (needs the optimizer "
             "in the backward)")
    add("--cuda-graph", action="store_true", help="capture the whole training step as one CUDA graph and replay "
        "it: one launch per step instead of one per kernel (for steps the host cannot launch fast enough: 1x512)")
    add("--plot", nargs="+", default=None, metavar="JSON", help="instead of training: plot peak GPU memory and "
        "tokens/s against sequence length from results files (ours, Liger, ...), memory labelled with the levers, "
        "into --out (.png)")
    return parser


def parse_args(argv=None):
    """The arguments; a bad one ends the run here with one line, before anything is loaded."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "grad_accum_steps", "eval_batches", "save_total_limit",
                 "eval_steps", "save_steps"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.seq_len < 2:  # position t learns to predict token t+1: a single token leaves nothing to predict
        parser.error("--seq-len must be at least 2: the loss predicts each next token, so 1 token has none")
    if not 0 < args.lr < math.inf:  # also false for nan
        parser.error(f"--lr must be a positive finite number, got {args.lr}")
    if not 0 <= args.max_grad_norm < math.inf or not 0 <= args.warmup_steps:
        parser.error("--max-grad-norm and --warmup-steps must be >= 0")
    if args.eval_split is not None and (not 0 < args.eval_split < 1 or args.eval_data or args.data == "synthetic"):
        parser.error("--eval-split takes a fraction between 0 and 1 of --data (not synthetic), not with --eval-data")
    if (args.save_steps or args.resume) and not args.output_dir:
        parser.error("--save-steps and --resume need --output-dir")
    if args.resume and not checkpoints(args.output_dir):
        parser.error(f"--resume: no complete checkpoint in {args.output_dir} (drop --resume to start a new run there)")
    if args.attn_implementation == "flex_attention" and not HAS_CUDA:
        parser.error("--attn-implementation flex_attention needs a GPU: FlexAttention has no backward on the CPU")
    if args.out and Path(args.out).is_dir():  # checked now: the results are written only at the end of the run
        parser.error(f"--out {args.out} is a directory: give the path of the file to write")
    if args.compile_mode != "default" and not (args.compile and COMPILE_BACKEND == "inductor"):
        parser.error(f"--compile-mode goes with --compile, on a GPU (the CPU's {COMPILE_BACKEND} has no modes)")
    if args.lce_chunk_size is not None and (args.lce_chunk_size <= 0 or args.loss != "linear_ce"):
        parser.error("--lce-chunk-size must be positive and goes with --loss linear_ce")
    if args.fp8 and args.lora is not None:
        parser.error("--fp8 cannot be combined with --lora or --qlora: torchao's float8 Linear would take the "
                     "adapters' Linears too; LoRA trains on the bf16 (or, with --qlora, NF4) base")
    check_fp8_flags(parser, args)
    if args.plot and not (args.out or "").endswith(".png"):
        parser.error("--plot writes a PNG: give its path with --out FILE.png")
    check_memory_flags(parser, args)
    check_lora_flags(parser, args)
    if args.seq_len_search:  # "4096,8192,...": increasing lengths; a part that is no number reads as 0, refused
        args.seq_len_search = [int(x) if x.strip().isdigit() else 0 for x in args.seq_len_search.split(",")]
        if args.seq_len_search != sorted(set(args.seq_len_search)) or args.seq_len_search[0] < 2:
            parser.error("--seq-len-search lengths must be at least 2 and increasing, e.g. 4096,8192,12288")
    if args.fsdp and "WORLD_SIZE" not in os.environ:
        parser.error(f"--fsdp needs a distributed launcher: torchrun --standalone --nproc-per-node 2 "
                     f"{Path(__file__).name} --fsdp, or accelerate launch --multi_gpu --num_processes 2 ...")
    for name in ("seq_len_search", "compile", "liger"):
        if args.fsdp and getattr(args, name, None):
            parser.error(f"--fsdp cannot be combined with --{name.replace('_', '-')}")
    return args


# ----------------------------------------------------------------------------------------------------------------------
# What ran, where, with which versions (the header and the JSON); the name of the JSON

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


# Options the default JSON name leaves out: its fixed parts and the variant show them, or they change no measurement.
UNNAMED_OPTIONS = {"model", "dtype", "batch_size", "seq_len", "fsdp", "compile", "liger", "loss", "rmsnorm", "swiglu",
                   "rope", "fp8", "out", "tensorboard", "allow_download"}


def default_out_path(args, weights, dtype, variant, world_size):
    """DIR/results.json with --output-dir; else runs/<script>_<model>-<weights>_<variant>_<dtype>_<shape>[_fsdpN] and
    every other option that differs from its default as _<option>=<value>: runs never overwrite each other's JSON."""
    if args.output_dir:
        return Path(args.output_dir) / "results.json"
    defaults = vars(build_parser().parse_args([]))
    parts = [Path(__file__).stem, f"{Path(args.model).name}-{weights}", variant, dtype,
             f"{args.batch_size}x{args.seq_len}" + (f"_fsdp{world_size}" if args.fsdp else "")]
    parts += [f"{name.replace('_', '-')}={Path(str(value)).name}" for name, value in vars(args).items()
              if name not in UNNAMED_OPTIONS and value != defaults[name]]
    return HERE / "runs" / ("_".join(re.sub(r"[^\w.+=-]+", "-", str(part)) for part in parts) + ".json")


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
# LoRA and QLoRA: peft's adapters on the frozen base (QLoRA: the base's decoder Linears in 4-bit NF4)

def check_lora_flags(parser, args):
    """The LoRA flags' rules (parse_args calls this): a usage error before anything is loaded."""
    lora_only = {"lora_alpha": None, "lora_dropout": 0.0, "lora_targets": None, "qlora": False, "merge": False}
    if args.lora is None:
        given = [name for name, default in lora_only.items() if getattr(args, name) != default]
        if given:
            parser.error(f"--{given[0].replace('_', '-')} goes with --lora R (the rank of the adapters to train)")
        return
    if args.lora <= 0:
        parser.error(f"--lora takes the adapters' rank, a positive integer, got {args.lora}")
    if not 0 <= args.lora_dropout < 1:
        parser.error(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lora_alpha is not None and not 0 < args.lora_alpha < math.inf:
        parser.error(f"--lora-alpha must be a positive finite number, got {args.lora_alpha}")
    if args.merge and (not args.output_dir or args.fsdp):
        parser.error("--merge writes DIR/final-merged: it needs --output-dir, and one process (not --fsdp)")
    if args.qlora and args.fsdp:
        parser.error("--qlora cannot be combined with --fsdp: the 4-bit base is not sharded here; --lora alone shards")


def lora_settings(args):
    """What makes adapters fit a run (None without --lora): the base model, the rank, the targets, the base's format.
    A checkpoint records it and --resume compares it."""
    if args.lora is None:
        return None
    return {"base_model": args.model, "r": args.lora, "targets": " ".join(args.lora_targets or ["all-linear"]),
            "base_format": "nf4" if args.qlora else "dense"}


def describe_lora(settings):
    """lora_settings in words, for --resume's error."""
    if settings is None:
        return "a full fine-tune (no LoRA)"
    return (f"LoRA adapters of rank {settings['r']} on {settings['targets']} of {settings['base_model']}"
            + " (NF4 base, --qlora)" * (settings["base_format"] == "nf4"))


def quantize_to_nf4(model):
    """QLoRA's base: the weight of every Linear in the decoder layers becomes torchao's NF4Tensor (4-bit NormalFloat
    codes in blocks of 64 values, each block's scale itself quantized to 8 bits: ~0.53 bytes a weight), frozen. The
    NF4Tensor dequantizes itself to the input's dtype inside F.linear, layer by layer, forward and backward, so peft's
    LoRA layer wraps the Linear as it wraps any other. The lm_head and the embedding stay as they are (the fused loss
    reads the lm_head's weight)."""
    from torchao.quantization import to_nf4
    linears = [module for module in model.model.layers.modules() if isinstance(module, torch.nn.Linear)]
    for linear in linears:
        blocks = linear.weight.numel() // 64
        # torchao quantizes the blocks' scales in groups of 256 (QLoRA's size); a weight of fewer blocks than a
        # multiple of 256 (the tiny configs' only) takes the largest group size that divides its count
        linear.weight = torch.nn.Parameter(to_nf4(linear.weight.detach(), 64, math.gcd(256, blocks)),
                                           requires_grad=False)


def apply_lora(args, model):
    """peft's LoRA on the model, in place: every target Linear becomes a peft LoraLayer around it (adapters A [R, in],
    B [out, R], B zero so training starts at the base model), and every other parameter is frozen (requires_grad
    False: no gradient, no optimizer state). --qlora first stores the base's decoder Linears in NF4. Returns the
    PeftModel, for saving the adapters and merging them; training calls the model itself, which is what peft's forward
    calls for LoRA. None without --lora."""
    if args.lora is None:
        return None
    from peft import LoraConfig, get_peft_model
    if args.lora_targets:  # peft's own error for a missing target names no alternative: this one lists them
        linears = {name.rsplit(".", 1)[-1] for name, module in model.model.layers.named_modules()
                   if isinstance(module, torch.nn.Linear)}
        unknown = sorted(set(args.lora_targets) - linears)
        if unknown:
            raise SystemExit(f"error: --lora-targets {' '.join(unknown)}: no such Linear in "
                             f"{model.config.model_type}'s decoder layers; its Linears: {' '.join(sorted(linears))}")
    if args.qlora:
        quantize_to_nf4(model)
    config = LoraConfig(r=args.lora, lora_alpha=args.lora_alpha or 2 * args.lora, lora_dropout=args.lora_dropout,
                        target_modules=args.lora_targets or "all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def trainable_parameters(model):
    """The parameters the optimizer updates: all of them in a full fine-tune, the adapters' under LoRA."""
    return [param for param in model.parameters() if param.requires_grad]


def lora_report(args, model):
    """The run's LoRA figures for the header and the JSON (None without --lora): its settings and how many of the
    model's parameters train."""
    if args.lora is None:
        return None
    total = sum(param.numel() for param in model.parameters())
    trainable = sum(param.numel() for param in trainable_parameters(model))
    return {**lora_settings(args), "alpha": args.lora_alpha or 2 * args.lora, "dropout": args.lora_dropout,
            "trainable_params": trainable, "total_params": total}


def dequantize_nf4(model):
    """The NF4 weights of --qlora back in their original dtype (merging adds the adapters to dense weights)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(weight, "get_original_weight"):  # torchao's NF4Tensor
            module.weight = torch.nn.Parameter(weight.get_original_weight(), requires_grad=False)


# ----------------------------------------------------------------------------------------------------------------------
# Data: [n_batches, batch, seq_len] token ids. Labels are the inputs themselves (causal LM); the shift happens below.

# A local data file is read by the datasets builder of its format, as load_dataset(<builder>, data_files=...) does.
DATA_FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def data_rows(source, offline):
    """The rows of a save_to_disk folder (its "train" split where it has several), a local data file (streamed: read
    only as far as the run needs; a .txt file is one document), a folder of data files, or a Hub data set (from the
    cache when offline)."""
    if offline:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when datasets is imported
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach the user as our one line instead
    path, builder = Path(source), DATA_FILE_BUILDERS.get(Path(source).suffix.lower())
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():  # written by save_to_disk
        rows = datasets.load_from_disk(source)
        return rows["train"] if isinstance(rows, datasets.DatasetDict) else rows
    if path.is_file() and builder is None:
        raise SystemExit(f"error: data {source}: unknown file type {path.suffix or '(none)'}; data is read from "
                         f"{', '.join(DATA_FILE_BUILDERS)} files and save_to_disk folders")
    if builder is None:  # a folder of data files (datasets picks the builder), or a Hub data set
        return datasets.load_dataset(source, split="train", streaming=path.is_dir())
    if not path.is_file():
        raise SystemExit(f"error: data {source}: no such file or folder")
    options = {"sample_by": "document"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=source, split="train", streaming=True, **options)


def load_tokenizer(args):
    """The model's tokenizer, or None where it has none here (a built-in architecture, a Hub id not in the cache): the
    UTF-8 bytes of the text are then the token ids (0..255, valid for any vocabulary >= 256)."""
    try:
        return AutoTokenizer.from_pretrained(args.model, local_files_only=not args.allow_download)
    except (OSError, ValueError) as err:
        print(f"no tokenizer for {args.model} ({first_line(err)}): using UTF-8 bytes as token ids")


def load_token_stream(args, source, eos_id, tokenizer, tokens_needed):
    """The --text-field of each row tokenized, rows joined by EOS and empty ones skipped, as one 1-D tensor. Data that
    cannot be read, lacks the field, is not UTF-8 or holds no text ends the run with one error line."""
    encode = (lambda text: tokenizer(text)["input_ids"]) if tokenizer else (lambda text: list(text.encode("utf-8")))
    ids = []
    try:
        for index, row in enumerate(data_rows(source, offline=not args.allow_download)):
            if args.text_field not in row:
                raise SystemExit(f"error: data {source}: no field {args.text_field!r} (its fields: "
                                 f"{', '.join(map(str, row))}); name the text column with --text-field")
            if not isinstance(text := row[args.text_field], str):
                raise SystemExit(f"error: data {source}: row {index}: field {args.text_field!r} holds {text!r:.40}, "
                                 f"not text")
            ids += encode(text) + [eos_id] if text.strip() else []
            if len(ids) >= tokens_needed:  # stop early: a big corpus needs only as many tokens as the run trains on
                break
    except Exception as err:  # datasets raises many types for "not cached", "no network", "not JSON", ...
        cause = err
        while not isinstance(cause, UnicodeDecodeError) and (cause.__cause__ or cause.__context__):
            cause = cause.__cause__ or cause.__context__  # a decoding error arrives wrapped in datasets' own
        what = (f"not UTF-8 text (byte 0x{cause.object[cause.start]:02x}); re-encode it as UTF-8"
                if isinstance(cause, UnicodeDecodeError) else f"cannot be read: {first_line(err)}")
        if not args.allow_download and not Path(source).exists():  # a Hub data set name, read from the cache only
            what += "; --allow-download fetches it from the Hub"
        raise SystemExit(f"error: data {source}: {what}") from None
    if not ids:
        raise SystemExit(f"error: data {source}: contains no text in field {args.text_field!r}")
    return torch.tensor(ids, dtype=torch.long)


def make_batches(args, split, vocab_size, eos_id, tokenizer, device, rank=0, world_size=1):
    """[n_batches, batch, seq_len] token ids of "train" (--steps x --grad-accum-steps micro-batches of --data) or "eval"
    (--eval-batches of --eval-data, or of the end of --data with --eval-split). The same arguments give the same
    batches: --resume continues the data where the checkpoint left it. --fsdp: rank r trains rows r::world_size."""
    n_batches = args.steps * args.grad_accum_steps if split == "train" else args.eval_batches
    rows = world_size * args.batch_size
    tokens_needed = n_batches * rows * args.seq_len
    source = args.eval_data if split == "eval" and args.eval_data else args.data
    if source == "synthetic":  # what the playbook trains on: uniform random tokens (loss stays near ln V)
        generator = torch.Generator().manual_seed(args.seed + (split == "eval"))  # held-out tokens are others
        stream = torch.randint(0, vocab_size, (tokens_needed,), generator=generator)
    else:
        # --eval-split: read what training needs plus the held-out share, then hold out the end of what was read
        train_tokens = args.steps * args.grad_accum_steps * rows * args.seq_len
        stream = load_token_stream(args, source, eos_id, tokenizer, math.ceil(train_tokens / (1 - args.eval_split))
                                   if args.eval_split else tokens_needed)
        if args.eval_split:
            cut = int(stream.numel() * (1 - args.eval_split))
            stream = stream[:cut] if split == "train" else stream[cut:]
        if stream.numel() < 2 or int(stream.max()) >= vocab_size:
            raise SystemExit(f"error: data {source}: its {split} part has {stream.numel()} tokens, or ids outside the "
                             f"model's vocabulary ({vocab_size})")
        if stream.numel() < tokens_needed:
            print(f"{split} data has {stream.numel()} tokens, the run needs {tokens_needed}: cycling through it")
            stream = stream.repeat(-(-tokens_needed // stream.numel()))
    # Packed: consecutive seq_len windows of the stream (no padding; attention crosses document boundaries, the
    # usual simplification for packed pre-training-style batches).
    batches = stream[:tokens_needed].view(n_batches, rows, args.seq_len)
    return batches[:, rank::world_size].contiguous().to(device)


def load_data(args, config, device, rank, world_size):
    """The tokenizer (None: synthetic data, or UTF-8 bytes as ids) and {"train": batches, "eval": batches or None}."""
    tokenizer = load_tokenizer(args) if args.data != "synthetic" or args.eval_data or args.output_dir else None
    eos_id = tokenizer.eos_token_id if tokenizer else config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id  # a config may list several (chat turn ends)
    wants_eval = args.eval_data or args.eval_split or args.eval_steps
    return tokenizer, {split: make_batches(args, split, config.vocab_size, eos_id, tokenizer, device, rank, world_size)
                       if split == "train" or wants_eval else None for split in ("train", "eval")}


def shift_labels_of(labels):
    """What transformers' ForCausalLMLoss does: position t predicts token t+1, the last position predicts nothing.
    Shifting the labels (instead of slicing the logits) keeps the [B, T, V] logits whole: no copy of them."""
    return F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()  # contiguous: [B, T] rows, viewable as [B*T]


# ----------------------------------------------------------------------------------------------------------------------
# Loss: THE part the kernels change (compare with finetune_optimized.py)

def compute_loss(model, input_ids, shift_labels, loss_impl, lce_chunk_size=None):
    """(loss, token accuracy): the fraction of non-ignored positions whose most likely token is the label, which the
    fused losses find in the same pass over the logits (return_token_accuracy)."""
    if loss_impl == "linear_ce":
        # Run the decoder body only and let the loss multiply by lm_head's weight chunk by chunk: no [B*T, V] logits.
        hidden = model.model(input_ids=input_ids).last_hidden_state  # [B, T, H]
        # Gemma 2 caps its logits at final_logit_softcapping (cap * tanh(logits / cap)): the kernel applies it to each
        # chunk of logits, as the model's own forward does to all of them.
        out = linear_cross_entropy(hidden, model.lm_head.weight, shift_labels, chunk_size=lce_chunk_size,
                                   softcap=getattr(model.config, "final_logit_softcapping", None),
                                   return_token_accuracy=True)
        return out.loss, out.token_accuracy
    logits = model(input_ids=input_ids).logits  # [B, T, V] in the model's dtype
    if loss_impl == "ce":
        # The same math as below without an fp32 copy of the logits. inplace_backward: the gradient overwrites the
        # logits, safe because lm_head's backward needs its input, not its output; not under torch.compile, where the
        # loss is an operator that may not overwrite its input.
        out = cross_entropy(logits, shift_labels, inplace_backward=not torch.compiler.is_compiling(),
                            return_token_accuracy=True)
        return out.loss, out.token_accuracy
    # transformers' ForCausalLMLoss: upcast the logits to fp32, mean over the non-ignored tokens.
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), shift_labels.view(-1), ignore_index=-100)
    with torch.no_grad():  # one more pass over the logits (argmax), as a training loop that logs accuracy does
        counted = shift_labels != -100
        accuracy = ((logits.argmax(dim=-1) == shift_labels) & counted).sum() / counted.sum()
    return loss, accuracy


class ModelWithLoss(torch.nn.Module):
    """The model and compute_loss as one module: the unit FSDP2 shards as its root, and the unit torch.compile
    compiles (the fused linear cross-entropy reads lm_head.weight outside lm_head's own forward)."""

    def __init__(self, model, loss_impl, lce_chunk_size=None):
        super().__init__()
        self.model, self.loss_impl, self.lce_chunk_size = model, loss_impl, lce_chunk_size

    def forward(self, input_ids, shift_labels):
        return compute_loss(self.model, input_ids, shift_labels, self.loss_impl, self.lce_chunk_size)


@torch.no_grad()
def evaluate(model_with_loss, batches, world_size):
    """Mean held-out loss and token accuracy over batches ([n, batch, seq_len]), averaged over the ranks."""
    model_with_loss.eval()
    results = [model_with_loss(input_ids, shift_labels_of(input_ids)) for input_ids in batches]
    model_with_loss.train()
    means = [torch.stack([result[i].float() for result in results]).mean() for i in (0, 1)]
    if world_size > 1:
        for mean in means:
            dist.all_reduce(mean.div_(world_size))
    return [mean.item() for mean in means]


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints: write, keep the last --save-total-limit, resume; the final model

def checkpoints(output_dir):
    """The complete checkpoints in output_dir, oldest first: a checkpoint takes its name once all of it is written."""
    folders = Path(output_dir).glob("checkpoint-*") if output_dir else []
    return sorted((f for f in folders if re.fullmatch(r"checkpoint-\d+", f.name)), key=lambda f: int(f.name[11:]))


def host_memory_available():
    """Bytes the host can still give without swapping (Linux: MemAvailable), or 0 where that is unknown."""
    try:
        line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return 0


def checkpoint_state(model, optimizers):
    """The tensors a checkpoint holds (model and optimizer state, optimizer state flattened so that one AdamW and one
    AdamW per parameter share a layout) and their size in bytes; a sharded tensor counts its global size."""
    model_state, optimizer_state = get_state_dict(model, optimizers, options=FLAT_STATE)
    size = sum(t.numel() * t.element_size() for part in (model_state, optimizer_state) for t in part.values()
               if isinstance(t, torch.Tensor))
    return {"model": model_state, "optimizer": optimizer_state}, size


class CheckpointStager(AsyncStager):
    """Where async_save copies the state before the background write, the one part of a checkpoint training waits for.
    async_save's own stager copies into freshly allocated pageable memory every time: for an 8B run (45 GB) that held
    training for half a minute. A pinned CheckpointStager copies into pinned host buffers, allocated once and reused by
    every checkpoint (torch's StateDictStager keeps them, keyed by the GPU storage each mirrors), with non-blocking
    copies at the PCIe rate. torch's DefaultStager cannot be the reusing one: in torch 2.11 it empties that cache after
    every copy. A checkpoint's write ends before the next one stages into the same buffers (finish_checkpoint)."""
    _synchronize_after_execute = False  # stage() returns with the copy complete

    def __init__(self, pinned):
        self.pinned = pinned
        self.kind = "pinned" if pinned else "pageable"  # as the results and the summary name it
        self.buffers = StateDictStager(pin_memory=True) if pinned else None

    def stage(self, state_dict):
        if not self.pinned:  # a fresh pageable copy, freed after its write (async_save's own behaviour)
            copier = StateDictStager()
            staged = copier.stage(state_dict)
            copier.close()  # drops its cache and the reference cycle of its copy table, not the copy
            return staged
        staged = self.buffers.stage(state_dict, non_blocking=True)
        torch.cuda.synchronize()  # the copies are queued behind the step: done before the next step changes the state
        return staged

    def synchronize_staging(self):
        pass

    def close(self):
        if self.buffers is not None:
            self.buffers.close()


def checkpoint_stager(size):
    """The run's CheckpointStager for a checkpoint of `size` bytes: pinned where the host has room for buffers that
    stay allocated beside what it already holds (a fifth to spare) and CUDA can pin them, pageable otherwise."""
    return CheckpointStager(pinned=HAS_CUDA and 1.2 * size < host_memory_available())


def prepare_checkpoint_staging(model, optimizers):
    """The run's checkpoint stager, made after the warm-up step (the optimizer state exists from then on). A pinned
    one stages the state once right away: allocating and pinning tens of GB of host memory takes seconds, which the
    run then spends before its timed steps, and every checkpoint, the first included, holds training only for the
    copy. Returns (stager, seconds spent)."""
    t0 = time.perf_counter()
    state, size = checkpoint_state(model, optimizers)
    stager = checkpoint_stager(size)
    if stager.pinned:
        stager.stage(state)
    return stager, time.perf_counter() - t0


def save_checkpoint(args, step, model, optimizers, schedulers, rank, world_size, stager):
    """Starts DIR/checkpoint-<step>: model and optimizer state through torch.distributed.checkpoint (every rank writes
    its own shards), plus the schedule, the step (which is also the data position: the batches are a function of the
    arguments) and the RNG states. Training waits only while async_save copies the state to host memory (through
    `stager`, from prepare_checkpoint_staging); a background thread writes it to
    DIR/.partial-checkpoint-<step> while the next steps run. finish_checkpoint waits for that write, then renames the
    folder checkpoint-<step> and only then deletes the checkpoints beyond --save-total-limit: a run killed at any
    moment leaves the last complete checkpoint whole."""
    out, t0 = Path(args.output_dir), time.perf_counter()
    partial = out / f".partial-checkpoint-{step}"
    state, size = checkpoint_state(model, optimizers)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if size > free:
        raise SystemExit(f"error: checkpoint-{step} needs {size / 2**30:.1f} GiB and {out} has {free / 2**30:.1f} GiB "
                         f"free; the earlier checkpoints are kept")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # what a run killed while writing this step left
    trainer_state = {"step": step, "world_size": world_size, "model": args.model, "rng": torch.get_rng_state(),
                     "cuda_rng": torch.cuda.get_rng_state_all() if HAS_CUDA else [],
                     "scheduler": schedulers[0].state_dict(), "lora": lora_settings(args)}
    with warnings.catch_warnings():  # one process without a process group is the intended use here
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        future = dcp.async_save(state, checkpoint_id=partial, async_stager=stager)
    return {"step": step, "bytes": size, "stage_s": time.perf_counter() - t0, "t0": t0, "future": future,
            "partial": partial, "trainer_state": trainer_state, "staging": stager.kind}


def finish_checkpoint(args, pending, rank, world_size):
    """Waits for a checkpoint's background write, adds the trainer state and gives the folder its final name; returns
    what the results report of it."""
    final = Path(args.output_dir) / f"checkpoint-{pending['step']}"
    try:
        pending["future"].result()
        if rank == 0:
            torch.save(pending["trainer_state"], pending["partial"] / "trainer_state.pt")
            pending["partial"].rename(final)
            for old in checkpoints(args.output_dir)[:-args.save_total_limit]:
                shutil.rmtree(old)
    except (Exception, CheckpointException) as err:  # the writer thread's OSError arrives wrapped in DCP's type
        raise SystemExit(f"error: writing {final} failed ({str(err).strip().splitlines()[-1][:300]}); the earlier "
                         f"checkpoints are kept") from None
    if world_size > 1:
        dist.barrier()
    return {"step": pending["step"], "bytes": pending["bytes"], "stage_s": pending["stage_s"],
            "staging": pending["staging"], "write_s": time.perf_counter() - pending["t0"]}


def write_done(pending, world_size):
    """Whether a checkpoint's background write has finished, on every rank (they rename it together)."""
    done = torch.tensor(int(pending["future"].done()))
    if world_size > 1:
        dist.all_reduce(done, op=dist.ReduceOp.MIN)  # a CPU tensor: the gloo half of the process group
    return bool(done)


def resume(args, model, optimizers, schedulers, world_size):
    """Loads the latest complete checkpoint of --output-dir into the model, the optimizer(s) (keyed by parameter name,
    whatever their number) and the schedule(s); returns its step."""
    folder = checkpoints(args.output_dir)[-1]
    state = torch.load(folder / "trainer_state.pt", weights_only=False)
    if state["world_size"] != world_size:
        raise SystemExit(f"error: --resume: {folder} was written by {state['world_size']} ranks, this run has "
                         f"{world_size}; resume with the same number of processes")
    if state.get("lora") != lora_settings(args):  # adapters fit only the base, rank and targets they were trained on
        raise SystemExit(f"error: --resume: {folder} holds {describe_lora(state.get('lora'))}; this run trains "
                         f"{describe_lora(lora_settings(args))}: resume with the --model and --lora flags that "
                         f"wrote it")
    model_state, optimizer_state = get_state_dict(model, optimizers, options=FLAT_STATE)  # the tensors to load into
    try:
        with warnings.catch_warnings():  # one process without a process group is the intended use here
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    except (Exception, CheckpointException) as err:  # DCP's own type, a BaseException, carries a shape mismatch
        raise SystemExit(f"error: --resume: {folder} (written for {state['model']}) does not fit this model: "
                         f"{str(err).strip().splitlines()[-1][:300]}") from None
    set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=FLAT_STATE)
    for scheduler in schedulers:
        scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    torch.cuda.set_rng_state_all(state["cuda_rng"])  # [] without a GPU
    print(f"resumed from {folder}: step {state['step']} of {args.steps}")
    return state["step"]


def save_final(args, model, lora_model, tokenizer, rank):
    """DIR/final: the model as safetensors (save_pretrained) and its tokenizer where one was loaded; under LoRA the
    adapters alone (adapter_model.safetensors and adapter_config.json, which PeftModel.from_pretrained(base,
    DIR/final) loads), and with --merge also DIR/final-merged: the base with the adapters added into its weights, a
    plain model. Under FSDP2 the shards are gathered to rank 0 first."""
    folder, saved = Path(args.output_dir) / "final", lora_model or model
    state = get_model_state_dict(saved, options=StateDictOptions(full_state_dict=True, cpu_offload=args.fsdp,
                                                                  ignore_frozen_params=lora_model is not None))
    if rank == 0:
        saved.save_pretrained(folder, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        print(f"{'adapters' if lora_model else 'model'}: {folder}")
    if args.merge:  # one process (parse_args refuses --merge with --fsdp); the run is over: merging in place is fine
        dequantize_nf4(model)
        merged_folder = folder.with_name("final-merged")
        lora_model.merge_and_unload().save_pretrained(merged_folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(merged_folder)
        print(f"merged model: {merged_folder}")
    return str(folder)


def write_results(result, out_path, rank):
    if rank == 0:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results: {out_path}")


# ----------------------------------------------------------------------------------------------------------------------
# The loop, and the longest trainable sequence

# A search step shorter than this is run twice at its length, and the second one timed (see seq_len_search).
SEARCH_RETIME_S = 60


def seq_len_search(args, train_step, phase, vocab, device):
    """A training step at batch 1 x L for each L of --seq-len-search, after a warm-up step that creates the optimizer
    state: "trained", "out of memory" (in which part of the step) or "non-finite loss"; the first length that does not
    train ends the search, the longer ones are "not tried". The first step at a length pays one-time costs (the
    allocator's growth, kernels compiled for new shapes, host buffers pinned): a length whose first step takes under
    SEARCH_RETIME_S runs a second step, and that one is timed."""
    generator = torch.Generator().manual_seed(args.seed)
    warmup_len = min(2048, args.seq_len_search[0])
    print(f"seq-len search (batch 1, synthetic tokens, after a warm-up step of {warmup_len}): {args.seq_len_search}")
    train_step(torch.randint(0, vocab, (1, 1, warmup_len), generator=generator).to(device))
    rows = []
    for seq_len in args.seq_len_search:
        input_ids = torch.randint(0, vocab, (1, 1, seq_len), generator=generator).to(device)
        if HAS_CUDA:
            torch.cuda.empty_cache()  # hand back the previous length's cached blocks: this length's own peak
            torch.cuda.reset_peak_memory_stats()
        t0, first_step_s, loss = time.perf_counter(), None, math.nan
        try:
            loss = train_step(input_ids)[0].item()  # .item(): the step has finished
            if time.perf_counter() - t0 < SEARCH_RETIME_S and math.isfinite(loss):
                first_step_s, t0 = time.perf_counter() - t0, time.perf_counter()
                loss = train_step(input_ids)[0].item()
        except torch.OutOfMemoryError:
            pass  # phase["now"] names the part of the step that ran out
        step_s = time.perf_counter() - t0
        row = {"seq_len": seq_len, "status": "trained" if math.isfinite(loss) else "non-finite loss", "loss": loss,
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if HAS_CUDA else None}
        if phase["now"] != "idle":
            row.update(status="out of memory", phase=phase["now"])
        elif row["status"] == "trained":
            row.update(step_ms=1e3 * step_s, tokens_per_s=seq_len / step_s,
                       first_step_ms=1e3 * (first_step_s or step_s))
        rows.append(row)
        peak = "n/a (CPU)" if row["peak_gib"] is None else f"{row['peak_gib']:.2f} GiB"
        print(f"seq_len {seq_len:>7}: {row['status']}" + (f" in the {phase['now']}" if "phase" in row else "")
              + (f", {step_s:.1f} s/step, {seq_len / step_s:,.0f} tok/s" if "step_ms" in row else "")
              + (f" (the first step at this length {first_step_s:.1f} s)" if "step_ms" in row and first_step_s else "")
              + f", peak {peak}")
        if row["status"] != "trained":
            break
    rows += [{"seq_len": seq_len, "status": "not tried"} for seq_len in args.seq_len_search[len(rows):]]
    longest = max((row["seq_len"] for row in rows if row["status"] == "trained"), default=None)
    print(f"longest batch-1 sequence that trained: {longest}")
    return {"seq_len_search": {"lengths": args.seq_len_search, "warmup_seq_len": warmup_len, "results": rows,
                               "longest_trained": longest}}


def init_distributed(args):
    """(rank, world_size, device). --fsdp: join the process group that torchrun or accelerate launch set up, NCCL
    with one GPU per process (cuda:LOCAL_RANK), gloo on CPU; otherwise one process on the one device."""
    if not args.fsdp:
        return 0, 1, "cuda" if HAS_CUDA else "cpu"
    device = f"cuda:{os.environ['LOCAL_RANK']}" if HAS_CUDA else "cpu"
    if HAS_CUDA:
        torch.cuda.set_device(device)  # the current device of synchronize(), max_memory_allocated(), NCCL
    # gloo beside NCCL: the checkpoints' background writes coordinate the ranks on the host
    dist.init_process_group("cpu:gloo,cuda:nccl" if HAS_CUDA else "gloo",
                            device_id=torch.device(device) if HAS_CUDA else None)
    if dist.get_rank() != 0:  # every rank runs this same script: rank 0's copy of the output is enough
        sys.stdout = open(os.devnull, "w")
    return dist.get_rank(), dist.get_world_size(), device


def end_distributed_run():
    """The last step of an --fsdp run: every rank waits at a barrier (past its last collective before any closes its
    connections), leaves the process group, and the process ends here, skipping Python's interpreter shutdown.
    torch.distributed.tensor caches its sharding decisions with the device mesh, and so the process group, in them:
    the group outlives destroy_process_group() and its gloo worker threads run into that shutdown. A worker still
    releasing a collective's buffers then needs the interpreter lock of an interpreter that is going away, and the
    process aborts ("terminate called without an active exception") after its work is done. Everything is written by
    now: the results, checkpoints (their background writes are waited for), the final model."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(args, train_step, model_with_loss, optimizers, schedulers, batches, start_step, variant, rank, world_size):
    """Steps start_step+1 .. --steps, then the summary. The first step(s) of the process are a warm-up left out of the
    timing (kernels compile, cuBLAS picks algorithms, the optimizer creates its state); each later step is timed
    between two synchronizations."""
    micro_batches = batches["train"].view(args.steps, args.grad_accum_steps, *batches["train"].shape[1:])
    tokens_per_step = world_size * args.grad_accum_steps * args.batch_size * args.seq_len
    warmup_steps = 2 if args.compile and args.compile_mode == "reduce-overhead" else 1  # the 2nd records its graphs
    sync = torch.cuda.synchronize if HAS_CUDA else lambda: None
    writer = None
    if args.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(args.tensorboard)
    records, step_times, evals, saved, pending, stager, staging_s = [], [], [], [], None, None, None
    progress = tqdm(range(start_step + 1, args.steps + 1), desc=variant, unit="step", disable=rank != 0)
    for step in progress:
        if step == start_step + warmup_steps + 1 and HAS_CUDA and warmup_steps == 1:
            torch.cuda.empty_cache()  # the timed steps' own peak (reduce-overhead's replays allocate nothing new)
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        loss, accuracy, grad_norm = train_step(micro_batches[step - 1])
        sync()
        if step > start_step + warmup_steps:
            step_times.append(time.perf_counter() - t0)
        records.append((loss, accuracy, grad_norm))
        scalars = {"train/loss": loss, "train/lr": schedulers[0].get_last_lr()[0], "train/grad_norm": grad_norm,
                   "train/tokens_per_s": tokens_per_step / step_times[-1] if step_times else None}
        if batches["eval"] is not None and (step % (args.eval_steps or args.steps) == 0 or step == args.steps):
            eval_loss, eval_accuracy = evaluate(model_with_loss, batches["eval"], world_size)
            evals.append({"step": step, "loss": eval_loss, "token_accuracy": eval_accuracy})
            scalars.update({"eval/loss": eval_loss, "eval/token_accuracy": eval_accuracy})
        scalars = {name: float(value) for name, value in scalars.items() if value is not None}
        progress.set_postfix({name.replace("train/", ""): f"{value:.4g}" for name, value in scalars.items()})
        for name, value in scalars.items() if writer else ():
            writer.add_scalar(name, value, step)
        if pending is not None and (write_done(pending, world_size) or step % args.save_steps == 0):
            saved.append(finish_checkpoint(args, pending, rank, world_size))
            pending = None
        if args.save_steps and stager is None:
            stager, staging_s = prepare_checkpoint_staging(model_with_loss.model, optimizers)
            if rank == 0:
                print(f"checkpoint staging: {stager.kind} host memory, ready in {staging_s:.1f} s")
        if args.save_steps and step % args.save_steps == 0:
            pending = save_checkpoint(args, step, model_with_loss.model, optimizers, schedulers, rank, world_size,
                                      stager)
    progress.close()
    if pending is not None:
        saved.append(finish_checkpoint(args, pending, rank, world_size))
    if stager is not None:
        stager.close()
    if writer:
        writer.close()

    # per figure, its value at every step (None where the step gives none, e.g. the norm without clipping)
    losses, accuracies, grad_norms = [None if column[0] is None else torch.stack(column).tolist()
                                      for column in zip(*records)]
    tokens_per_s = tokens_per_step * len(step_times) / sum(step_times) if step_times else None
    avg_step_ms = 1e3 * sum(step_times) / len(step_times) if step_times else None
    peak_gib = [torch.cuda.max_memory_allocated() / 2**30 if HAS_CUDA else None] * world_size
    if args.fsdp:  # each rank holds its own shards, activations and optimizer state: report every rank's peak
        dist.all_gather_object(peak_gib, peak_gib[rank])
    print(f"---- summary: {variant} {args.model} {args.batch_size}x{args.seq_len} {args.optimizer} ----")
    print(f"steps           : {start_step + 1}..{args.steps}, {len(step_times)} timed after {warmup_steps} warm-up")
    print("tokens/s        : " + (f"{tokens_per_s:,.0f} ({avg_step_ms:.1f} ms/step)" if tokens_per_s
                                   else "n/a (no timed step)") + (f" over {world_size} ranks" if args.fsdp else ""))
    print("peak GPU memory : " + (", ".join(f"{gib:.2f} GiB" for gib in peak_gib) if HAS_CUDA else "n/a (CPU)"))
    print(f"loss            : {losses[0]:.4f} (step {start_step + 1}) -> {losses[-1]:.4f} (step {args.steps})"
          + (f" | held-out {evals[-1]['loss']:.4f}" if evals else ""))
    for checkpoint in saved[-1:]:
        print(f"checkpoint      : {checkpoint['bytes'] / 2**30:.2f} GiB, training held {checkpoint['stage_s']:.1f} s "
              f"while it was copied to {checkpoint['staging']} host memory, written in {checkpoint['write_s']:.1f} s "
              f"(step {checkpoint['step']}, {len(saved)} written)")
    return {"shape": f"{args.batch_size}x{args.seq_len}", "tokens_per_step": tokens_per_step, "steps": args.steps,
            "start_step": start_step, "warmup_steps": warmup_steps, "tokens_per_s": tokens_per_s,
            "avg_step_ms": avg_step_ms, "peak_memory_gib": peak_gib[0], "peak_memory_gib_per_rank": peak_gib,
            "losses": losses, "token_accuracies": accuracies, "grad_norms": grad_norms,
            "step_ms": [1e3 * s for s in step_times], "evals": evals, "checkpoints": saved,
            "checkpoint_staging": None if stager is None else {"staging": stager.kind, "ready_s": staging_s}}

# ----------------------------------------------------------------------------------------------------------------------

def main(argv=None):
    """The script. With --memory-plan auto, a step that runs out of memory hands its plan back here: everything it
    held is freed, and the run starts over (model included: a step cut off in the backward may have updated part of
    it) with the next plan, saying so in one line. A run that still does not fit ends with one line that says what
    to change, not with a traceback through transformers. --seq-len-search: one fresh run per length, each planned
    for its length."""
    args = parse_args(argv)
    if args.plot:
        return plot_memory(args.plot, args.out)
    searched = args.seq_len_search if args.seq_len_search and args.memory_plan == "auto" else [None]
    rows, result = [], None
    for seq_len in searched:
        if rows and rows[-1]["status"] != "trained":
            rows.append({"seq_len": seq_len, "status": "not tried"})
            print(f"seq_len {seq_len:>7}: not tried")
            continue
        one = args if seq_len is None else argparse.Namespace(**{**vars(args), "seq_len_search": [seq_len],
                                                                 "seq_len": seq_len})  # the length the plan fits
        try:
            result = fine_tune_with_fallback(one, write=seq_len is None)
        except NoPlanFits as no_plan:
            if seq_len is None or result is None:  # a run, or the search's first length: nothing else to report
                raise
            rows.append({"seq_len": seq_len, "status": "no plan fits", "reason": str(no_plan)})
            print(f"seq_len {seq_len:>7}: {no_plan}")
            continue
        rows += result["seq_len_search"]["results"] if seq_len is not None else []
        gc.collect()  # the length's model, optimizer state and pinned buffers, before the next length's
    if rows:  # the per-length runs as one search: the first run's header, every length's row
        result["options"]["seq_len_search"] = args.seq_len_search
        result["seq_len_search"] = {"lengths": args.seq_len_search, "results": rows,
                                    "longest_trained": max((r["seq_len"] for r in rows if r["status"] == "trained"),
                                                           default=None)}
        print(f"longest batch-1 sequence that trained: {result['seq_len_search']['longest_trained']}")
        write_results(result, Path(args.out) if args.out else default_out_path(
            args, result["weights"], result["dtype"], result["variant"], 1), 0)


def fine_tune_with_fallback(args, write=True):
    tried = []  # plans that ran out of memory
    while True:
        failed = None
        try:
            return fine_tune(args, tried, write)
        except torch.OutOfMemoryError as err:
            failed, torch_says = getattr(err, "memory_plan", None), str(err).split(" Including")[0]
            if failed is None:  # --memory-plan manual: the flags are the user's to change
                raise SystemExit(f"error: out of memory on the GPU ({torch_says}). Shorter sequences or batches "
                                 f"(--seq-len, --batch-size), --memory-plan auto, or --seq-len-search to find the "
                                 f"longest that fits") from None
        # outside the except block: the traceback, and with it every tensor of the failed step, is gone
        gc.collect()
        torch.cuda.empty_cache()
        tried.append(failed)
        print(f"out of memory with the plan {failed.describe()} (estimated {failed.estimated_peak_bytes / 2**30:.1f} "
              f"GiB; {torch_says}): starting over with the next plan")


def fine_tune(args, tried=(), write=True):
    rank, world_size, device = init_distributed(args)
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if HAS_CUDA else torch.float32)
    info = run_info()
    torch.manual_seed(args.seed)  # the same on every rank: identical random weights before FSDP shards them
    model, weights = load_model(args, device, dtype)
    model.config.use_cache = False  # training: no KV cache
    model.train()
    config = model.config
    lora_model = apply_lora(args, model)  # the PeftModel around model, or None

    # --- what this script changes about the model: the fused kernels (counts checked: a no-op swap is an error) ------
    replaced, variant, loss_impl = patch_kernels(args, model), kernel_variant(args), args.loss
    if args.fp8:  # torchao's float8 Linear in every decoder layer; the lm_head's matmul stays in the fused loss
        replaced["float8_linear"] = convert_decoder_linears(model, args.fp8, keep_bf16=args.fp8_keep_bf16)
        info["torchao"] = torchao_version()
    model_with_loss = ModelWithLoss(model, loss_impl, args.lce_chunk_size)
    # --- memory: the fastest plan that fits (--memory-plan auto) or the flags as given, and its levers ---------------
    plan = plan_memory(args, model, model_with_loss, device, tried)
    offloader = apply_levers(model, plan)
    if offloader is not None:
        offloader.reserve(args.batch_size, args.seq_len, dtype)
    use_cuda_graph = prepare_compiled_step(args, model)

    if args.fsdp:
        # FSDP2: each decoder layer is one unit that all-gathers its parameters just before its forward (and again for
        # its backward), frees them after, and reduce-scatters its gradients; the root unit holds the rest.
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model_with_loss)
    step_module = (torch.compile(model_with_loss, backend=COMPILE_BACKEND, mode=args.compile_mode) if args.compile
                   else model_with_loss)
    # After fully_shard: the optimizer holds the sharded parameters (each rank updates its own shard).
    optimizers, clip_in_backward = make_optimizers(args, model, plan, capturable=use_cuda_graph)
    schedulers = [get_scheduler(LR_SCHEDULERS[args.lr_scheduler], optimizer, args.warmup_steps, args.steps)
                  for optimizer in optimizers]
    phase = {"now": "idle"}  # the part of the step that is running: names what ran out of memory

    def train_step(micro_batches):
        """One optimizer step over micro_batches ([grad_accum_steps, batch, seq_len] token ids); returns the loss, the
        token accuracy and the gradient norm (None without clipping), as device tensors: no host sync."""
        if offloader is not None:
            offloader.new_step()
        step_loss, step_accuracy = 0.0, 0.0
        for input_ids in micro_batches:
            phase["now"] = "forward"
            loss, accuracy = step_module(input_ids, shift_labels_of(input_ids))
            phase["now"] = "backward" + " (with the optimizer steps inside)" * plan.optimizer_in_backward
            (loss / len(micro_batches)).backward()
            step_loss = step_loss + loss.detach() / len(micro_batches)
            step_accuracy = step_accuracy + accuracy / len(micro_batches)
        phase["now"] = "optimizer step"
        grad_norm = clip_gradients(args, model, optimizers, clip_in_backward)
        for optimizer, scheduler in zip(optimizers, schedulers):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        phase["now"] = "idle"
        if args.fsdp:  # the global batch's figures: the mean over ranks (a collective, not a host sync)
            for value in (step_loss, step_accuracy):
                dist.all_reduce(value.div_(world_size))  # sum of value / world_size (gloo has no AVG)
            if grad_norm is not None:  # clip_grad_norm_ of sharded gradients: a DTensor, the same on every rank
                grad_norm = grad_norm.full_tensor()
        return step_loss, step_accuracy, grad_norm

    print(f"device: {info['device']} | torch {info['torch']} | triton {info['triton']} | "
          f"transformers {info['transformers']} | commit {info['git_commit']}{'+dirty' if info['git_dirty'] else ''}")
    print(f"model: {args.model} ({weights} weights), {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}, {str(dtype).replace('torch.', '')}, attn {args.attn_implementation}")
    if lora_model is not None:
        lora = lora_report(args, model)
        print(f"LoRA: rank {args.lora}, alpha {lora['alpha']:g}, dropout {args.lora_dropout:g} on {lora['targets']}"
              f"{', base in NF4' if args.qlora else ''}: {lora['trainable_params']:,} of {lora['total_params']:,} "
              f"parameters train")
    print(f"{Path(__file__).name}: variant {variant}, optimizer {args.optimizer}, lr {args.lr} ({args.lr_scheduler}), "
          f"data {args.data}" + (f", replaced {replaced}" * bool(replaced))
          + (f", FSDP2 over {world_size} ranks (batch {args.batch_size} per rank)" if args.fsdp else ""))
    print(f"memory plan ({args.memory_plan}): {plan.reason}")
    if args.compile or args.fp8:
        print(f"torch.compile: backend {COMPILE_BACKEND}, mode {args.compile_mode}"
              + (", each decoder layer (--fp8)" if not args.compile else "")
              + ("" if HAS_CUDA else " (no CUDA device: aot_eager traces the graphs, generates no code)"))
    result = {**info, "script": Path(__file__).name, "model": args.model, "weights": weights,
              "dtype": str(dtype).replace("torch.", ""), "variant": variant, "loss_impl": loss_impl,
              "replaced": replaced, "world_size": world_size, "options": vars(args),
              "lora": lora_report(args, model),
              "compile_backend": COMPILE_BACKEND if args.compile or args.fp8 else None,
              "memory_plan": plan_record(plan), "cuda_graph": use_cuda_graph}
    out_path = Path(args.out) if args.out else default_out_path(args, weights, result["dtype"], variant, world_size)
    try:
        if args.seq_len_search:
            result.update(seq_len_search(args, train_step, phase, config.vocab_size, device))
            row = result["seq_len_search"]["results"][-1]
            row["memory_plan"] = plan_record(plan)
            offload = offloader.report() if offloader is not None else None
            if row["status"] == "trained" and (held := host_bytes_held(offload, optimizers)):
                row["host_gib"] = held / 2**30
            if row["status"] == "out of memory" and args.memory_plan == "auto":  # main tries the next plan
                raise torch.OutOfMemoryError(f"in the {row['phase']}, at a peak of {row['peak_gib']:.1f} GiB")
        else:
            tokenizer, batches = load_data(args, config, device, rank, world_size)
            start_step = resume(args, model, optimizers, schedulers, world_size) if args.resume else 0
            step_function = capture_step(train_step) if use_cuda_graph else train_step
            result.update(train(args, step_function, model_with_loss, optimizers, schedulers, batches, start_step,
                                variant, rank, world_size))
            result["offload"] = offloader.report() if offloader is not None else None
            result["host_gib"] = host_bytes_held(result["offload"], optimizers) / 2**30
            if result["offload"]:
                print(f"offload         : {result['offload']['host_bytes'] / 2**30:.2f} GiB of layer inputs on the "
                      f"host ({result['offload']['layers']} layers)")
            if use_cuda_graph:
                print("cuda graph      : the whole step replayed as one CUDA graph")
            if args.output_dir:
                result["final_model"] = save_final(args, model, lora_model, tokenizer, rank)
    except torch.OutOfMemoryError as err:
        err.memory_plan = plan if args.memory_plan == "auto" else None  # main starts over with the next plan
        raise
    if write:
        write_results(result, out_path, rank)
    if args.fsdp:
        end_distributed_run()
    return result



# ======================================================================================================================
# What is ours, in the order fine_tune uses it: the kernels, the memory plan, the levers, the CUDA graph, the plot.

# ----------------------------------------------------------------------------------------------------------------------
# The fused kernels

def patch_kernels(args, model):
    """Swaps in the fused kernels --rmsnorm/--swiglu/--rope ask for; returns {kernel: modules replaced}. Each kernel
    module's entry point knows the supported families' layouts and checks the counts (65 RMSNorms for Llama-3.1-8B:
    two per decoder layer plus the final norm; one MLP and one attention per layer); a model of another family ends
    the run with one line naming the supported ones."""
    replaced = {}
    try:
        if args.rmsnorm:
            replaced["rmsnorm"] = apply_rmsnorm(model)
        if args.swiglu:
            replaced["swiglu_mlp"] = apply_glu_mlp(model)
        if args.rope:
            replaced["rope_attention"] = apply_rope(model)  # process-wide: the family's attention looks it up per call
    except ValueError as err:
        raise SystemExit(f"error: {err} (--no-rmsnorm/--no-swiglu/--no-rope leave a kernel out)") from None
    return replaced


def kernel_variant(args):
    """The run's name in reports: its loss and the kernels it uses, e.g. rmsnorm+linear_ce+swiglu+rope."""
    kernels = [name for name in ("rmsnorm", "swiglu", "rope") if getattr(args, name)]
    fp8 = [f"fp8-{args.fp8}" + "".join(f"-{name}-bf16" for name in args.fp8_keep_bf16)] if args.fp8 else []
    return "+".join(kernels[:1] + [args.loss] + kernels[1:] + fp8 + (["compile"] if args.compile else []))


# ----------------------------------------------------------------------------------------------------------------------
# The memory plan: which levers this run uses

def check_memory_flags(parser, args):
    """The memory flags' own rules (parse_args calls this): contradictions are one usage error."""
    for name in ("checkpoint_layers", "tiled_mlp", "memory_budget_gib"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.offload_activations is not None and args.offload_activations < 0:
        parser.error(f"--offload-activations takes a number of layers >= 0, got {args.offload_activations}")
    manual = args.memory_plan == "manual"
    if (args.offload_activations or args.checkpoint_layers) and args.activation_checkpointing == "none" or (
            manual and (args.offload_activations or args.checkpoint_layers) and not args.activation_checkpointing):
        parser.error("--offload-activations and --checkpoint-layers act on checkpointed layers: they need "
                     "--activation-checkpointing full or selective")
    if None not in (args.checkpoint_layers, args.offload_activations) and \
            args.offload_activations > args.checkpoint_layers:
        parser.error("--offload-activations cannot exceed --checkpoint-layers: only checkpointed layers are offloaded")
    if args.offload_optimizer and args.optimizer_in_backward is False:
        parser.error("--offload-optimizer streams AdamW's state through the GPU in the backward: it cannot be "
                     "combined with --no-optimizer-in-backward")
    in_backward = args.optimizer_in_backward or args.offload_optimizer
    if in_backward and args.grad_accum_steps > 1:
        parser.error("--optimizer-in-backward steps each parameter as soon as its gradient exists, so gradients "
                     "cannot be accumulated over micro-batches: use --grad-accum-steps 1")
    if in_backward and args.fsdp:
        parser.error("--optimizer-in-backward cannot be combined with --fsdp (FSDP2 reduces gradients after the "
                     "backward)")
    if args.cuda_graph:
        # A graph replays one fixed sequence of kernels on fixed buffers: one shape, no host work between kernels, and
        # a learning rate baked into the captured optimizer step.
        clashes = {"--compile": args.compile, "--fsdp": args.fsdp, "--seq-len-search": args.seq_len_search,
                   "--optimizer-in-backward": in_backward, "--resume": args.resume,
                   "--activation-checkpointing": args.activation_checkpointing not in (None, "none"),
                   "--lr-scheduler other than constant, or --warmup-steps": args.lr_scheduler != "constant"
                   or args.warmup_steps}
        clash = next((flag for flag, used in clashes.items() if used), None)
        if clash:
            parser.error(f"--cuda-graph captures one plain step of one shape: it cannot be combined with {clash}")


def given_levers(args, n_layers, every_lever):
    """The levers set by hand, named as the plan names them. every_lever: each lever is given, an unset one off (what
    --memory-plan manual, --cuda-graph, whose captured step takes no lever, and a run with no GPU to plan for take)."""
    if every_lever:
        mode = args.activation_checkpointing or "none"
        return {"activation_checkpointing": mode,
                "checkpoint_layers": 0 if mode == "none" else args.checkpoint_layers or n_layers,
                "offload_layers": args.offload_activations or 0, "tiled_mlp": args.tiled_mlp,
                "optimizer_in_backward": bool(args.optimizer_in_backward or args.offload_optimizer),
                "offload_optimizer": bool(args.offload_optimizer)}
    given = {"activation_checkpointing": args.activation_checkpointing,
             "checkpoint_layers": 0 if args.activation_checkpointing == "none" else args.checkpoint_layers,
             "offload_layers": args.offload_activations, "tiled_mlp": args.tiled_mlp,
             "optimizer_in_backward": True if args.offload_optimizer else args.optimizer_in_backward,
             "offload_optimizer": args.offload_optimizer}
    if args.fsdp or args.grad_accum_steps > 1:  # FSDP2 and accumulation need whole-model gradients after the backward
        given.update(optimizer_in_backward=False, offload_optimizer=False)
    return {name: value for name, value in given.items() if value is not None}


def host_memory_bytes():
    """The host memory pinned offloads may take: 90 % of what the kernel reports available (Linux' MemAvailable); the
    rest is the process's own and the system's. The offloads pin exactly what the plan counts (pinned_empty)."""
    return int(0.9 * host_memory_available())


class NoPlanFits(SystemExit):
    """No plan fits the budget: one error line for a run, a row of its own in a search."""


def plan_memory(args, model, model_with_loss, device, tried=()):
    """The levers of this run. --memory-plan manual: the flags. auto: the cheapest plan (plan_cost) whose estimated
    peak fits the GPU's memory (or --memory-budget-gib), with the levers given by hand kept; a plan that ran out of
    memory (tried) rules out every plan estimated at as much or more. The estimate's per-token bytes come from two
    probe forwards at short lengths on the GPU; without a GPU they are counted from the config, and there is no GPU
    memory to plan for unless --memory-budget-gib names some: the levers given by hand are the plan."""
    n_layers, tokens = model.config.num_hidden_layers, args.batch_size * args.seq_len
    for flag, value in (("offload-activations", args.offload_activations),
                        ("checkpoint-layers", args.checkpoint_layers)):
        if value is not None and value > n_layers:
            raise SystemExit(f"error: --{flag} {value}: the model has {n_layers} decoder layers")
    nothing_to_plan_for = not HAS_CUDA and args.memory_budget_gib is None
    as_given = args.memory_plan == "manual" or args.cuda_graph or nothing_to_plan_for
    given = given_levers(args, n_layers, every_lever=as_given)
    model_bytes = measure_model_bytes(args, model, model_with_loss, device)
    if as_given:
        plan = MemoryPlan(**{**dataclasses.asdict(MemoryPlan()), **given})
        plan.estimated_peak_bytes, plan.estimated_parts = estimate_peak_bytes(plan, model_bytes, args.batch_size,
                                                                              args.seq_len)
        plan.reason = f"{plan.describe()} (as given; estimated peak {plan.estimated_peak_bytes / 2**30:.1f} GiB)"
        if nothing_to_plan_for and args.memory_plan == "auto":
            plan.reason = (f"{plan.describe()}: without a GPU there is no GPU memory to plan for, so only the levers "
                           f"given by hand (--memory-budget-gib plans for a GPU)")
        return plan
    if args.memory_budget_gib is not None:
        budget, where = int(args.memory_budget_gib * 2**30), "--memory-budget-gib"
    else:
        free, _ = torch.cuda.mem_get_info(device)
        # What the caching allocator holds (the weights, and the probe's freed blocks it keeps cached) is this
        # process's to use, on top of what the driver reports free; keep 3 % + 1 GiB for the CUDA context's growth,
        # cuBLAS workspaces and the allocator's rounding.
        budget, where = int(0.97 * (free + torch.cuda.memory_reserved(device))) - 2**30, "this GPU"
    host = host_memory_bytes()
    if args.save_steps:  # a checkpoint of the weights and the optimizer state is staged in host memory too
        host = max(0, host - model_bytes.param_bytes - model_bytes.optimizer_state_bytes)
    fitting = fitting_plans(budget, model_bytes, args.batch_size, args.seq_len, given, host)
    if tried:
        fitting = [plan for plan in fitting
                   if plan.estimated_peak_bytes < min(failed.estimated_peak_bytes for failed in tried)]
    if not fitting:
        _, leanest = choose_plan(0, model_bytes, args.batch_size, args.seq_len, given, host)
        raise NoPlanFits(f"error: no memory plan fits {tokens} tokens per step in {budget / 2**30:.1f} GiB of "
                         f"{where}" + (f" after {len(tried)} ran out of memory" if tried else "")
                         + f": the leanest ({leanest.describe()}) needs about "
                         f"{leanest.estimated_peak_bytes / 2**30:.1f} GiB ({format_parts(leanest.estimated_parts)}) "
                         f"and {leanest.estimated_host_bytes / 2**30:.1f} GiB of host memory ({host / 2**30:.1f} GiB "
                         f"usable). Shorter sequences or a larger GPU")
    plan = fitting[0]
    plan.reason = (f"{plan.describe()}: the fastest of {len(fitting)} plans that fit {budget / 2**30:.1f} GiB of "
                   f"{where} (estimated peak {plan.estimated_peak_bytes / 2**30:.1f} GiB: "
                   f"{format_parts(plan.estimated_parts)}; +{plan.cost:.0%} step time)")
    return plan


def measure_model_bytes(args, model, model_with_loss, device):
    """ModelBytes for the estimate: counts from the config, and what a decoder layer keeps per token from two probe
    forwards (grad mode on, no lever) at 1024 and 2048 tokens on the GPU, after an unmeasured one: the difference of
    their peaks over the difference of their tokens is the per-token part alone, free of what the forward holds
    whatever the length (the fused linear cross-entropy's lm_head gradient, its chunk of logits). Without a GPU the
    per-token part is counted from the config: a LLaMA layer keeps about 8 hidden-sized and 3 intermediate-sized
    tensors per token (its norms' inputs, q, k, v, attention's output, o_proj's input, the MLP's gate, up and their
    product)."""
    config = model.config
    itemsize = next(model.parameters()).element_size()
    if HAS_CUDA and args.memory_plan == "auto" and not args.cuda_graph:
        peaks = {}
        # The first forward is not measured (the second 1024 overwrites it): one-time allocations, such as cuBLAS's
        # workspace (32 MiB on Hopper) made at the first matmul, would land in the first probe's peak and not in the
        # second's, and take 32 MiB / 1024 off the per-token figure (for a tiny model, more than it keeps).
        for tokens in (1024, 1024, 2048):
            probe = torch.randint(0, config.vocab_size, (1, tokens), device=device)
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            loss, _ = model_with_loss(probe, shift_labels_of(probe))
            peaks[tokens] = torch.cuda.max_memory_allocated(device) - before
            del loss  # frees the probe's graph and activations
        per_token = (peaks[2048] - peaks[1024]) / 1024
        fixed = max(0, int(peaks[2048] - 2048 * per_token))
        return probe_model_bytes(config, before + peaks[2048], before, 2048, param_itemsize=itemsize,
                                 optimizer_state_itemsize=itemsize, loss_fixed_bytes=fixed)
    per_token = config.num_hidden_layers * (8 * config.hidden_size + 3 * config.intermediate_size) * itemsize
    return probe_model_bytes(config, per_token + 2 * config.hidden_size * itemsize + 4, 0, 1,
                             param_itemsize=itemsize, optimizer_state_itemsize=itemsize)


def plan_record(plan):
    """The plan as the results JSON keeps it: its levers (what --memory-plan manual needs to repeat the run: the flags
    of the same names), the estimate and the reason."""
    return {**plan.levers(), "estimated_peak_gib": plan.estimated_peak_bytes / 2**30,
            "estimated_parts_gib": {name: value / 2**30 for name, value in plan.estimated_parts.items()},
            "estimated_host_gib": plan.estimated_host_bytes / 2**30, "estimated_cost": plan.cost,
            "reason": plan.reason}


def apply_levers(model, plan):
    """Puts the plan's activation levers on the model; returns the ActivationOffloader, or None. (The optimizer's
    levers are make_optimizers'.)"""
    if plan.tiled_mlp:
        tile_mlps(model, plan.tiled_mlp)  # after the MLP swap: it tiles whatever forward the MLP now has
    if plan.activation_checkpointing == "none":
        return None
    return enable_activation_checkpointing(model, plan.activation_checkpointing, plan.offload_layers,
                                           plan.checkpoint_layers)


def make_optimizers(args, model, plan, capturable=False):
    """(optimizers, ClipInBackward or None): one fused/foreach AdamW over every parameter, or with the optimizer in
    the backward one AdamW per parameter stepped by a hook (its state on the host with offload_optimizer)."""
    adamw = dict(lr=args.lr, foreach=args.optimizer == "adamw_foreach", fused=args.optimizer == "adamw_fused")
    if not plan.optimizer_in_backward:
        optimizer = torch.optim.AdamW(trainable_parameters(model), capturable=capturable, **adamw)
        # clip_in_fused_step hands each step its clipping factor as grad_scale: dropped once the step has read it, so
        # no step's factor stays allocated through the next step's peak
        optimizer.register_step_post_hook(lambda optimizer, *_: setattr(optimizer, "grad_scale", None))
        return [optimizer], None
    # the clipping hooks come first: a parameter's hooks run in the order they were registered
    clip = ClipInBackward(model, args.max_grad_norm) if args.max_grad_norm else None
    if plan.offload_optimizer:
        return [OffloadedAdamW(trainable_parameters(model), in_backward=True, **adamw)], clip
    return list(optimizer_in_backward(model, lambda params: torch.optim.AdamW(params, **adamw)).values()), clip


def clip_in_fused_step(model, optimizers, max_norm):
    """Gradient clipping folded into the fused AdamW step; returns the gradients' global norm (a device tensor).
    torch's clip_grad_norm_ reads every gradient for the norm, then multiplies every gradient in place: another read
    and write of all of them (16 GB each way for 8B in bf16, about 3.5 % of a 1x4096 step on an H100). The fused
    AdamW kernel divides each gradient by the optimizer's `grad_scale` as it reads it (the hook AMP's GradScaler
    unscales through), so grad_scale = max(1, norm / max_norm) clips with the norm's read alone: the same update as
    clip_grad_norm_'s up to fp32 rounding."""
    norm = torch.nn.utils.get_total_norm([param.grad for param in model.parameters() if param.grad is not None])
    for optimizer in optimizers:
        optimizer.grad_scale = (norm.float() / max_norm).clamp(min=1.0)
    return norm


class ClipInBackward:
    """Gradient clipping for the optimizer in the backward. The global gradient norm is known only after the last
    gradient, too late for the parameters stepped already; so each parameter's gradient is scaled by the clipping
    factor of the PREVIOUS step (max_norm / its global norm, at most 1; none on the first step) just before it
    steps, and this step's norm is summed on the way for the next. Adam's update changes little under a gradient
    scale that changes slowly, so this tracks the plain clipped step closely, but not bit for bit when clipping
    acts. Device tensors throughout: no host sync."""

    def __init__(self, model, max_norm):
        self.max_norm, self.squared_norm, self.factor = max_norm, None, None
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self.clip)

    def clip(self, param):
        squared = param.grad.detach().float().pow(2).sum()
        self.squared_norm = squared if self.squared_norm is None else self.squared_norm + squared
        if self.factor is not None:
            param.grad.mul_(self.factor.to(param.grad.dtype))

    def end_step(self):
        """This step's global gradient norm (before clipping), which sets the next step's factor."""
        norm, self.squared_norm = self.squared_norm.sqrt(), None
        self.factor = (self.max_norm / (norm + 1e-6)).clamp(max=1.0)  # the factor torch's clip_grad_norm_ uses
        return norm


def clip_gradients(args, model, optimizers, clip_in_backward):
    """The step's gradient norm (None without --max-grad-norm), clipped the cheapest way the step allows: with the
    optimizer in the backward by the previous step's norm (ClipInBackward), else inside the fused AdamW step, else
    (foreach AdamW, FSDP2's sharded gradients) by torch's clip_grad_norm_."""
    if clip_in_backward is not None:  # the parameters have stepped already, clipped by the previous step's norm
        return clip_in_backward.end_step()
    if args.max_grad_norm and args.optimizer == "adamw_fused" and not args.fsdp:
        return clip_in_fused_step(model, optimizers, args.max_grad_norm)
    return torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm) if args.max_grad_norm else None


# ----------------------------------------------------------------------------------------------------------------------
# What the estimate needs to know about the model

# The hardware rates of the cost model (an H100 SXM): the bf16 matmul rate a training step reaches (the 1x262144 step
# of Llama-3.1-8B, 6.6e16 FLOP in 183 s, runs at ~360 TFLOP/s) and the pinned host<->GPU copy rate over PCIe 5.0 x16
# (~50 GB/s a direction in theory, about half of it measured with other traffic on the bus).
MATMUL_FLOPS_PER_S = 400e12
PCIE_BYTES_PER_S = 25e9
# Share of the activation copies' PCIe time that shows in the step time: they run on a side stream, overlapped with
# the compute of the layers around them (one layer's input at 131072 tokens: ~40 ms of copy against ~2 s of compute).
OFFLOAD_EXPOSED_FRACTION = 0.1
# Launching one MLP tile's forward and backward kernels (~30 launches) plus its recompute's Python: per tile per layer.
TILE_OVERHEAD_S = 1e-3
# The optimizer in the backward runs one small AdamW per parameter instead of one multi-tensor kernel: almost free, but
# not quite, so a plan that does not need it does not take it.
OPTIMIZER_IN_BACKWARD_COST = 1e-3
# The MLP tile sizes (tokens per sequence) a plan may choose; smaller tiles hold less and launch more.
TILE_TOKENS_CHOICES = (16384, 4096, 1024)
CHECKPOINT_MODES = ("none", "selective", "full")
LEVERS = ("activation_checkpointing", "checkpoint_layers", "offload_layers", "tiled_mlp", "optimizer_in_backward",
          "offload_optimizer")


@dataclasses.dataclass(frozen=True)
class ModelBytes:
    """What a step's peak depends on. Counts and bytes come from the config; the per-token activation bytes of a
    decoder layer that keeps everything come from one probe step (probe_model_bytes)."""
    n_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    param_count: int
    layer_param_count: int  # one decoder layer's parameters (attention, MLP, its two norms)
    largest_param_count: int  # the largest parameter tensor (embedding or lm_head): when parameters are stepped one
    # at a time, the most gradient or moment bytes the GPU holds at once
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    activation_itemsize: int  # bytes per element of the activations (2 for bf16)
    layer_bytes_per_token: float  # kept for the backward by one decoder layer without checkpointing (probed)
    loss_bytes_per_token: float  # kept by the final norm and the loss (from the config)
    loss_fixed_bytes: int  # the loss's transient that does not grow with tokens (the linear CE's chunk of logits)
    recompute_bytes_per_token: float  # transient of one checkpointed layer's backward: its rebuilt activations and
    # the gradients in flight

    @property
    def input_bytes_per_token(self):
        """What a checkpointed layer keeps: its input hidden states."""
        return self.hidden_size * self.activation_itemsize

    @property
    def attention_bytes_per_token(self):
        """What selective checkpointing keeps besides the input: attention's output and its fp32 log-sum-exp."""
        return self.hidden_size * self.activation_itemsize + 4 * self.num_attention_heads

    @property
    def mlp_bytes_per_token(self):
        """What an MLP keeps for its backward: gate and up projections and their product (down_proj's input)."""
        return 3 * self.intermediate_size * self.activation_itemsize

    def grad_bytes_of(self, n_params):
        return n_params * self.grad_bytes / self.param_count

    def state_bytes_of(self, n_params):
        return n_params * self.optimizer_state_bytes / self.param_count


def llama_param_counts(config):
    """(total, one decoder layer, largest tensor) parameter counts of a LLaMA-shaped decoder (no biases), exactly from
    the config: q/o projections h x h, k/v h x kv_heads*head_dim, a gated MLP of three h x I matrices, two norms per
    layer, the final norm, the embedding, and lm_head unless tied to the embedding."""
    h, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv_width = config.num_key_value_heads * head_dim
    layer = h * heads * head_dim * 2 + h * kv_width * 2 + 3 * h * config.intermediate_size + 2 * h
    embedding = config.vocab_size * h
    head = 0 if config.tie_word_embeddings else embedding
    return config.num_hidden_layers * layer + embedding + head + h, layer, embedding


def probe_model_bytes(config, forward_peak_bytes, allocated_before_bytes, probe_tokens, *, param_itemsize,
                      optimizer_state_itemsize, optimizer_moments=2, activation_itemsize=None, loss_fixed_bytes=0,
                      loss_bytes_per_token=None, backward_extra_bytes_per_token=None):
    """ModelBytes from one probe step without levers, after the optimizer state exists (a warm-up step).

    forward_peak_bytes: torch.cuda.max_memory_allocated() right after the forward and the loss of the probe step
    (reset_peak_memory_stats() just before it); allocated_before_bytes: memory_allocated() at that reset (weights and
    optimizer state; the gradients were freed by zero_grad(set_to_none=True)). The forward's peak, not the step's:
    the step's peak mixes in gradients and, at short probes, is set by the optimizer step, not by activations.

    What the config gives exactly is computed, not probed: parameter, gradient and optimizer-state bytes; what a
    checkpointed layer keeps (its input, hidden * itemsize per token); what selective checkpointing adds (attention's
    output and its fp32 log-sum-exp, 4 bytes per head); the loss's part, by default the final RMSNorm's input (hidden *
    itemsize) and fp32 rstd (4) plus the hidden states' gradient the fused linear cross-entropy computes in the forward
    (hidden * itemsize). The probe then gives the one number the config cannot: per token, what a decoder layer keeps
    without checkpointing, (forward peak - before - loss_fixed_bytes) / tokens - loss part, over the layers.

    The recompute transient of a checkpointed layer is its activations rebuilt in the backward plus the gradients in
    flight: the gradient arriving at its output and the one it returns for its input (2 * hidden * itemsize per token
    by default; the backward frees the rebuilt activations as it consumes them)."""
    if probe_tokens <= 0 or forward_peak_bytes <= allocated_before_bytes:
        raise ValueError(f"probe_model_bytes: a probe of {probe_tokens} tokens must raise the peak above the "
                         f"{allocated_before_bytes} bytes allocated before it (got {forward_peak_bytes})")
    activation_itemsize = activation_itemsize or param_itemsize
    h = config.hidden_size
    if loss_bytes_per_token is None:
        loss_bytes_per_token = 2 * h * activation_itemsize + 4
    if backward_extra_bytes_per_token is None:
        backward_extra_bytes_per_token = 2 * h * activation_itemsize
    forward_bytes_per_token = (forward_peak_bytes - allocated_before_bytes - loss_fixed_bytes) / probe_tokens
    layer_bytes_per_token = (forward_bytes_per_token - loss_bytes_per_token) / config.num_hidden_layers
    if layer_bytes_per_token <= h * activation_itemsize:
        raise ValueError(f"probe_model_bytes: {layer_bytes_per_token:.0f} bytes per token per layer is less than one "
                         f"layer's input: was the probe step run without checkpointing, with the peak reset?")
    param_count, layer_param_count, largest_param_count = llama_param_counts(config)
    return ModelBytes(
        n_layers=config.num_hidden_layers, hidden_size=h, intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads, vocab_size=config.vocab_size, param_count=param_count,
        layer_param_count=layer_param_count, largest_param_count=largest_param_count,
        param_bytes=param_count * param_itemsize, grad_bytes=param_count * param_itemsize,
        optimizer_state_bytes=optimizer_moments * param_count * optimizer_state_itemsize,
        activation_itemsize=activation_itemsize, layer_bytes_per_token=layer_bytes_per_token,
        loss_bytes_per_token=loss_bytes_per_token, loss_fixed_bytes=loss_fixed_bytes,
        recompute_bytes_per_token=layer_bytes_per_token + backward_extra_bytes_per_token)


# ----------------------------------------------------------------------------------------------------------------------
# The estimate: the step's memory at each of its moments, and the largest of them

@dataclasses.dataclass
class MemoryPlan:
    """The levers of one step and what they are estimated to cost. Checkpointing applies to the first
    checkpoint_layers decoder layers (one mode for all of them, as enable_activation_checkpointing takes it), offload
    to the first offload_layers of those."""
    activation_checkpointing: str = "none"
    checkpoint_layers: int = 0
    offload_layers: int = 0
    tiled_mlp: int | None = None  # tokens per tile, or None
    optimizer_in_backward: bool = False
    offload_optimizer: bool = False
    estimated_peak_bytes: int = 0
    estimated_parts: dict = dataclasses.field(default_factory=dict)  # bytes per part at the peak; they sum to it
    estimated_host_bytes: int = 0  # pinned host memory the offloads hold
    cost: float = 0.0  # estimated extra step time, as a fraction of a step without levers
    reason: str = ""

    def levers(self):
        return {name: getattr(self, name) for name in LEVERS}

    def describe(self):
        parts = []
        if self.activation_checkpointing != "none":
            parts.append(f"{self.activation_checkpointing} checkpointing on {self.checkpoint_layers} layers")
        if self.offload_layers:
            parts.append(f"{self.offload_layers} layer inputs offloaded")
        if self.tiled_mlp:
            parts.append(f"MLP tiles of {self.tiled_mlp}")
        if self.offload_optimizer:
            parts.append("optimizer state offloaded (in backward)")
        elif self.optimizer_in_backward:
            parts.append("optimizer in backward")
        return ", ".join(parts) or "no lever"


def check_levers(levers, n_layers):
    """A ValueError for lever settings that cannot run together (the same rules finetune_optimized.py's flags
    follow)."""
    mode, layers, offload = levers["activation_checkpointing"], levers["checkpoint_layers"], levers["offload_layers"]
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"activation_checkpointing must be one of {CHECKPOINT_MODES}, got {mode!r}")
    if (mode == "none") != (layers == 0) or not 0 <= layers <= n_layers:
        raise ValueError(f"checkpoint_layers {layers}: 1..{n_layers} with checkpointing, 0 without")
    if not 0 <= offload <= layers:
        raise ValueError(f"offload_layers {offload}: only checkpointed layers ({layers}) can be offloaded")
    if levers["tiled_mlp"] is not None and levers["tiled_mlp"] <= 0:
        raise ValueError(f"tiled_mlp takes a positive number of tokens, got {levers['tiled_mlp']}")
    if levers["offload_optimizer"] and not levers["optimizer_in_backward"]:
        raise ValueError("offload_optimizer streams the state through the GPU in the backward: it needs "
                         "optimizer_in_backward")


def estimate_peak_bytes(plan, model_bytes, batch, seq_len):
    """(peak bytes, {part: bytes}) of a steady-state step (the optimizer state already exists) under plan's levers.

    The step is followed through its moments, and the largest wins:
      - the loss: every layer's kept activations, the loss's own, and lm_head's gradient (the fused linear
        cross-entropy computes it in the forward);
      - the backward of each decoder layer, last to first: the activations of the layers below it still kept,
        the gradients so far (those of the layers above it and lm_head's; with the optimizer in the backward only
        the one being stepped, at most the largest tensor's) and the layer's backward transient (a checkpointed
        layer's recompute; an offloaded layer's input back on the GPU with the next one's prefetched; a tile's MLP);
      - the optimizer step (without the optimizer in the backward): all the gradients at once.
    The parts: weights, gradients, optimizer_state, kept_activations, recompute_transient, loss."""
    mb, tokens = model_bytes, batch * seq_len
    levers = plan.levers()
    check_levers(levers, mb.n_layers)
    tiled = plan.tiled_mlp is not None and plan.tiled_mlp < seq_len  # a sequence within one tile runs untiled
    # With MLP tiles an MLP keeps none of its [tokens, intermediate] tensors: one tile's exist, rebuilt for its
    # backward, which holds the MLP input's gradient twice (as tile pieces and concatenated).
    mlp_not_kept = mb.mlp_bytes_per_token if tiled else 0
    tile_bytes = batch * plan.tiled_mlp * mb.mlp_bytes_per_token if tiled else 0
    tile_gradient = 2 * mb.input_bytes_per_token if tiled else 0
    optimizer_gpu = (2 * mb.state_bytes_of(mb.largest_param_count) if plan.offload_optimizer  # current + prefetch
                     else mb.optimizer_state_bytes)
    largest_grad = mb.grad_bytes_of(mb.largest_param_count)

    # Per token, what a layer keeps and its backward's transient, for the three kinds of layers: checkpointed and
    # offloaded (the first offload_layers), checkpointed (up to checkpoint_layers), plain (the rest). The recompute
    # rebuilds what a checkpointed layer did not keep; an offloaded input comes back to the GPU for it while the next
    # offloaded layer's input is prefetched.
    kept_by_checkpoint = mb.input_bytes_per_token + (
        mb.attention_bytes_per_token if plan.activation_checkpointing == "selective" else 0)
    checkpointed = (kept_by_checkpoint,
                    mb.recompute_bytes_per_token - kept_by_checkpoint - mlp_not_kept + tile_gradient)
    offloaded = (checkpointed[0] - mb.input_bytes_per_token, checkpointed[1] + 2 * mb.input_bytes_per_token)
    plain = (mb.layer_bytes_per_token - mlp_not_kept,  # its backward adds only the gradients in flight
             mb.recompute_bytes_per_token - mb.layer_bytes_per_token + tile_gradient)
    n_offloaded, n_checkpointed = plan.offload_layers, plan.checkpoint_layers - plan.offload_layers

    def kept_up_to(layer):  # layers 0..layer, bytes per token
        below = layer + 1
        return (min(below, n_offloaded) * offloaded[0]
                + min(max(below - n_offloaded, 0), n_checkpointed) * checkpointed[0]
                + max(below - plan.checkpoint_layers, 0) * plain[0])

    def transient(layer):
        return (offloaded if layer < n_offloaded else checkpointed if layer < plan.checkpoint_layers else plain)[1]

    # Within each kind the memory at a layer's backward is linear in the layer's index (kept activations below it,
    # gradients above it): its largest value is at one end of the kind's range of layers.
    ends = {0, n_offloaded - 1, n_offloaded, plan.checkpoint_layers - 1, plan.checkpoint_layers, mb.n_layers - 1}
    layers = sorted((layer for layer in ends if 0 <= layer < mb.n_layers), reverse=True)
    # Each moment as (gradients, kept activations, recompute transient, loss); weights and optimizer state are the
    # same at every moment.
    moments = [(largest_grad, kept_up_to(mb.n_layers - 1) * tokens, 0,
                mb.loss_bytes_per_token * tokens + mb.loss_fixed_bytes)]
    layer_grad = mb.grad_bytes_of(mb.layer_param_count)
    for layer in layers:
        gradients = largest_grad + (0 if plan.optimizer_in_backward else (mb.n_layers - layer) * layer_grad)
        moments.append((gradients, kept_up_to(layer) * tokens, transient(layer) * tokens + tile_bytes, 0))
    if not plan.optimizer_in_backward:
        moments.append((mb.grad_bytes, 0, 0, 0))
    gradients, kept_bytes, transient_bytes, loss_bytes = max(moments, key=sum)
    parts = {"weights": mb.param_bytes, "gradients": gradients, "optimizer_state": optimizer_gpu,
             "kept_activations": kept_bytes, "recompute_transient": transient_bytes, "loss": loss_bytes}
    parts = {name: int(round(value)) for name, value in parts.items()}
    return sum(parts.values()), parts


def estimate_host_bytes(plan, model_bytes, batch, seq_len):
    """Pinned host bytes the plan's offloads hold: the offloaded layer inputs and the optimizer's moments."""
    activations = plan.offload_layers * model_bytes.input_bytes_per_token * batch * seq_len
    return int(activations + (model_bytes.optimizer_state_bytes if plan.offload_optimizer else 0))


def plan_cost(plan, model_bytes, batch, seq_len):
    """Estimated extra step time of plan's levers, as a fraction of a step without levers.

    A step without levers: 3 forwards' worth of FLOPs (the backward is two), a forward being, per token, 2 FLOP per
    weight plus causal attention's 2 * 2 * (seq_len / 2) * hidden (QK^T and PV over half the keys on average), at
    MATMUL_FLOPS_PER_S. Each lever adds:
      - optimizer in the backward: OPTIMIZER_IN_BACKWARD_COST (~0);
      - selective checkpointing, per layer: the layer's forward without attention (its matmuls);
      - full checkpointing, per layer: the layer's whole forward (c_full > c_sel, by attention's share, which grows
        with the sequence);
      - activation offload, per layer: OFFLOAD_EXPOSED_FRACTION of its input's PCIe round trip;
      - MLP tiles: every MLP's forward once more plus TILE_OVERHEAD_S per tile and layer;
      - optimizer-state offload: both moments to the GPU and back over PCIe every step, all of it (the copies
        overlap the backward, but the step cannot end before they do): the most expensive lever at short sequences,
        where a step's compute is short.
    The costs add up; they only rank plans, so their rates need to be right in proportion, not to the percent."""
    mb, tokens = model_bytes, batch * seq_len
    attention_flops = 2 * 2 * (seq_len / 2) * mb.hidden_size
    layer_forward_s = (2 * mb.layer_param_count + attention_flops) * tokens / MATMUL_FLOPS_PER_S
    matmul_forward_s = 2 * mb.layer_param_count * tokens / MATMUL_FLOPS_PER_S
    mlp_forward_s = 2 * 3 * mb.hidden_size * mb.intermediate_size * tokens / MATMUL_FLOPS_PER_S
    head_forward_s = 2 * mb.vocab_size * mb.hidden_size * tokens / MATMUL_FLOPS_PER_S
    step_s = 3 * (mb.n_layers * layer_forward_s + head_forward_s)

    extra_s = {"none": 0, "selective": matmul_forward_s, "full": layer_forward_s}[plan.activation_checkpointing] \
        * plan.checkpoint_layers
    extra_s += OFFLOAD_EXPOSED_FRACTION * plan.offload_layers * 2 * mb.input_bytes_per_token * tokens \
        / PCIE_BYTES_PER_S
    if plan.tiled_mlp is not None and plan.tiled_mlp < seq_len:
        extra_s += mb.n_layers * (mlp_forward_s + math.ceil(seq_len / plan.tiled_mlp) * TILE_OVERHEAD_S)
    if plan.offload_optimizer:
        extra_s += 2 * mb.optimizer_state_bytes / PCIE_BYTES_PER_S
    return extra_s / step_s + (OPTIMIZER_IN_BACKWARD_COST if plan.optimizer_in_backward else 0)


# ----------------------------------------------------------------------------------------------------------------------
# The choice: the cheapest candidate that fits

def candidate_levers(n_layers, seq_len, given):
    """Every combination of levers (with the given ones fixed), as dicts."""
    modes = [given["activation_checkpointing"]] if "activation_checkpointing" in given else CHECKPOINT_MODES
    tiles = [None] + [tile for tile in TILE_TOKENS_CHOICES if tile < seq_len]
    for mode in modes:
        for layers in ([0] if mode == "none" else range(1, n_layers + 1)):
            for offload, tile, in_backward, offload_optimizer in itertools.product(
                    range(layers + 1), tiles, (False, True), (False, True)):
                levers = dict(zip(LEVERS, (mode, layers, offload, tile, in_backward, offload_optimizer)))
                if offload_optimizer and not in_backward:
                    continue
                if all(levers[name] == value for name, value in given.items()):
                    yield levers


@functools.lru_cache(maxsize=64)
def ranked_candidates(model_bytes, batch, seq_len, given_items, host_budget_bytes):
    """The candidates whose offloads fit the host, each estimated, cheapest first (ties: the smaller peak first).
    Independent of the GPU budget: every budget picks from this same list, which makes the choice monotone."""
    given = dict(given_items)
    candidates = []
    for levers in candidate_levers(model_bytes.n_layers, seq_len, given):
        plan = MemoryPlan(**levers)
        plan.estimated_host_bytes = estimate_host_bytes(plan, model_bytes, batch, seq_len)
        if plan.estimated_host_bytes > host_budget_bytes:
            continue
        plan.estimated_peak_bytes, plan.estimated_parts = estimate_peak_bytes(plan, model_bytes, batch, seq_len)
        plan.cost = plan_cost(plan, model_bytes, batch, seq_len)
        candidates.append(plan)
    if not candidates:
        raise ValueError(f"no plan has the given levers {given} within {host_budget_bytes / 2**30:.1f} GiB of host "
                         f"memory")
    candidates.sort(key=lambda plan: (plan.cost, plan.estimated_peak_bytes))
    return tuple(candidates)


def _validated_given(given, n_layers):
    given = dict(given or {})
    unknown = set(given) - set(LEVERS)
    if unknown:
        raise ValueError(f"unknown levers {sorted(unknown)}; the levers are {LEVERS}")
    if given.get("checkpoint_layers", 0) > n_layers:
        raise ValueError(f"checkpoint_layers {given['checkpoint_layers']}: the model has {n_layers} decoder layers")
    return tuple(sorted(given.items()))


def _copy(plan):
    """A plan the caller may change: the ranked list is cached and shared between calls."""
    return dataclasses.replace(plan, estimated_parts=dict(plan.estimated_parts))


def fitting_plans(budget_bytes, model_bytes, batch, seq_len, given=None, host_budget_bytes=0):
    """Every candidate whose estimated peak fits budget_bytes, cheapest first: what run_with_fallback walks."""
    candidates = ranked_candidates(model_bytes, batch, seq_len, _validated_given(given, model_bytes.n_layers),
                                   host_budget_bytes)
    return [_copy(plan) for plan in candidates if plan.estimated_peak_bytes <= budget_bytes]


def choose_plan(budget_bytes, model_bytes, batch, seq_len, given=None, host_budget_bytes=0):
    """(plan, None): the cheapest candidate (plan_cost) whose estimated peak fits budget_bytes of GPU memory and
    whose offloads fit host_budget_bytes of pinned host memory; or (None, leanest) when none fits, leanest being the
    candidate with the smallest estimated peak, whose parts say what the step needs.

    budget_bytes: what the step may allocate: the GPU's memory less the CUDA context, library workspaces and the
    allocator's fragmentation (~3 GiB on an 80 GB H100).
    given: levers fixed by the user ({"activation_checkpointing": "full", ...}, names as in MemoryPlan): only
    candidates with those values compete, the plan fills in the rest. Pure: the same arguments give the same plan,
    and a larger budget never a costlier one (one cost-ordered candidate list, independent of the budget; the first
    that fits wins)."""
    candidates = ranked_candidates(model_bytes, batch, seq_len, _validated_given(given, model_bytes.n_layers),
                                   host_budget_bytes)
    budget = f"{budget_bytes / 2**30:.1f} GiB"
    plan = next((_copy(plan) for plan in candidates if plan.estimated_peak_bytes <= budget_bytes), None)
    if plan is None:
        leanest = _copy(min(candidates, key=lambda plan: plan.estimated_peak_bytes))
        leanest.reason = (f"nothing fits: the leanest plan ({leanest.describe()}) needs "
                          f"{leanest.estimated_peak_bytes / 2**30:.1f} GiB ({format_parts(leanest.estimated_parts)}), "
                          f"the budget is {budget}")
        return None, leanest
    plan.reason = (f"{plan.describe()}: the cheapest plan that fits {budget} (estimated peak "
                   f"{plan.estimated_peak_bytes / 2**30:.1f} GiB, +{plan.cost:.1%} step time)")
    return plan, None


def format_parts(parts):
    """'weights 15.0 + gradients 1.0 + ... GiB': the estimate's parts, for a log line."""
    return " + ".join(f"{name.replace('_', ' ')} {value / 2**30:.1f}" for name, value in parts.items()) + " GiB"


# ----------------------------------------------------------------------------------------------------------------------
# The levers: what the step keeps, recomputes, tiles or moves to the host

# The attention kernels SDPA dispatches to, and what they are called in reports. Selective checkpointing keeps their
# outputs (the attention output and its log-sum-exp), so a layer's recompute skips attention, the only part of the step
# whose cost grows with T^2. The math kernel is the one that materializes the [T, T] score matrix.
ATTENTION_KERNELS = {
    torch.ops.aten._scaled_dot_product_flash_attention.default: "flash",
    torch.ops.aten._scaled_dot_product_cudnn_attention.default: "cuDNN",
    torch.ops.aten._scaled_dot_product_efficient_attention.default: "memory-efficient",
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: "flash (CPU)",
    torch.ops.aten._scaled_dot_product_attention_math.default: "math (materializes [T, T])",
}


def keep_attention_outputs(ctx, op, *args, **kwargs):
    """Selective checkpointing policy: keep what attention kernels return, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_KERNELS else CheckpointPolicy.PREFER_RECOMPUTE


def host_bytes_held(offload, optimizers):
    """Bytes the run keeps in host memory: the offloaded layer inputs of the last step (offload: the offloader's
    report, or None) and the optimizer's moments."""
    return ((offload or {}).get("host_bytes", 0)
            + sum(optimizer.host_bytes() for optimizer in optimizers if isinstance(optimizer, OffloadedAdamW)))


# Up to this size a tensor's memory may come from heap pages it shares with other allocations, and a page cannot be
# registered twice; above it glibc maps fresh pages for every allocation (its mmap threshold tops out at 32 MiB). The
# blocks of the plan's levers at this size or below are powers of two already (a LLaMA q_proj's moment: 32 MiB).
PINNED_REGISTER_MIN_BYTES = 32 * 2**20


def pinned_empty(shape, dtype):
    """An uninitialized host tensor of exactly `shape`, page-locked so that copies between it and the GPU run
    asynchronously (on the CPU, a plain tensor). torch.empty(pin_memory=True) takes its memory from the caching host
    allocator, which rounds every block up to a power of two: a 3 GiB layer input (393216 tokens) would pin 4 GiB and
    each 1.002 GiB moment of the embedding 2 GiB. Large tensors are therefore allocated as ordinary host memory and
    registered with the driver (cudaHostRegister), pinned page for page; the registration ends when the tensor is
    collected. Small ones, which may share a page with other allocations, take the caching allocator's path."""
    if not HAS_CUDA or math.prod(shape) * dtype.itemsize <= PINNED_REGISTER_MIN_BYTES:
        return torch.empty(shape, dtype=dtype, pin_memory=HAS_CUDA)
    tensor = torch.empty(shape, dtype=dtype)
    cudart, address = torch.cuda.cudart(), tensor.data_ptr()
    error = cudart.cudaHostRegister(address, tensor.nbytes, 0)
    if int(error):
        raise RuntimeError(f"cudaHostRegister of {tensor.nbytes / 2**30:.2f} GiB failed: "
                           f"{cudart.cudaGetErrorString(error)}")
    weakref.finalize(tensor, cudart.cudaHostUnregister, address)  # before the memory goes back to the system
    return tensor


class ActivationOffloader:
    """Keeps the checkpointed input of some decoder layers in pinned host memory instead of on the GPU.

    With checkpointing, a layer keeps only its input ([tokens, hidden]) for the backward, which recomputes the rest.
    The offloader packs that saved input into pinned host memory: the device-to-host copy runs on a side stream, so it
    overlaps the layer's compute. The backward visits the layers in reverse order: when layer i's input is unpacked,
    the copy of layer i-1's input back to the GPU starts on the side stream, so it is there when layer i-1's recompute
    needs it. On the GPU, CUDA events time each copy and the compute between two offloaded layers (the copy must hide
    behind it); without a GPU the tensors are plain host copies.

    Every GPU tensor of the offloader belongs to the compute stream's memory pool, and the compute stream waits for
    each copy (an event) before it can free or read that tensor. torch's other way, record_stream, returns a block
    to the pool only once the caching allocator has seen the side stream's event complete; while the CPU runs ahead
    of the GPU it has not, so at a nearly full GPU an allocation finds no free block, and the allocator synchronizes
    and unmaps its cached memory to map new pages, the GPU idle meanwhile (~35 ms each time for an 8B model at 65536
    tokens). A copy takes a fraction of its layer's compute (~10 of ~85 ms there), so these waits cost nothing."""

    def __init__(self, hidden_size):
        self.hidden_size = hidden_size  # what a layer input looks like: [..., hidden_size]
        self.stream = torch.cuda.Stream() if HAS_CUDA else None
        self.records = []
        self.layers = 0  # layers wrapped: each offloads one input per step
        self.buffers = []  # the host buffers, one per offloaded input of a step, reused by every step

    def wrap(self, checkpoint_function):
        """One layer's checkpoint function, with the tensors it saves packed by this offloader."""
        self.layers += 1

        def offloaded_checkpoint(function, *args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                output = checkpoint_function(function, *args, **kwargs)
            # The layer's work is queued: the compute stream waits here for its input's copy (which ran beside it),
            # so that input's memory, freed once the caller drops it, is reused only after the copy has read it.
            for record in self.records:
                if "source" in record:
                    torch.cuda.current_stream().wait_event(record["copied"])
                    del record["source"]
            return output
        return offloaded_checkpoint

    def new_step(self):
        self.records = []

    def reserve(self, batch, seq_len, dtype):
        """Pins the host buffers of one step's offloaded inputs ([batch, seq_len, hidden] per wrapped layer) ahead of
        the step, so the first step at a length does not wait on the pinning (seconds for tens of GiB, which a
        --seq-len-search row would count as step time)."""
        for index in range(self.layers):
            self._buffer(index, (batch, seq_len, self.hidden_size), dtype)

    def _buffer(self, index, shape, dtype):
        """The host buffer of a step's index-th offloaded input: the one of the step before where it has the shape."""
        if index == len(self.buffers):
            self.buffers.append(None)
        buffer = self.buffers[index]
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            self.buffers[index] = None  # the old buffer's memory goes back before the new one is pinned
            self.buffers[index] = buffer = pinned_empty(shape, dtype)
        return buffer

    def pack(self, tensor):
        if tensor.dim() < 2 or tensor.shape[-1] != self.hidden_size:
            return tensor  # not a layer input (checkpoint also saves a small placeholder tensor of its own): kept
        record = {"device": tensor.device, "index": len(self.records), "on_gpu": None, "used": False,
                  "host": self._buffer(len(self.records), tensor.shape, tensor.dtype)}
        if tensor.is_cuda:
            record["saved"] = torch.cuda.Event(enable_timing=True)
            record["saved"].record()  # on the compute stream: the layer's input is complete here
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                record["copied"] = torch.cuda.Event(enable_timing=True)
                record["host"].copy_(tensor, non_blocking=True)
                record["copied"].record()
            record["source"] = tensor  # alive until the compute stream waits for the copy (offloaded_checkpoint)
        else:
            record["host"].copy_(tensor)
        self.records.append(record)
        return record

    def _fetch(self, record):
        """Start (or finish) bringing a record back to its device; the copy is queued on the side stream."""
        if record["on_gpu"] is None:
            if record["device"].type == "cuda":
                # allocated on the compute stream, which may hand out a block its queued kernels still use: the copy
                # into it waits for them
                host = record["host"]
                record["on_gpu"] = torch.empty(host.shape, dtype=host.dtype, device=record["device"])
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    record["on_gpu"].copy_(host, non_blocking=True)
                    record["fetched"] = torch.cuda.Event()
                    record["fetched"].record()
            else:
                record["on_gpu"] = record["host"].clone()
        return record["on_gpu"]

    def unpack(self, record):
        if isinstance(record, torch.Tensor):
            return record
        tensor = self._fetch(record)
        if record["index"] > 0 and not self.records[record["index"] - 1]["used"]:
            self._fetch(self.records[record["index"] - 1])  # the input the backward needs next
        if tensor.is_cuda:
            torch.cuda.current_stream().wait_event(record["fetched"])  # this copy only, not the prefetch behind it
        record["on_gpu"], record["used"] = None, True  # from here the recompute holds it
        return tensor

    def report(self):
        """Bytes on the host this step and, on the GPU, median ms of one layer's copy and of the compute between two
        offloaded layers' inputs (synchronizes: call after the step)."""
        result = {"host_bytes": sum(r["host"].numel() * r["host"].element_size() for r in self.records),
                  "layers": len(self.records)}
        if HAS_CUDA and len(self.records) > 1:
            torch.cuda.synchronize()
            result["copy_ms"] = statistics.median_high(r["saved"].elapsed_time(r["copied"]) for r in self.records)
            result["layer_compute_ms"] = statistics.median_high(a["saved"].elapsed_time(b["saved"])
                                                                for a, b in zip(self.records, self.records[1:]))
        return result


class TiledMLPFunction(torch.autograd.Function):
    """mlp(x) over sequence tiles, so the MLP's [tokens, intermediate] tensors exist for one tile at a time.

    The forward runs each tile without autograd and saves only x. The backward recomputes each tile's MLP with autograd
    on, back-propagates that tile and sums the weights' gradients over the tiles; they are returned to autograd rather
    than accumulated into .grad tile by tile, so each weight's gradient arrives once per step (an optimizer step hooked
    to its arrival, --optimizer-in-backward, runs once)."""

    @staticmethod
    def forward(ctx, x, tile_tokens, mlp_forward, *weights):
        ctx.save_for_backward(x)
        ctx.tile_tokens, ctx.mlp_forward, ctx.weights = tile_tokens, mlp_forward, weights
        with torch.no_grad():
            return torch.cat([mlp_forward(tile) for tile in x.split(tile_tokens, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        grad_x, grad_weights = [], [None] * len(ctx.weights)
        for tile, grad_tile in zip(x.split(ctx.tile_tokens, dim=-2), grad_output.split(ctx.tile_tokens, dim=-2)):
            tile = tile.detach().requires_grad_(True)
            with torch.enable_grad():
                out = ctx.mlp_forward(tile)
            grads = torch.autograd.grad(out, (tile, *ctx.weights), grad_tile)
            grad_x.append(grads[0])
            for i, grad in enumerate(grads[1:]):
                grad_weights[i] = grad if grad_weights[i] is None else grad_weights[i].add_(grad)
        return torch.cat(grad_x, dim=-2), None, None, *grad_weights


def tile_mlps(model, tile_tokens):
    """Route every decoder layer's MLP (whatever its forward: eager, fused kernel, Liger) through TiledMLPFunction."""
    for layer in model.model.layers:
        untiled_forward = layer.mlp.forward
        weights = tuple(p for p in layer.mlp.parameters() if p.requires_grad)

        def tiled_forward(x, untiled_forward=untiled_forward, weights=weights):
            if x.shape[-2] <= tile_tokens or not torch.is_grad_enabled():
                return untiled_forward(x)
            return TiledMLPFunction.apply(x, tile_tokens, untiled_forward, *weights)
        layer.mlp.forward = tiled_forward


def enable_activation_checkpointing(model, mode, offload_layers, checkpoint_layers=None):
    """transformers' gradient checkpointing (torch.utils.checkpoint, non-reentrant) on the first checkpoint_layers
    decoder layers (all by default): "full" recomputes the whole layer in the backward, "selective" all of it but
    attention. The first offload_layers layers keep their checkpointed input on the host. Returns the
    ActivationOffloader, or None."""
    checkpoint_kwargs = {"use_reentrant": False}
    if mode == "selective":  # "full" keeps checkpoint's default context, which torch.compile can trace
        checkpoint_kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                            keep_attention_outputs)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
    if checkpoint_layers is not None:
        for layer in model.model.layers[checkpoint_layers:]:
            layer.gradient_checkpointing = False  # transformers' per-layer switch: this layer keeps its activations
    if not offload_layers:
        return None
    offloader = ActivationOffloader(model.config.hidden_size)
    for layer in model.model.layers[:offload_layers]:
        # the function transformers' GradientCheckpointingLayer calls to checkpoint this layer
        layer._gradient_checkpointing_func = offloader.wrap(layer._gradient_checkpointing_func)
    return offloader


def optimizer_in_backward(model, make_optimizer):
    """One optimizer per parameter, stepped by a hook as soon as that parameter's gradient has been accumulated, after
    which the gradient is freed: the gradients of the whole model (16 GB for 8B in bf16) never exist at once."""
    optimizers = {param: make_optimizer([param]) for param in model.parameters() if param.requires_grad}

    def step(param):
        optimizers[param].step()
        optimizers[param].zero_grad(set_to_none=True)
    for param in optimizers:
        param.register_post_accumulate_grad_hook(step)
    return optimizers


# ----------------------------------------------------------------------------------------------------------------------
# AdamW whose moments live on the host

class OffloadedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW whose state tensors (exp_avg, exp_avg_sq) wait in pinned host memory between steps.

    Each parameter has its own torch.optim.AdamW (torch's math, fused or foreach as asked, none of ours). When a
    parameter's gradient is ready -- in the backward, from a post-accumulate-grad hook (in_backward=True), or in
    step() -- its moments are copied to the GPU on a side stream, its AdamW steps on the compute stream, the moments
    go back to the host on the side stream and the gradient is freed. While one parameter steps, the next one's
    moments are already on their way: the backward visits the parameters in the same order every step, so the order
    of the last backward says which is next. On the GPU at any time: the moments of two parameters, not the model's.

    It is a torch.optim.Optimizer over the same param groups as torch.optim.AdamW would be, with the state in
    self.state, so state_dict() has plain AdamW's layout (a checkpoint of either loads into the other) and an LR
    scheduler sets the lr of its param_groups, which each parameter's AdamW reads before it steps. With in_backward,
    step() has nothing left to do but is safe to call (schedulers expect it). Without CUDA the same code runs with
    plain host tensors and no streams."""

    def __init__(self, params, *, in_backward=True, **adamw_kwargs):
        # A plain AdamW over the same params checks the arguments and fills in its defaults: the groups are AdamW's.
        template = torch.optim.AdamW(params, **adamw_kwargs)
        super().__init__(template.param_groups, template.defaults)
        self._adamw = {param: torch.optim.AdamW([param], **adamw_kwargs)  # each parameter's own AdamW
                       for group in self.param_groups for param in group["params"]}
        # By index: load_state_dict replaces the group dicts, not their order.
        self._group_index = {param: index for index, group in enumerate(self.param_groups) for param in group["params"]}
        on_gpu = any(param.is_cuda for param in self._adamw)
        self._copy_stream = torch.cuda.Stream() if on_gpu else None
        self._on_device = {}  # parameter -> (its moments on its device, the event that says they have arrived)
        self._next_in_backward, self._this_backward = {}, {}
        self._hooks = [param.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for param in self._adamw if in_backward and param.requires_grad]

    def remove_hooks(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def host_bytes(self):
        """Bytes of the moments held on the host."""
        return sum(value.nbytes for state in self.state.values() for key, value in state.items() if key != "step")

    @torch.no_grad()
    def step(self, closure=None):
        """Steps every parameter that still has a gradient (all of them without in_backward, none with it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ready = [param for param in self._adamw if param.grad is not None]
        for param, next_param in zip(ready, ready[1:] + [None]):
            self._step_one(param, next_param)
        return loss

    def _on_grad_ready(self, param):
        if param in self._this_backward:  # a backward that raised (out of memory) never ran its end callback
            self._end_of_backward()
        if not self._this_backward:  # the first parameter of this backward: learn the order when it ends
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._this_backward[param] = None  # a dict: ordered, and membership by identity (tensor == is elementwise)
        with torch.no_grad():
            self._step_one(param, self._next_in_backward.get(param))

    def _end_of_backward(self):
        order, self._this_backward = list(self._this_backward), {}
        self._next_in_backward = dict(zip(order, order[1:]))
        self._on_device.clear()  # a prefetch the backward did not use (its order changed) must not hold the GPU

    def _fetch(self, param):
        """Starts copying param's moments to its device (once); returns them and the event of their arrival."""
        if param not in self._on_device:
            moments = {key: value for key, value in self.state[param].items() if key != "step"}
            if self._copy_stream is None:  # no GPU: the same swap, as plain copies
                self._on_device[param] = ({key: value.clone() for key, value in moments.items()}, None)
            else:
                with torch.cuda.stream(self._copy_stream):
                    on_device = {key: value.to(param.device, non_blocking=True) for key, value in moments.items()}
                    arrived = torch.cuda.Event()
                    arrived.record()
                self._on_device[param] = (on_device, arrived)
        return self._on_device[param]

    def _step_one(self, param, next_param):
        moments, arrived = self._fetch(param)
        if next_param is not None and next_param in self.state:  # no state yet (first step): nothing to prefetch
            self._fetch(next_param)
        del self._on_device[param]
        if arrived is not None:
            compute_stream = torch.cuda.current_stream()
            compute_stream.wait_event(arrived)  # this parameter's copy only, not the prefetch queued behind it
            for value in moments.values():
                value.record_stream(compute_stream)  # allocated on the copy stream, used here
        # torch's AdamW steps on the state as it would hold it: the host dict with the device moments swapped in.
        # On the first step the dict is empty and AdamW creates the state itself (on the device), as it would.
        state = self.state[param]
        adamw = self._adamw[param]
        group = self.param_groups[self._group_index[param]]  # where a scheduler sets the lr
        adamw.param_groups[0].update({key: value for key, value in group.items()
                                      if key not in ("params", "param_names")})
        adamw.state[param] = {key: moments.get(key, value) for key, value in state.items()}
        adamw.step()
        on_device = adamw.state.pop(param)
        if not state:  # the first step: pinned host tensors for the state AdamW has just created
            state.update({key: value if key == "step" else pinned_empty(value.shape, value.dtype)
                          for key, value in on_device.items()})
        self._copy_back(state, on_device)
        param.grad = None

    def _copy_back(self, state, on_device):
        if self._copy_stream is None:
            for key, value in on_device.items():
                if key != "step":
                    state[key].copy_(value)
            return
        self._copy_stream.wait_stream(torch.cuda.current_stream())  # the update must be complete before it is read
        with torch.cuda.stream(self._copy_stream):
            for key, value in on_device.items():
                if key != "step":
                    state[key].copy_(value, non_blocking=True)
                    value.record_stream(self._copy_stream)  # its memory is reused only after the copy has read it

    def _wait_for_copies(self):
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def state_dict(self):
        self._wait_for_copies()  # the host tensors are complete only once the copies back have run
        state_dict = super().state_dict()
        # In parameter order, as AdamW's: the state was created in the order the backward reached the parameters.
        state_dict["state"] = dict(sorted(state_dict["state"].items()))
        return state_dict

    def load_state_dict(self, state_dict):
        """Loads a state_dict of this class or of torch.optim.AdamW over the same params. torch's loader would put
        every moment on its parameter's device (the whole optimizer state on the GPU at once): it loads the steps and
        groups only, and the moments are copied into pinned host tensors here."""
        self._wait_for_copies()
        self._on_device.clear()
        saved_state = state_dict["state"]
        steps_only = {**state_dict, "state": {key: {name: value for name, value in state.items() if name == "step"}
                                              for key, state in saved_state.items()}}
        super().load_state_dict(steps_only)
        ids = itertools.chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = itertools.chain.from_iterable(group["params"] for group in self.param_groups)
        for saved_id, param in zip(ids, params):
            for name, value in saved_state.get(saved_id, {}).items():
                if name != "step":
                    self.state[param][name] = pinned_empty(param.shape, param.dtype).copy_(value)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA graph: the whole step replayed as one launch

def prepare_compiled_step(args, model):
    """What a compiled or captured step needs, once the levers are in place; returns whether the step is replayed as a
    CUDA graph (--cuda-graph with a GPU)."""
    if args.fp8 and not args.compile:  # the float8 casts fuse only when compiled; --compile compiles the whole step
        compile_decoder_layers(model, COMPILE_BACKEND)
    use_cuda_graph = args.cuda_graph and HAS_CUDA
    if args.cuda_graph and not HAS_CUDA:
        print("no CUDA device: --cuda-graph has no graph to capture, the steps run eagerly")
    if (use_cuda_graph or args.compile) and args.attn_implementation == "sdpa":
        causal_sdpa_without_mask(model)
    return use_cuda_graph


def causal_sdpa_without_mask(model):
    """--cuda-graph and --compile with SDPA: keep the causal mask a flag, not a tensor, in a captured or compiled step.

    While capturing or tracing, transformers builds the causal mask as a [T, T] tensor (a skipped mask would be baked
    into the graph), and SDPA with a mask tensor takes a masked kernel: 3x slower than the causal one at 1x8192, plus
    the mask's memory. The batches are packed windows with no padding, so their mask is always the plain causal one.
    An attention implementation registered without a mask function gets attention_mask=None from transformers, and
    its SDPA function then passes is_causal=True, exactly as the eager step does."""
    AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
    model.set_attn_implementation("sdpa_causal")


def capture_step(train_step):
    """--cuda-graph: train_step as a CUDA graph. The first call trains eagerly on a side stream (kernels compile,
    the optimizer creates its state), as PyTorch's CUDA-graph notes ask, then records one call of train_step into a
    graph (recording runs nothing); every later call copies its batch into the graph's input buffer and replays.

    Why it pays: an 8B step launches thousands of kernels, and at 1x512 most finish faster than Python and the driver
    can launch the next one, so the GPU waits on the host. A replay is one launch for the whole step. What it needs,
    and the script provides: one shape every step, no host sync inside the step, AdamW with capturable=True (its step
    count lives on the GPU) and a fixed learning rate. A step that cannot be captured (a host sync, a copy from the
    host) ends the run with one error line."""
    graph, static = torch.cuda.CUDAGraph(), {}

    def graphed_step(micro_batches):
        if not static:
            side_stream = torch.cuda.Stream()
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):
                outputs = train_step(micro_batches)
            torch.cuda.current_stream().wait_stream(side_stream)
            static["batch"] = micro_batches.clone()
            try:
                with torch.cuda.graph(graph):
                    static["outputs"] = train_step(static["batch"])
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as err:
                raise SystemExit(f"error: the training step cannot be captured as a CUDA graph "
                                 f"({str(err).splitlines()[0]}): something in it waits for the GPU or copies from "
                                 f"the host; run without --cuda-graph") from None
            return outputs
        static["batch"].copy_(micro_batches)
        graph.replay()
        # the next replay overwrites the outputs in place: hand the caller copies
        return tuple(None if value is None else value.clone() for value in static["outputs"])
    return graphed_step


# ----------------------------------------------------------------------------------------------------------------------
# Reporting: peak memory and tokens/s against sequence length, from the JSON files of earlier runs

def flag_summary(levers):
    """A run's memory levers, short enough to label a point: its memory plan's record (levers named as MemoryPlan
    names them), or, in files from before the plan, its options (the flags' names)."""
    parts = [levers.get("activation_checkpointing") or "none"]
    if levers.get("checkpoint_layers"):
        parts.append(f"{levers['checkpoint_layers']} layers")
    offloaded = levers.get("offload_layers", levers.get("offload_activations"))
    if offloaded:
        parts.append(f"offload {offloaded}")
    if levers.get("tiled_mlp"):
        parts.append(f"MLP tiles {levers['tiled_mlp']}")
    if levers.get("offload_optimizer"):
        parts.append("optimizer state offloaded")
    elif levers.get("optimizer_in_backward"):
        parts.append("optimizer in backward")
    return ", ".join(parts)


def plot_memory(paths, out_path):
    """Two panels, one line per kind of run (ours, Liger, baseline...), at each sequence length that a results file
    (a fine-tune or a --seq-len-search) reports: peak GPU memory (a cross where a length ran out of memory; each point
    labelled with its flags and the memory it kept on the host) and tokens per second. A run without a GPU measured
    no peak (null): it is left out, and said so."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    series, unmeasured = {}, []
    for path in paths:
        try:
            result = json.loads(Path(path).read_text())
            writer = result.get("script")
            if writer not in ("finetune_baseline.py", "finetune_optimized.py"):  # e.g. a profile's .summary.json
                raise SystemExit(f"error: --plot {path}: not a fine-tune results file ("
                                 + (f"written by {writer}" if writer else "it names no script")
                                 + "); --plot reads the JSON of finetune_baseline.py and finetune_optimized.py")
            label = "ours (fused kernels)" if writer == "finetune_optimized.py" else result["variant"]
            # A search times one step per length (the second at that length where the first was short); a run times
            # its steps after the first, at one length: two series, not one line.
            label += ", --seq-len-search" if "seq_len_search" in result else ""
            rows = (result["seq_len_search"]["results"] if "seq_len_search" in result else
                    [{"seq_len": result["options"]["seq_len"], "status": "trained",
                      "peak_gib": result["peak_memory_gib"], "tokens_per_s": result.get("tokens_per_s"),
                      "host_gib": result.get("host_gib", (result.get("offload") or {}).get("host_bytes", 0) / 2**30)}])
            for row in rows:
                if row["status"] not in ("trained", "out of memory"):
                    continue  # "not tried", "non-finite loss": no memory to show
                if row.get("peak_gib") is None:  # a run without a GPU has no GPU memory to report
                    unmeasured.append(f"{path} ({row['seq_len']} tokens)")
                else:
                    levers = row.get("memory_plan") or result.get("memory_plan") or result["options"]
                    series.setdefault(label, []).append((row, flag_summary(levers)))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # e.g. an older file's rows
            raise SystemExit(f"error: --plot {path}: not a fine-tune results file this version reads "
                             f"({type(err).__name__}: {err})")
    if unmeasured:
        print(f"left out, no peak GPU memory (run without a GPU): {', '.join(unmeasured)}")
    if not series:
        raise SystemExit("error: --plot: nothing to plot: no run in these files measured its peak GPU memory")
    fig, (ax, speed_ax) = plt.subplots(1, 2, figsize=(15, 5.5))
    for label, points in series.items():
        points.sort(key=lambda point: point[0]["seq_len"])
        trained = [row for row, _ in points if row["status"] == "trained"]
        # dotted: the points of one series may use different flags (each is labelled)
        line, = ax.plot([row["seq_len"] for row in trained], [row["peak_gib"] for row in trained], marker="o",
                        linestyle=":", label=label)
        timed = [row for row in trained if row.get("tokens_per_s")]
        speed_ax.plot([row["seq_len"] for row in timed], [row["tokens_per_s"] for row in timed], marker="o",
                      linestyle=":", label=label, color=line.get_color())
        for row, flags in points:
            host = f", +{row['host_gib']:.0f} GiB host" if row.get("host_gib") else ""
            if row["status"] == "out of memory":
                ax.plot(row["seq_len"], row["peak_gib"], marker="x", markersize=10, color=line.get_color())
                flags = f"out of memory ({row['phase']})"
            ax.annotate(f"{flags}{host}", (row["seq_len"], row["peak_gib"]), textcoords="offset points",
                        xytext=(4, 6), fontsize=7, color=line.get_color())
    lengths = [row["seq_len"] for points in series.values() for row, _ in points]
    for axis in (ax, speed_ax):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tokens per sequence (batch 1)")
        axis.grid(True, alpha=0.3)
        axis.legend()
    ax.set_xlim(min(lengths) / 1.3, max(lengths) * 3.5)  # room for the labels right of the last points
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title("Peak GPU memory (each point labelled with its levers)", fontsize=10)
    if any(row.get("tokens_per_s") for points in series.values() for row, _ in points):  # else nothing is timed
        speed_ax.set_yscale("log")
    speed_ax.set_ylabel("tokens per second")
    speed_ax.set_title("Training speed (full fine-tune, batch 1)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    print(f"plot: {out_path}")


#


if __name__ == "__main__":
    main()
