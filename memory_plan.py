"""Will it fit? The memory plan of a single-GPU fine-tune: which levers a step needs, estimated before anything runs.

Run it on any machine, no GPU and no weights needed:
    python memory_plan.py --model configs/llama-3.1-8b --seq-len 65536 --gpu-gib 80 --host-gib 128
    python memory_plan.py --model meta-llama/Llama-3.1-8B --longest --gpu-gib 24 48 80 141
finetune_optimized.py plans every run with the same code (--memory-plan auto, its default).

What the config fixes
---------------------
The parameters (counted from the model the config builds), their gradients and AdamW's two moments, each in the
weights' dtype: 8.03 B parameters of Llama-3.1-8B in bf16 are 15.0 GiB of weights, 15.0 of gradients and 29.9 of
moments, 60 GiB before the first activation. Under LoRA only the adapters have gradients and moments (peft keeps them
in fp32), and QLoRA stores the base's decoder weights in 4-bit NF4. What a checkpointed decoder layer keeps is fixed
too: its input, hidden size x 2 bytes per token (8 KiB); selective checkpointing also keeps attention's output and
its fp32 log-sum-exp.

What a decoder layer keeps per token, and how it is measured
------------------------------------------------------------
Without checkpointing a layer keeps, for its backward, every tensor autograd saved: the norms' inputs, q, k, v after
the rotary embedding, attention's output and log-sum-exp, o_proj's input, the MLP's gate, up and their product (the
fused kernels change that list; about 136 KiB per token for Llama-3.1-8B). The number is measured, not written down:
two forwards of the model as the fine-tune runs it, at 1024 and 2048 tokens, and the difference of their peaks over
the 1024 tokens between them is the per-token part alone (the loss's chunk of logits and the lm_head gradient the
fused loss computes in its forward are the same at both lengths and cancel).
  - On a GPU the forwards run for real and torch.cuda.max_memory_allocated reads the peaks (`probe_forward_peaks`).
  - Without one they run on fake tensors (`count_forward_peaks`): torch's FakeTensorMode gives every tensor its
    shape, dtype and device but no memory, and a dispatch mode adds up the bytes of every storage an operator creates
    and takes them off when the last tensor on it dies, so the peak is the allocator's peak as the GPU would see it,
    for 8 billion parameters in a few seconds and in no memory. The Triton launches inside the kernels are skipped
    (there is no data to compute), the buffers they allocate are counted. For Llama-3.1-8B the count lands 1 % above
    what the H100's measured peaks give; tests/test_memory_plan.py holds it to 3 %, and on a GPU compares the count
    with the probe directly.

The peak, moment by moment through a step
-----------------------------------------
`estimate_peak_bytes` follows a steady-state step (the optimizer state exists) and keeps the largest moment: the
loss (every layer's kept activations plus the loss's own), the backward of each decoder layer from the last to the
first (the activations of the layers below still kept, the gradients so far, and the layer's transient: a
checkpointed layer's recompute, an offloaded input back on the GPU with the next one prefetched, one MLP tile), and
the optimizer step (all gradients at once, unless each parameter steps inside the backward).

The cost model
--------------
`plan_cost` prices each lever in seconds from FLOPs at a matmul rate and bytes at a PCIe rate, as a fraction of a
step without levers (3 forwards' FLOPs, about 2 under LoRA): recomputing a layer's matmuls (selective) or all of it
(full), the exposed part of an offloaded input's round trip, one more MLP forward plus a launch overhead per tile, both
AdamW moments over PCIe and back per step. The rates only rank plans; they need to be right in proportion, not to the
percent.

One cost-ordered list for every budget
--------------------------------------
Every combination of levers is estimated once per length (`ranked_candidates`) and sorted by cost; a budget takes the
first that fits. More memory therefore never picks a slower plan, and the first plan that fits is the fastest.
"""
import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import time
import unittest.mock
import weakref
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# The kernel modules come BEFORE transformers: without a GPU they switch Triton to its CPU interpreter, which only
# works if that happens before anything (transformers' LLaMA code does) imports Triton.
from linear_cross_entropy_kernel import linear_cross_entropy
from lora_adapters import add_adapters
from rmsnorm_kernel import apply_rmsnorm
from rope_kernel import apply_rope
from swiglu_kernel import apply_glu_mlp
import triton.runtime.interpreter
import triton.runtime.jit

