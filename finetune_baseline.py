"""Full fine-tuning of LLaMA-3.1-8B with stock PyTorch + transformers: the BASELINE.

The playbook's step 11, first half. One readable loop (nanoGPT style): build the model, one warm-up step, reset the
peak-memory counter, then --steps timed steps of forward -> loss -> backward -> AdamW step -> zero_grad, and a summary
(average step time, tokens/s, peak GPU memory) plus a JSON file with everything needed to compare runs.

finetune_optimized.py is the same script with the fused kernels plugged in; `diff finetune_baseline.py
finetune_optimized.py` shows exactly what they change. This one also offers the peers a user would try first:
--compile (torch.compile of the model with its loss; --compile-mode picks inductor's mode) and --liger (Liger-Kernel's
apply_liger_kernel_to_llama). finetune_optimized.py has the same --compile, around its kernels. Both have --cuda-graph,
which replays the whole step as one CUDA graph: the lever for steps the host cannot launch as fast as the GPU runs them.

    python finetune_baseline.py                                 # 20 steps at 1x512 (without a GPU: tiny LLaMA, 1x32)
    python finetune_baseline.py --seq-len 8192 --out results/finetune_baseline_1x8192.json
    python finetune_baseline.py --seq-len-search 4096,8192,12288,16384   # longest batch-1 sequence that trains

Model: real weights when they can be loaded offline (a Hub id in the local cache or a local folder written by
save_pretrained; loaded straight onto the GPU with device_map), otherwise the same architecture with RANDOM weights
(said so in every output); without a GPU a tiny LLaMA of the same structure. Data: random tokens like the playbook, or
--data: a folder written by save_to_disk, a local .txt/.json/.jsonl/.parquet/.csv file, or a Hub data set name; the
--text-field column of its rows is tokenized and packed into --seq-len windows.

--fsdp shards the model over several processes started by either launcher:
    torchrun --standalone --nproc-per-node 2 finetune_baseline.py --fsdp
    accelerate launch --multi_gpu --num_processes 2 finetune_baseline.py --fsdp
"""
import argparse
import datetime
import functools
import gc
import importlib.metadata
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Long sequences need large blocks. By default the CUDA caching allocator carves them out of fixed segments and then
# cannot reuse a segment's free space for other sizes ("reserved but unallocated"); expandable segments grow one
# mapping instead. It must be set before torch initializes CUDA, and only when the user has not chosen a setting.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts  # noqa: E402
from tqdm import tqdm  # noqa: E402

import transformers
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import is_accelerate_available

