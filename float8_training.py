"""Float8 training of the decoder's linear layers with torchao: finetune_optimized.py --fp8 rowwise|tensorwise.

What float8 training is
-----------------------
A Linear layer costs three matmuls per step: the output (x @ W.T) in the forward, grad_input (dy @ W) and grad_weight
(dy.T @ x) in the backward. On a GPU with FP8 tensor cores (compute capability 8.9 and up: Ada, Hopper) a matmul on
float8 operands runs at twice the bf16 peak. torchao's Float8Linear casts each operand to float8 just before its
matmul and accumulates in fp32, so the output and the gradients come out in the model's dtype. Everything else stays
as it was: the weights, their gradients and AdamW's state in bf16, every non-matmul op (our RMSNorm, SwiGLU, RoPE,
attention, the loss) in bf16. It saves compute, not memory: each layer keeps its bf16 input for the backward, as a
bf16 Linear does, and the float8 copies exist only around their matmul.

float8 has few bits: e4m3 (4 exponent bits, 3 mantissa bits, largest value 448) for values, e5m2 (2 mantissa bits,
more range) for the gradients in the tensorwise recipe. So every cast is scaled: the tensor is multiplied by
448 / amax (its largest magnitude), which spends the few bits on the values present, and the matmul divides the scale
back out. The scales are dynamic, from this very tensor's amax, at each cast.

Why torch.compile is part of it
-------------------------------
Each cast is a reduction (amax) and an elementwise pass (scale, round, saturate), each a full read of a bf16 tensor
of the size of the matmul's operand. Run eagerly, those extra passes over memory eat the matmul's gain. Compiled,
inductor fuses amax, scale and cast into few kernels. --fp8 therefore compiles every decoder layer in place (the
layers share one graph); with --compile the whole step is compiled already. Our kernels are custom operators: the
compiled graph calls them as they are, and the casts and the small ops between them become generated code.

Rowwise or tensorwise (torchao's recipes)
-----------------------------------------
- tensorwise: one scale per tensor. The cheapest cast (one amax) and cuBLAS's plain FP8 matmul: the faster recipe.
  But one outlier anywhere (LLMs have a few activation channels far larger than the rest) sets the scale for every
  value, and small values in other rows lose their bits or round to zero. Gradients use e5m2.
- rowwise: one scale per row of each operand, along the dimension the matmul sums over, so an outlier costs
  resolution in its own row only; the scales are rounded down to powers of two (scaling is then exact) and all three
  operands use e4m3. The matmul is a row-scaled kernel (CUTLASS) and the casts do more work: the more accurate,
  somewhat slower recipe; which wins end to end is what the measurement says.
- rowwise_with_gw_hp: rowwise, but the weight gradient's matmul (dy.T @ x, summed over all tokens, where rounding
  errors add up most) stays in bf16: a third of the float8 gain given back for accuracy.

Which layers
------------
Every nn.Linear inside the decoder layers (model.model.layers): for Llama q/k/v/o_proj and gate/up/down_proj, 7 per
layer, 224 for Llama-3.1-8B; Phi-3's fused qkv_proj and gate_up_proj count once each. The fused MLP and attention
call their Linear modules, so the swap reaches them. NOT the lm_head: its matmul is inside our fused linear
cross-entropy (--loss linear_ce), which reads lm_head.weight and never calls the module, so a converted lm_head would
claim float8 and still run bf16. The logits also feed a softmax over the whole vocabulary, where 3 mantissa bits
would move the loss itself: float8 pre-training recipes (torchtitan's) also leave the output projection in bf16.
torchao's own size filter (_auto_filter_for_recipe) would also leave Llama-3.1-8B's k_proj and v_proj (1024 outputs)
in bf16, where it measured the casts costing more than the faster matmul saves; here the whole decoder is converted
unless --fp8-keep-bf16 names the Linears to leave (k_proj v_proj: torchao's choice), and a measurement tells which pays.

The checks, one error line each
-------------------------------
Before the model loads: --loss ce or eager (those call the lm_head module, the one Linear float8 leaves out: the fp8 run
is defined with the fused linear cross-entropy); --fsdp and --cuda-graph (both refuse --compile too, and --fp8
compiles); no GPU, or one below compute capability 8.9 (no FP8 tensor cores); torch below 2.11 (NGC images built
on 2.10); torchao missing, or too old for the recipe. At the swap: a decoder Linear whose sizes are not multiples of 16
(the FP8 matmul's requirement), and afterwards any decoder Linear left unconverted or a converted lm_head (the count
goes into the run's "replaced" record). On the CPU, the tests run the same conversion with torchao's emulation
(emulate=True: the same casts, the matmul in high precision).

Loss parity: run as a script
----------------------------
Faster training that learns less is not faster, so a float8 run's loss curve is compared with bf16's from the same
seed and data. The text to learn is the Python standard library's own source (every machine has it; without a
tokenizer the scripts train on its UTF-8 bytes), the model configs/llama-small (small enough for 300 steps in
minutes):
    python float8_training.py --write-corpus stdlib.txt
    python finetune_optimized.py --model llama-small --data stdlib.txt --steps 300 --batch-size 4 --seq-len 2048 \
        --lr 1e-4 --lr-scheduler cosine --warmup-steps 30 --out bf16.json   # again with --fp8 tensorwise (or rowwise)
    python float8_training.py --compare bf16.json fp8.json --out results/fp8_loss_parity_tensorwise_h100.json
The comparison smooths both curves with a trailing mean over --window steps (20) and reports the largest relative gap
of the smoothed fp8 curve from bf16's (`max_smoothed_rel_gap`), with a PNG of both curves beside the JSON. The same
comparison of the bf16 run with a `--compile` run of it (other kernels, other rounding, the same math) gives the
noise floor: how far two runs drift apart from rounding alone. It grows with the learning rate, and a gap is worth
reading only well above it.
"""
import dataclasses
import importlib.metadata
import json
import random
import sys
import sysconfig
from pathlib import Path

