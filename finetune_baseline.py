"""Full fine-tuning of LLaMA-3.1-8B with stock PyTorch + transformers: the BASELINE.

The playbook's step 11, first half. One readable loop (nanoGPT style): build the model, one warm-up step, reset the
peak-memory counter, then --steps timed steps of forward -> loss -> backward -> AdamW step -> zero_grad, and a summary
(average step time, tokens/s, peak GPU memory) plus a JSON file with everything needed to compare runs.

finetune_optimized.py is the same script with the fused kernels plugged in; `diff finetune_baseline.py
finetune_optimized.py` shows exactly what they change. This one also offers the peers a user would try first:
--compile (torch.compile of the model) and --liger (Liger-Kernel's apply_liger_kernel_to_llama).

    python finetune_baseline.py                                 # 20 steps at 1x512 (tiny LLaMA on CPU)
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
import gc
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from tqdm import tqdm

import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.utils import is_accelerate_available

HERE = Path(__file__).resolve().parent
HAS_CUDA = torch.cuda.is_available()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B" if HAS_CUDA else "tiny",
                        help='Hub id or local folder (save_pretrained); "tiny" = a 2-layer LLaMA with random weights '
                             '(CPU runs)')
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="auto = bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--attn-implementation", default="sdpa", help="transformers attention backend")
    parser.add_argument("--allow-download", action="store_true", help="let from_pretrained/load_dataset reach the Hub")
    parser.add_argument("--strict-weights", action="store_true",
                        help="fail instead of falling back to random weights when the weights cannot be loaded")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps (after one warm-up step)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=512 if HAS_CUDA else 32,
                        help="tokens per sequence, at least 2 (32 without a GPU: the Triton interpreter is slow)")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random weights and the synthetic tokens")
    parser.add_argument("--optimizer", choices=["adamw_foreach", "adamw_fused"], default="adamw_foreach",
                        help="torch AdamW, multi-tensor (foreach) or single fused kernel")
    parser.add_argument("--data", default="synthetic",
                        help='"synthetic" (random tokens), a save_to_disk folder, a local .txt/.json/.jsonl/.parquet/'
                             '.csv file, or a Hub data set name')
    parser.add_argument("--text-field", default="text", help="the column of --data that holds the text")
    parser.add_argument("--log-interval", type=int, default=1, help="update the progress bar every N steps")
    parser.add_argument("--seq-len-search", default=None, metavar="L1,L2,...",
                        help="instead of training: find the longest batch-1 length that trains (2 steps each)")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the model with FSDP2 over the N processes of torchrun --nproc-per-node N or "
                             "accelerate launch --multi_gpu --num_processes N; --batch-size is per rank (global batch "
                             "= N x --batch-size)")
    parser.add_argument("--out", default=None,
                        help="JSON results path; when not given: runs/<script>_<model>-<weights>_<variant>_<data>_"
                             "<optimizer>_<dtype>_<shape>[_fsdpN][_<option>=<value>...].json")
    # -- baseline only: the peers a user would try -----------------------------------------------------------------
    peers = parser.add_mutually_exclusive_group()
    peers.add_argument("--compile", action="store_true", help="torch.compile(model)")
    peers.add_argument("--liger", action="store_true", help="Liger-Kernel's apply_liger_kernel_to_llama(model=...)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "log_interval"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.seq_len < 2:  # position t learns to predict token t+1: a single token leaves nothing to predict
        parser.error("--seq-len must be at least 2: the loss predicts each next token, so 1 token has none")
    if args.seq_len_search:
        try:
            args.seq_len_search = [int(x) for x in args.seq_len_search.split(",")]
        except ValueError:
            parser.error("--seq-len-search takes comma-separated integers, e.g. 4096,8192,12288")
        if args.seq_len_search != sorted(set(args.seq_len_search)) or min(args.seq_len_search) < 2:
            parser.error("--seq-len-search lengths must be at least 2 and increasing")
    if args.fsdp:
        combined = [name for name in ("seq_len_search", "compile", "liger") if getattr(args, name, None)]  # the last
        if combined:                                                      # two exist in finetune_baseline.py only
            parser.error(f"--fsdp cannot be combined with --{combined[0].replace('_', '-')}")
        if "WORLD_SIZE" not in os.environ:
            parser.error(f"--fsdp needs a distributed launcher, e.g. torchrun --standalone --nproc-per-node 2 "
                         f"{Path(__file__).name} --fsdp or accelerate launch --multi_gpu --num_processes 2 "
                         f"{Path(__file__).name} --fsdp (torchrun --nproc-per-node 1 for a single process)")
    return args


# ----------------------------------------------------------------------------------------------------------------------
# Run information: what ran, where, with which versions (goes into the header and the JSON)

def git_info():
    """(short commit, dirty?) of the checkout; outside a git checkout (a copied tree on a GPU box) the GIT_COMMIT
    and GIT_DIRTY environment variables say which commit the copy was taken from."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=HERE, capture_output=True, text=True, timeout=10)
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode == 0:
            return head.stdout.strip(), bool(git("status", "--porcelain").stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("GIT_COMMIT", "uncommitted"), os.environ.get("GIT_DIRTY") not in (None, "0")


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
    name = args.model
    if name != "tiny":
        local = is_local_path(name)
        if local and not Path(name).expanduser().is_dir():
            raise SystemExit(f"error: --model {name}: no such directory (a local model is the folder written by "
                             f"save_pretrained; a Hub id has the form org/name)")
        placement = {"device_map": device} if is_accelerate_available() else {}
        try:
            model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(name) if local else name, dtype=dtype,
                                                         attn_implementation=args.attn_implementation,
                                                         local_files_only=not args.allow_download, **placement)
            return model.to(device), "real"
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
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation=args.attn_implementation)
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
    if loss_impl == "liger":
        # Liger's fused linear cross-entropy lives in its patched forward, which only takes that path when it is given
        # labels in training mode; shift_labels is transformers' own keyword for already-shifted labels.
        return model(input_ids=input_ids, shift_labels=shift_labels).loss
    logits = model(input_ids=input_ids).logits  # [B, T, V] in the model's dtype
    # transformers' ForCausalLMLoss: upcast the logits to fp32, mean over the non-ignored tokens.
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), shift_labels.view(-1), ignore_index=-100)


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
# Longest trainable sequence: each length must survive an optimizer step AFTER the optimizer state exists

