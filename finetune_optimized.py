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
Everything else -- model, loop, resume, evaluation, JSON -- is the baseline's, line for line; so are the data
(training_data.py) and peft's LoRA (lora_adapters.py), which this script imports where the baseline has them inline.
README.md tells which models and data it takes (without cached weights: the same architecture with RANDOM weights,
said so). Under --lora the kernels run on the peft-wrapped model and spend nothing on a frozen weight's gradient.

    python finetune_optimized.py                                # 20 steps at 1x512 (without a GPU: tiny LLaMA, 1x32)
    python finetune_optimized.py --seq-len 8192                 # the plan picks what fits the GPU
    python finetune_optimized.py --data corpus.txt --output-dir runs/ft --save-steps 200 --eval-split 0.05 [--resume]
    python finetune_optimized.py --data chat.jsonl --seq-len 8192   # conversations: the answers the targets, packed
    python finetune_optimized.py --seq-len-search 65536,131072,262144   # longest batch-1 sequence, a plan per length
    python finetune_optimized.py --lora 16 [--qlora] --output-dir runs/lora --merge   # peft's LoRA, our kernels
    torchrun --standalone --nproc-per-node 2 finetune_optimized.py --fsdp  # or accelerate launch --multi_gpu ...
"""
import argparse
import datetime
import gc
import json
import logging
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import warnings
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
from tqdm import tqdm

# The kernel modules come BEFORE transformers: without a GPU they switch Triton to its CPU interpreter, which only
# works if that happens before anything (transformers' LLaMA code does) imports Triton.
from cross_entropy_kernel import cross_entropy
from float8_training import RECIPES, check_fp8_flags, compile_decoder_layers, convert_decoder_linears, torchao_version
from linear_cross_entropy_kernel import linear_cross_entropy
from lora_adapters import (apply_lora, check_lora_flags, dequantize_nf4, describe_adapters, describe_lora, lora_report,
                           lora_settings, trainable_parameters)
from memory_levers import ClipInBackward, OffloadedAdamW, apply_levers, host_bytes_held, optimizer_in_backward
from memory_plan import (PINNED_HOST_FRACTION, NoPlanFits, causal_sdpa_without_mask, check_memory_flags,
                         measure_model_bytes, plan_memory, plan_record)
from rmsnorm_kernel import apply_rmsnorm
from rope_kernel import apply_rope
from swiglu_kernel import apply_glu_mlp

# transformers imports torchao where it is installed (for finetune_optimized.py --fp8); torchao's notice that its CUDA
# extensions do not load and torch's about torchao's enums concern no run here: those two loggers show errors only.
for noisy_logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(noisy_logger).setLevel(logging.ERROR)

import transformers
from transformers import AutoConfig, AutoModelForCausalLM, get_scheduler

from training_data import (DATA_FORMATS, attention_inputs, choose_attention, first_line, load_data, packed_documents,
                           resolve_data_format, shift_labels_of, targets_per_rank, text_batch)

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
    add("--attn-implementation", choices=["auto", *ATTN_IMPLEMENTATIONS, "torch_varlen"], default="auto",
        help="transformers' attention; auto: sdpa, or for packed conversations on a GPU flash_attention_2 (where "
             "flash-attn is installed) or flex_attention, which skip the work across conversations; torch_varlen: "
             "torch's own variable-length attention (CUDA)")
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
    add("--data-format", choices=DATA_FORMATS, default="auto",
        help="text: the --text-field of each row, one token stream in --seq-len windows, every token a target; chat: "
             "'messages' rows (role/content turns) through the chat template, the assistant turns the targets; "
             "prompt-completion: 'prompt' and 'completion' rows, the completion the target; auto: the first "
             "row's fields")
    add("--chat-template", default=None, metavar="FILE", help="a Jinja chat template for chat rows (default: the "
        "tokenizer's; without a tokenizer a built-in one over UTF-8 bytes)")
    add("--train-on-prompt", action="store_true", help="chat and prompt/completion data: every token a target, not "
        "only the answers")
    add("--packing", choices=["on", "off"], default="on",
        help="chat and prompt/completion data: on = whole conversations packed into rows of --seq-len tokens, "
             "positions and attention kept within each; off = one conversation per row, each step's batches padded "
             "to its longest")
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
    if args.attn_implementation == "torch_varlen" and not HAS_CUDA:
        parser.error("--attn-implementation torch_varlen needs a GPU: torch's variable-length attention is CUDA only")
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
                   "rope", "fp8", "out", "tensorboard", "allow_download", "data_format"}  # the data says its format


def default_out_path(args, weights, dtype, variant, world_size):
    """DIR/results.json with --output-dir; else runs/<script>_<model>-<weights>_<variant>_<dtype>_<shape>[_fsdpN] and
    every other option that differs from its default as _<option>=<value>: runs never overwrite each other's JSON."""
    if args.output_dir:
        return Path(args.output_dir) / "results.json"
    defaults = vars(build_parser().parse_args([]))
    parts = [Path(__file__).stem, f"{Path(args.model).name}-{weights}", variant, dtype,
             f"{args.batch_size}x{args.seq_len}" + (f"_fsdp{world_size}" if args.fsdp else "")]
    auto = argparse.Namespace(**{**vars(args), "attn_implementation": "auto"})
    choose_attention(auto)  # what --attn-implementation auto picks for this data and device: no difference to name
    parts += [f"{name.replace('_', '-')}={Path(str(value)).name}" for name, value in vars(args).items()
              if name not in UNNAMED_OPTIONS and value != defaults[name]
              and not (name == "attn_implementation" and value == auto.attn_implementation)]
    return HERE / "runs" / ("_".join(re.sub(r"[^\w.+=-]+", "-", str(part)) for part in parts) + ".json")


