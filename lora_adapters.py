"""LoRA and QLoRA: train low-rank adapters on a frozen base model, the base optionally stored in 4-bit NF4.

What it computes
----------------
LoRA (Hu et al., 2021) leaves each target Linear's weight W [out, in] frozen and learns a low-rank change to it:
    y = x W^T + (alpha / R) * (dropout(x) A^T) B^T,    A [R, in], B [out, R], B = 0 at the start,
so training starts exactly at the base model. peft's `get_peft_model` wraps every target Linear in a LoraLayer that
does this; its adapters are standard: `save_pretrained` writes adapter_model.safetensors + adapter_config.json, which
`PeftModel.from_pretrained(base, folder)` loads, and `merge_and_unload` folds B A into W.

What it saves
-------------
Only the adapters train: for Llama-3.1-8B at R = 16 on the seven projections of every decoder layer, 42 M of 8.03 B
parameters. The frozen weights need no gradient (15 GiB in bf16 for the full fine-tune), no AdamW moments (30 GiB) and
no weight-gradient matmul in the backward (a third of a full step's FLOPs); only the gradient of each layer's input
flows through W. The fused kernels keep working: they see a LoraLayer where a Linear was, and the fused linear
cross-entropy skips the lm_head's dW when that weight is frozen.

QLoRA (Dettmers et al., 2023) also stores the frozen decoder Linears in 4-bit NormalFloat: torchao's NF4Tensor (the
one torchtune's QLoRA uses) keeps 4-bit codes in blocks of 64 values and each block's scale quantized to 8 bits, about
0.53 bytes a weight instead of 2, and dequantizes a layer's weight to the input's dtype inside F.linear, forward and
backward. The embedding and the lm_head stay dense (the fused loss reads the lm_head's weight).

Both fine-tune scripts run the same adapters; finetune_optimized.py and memory_plan.py import this module, and
finetune_baseline.py carries the same code inline (it imports nothing of ours).
"""
import math

import torch


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
