"""Full fine-tuning of LLaMA-3.1-8B with stock PyTorch + transformers: the BASELINE.

The playbook's step 11, first half, as a user of the stock tools writes it, one loop read top to bottom like nanoGPT's
train.py: forward, loss, backward, clipping, AdamW, schedule; held-out evaluation, checkpoints, save_pretrained, and a
summary plus a JSON file. finetune_optimized.py is this script plus what is ours: `diff` the two files to see it.

    python finetune_baseline.py                                 # 20 steps at 1x512 (without a GPU: tiny LLaMA, 1x32)
    python finetune_baseline.py --liger --seq-len 8192 --activation-checkpointing full   # the peer: Liger-Kernel
    python finetune_baseline.py --data corpus.txt --output-dir runs/ft --save-steps 200 --eval-split 0.05 [--resume]
    python finetune_baseline.py --data chat.jsonl --seq-len 8192   # conversations: the answers the targets, packed
    python finetune_baseline.py --seq-len-search 4096,8192,12288,16384   # longest batch-1 sequence that trains
    python finetune_baseline.py --lora 16 [--qlora] --output-dir runs/lora --merge   # peft's LoRA on the frozen base
    torchrun --standalone --nproc-per-node 2 finetune_baseline.py --fsdp  # or accelerate launch --multi_gpu ...
"""
import argparse
import datetime
import importlib.metadata
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

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import fully_shard
from tqdm import tqdm

# transformers imports torchao where it is installed (for finetune_optimized.py --fp8); torchao's notice that its CUDA
# extensions do not load and torch's about torchao's enums concern no run here: those two loggers show errors only.
for noisy_logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(noisy_logger).setLevel(logging.ERROR)

import transformers
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

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
    add("--activation-checkpointing", choices=["none", "full"], default="none",
        help="full: transformers' gradient checkpointing of every decoder layer")
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
    # -- baseline only: the peer a user would try -------------------------------------------------------------------
    add("--liger", action="store_true", help="Liger-Kernel's patch for the model's family (Trainer's use_liger_kernel)")
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
    if args.liger and args.compile:
        parser.error("--liger and --compile are two peers to compare against: pick one")
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


def add_adapters(model, rank, alpha=None, dropout=0.0, targets=None, nf4_base=False):
    """peft's LoRA on the model, in place: every target Linear of the decoder layers (default: all of them, peft's
    "all-linear", which leaves out the lm_head) becomes a LoraLayer around it, and every other parameter is frozen
    (requires_grad False: no gradient, no optimizer state). nf4_base first stores the decoder Linears in NF4. Returns
    the PeftModel, for saving the adapters and merging them; training calls the model itself, which is what peft's
    forward calls for LoRA."""
    from peft import LoraConfig, get_peft_model
    if targets:  # peft's own error for a missing target names no alternative: this one lists them
        linears = {name.rsplit(".", 1)[-1] for name, module in model.model.layers.named_modules()
                   if isinstance(module, torch.nn.Linear)}
        unknown = sorted(set(targets) - linears)
        if unknown:
            raise SystemExit(f"error: --lora-targets {' '.join(unknown)}: no such Linear in "
                             f"{model.config.model_type}'s decoder layers; its Linears: {' '.join(sorted(linears))}")
    if nf4_base:
        quantize_to_nf4(model)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=dropout,
                        target_modules=targets or "all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def apply_lora(args, model):
    """add_adapters with the run's --lora flags; None without --lora."""
    if args.lora is None:
        return None
    return add_adapters(model, args.lora, args.lora_alpha, args.lora_dropout, args.lora_targets, args.qlora)


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


def describe_adapters(report):
    """The header's LoRA line, from lora_report."""
    return (f"LoRA: rank {report['r']}, alpha {report['alpha']:g}, dropout {report['dropout']:g} on {report['targets']}"
            f"{', base in NF4' if report['base_format'] == 'nf4' else ''}: {report['trainable_params']:,} of "
            f"{report['total_params']:,} parameters train")