# transformers imports torchao where it is installed; torchao's notice that its CUDA extensions do not load and
# torch's about torchao's enums concern no run here: those two loggers show errors only.
for noisy_logger in ("torchao", "torch.utils._pytree"):
    logging.getLogger(noisy_logger).setLevel(logging.ERROR)

import transformers
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

HAS_CUDA = torch.cuda.is_available()
HERE = Path(__file__).resolve().parent
GiB = 2**30


# ----------------------------------------------------------------------------------------------------------------------
# What the config fixes: the parameters


@dataclasses.dataclass(frozen=True)
class Parameters:
    """What the step's fixed memory depends on, read off a built model (real or fake weights, adapters included)."""
    count: int  # every parameter (a tied weight is one Parameter, counted once)
    layer_count: int  # one decoder layer's
    largest_count: int  # the largest tensor's (the embedding or lm_head in a full fine-tune)
    stored_bytes: int  # the weights as stored: 2 bytes a bf16 weight, about 0.52 an NF4 one (QLoRA)
    trainable_count: int  # the parameters that get gradients and AdamW moments (LoRA: the adapters')
    trainable_bytes: int  # their bytes: the gradients' and each AdamW moment's (peft keeps adapters in fp32)


def stored_bytes(tensor):
    """A tensor's bytes as stored: a tensor subclass that packs its data (torchao's NF4Tensor) by its inner tensors."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def parameters_of(model):
    """The model's Parameters, for every family's layout (fused qkv, q/k norms, tied embeddings) and under LoRA."""
    params = list(model.parameters())
    trainable = [param for param in params if param.requires_grad]
    return Parameters(count=sum(param.numel() for param in params),
                      layer_count=sum(param.numel() for param in model.model.layers[0].parameters()),
                      largest_count=max((param.numel() for param in trainable), default=0),
                      stored_bytes=sum(stored_bytes(param) for param in params),
                      trainable_count=sum(param.numel() for param in trainable),
                      trainable_bytes=sum(stored_bytes(param) for param in trainable))


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


# ----------------------------------------------------------------------------------------------------------------------
# What a decoder layer keeps per token: two probe forwards, on the GPU or on fake tensors


# The probe lengths. The first is also run once unmeasured on the GPU: one-time allocations, such as cuBLAS's workspace
# (32 MiB on Hopper) made at the first matmul, would land in the first probe's peak and not in the second's.
PROBE_TOKENS = (1024, 2048)


def causal_sdpa_without_mask(model):
    """Keep the causal mask a flag, not a tensor, wherever the step is traced: under torch.compile, CUDA-graph capture
    and fake tensors alike, transformers builds the causal mask as a [T, T] tensor (a skipped mask would be baked into
    the graph), and SDPA with a mask tensor takes a masked kernel: 3x slower than the causal one at 1x8192, plus the
    mask's memory. The batches are packed windows with no padding, so their mask is always the plain causal one. An
    attention implementation registered without a mask function gets attention_mask=None from transformers, and its
    SDPA function then passes is_causal=True, exactly as the eager step does."""
    AttentionInterface.register("sdpa_causal", sdpa_attention_forward)
    model.set_attn_implementation("sdpa_causal")


def our_kernels(model):
    """The fused kernels as finetune_optimized.py puts them in by default: RMSNorm, SwiGLU (GELU for Gemma), RoPE."""
    apply_rmsnorm(model)
    apply_glu_mlp(model)
    apply_rope(model)


def lora_and_our_kernels(rank, nf4_base=False):
    """patch_model for a LoRA fine-tune as finetune_optimized.py --lora R [--qlora] runs it: peft's adapters of rank R
    on every Linear of the decoder layers, the rest frozen, the base in NF4 with nf4_base (lora_adapters.py); then our
    kernels."""
    def patch(model):
        add_adapters(model, rank, nf4_base=nf4_base)
        our_kernels(model)
    return patch


def linear_ce_loss(model, input_ids):
    """finetune_optimized.py's default loss: the decoder body, then the fused linear cross-entropy on lm_head's weight
    (no [tokens, vocab] logits; it computes the gradients of the hidden states and of lm_head in its forward)."""
    hidden = model.model(input_ids=input_ids).last_hidden_state
    return linear_cross_entropy(hidden, model.lm_head.weight, input_ids,
                                softcap=getattr(model.config, "final_logit_softcapping", None))


def probe_forward_peaks(forward_loss, vocab_size, device):
    """({tokens: peak bytes of the forward above what was allocated before}, bytes allocated before): the probe
    forwards run for real (grad mode on, no lever), read by the CUDA caching allocator's statistics."""
    peaks, before = {}, 0
    for tokens in (PROBE_TOKENS[0], *PROBE_TOKENS):  # the first is not kept: the second at that length overwrites it
        probe = torch.randint(0, vocab_size, (1, tokens), device=device)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss = forward_loss(probe)
        peaks[tokens] = torch.cuda.max_memory_allocated(device) - before
        del loss  # frees the probe's graph and activations
    return peaks, before