HERE = Path(__file__).resolve().parent
HAS_CUDA = torch.cuda.is_available()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COMPILE_MODES = ["default", "reduce-overhead", "max-autotune-no-cudagraphs"]
# The attention implementations transformers trains LLaMA with (its "paged|..." variants serve generation).
ATTN_IMPLEMENTATIONS = ["sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"]
# Without a GPU, --compile uses aot_eager: it traces the step as inductor would (with fake tensors, through the kernels'
# custom operators, into forward and backward graphs) but generates no code. Inductor's C++ for the CPU takes ~30 s to
# compile even the tiny model on 2 cores and would speed up nothing that matters: the kernels run on the interpreter.
COMPILE_BACKEND = "inductor" if HAS_CUDA else "aot_eager"


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # expanduser here, once: the weights and the tokenizer then read the same folder, also for --model=~/models/x
    # (the shell expands a ~ only at the start of a word)
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B" if HAS_CUDA else "tiny", type=os.path.expanduser,
                        help='Hub id or local folder (save_pretrained); "tiny" = a 2-layer LLaMA with random weights '
                             '(CPU runs)')
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto = bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--attn-implementation", choices=ATTN_IMPLEMENTATIONS, default="sdpa",
                        help="transformers' attention: sdpa = torch's scaled_dot_product_attention; eager = matmul, "
                             "softmax, matmul; flash_attention_2/3 need the flash-attn package; flex_attention a GPU")
    parser.add_argument("--allow-download", action="store_true", help="let from_pretrained/load_dataset reach the Hub")
    parser.add_argument("--strict-weights", action="store_true",
                        help="fail instead of falling back to random weights when the weights cannot be loaded")
    parser.add_argument("--steps", type=int, default=20,
                        help="timed optimizer steps (after the warm-up: one step, two with --compile-mode "
                             "reduce-overhead)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=512 if HAS_CUDA else 32,
                        help="tokens per sequence, at least 2 (32 without a GPU: the Triton interpreter is slow)")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights and the synthetic tokens")
    parser.add_argument("--optimizer", choices=["adamw_foreach", "adamw_fused"], default="adamw_fused",
                        help="torch AdamW: one fused kernel (the default, as in every comparison in the README) or "
                             "multi-tensor (foreach)")
    parser.add_argument("--data", default="synthetic",
                        help='"synthetic" (random tokens), a save_to_disk folder, a local .txt/.json/.jsonl/.parquet/'
                             '.csv file, or a Hub data set name')
    parser.add_argument("--text-field", default="text", help="the column of --data that holds the text")
    parser.add_argument("--log-interval", type=int, default=1, help="update the progress bar every N steps")
    parser.add_argument("--seq-len-search", default=None, metavar="L1,L2,...",
                        help="instead of training: after a short warm-up step that creates the optimizer state, one "
                             "step per length at batch 1, reported as trained / out of memory (in which part of the "
                             "step) / not tried; the first length that does not fit ends the search")
    parser.add_argument("--plot", nargs="+", default=None, metavar="JSON",
                        help="instead of training: plot peak GPU memory against sequence length from the results "
                             "files of fine-tune runs and searches (ours, Liger, ...) into --out (a .png)")
    parser.add_argument("--warmup-seq-len", type=int, default=None,
                        help="tokens per sequence of the warm-up step: at most --seq-len (default: --seq-len); with "
                             "--seq-len-search any length (default: the first length searched, at most 2048). A short "
                             "warm-up compiles the kernels and creates the optimizer state for a fraction of one long "
                             "step")
    parser.add_argument("--grad-accum-steps", type=int, default=1,
                        help="micro-batches whose gradients are summed per optimizer step")
    # -- long sequences (the same flags in both scripts) ---------------------------------------------------------------
    parser.add_argument("--activation-checkpointing", choices=["none", "full", "selective"], default="none",
                        help="recompute each decoder layer in the backward instead of keeping its activations: full = "
                             "the whole layer; selective = all but attention, whose output and log-sum-exp are kept "
                             "(attention is the part whose cost grows with T^2)")
    parser.add_argument("--checkpoint-layers", type=int, default=None, metavar="N",
                        help="with checkpointing: checkpoint only the first N decoder layers (default: all); the "
                             "others keep their activations, which is faster where the memory allows it")
    parser.add_argument("--offload-activations", type=int, default=0, metavar="N",
                        help="with checkpointing: keep the checkpointed input of the first N decoder layers in pinned "
                             "host memory; copies run on a side stream, overlapped with compute")
    parser.add_argument("--tiled-mlp", type=int, default=None, metavar="TOKENS",
                        help="run every MLP over sequence tiles of TOKENS tokens, so its [tokens, intermediate] "
                             "tensors exist for one tile at a time (the backward recomputes each tile)")
    parser.add_argument("--optimizer-in-backward", action="store_true",
                        help="step each parameter's AdamW as soon as its gradient is ready, then free that gradient: "
                             "the whole model's gradients never exist at once. Not combinable with gradient "
                             "accumulation (--grad-accum-steps > 1) or --fsdp")
    parser.add_argument("--measure-recompute", action="store_true",
                        help="with checkpointing: after the timed steps, time one step without it (if it fits) and "
                             "report the recompute overhead")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the model with FSDP2 over the N processes of torchrun --nproc-per-node N or "
                             "accelerate launch --multi_gpu --num_processes N; --batch-size is per rank (global batch "
                             "= N x --batch-size)")
    parser.add_argument("--out", default=None,
                        help="JSON results path. Default: a file in runs/ named after the run: script, model-weights, "
                             "variant, data, optimizer, dtype, shape, then fsdpN with --fsdp and option=value for "
                             "every other option not at its default, joined by _")
    # -- torch.compile (the same flags in both scripts) ----------------------------------------------------------------
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model with its loss (compiled on the first warm-up step)")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                        help="torch.compile's mode: reduce-overhead replays each step's kernel launches as CUDA "
                             "graphs (no host work per launch); max-autotune-no-cudagraphs tries more kernel "
                             "configurations (a longer compile)")
    # -- CUDA graph (the same flag in both scripts) --------------------------------------------------------------------
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture the whole training step (forward, backward, optimizer step) as one CUDA graph "
                             "after the warm-up and replay it: one launch per step instead of one per kernel, for "
                             "steps the host cannot launch as fast as the GPU runs them (1x512)")
    # -- baseline only: the other peer a user would try (the first is --compile) -------------------------------------
    parser.add_argument("--liger", action="store_true",
                        help="Liger-Kernel's apply_liger_kernel_to_llama(model=...); not with --compile")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "log_interval", "grad_accum_steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.seq_len < 2:  # position t learns to predict token t+1: a single token leaves nothing to predict
        parser.error("--seq-len must be at least 2: the loss predicts each next token, so 1 token has none")
    if not 0 < args.lr < math.inf:  # also false for nan
        parser.error(f"--lr must be a positive finite number, got {args.lr}")
    if args.attn_implementation == "flex_attention" and not HAS_CUDA:
        parser.error("--attn-implementation flex_attention needs a GPU: FlexAttention has no backward on the CPU")
    if args.out and Path(args.out).is_dir():  # checked now: the results are written only at the end of the run
        parser.error(f"--out {args.out} is a directory: give the path of the file to write")
    if args.compile_mode != "default" and not args.compile:
        parser.error("--compile-mode goes with --compile")
    if args.compile_mode != "default" and COMPILE_BACKEND != "inductor":
        parser.error(f"--compile-mode needs a GPU: without one, --compile uses the {COMPILE_BACKEND} backend, which "
                     f"has no modes")
    if args.liger and args.compile:
        parser.error("--liger and --compile are two peers to compare against: pick one")
    if args.plot and not (args.out or "").endswith(".png"):
        parser.error("--plot writes a PNG: give its path with --out FILE.png")
    if args.warmup_seq_len is not None and args.warmup_seq_len < 2:
        parser.error("--warmup-seq-len must be at least 2 (the loss predicts each next token)")
    if args.warmup_seq_len is not None and not args.seq_len_search and args.warmup_seq_len > args.seq_len:
        # the warm-up trains on the first --warmup-seq-len tokens of a --seq-len batch: there are no more
        parser.error(f"--warmup-seq-len {args.warmup_seq_len} is longer than --seq-len {args.seq_len}")
    if args.tiled_mlp is not None and args.tiled_mlp <= 0:
        parser.error(f"--tiled-mlp takes a positive number of tokens per tile, got {args.tiled_mlp}")
    if args.offload_activations < 0:
        parser.error(f"--offload-activations takes a number of layers >= 0, got {args.offload_activations}")
    if args.offload_activations and args.activation_checkpointing == "none":
        parser.error("--offload-activations moves checkpointed layer inputs to the host: it needs "
                     "--activation-checkpointing full or selective")
    if args.checkpoint_layers is not None and (args.checkpoint_layers <= 0 or args.activation_checkpointing == "none"):
        parser.error("--checkpoint-layers takes a positive number of layers and needs --activation-checkpointing")
    if args.checkpoint_layers is not None and args.offload_activations > args.checkpoint_layers:
        parser.error("--offload-activations cannot exceed --checkpoint-layers: only checkpointed layers are offloaded")
    if args.measure_recompute and args.activation_checkpointing == "none":
        parser.error("--measure-recompute compares with and without checkpointing: it needs --activation-checkpointing")
    if args.optimizer_in_backward and args.grad_accum_steps > 1:
        parser.error("--optimizer-in-backward steps each parameter as soon as its gradient exists, so gradients "
                     "cannot be accumulated over micro-batches: use --grad-accum-steps 1")
    if args.optimizer_in_backward and args.fsdp:
        parser.error("--optimizer-in-backward cannot be combined with --fsdp (FSDP2 reduces gradients after the "
                     "backward)")
    if args.cuda_graph:
        # A graph replays one fixed sequence of kernels on fixed buffers: the step must have one shape and no host work
        # between its kernels. torch.compile's reduce-overhead mode is its own use of CUDA graphs.
        clashes = {"--compile": args.compile, "--fsdp": args.fsdp, "--seq-len-search": args.seq_len_search,
                   "--optimizer-in-backward": args.optimizer_in_backward,
                   "--activation-checkpointing": args.activation_checkpointing != "none",
                   "--warmup-seq-len": args.warmup_seq_len is not None}
        clash = next((flag for flag, used in clashes.items() if used), None)
        if clash:
            parser.error(f"--cuda-graph captures one plain step of one shape: it cannot be combined with {clash}")
    if args.seq_len_search:
        try:
            args.seq_len_search = [int(x) for x in args.seq_len_search.split(",")]
        except ValueError:
            parser.error("--seq-len-search takes comma-separated integers, e.g. 4096,8192,12288")
        if args.seq_len_search != sorted(set(args.seq_len_search)) or min(args.seq_len_search) < 2:
            parser.error("--seq-len-search lengths must be at least 2 and increasing")
    if args.fsdp:
        # --liger exists in finetune_baseline.py only
        combined = [name for name in ("seq_len_search", "compile", "liger") if getattr(args, name, None)]
        if combined:
            parser.error(f"--fsdp cannot be combined with --{combined[0].replace('_', '-')}")
        if "WORLD_SIZE" not in os.environ:
            parser.error(f"--fsdp needs a distributed launcher, e.g. torchrun --standalone --nproc-per-node 2 "
                         f"{Path(__file__).name} --fsdp or accelerate launch --multi_gpu --num_processes 2 "
                         f"{Path(__file__).name} --fsdp (torchrun --nproc-per-node 1 for a single process)")
    return args