def dequantize_nf4(model):
    """The NF4 weights of --qlora back in their original dtype (merging adds the adapters to dense weights)."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(weight, "get_original_weight"):  # torchao's NF4Tensor
            module.weight = torch.nn.Parameter(weight.get_original_weight(), requires_grad=False)


# ----------------------------------------------------------------------------------------------------------------------
# Data: batches of [3, rows, T] = the token ids, the shifted labels (-100: not a target) and the position ids.
#   text: one token stream cut into --seq-len windows; every token is a target (labels = the inputs, shifted).
#   chat (`messages`) and prompt/completion rows: one tokenized conversation each, its answers the only targets;
#   packed (whole conversations in rows of --seq-len tokens, positions restarting at each) or padded (one per row).

# A local data file is read by the datasets builder of its format, as load_dataset(<builder>, data_files=...) does.
DATA_FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
DATA_FORMATS = ["auto", "text", "chat", "prompt-completion"]
# Without a tokenizer (a built-in architecture, or a model whose tokenizer is not here) conversations are rendered
# with this template and their UTF-8 bytes are the token ids: each turn a "<|role|>" line closed by "<|end|>", which an
# answer's targets include, so the model learns where an answer ends.
BYTE_CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
                      "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


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


def read_rows(args, source):
    """The rows of `source` one at a time (data_rows); data that cannot be read ends the run with one error line."""
    try:
        yield from data_rows(source, offline=not args.allow_download)
    except Exception as err:  # datasets raises many types for "not cached", "no network", "not JSON", ...
        cause = err
        while not isinstance(cause, UnicodeDecodeError) and (cause.__cause__ or cause.__context__):
            cause = cause.__cause__ or cause.__context__  # a decoding error arrives wrapped in datasets' own
        what = (f"not UTF-8 text (byte 0x{cause.object[cause.start]:02x}); re-encode it as UTF-8"
                if isinstance(cause, UnicodeDecodeError) else f"cannot be read: {first_line(err)}")
        if not args.allow_download and not Path(source).exists():  # a Hub data set name, read from the cache only
            what += "; --allow-download fetches it from the Hub"
        raise SystemExit(f"error: data {source}: {what}") from None


def row_format(row, text_field):
    """The format a row's fields say: chat (`messages`), prompt-completion, text (--text-field), or None."""
    if "messages" in row:
        return "chat"
    if "prompt" in row and "completion" in row:
        return "prompt-completion"
    return "text" if text_field in row else None


def missing_fields(source, index, row, args):
    """The one error line for a row without the fields of --data-format."""
    wanted = {"text": repr(args.text_field), "chat": "'messages'", "prompt-completion": "'prompt' and 'completion'",
              "auto": f"{args.text_field!r}"}[args.data_format]
    return SystemExit(f"error: data {source}: no field {wanted} (its fields: {', '.join(map(str, row))}) in row "
                      f"{index}; name the text column with --text-field, or give chat rows ('messages') or "
                      f"prompt/completion rows ('prompt', 'completion')")


def resolve_data_format(args):
    """--data-format auto: the format of --data's first row (synthetic or empty data: text). Afterwards
    args.data_format is text, chat or prompt-completion; --eval-data must hold rows of the same format."""
    if args.data_format == "auto":
        first = None if args.data == "synthetic" else next(iter(read_rows(args, args.data)), None)
        if first is not None and row_format(first, args.text_field) is None:
            raise missing_fields(args.data, 0, first, args)
        args.data_format = "text" if first is None else row_format(first, args.text_field)
    return args.data_format


def packed_documents(args):
    """Whether rows hold several conversations, told apart by their position ids (which the model is then given)."""
    return args.data_format != "text" and args.packing == "on"


def choose_attention(args):
    """--attn-implementation auto: sdpa, but for packed conversations on a GPU, where attention must stay inside each
    conversation, the implementation that skips the work across them: flash_attention_2 where flash-attn is installed
    (transformers turns the restarting position ids into cu_seqlens, its variable-length kernel computes only the
    blocks within conversations), else flex_attention (a BlockMask of the documents: blocks across them are skipped).
    sdpa with packed rows gets a dense [rows, 1, T, T] document mask and runs its masked kernel over every block: the
    CPU's choice (correct; FlexAttention has no backward on the CPU). Returns why, for the header."""
    if args.attn_implementation != "auto":
        return "as given"
    if not (packed_documents(args) and HAS_CUDA):
        args.attn_implementation = "sdpa"
        return ("packed conversations on the CPU: a dense document mask" if packed_documents(args)
                else "no packed conversations: the causal kernel without a mask")
    import importlib.util
    has_flash = importlib.util.find_spec("flash_attn") is not None
    args.attn_implementation = "flash_attention_2" if has_flash else "flex_attention"
    return ("packed conversations: flash-attn's variable-length kernel" if has_flash else
            "packed conversations: FlexAttention with a document BlockMask (flash-attn is not installed)")