class StorageBytes(TorchDispatchMode):
    """Live and peak bytes of the storages that operators create while this mode is on, counted as the CUDA caching
    allocator counts allocations: a storage from the operator that creates it until the last tensor on it dies (a view
    shares its base's storage and adds nothing). A storage first seen as an input existed before (the weights): not
    counted. Works on fake tensors, whose storages have a size but no memory."""

    def __init__(self):
        super().__init__()
        self.live_bytes, self.peak_bytes, self._bytes_of = 0, 0, {}

    def _track(self, tensor, created):
        storage = tensor.untyped_storage()  # the same Python object for as long as the storage lives
        if id(storage) not in self._bytes_of:
            self._bytes_of[id(storage)] = storage.nbytes() if created else 0
            self.live_bytes += self._bytes_of[id(storage)]
            weakref.finalize(storage, self._release, id(storage))

    def _release(self, key):
        self.live_bytes -= self._bytes_of.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for tensor in tree_leaves((args, kwargs)):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, created=False)
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, created=True)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out


def _to_new_parameters(module, *args, **kwargs):
    """torch.nn.Module.to for fake parameters: torch would swap each one in place, which fails for a fake tensor
    (torch holds a weak reference to it); new Parameters on the device and in the dtype asked for do the same here.
    peft's adapters are made and moved this way."""
    device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
    for submodule in module.modules():
        for name, tensor in (*submodule._parameters.items(), *submodule._buffers.items()):
            if tensor is None:
                continue
            moved = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
            if name in submodule._parameters:
                submodule._parameters[name] = torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
            else:
                submodule._buffers[name] = moved
    return module


def _skip_launch(*args, **kwargs):
    """A Triton launch on fake tensors: there is no data to compute, and the launcher has allocated its outputs."""


