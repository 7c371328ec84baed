"""Full fine-tuning of LLaMA-3.1-8B with stock PyTorch + transformers: the BASELINE.

The playbook's step 11, first half, as a user of the stock tools writes it: one loop read top to bottom (nanoGPT's
train.py style) of forward -> loss -> backward -> gradient clipping -> AdamW -> learning-rate schedule, with held-out
evaluation, checkpoints to resume from, the model saved with save_pretrained, and a summary (tokens/s, peak GPU memory)
plus a JSON file. Its options are the stock ones: fused or foreach AdamW, transformers' gradient checkpointing,
torch.compile, Liger-Kernel (--liger, the peer to beat), FSDP2, local data sets, TensorBoard. finetune_optimized.py is
this script plus what is ours: `diff finetune_baseline.py finetune_optimized.py` shows exactly that. README.md tells
which models and data it takes (without cached weights: the same architecture with RANDOM weights, said so).

    python finetune_baseline.py                                 # 20 steps at 1x512 (without a GPU: tiny LLaMA, 1x32)
    python finetune_baseline.py --liger --seq-len 8192 --activation-checkpointing full
    python finetune_baseline.py --data corpus.txt --output-dir runs/ft --save-steps 200 --eval-split 0.05 [--resume]
    python finetune_baseline.py --seq-len-search 4096,8192,12288,16384   # longest batch-1 sequence that trains
    torchrun --standalone --nproc-per-node 2 finetune_baseline.py --fsdp  # or accelerate launch --multi_gpu ...
"""
import argparse
import datetime
import gc
import importlib.metadata
import json
import logging
import math
import os
import platform
import re
import shutil
import socket
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

# transformers imports torchao where it is installed (requirements.txt has it for finetune_optimized.py --fp8) to
# register its quantizer; torchao then logs that its CUDA-only extensions do not load, and torch that torchao registers
# enums the deprecated way. Neither concerns these runs: those two loggers show errors only.
for noisy_logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(noisy_logger).setLevel(logging.ERROR)

import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler
from transformers.utils import is_accelerate_available