# ----------------------------------------------------------------------------------------------------------------------
# Model: real weights where from_pretrained can load them, otherwise the same architecture with random weights

# configs/<name>/config.json: the published architecture of each supported family's common size (llama-3.1-8b,
# mistral-7b-v0.3, qwen2.5-7b, qwen3-8b, gemma-2-9b, gemma-3-12b's text decoder, phi-3-mini-4k-instruct) and a tiny
# one of the same structure per family for CPU runs ("tiny" is LLaMA's, "tiny-<family>" the others').
CONFIGS = HERE / "configs"
# The attention implementations that apply Gemma 2's attention logit softcapping (sdpa has no such argument).
SOFTCAP_ATTENTION = ["eager", "flex_attention", "flash_attention_2"]


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
# Loss: THE part the kernels change (compare with finetune_optimized.py)

def compute_loss(model, input_ids, shift_labels, loss_impl, position_ids=None, num_targets=None,
                 lce_chunk_size=None):
    """(loss, token accuracy): the mean over the non-ignored positions of the loss and of the hits (the most likely
    token is the label), or with num_targets (targets_per_rank) their sums divided by it: the micro-batch's share of
    its step's token-weighted means. position_ids: per-token positions of packed rows (None: 0..T-1 in every row). The
    fused losses find the hits in the same pass over the logits (return_token_accuracy)."""
    if loss_impl == "linear_ce":
        # Run the decoder body only and let the loss multiply by lm_head's weight chunk by chunk: no [B*T, V] logits.
        hidden = model.model(input_ids=input_ids, **attention_inputs(model, position_ids)).last_hidden_state
        # Gemma 2 caps its logits at final_logit_softcapping (cap * tanh(logits / cap)): the kernel applies it to each
        # chunk of logits, as the model's own forward does to all of them.
        out = linear_cross_entropy(hidden, model.lm_head.weight, shift_labels, chunk_size=lce_chunk_size,
                                   softcap=getattr(model.config, "final_logit_softcapping", None),
                                   reduction="mean" if num_targets is None else "sum", return_token_accuracy=True)
        return (out.loss if num_targets is None else out.loss / num_targets), token_share(out.token_accuracy,
                                                                                         shift_labels, num_targets)
    logits = model(input_ids=input_ids, **attention_inputs(model, position_ids)).logits  # [B, T, V], model's dtype
    if loss_impl == "ce":
        # The same math as below without an fp32 copy of the logits. inplace_backward: the gradient overwrites the
        # logits, safe because lm_head's backward needs its input, not its output; not under torch.compile, where the
        # loss is an operator that may not overwrite its input.
        out = cross_entropy(logits, shift_labels, inplace_backward=not torch.compiler.is_compiling(),
                            reduction="mean" if num_targets is None else "sum", return_token_accuracy=True)
        return (out.loss if num_targets is None else out.loss / num_targets), token_share(out.token_accuracy,
                                                                                         shift_labels, num_targets)
    # transformers' ForCausalLMLoss: upcast the logits to fp32, mean (or sum) over the non-ignored tokens.
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), shift_labels.view(-1), ignore_index=-100,
                           reduction="mean" if num_targets is None else "sum")
    with torch.no_grad():  # one more pass over the logits (argmax), as a training loop that logs accuracy does
        counted = shift_labels != -100
        hits = ((logits.argmax(dim=-1) == shift_labels) & counted).sum()
    if num_targets is None:
        return loss, hits / counted.sum()
    return loss / num_targets, hits / num_targets