def count_forward_peaks(config, dtype, patch_model=our_kernels, forward_loss=linear_ce_loss):
    """({tokens: forward peak bytes}, Parameters of the model): the probe forwards of the model `config`
    builds, patched by patch_model and run by forward_loss(model, input_ids), on fake tensors: no weights, no memory,
    no GPU. The fake device is where the kernels run (the GPU where there is one, else the CPU), so every launcher
    takes its own path and allocates what it would."""
    config = copy.deepcopy(config)  # from_config and the attention switch below write into it
    with contextlib.ExitStack() as stack:
        for launcher in (triton.runtime.jit.JITFunction, triton.runtime.interpreter.InterpretedFunction):
            stack.enter_context(unittest.mock.patch.object(launcher, "run", _skip_launch))
        stack.enter_context(unittest.mock.patch.object(torch.nn.Module, "to", _to_new_parameters))
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(torch.device("cuda" if HAS_CUDA else "cpu"))
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        model.config.use_cache = False  # training: no KV cache
        model.train()
        causal_sdpa_without_mask(model)
        # The fused RoPE replaces the family's apply_rotary_pos_emb in its modeling module, process-wide: the count
        # puts back what was there, so it changes nothing outside itself (a run with --no-rope, a stock model).
        for module in {sys.modules[type(submodule).__module__] for submodule in model.modules()}:
            if hasattr(module, "apply_rotary_pos_emb"):
                stack.enter_context(unittest.mock.patch.object(module, "apply_rotary_pos_emb",
                                                               module.apply_rotary_pos_emb))
        patch_model(model)
        peaks = {}
        for tokens in PROBE_TOKENS:
            input_ids = torch.zeros(1, tokens, dtype=torch.long)
            with StorageBytes() as counter:
                loss = forward_loss(model, input_ids)
            peaks[tokens] = counter.peak_bytes
            del loss
        return peaks, parameters_of(model)


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
    largest_param_count: int  # the largest parameter tensor that trains (embedding or lm_head): when parameters are
    # stepped one at a time, the most gradient or moment bytes the GPU holds at once
    trainable_param_count: int  # the parameters with gradients: all of them, or LoRA's adapters
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

    @property
    def layer_grad_bytes(self):
        """One decoder layer's gradients: its share of the trained parameters (LoRA's adapters are in every layer)."""
        return self.grad_bytes * self.layer_param_count / self.param_count

    def grad_bytes_of(self, n_trainable):
        return n_trainable * self.grad_bytes / self.trainable_param_count

    def state_bytes_of(self, n_trainable):
        return n_trainable * self.optimizer_state_bytes / self.trainable_param_count


