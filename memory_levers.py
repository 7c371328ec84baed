"""The memory levers: what a training step keeps, recomputes, tiles or moves to the host, each a drop-in.

A full fine-tune of an 8B model on one GPU spends its memory on three things: the weights with their gradients and
AdamW's two moments (16 + 16 + 32 GB in bf16, fixed by the model), and the activations the backward needs, which grow
with the tokens of a step (about 140 KB per token per Llama-3.1-8B decoder layer, 4.4 MB per token for all 32). Each
lever here trades some step time for some of that memory; memory_plan.py estimates what each combination saves and
costs and picks the fastest that fits the card. In the order the plan reaches for them:

  - activation checkpointing (`enable_activation_checkpointing`) of the first N decoder layers: a layer keeps only its
    input and recomputes the rest in the backward. "selective" keeps attention's output and log-sum-exp too, so the
    recompute skips attention, the one part whose cost grows with T^2 (`keep_attention_outputs`); "full" recomputes
    it. Saves per token ~130 KB a layer (8B); costs the layer's matmuls again (selective) or its whole forward (full).
    The plan checkpoints as few layers as it must, the first ones, since their backward comes last.
  - activation offload (`ActivationOffloader`): a checkpointed layer's input ([tokens, hidden], 8 KB per token) waits
    in pinned host memory, copied on a side stream while the next layers compute and copied back one layer ahead of
    its backward. Saves that input on the GPU; costs PCIe time that mostly hides behind compute, and host memory.
  - MLP tiles (`TiledMLPFunction`, `tile_mlps`): the MLP runs over sequence tiles, so its [tokens, intermediate]
    tensors (3 x 14336 per token for 8B, the largest of a layer) exist for one tile at a time. Costs one more MLP
    forward per layer and a launch overhead per tile: the plan takes it only for very long sequences.
  - the optimizer in the backward (`optimizer_in_backward`, `ClipInBackward`): each parameter's AdamW steps as soon as
    its gradient is complete, which is then freed, so the whole model's gradients (16 GB for 8B) never exist at once.
    Costs almost nothing; rules out gradient accumulation and FSDP, and clips by the previous step's norm.
  - AdamW's moments on the host (`OffloadedAdamW`): the 32 GB of moments wait in pinned host memory and stream through
    the GPU one parameter at a time, in the backward. Costs both moments' PCIe round trip every step: the most
    expensive lever at short sequences, so the plan takes it last.

`apply_levers` puts a plan's activation levers on a model; the fine-tune builds its optimizers from the plan's
optimizer levers. Without a GPU every lever runs with plain host tensors and no streams, so the CPU tests exercise the
same code paths.
"""
import functools
import itertools
import math
import statistics
import weakref

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

HAS_CUDA = torch.cuda.is_available()


def apply_levers(model, plan):
    """Puts the plan's activation levers on the model (a MemoryPlan of memory_plan.py, or anything with its fields);
    returns the ActivationOffloader, or None. The optimizer's levers are for the fine-tune's optimizers."""
    if plan.tiled_mlp:
        tile_mlps(model, plan.tiled_mlp)  # after the MLP swap: it tiles whatever forward the MLP now has
    if plan.activation_checkpointing == "none":
        return None
    return enable_activation_checkpointing(model, plan.activation_checkpointing, plan.offload_layers,
                                           plan.checkpoint_layers)


# ----------------------------------------------------------------------------------------------------------------------
# Activation checkpointing: keep a layer's input, recompute the rest in the backward

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


# ----------------------------------------------------------------------------------------------------------------------
# Activation offload: a checkpointed layer's input waits in pinned host memory

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


# ----------------------------------------------------------------------------------------------------------------------
# MLP tiles: the MLP's [tokens, intermediate] tensors for one tile at a time

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


# ----------------------------------------------------------------------------------------------------------------------
# The optimizer in the backward: no whole-model gradients

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


def host_bytes_held(offload, optimizers):
    """Bytes the run keeps in host memory: the offloaded layer inputs of the last step (offload: the offloader's
    report, or None) and the optimizer's moments."""
    return ((offload or {}).get("host_bytes", 0)
            + sum(optimizer.host_bytes() for optimizer in optimizers if isinstance(optimizer, OffloadedAdamW)))