def token_share(mean, shift_labels, num_targets):
    """A micro-batch's mean over its own targets as its share of the step's token-weighted mean: mean x its targets /
    num_targets (None: the mean itself). A micro-batch without targets has a NaN mean and adds 0."""
    return mean if num_targets is None else mean.nan_to_num() * (shift_labels != -100).sum() / num_targets


class ModelWithLoss(torch.nn.Module):
    """The model and compute_loss as one module: the unit FSDP2 shards as its root, and the unit torch.compile
    compiles (the fused linear cross-entropy reads lm_head.weight outside lm_head's own forward)."""

    def __init__(self, model, loss_impl, lce_chunk_size=None):
        super().__init__()
        self.model, self.loss_impl, self.lce_chunk_size = model, loss_impl, lce_chunk_size

    def forward(self, input_ids, shift_labels, position_ids=None, num_targets=None):
        return compute_loss(self.model, input_ids, shift_labels, self.loss_impl, position_ids, num_targets,
                            self.lce_chunk_size)


@torch.no_grad()
def evaluate(model_with_loss, batches, world_size, documents):
    """Held-out loss and token accuracy over batches (each [3, batch, T]) on every rank: their sums over every target
    token divided by the targets' count, so each target counts once, however many a batch holds. documents: the
    rows are packed conversations, whose positions the model is given."""
    model_with_loss.eval()
    num_targets = targets_per_rank(batches, world_size)
    results = [model_with_loss(input_ids, shift_labels, position_ids if documents else None, num_targets)
               for input_ids, shift_labels, position_ids in batches]
    model_with_loss.train()
    sums = [torch.stack([result[i].float() for result in results]).sum() for i in (0, 1)]
    if world_size > 1:
        for value in sums:
            dist.all_reduce(value.div_(world_size))  # each rank's sum is over the mean count per rank
    return [value.item() for value in sums]


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
    train_step(text_batch(torch.randint(0, vocab, (1, 1, warmup_len), generator=generator)).to(device))
    rows = []
    for seq_len in args.seq_len_search:
        input_ids = text_batch(torch.randint(0, vocab, (1, 1, seq_len), generator=generator)).to(device)
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
    micro_batches, tokens_per_step = batches["train"]["steps"], batches["train"]["real_tokens"]  # real: no padding
    timed_tokens = []
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
            timed_tokens.append(tokens_per_step[step - 1])
        records.append((loss, accuracy, grad_norm))
        scalars = {"train/loss": loss, "train/lr": schedulers[0].get_last_lr()[0], "train/grad_norm": grad_norm,
                   "train/tokens_per_s": timed_tokens[-1] / step_times[-1] if step_times else None}
        if batches["eval"] is not None and (step % (args.eval_steps or args.steps) == 0 or step == args.steps):
            eval_loss, eval_accuracy = evaluate(model_with_loss, batches["eval"]["steps"], world_size,
                                                packed_documents(args))
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
    tokens_per_s = sum(timed_tokens) / sum(step_times) if step_times else None
    avg_step_ms = 1e3 * sum(step_times) / len(step_times) if step_times else None
    peak_gib = [torch.cuda.max_memory_allocated() / 2**30 if HAS_CUDA else None] * world_size
    if args.fsdp:  # each rank holds its own shards, activations and optimizer state: report every rank's peak
        dist.all_gather_object(peak_gib, peak_gib[rank])
    print(f"---- summary: {variant} {args.model} {args.batch_size}x{args.seq_len} {args.optimizer} ----")
    print(f"steps           : {start_step + 1}..{args.steps}, {len(step_times)} timed after {warmup_steps} warm-up")
    print("tokens/s        : " + (f"{tokens_per_s:,.0f} ({avg_step_ms:.1f} ms/step)" if tokens_per_s
                                   else "n/a (no timed step)") + (f" over {world_size} ranks" if args.fsdp else "")
          + (" (real tokens, no padding)" if args.data_format != "text" else ""))
    if args.data_format != "text":
        print(f"rows            : {batches['train']['conversations']} conversations, "
              + (f"packed into rows {100 * batches['train']['fill']:.1f} % full" if args.packing == "on" else
                 f"one per row, padded: {100 * batches['train']['fill']:.1f} % of the tokens are real"))
    print("peak GPU memory : " + (", ".join(f"{gib:.2f} GiB" for gib in peak_gib) if HAS_CUDA else "n/a (CPU)"))
    print(f"loss            : {losses[0]:.4f} (step {start_step + 1}) -> {losses[-1]:.4f} (step {args.steps})"
          + (f" | held-out {evals[-1]['loss']:.4f}" if evals else ""))
    for checkpoint in saved[-1:]:
        print(f"checkpoint      : {checkpoint['bytes'] / 2**30:.2f} GiB, training held {checkpoint['stage_s']:.1f} s "
              f"while it was copied to {checkpoint['staging']} host memory, written in {checkpoint['write_s']:.1f} s "
              f"(step {checkpoint['step']}, {len(saved)} written)")
    return {"shape": f"{args.batch_size}x{args.seq_len}", "tokens_per_step": sum(tokens_per_step) / args.steps,
            "real_tokens_per_step": tokens_per_step, "row_fill": batches["train"]["fill"],
            "conversations": batches["train"]["conversations"], "tokenized_by": batches["train"]["tokenized_by"],
            "steps": args.steps,
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
    resolve_data_format(args)  # before the model: the attention depends on it
    documents, attention_reason = packed_documents(args), choose_attention(args)
    data_kind = args.data_format + (f", packing {args.packing}" if args.data_format != "text" else "")
    check_step_flags_for_data(args, documents)
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
    plan, offloader = plan_and_apply_levers(args, model, loss_impl, dtype, device, tried)
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
        """One optimizer step over micro_batches ([grad_accum_steps, 3, batch, T]: token ids, shifted labels,
        positions); returns the loss and the token accuracy (token-weighted means over all the step's targets) and
        the gradient norm (None without clipping), as device tensors: no host sync."""
        num_targets = targets_per_rank(micro_batches, world_size)
        if offloader is not None:
            offloader.new_step()
        step_loss, step_accuracy = 0.0, 0.0
        for input_ids, shift_labels, position_ids in micro_batches:
            phase["now"] = "forward"
            loss, accuracy = step_module(input_ids, shift_labels, position_ids if documents else None, num_targets)
            phase["now"] = "backward" + " (with the optimizer steps inside)" * plan.optimizer_in_backward
            loss.backward()  # the micro-batch's summed losses over the step's targets: the step's gradient adds up
            step_loss = step_loss + loss.detach()
            step_accuracy = step_accuracy + accuracy
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
          f"vocab {config.vocab_size}, {str(dtype).replace('torch.', '')}, attn {args.attn_implementation} "
          f"({attention_reason})")
    if lora_model is not None:
        print(describe_adapters(lora_report(args, model)))
    print(f"{Path(__file__).name}: variant {variant}, optimizer {args.optimizer}, lr {args.lr} ({args.lr_scheduler}), "
          f"data {args.data} ({data_kind})" + (f", replaced {replaced}" * bool(replaced))
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
            result.update(seq_len_search_with_plan(args, train_step, phase, config.vocab_size, device, plan, offloader,
                                                   optimizers))
        else:
            tokenizer, batches = load_data(args, config, device, rank, world_size)
            start_step = resume(args, model, optimizers, schedulers, world_size) if args.resume else 0
            step_function = capture_step(train_step) if use_cuda_graph else train_step
            result.update(train(args, step_function, model_with_loss, optimizers, schedulers, batches, start_step,
                                variant, rank, world_size))
            result.update(levers_report(offloader, optimizers, use_cuda_graph))
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
# What is ours, in the order fine_tune uses it: the kernels, the optimizers of the plan, the CUDA graph. The memory plan
# is memory_plan.py, its levers memory_levers.py.

# ----------------------------------------------------------------------------------------------------------------------
# The memory plan and its levers, in the run

def plan_and_apply_levers(args, model, loss_impl, dtype, device, tried):
    """(the run's memory plan, the activation offloader or None): the fastest plan that fits (--memory-plan auto) or
    the flags as given (manual), its levers applied to the model. What a token costs is measured on the model as it
    trains: probe forwards on the GPU, the fake-tensor count without one (and under --cuda-graph, whose capture
    allocates its own pool)."""
    model_bytes = measure_model_bytes(model, lambda model, input_ids: compute_loss(
        model, input_ids, shift_labels_of(input_ids), loss_impl, lce_chunk_size=args.lce_chunk_size),
        lambda model: (apply_lora(args, model), patch_kernels(args, model)),
        on_gpu=HAS_CUDA and args.memory_plan == "auto" and not args.cuda_graph)
    # pinned offloads may take 90 % of what the kernel reports available; the rest is the process's own and the system's
    plan = plan_memory(args, model_bytes, int(PINNED_HOST_FRACTION * host_memory_available()), device, tried)
    offloader = apply_levers(model, plan)
    if offloader is not None:
        offloader.reserve(args.batch_size, args.seq_len, dtype)
    return plan, offloader


def seq_len_search_with_plan(args, train_step, phase, vocab, device, plan, offloader, optimizers):
    """seq_len_search under the run's plan: the last length's row records the plan and the host memory its levers
    held; a length out of memory under --memory-plan auto raises, and main tries the next plan."""
    result = seq_len_search(args, train_step, phase, vocab, device)
    row = result["seq_len_search"]["results"][-1]
    row["memory_plan"] = plan_record(plan)
    offload = offloader.report() if offloader is not None else None
    if row["status"] == "trained" and (held := host_bytes_held(offload, optimizers)):
        row["host_gib"] = held / 2**30
    if row["status"] == "out of memory" and args.memory_plan == "auto":
        raise torch.OutOfMemoryError(f"in the {row['phase']}, at a peak of {row['peak_gib']:.1f} GiB")
    return result


def levers_report(offloader, optimizers, use_cuda_graph):
    """The levers' part of the results (what the offloader moved, the host memory held) and its summary lines."""
    offload = offloader.report() if offloader is not None else None
    if offload:
        print(f"offload         : {offload['host_bytes'] / 2**30:.2f} GiB of layer inputs on the host "
              f"({offload['layers']} layers)")
    if use_cuda_graph:
        print("cuda graph      : the whole step replayed as one CUDA graph")
    return {"offload": offload, "host_gib": host_bytes_held(offload, optimizers) / 2**30}


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
# CUDA graph: the whole step replayed as one launch

def check_step_flags_for_data(args, documents):
    """The step options that conversations rule out, refused before the model loads."""
    if args.cuda_graph and args.data_format != "text":
        raise SystemExit("error: --cuda-graph replays one step of one shape with no host work: text data only "
                         "(conversations change the shape, and transformers finds packed ones' boundaries on the host)")
    if args.compile and documents and args.attn_implementation == "sdpa":
        raise SystemExit("error: --compile with sdpa keeps the causal mask a flag, not a tensor, which would let "
                         "attention cross packed conversations: --attn-implementation flex_attention (GPU) or eager, "
                         "or --packing off")


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



if __name__ == "__main__":
    main()