def probe_model_bytes(config, forward_peak_bytes, allocated_before_bytes, probe_tokens, *, param_itemsize,
                      optimizer_state_itemsize, optimizer_moments=2, activation_itemsize=None, loss_fixed_bytes=0,
                      loss_bytes_per_token=None, backward_extra_bytes_per_token=None, parameters=None):
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
    by default; the backward frees the rebuilt activations as it consumes them).

    parameters: the model's Parameters (parameters_of), which also say what trains (LoRA: the adapters alone carry
    gradients and moments); by default every parameter of a LLaMA-shaped config trains (llama_param_counts), stored
    at param_itemsize with moments at optimizer_state_itemsize."""
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
    if parameters is None:
        count, layer_count, largest_count = llama_param_counts(config)
        parameters = Parameters(count, layer_count, largest_count, stored_bytes=count * param_itemsize,
                                trainable_count=count, trainable_bytes=count * param_itemsize)
        state_bytes = optimizer_moments * count * optimizer_state_itemsize
    else:  # torch's AdamW keeps its moments in each parameter's dtype
        state_bytes = optimizer_moments * parameters.trainable_bytes
    return ModelBytes(
        n_layers=config.num_hidden_layers, hidden_size=h, intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads, vocab_size=config.vocab_size, param_count=parameters.count,
        layer_param_count=parameters.layer_count, largest_param_count=parameters.largest_count,
        trainable_param_count=parameters.trainable_count, param_bytes=parameters.stored_bytes,
        grad_bytes=parameters.trainable_bytes, optimizer_state_bytes=state_bytes,
        activation_itemsize=activation_itemsize, layer_bytes_per_token=layer_bytes_per_token,
        loss_bytes_per_token=loss_bytes_per_token, loss_fixed_bytes=loss_fixed_bytes,
        recompute_bytes_per_token=layer_bytes_per_token + backward_extra_bytes_per_token)


def model_bytes_from_peaks(config, peaks, allocated_before, parameters, itemsize):
    """ModelBytes from the probe forwards' peaks ({tokens: bytes above allocated_before}): the difference of the two
    peaks over the difference of their tokens is the per-token part alone, free of what the forward holds whatever
    the length (the fused linear cross-entropy's lm_head gradient and its chunk of logits), which is the rest of the
    longer probe's peak. parameters: the model's Parameters (parameters_of); itemsize: its activations' (the dtype the
    model computes in)."""
    short, long = PROBE_TOKENS
    per_token = (peaks[long] - peaks[short]) / (long - short)
    fixed = max(0, int(peaks[long] - long * per_token))
    return probe_model_bytes(config, allocated_before + peaks[long], allocated_before, long, param_itemsize=itemsize,
                             optimizer_state_itemsize=itemsize, loss_fixed_bytes=fixed, parameters=parameters)


def measure_model_bytes(model, forward_loss, patch_model, on_gpu):
    """The run's ModelBytes: its own model's probe forwards on the GPU (on_gpu: grad mode on, no lever yet), else
    counted on fake tensors of the same config, patched by patch_model and run by forward_loss(model, input_ids)."""
    weight = next(model.parameters())
    if on_gpu:
        peaks, before = probe_forward_peaks(functools.partial(forward_loss, model), model.config.vocab_size,
                                            weight.device)
    else:
        (peaks, _), before = count_forward_peaks(model.config, model.dtype, patch_model, forward_loss), 0
    return model_bytes_from_peaks(model.config, peaks, before, parameters_of(model), model.dtype.itemsize)


# ----------------------------------------------------------------------------------------------------------------------
# The peak, moment by moment through a step


CHECKPOINT_MODES = ("none", "selective", "full")
LEVERS = ("activation_checkpointing", "checkpoint_layers", "offload_layers", "tiled_mlp", "optimizer_in_backward",
          "offload_optimizer")


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
    layer_grad = mb.layer_grad_bytes
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


# ----------------------------------------------------------------------------------------------------------------------
# The cost model: extra seconds from FLOPs and PCIe bytes


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


def plan_cost(plan, model_bytes, batch, seq_len):
    """Estimated extra step time of plan's levers, as a fraction of a step without levers.

    A step without levers: 3 forwards' worth of FLOPs (the backward is two), a forward being, per token, 2 FLOP per
    weight plus causal attention's 2 * 2 * (seq_len / 2) * hidden (QK^T and PV over half the keys on average), at
    MATMUL_FLOPS_PER_S; under LoRA the frozen weights' backward is one forward's (no weight gradient), so a step is
    about 2 forwards' matmuls and each recompute weighs more. Each lever adds:
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
    # The backward: attention's twice its forward; a matmul's once for its input's gradient, and once more for its
    # weight's where the weight trains (LoRA's frozen base has no weight-gradient matmul).
    weight_gradient_share = mb.trainable_param_count / mb.param_count
    matmul_step_s = (2 + weight_gradient_share) * (mb.n_layers * matmul_forward_s + head_forward_s)
    step_s = matmul_step_s + 3 * mb.n_layers * (layer_forward_s - matmul_forward_s)

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
# One cost-ordered list for every budget


# The MLP tile sizes (tokens per sequence) a plan may choose; smaller tiles hold less and launch more.
TILE_TOKENS_CHOICES = (16384, 4096, 1024)


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
# The fine-tune's plan: its flags, its budget, its levers (finetune_optimized.py calls these)


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


class NoPlanFits(SystemExit):
    """No plan fits the budget: one error line for a run, a row of its own in a search."""


def plan_memory(args, model_bytes, host_budget_bytes, device, tried=()):
    """The levers of this run (args: finetune_optimized.py's flags). --memory-plan manual: the flags. auto: the
    cheapest plan (plan_cost) whose estimated peak fits the GPU's memory (or --memory-budget-gib), with the levers
    given by hand kept and the offloads within host_budget_bytes of pinned host memory; a plan that ran out of memory
    (tried) rules out every plan estimated at as much or more. Without a GPU there is no GPU memory to plan for unless
    --memory-budget-gib names some: the levers given by hand are the plan."""
    n_layers, tokens = model_bytes.n_layers, args.batch_size * args.seq_len
    for flag, value in (("offload-activations", args.offload_activations),
                        ("checkpoint-layers", args.checkpoint_layers)):
        if value is not None and value > n_layers:
            raise SystemExit(f"error: --{flag} {value}: the model has {n_layers} decoder layers")
    nothing_to_plan_for = not HAS_CUDA and args.memory_budget_gib is None
    as_given = args.memory_plan == "manual" or args.cuda_graph or nothing_to_plan_for
    given = given_levers(args, n_layers, every_lever=as_given)
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
        # process's to use, on top of what the driver reports free.
        budget, where = usable_gpu_bytes(free + torch.cuda.memory_reserved(device)), "this GPU"
    host = host_budget_bytes
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