def torch_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                           max_length_q=None, **kwargs):
    """transformers' attention interface over torch's own variable-length attention (torch.nn.attention.varlen:
    FlashAttention inside torch, CUDA only): the rows' tokens become one ragged batch whose sequences start at
    cu_seq_lens_q (the packed conversations, from attention_inputs; without them each row is one sequence), each
    causal within itself, so nothing is computed across conversations. query [B, Hq, T, D], key and value
    [B, Hkv, T, D]; returns [B, T, Hq, D] and no weights, as transformers' attention functions do."""
    from torch.nn.attention.varlen import varlen_attn
    batch, heads, length, head_dim = query.shape
    if cu_seq_lens_q is None:
        cu_seq_lens_q = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=query.device)
        max_length_q = length
    window = getattr(module, "sliding_window", None)  # a sliding-window layer sees its last `window` tokens

    def ragged(x):  # [B, H, T, D] -> [B*T, H, D]
        return x.transpose(1, 2).reshape(batch * length, x.shape[1], head_dim)
    out = varlen_attn(ragged(query), ragged(key), ragged(value), cu_seq_lens_q, cu_seq_lens_q, max_length_q,
                      max_length_q, scale=scaling, window_size=(-1 if window is None else window - 1, 0),
                      enable_gqa=key.shape[1] != heads)
    return out.view(batch, length, heads, head_dim), None


# Registered under its name with the mask function of transformers' FlashAttention (no mask tensor: the conversations'
# boundaries travel as cu_seq_lens), so --attn-implementation torch_varlen works like transformers' own names.
AttentionInterface.register("torch_varlen", torch_varlen_attention)
AttentionMaskInterface.register("torch_varlen", flash_attention_mask)
# The implementations that take packed rows as cu_seq_lens (transformers derives them from position ids in every layer
# unless they are given).
VARLEN_ATTENTION = ["flash_attention_2", "flash_attention_3", "torch_varlen"]