import torch

RECIPES = ("rowwise", "tensorwise", "rowwise_with_gw_hp")
MIN_CAPABILITY = (8, 9)  # the first NVIDIA GPUs with FP8 tensor cores (Ada; Hopper is 9.0)
# torchao 0.17+ is built against torch's stable ABI; the pinned 0.18 is built and tested for torch 2.11 and newer
MIN_TORCH = (2, 11)
# torch._scaled_mm, the FP8 matmul, takes operands whose sizes are multiples of 16
FP8_MATMUL_MULTIPLE = 16


def torchao_version():
    """The installed torchao's version, or None (read from its metadata: importing torchao is not needed)."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def fp8_problem(args, cuda_capability):
    """Why `--fp8 args.fp8` cannot run with these arguments on this machine, as one line; None when it can.
    cuda_capability: (major, minor) of the GPU, None without one."""
    if args.loss != "linear_ce":
        return (f"--fp8 goes with --loss linear_ce: --loss {args.loss} runs the lm_head as a Linear outside the fused "
                f"loss, which float8 would have to convert (at the logits' accuracy) or leave in bf16")
    clash = next((flag for flag, used in (("--fsdp", args.fsdp), ("--cuda-graph", args.cuda_graph)) if used), None)
    if clash:
        return f"--fp8 compiles the decoder layers: it cannot be combined with {clash}, as --compile cannot"
    if cuda_capability is None or tuple(cuda_capability) < MIN_CAPABILITY:
        major, minor = MIN_CAPABILITY
        found = "no CUDA device" if cuda_capability is None else "compute capability {}.{}".format(*cuda_capability)
        return (f"--fp8 needs a GPU with FP8 tensor cores, compute capability {major}.{minor} or higher (H100, L40S, "
                f"RTX 4090); found {found}")
    torch_release = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if torch_release < MIN_TORCH:
        return (f"--fp8 needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or newer for the pinned torchao; this is torch "
                f"{torch.__version__}")
    version = torchao_version()
    if version is None:
        return "--fp8 needs torchao, which is not installed: pip install -r requirements.txt"
    try:
        from torchao.float8 import Float8LinearConfig, Float8LinearRecipeName
    except ImportError as err:  # before the recipes had names (or a broken install: the error says which)
        return f"--fp8 {args.fp8}: torchao {version} has no float8 recipes ({err}); pip install -r requirements.txt"
    recipes = [recipe.value for recipe in Float8LinearRecipeName]
    if args.fp8 not in recipes or not hasattr(Float8LinearConfig, "from_recipe_name"):
        return (f"--fp8 {args.fp8}: torchao {version} is too old for this recipe (its recipes: {', '.join(recipes)}); "
                f"pip install -r requirements.txt")
    return None


def check_fp8_flags(parser, args):
    """--fp8's rules (parse_args calls this): a usage error before anything is loaded."""
    if getattr(args, "fp8_keep_bf16", None) and not args.fp8:
        parser.error("--fp8-keep-bf16 goes with --fp8")
    if args.fp8:
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        problem = fp8_problem(args, capability)
        if problem:
            parser.error(problem)


def is_decoder_linear(module, fqn):
    """torchao's module_filter_fn: the Linear layers inside model.model.layers, not the lm_head."""
    return isinstance(module, torch.nn.Linear) and fqn.startswith("model.layers.")