def plan_record(plan):
    """The plan as the results JSON keeps it: its levers (what --memory-plan manual needs to repeat the run: the flags
    of the same names), the estimate and the reason."""
    return {**plan.levers(), "estimated_peak_gib": plan.estimated_peak_bytes / 2**30,
            "estimated_parts_gib": {name: value / 2**30 for name, value in plan.estimated_parts.items()},
            "estimated_host_gib": plan.estimated_host_bytes / 2**30, "estimated_cost": plan.cost,
            "reason": plan.reason}


# ----------------------------------------------------------------------------------------------------------------------
# Cards: what a plan for a GPU of N GiB and a host of M GiB may take

# A card sold as N GiB shows CUDA about 99 % of it (an "80 GB" H100: 79.2 GiB, a 141 GB H200: 139.8), and the CUDA
# context with the process's first allocations holds about 0.75 GiB of that before the plan: on the H100 the fine-tune
# planned 75.1 GiB, 97 % of 78.45 less 1 GiB (usable_gpu_bytes).
CARD_VISIBLE_FRACTION = 0.99
CUDA_CONTEXT_GIB = 0.75
# Pinned offloads may take 90 % of the host memory the kernel reports available (MemAvailable); the rest is the
# process's own and the system's. Available is about 95 % of a host's memory once the system is up: 130.8 and 131.5 GB
# (121.8 and 122.5 GiB) at the start of two calls on the 128 GiB H100 machine (results/NOTES.md, 2026-12-06).
PINNED_HOST_FRACTION = 0.9
HOST_AVAILABLE_FRACTION = 0.95


def usable_gpu_bytes(visible_bytes):
    """What a step may allocate of the GPU memory this process can use: 97 % of it less 1 GiB, kept for the CUDA
    context's growth, cuBLAS workspaces and the allocator's rounding."""
    return int(0.97 * visible_bytes) - GiB


def card_budget_bytes(gpu_gib):
    """usable_gpu_bytes of a card sold as gpu_gib GiB."""
    return usable_gpu_bytes((CARD_VISIBLE_FRACTION * gpu_gib - CUDA_CONTEXT_GIB) * GiB)


def host_budget_bytes(host_gib):
    """What pinned offloads may take on a host of host_gib GiB."""
    return int(PINNED_HOST_FRACTION * HOST_AVAILABLE_FRACTION * host_gib * GiB)


def longest_trainable(budget_bytes, model_bytes, batch, host_budget_bytes, step=1024):
    """(longest sequence, its plan): the longest multiple of `step` tokens per sequence for which some plan fits, by
    doubling then bisection (the leanest plan's peak grows with the length); (0, None) if not even `step` fits."""
    def plan_at(seq_len):
        return choose_plan(budget_bytes, model_bytes, batch, seq_len, host_budget_bytes=host_budget_bytes)[0]
    fits, fails = 0, 8 * step
    while plan_at(fails) is not None and fails < 2**24:
        fits, fails = fails, 2 * fails
    if fits == 0 and plan_at(step) is None:
        return 0, None
    fits = max(fits, step)
    while fails - fits > step:
        middle = (fits + fails) // 2 // step * step
        fits, fails = (middle, fails) if plan_at(middle) is not None else (fits, middle)
    return fits, plan_at(fits)


# ----------------------------------------------------------------------------------------------------------------------
# Measured: peak GPU memory and tokens/s against sequence length, from the JSON files of fine-tune runs


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