def attention_inputs(model, position_ids):
    """The model's keyword arguments for a micro-batch's packed rows (position_ids None: plain rows, nothing to add):
    the position ids, and for the variable-length kernels the conversations' boundaries (cu_seq_lens, the longest
    length), found once per micro-batch with transformers' own helper instead of once per layer. The longest length
    is a number on the host: one sync per micro-batch, which these kernels need to size their launch."""
    if position_ids is None:
        return {}
    if model.config._attn_implementation not in VARLEN_ATTENTION:
        return {"position_ids": position_ids}
    (cu_seq_lens_q, cu_seq_lens_k), (max_length_q, max_length_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    return {"position_ids": position_ids, "cu_seq_lens_q": cu_seq_lens_q, "cu_seq_lens_k": cu_seq_lens_k,
            "max_length_q": int(max_length_q), "max_length_k": int(max_length_k)}


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
    for index, row in enumerate(read_rows(args, source)):
        if args.text_field not in row:
            raise missing_fields(source, index, row, args)
        if not isinstance(text := row[args.text_field], str):
            raise SystemExit(f"error: data {source}: row {index}: field {args.text_field!r} holds {text!r:.40}, "
                             f"not text")
        ids += encode(text) + [eos_id] if text.strip() else []
        if len(ids) >= tokens_needed:  # stop early: a big corpus needs only as many tokens as the run trains on
            break
    if not ids:
        raise SystemExit(f"error: data {source}: contains no text in field {args.text_field!r}")
    return torch.tensor(ids, dtype=torch.long)


def chat_template_of(args, tokenizer):
    """The template conversations are rendered with: --chat-template FILE, else the tokenizer's, else (no tokenizer)
    the built-in byte-level one. A tokenizer without a template and no FILE is an error: guessing one would train a
    format the model is never prompted with."""
    if args.chat_template:
        try:
            return Path(args.chat_template).read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise SystemExit(f"error: --chat-template {args.chat_template}: {first_line(err)}") from None
    if tokenizer is None:
        return BYTE_CHAT_TEMPLATE
    if not tokenizer.chat_template:
        raise SystemExit(f"error: the tokenizer of {args.model} has no chat template: give one with --chat-template "
                         f"FILE (a Jinja template, as in a tokenizer_config.json)")
    return tokenizer.chat_template


def render_chat(messages, template, tokenizer, add_generation_prompt):
    """The conversation as text, through the chat template: the tokenizer's apply_chat_template, or without a
    tokenizer transformers' own Jinja renderer (the same function apply_chat_template calls)."""
    if tokenizer is not None:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    from transformers.utils.chat_template_utils import render_jinja_template
    return render_jinja_template([messages], chat_template=template, add_generation_prompt=add_generation_prompt)[0][0]


def encode_with_offsets(text, tokenizer, add_special_tokens):
    """(token ids, the character each token starts at): the tokenizer's offsets, or each UTF-8 byte and its char."""
    if tokenizer is None:
        return ([byte for char in text for byte in char.encode("utf-8")],
                [index for index, char in enumerate(text) for _ in char.encode("utf-8")])
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return encoded["input_ids"], [start for start, _ in encoded["offset_mapping"]]


def check_messages(source, index, messages):
    """A `messages` value must be a list of {"role": str, "content": str} turns: one error line otherwise."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)
            for turn in messages):
        raise SystemExit(f"error: data {source}: row {index}: 'messages' must be a list of turns like "
                         f"{{\"role\": \"user\", \"content\": \"...\"}}, got {messages!r:.60}")


def conversation_tokens(args, source, index, row, template, tokenizer, eos_id):
    """(token ids, target flags) of one chat or prompt/completion row; None where it has no answer to train on.

    Targets are the tokens of the answers: each assistant turn as the template renders it (its end-of-turn tokens
    included), or the completion followed by EOS; --train-on-prompt makes every token a target. An answer's span is
    found by rendering the conversation up to it twice: up to the turn before with the generation prompt (where the
    answer starts) and through the answer (where it ends); tokens starting inside a span are targets. This needs a
    template that renders a conversation turn by turn, as chat templates do for generation."""
    if args.data_format == "prompt-completion":
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):  # plain text: no template, EOS ends the answer
            if not completion.strip():
                return None
            ids, starts = encode_with_offsets(prompt + completion, tokenizer, add_special_tokens=True)
            targets = [args.train_on_prompt or start >= len(prompt) for start in starts]
            # a special token the tokenizer adds (BOS) has offset 0: part of the prompt
            return ids + [eos_id], targets + [True]
        messages, first_answer = ([*prompt, *completion], len(prompt)) if isinstance(prompt, list) and isinstance(
            completion, list) else (None, 0)
        if messages is None:
            raise SystemExit(f"error: data {source}: row {index}: 'prompt' and 'completion' must both be text or both "
                             f"lists of turns")
    else:
        messages, first_answer = row["messages"], 0
    check_messages(source, index, messages)
    try:
        text = render_chat(messages, template, tokenizer, add_generation_prompt=False)
        spans = []
        for turn in range(first_answer, len(messages)):
            if messages[turn]["role"] == "assistant":
                start = render_chat(messages[:turn], template, tokenizer, add_generation_prompt=True)
                end = render_chat(messages[:turn + 1], template, tokenizer, add_generation_prompt=False)
                if not (text.startswith(start) and text.startswith(end) and len(start) <= len(end)):
                    raise ValueError("it does not render a conversation turn by turn (a shorter conversation's "
                                     "text is not the start of a longer one's), so the answers cannot be located")
                spans.append((len(start), len(end)))
    except Exception as err:  # jinja2's errors, the template's own raise_exception, ours above
        raise SystemExit(f"error: data {source}: row {index}: the chat template does not render it: "
                         f"{first_line(err)}") from None
    if not spans:
        return None
    ids, starts = encode_with_offsets(text, tokenizer, add_special_tokens=False)  # the template writes BOS itself
    return ids, [args.train_on_prompt or any(a <= start < b for a, b in spans) for start in starts]


def load_conversations(args, source, eos_id, tokenizer, rows_needed):
    """[(token ids, shifted labels)] of the chat or prompt/completion rows of `source`, read until they fill
    rows_needed rows of --seq-len (packed: a quarter more tokens than the rows hold, as first fit leaves some room in
    each row) or give rows_needed conversations (padded). Each conversation's labels are
    shifted within it: its last position predicts nothing, so no position learns the next conversation's first token.
    A conversation longer than --seq-len is cut to it; one without an answer is skipped; both are counted."""
    template = chat_template_of(args, tokenizer)
    conversations, tokens, skipped, truncated = [], 0, 0, 0
    for index, row in enumerate(read_rows(args, source)):
        if row_format(row, args.text_field) != args.data_format:
            raise missing_fields(source, index, row, args)
        ids, targets = conversation_tokens(args, source, index, row, template, tokenizer, eos_id) or ([], [])
        truncated += len(ids) > args.seq_len
        ids, targets = ids[:args.seq_len], targets[:args.seq_len]
        if not any(targets[1:]):  # no answer (within --seq-len); the first token is never predicted
            skipped += 1
            continue
        labels = [token if target else -100 for token, target in zip(ids[1:], targets[1:])] + [-100]
        conversations.append((ids, labels))
        tokens += len(ids)
        if len(conversations) >= rows_needed and (args.packing == "off" or tokens >= 1.25 * rows_needed * args.seq_len):
            break
    what = ("an assistant turn" if args.data_format == "chat" else "a completion") + f" within {args.seq_len} tokens"
    if not conversations:
        raise SystemExit(f"error: data {source}: no row has {what} to train on ({skipped} read)")
    print(f"data {source}: {len(conversations)} conversations" + (f", {skipped} without {what} skipped" * bool(skipped))
          + (f", {truncated} longer than --seq-len {args.seq_len} truncated" * bool(truncated))
          + ("" if tokenizer else ", tokenized as UTF-8 bytes with the built-in chat template (no tokenizer)"))
    return conversations


def pack_conversations(conversations, seq_len):
    """Rows of whole conversations, each at most seq_len tokens: first fit, in order (each conversation goes into the
    first row with room for it, so short ones fill the gaps the long ones leave). Returns lists of indices."""
    rows, free = [], []
    for index, (ids, _) in enumerate(conversations):
        row = next((r for r, room in enumerate(free) if room >= len(ids)), None)
        if row is None:
            rows.append([])
            free.append(seq_len)
            row = len(rows) - 1
        rows[row].append(index)
        free[row] -= len(ids)
    return rows


def conversation_rows(conversations, groups, length, pad_id):
    """[3, len(groups), length] tensors: each group's conversations side by side, padded at the end. Positions restart
    at 0 at every conversation (and in the padding, which then counts as one more document): transformers sees
    the boundaries in them and keeps attention within each conversation, and RoPE gets each token's own position."""
    fields = torch.full((3, len(groups), length), -100, dtype=torch.long)
    fields[0] = pad_id
    for row, group in enumerate(groups):
        at = 0
        for ids, labels in (conversations[index] for index in group):
            fields[0, row, at:at + len(ids)] = torch.tensor(ids)
            fields[1, row, at:at + len(ids)] = torch.tensor(labels)
            fields[2, row, at:at + len(ids)] = torch.arange(len(ids))
            at += len(ids)
        fields[2, row, at:] = torch.arange(length - at)
    return fields


def make_batches(args, split, vocab_size, eos_id, tokenizer, device, rank=0, world_size=1):
    """The batches of "train" (--steps steps of --grad-accum-steps micro-batches of --data) or "eval" (--eval-batches
    of --eval-data, or of the end of --data with --eval-split), each [3, batch, T] (token ids, shifted labels,
    positions), and the real (not padding) tokens of each step over all ranks. The same arguments give the same
    batches: --resume continues the data where the checkpoint left it. --fsdp: rank r trains rows r::world_size."""
    resolve_data_format(args)
    n_batches = args.steps * args.grad_accum_steps if split == "train" else args.eval_batches
    per_step = args.grad_accum_steps if split == "train" else 1
    rows = world_size * args.batch_size
    tokens_needed = n_batches * rows * args.seq_len
    source = args.eval_data if split == "eval" and args.eval_data else args.data
    if args.data_format != "text":
        # --eval-split: read what training needs plus the held-out share, then hold out the last conversations
        rows_needed = math.ceil(args.steps * args.grad_accum_steps * rows / (1 - args.eval_split)) \
            if args.eval_split else n_batches * rows
        conversations = load_conversations(args, source, eos_id, tokenizer, rows_needed)
        if args.eval_split:
            cut = min(max(1, int(len(conversations) * (1 - args.eval_split))), len(conversations) - 1)
            conversations = conversations[:cut] if split == "train" else conversations[cut:]
        if max(max(ids) for ids, _ in conversations) >= vocab_size:
            raise SystemExit(f"error: data {source}: token ids outside the model's vocabulary ({vocab_size})")
        groups = (pack_conversations(conversations, args.seq_len) if args.packing == "on"
                  else [[index] for index in range(len(conversations))])
        if len(groups) < n_batches * rows:
            print(f"{split} data fills {len(groups)} rows, the run needs {n_batches * rows}: cycling through them")
            groups = (groups * -(-n_batches * rows // len(groups)))
        groups = groups[:n_batches * rows]
        steps = []
        for first in range(0, len(groups), per_step * rows):  # padded: each step to its longest conversation
            step_groups = groups[first:first + per_step * rows]
            length = args.seq_len if args.packing == "on" else max(
                sum(len(conversations[index][0]) for index in group) for group in step_groups)
            steps.append(conversation_rows(conversations, step_groups, length, eos_id).view(3, per_step, rows, length)
                         .transpose(0, 1)[:, :, rank::world_size].contiguous().to(device))
        real_tokens = [sum(len(conversations[index][0]) for group in groups[first:first + per_step * rows]
                           for index in group) for first in range(0, len(groups), per_step * rows)]
        fill = sum(real_tokens) / sum(step.shape[0] * rows * step.shape[-1] for step in steps)
        return {"steps": steps if split == "train" else [step[0] for step in steps], "real_tokens": real_tokens,
                "fill": fill, "conversations": len(conversations),
                "tokenized_by": "the built-in chat template over UTF-8 bytes" if tokenizer is None else "the tokenizer"}
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
    # Consecutive seq_len windows of the stream, every token a target (no padding; attention crosses document
    # boundaries, the usual simplification for pre-training-style text).
    input_ids = stream[:tokens_needed].view(n_batches, rows, args.seq_len)[:, rank::world_size]
    batches = text_batch(input_ids).view(n_batches // per_step, per_step, 3, *input_ids.shape[1:]).to(device)
    return {"steps": batches if split == "train" else batches[:, 0], "real_tokens": [per_step * rows * args.seq_len]
            * (n_batches // per_step), "fill": 1.0, "conversations": None,
            "tokenized_by": "random ids" if source == "synthetic" else "UTF-8 bytes" if tokenizer is None
            else "the tokenizer"}


def text_batch(input_ids):
    """[..., 3, rows, T] of text windows [..., rows, T]: the ids, their labels shifted, positions 0..T-1 in each row."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    return torch.stack([input_ids, shift_labels_of(input_ids), positions], dim=-3).contiguous()


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


def targets_per_rank(micro_batches, world_size):
    """The divisor of an optimizer step's (or an evaluation's) summed per-token losses: its target tokens over all
    micro-batches and ranks, divided by the number of ranks, because FSDP averages the ranks' gradients. Each
    micro-batch's sum over this divisor then adds up to the token-weighted mean of the whole step, however the targets
    fall between micro-batches and ranks. A device tensor: counting and the all-reduce need no host sync."""
    count = sum((labels != -100).sum() for _, labels, _ in micro_batches)
    if world_size > 1:
        dist.all_reduce(count)  # a collective on the device, not a host sync
    return count.float() / world_size


# ----------------------------------------------------------------------------------------------------------------------
# Loss: THE part the kernels change (compare with finetune_optimized.py)

def apply_liger(model):
    """What transformers' Trainer(use_liger_kernel=True) calls: Liger-Kernel's patch for the model's family (RoPE,
    RMSNorm, the gated MLP, the fused linear cross-entropy). Returns how many modules it patched (65 + 32 for 8B)."""
    if not HAS_CUDA:
        raise SystemExit("error: --liger needs a CUDA GPU (Liger-Kernel's Triton kernels have no CPU path)")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as err:
        raise SystemExit(f"error: --liger needs the liger-kernel package ({err}); pip install liger-kernel")
    _apply_liger_kernel_to_instance(model=model)
    patched = sum(module._get_name().startswith("Liger") for module in model.modules())  # Liger renames what it patches
    if not patched:
        raise SystemExit(f"error: --liger: Liger-Kernel has no patch for {model.config.model_type} models")
    return patched


def compute_loss(model, input_ids, shift_labels, loss_impl, position_ids=None, num_targets=None):
    """(loss, token accuracy): the mean over the non-ignored positions of the loss and of the hits (the most likely
    token is the label), or with num_targets (targets_per_rank) their sums divided by it: the micro-batch's share of
    its step's token-weighted means. position_ids: per-token positions of packed rows (None: 0..T-1 in every row)."""
    if loss_impl == "liger":
        # Liger's fused linear cross-entropy lives in its patched forward, which takes that path when it is given
        # labels (shift_labels: transformers' keyword for already-shifted ones) and skip_logits, also in evaluation.
        # Its kernel finds the token accuracy in the same pass when asked (what TRL passes to log it).
        # num_items_in_batch: transformers' name for the divisor of summed losses (Liger's loss then sums).
        out = model(input_ids=input_ids, **attention_inputs(model, position_ids), shift_labels=shift_labels,
                    skip_logits=True, return_token_accuracy=True, num_items_in_batch=num_targets)
        return out.loss, token_share(out.token_accuracy, shift_labels, num_targets)
    logits = model(input_ids=input_ids, **attention_inputs(model, position_ids)).logits  # [B, T, V], model's dtype
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

    def __init__(self, model, loss_impl):
        super().__init__()
        self.model, self.loss_impl = model, loss_impl

    def forward(self, input_ids, shift_labels, position_ids=None, num_targets=None):
        return compute_loss(self.model, input_ids, shift_labels, self.loss_impl, position_ids, num_targets)


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


def save_checkpoint(args, step, model, optimizers, schedulers, rank, world_size):
    """Writes DIR/checkpoint-<step> the stock way, training waiting: model and optimizer state with dcp.save (every
    rank its own shards), the schedule, the step (the data position: the batches are a function of the arguments) and
    the RNG states, all as .partial-checkpoint-<step>, renamed when whole; only then do checkpoints beyond
    --save-total-limit go: a run killed at any moment leaves the last complete checkpoint whole."""
    out, t0 = Path(args.output_dir), time.perf_counter()
    partial, final = out / f".partial-checkpoint-{step}", out / f"checkpoint-{step}"
    model_state, optimizer_state = get_state_dict(model, optimizers, options=FLAT_STATE)
    size = sum(t.numel() * t.element_size() for part in (model_state, optimizer_state) for t in part.values()
               if isinstance(t, torch.Tensor))  # a sharded tensor counts its global size
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if size > free:
        raise SystemExit(f"error: checkpoint-{step} needs {size / 2**30:.1f} GiB and {out} has {free / 2**30:.1f} GiB "
                         f"free; the earlier checkpoints are kept")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # what a run killed while writing this step left
    try:
        with warnings.catch_warnings():  # one process without a process group is the intended use here
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=partial)
        if rank == 0:
            torch.save({"step": step, "world_size": world_size, "model": args.model, "rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state_all() if HAS_CUDA else [],
                        "scheduler": schedulers[0].state_dict(), "lora": lora_settings(args)},
                       partial / "trainer_state.pt")
            partial.rename(final)
            for old in checkpoints(args.output_dir)[:-args.save_total_limit]:
                shutil.rmtree(old)
    except (Exception, CheckpointException) as err:  # DCP's own type, a BaseException, wraps the writer's OSError
        raise SystemExit(f"error: writing {final} failed ({str(err).strip().splitlines()[-1][:300]}); the earlier "
                         f"checkpoints are kept") from None
    if world_size > 1:
        dist.barrier()  # every rank's shards are in place before any rank writes the next checkpoint
    return {"step": step, "bytes": size, "write_s": time.perf_counter() - t0}


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
    dist.init_process_group("nccl" if HAS_CUDA else "gloo", device_id=torch.device(device) if HAS_CUDA else None)
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
    now: the results, the checkpoints, the final model."""
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
    records, step_times, evals, saved = [], [], [], []
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
        if args.save_steps and step % args.save_steps == 0:
            saved.append(save_checkpoint(args, step, model_with_loss.model, optimizers, schedulers, rank, world_size))
    progress.close()
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
        print(f"checkpoint      : {checkpoint['bytes'] / 2**30:.2f} GiB written in {checkpoint['write_s']:.1f} s (step "
              f"{checkpoint['step']}, {len(saved)} written)")
    return {"shape": f"{args.batch_size}x{args.seq_len}", "tokens_per_step": sum(tokens_per_step) / args.steps,
            "real_tokens_per_step": tokens_per_step, "row_fill": batches["train"]["fill"],
            "conversations": batches["train"]["conversations"], "tokenized_by": batches["train"]["tokenized_by"],
            "steps": args.steps,
            "start_step": start_step, "warmup_steps": warmup_steps, "tokens_per_s": tokens_per_s,
            "avg_step_ms": avg_step_ms, "peak_memory_gib": peak_gib[0], "peak_memory_gib_per_rank": peak_gib,
            "losses": losses, "token_accuracies": accuracies, "grad_norms": grad_norms,
            "step_ms": [1e3 * s for s in step_times], "evals": evals, "checkpoints": saved}

# ----------------------------------------------------------------------------------------------------------------------

def main(argv=None):
    """The script. A run too large for the GPU ends with one line that says what to change, not with a traceback
    through transformers."""
    try:
        return fine_tune(argv)
    except torch.OutOfMemoryError as err:
        torch_says = str(err).split(" Including")[0]  # "CUDA out of memory. Tried to allocate ... is free."
        raise SystemExit(f"error: out of memory on the GPU ({torch_says}). Shorter sequences or batches (--seq-len, "
                         f"--batch-size), --activation-checkpointing full, or --seq-len-search to find the longest "
                         f"that fits") from None


def fine_tune(argv=None):
    args = parse_args(argv)
    rank, world_size, device = init_distributed(args)
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if HAS_CUDA else torch.float32)
    info = run_info()
    resolve_data_format(args)  # before the model: the attention depends on it
    documents, attention_reason = packed_documents(args), choose_attention(args)
    data_kind = args.data_format + (f", packing {args.packing}" if args.data_format != "text" else "")
    torch.manual_seed(args.seed)  # the same on every rank: identical random weights before FSDP shards them
    model, weights = load_model(args, device, dtype)
    model.config.use_cache = False  # training: no KV cache
    model.train()
    config = model.config
    lora_model = apply_lora(args, model)  # the PeftModel around model, or None

    # --- what this script changes about the model: nothing, or the peer's kernels ------------------------------------
    replaced, variant, loss_impl = {}, "compile" if args.compile else "baseline", "eager"
    if args.liger:
        replaced["liger_modules"], variant, loss_impl = apply_liger(model), "liger", "liger"
        info["liger_kernel"] = importlib.metadata.version("liger-kernel")  # the package has no __version__
    if args.activation_checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    model_with_loss = ModelWithLoss(model, loss_impl)
    if args.fsdp:
        # FSDP2: each decoder layer is one unit that all-gathers its parameters just before its forward (and again for
        # its backward), frees them after, and reduce-scatters its gradients; the root unit holds the rest.
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model_with_loss)
    step_module = (torch.compile(model_with_loss, backend=COMPILE_BACKEND, mode=args.compile_mode) if args.compile
                   else model_with_loss)
    # After fully_shard: the optimizer holds the sharded parameters (each rank updates its own shard).
    optimizers = [torch.optim.AdamW(trainable_parameters(model), lr=args.lr, foreach=args.optimizer == "adamw_foreach",
                                    fused=args.optimizer == "adamw_fused")]
    schedulers = [get_scheduler(LR_SCHEDULERS[args.lr_scheduler], optimizer, args.warmup_steps, args.steps)
                  for optimizer in optimizers]
    phase = {"now": "idle"}  # the part of the step that is running: names what ran out of memory

    def train_step(micro_batches):
        """One optimizer step over micro_batches ([grad_accum_steps, 3, batch, T]: token ids, shifted labels,
        positions); returns the loss and the token accuracy (token-weighted means over all the step's targets) and
        the gradient norm (None without clipping), as device tensors: no host sync."""
        num_targets = targets_per_rank(micro_batches, world_size)
        step_loss, step_accuracy = 0.0, 0.0
        for input_ids, shift_labels, position_ids in micro_batches:
            phase["now"] = "forward"
            loss, accuracy = step_module(input_ids, shift_labels, position_ids if documents else None, num_targets)
            phase["now"] = "backward"
            loss.backward()  # the micro-batch's summed losses over the step's targets: the step's gradient adds up
            step_loss = step_loss + loss.detach()
            step_accuracy = step_accuracy + accuracy
        phase["now"] = "optimizer step"
        grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm) if args.max_grad_norm
                     else None)
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
          f"data {args.data} ({data_kind}), checkpointing {args.activation_checkpointing}"
          + f", replaced {replaced}" * bool(replaced)
          + (f", FSDP2 over {world_size} ranks (batch {args.batch_size} per rank)" if args.fsdp else ""))
    if args.compile:
        print(f"torch.compile: backend {COMPILE_BACKEND}, mode {args.compile_mode}"
              + ("" if HAS_CUDA else " (no CUDA device: aot_eager traces the graphs, generates no code)"))
    result = {**info, "script": Path(__file__).name, "model": args.model, "weights": weights,
              "dtype": str(dtype).replace("torch.", ""), "variant": variant, "loss_impl": loss_impl,
              "replaced": replaced, "world_size": world_size, "options": vars(args),
              "lora": lora_report(args, model),
              "compile_backend": COMPILE_BACKEND if args.compile else None}
    out_path = Path(args.out) if args.out else default_out_path(args, weights, result["dtype"], variant, world_size)
    if args.seq_len_search:
        result.update(seq_len_search(args, train_step, phase, config.vocab_size, device))
    else:
        tokenizer, batches = load_data(args, config, device, rank, world_size)
        start_step = resume(args, model, optimizers, schedulers, world_size) if args.resume else 0
        result.update(train(args, train_step, model_with_loss, optimizers, schedulers, batches, start_step, variant,
                            rank, world_size))
        if args.output_dir:
            result["final_model"] = save_final(args, model, lora_model, tokenizer, rank)
    write_results(result, out_path, rank)
    if args.fsdp:
        end_distributed_run()


if __name__ == "__main__":
    main()