HERE = Path(__file__).resolve().parent
HAS_CUDA = torch.cuda.is_available()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COMPILE_MODES = ["default", "reduce-overhead", "max-autotune-no-cudagraphs"]
# The attention implementations transformers trains LLaMA with (its "paged|..." variants serve generation).
ATTN_IMPLEMENTATIONS = ["sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"]
# Without a GPU, --compile uses aot_eager: it traces the step as inductor would but generates no code (inductor's C++
# for the CPU takes ~30 s to compile even the tiny model on 2 cores and would speed up nothing that matters).
COMPILE_BACKEND = "inductor" if HAS_CUDA else "aot_eager"
# transformers' names of the schedules: "constant" holds the rate after the warm-up, the others decay it to 0.
LR_SCHEDULERS = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}
# Checkpoints store the optimizer state keyed by parameter name, one flat entry per tensor: the same layout for one
# AdamW over all parameters and for one AdamW per parameter, and resharded on load under FSDP2.
FLAT_STATE = StateDictOptions(flatten_optimizer_state_dict=True)


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    # expanduser here, once: the weights and the tokenizer then read the same folder, also for --model=~/models/x
    add("--model", default="meta-llama/Llama-3.1-8B" if HAS_CUDA else "tiny", type=os.path.expanduser,
        help='Hub id or local folder (save_pretrained, or just a config.json); a name in configs/ (tiny, '
             'tiny-<family>, qwen3-8b, gemma-2-9b, ...) builds that architecture with random weights')
    add("--dtype", choices=["auto", *DTYPES], default="auto", help="auto = bf16 on CUDA, fp32 on CPU")
    add("--attn-implementation", choices=ATTN_IMPLEMENTATIONS, default="sdpa", help="transformers' attention "
        "(flash_attention_2/3 need the flash-attn package, flex_attention a GPU)")
    add("--allow-download", action="store_true", help="let from_pretrained/load_dataset reach the Hub")
    add("--strict-weights", action="store_true", help="fail where the weights cannot be loaded (no random weights)")
    # -- training --------------------------------------------------------------------------------------------------
    add("--steps", type=int, default=20, help="optimizer steps; the first one (two with --compile-mode "
        "reduce-overhead) is a warm-up left out of the timing")
    add("--batch-size", type=int, default=1, help="sequences per micro-batch (per rank with --fsdp)")
    add("--seq-len", type=int, default=512 if HAS_CUDA else 32,
        help="tokens per sequence, at least 2 (32 without a GPU: the Triton interpreter is slow)")
    add("--grad-accum-steps", type=int, default=1, help="micro-batches whose gradients are summed per optimizer step")
    add("--optimizer", choices=["adamw_fused", "adamw_foreach"], default="adamw_fused", help="torch AdamW's kernels")
    add("--lr", type=float, default=1e-5, help="peak AdamW learning rate")
    add("--lr-scheduler", choices=list(LR_SCHEDULERS), default="constant",
        help="the rate after --warmup-steps of linear warm-up: held (constant), or decayed to 0 at --steps")
    add("--warmup-steps", type=int, default=0, help="learning-rate warm-up steps")
    add("--max-grad-norm", type=float, default=1.0, help="clip the gradients' global norm to this (0: no clipping)")
    add("--seed", type=int, default=0, help="seeds the random weights and the synthetic tokens")
    add("--activation-checkpointing", choices=["none", "full"], default="none",
        help="transformers' gradient checkpointing: full = recompute every decoder layer in the backward")
    # -- data and evaluation ---------------------------------------------------------------------------------------
    add("--data", default="synthetic", help='"synthetic" (random tokens), a save_to_disk folder, a local '
        '.txt/.json/.jsonl/.parquet/.csv file, or a Hub data set name')
    add("--text-field", default="text", help="the column of --data (and --eval-data) that holds the text")
    add("--eval-data", default=None, help="held-out data, read like --data")
    add("--eval-split", type=float, default=None, help="instead of --eval-data: hold out this fraction of the tokens "
        "read from --data (its end)")
    add("--eval-steps", type=int, default=None, help="evaluate every N steps (and always after the last step)")
    add("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    # -- saving ----------------------------------------------------------------------------------------------------
    add("--output-dir", default=None, help="where the fine-tuned model (DIR/final, save_pretrained), the checkpoints "
        "(DIR/checkpoint-<step>) and the results JSON go")
    add("--save-steps", type=int, default=None, help="write a checkpoint every N steps (needs --output-dir)")
    add("--save-total-limit", type=int, default=1, help="checkpoints kept (the oldest deleted once a new one is whole)")
    add("--resume", action="store_true", help="continue from the latest complete checkpoint in --output-dir")
    add("--tensorboard", default=None, metavar="DIR", help="loss, lr, tokens/s, held-out loss as TensorBoard scalars")
    add("--out", default=None, help="JSON results path (default: DIR/results.json with --output-dir, else a file in "
        "runs/ named after the run's options)")
    add("--log-interval", type=int, default=1, help="update the progress line every N steps")
    # -- measurements ----------------------------------------------------------------------------------------------
    add("--seq-len-search", default=None, metavar="L1,L2,...", help="instead of training: one step per length at "
        "batch 1 after a warm-up step (it creates the optimizer state): trained / out of memory (where) / not tried")
    add("--warmup-seq-len", type=int, default=None,
        help="with --seq-len-search: tokens of the warm-up step (default: the first length, at most 2048)")
    add("--fsdp", action="store_true", help="shard the model with FSDP2 over the processes of torchrun or accelerate")
    add("--compile", action="store_true", help="torch.compile the model with its loss (on the first step)")
    add("--compile-mode", choices=COMPILE_MODES, default="default", help="torch.compile's mode")
    # -- baseline only: the peer a user would try -------------------------------------------------------------------
    add("--liger", action="store_true", help="Liger-Kernel's patch for the model's family (Trainer's use_liger_kernel)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "log_interval", "grad_accum_steps", "eval_batches",
                 "save_total_limit", "eval_steps", "save_steps"):
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
        parser.error(f"--resume: no complete checkpoint in {args.output_dir} (nothing to resume; drop --resume to "
                     f"start a new run there)")
    if args.attn_implementation == "flex_attention" and not HAS_CUDA:
        parser.error("--attn-implementation flex_attention needs a GPU: FlexAttention has no backward on the CPU")
    if args.out and Path(args.out).is_dir():  # checked now: the results are written only at the end of the run
        parser.error(f"--out {args.out} is a directory: give the path of the file to write")
    if args.compile_mode != "default" and not args.compile:
        parser.error("--compile-mode goes with --compile")
    if args.compile_mode != "default" and COMPILE_BACKEND != "inductor":
        parser.error(f"--compile-mode needs a GPU: without one, --compile uses the {COMPILE_BACKEND} backend, which "
                     f"has no modes")
    if getattr(args, "liger", False) and args.compile:
        parser.error("--liger and --compile are two peers to compare against: pick one")
    if args.warmup_seq_len is not None and (args.warmup_seq_len < 2 or not args.seq_len_search):
        parser.error("--warmup-seq-len is the --seq-len-search warm-up's length, at least 2")
    if args.seq_len_search:
        try:
            args.seq_len_search = [int(x) for x in args.seq_len_search.split(",")]
        except ValueError:
            parser.error("--seq-len-search takes comma-separated integers, e.g. 4096,8192,12288")
        if args.seq_len_search != sorted(set(args.seq_len_search)) or min(args.seq_len_search) < 2:
            parser.error("--seq-len-search lengths must be at least 2 and increasing")
    if args.fsdp:
        combined = [name for name in ("seq_len_search", "compile", "liger") if getattr(args, name, None)]
        if combined:
            parser.error(f"--fsdp cannot be combined with --{combined[0].replace('_', '-')}")
        if "WORLD_SIZE" not in os.environ:
            parser.error(f"--fsdp needs a distributed launcher, e.g. torchrun --standalone --nproc-per-node 2 "
                         f"{Path(__file__).name} --fsdp or accelerate launch --multi_gpu --num_processes 2 "
                         f"{Path(__file__).name} --fsdp (torchrun --nproc-per-node 1 for a single process)")
    return args


# ----------------------------------------------------------------------------------------------------------------------
# What ran, where, with which versions (the header and the JSON); the name of the JSON

def run_info():
    """What ran, where, with which versions. The GIT_COMMIT and GIT_DIRTY environment variables, when set, name the
    commit a copied tree was taken from (a copy on a GPU box may carry no .git, or a stale one). The host's CPU sets
    the pace of host-bound steps, so figures from different hosts differ."""
    import triton
    commit, dirty = os.environ.get("GIT_COMMIT"), os.environ.get("GIT_DIRTY") not in (None, "0")
    try:
        if commit is None:  # the checkout's HEAD, dirty where git status lists anything
            head, status = (subprocess.check_output(["git", *command], cwd=HERE, stderr=subprocess.DEVNULL, text=True,
                                                    timeout=10).strip()
                            for command in (["rev-parse", "--short", "HEAD"], ["status", "--porcelain"]))
            commit, dirty = head, bool(status)
    except (OSError, subprocess.SubprocessError):  # no git, or not a checkout
        commit, dirty = "uncommitted", False
    try:  # Linux
        cpu = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE).group(1)
    except (OSError, AttributeError):
        cpu = platform.processor() or "unknown CPU"
    return {"device": torch.cuda.get_device_name() if HAS_CUDA else "cpu (Triton interpreter; toy sizes)",
            "host": socket.gethostname(), "host_cpu": f"{cpu}, {os.cpu_count()} cores", "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__, "transformers": transformers.__version__,
            "git_commit": commit, "git_dirty": dirty, "command": [sys.executable, *sys.argv],
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}