# ----------------------------------------------------------------------------------------------------------------------
# Run information: what ran, where, with which versions (goes into the header and the JSON)

def git_info():
    """(short commit, dirty?) of the checkout. The GIT_COMMIT and GIT_DIRTY environment variables, when set, say
    which commit a copied tree was taken from and take precedence: a copy on a GPU box may carry no .git, or a stale
    one."""
    if "GIT_COMMIT" in os.environ:
        return os.environ["GIT_COMMIT"], os.environ.get("GIT_DIRTY") not in (None, "0")

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=HERE, capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode == 0:
            return head.stdout.strip(), bool(git("status", "--porcelain").stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return "uncommitted", False


def host_cpu():
    """The host's CPU model and core count (Linux: /proc/cpuinfo): it sets the pace of host-bound steps, so figures
    from different hosts differ."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


def run_info():
    commit, dirty = git_info()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": torch.cuda.get_device_name() if HAS_CUDA else "cpu (Triton interpreter; toy sizes)",
        "host": socket.gethostname(),
        "host_cpu": host_cpu(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "command": [sys.executable, *sys.argv],
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


# Options the default JSON name shows in its fixed parts or through the variant (finetune_baseline.py's peers,
# finetune_optimized.py's kernels), and options that do not change what a run measures.
NAMED_OPTIONS = {"model", "dtype", "data", "optimizer", "batch_size", "seq_len", "seq_len_search", "fsdp",
                 "compile", "liger", "loss", "swiglu", "rope"}
UNNAMED_OPTIONS = {"out", "log_interval", "allow_download", "strict_weights"}


def default_out_path(args, weights, dtype, variant, world_size):
    """runs/<script>_<model>-<weights>_<variant>_<data>_<optimizer>_<dtype>_<shape>[_fsdpN][_<option>=<value>...]
    .json: every other option that changes the run is in the name when it differs from its default, so runs on other
    data, shapes or settings never overwrite each other's JSON (which holds all the options)."""
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

ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama31_8b_config():
    """The published Llama-3.1-8B config.json values, so the architecture is available without the gated repo."""
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
                       rope_parameters=dict(ROPE_LLAMA3))


def tiny_llama_config():
    """Same structure as Llama-3.1-8B (GQA, SwiGLU, llama3 RoPE, untied head), toy sizes: runs on CPU in seconds."""
    return LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       rope_parameters=dict(ROPE_LLAMA3))