# ----------------------------------------------------------------------------------------------------------------------
# The command

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--model", default="meta-llama/Llama-3.1-8B", type=os.path.expanduser,
        help="a folder with config.json, a Hub id whose config is in the local cache, or a name in configs/ (a Hub id "
             "not cached falls back to configs/<its last part>): only the config is read, no weights")
    add("--seq-len", type=int, default=8192, help="tokens per sequence")
    add("--batch-size", type=int, default=1, help="sequences per step")
    add("--gpu-gib", type=float, nargs="+", default=[80.0], metavar="GIB",
        help="the card's memory as sold (80 for an H100 80GB, 141 for an H200); several give one row each")
    add("--host-gib", type=float, default=None, help="the host's memory; None: this machine's")
    add("--dtype", choices=list(DTYPES), default="bf16", help="the weights' and AdamW moments' dtype")
    add("--lora", type=int, default=None, metavar="R", help="plan a LoRA fine-tune: adapters of rank R on every "
        "Linear of the decoder layers, the base frozen (no gradients, no AdamW moments)")
    add("--qlora", action="store_true", help="with --lora: the base's decoder Linears in 4-bit NF4")
    add("--longest", action="store_true", help="instead of --seq-len: the longest sequence each card trains (batch "
        "--batch-size), with its plan")
    add("--candidates", type=int, default=8, help="rows of the table of the candidates weighed (one card, one length)")
    add("--out", default=None, help="also write the rows as JSON (with --plot: the PNG to write)")
    add("--plot", nargs="+", default=None, metavar="JSON", help="instead of planning: plot the measured peak GPU "
        "memory and tokens/s against sequence length from fine-tune results files (ours, Liger, ...), each point "
        "labelled with its levers, into --out (.png)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot and not (args.out or "").endswith(".png"):
        parser.error("--plot writes a PNG: give its path with --out FILE.png")
    if args.qlora and args.lora is None:
        parser.error("--qlora goes with --lora R (the rank of the adapters)")
    for name in ("seq_len", "batch_size", "candidates", "lora"):
        if (getattr(args, name) or 1) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if min(args.gpu_gib) <= CUDA_CONTEXT_GIB or (args.host_gib is not None and args.host_gib < 0):
        parser.error(f"--gpu-gib must exceed the CUDA context ({CUDA_CONTEXT_GIB} GiB) and --host-gib be >= 0")
    return args


def load_config(name):
    """(config, where it came from): a folder's config.json, a name in configs/, or a Hub id's config from the local
    cache, else configs/ under the id's last part (meta-llama/Llama-3.1-8B: configs/llama-3.1-8b)."""
    builtin = HERE / "configs" / Path(name).name.lower()
    try:
        if (Path(name) / "config.json").is_file():
            return AutoConfig.from_pretrained(name), f"{name}/config.json"
        if "/" in name and not Path(name).exists():
            return AutoConfig.from_pretrained(name, local_files_only=True), "the local Hub cache"
    except (OSError, ValueError):
        pass  # not in the cache: configs/ below
    if (builtin / "config.json").is_file():
        return AutoConfig.from_pretrained(builtin), f"configs/{builtin.name}"
    raise SystemExit(f"error: --model {name}: no config.json there, none in the local Hub cache, and no configs/"
                     f"{builtin.name}")


def gib(value):
    return round(value / GiB, 2)


def plan_row(card_gib, plan):
    return {"gpu_gib": card_gib, "plan": plan.describe() if plan else "nothing fits", **(plan.levers() if plan else {}),
            "estimated_peak_gib": gib(plan.estimated_peak_bytes) if plan else None,
            "estimated_host_gib": gib(plan.estimated_host_bytes) if plan else None,
            "estimated_extra_step_time": round(plan.cost, 4) if plan else None}


def main(argv=None):
    from tabulate import tabulate  # a table printer, only for the command
    args = parse_args(argv)
    if args.plot:
        return plot_memory(args.plot, args.out)
    config, source = load_config(args.model)
    t0 = time.perf_counter()
    patch = our_kernels if args.lora is None else lora_and_our_kernels(args.lora, args.qlora)
    peaks, parameters = count_forward_peaks(config, DTYPES[args.dtype], patch)
    model_bytes = model_bytes_from_peaks(config, peaks, 0, parameters, DTYPES[args.dtype].itemsize)
    count_s = time.perf_counter() - t0
    host_gib = args.host_gib if args.host_gib is not None else \
        os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GiB
    host_budget = host_budget_bytes(host_gib)
    print(f"model: {args.model} (config from {source}): {config.model_type}, {parameters.count / 1e9:.2f} B "
          f"parameters, {config.num_hidden_layers} layers, {args.dtype}; "
          + ("full fine-tune" if args.lora is None else f"LoRA rank {args.lora}" + ", NF4 base" * args.qlora
             + f" ({parameters.trainable_count / 1e6:.1f} M parameters train)")
          + " with AdamW, ours (fused RMSNorm, SwiGLU, RoPE, linear cross-entropy)")
    print(f"a decoder layer keeps {model_bytes.layer_bytes_per_token / 1024:.1f} KiB per token without checkpointing "
          f"(counted on fake tensors in {count_s:.1f} s: no GPU, no weights); weights {gib(model_bytes.param_bytes)}, "
          f"gradients {gib(model_bytes.grad_bytes)}, AdamW moments {gib(model_bytes.optimizer_state_bytes)} GiB")
    print(f"host: {host_gib:.0f} GiB" + (" (this machine's; --host-gib for another)" if args.host_gib is None else "")
          + f", of which offloads may pin {host_budget / GiB:.1f} GiB")
    rows = []
    for card_gib in args.gpu_gib:
        budget = card_budget_bytes(card_gib)
        if args.longest:
            seq_len, plan = longest_trainable(budget, model_bytes, args.batch_size, host_budget)
        else:
            seq_len, plan = args.seq_len, choose_plan(budget, model_bytes, args.batch_size, args.seq_len,
                                                      host_budget_bytes=host_budget)[0]
        rows.append({"seq_len": seq_len, "budget_gib": gib(budget), **plan_row(card_gib, plan)})
    headers = {"gpu_gib": "card GiB", "budget_gib": "plans for GiB", "seq_len": "tokens" + " (longest)" * args.longest,
               "plan": "levers", "estimated_peak_gib": "est. peak GiB", "estimated_host_gib": "est. host GiB",
               "estimated_extra_step_time": "extra step time"}
    print(f"batch {args.batch_size}" + ("" if args.longest else f" x {args.seq_len} tokens") + ":")
    print(tabulate([[row[key] for key in headers] for row in rows], headers=list(headers.values()),
                   tablefmt="github", floatfmt=".4g"))
    if len(rows) == 1 and not args.longest:
        candidates = ranked_candidates(model_bytes, args.batch_size, args.seq_len, (), host_budget)
        budget = card_budget_bytes(args.gpu_gib[0])
        fitting = [plan for plan in candidates if plan.estimated_peak_bytes <= budget]
        shown = list(candidates[:args.candidates])
        shown += [plan for plan in (fitting[:1] + [min(candidates, key=lambda p: p.estimated_peak_bytes)])
                  if plan not in shown]
        print(f"\nthe candidates weighed: {len(candidates)} combinations of levers, {len(fitting)} fit; the "
              f"{args.candidates} cheapest, the chosen and the leanest, cheapest first:")
        print(tabulate([[plan.describe(), gib(plan.estimated_peak_bytes), gib(plan.estimated_host_bytes),
                         f"+{plan.cost:.1%}", "yes" if plan.estimated_peak_bytes <= budget else "no"]
                        for plan in sorted(shown, key=lambda plan: (plan.cost, plan.estimated_peak_bytes))],
                       headers=["levers", "est. peak GiB", "est. host GiB", "step time", "fits"], tablefmt="github"))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "script": Path(__file__).name, "command": [sys.executable, *sys.argv], "model": args.model,
            "config_source": source, "dtype": args.dtype, "batch_size": args.batch_size, "host_gib": host_gib,
            "lora": args.lora, "qlora": args.qlora,
            "layer_bytes_per_token": model_bytes.layer_bytes_per_token, "counted_in_s": count_s,
            "torch": torch.__version__, "transformers": transformers.__version__, "git_commit": subprocess.run(
                ["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True).stdout.strip(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "rows": rows}, indent=2) + "\n")
        print(f"results: {args.out}")


if __name__ == "__main__":
    main()