# Options the default JSON name shows in its fixed parts or through the variant (finetune_baseline.py's peers,
# finetune_optimized.py's kernels), and options that do not change what a run measures.
NAMED_OPTIONS = {"model", "dtype", "data", "optimizer", "batch_size", "seq_len", "seq_len_search", "fsdp",
                 "compile", "liger", "loss", "rmsnorm", "swiglu", "rope", "fp8"}
UNNAMED_OPTIONS = {"out", "log_interval", "allow_download", "strict_weights", "output_dir", "tensorboard", "resume"}


def default_out_path(args, weights, dtype, variant, world_size):
    """DIR/results.json with --output-dir; otherwise runs/<script>_<model>-<weights>_<variant>_<data>_<optimizer>_
    <dtype>_<shape>[_fsdpN][_<option>=<value>...].json: every other option that differs from its default is in the
    name, so runs on other data, shapes or settings never overwrite each other's JSON."""
    if args.output_dir:
        return Path(args.output_dir) / "results.json"
    defaults = vars(build_parser().parse_args([]))
    shape = (f"search{'-'.join(map(str, args.seq_len_search))}" if args.seq_len_search
             else f"{args.batch_size}x{args.seq_len}")
    data = Path(args.data).name if is_local_path(args.data) else args.data
    parts = [Path(__file__).stem, f"{Path(args.model).name}-{weights}", variant, data, args.optimizer, dtype, shape]
    parts += [f"fsdp{world_size}"] if args.fsdp else []
    parts += [f"{name.replace('_', '-')}={value}" for name, value in vars(args).items()
              if name not in NAMED_OPTIONS | UNNAMED_OPTIONS and value != defaults[name]]
    return HERE / "runs" / ("_".join(re.sub(r"[^\w.+=-]+", "-", str(part)) for part in parts) + ".json")


# ----------------------------------------------------------------------------------------------------------------------
# Model: real weights when they can be loaded offline, otherwise the same architecture with random weights

# configs/<name>/config.json: the published architecture of each supported family's common size (llama-3.1-8b,
# mistral-7b-v0.3, qwen2.5-7b, qwen3-8b, gemma-2-9b, gemma-3-12b's text decoder, phi-3-mini-4k-instruct) and a tiny
# one of the same structure per family for CPU runs ("tiny" is LLaMA's, "tiny-<family>" the others').
CONFIGS = HERE / "configs"
# The attention implementations that apply Gemma 2's attention logit softcapping (sdpa has no such argument).
SOFTCAP_ATTENTION = ["eager", "flex_attention", "flash_attention_2"]


def builtin_config(name):
    """The config in configs/ named like the model (its Hub id's last part, in any case), or None."""
    folder = CONFIGS / name.rstrip("/").split("/")[-1].lower()
    return AutoConfig.from_pretrained(folder) if (folder / "config.json").is_file() else None


def is_builtin(name):
    """Whether --model names a built-in architecture: a bare name (no org/, nothing of that name here) of a configs/
    folder. Such a model has random weights and no tokenizer."""
    return "/" not in name and not Path(name).exists() and (CONFIGS / name.lower() / "config.json").is_file()