def convert_decoder_linears(model, recipe, emulate=False, keep_bf16=()):
    """Swaps every Linear of the decoder layers for torchao's float8 training Linear of `recipe` (the same weight
    Parameter: the optimizer, checkpoints and save_pretrained see the same model); returns how many. emulate: torchao's
    emulation, the same casts with the matmuls in high precision (the CPU tests). keep_bf16: names of Linears
    (k_proj, v_proj, ...) left as they are in every layer, where the casts may cost more than the faster matmul saves
    (torchao's own size filter leaves Llama-3.1-8B's k_proj and v_proj, 1024 outputs, in bf16)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def converts(module, fqn):
        return is_decoder_linear(module, fqn) and fqn.rsplit(".", 1)[-1] not in keep_bf16

    layers = model.model.layers
    names = {fqn.rsplit(".", 1)[-1] for fqn, m in layers.named_modules() if isinstance(m, torch.nn.Linear)}
    unknown = sorted(set(keep_bf16) - names)
    if unknown or names <= set(keep_bf16):
        raise SystemExit(f"error: --fp8-keep-bf16 {' '.join(keep_bf16)}: the decoder's Linears are "
                         f"{', '.join(sorted(names))}; name some of them, not all" + (
                             f" ({', '.join(unknown)} is none of them)" if unknown else ""))
    linears = [sum(isinstance(m, torch.nn.Linear) and fqn.rsplit(".", 1)[-1] not in keep_bf16
                   for fqn, m in layer.named_modules()) for layer in layers]
    if not emulate:
        odd = next((f"{name} {tuple(m.weight.shape)}" for name, m in model.named_modules()
                    if converts(m, name) and any(size % FP8_MATMUL_MULTIPLE for size in m.weight.shape)), None)
        if odd:
            raise SystemExit(f"error: --fp8: {odd}: the FP8 matmul needs sizes that are multiples of "
                             f"{FP8_MATMUL_MULTIPLE}")
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=True) if emulate else config
    convert_to_float8_training(model, module_filter_fn=converts, config=config)
    # A plain Linear left in a layer (other than those kept), or none converted, is an error, not a bf16 run under an
    # fp8 name.
    converted = [sum(isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear for m in layer.modules())
                 for layer in layers]
    if converted != linears or not sum(converted) or type(model.lm_head) is not torch.nn.Linear:
        raise SystemExit(f"error: --fp8 {recipe}: converted {converted} Linear layers per decoder layer, expected "
                         f"{linears} and the lm_head left as it is")
    return sum(converted)


def compile_decoder_layers(model, backend):
    """torch.compile each decoder layer in place (nn.Module.compile: the module keeps its class and its parameter
    names), so the float8 casts between our kernels fuse. Compilation happens at the first forward, after the memory
    levers are in place; one graph serves every layer (the guards do not depend on which layer runs).

    Rowwise scaling reduces each operand along the dimension its matmul sums over; for the backward's operands that
    is across the tokens: a column reduction fused with a transposed float8 write. With inductor's defaults such a
    kernel runs several times slower than a copy. Three options make it fast: tile reductions and pointwise kernels
    in two dimensions (tile_reductions, prefer_nd_tiling), so that both the reads along rows and the transposed writes
    along columns are coalesced, and time neighbouring block sizes of each kernel once, at its first compile
    (coordinate_descent_tuning)."""
    options = ({"coordinate_descent_tuning": True, "triton.tile_reductions": True, "triton.prefer_nd_tiling": True}
               if backend == "inductor" else None)
    for layer in model.model.layers:
        layer.compile(backend=backend, options=options)


# ----------------------------------------------------------------------------------------------------------------------
# Loss parity: the script

# What two runs must share for their loss curves to be comparable (the fine-tune scripts' "options" in their JSON).
SAME_RUN_OPTIONS = ("model", "data", "seed", "steps", "batch_size", "seq_len", "grad_accum_steps", "lr", "lr_scheduler",
                    "warmup_steps", "max_grad_norm", "dtype")


# The order of the corpus' files: the same on every machine whose standard library has the same files.
CORPUS_SEED = 0


def corpus_files():
    """The standard library's .py files (this interpreter's, without its tests and site-packages), in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py")) if "site-packages" not in p.parts and "test" not in p.parts]