def is_local_path(name):
    """A Hub id is `name` or `org/name`: a name that exists here, starts with / . ~ or has 2 slashes is a local path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).exists()


def load_model(args, device, dtype):
    """Returns (model, "real" | "random"). Never waits on the network unless --allow-download is given.

    Real weights load straight onto `device`: from_pretrained's device_map places each tensor as it is read (that
    placement needs accelerate; without it the weights pass through CPU memory first). A local --model that does not
    exist is an error, never a fall-back to random weights: it is a typo, not a missing download."""
    name = args.model  # "~" already expanded by the parser
    if name != "tiny":
        if is_local_path(name) and not Path(name).is_dir():
            raise SystemExit(f"error: --model {name}: no such directory (a local model is the folder written by "
                             f"save_pretrained; a Hub id has the form org/name)")
        placement = {"device_map": device} if is_accelerate_available() else {}
        try:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=not args.allow_download,
                                                         attn_implementation=args.attn_implementation, **placement)
            return model.to(device), "real"
        except ImportError as err:  # the attention implementation's package (flash-attn) is not installed
            raise SystemExit(f"error: --attn-implementation {args.attn_implementation}: {str(err).splitlines()[0]}")
        except (OSError, ValueError) as err:  # missing files, gated repo, no network: all surface as one of these
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if args.strict_weights:
                raise SystemExit(f"error: cannot load the weights of {name}: {reason}")
            if not name.rstrip("/").lower().endswith(("llama-3.1-8b", "llama-3.1-8b-instruct")):
                raise SystemExit(f"error: cannot load {name} ({reason}) and no built-in config is known for it")
            where = "" if args.allow_download else " offline"
            print(f"weights for {name} not available{where} ({reason}): "
                  f"using the same architecture with RANDOM weights")
    config = tiny_llama_config() if name == "tiny" else llama31_8b_config()
    # Build directly on the target device in the target dtype: 8B parameters never pass through CPU memory or fp32.
    try:
        with torch.device(device):
            model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation=args.attn_implementation)
    except ImportError as err:
        raise SystemExit(f"error: --attn-implementation {args.attn_implementation}: {str(err).splitlines()[0]}")
    return model, "random"


# ----------------------------------------------------------------------------------------------------------------------
# Data: [n_batches, batch, seq_len] token ids. Labels are the inputs themselves (causal LM); the shift happens below.

# A local data file is read by the datasets builder of its format, as load_dataset(<builder>, data_files=...) does.
DATA_FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def data_error(args, what):
    """The one line a bad --data ends the run with (exit code 1), before anything is trained or written."""
    return SystemExit(f"error: --data {args.data}: {what}")


def data_rows(args):
    """The rows of --data (dicts holding the --text-field column), the way datasets users keep data sets:
      - a folder written by save_to_disk: load_from_disk (of a DatasetDict, its "train" split or its only one);
      - a local .txt/.json/.jsonl/.parquet/.csv file: load_dataset(<builder>, data_files=...), streamed, so a big file
        is read only as far as the run needs (a .txt file is one document, sample_by="document");
      - another local folder: load_dataset(folder, streaming=True), which picks the builder from the files in it;
      - anything else: a data set name on the Hub, from the local cache unless --allow-download.
    Without the datasets package only a .txt file can be read (as one document, the same row the text builder makes)."""
    path = Path(args.data).expanduser()
    if not args.allow_download:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when datasets is imported
    try:
        import datasets
    except ImportError:
        if path.is_file() and path.suffix == ".txt":
            print(f"the datasets package is not installed: reading {args.data} as one plain-text document")
            return [{"text": path.read_text(encoding="utf-8")}]
        raise data_error(args, "reading it needs the datasets package (pip install -r requirements.txt); without it "
                               "only a .txt file can be used")
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach the user as our one line instead
    if path.is_dir():
        if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
            return datasets.load_dataset(str(path), split="train", streaming=True)
        rows = datasets.load_from_disk(str(path))
        if isinstance(rows, datasets.DatasetDict):
            splits = list(rows)
            if "train" not in splits and len(splits) != 1:
                raise data_error(args, f"a DatasetDict with the splits {splits} and none called train")
            rows = rows["train" if "train" in splits else splits[0]]
        return rows
    if path.is_file():
        builder = DATA_FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise data_error(args, f"unknown file type {path.suffix or '(none)'}; --data reads "
                                   f"{', '.join(DATA_FILE_BUILDERS)} files and save_to_disk folders")
        options = {"sample_by": "document"} if builder == "text" else {}
        return datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True, **options)
    if is_local_path(args.data) or path.suffix.lower() in DATA_FILE_BUILDERS:
        raise data_error(args, "no such file or folder")
    return datasets.load_dataset(args.data, split="train")


def text_encoder(args):
    """text -> token ids with the model's tokenizer. A model without a tokenizer available offline ("tiny", or
    weights-less 8B) uses the UTF-8 bytes of the text as token ids (0..255, valid for any vocabulary >= 256)."""
    if args.model != "tiny":
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=not args.allow_download)
            return lambda text: tokenizer(text)["input_ids"]
        except (OSError, ValueError) as err:
            print(f"no tokenizer for {args.model} ({str(err).strip().splitlines()[0]}): using UTF-8 bytes as token ids")
    else:
        print("the tiny model has no tokenizer: using UTF-8 bytes as token ids")
    return lambda text: list(text.encode("utf-8"))


def load_token_stream(args, eos_id, tokens_needed):
    """Token ids of --data as one 1-D tensor: the --text-field of each row, tokenized, rows joined by EOS; rows with no
    text (empty or only whitespace) are skipped. A data set that cannot be read, has no such field, is not UTF-8 or
    holds no text at all ends the run with one error line."""
    ids = []
    try:
        rows = data_rows(args)
        encode = text_encoder(args)
        for index, row in enumerate(rows):
            if args.text_field not in row:
                raise data_error(args, f"no field {args.text_field!r} (its fields: {', '.join(map(str, row))}); "
                                       f"name the text column with --text-field")
            text = row[args.text_field]
            if not isinstance(text, str):
                raise data_error(args, f"row {index}: field {args.text_field!r} holds {text!r:.40}, not text")
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
            raise data_error(args, f"not UTF-8 text (byte 0x{bad_bytes.object[bad_bytes.start]:02x}: "
                                   f"{bad_bytes.reason}); re-encode it as UTF-8") from None
        if isinstance(err, StopIteration):  # datasets' json builder on an empty file
            raise data_error(args, "contains no text") from None
        reason = next((str(e).strip().splitlines()[0] for e in causes if str(e).strip()), type(err).__name__)
        if is_local_path(args.data):
            raise data_error(args, f"cannot be read: {reason}") from None
        where = "" if args.allow_download else " offline (not in the local cache; --allow-download fetches it)"
        raise data_error(args, f"cannot be loaded{where}: {reason}") from None
    if not ids:
        raise data_error(args, "contains no text" + (f" in field {args.text_field!r}" if args.text_field != "text"
                                                     else ""))
    return torch.tensor(ids, dtype=torch.long)


def make_batches(args, n_batches, vocab_size, eos_id, device, rank=0, world_size=1):
    # --fsdp: the run draws GLOBAL batches of world_size x batch_size rows and rank r trains rows r::world_size, so the
    # ranks see different sequences and together exactly what one process with that global batch size would see.
    global_batch_size = world_size * args.batch_size
    tokens_needed = n_batches * global_batch_size * args.seq_len
    if args.data == "synthetic":  # what the playbook trains on: uniform random tokens (loss stays near ln V)
        generator = torch.Generator().manual_seed(args.seed)
        stream = torch.randint(0, vocab_size, (tokens_needed,), generator=generator)
    else:
        stream = load_token_stream(args, eos_id, tokens_needed)
        if int(stream.max()) >= vocab_size:
            raise SystemExit(f"error: token id {int(stream.max())} from --data is outside the model's vocabulary "
                             f"({vocab_size})")
        if stream.numel() < tokens_needed:
            print(f"--data has {stream.numel()} tokens, the run needs {tokens_needed}: cycling through it")
            stream = stream.repeat(-(-tokens_needed // stream.numel()))
    # Packed: consecutive seq_len windows of the stream (no padding; attention crosses document boundaries, the
    # usual simplification for packed pre-training-style batches).
    batches = stream[:tokens_needed].view(n_batches, global_batch_size, args.seq_len)
    return batches[:, rank::world_size].contiguous().to(device)


def shift_labels_of(labels):
    """What transformers' ForCausalLMLoss does: position t predicts token t+1, the last position predicts nothing.
    Shifting the labels (instead of slicing the logits) keeps the [B, T, V] logits whole: no copy of them."""
    return F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()  # contiguous: [B, T] rows, viewable as [B*T]


# ----------------------------------------------------------------------------------------------------------------------
# Loss: THE part the kernels change (compare with finetune_optimized.py)

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
    """The model and compute_loss as one module: the unit FSDP2 shards as its root. The root all-gathers the
    parameters outside the decoder layers (embedding, final norm, lm_head) around ITS forward, and a loss that reads
    lm_head.weight outside lm_head's own forward (the fused linear cross-entropy) needs them gathered there."""

    def __init__(self, model, loss_impl):
        super().__init__()
        self.model, self.loss_impl = model, loss_impl

    def forward(self, input_ids, shift_labels):
        return compute_loss(self.model, input_ids, shift_labels, self.loss_impl)


# ----------------------------------------------------------------------------------------------------------------------
# Long sequences: what the step keeps, recomputes, tiles or moves to the host (the same code in both fine-tune scripts)

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


class AttentionKernelRecorder(TorchDispatchMode):
    """Records which SDPA kernels run while active (the `attention_kernels` entry of the results)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in ATTENTION_KERNELS:
            self.seen.add(ATTENTION_KERNELS[func])
        return func(*args, **(kwargs or {}))


class ActivationOffloader:
    """Keeps the checkpointed input of some decoder layers in pinned host memory instead of on the GPU.

    With checkpointing, a layer keeps only its input ([tokens, hidden]) for the backward, which recomputes the rest.
    The offloader packs that saved input into pinned host memory: the device-to-host copy runs on a side stream, so it
    overlaps the layer's compute, and record_stream keeps the caching allocator from reusing the GPU memory before the
    copy has read it. The backward visits the layers in reverse order: when layer i's input is unpacked, the copy of
    layer i-1's input back to the GPU starts on the side stream, so it is there when layer i-1's recompute needs it.
    On the GPU, CUDA events time each copy and the compute between two offloaded layers (the copy must hide behind
    it); without a GPU the tensors are plain host copies."""

    def __init__(self, hidden_size):
        self.hidden_size = hidden_size  # what a layer input looks like: [..., hidden_size]
        self.stream = torch.cuda.Stream() if HAS_CUDA else None
        self.records = []

    def wrap(self, checkpoint_function):
        """One layer's checkpoint function, with the tensors it saves packed by this offloader."""
        def offloaded_checkpoint(function, *args, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                return checkpoint_function(function, *args, **kwargs)
        return offloaded_checkpoint

    def new_step(self):
        self.records = []

    def pack(self, tensor):
        if tensor.dim() < 2 or tensor.shape[-1] != self.hidden_size:
            return tensor  # not a layer input (checkpoint also saves a small placeholder tensor of its own): kept
        record = {"device": tensor.device, "index": len(self.records), "on_gpu": None, "used": False,
                  "host": torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)}
        if tensor.is_cuda:
            record["saved"] = torch.cuda.Event(enable_timing=True)
            record["saved"].record()  # on the compute stream: the layer's input is complete here
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                record["copied"] = torch.cuda.Event(enable_timing=True)
                record["host"].copy_(tensor, non_blocking=True)
                record["copied"].record()
            tensor.record_stream(self.stream)
        else:
            record["host"].copy_(tensor)
        self.records.append(record)
        return record

    def _fetch(self, record):
        """Start (or finish) bringing a record back to its device; the copy is queued on the side stream."""
        if record["on_gpu"] is None:
            if record["device"].type == "cuda":
                with torch.cuda.stream(self.stream):
                    record["on_gpu"] = record["host"].to(record["device"], non_blocking=True)
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
            tensor.record_stream(torch.cuda.current_stream())
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
# Reporting: peak memory against sequence length, from the JSON files of earlier runs (the same in both scripts)