def is_local_path(name):
    """A Hub id is `name` or `org/name`: a name that exists here, starts with / . ~ or has 2 slashes is a local path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).exists()


def check_attention(config, attn_implementation):
    """A model whose attention logits are softcapped (Gemma 2) would train a different function on an attention that
    drops the cap: one error line instead."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap and attn_implementation not in SOFTCAP_ATTENTION:
        raise SystemExit(f"error: --attn-implementation {attn_implementation} cannot apply {config.model_type}'s "
                         f"attention logit softcapping ({softcap}); use {' or '.join(SOFTCAP_ATTENTION)}")


def load_model(args, device, dtype):
    """(model, "real" | "random"), never waiting on the network unless --allow-download. Real weights load straight
    onto `device` (from_pretrained's device_map, where accelerate is installed). A built-in name, or weights that
    cannot be loaded, give the architecture with random weights, from a local folder's own config.json or configs/.
    A local --model that does not exist is an error: a typo, not a missing download."""
    name = args.model  # "~" already expanded by the parser
    config = builtin_config(name) if is_builtin(name) else None
    try:
        if config is None:
            if is_local_path(name) and not Path(name).is_dir():
                raise SystemExit(f"error: --model {name}: no such directory (a local model is the folder written by "
                                 f"save_pretrained; a Hub id has the form org/name)")
            placement = {"device_map": device} if is_accelerate_available() else {}
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    name, dtype=dtype, attn_implementation=args.attn_implementation,
                    local_files_only=not args.allow_download, **placement)
                check_attention(model.config, args.attn_implementation)
                return model.to(device), "real"
            except (OSError, ValueError) as err:  # missing files, gated repo, no network: all surface as one of these
                reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                if args.strict_weights:
                    raise SystemExit(f"error: cannot load the weights of {name}: {reason}")
                local_config = is_local_path(name) and (Path(name) / "config.json").is_file()
                config = AutoConfig.from_pretrained(name) if local_config else builtin_config(name)
                if config is None:
                    raise SystemExit(f"error: cannot load {name} ({reason}) and no built-in config is known for it "
                                     f"(configs/ has {', '.join(sorted(p.name for p in CONFIGS.iterdir()))})")
                print(f"weights for {name} not available{'' if args.allow_download else ' offline'} ({reason}): "
                      f"using the same architecture with RANDOM weights")
        check_attention(config, args.attn_implementation)
        # Built on the target device in the target dtype: 8B parameters never pass through CPU memory or fp32.
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                    attn_implementation=args.attn_implementation), "random"
    except ImportError as err:  # the attention implementation's package (flash-attn) is not installed
        raise SystemExit(f"error: --attn-implementation {args.attn_implementation}: {str(err).splitlines()[0]}")


# ----------------------------------------------------------------------------------------------------------------------
# Data: [n_batches, batch, seq_len] token ids. Labels are the inputs themselves (causal LM); the shift happens below.

# A local data file is read by the datasets builder of its format, as load_dataset(<builder>, data_files=...) does.
DATA_FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def data_error(source, what):
    """The one line a bad --data or --eval-data ends the run with, before anything is trained."""
    return SystemExit(f"error: data {source}: {what}")


def data_rows(args, source):
    """The rows (dicts holding the --text-field column) of a save_to_disk folder (a DatasetDict's "train" split or its
    only one), a local data file (streamed: read only as far as the run needs; a .txt file is one document), a folder
    of data files, or a Hub data set (from the cache unless --allow-download). Without datasets: .txt files only."""
    path = Path(source).expanduser()
    if not args.allow_download:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when datasets is imported
    try:
        import datasets
    except ImportError:
        if path.is_file() and path.suffix == ".txt":
            print(f"the datasets package is not installed: reading {source} as one plain-text document")
            return [{"text": path.read_text(encoding="utf-8")}]
        raise data_error(source, "reading it needs the datasets package (pip install -r requirements.txt); without "
                                 "it only a .txt file can be used")
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach the user as our one line instead
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():  # written by save_to_disk
        rows = datasets.load_from_disk(str(path))
        if isinstance(rows, datasets.DatasetDict):
            if "train" not in rows and len(rows) != 1:
                raise data_error(source, f"a DatasetDict with the splits {list(rows)} and none called train")
            rows = rows["train"] if "train" in rows else next(iter(rows.values()))
        return rows
    if path.is_dir():  # a folder of data files: datasets picks the builder from them
        return datasets.load_dataset(str(path), split="train", streaming=True)
    if path.is_file():
        builder = DATA_FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise data_error(source, f"unknown file type {path.suffix or '(none)'}; data is read from "
                                     f"{', '.join(DATA_FILE_BUILDERS)} files and save_to_disk folders")
        options = {"sample_by": "document"} if builder == "text" else {}
        return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **options)
    if is_local_path(source) or path.suffix.lower() in DATA_FILE_BUILDERS:
        raise data_error(source, "no such file or folder")
    return datasets.load_dataset(source, split="train")