def seq_len_search(lengths, try_length, free_memory):
    """try_length(L) runs two optimizer steps at batch 1 x L and returns its metrics; the first length that runs out
    of memory ends the search (longer ones would too). Returns (rows, longest length that trained or None)."""
    rows, longest = [], None
    for seq_len in lengths:
        out_of_memory = False
        try:
            row = try_length(seq_len)
        except torch.OutOfMemoryError:
            out_of_memory = True  # leave the except block first: its traceback still references the step's tensors
        if out_of_memory:
            free_memory()
            rows.append({"seq_len": seq_len, "trained": False})
            print(f"seq_len {seq_len:>6}: out of memory")
            break
        rows.append({"seq_len": seq_len, "trained": True, **row})
        longest = seq_len
        print(f"seq_len {seq_len:>6}: trained, {row['step_ms']:.0f} ms/step, peak {row['peak_gib']:.2f} GiB")
    return rows, longest


def sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


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
    args = parse_args(argv)
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
            import liger_kernel
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as err:
            raise SystemExit(f"error: --liger needs the liger-kernel package ({err}); pip install liger-kernel")
        apply_liger_kernel_to_llama(model=model)  # RoPE, RMSNorm, SwiGLU MLP, fused linear cross-entropy
        # Liger patches the module instances' forward and their _get_name() (the class stays): 65 + 32 for 8B.
        replaced["liger_modules"] = sum(m._get_name().startswith("Liger") for m in model.modules())
        info["liger_kernel"] = getattr(liger_kernel, "__version__", "installed")
    variant = "liger" if args.liger else "compile" if args.compile else "baseline"
    loss_impl = "liger" if args.liger else "eager"

    if args.compile:
        model = torch.compile(model)  # compiles on the warm-up step
    model_with_loss = ModelWithLoss(model, loss_impl)
    if args.fsdp:
        # FSDP2: every parameter is split across the ranks. Each decoder layer is one unit that all-gathers its
        # parameters just before its forward (and again for its backward), frees them after, and reduce-scatters
        # (averages) its gradients; the root unit holds the rest. Parameters stay in the model's dtype.
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model_with_loss)
    # After fully_shard: the optimizer must hold the sharded parameters (each rank updates its own shard).
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=args.optimizer == "adamw_foreach",
                                  fused=args.optimizer == "adamw_fused")

    def train_step(input_ids):
        loss = model_with_loss(input_ids, shift_labels_of(input_ids))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.fsdp:  # log the global batch's loss: the mean over ranks (every rank has the same token count)
            loss = loss.detach() / world_size
            dist.all_reduce(loss)  # sum of loss / world_size (gloo has no AVG); a collective, not a host sync
        return loss.detach()

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

    result = {**info, "script": script, "model": args.model, "weights": weights,
              "dtype": str(dtype).replace("torch.", ""), "variant": variant, "loss_impl": loss_impl,
              "replaced": replaced, "world_size": world_size, "options": vars(args)}
    out_path = Path(args.out) if args.out else default_out_path(args, weights, result["dtype"], variant, world_size)

    if args.seq_len_search:
        # --- longest batch-1 sequence -------------------------------------------------------------------------------
        print(f"seq-len search (batch 1, synthetic tokens, 2 optimizer steps each): {args.seq_len_search}")
        generator = torch.Generator().manual_seed(args.seed)

        def try_length(seq_len):
            input_ids = torch.randint(0, vocab, (1, seq_len), generator=generator).to(device)
            sync()
            if HAS_CUDA:
                torch.cuda.empty_cache()  # hand back the previous length's cached blocks: less fragmentation
                torch.cuda.reset_peak_memory_stats()
            for _ in range(2):  # the second step is the one that runs with the optimizer state allocated
                t0 = time.perf_counter()
                train_step(input_ids)
                sync()
                step_s = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated() / 2**30 if HAS_CUDA else 0.0
            return {"step_ms": 1e3 * step_s, "tokens_per_s": seq_len / step_s, "peak_gib": peak}

        def free_memory():
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if HAS_CUDA:
                torch.cuda.empty_cache()

        rows, longest = seq_len_search(args.seq_len_search, try_length, free_memory)
        print(f"longest batch-1 sequence that trained: {longest}")
        result["seq_len_search"] = {"lengths": args.seq_len_search, "results": rows, "longest_trained": longest}
    else:
        # --- training ------------------------------------------------------------------------------------------------
        # steps + 1: the warm-up batch. Each rank gets its own rows of the global batches.
        batches = make_batches(args, args.steps + 1, vocab, config.eos_token_id, device, rank, world_size)
        tokens_per_step = world_size * args.batch_size * args.seq_len  # global: all the ranks together

        # Warm-up: Triton/torch.compile compile, cuBLAS picks algorithms, AdamW allocates its state. Not timed.
        t0 = time.perf_counter()
        warmup_loss = train_step(batches[0])
        sync()
        warmup_s = time.perf_counter() - t0
        if HAS_CUDA:
            torch.cuda.reset_peak_memory_stats()

        losses, step_times = [], []  # losses stay on the device; read once at the end
        progress = tqdm(range(1, args.steps + 1), desc=variant, unit="step", disable=rank != 0)
        for step in progress:
            # Synchronize around the host timer so the step's GPU work is inside the interval (launches are async).
            sync()
            t0 = time.perf_counter()
            loss = train_step(batches[step])
            sync()
            step_times.append(time.perf_counter() - t0)
            losses.append(loss)
            if step % args.log_interval == 0 or step == args.steps:
                # The step already synchronized for timing, so reading the loss here costs no extra stall.
                progress.set_postfix(loss=f"{loss.item():.4f}", tok_s=f"{tokens_per_step / step_times[-1]:,.0f}")
        progress.close()

        losses = torch.stack(losses).tolist()
        avg_step_s = sum(step_times) / len(step_times)
        tokens_per_s = tokens_per_step * len(step_times) / sum(step_times)
        peak_bytes = torch.cuda.max_memory_allocated() if HAS_CUDA else None
        peak_gib = peak_bytes / 2**30 if HAS_CUDA else None
        peak_bytes_per_rank = [peak_bytes]
        if args.fsdp:  # each rank holds its own shards, activations and optimizer state: report every rank's peak
            peak_bytes_per_rank = [None] * world_size
            dist.all_gather_object(peak_bytes_per_rank, peak_bytes)
        peak_gib_per_rank = [b / 2**30 if b is not None else None for b in peak_bytes_per_rank]

        # --- summary -----------------------------------------------------------------------------------------------
        print(f"---- summary: {script} [{variant}] {args.model} ({weights} weights) {shape} {args.optimizer} ----")
        print(f"steps timed     : {args.steps} (after 1 warm-up step of {warmup_s:.2f} s)")
        print(f"avg step time   : {1e3 * avg_step_s:.1f} ms")
        print(f"tokens/s        : {tokens_per_s:,.0f}"
              + (f" over {world_size} ranks, {tokens_per_s / world_size:,.0f} per GPU" if args.fsdp else ""))
        print(f"peak GPU memory : " + (f"{peak_gib:.2f} GiB ({peak_bytes / 1e9:.1f} GB)" if HAS_CUDA else "n/a (CPU)")
              + (f"; per rank {', '.join(f'{g:.2f}' for g in peak_gib_per_rank)} GiB" if args.fsdp and HAS_CUDA
                 else ""))
        print(f"loss            : {losses[0]:.4f} (step 1) -> {losses[-1]:.4f} (step {args.steps})")
        result.update({"shape": shape, "tokens_per_step": tokens_per_step, "steps": args.steps,
                       "warmup_loss": warmup_loss.item(), "warmup_s": warmup_s,
                       "avg_step_ms": 1e3 * avg_step_s, "tokens_per_s": tokens_per_s,
                       "tokens_per_s_per_gpu": tokens_per_s / world_size,
                       "peak_memory_gib": peak_gib, "peak_memory_bytes": peak_bytes,
                       "peak_memory_gib_per_rank": peak_gib_per_rank,
                       "losses": losses, "step_ms": [1e3 * s for s in step_times]})

    if rank == 0:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"results: {out_path}")
    if args.fsdp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