def write_corpus(path):
    """The standard library's .py sources (this interpreter's) as one UTF-8 text file, the files in a fixed shuffled
    order; returns its size in bytes. Shuffled because the fine-tune scripts read text in order and do not shuffle: in
    path order the first hundred steps would see only a few packages, and the loss curve would follow which files come
    up (easy ones dip it, hard ones lift it) rather than what the model learns."""
    paths = corpus_files()
    random.Random(CORPUS_SEED).shuffle(paths)
    sources = [p.read_text(encoding="utf-8", errors="replace") for p in paths]
    text = "\n".join(sources)
    Path(path).write_text(text, encoding="utf-8")
    return len(text.encode("utf-8"))


def smoothed(losses, window):
    """Trailing mean over `window` steps: step i averages steps max(0, i - window + 1) .. i."""
    sums, total = [], 0.0
    for i, loss in enumerate(losses):
        total += loss - (losses[i - window] if i >= window else 0.0)
        sums.append(total / min(i + 1, window))
    return sums


def compare_runs(reference, candidate, window):
    """The parity record of two fine-tune JSONs (bf16 reference, float8 candidate): both curves raw and smoothed and
    the largest relative gap of the smoothed candidate from the smoothed reference. Runs that differ in what decides
    the loss curve (SAME_RUN_OPTIONS) are refused with the first difference."""
    for name in SAME_RUN_OPTIONS:
        if reference["options"].get(name) != candidate["options"].get(name):
            raise SystemExit(f"error: --compare: the runs differ in --{name.replace('_', '-')} "
                             f"({reference['options'].get(name)!r} and {candidate['options'].get(name)!r}): their "
                             f"losses are not comparable")
    curves = {"reference": reference["losses"], "candidate": candidate["losses"]}
    smooth = {key: smoothed(losses, window) for key, losses in curves.items()}
    gaps = [abs(c - r) / abs(r) for r, c in zip(smooth["reference"], smooth["candidate"])]
    return {"reference": {"variant": reference["variant"], "device": reference["device"],
                          "git_commit": reference["git_commit"], "losses": curves["reference"],
                          "smoothed": smooth["reference"]},
            "candidate": {"variant": candidate["variant"], "device": candidate["device"],
                          "git_commit": candidate["git_commit"], "losses": curves["candidate"],
                          "smoothed": smooth["candidate"]},
            "window": window, "steps": len(gaps), "max_smoothed_rel_gap": max(gaps),
            "at_step": candidate["start_step"] + 1 + gaps.index(max(gaps)), "options": reference["options"]}


def plot_parity(record, path):
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for key, color in (("reference", "tab:blue"), ("candidate", "tab:red")):
        run = record[key]
        steps = range(1, len(run["losses"]) + 1)
        axes.plot(steps, run["losses"], color=color, alpha=0.25, linewidth=0.8)
        axes.plot(steps, run["smoothed"], color=color, label=f"{run['variant']} ({record['window']}-step mean)")
    axes.set(xlabel="step", ylabel="training loss", title=f"{record['options']['model']}: max smoothed relative gap "
             f"{100 * record['max_smoothed_rel_gap']:.2f} % ({record['candidate']['device']})")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description="Float8 loss parity: the corpus to train on, and the comparison of a "
                                     "float8 run's losses with bf16's (see this file's docstring for the commands)")
    parser.add_argument("--write-corpus", metavar="PATH", help="write the standard library's sources to PATH (.txt)")
    parser.add_argument("--compare", nargs=2, metavar=("BF16_JSON", "FP8_JSON"),
                        help="the fine-tune scripts' results JSON of the bf16 run and of the float8 run")
    parser.add_argument("--window", type=int, default=20, help="steps of the trailing mean both curves are smoothed by")
    parser.add_argument("--out", default="fp8_loss_parity.json", help="the parity JSON (its PNG goes beside it)")
    args = parser.parse_args(argv)
    if not args.write_corpus and not args.compare:
        parser.error("nothing to do: give --write-corpus PATH and/or --compare BF16_JSON FP8_JSON")
    if args.window < 1:
        parser.error("--window must be positive")
    if args.write_corpus:
        print(f"{args.write_corpus}: {write_corpus(args.write_corpus) / 2**20:.1f} MiB of standard library source")
    if args.compare:
        runs = []
        for path in args.compare:
            try:
                runs.append(json.loads(Path(path).read_text()))
            except (OSError, ValueError) as err:
                parser.error(f"--compare {path}: not a readable results JSON ({err})")
            if not runs[-1].get("losses"):
                parser.error(f"--compare {path}: no per-step losses (a --seq-len-search run?)")
        record = compare_runs(*runs, args.window)
        record["command"] = [sys.executable, *sys.argv]
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        plot_parity(record, out.with_suffix(".png"))
        print(f"max smoothed relative gap {100 * record['max_smoothed_rel_gap']:.2f} % (step {record['at_step']}, "
              f"{record['window']}-step means): {out}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