def load_tokenizer(args):
    """The model's tokenizer, or None where none is available offline (a built-in architecture, a Hub id not in the
    cache): the UTF-8 bytes of the text are then the token ids (0..255, valid for any vocabulary >= 256)."""
    if is_builtin(args.model):
        print(f"the built-in {args.model} has no tokenizer: using UTF-8 bytes as token ids")
        return None
    try:
        return AutoTokenizer.from_pretrained(args.model, local_files_only=not args.allow_download)
    except (OSError, ValueError) as err:
        print(f"no tokenizer for {args.model} ({str(err).strip().splitlines()[0]}): using UTF-8 bytes as token ids")
        return None


def load_token_stream(args, source, eos_id, tokenizer, tokens_needed):
    """The --text-field of each row tokenized, rows joined by EOS and empty ones skipped, as one 1-D tensor. Data that
    cannot be read, lacks the field, is not UTF-8 or holds no text ends the run with one error line."""
    encode = (lambda text: tokenizer(text)["input_ids"]) if tokenizer else (lambda text: list(text.encode("utf-8")))
    ids = []
    try:
        for index, row in enumerate(data_rows(args, source)):
            if args.text_field not in row:
                raise data_error(source, f"no field {args.text_field!r} (its fields: {', '.join(map(str, row))}); "
                                         f"name the text column with --text-field")
            text = row[args.text_field]
            if not isinstance(text, str):
                raise data_error(source, f"row {index}: field {args.text_field!r} holds {text!r:.40}, not text")
            if text.strip():
                ids += encode(text) + [eos_id]
            if len(ids) >= tokens_needed:  # stop early: a big corpus needs only as many tokens as the run trains on
                break
    except Exception as err:  # datasets raises many types for "not cached", "no network", "not JSON", ...
        causes = [err]
        while causes[-1].__cause__ or causes[-1].__context__:
            causes.append(causes[-1].__cause__ or causes[-1].__context__)
        bad_bytes = next((e for e in causes if isinstance(e, UnicodeDecodeError)), None)
        if bad_bytes is not None:
            raise data_error(source, f"not UTF-8 text (byte 0x{bad_bytes.object[bad_bytes.start]:02x}: "
                                     f"{bad_bytes.reason}); re-encode it as UTF-8") from None
        if isinstance(err, StopIteration):  # datasets' json builder on an empty file
            raise data_error(source, "contains no text") from None
        reason = next((str(e).strip().splitlines()[0] for e in causes if str(e).strip()), type(err).__name__)
        offline = "" if args.allow_download else " offline (not in the local cache; --allow-download fetches it)"
        raise data_error(source, f"cannot be read: {reason}" if is_local_path(source)
                         else f"cannot be loaded{offline}: {reason}") from None
    if not ids:
        raise data_error(source, "contains no text" + (f" in field {args.text_field!r}" if args.text_field != "text"
                                                       else ""))
    return torch.tensor(ids, dtype=torch.long)


def make_batches(args, split, vocab_size, eos_id, tokenizer, device, rank=0, world_size=1):
    """[n_batches, batch, seq_len] token ids of "train" (--steps x --grad-accum-steps micro-batches of --data) or "eval"
    (--eval-batches of --eval-data, or of the end of --data with --eval-split). The same arguments give the same
    batches, which lets --resume continue the data where the checkpoint left it. --fsdp: the run draws global batches
    of world_size x batch_size rows and rank r trains rows r::world_size."""
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
        read = math.ceil(train_tokens / (1 - args.eval_split)) if args.eval_split else tokens_needed
        stream = load_token_stream(args, source, eos_id, tokenizer, read)
        if args.eval_split:
            cut = int(stream.numel() * (1 - args.eval_split))
            stream = stream[:cut] if split == "train" else stream[cut:]
        if stream.numel() < 2 or int(stream.max()) >= vocab_size:
            raise data_error(source, f"its {split} part has {stream.numel()} tokens, or ids outside the model's "
                                     f"vocabulary ({vocab_size})")
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

def apply_liger(model):
    """What transformers' Trainer(use_liger_kernel=True) calls: Liger-Kernel's patch for the model's family (RoPE,
    RMSNorm, the gated MLP, the fused linear cross-entropy with the family's softcap). Returns how many modules it
    patched: Liger patches the instances' forward and _get_name() (the class stays), 65 + 32 for 8B."""
    if not HAS_CUDA:
        raise SystemExit("error: --liger needs a CUDA GPU (Liger-Kernel's Triton kernels have no CPU path)")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        raise SystemExit(f"error: --liger needs the liger-kernel package ({err}); pip install liger-kernel")
    if model.config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise SystemExit(f"error: --liger: Liger-Kernel has no patch for {model.config.model_type} models")
    _apply_liger_kernel_to_instance(model=model)
    return sum(module._get_name().startswith("Liger") for module in model.modules())