def flag_summary(options):
    """The long-sequence flags of a run, short enough to label a point."""
    parts = [options.get("activation_checkpointing", "none")]
    if options.get("checkpoint_layers"):
        parts.append(f"{options['checkpoint_layers']} layers")
    if options.get("offload_activations"):
        parts.append(f"offload {options['offload_activations']}")
    if options.get("tiled_mlp"):
        parts.append(f"MLP tiles {options['tiled_mlp']}")
    if options.get("optimizer_in_backward"):
        parts.append("optimizer in backward")
    return ", ".join(parts)


def plot_memory(paths, out_path):
    """One line per kind of run (ours, Liger, baseline...): peak GPU memory at each sequence length that a results file
    (a fine-tune or a --seq-len-search) reports; a cross where a length ran out of memory; each point labelled with
    its flags and the memory it kept on the host. A run without a GPU measured no peak (null): it is left out, and
    said so."""
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
            rows = (result["seq_len_search"]["results"] if "seq_len_search" in result else
                    [{"seq_len": result["options"]["seq_len"], "status": "trained",
                      "peak_gib": result["peak_memory_gib"],
                      "host_gib": (result.get("offload") or {}).get("host_bytes", 0) / 2**30}])
            for row in rows:
                if row["status"] not in ("trained", "out of memory"):
                    continue  # "not tried", "non-finite loss": no memory to show
                if row.get("peak_gib") is None:  # a run without a GPU has no GPU memory to report
                    unmeasured.append(f"{path} ({row['seq_len']} tokens)")
                else:
                    series.setdefault(label, []).append((row, flag_summary(result["options"])))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:  # e.g. an older file's rows
            raise SystemExit(f"error: --plot {path}: not a fine-tune results file this version reads "
                             f"({type(err).__name__}: {err})")
    if unmeasured:
        print(f"left out, no peak GPU memory (run without a GPU): {', '.join(unmeasured)}")
    if not series:
        raise SystemExit("error: --plot: nothing to plot: no run in these files measured its peak GPU memory")
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label, points in series.items():
        points.sort(key=lambda point: point[0]["seq_len"])
        trained = [(row["seq_len"], row["peak_gib"]) for row, _ in points if row["status"] == "trained"]
        # dotted: the points of one series may use different flags (each is labelled)
        line, = ax.plot(*zip(*trained) if trained else ([], []), marker="o", linestyle=":", label=label)
        for row, flags in points:
            host = f", +{row['host_gib']:.0f} GiB host" if row.get("host_gib") else ""
            if row["status"] == "out of memory":
                ax.plot(row["seq_len"], row["peak_gib"], marker="x", markersize=10, color=line.get_color())
                flags = f"out of memory ({row['phase']})"
            ax.annotate(f"{flags}{host}", (row["seq_len"], row["peak_gib"]), textcoords="offset points",
                        xytext=(4, 6), fontsize=7, color=line.get_color())
    ax.set_xscale("log", base=2)
    lengths = [row["seq_len"] for points in series.values() for row, _ in points]
    ax.set_xlim(min(lengths) / 1.3, max(lengths) * 3.5)  # room for the labels right of the last points
    ax.set_xlabel("tokens per sequence (batch 1)")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title("Peak GPU memory against sequence length\n(full fine-tune, batch 1; each point labelled with its "
                 "flags)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    print(f"plot: {out_path}")


# ----------------------------------------------------------------------------------------------------------------------
# Longest trainable sequence: one step per length, run after a warm-up step has created the optimizer state

def seq_len_search(lengths, try_length):
    """try_length(L) runs one training step at batch 1 x L and returns a row whose "status" is "trained", "out of
    memory" (with the part of the step that ran out and the peak it reached) or "non-finite loss". The first length
    that does not train ends the search: the longer ones are reported as "not tried" (a later run can try them).
    Returns (rows, the longest length that trained or None)."""
    rows, longest = [], None
    for seq_len in lengths:
        if rows and rows[-1]["status"] != "trained":
            rows.append({"seq_len": seq_len, "status": "not tried"})
            print(f"seq_len {seq_len:>7}: not tried")
            continue
        row = {"seq_len": seq_len, **try_length(seq_len)}
        rows.append(row)
        peak = "n/a (CPU)" if row.get("peak_gib") is None else f"{row['peak_gib']:.2f} GiB"
        if row["status"] == "trained":
            longest = seq_len
            host = f", {row['host_gib']:.1f} GiB on the host" if row.get("host_gib") else ""
            print(f"seq_len {seq_len:>7}: trained, {row['step_ms'] / 1e3:.1f} s/step, {row['tokens_per_s']:,.0f} "
                  f"tok/s, peak {peak}{host}")
        elif row["status"] == "out of memory":
            print(f"seq_len {seq_len:>7}: out of memory in the {row['phase']} (peak {peak})")
        else:
            print(f"seq_len {seq_len:>7}: {row['status']}")
    return rows, longest


def sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


def causal_sdpa_without_mask(model):
    """--cuda-graph and --compile with SDPA: keep the causal mask a flag, not a tensor, in a captured or compiled step.

    During a CUDA-graph capture or a torch.compile trace transformers builds the causal mask as a [T, T] tensor (a
    skipped mask would be baked into the graph, so it skips it only when not tracing), and SDPA with a mask tensor takes
    a masked attention kernel: 3x slower than the causal one at 1x8192, plus the mask's memory. The fine-tune's batches
    are packed windows with no padding, so their mask is always the plain causal one. An attention implementation
    registered without a mask function gets attention_mask=None from transformers, and transformers' own SDPA function
    then passes is_causal=True, exactly as the eager step does."""
    AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
    model.set_attn_implementation("sdpa_causal")


def capture_step(train_step, example_batch):
    """--cuda-graph: record one call of train_step (forward, backward, optimizer step) as a CUDA graph and return a
    step function that replays it on new token ids.

    Why it pays: an 8B step launches thousands of kernels, and at 1x512 most finish faster than Python and the CUDA
    driver can launch the next one, so the GPU waits on the host. A replay is one launch for the whole step.
    What it needs, and the scripts provide: the same shapes every step (the batch is copied into one fixed input
    buffer), no host syncs inside the step, an optimizer created with capturable=True (its step count lives on the
    GPU), and a warm-up step on a side stream before the capture, as PyTorch's CUDA-graph notes ask (Triton compiles
    its kernels then, not during the capture). Capturing runs nothing: the first replay is the first step it trains.
    The step's activations come from the graph's own memory pool, allocated during the capture as an eager step
    allocates them, so the peak-memory counter still sees the step's peak.
    A step that cannot be captured (a host sync, a copy from the host: e.g. in a peer's kernels) ends the run with
    one error line; running out of memory goes to main's message."""
    static_batch = example_batch.clone()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static_loss, static_accuracy = train_step(static_batch)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as err:
        torch_says = str(err).splitlines()[0]
        raise SystemExit(f"error: the training step cannot be captured as a CUDA graph ({torch_says}): something in "
                         f"it waits for the GPU or copies from the host; run without --cuda-graph") from None

    def graphed_step(micro_batches):
        static_batch.copy_(micro_batches)
        graph.replay()
        # the next replay overwrites the outputs in place: hand the caller copies
        return static_loss.clone(), None if static_accuracy is None else static_accuracy.clone()
    return graphed_step


def init_distributed(args):
    """(rank, world_size, device). --fsdp: join the process group that torchrun or accelerate launch set up, NCCL
    with one GPU per process (cuda:LOCAL_RANK), gloo on CPU; otherwise one process on the one device."""
    if not args.fsdp:
        return 0, 1, "cuda" if HAS_CUDA else "cpu"
    device = f"cuda:{os.environ['LOCAL_RANK']}" if HAS_CUDA else "cpu"
    if HAS_CUDA:
        torch.cuda.set_device(device)  # the current device of synchronize(), max_memory_allocated(), NCCL
    dist.init_process_group("nccl" if HAS_CUDA else "gloo", device_id=torch.device(device) if HAS_CUDA else None)
    return dist.get_rank(), dist.get_world_size(), device


# ----------------------------------------------------------------------------------------------------------------------

def main(argv=None):
    """The script. A run too large for the GPU ends with one line that says what to change, not with a traceback
    through transformers; nothing is written (the JSON comes only at the end)."""
    try:
        return fine_tune(argv)
    except torch.OutOfMemoryError as err:
        torch_says = str(err).split(" Including")[0]  # "CUDA out of memory. Tried to allocate ... is free."
        raise SystemExit(f"error: out of memory on the GPU ({torch_says}). Shorter sequences or batches (--seq-len, "
                         f"--batch-size), --activation-checkpointing full, or --seq-len-search to find the longest "
                         f"that fits") from None


def fine_tune(argv=None):
    args = parse_args(argv)
    if args.plot:
        return plot_memory(args.plot, args.out)
    rank, world_size, device = init_distributed(args)
    if rank != 0:  # every rank runs this same script: rank 0's copy of the output is enough
        sys.stdout = open(os.devnull, "w")
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if HAS_CUDA else torch.float32)
    info = run_info()
    torch.manual_seed(args.seed)  # the same on every rank: identical random weights before FSDP shards them
    model, weights = load_model(args, device, dtype)
    model.config.use_cache = False  # training: no KV cache
    model.train()
    config = model.config
    n_layers, vocab = config.num_hidden_layers, config.vocab_size

    # --- what this script changes about the model (baseline: nothing, or a peer) ------------------------------------
    replaced = {}
    if args.liger:
        if not HAS_CUDA:
            raise SystemExit("error: --liger needs a CUDA GPU (Liger-Kernel's Triton kernels have no CPU path)")
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as err:
            raise SystemExit(f"error: --liger needs the liger-kernel package ({err}); pip install liger-kernel")
        apply_liger_kernel_to_llama(model=model)  # RoPE, RMSNorm, SwiGLU MLP, fused linear cross-entropy
        # Liger patches the module instances' forward and their _get_name() (the class stays): 65 + 32 for 8B.
        replaced["liger_modules"] = sum(m._get_name().startswith("Liger") for m in model.modules())
        # liger_kernel has no __version__: the installed distribution's metadata has the version
        info["liger_kernel"] = importlib.metadata.version("liger-kernel")
    variant = "liger" if args.liger else "compile" if args.compile else "baseline"
    loss_impl = "liger" if args.liger else "eager"

    # --- long sequences: what the step keeps, recomputes, tiles or moves to the host (same in both scripts) ----------
    for flag, value in (("offload-activations", args.offload_activations),
                        ("checkpoint-layers", args.checkpoint_layers)):
        if value is not None and value > n_layers:
            raise SystemExit(f"error: --{flag} {value}: the model has {n_layers} decoder layers")
    if args.tiled_mlp:
        tile_mlps(model, args.tiled_mlp)  # after any MLP replacement: it tiles whatever forward the MLP now has
    offloader = None
    if args.activation_checkpointing != "none":
        offloader = enable_activation_checkpointing(model, args.activation_checkpointing, args.offload_activations,
                                                    args.checkpoint_layers)

    model_with_loss = ModelWithLoss(model, loss_impl)
    if args.compile:
        # The model and its loss compile as one module, on the warm-up step: the fused linear cross-entropy of
        # finetune_optimized.py reads lm_head's weight outside lm_head's forward, so compiling the model alone would
        # leave the loss and lm_head out of the graph.
        model_with_loss = torch.compile(model_with_loss, backend=COMPILE_BACKEND, mode=args.compile_mode)
    if args.fsdp:
        # FSDP2: every parameter is split across the ranks. Each decoder layer is one unit that all-gathers its
        # parameters just before its forward (and again for its backward), frees them after, and reduce-scatters
        # (averages) its gradients; the root unit holds the rest. Parameters stay in the model's dtype.
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model_with_loss)
    use_cuda_graph = args.cuda_graph and HAS_CUDA
    if args.cuda_graph and not HAS_CUDA:
        print("no CUDA device: --cuda-graph has no graph to capture, the steps run eagerly")
    if (use_cuda_graph or args.compile) and args.attn_implementation == "sdpa":
        causal_sdpa_without_mask(model)
    # After fully_shard: the optimizer must hold the sharded parameters (each rank updates its own shard).
    def make_optimizer(params):
        return torch.optim.AdamW(params, lr=args.lr, foreach=args.optimizer == "adamw_foreach",
                                 fused=args.optimizer == "adamw_fused", capturable=use_cuda_graph)
    if args.optimizer_in_backward:
        optimizer_in_backward(model, make_optimizer)
        optimizer = None  # nothing left to step after the backward
    else:
        optimizer = make_optimizer(model.parameters())
    phase = {"now": "idle"}  # the part of the step that is running: names what ran out of memory

    def train_step(micro_batches):
        """One optimizer step over micro_batches ([grad_accum_steps, batch, seq_len] token ids); returns the loss and
        the token accuracy (None where the loss does not give it), both device tensors: no host sync."""
        if offloader is not None:
            offloader.new_step()
        step_loss, step_accuracy = 0.0, 0.0
        for input_ids in micro_batches:
            phase["now"] = "forward"
            loss, accuracy = model_with_loss(input_ids, shift_labels_of(input_ids))
            loss = loss / len(micro_batches)
            phase["now"] = "backward" if optimizer is not None else "backward (with the optimizer steps inside)"
            loss.backward()
            step_loss = step_loss + loss.detach()
            step_accuracy = None if accuracy is None else step_accuracy + accuracy / len(micro_batches)
        phase["now"] = "optimizer step"
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        phase["now"] = "idle"
        if args.fsdp:  # log the global batch's figures: the mean over ranks (every rank has the same token count)
            for value in (step_loss, step_accuracy):
                if value is not None:  # sum of value / world_size (gloo has no AVG); a collective, not a host sync
                    dist.all_reduce(value.div_(world_size))
        return step_loss, step_accuracy

    # torch.compile compiles on the first call; in reduce-overhead mode it records its CUDA graphs on the second,
    # which takes about as long as 17 replayed steps (1x512, H200) and belongs to the warm-up, not to the timed steps.
    compile_records_graphs = args.compile and args.compile_mode == "reduce-overhead"
    warmup_steps = 2 if compile_records_graphs else 1

    def warm_up(micro_batches):
        """The untimed first step(s): kernels compile, cuBLAS picks algorithms, the optimizer creates its state. The
        first attention layer's forward records which SDPA kernel runs, but not under --compile: the recorder,
        entered inside the compiled model, would break its graph and send the decoder layers back to eager."""
        recorder = AttentionKernelRecorder()

        def start_recording(*_):  # a hook that returns None leaves the layer's inputs and outputs as they are
            recorder.__enter__()

        def stop_recording(*_):
            recorder.__exit__(None, None, None)
        attention = model.model.layers[0].self_attn
        hooks = [] if args.compile else [attention.register_forward_pre_hook(start_recording),
                                         attention.register_forward_hook(stop_recording)]
        # --cuda-graph: the warm-up runs on a side stream, as torch.cuda.graph asks, so that nothing it initializes
        # lazily is tied to the stream the capture then records.
        side_stream = torch.cuda.Stream() if use_cuda_graph else None
        try:
            t0 = time.perf_counter()
            if side_stream is not None:
                side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):  # None: the current stream
                for _ in range(warmup_steps):
                    loss, _ = train_step(micro_batches)
            sync()
        finally:
            for hook in hooks:
                hook.remove()
        return loss, time.perf_counter() - t0, sorted(recorder.seen)

    # --- header ------------------------------------------------------------------------------------------------------
    script = Path(__file__).name
    shape = f"{args.batch_size}x{args.seq_len}"
    print(f"device: {info['device']} | torch {info['torch']} | triton {info['triton']} | "
          f"transformers {info['transformers']} | commit {info['git_commit']}{'+dirty' if info['git_dirty'] else ''}")
    print(f"model: {args.model} ({weights} weights), {n_layers} layers, hidden {config.hidden_size}, vocab {vocab}, "
          f"{str(dtype).replace('torch.', '')}, attn {args.attn_implementation}")
    print(f"{script}: variant {variant}, loss {loss_impl}, optimizer {args.optimizer}, lr {args.lr}, data {args.data}"
          + (f", replaced {replaced}" if replaced else "")
          + (f", FSDP2 over {world_size} ranks (batch {args.batch_size} per rank)" if args.fsdp else ""))
    if args.compile:
        print(f"torch.compile: backend {COMPILE_BACKEND}, mode {args.compile_mode}"
              + ("" if HAS_CUDA else " (no CUDA device: aot_eager traces the graphs, generates no code)"))

    info["allocator_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    result = {**info, "script": script, "model": args.model, "weights": weights,
              "dtype": str(dtype).replace("torch.", ""), "variant": variant, "loss_impl": loss_impl,
              "replaced": replaced, "world_size": world_size, "options": vars(args),
              "compile_backend": COMPILE_BACKEND if args.compile else None}
    out_path = Path(args.out) if args.out else default_out_path(args, weights, result["dtype"], variant, world_size)

    if args.seq_len_search:
        # --- longest batch-1 sequence -------------------------------------------------------------------------------
        warmup_len = args.warmup_seq_len or min(2048, args.seq_len_search[0])
        print(f"seq-len search (batch 1, synthetic tokens, one step per length after a warm-up step of {warmup_len} "
              f"tokens): {args.seq_len_search}")
        generator = torch.Generator().manual_seed(args.seed)

        def random_tokens(seq_len):
            return torch.randint(0, vocab, (1, 1, seq_len), generator=generator).to(device)

        _, _, attention_kernels = warm_up(random_tokens(warmup_len))

        def try_length(seq_len):
            input_ids = random_tokens(seq_len)
            sync()
            if HAS_CUDA:
                torch.cuda.empty_cache()  # hand back the previous length's cached blocks
                torch.cuda.reset_peak_memory_stats()
            out_of_memory = False
            t0 = time.perf_counter()
            try:
                loss = train_step(input_ids)[0].item()  # .item(): the step has finished
            except torch.OutOfMemoryError:
                out_of_memory = True  # leave the except block first: its traceback still references the step's tensors
            step_s = time.perf_counter() - t0
            peak_gib = torch.cuda.max_memory_allocated() / 2**30 if HAS_CUDA else None  # null: no GPU, no peak
            if out_of_memory:
                failed_in, phase["now"] = phase["now"], "idle"
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                gc.collect()
                if HAS_CUDA:
                    torch.cuda.empty_cache()
                return {"status": "out of memory", "phase": failed_in, "peak_gib": peak_gib}
            if not math.isfinite(loss):
                return {"status": "non-finite loss", "loss": loss, "peak_gib": peak_gib}
            row = {"status": "trained", "loss": loss, "step_ms": 1e3 * step_s, "tokens_per_s": seq_len / step_s,
                   "peak_gib": peak_gib}
            if offloader is not None:
                offload = offloader.report()
                row.update(host_gib=offload.pop("host_bytes") / 2**30, offload=offload)
            return row

        rows, longest = seq_len_search(args.seq_len_search, try_length)
        print(f"longest batch-1 sequence that trained: {longest}")
        result["seq_len_search"] = {"lengths": args.seq_len_search, "warmup_seq_len": warmup_len,
                                    "results": rows, "longest_trained": longest}
        result["attention_kernels"] = attention_kernels
    else:
        # --- training ------------------------------------------------------------------------------------------------
        # steps + 1: the warm-up batch. Each rank gets its own rows of the global batches.
        n_micro = args.grad_accum_steps
        batches = make_batches(args, (args.steps + 1) * n_micro, vocab, config.eos_token_id, device, rank, world_size)
        batches = batches.view(args.steps + 1, n_micro, *batches.shape[1:])  # [step, micro-batch, batch, seq_len]
        tokens_per_step = world_size * n_micro * args.batch_size * args.seq_len  # global: all the ranks together

        warmup_loss, warmup_s, attention_kernels = warm_up(batches[0][..., :args.warmup_seq_len or args.seq_len])
        # The peak is the timed steps' own, except under reduce-overhead: its replays allocate nothing, their memory
        # was allocated while the warm-up recorded them, so the peak there includes the warm-up.
        if HAS_CUDA and not compile_records_graphs:
            torch.cuda.empty_cache()  # the warm-up's cached activations: a --cuda-graph capture allocates its own
            torch.cuda.reset_peak_memory_stats()
        step_function = capture_step(train_step, batches[0]) if use_cuda_graph else train_step

        losses, accuracies, step_times = [], [], []  # device tensors, read once at the end
        progress = tqdm(range(1, args.steps + 1), desc=variant, unit="step", disable=rank != 0)
        for step in progress:
            # Synchronize around the host timer so the step's GPU work is inside the interval (launches are async).
            sync()
            t0 = time.perf_counter()
            loss, accuracy = step_function(batches[step])
            sync()
            step_times.append(time.perf_counter() - t0)
            losses.append(loss)
            accuracies.append(accuracy)
            if step % args.log_interval == 0 or step == args.steps:
                # The step already synchronized for timing, so reading the loss here costs no extra stall.
                progress.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{tokens_per_step / step_times[-1]:,.0f}",
                                     **({"acc": f"{accuracy.item():.3f}"} if accuracy is not None else {}))
        progress.close()

        losses = torch.stack(losses).tolist()
        accuracies = None if accuracies[0] is None else torch.stack(accuracies).tolist()
        avg_step_s = sum(step_times) / len(step_times)
        tokens_per_s = tokens_per_step * len(step_times) / sum(step_times)
        peak_bytes = torch.cuda.max_memory_allocated() if HAS_CUDA else None
        peak_gib = peak_bytes / 2**30 if HAS_CUDA else None
        peak_bytes_per_rank = [peak_bytes]
        if args.fsdp:  # each rank holds its own shards, activations and optimizer state: report every rank's peak
            peak_bytes_per_rank = [None] * world_size
            dist.all_gather_object(peak_bytes_per_rank, peak_bytes)
        peak_gib_per_rank = [b / 2**30 if b is not None else None for b in peak_bytes_per_rank]
        offload = offloader.report() if offloader is not None else None
        recompute = None
        if args.measure_recompute:  # the same step without checkpointing, if it fits
            model.gradient_checkpointing_disable()
            sync()
            t0 = time.perf_counter()
            try:
                train_step(batches[-1])
                sync()
                recompute = {"step_ms_without_checkpointing": 1e3 * (time.perf_counter() - t0)}
                recompute["overhead"] = avg_step_s * 1e3 / recompute["step_ms_without_checkpointing"] - 1
            except torch.OutOfMemoryError:
                recompute = {"step_ms_without_checkpointing": None, "overhead": None,
                             "note": f"out of memory without checkpointing (in the {phase['now']})"}

        # --- summary -----------------------------------------------------------------------------------------------
        print(f"---- summary: {script} [{variant}] {args.model} ({weights} weights) {shape} {args.optimizer} ----")
        print(f"steps timed     : {args.steps} (after {warmup_steps} warm-up step{'s' * (warmup_steps > 1)} of "
              f"{warmup_s:.2f} s)")
        print(f"avg step time   : {1e3 * avg_step_s:.1f} ms")
        print(f"tokens/s        : {tokens_per_s:,.0f}"
              + (f" over {world_size} ranks, {tokens_per_s / world_size:,.0f} per GPU" if args.fsdp else ""))
        print(f"peak GPU memory : " + (f"{peak_gib:.2f} GiB ({peak_bytes / 1e9:.1f} GB)" if HAS_CUDA else "n/a (CPU)")
              + (f"; per rank {', '.join(f'{g:.2f}' for g in peak_gib_per_rank)} GiB" if args.fsdp and HAS_CUDA
                 else ""))
        print(f"loss            : {losses[0]:.4f} (step 1) -> {losses[-1]:.4f} (step {args.steps})"
              + (f" | token accuracy {accuracies[0]:.3f} -> {accuracies[-1]:.3f}" if accuracies else ""))
        not_seen = "not recorded under --compile" if args.compile else "no SDPA kernel seen"
        print(f"attention       : {', '.join(attention_kernels) or not_seen} | checkpointing "
              f"{args.activation_checkpointing}" + (f", MLP tiles of {args.tiled_mlp} tokens" if args.tiled_mlp else "")
              + (", optimizer in backward" if args.optimizer_in_backward else "")
              + (" | the whole step replayed as one CUDA graph" if use_cuda_graph else "")
              + f" | allocator {os.environ.get('PYTORCH_CUDA_ALLOC_CONF') or 'default'}")
        if offload is not None:
            timing = (f"; one layer's copy {offload['copy_ms']:.1f} ms against {offload['layer_compute_ms']:.1f} ms "
                      f"of compute per layer" if "copy_ms" in offload else "")
            print(f"offload         : {offload['host_bytes'] / 2**30:.2f} GiB on the host ({offload['layers']} layer "
                  f"inputs){timing}")
        if recompute is not None:
            print(f"recompute       : " + (f"{recompute['overhead']:+.1%} step time against "
                                           f"{recompute['step_ms_without_checkpointing']:.0f} ms without checkpointing"
                                           if recompute["overhead"] is not None else recompute["note"]))
        result.update({"shape": shape, "tokens_per_step": tokens_per_step, "steps": args.steps,
                       "warmup_steps": warmup_steps, "warmup_loss": warmup_loss.item(), "warmup_s": warmup_s,
                       "avg_step_ms": 1e3 * avg_step_s, "tokens_per_s": tokens_per_s,
                       "tokens_per_s_per_gpu": tokens_per_s / world_size,
                       "peak_memory_gib": peak_gib, "peak_memory_bytes": peak_bytes,
                       "peak_memory_gib_per_rank": peak_gib_per_rank,
                       "losses": losses, "token_accuracies": accuracies, "step_ms": [1e3 * s for s in step_times],
                       "attention_kernels": attention_kernels, "offload": offload, "recompute": recompute,
                       "cuda_graph": use_cuda_graph})

    if rank == 0:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results: {out_path}")
    if args.fsdp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