def compute_loss(model, input_ids, shift_labels, loss_impl):
    """(loss, token accuracy): the fraction of non-ignored positions whose most likely token is the label, or None
    where no logits exist to take it from (Liger's fused loss)."""
    if loss_impl == "liger":
        # Liger's fused linear cross-entropy lives in its patched forward, which only takes that path when it is given
        # labels in training mode; shift_labels is transformers' own keyword for already-shifted labels.
        return model(input_ids=input_ids, shift_labels=shift_labels).loss, None
    logits = model(input_ids=input_ids).logits  # [B, T, V] in the model's dtype
    # transformers' ForCausalLMLoss: upcast the logits to fp32, mean over the non-ignored tokens.
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), shift_labels.view(-1), ignore_index=-100)
    with torch.no_grad():  # one more pass over the logits (argmax), as a training loop that logs accuracy does
        counted = shift_labels != -100
        accuracy = ((logits.argmax(dim=-1) == shift_labels) & counted).sum() / counted.sum()
    return loss, accuracy


class ModelWithLoss(torch.nn.Module):
    """The model and compute_loss as one module: the unit FSDP2 shards as its root, and the unit torch.compile
    compiles (the fused linear cross-entropy reads lm_head.weight outside lm_head's own forward)."""

    def __init__(self, model, loss_impl):
        super().__init__()
        self.model, self.loss_impl = model, loss_impl

    def forward(self, input_ids, shift_labels):
        return compute_loss(self.model, input_ids, shift_labels, self.loss_impl)


@torch.no_grad()
def evaluate(model_with_loss, batches, world_size):
    """Mean held-out loss and token accuracy over batches ([n, batch, seq_len]), averaged over the ranks."""
    model_with_loss.eval()
    results = [model_with_loss(input_ids, shift_labels_of(input_ids)) for input_ids in batches]
    model_with_loss.train()
    means = [torch.stack([r[i].float() for r in results]).mean() if results[0][i] is not None else None for i in (0, 1)]
    if world_size > 1:
        for mean in (mean for mean in means if mean is not None):  # not filter(None): an accuracy of 0 is falsy
            dist.all_reduce(mean.div_(world_size))
    return [None if mean is None else mean.item() for mean in means]


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoints: write, keep the last --save-total-limit, resume

def checkpoints(output_dir):
    """The complete checkpoints in output_dir, oldest first. A checkpoint gets its name checkpoint-<step> only after
    everything in it is written, so a run killed while writing leaves the earlier ones whole."""
    folders = Path(output_dir).glob("checkpoint-*") if output_dir else []
    return sorted((f for f in folders if re.fullmatch(r"checkpoint-\d+", f.name)), key=lambda f: int(f.name[11:]))


def save_checkpoint(args, step, model, optimizers, schedulers, rank, world_size):
    """Writes DIR/checkpoint-<step>, the stock way: model and optimizer state through torch.distributed.checkpoint
    (every rank writes its own shards; training waits), plus the schedule, the step (which is also the data position:
    the batches are a function of the arguments) and the RNG states. All of it goes to .partial-checkpoint-<step>,
    renamed when complete; only then are the checkpoints beyond --save-total-limit deleted: a run killed at any moment
    leaves the last complete checkpoint whole."""
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
            rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if HAS_CUDA else None}
            torch.save({"step": step, "world_size": world_size, "model": args.model, "rng": rng,
                        "scheduler": schedulers[0].state_dict()}, partial / "trainer_state.pt")
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
    """Loads the latest complete checkpoint of --output-dir into the model, the optimizer(s) and the schedule(s);
    returns its step. The optimizer state is keyed by parameter name, so it loads whatever the number of optimizers."""
    folder = checkpoints(args.output_dir)[-1]
    state = torch.load(folder / "trainer_state.pt", weights_only=False)
    if state["world_size"] != world_size:
        raise SystemExit(f"error: --resume: {folder} was written by {state['world_size']} ranks, this run has "
                         f"{world_size}; resume with the same number of processes")
    model_state, optimizer_state = get_state_dict(model, optimizers, options=FLAT_STATE)  # the tensors to load into
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    except (Exception, CheckpointException) as err:  # DCP's own type, a BaseException, carries a shape mismatch
        raise SystemExit(f"error: --resume: {folder} (written for {state['model']}) does not fit this model: "
                         f"{str(err).strip().splitlines()[-1][:300]}") from None
    set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=FLAT_STATE)
    for scheduler in schedulers:
        scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["cpu"])
    if HAS_CUDA and state["rng"]["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    print(f"resumed from {folder}: step {state['step']} of {args.steps}")
    return state["step"]


def save_final(args, model, tokenizer, rank):
    """DIR/final: the fine-tuned model as safetensors (save_pretrained; AutoModelForCausalLM.from_pretrained loads
    it) and its tokenizer where one was loaded. Under FSDP2 the shards are gathered to rank 0 first."""
    folder = Path(args.output_dir) / "final"
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=args.fsdp))
    if rank == 0:
        model.save_pretrained(folder, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        print(f"model: {folder}")
    return str(folder)


def write_results(result, out_path, rank):
    if rank == 0:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results: {out_path}")


# ----------------------------------------------------------------------------------------------------------------------
# Longest trainable sequence: one step per length, after a warm-up step has created the optimizer state

def seq_len_search(args, train_step, phase, vocab, device):
    """One training step at batch 1 x L for each L of --seq-len-search: "trained", "out of memory" (in which part of the
    step, at which peak) or "non-finite loss"; the first length that does not train ends the search."""
    generator = torch.Generator().manual_seed(args.seed)
    warmup_len = args.warmup_seq_len or min(2048, args.seq_len_search[0])
    print(f"seq-len search (batch 1, synthetic tokens, one step per length after a warm-up step of {warmup_len} "
          f"tokens): {args.seq_len_search}")
    train_step(torch.randint(0, vocab, (1, 1, warmup_len), generator=generator).to(device))
    rows = []
    for seq_len in args.seq_len_search:
        if rows and rows[-1]["status"] != "trained":
            rows.append({"seq_len": seq_len, "status": "not tried"})
            print(f"seq_len {seq_len:>7}: not tried")
            continue
        input_ids = torch.randint(0, vocab, (1, 1, seq_len), generator=generator).to(device)
        if HAS_CUDA:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # hand back the previous length's cached blocks
            torch.cuda.reset_peak_memory_stats()
        t0, out_of_memory = time.perf_counter(), False
        try:
            loss = train_step(input_ids)[0].item()  # .item(): the step has finished
        except torch.OutOfMemoryError:
            out_of_memory = True  # leave the except block first: its traceback still references the step's tensors
        step_s = time.perf_counter() - t0
        row = {"seq_len": seq_len, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if HAS_CUDA else None}
        peak = "n/a (CPU)" if row["peak_gib"] is None else f"{row['peak_gib']:.2f} GiB"
        if out_of_memory:
            row.update(status="out of memory", phase=phase["now"])
            print(f"seq_len {seq_len:>7}: out of memory in the {phase['now']} (peak {peak})")
            phase["now"] = "idle"
            gc.collect()
            torch.cuda.empty_cache()  # a no-op without CUDA
        elif not math.isfinite(loss):
            row.update(status="non-finite loss", loss=loss)
            print(f"seq_len {seq_len:>7}: non-finite loss")
        else:
            row.update(status="trained", loss=loss, step_ms=1e3 * step_s, tokens_per_s=seq_len / step_s)
            print(f"seq_len {seq_len:>7}: trained, {step_s:.1f} s/step, {seq_len / step_s:,.0f} tok/s, peak {peak}")
        rows.append(row)
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


def sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


def train(args, train_step, model_with_loss, optimizers, schedulers, batches, start_step, variant, rank, world_size):
    """Steps start_step+1 .. --steps of the training batches, then the summary. The first step(s) of the process are
    a warm-up left out of the timing (kernels compile, cuBLAS picks algorithms, the optimizer creates its state);
    every step after it is synchronized around a host timer. Losses stay on the GPU until a progress update reads them
    (the step has synchronized by then, so that costs no stall)."""
    micro_batches = batches["train"].view(args.steps, args.grad_accum_steps, *batches["train"].shape[1:])
    tokens_per_step = world_size * args.grad_accum_steps * args.batch_size * args.seq_len
    warmup_steps = 2 if args.compile and args.compile_mode == "reduce-overhead" else 1  # the 2nd records its graphs
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
        records.append((loss, accuracy, grad_norm))
        scalars = {}
        if step % args.log_interval == 0 or step == args.steps:
            scalars = {"train/loss": loss.item(), "train/lr": schedulers[0].get_last_lr()[0]}
            scalars.update({"train/grad_norm": grad_norm.item()} if grad_norm is not None else {})
            scalars.update({"train/tokens_per_s": tokens_per_step / step_times[-1]} if step_times else {})
        if batches["eval"] is not None and (step % (args.eval_steps or args.steps) == 0 or step == args.steps):
            eval_loss, eval_accuracy = evaluate(model_with_loss, batches["eval"], world_size)
            evals.append({"step": step, "loss": eval_loss, "token_accuracy": eval_accuracy})
            scalars.update({"eval/loss": eval_loss} | ({"eval/token_accuracy": eval_accuracy} if eval_accuracy else {}))
        if scalars:
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
    tokens_per_s = tokens_per_step * len(step_times) / sum(step_times) if step_times else None
    avg_step_ms = 1e3 * sum(step_times) / len(step_times) if step_times else None
    peak_bytes = torch.cuda.max_memory_allocated() if HAS_CUDA else None
    peak_bytes_per_rank = [peak_bytes] * world_size
    if args.fsdp:  # each rank holds its own shards, activations and optimizer state: report every rank's peak
        dist.all_gather_object(peak_bytes_per_rank, peak_bytes)
    print(f"---- summary: {variant} {args.model} {args.batch_size}x{args.seq_len} {args.optimizer} ----")
    print(f"steps           : {start_step + 1}..{args.steps}, {len(step_times)} timed after {warmup_steps} warm-up")
    print("tokens/s        : " + (f"{tokens_per_s:,.0f} ({avg_step_ms:.1f} ms/step)" if tokens_per_s
                                   else "n/a (no timed step)")
          + (f" over {world_size} ranks" if args.fsdp else ""))
    print("peak GPU memory : " + (", ".join(f"{b / 2**30:.2f} GiB" for b in peak_bytes_per_rank) if HAS_CUDA
                                   else "n/a (CPU)"))
    print(f"loss            : {losses[0]:.4f} (step {start_step + 1}) -> {losses[-1]:.4f} (step {args.steps})"
          + (f" | held-out {evals[-1]['loss']:.4f}" if evals else ""))
    for checkpoint in saved[-1:]:
        print(f"checkpoint      : {checkpoint['bytes'] / 2**30:.2f} GiB written in {checkpoint['write_s']:.1f} s (step "
              f"{checkpoint['step']}, {len(saved)} written)")
    return {"shape": f"{args.batch_size}x{args.seq_len}", "tokens_per_step": tokens_per_step, "steps": args.steps,
            "start_step": start_step, "warmup_steps": warmup_steps, "tokens_per_s": tokens_per_s,
            "avg_step_ms": avg_step_ms,
            "peak_memory_gib": peak_bytes / 2**30 if HAS_CUDA else None, "peak_memory_bytes": peak_bytes,
            "peak_memory_gib_per_rank": [b / 2**30 if b is not None else None for b in peak_bytes_per_rank],
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
    torch.manual_seed(args.seed)  # the same on every rank: identical random weights before FSDP shards them
    model, weights = load_model(args, device, dtype)
    model.config.use_cache = False  # training: no KV cache
    model.train()
    config = model.config

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
    optimizers = [torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=args.optimizer == "adamw_foreach",
                                    fused=args.optimizer == "adamw_fused")]
    schedulers = [get_scheduler(LR_SCHEDULERS[args.lr_scheduler], optimizer, args.warmup_steps, args.steps)
                  for optimizer in optimizers]
    phase = {"now": "idle"}  # the part of the step that is running: names what ran out of memory

    def train_step(micro_batches):
        """One optimizer step over micro_batches ([grad_accum_steps, batch, seq_len] token ids); returns the loss, the
        token accuracy (None where the loss does not give it) and the gradient norm, as device tensors: no host sync."""
        step_loss, step_accuracy = 0.0, 0.0
        for input_ids in micro_batches:
            phase["now"] = "forward"
            loss, accuracy = step_module(input_ids, shift_labels_of(input_ids))
            phase["now"] = "backward"
            (loss / len(micro_batches)).backward()
            step_loss = step_loss + loss.detach() / len(micro_batches)
            step_accuracy = None if accuracy is None else step_accuracy + accuracy / len(micro_batches)
        phase["now"] = "optimizer step"
        grad_norm = (torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm) if args.max_grad_norm
                     else None)
        for optimizer, scheduler in zip(optimizers, schedulers):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        phase["now"] = "idle"
        if args.fsdp:  # the global batch's figures: the mean over ranks (a collective, not a host sync)
            for value in filter(lambda v: v is not None, (step_loss, step_accuracy)):
                dist.all_reduce(value.div_(world_size))  # sum of value / world_size (gloo has no AVG)
            if grad_norm is not None:  # clip_grad_norm_ of sharded gradients: a DTensor, the same on every rank
                grad_norm = grad_norm.full_tensor()
        return step_loss, step_accuracy, grad_norm

    print(f"device: {info['device']} | torch {info['torch']} | triton {info['triton']} | "
          f"transformers {info['transformers']} | commit {info['git_commit']}{'+dirty' if info['git_dirty'] else ''}")
    print(f"model: {args.model} ({weights} weights), {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}, {str(dtype).replace('torch.', '')}, attn {args.attn_implementation}")
    print(f"{Path(__file__).name}: variant {variant}, optimizer {args.optimizer}, lr {args.lr} ({args.lr_scheduler}), "
          f"data {args.data}, checkpointing {args.activation_checkpointing}" + f", replaced {replaced}" * bool(replaced)
          + (f", FSDP2 over {world_size} ranks (batch {args.batch_size} per rank)" if args.fsdp else ""))
    if args.compile:
        print(f"torch.compile: backend {COMPILE_BACKEND}, mode {args.compile_mode}"
              + ("" if HAS_CUDA else " (no CUDA device: aot_eager traces the graphs, generates no code)"))
    result = {**info, "script": Path(__file__).name, "model": args.model, "weights": weights,
              "dtype": str(dtype).replace("torch.", ""), "variant": variant, "loss_impl": loss_impl,
              "replaced": replaced, "world_size": world_size, "options": vars(args),
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
            result["final_model"] = save_final(args, model, tokenizer, rank)
    write_results(result, out_path, rank)
    if args.fsdp:  # every rank past its last collective before any closes its connections
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
