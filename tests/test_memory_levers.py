"""memory_levers.py, the levers of finetune_optimized.py's memory plan, on the tiny LLaMA in fp32 (CPU, Triton interpreter), with the fused
kernels and on the stock model (kernels off).

- Activation checkpointing (full, selective), tiled MLP and activation offload change what the step keeps, not what it
  computes: the loss and every parameter's gradient equal a plain step's. Full and selective checkpointing recompute
  the same ops in the same order, so they match bit for bit; the tiled MLP sums each weight's gradient over tiles (a
  different summation order), so it matches to fp32 rounding (rtol 1e-5; a missing tile or a wrong weight gradient
  is off by whole percents). With the fused kernels (finetune_optimized.py) this also checks that RMSNorm, SwiGLU's
  in-place backward, RoPE and the linear cross-entropy work under recompute.
- Selective checkpointing really skips attention in the recompute (attention kernel calls counted).
- The optimizer step inside the backward gives the same per-step losses as a normal AdamW step (fused AdamW applies
  the same elementwise update either way: equal to the bit here).
- The seq-len search reports trained / out of memory (with the part of the step) / not tried; contradictory or bad
  flags exit non-zero with one line and write no JSON.
- OffloadedAdamW: on the CPU (fp32, a tiny LLaMA) its parameters and moments equal torch.optim.AdamW's bit for bit
  over several steps, with weight decay and an lr schedule, stepping in the backward or in step(); its state_dict has
  AdamW's layout and either optimizer's checkpoint continues in the other. With CUDA: the same on the GPU (fused),
  the moments pinned on the host, and a lower peak than AdamW's.
"""
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import finetune_optimized  # noqa: E402  (first: the kernel modules must set up Triton before transformers loads it)
import memory_levers  # noqa: E402
from memory_levers import OffloadedAdamW  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402


class StockModel:
    """finetune_optimized's levers on the stock model: tiny_model swaps no kernel, the loss is transformers' own."""

    def __getattr__(self, name):
        return getattr(finetune_optimized, name)


SCRIPTS = {"optimized": finetune_optimized, "stock": StockModel()}
# The kernels run on the GPU when there is one (CPU interpreter otherwise), so the models and inputs go there too.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Full and selective checkpointing recompute the same ops in the same order: bit for bit on the CPU. On a GPU some
# backward kernels (attention) may accumulate in a run-dependent order, so there the rule is fp32 rounding.
EXACT = DEVICE == "cpu"
# Counting attention kernels needs one that SDPA really calls: on a GPU fp32 attention with grouped KV heads is
# composed of plain ops (no attention kernel to keep), so those tests use bf16 there, as real runs do.
KERNEL_DTYPE, KERNEL_DTYPE_FLAG = (torch.bfloat16, "bf16") if DEVICE == "cuda" else (torch.float32, "fp32")


def tiny_model(script, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = script.AutoModelForCausalLM.from_config(script.builtin_config("tiny"), dtype=dtype,
                                                   attn_implementation="sdpa")
    with torch.no_grad():  # norm weights that are not all ones, so their gradients are exercised
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.config.use_cache = False
    model.train()
    model.to(DEVICE)
    if script is finetune_optimized:
        script.apply_rmsnorm(model)
        script.apply_glu_mlp(model)
    return model


@pytest.fixture
def rope_patch():
    """The fused RoPE patch is process-wide: install it for one test, then restore transformers' function."""
    original = modeling_llama.apply_rotary_pos_emb
    finetune_optimized.apply_rope(finetune_optimized.AutoModelForCausalLM.from_config(
        finetune_optimized.builtin_config("tiny")))
    yield
    modeling_llama.apply_rotary_pos_emb = original


def loss_and_grads(script, model, input_ids):
    loss_impl = "linear_ce" if script is finetune_optimized else "eager"
    model.zero_grad(set_to_none=True)
    loss, _ = script.compute_loss(model, input_ids, script.shift_labels_of(input_ids), loss_impl)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


class AttentionCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in memory_levers.ATTENTION_KERNELS
        return func(*args, **(kwargs or {}))


CONFIGS = [  # (checkpointing, layers offloaded, MLP tile tokens[, layers checkpointed])
    ("full", 0, None), ("selective", 0, None), ("full", 2, None), ("selective", 1, None),
    ("none", 0, 16), ("full", 1, 8), ("selective", 2, 16), ("selective", 1, None, 1),
]


@pytest.mark.parametrize("script_name", ["optimized", "stock"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_same_loss_and_gradients_as_a_plain_step(script_name, config, rope_patch):
    mode, offload, tile, checkpoint_layers = (*config, None)[:4]
    script = SCRIPTS[script_name]
    input_ids = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ref_loss, ref_grads = loss_and_grads(script, tiny_model(script), input_ids)

    model = tiny_model(script)
    if tile:
        memory_levers.tile_mlps(model, tile)
    offloader = None
    if mode != "none":
        offloader = memory_levers.enable_activation_checkpointing(model, mode, offload, checkpoint_layers)
    loss, grads = loss_and_grads(script, model, input_ids)

    assert len(ref_grads) == len(grads) == len(list(model.parameters()))
    exact = tile is None and EXACT
    torch.testing.assert_close(loss, ref_loss, rtol=0 if exact else 1e-5, atol=0)
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, name  # every parameter really gets a gradient
        torch.testing.assert_close(grads[name], ref, rtol=0 if exact else 1e-5,
                                   atol=0 if exact else 1e-6 * ref.abs().max().item(), msg=name)
    if offload:
        report = offloader.report()
        assert report["layers"] == offload and report["host_bytes"] == offload * input_ids.numel() * 64 * 4


@pytest.mark.parametrize("mode,expected_calls", [("full", 4), ("selective", 2)])
def test_selective_checkpointing_does_not_recompute_attention(mode, expected_calls):
    stock = SCRIPTS["stock"]
    model = tiny_model(stock, dtype=KERNEL_DTYPE)
    memory_levers.enable_activation_checkpointing(model, mode, 0)
    input_ids = torch.randint(0, 1000, (1, 24)).to(DEVICE)
    with AttentionCalls() as calls:
        loss_and_grads(stock, model, input_ids)
    assert calls.count == expected_calls  # 2 layers: one forward each, plus one recompute each under "full"


def test_tiled_mlp_keeps_one_weight_gradient_per_step():
    """The tiled MLP hands each weight's gradient to autograd once (a hook counting accumulations sees one)."""
    stock = SCRIPTS["stock"]
    model = tiny_model(stock)
    memory_levers.tile_mlps(model, 8)
    arrivals = []
    model.model.layers[0].mlp.gate_proj.weight.register_post_accumulate_grad_hook(lambda p: arrivals.append(1))
    loss_and_grads(stock, model, torch.randint(0, 1000, (1, 40)).to(DEVICE))
    assert arrivals == [1]


@pytest.mark.parametrize("script_name", ["optimized", "stock"])
def test_optimizer_in_backward_matches_a_normal_step(script_name, rope_patch):
    script = SCRIPTS[script_name]
    batches = torch.randint(0, 1000, (4, 1, 32), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def train(in_backward):
        model = tiny_model(script)
        make = lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True)  # noqa: E731
        optimizer = None
        if in_backward:
            memory_levers.optimizer_in_backward(model, make)
        else:
            optimizer = make(list(model.parameters()))
        losses = []
        for input_ids in batches:
            loss, _ = loss_and_grads(script, model, input_ids)
            if optimizer is not None:
                optimizer.step()
            losses.append(loss.item())
        return losses

    normal, in_backward = train(False), train(True)
    assert normal[0] != normal[-1]  # the weights really change between steps
    assert in_backward == pytest.approx(normal, rel=1e-6, abs=0)


def test_offloader_pins_its_buffers_once(monkeypatch):
    """reserve pins one host buffer per offloaded layer, of the layer input's shape and dtype, before the first step;
    every step's pack copies into those same buffers (a step pins nothing), the gradients are those of a run without
    offload, and another length replaces the buffers."""
    requests, pinned_empty = [], memory_levers.pinned_empty
    monkeypatch.setattr(memory_levers, "pinned_empty",
                        lambda shape, dtype: requests.append((tuple(shape), dtype)) or pinned_empty(shape, dtype))
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)]
    offloader = memory_levers.ActivationOffloader(hidden_size=8)
    checkpoints = [offloader.wrap(torch.utils.checkpoint.checkpoint) for _ in layers]
    offloader.reserve(1, 16, torch.float32)
    assert requests == [((1, 16, 8), torch.float32)] * 3
    reserved = list(offloader.buffers)

    def gradients(offload):
        x = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(1))
        for layer, checkpoint in zip(layers, checkpoints):
            x = checkpoint(layer, x, use_reentrant=False) if offload else layer(x)
        return torch.autograd.grad(x.square().sum(), [p for layer in layers for p in layer.parameters()])

    reference = gradients(offload=False)
    for _ in range(2):
        offloader.new_step()
        for got, want in zip(gradients(offload=True), reference):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert len(offloader.records) == 3 and all(record["host"] is buffer  # the same buffers, by identity
                                                   for record, buffer in zip(offloader.records, reserved))
    assert len(requests) == 3
    offloader.reserve(1, 32, torch.float32)
    assert requests[3:] == [((1, 32, 8), torch.float32)] * 3


def test_pinned_empty_is_exactly_its_shape():
    """On the CPU a plain tensor; on a GPU pinned, big ones registered at their exact size (no power-of-two block)."""
    for shape in [(3, 5), (1, 4097, 2049)]:  # small, and just above PINNED_REGISTER_MIN_BYTES (fp32)
        tensor = memory_levers.pinned_empty(shape, torch.float32)
        assert tensor.shape == shape and tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert tensor.is_pinned() == torch.cuda.is_available()


def test_search_times_a_second_step_where_the_first_is_short(monkeypatch):
    """The first step at a length pays one-time costs: a short one is run again and the second is the row's time;
    a long one (over SEARCH_RETIME_S) is timed as it is."""
    monkeypatch.setattr(finetune_optimized, "SEARCH_RETIME_S", 0.2)
    calls = []

    def train_step(input_ids):
        calls.append(input_ids.shape[-1])
        # calls: the warm-up, the first step at 16 (slow), the second at 16, the one at 32 (long: timed once)
        time.sleep({2: 0.1, 4: 0.25}.get(len(calls), 0.0))
        return torch.tensor(6.9), None, None

    args = finetune_optimized.parse_args(["--seq-len-search", "16,32"])
    search = finetune_optimized.seq_len_search(args, train_step, {"now": "idle"}, 1000, "cpu")["seq_len_search"]
    rows = search["results"]
    assert calls == [16, 16, 16, 32]
    assert rows[0]["first_step_ms"] >= 100 > rows[0]["step_ms"]
    assert rows[1]["first_step_ms"] == rows[1]["step_ms"] >= 250


def test_search_reports_the_failing_part_and_not_tried():
    phase = {"now": "idle"}

    def train_step(input_ids):
        if input_ids.shape[-1] > 16:
            phase["now"] = "backward"
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return torch.tensor(6.9), None, None

    args = finetune_optimized.parse_args(["--seq-len-search", "8,16,24,32"])
    search = finetune_optimized.seq_len_search(args, train_step, phase, 1000, "cpu")["seq_len_search"]
    rows = search["results"]
    assert search["longest_trained"] == 16
    assert [row["status"] for row in rows] == ["trained", "trained", "out of memory", "not tried"]
    assert rows[2]["phase"] == "backward" and rows[3] == {"seq_len": 32, "status": "not tried"}


def run(script, tmp_path, *flags):
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(ROOT / script), "--model", "tiny", "--dtype", KERNEL_DTYPE_FLAG, "--out", str(out),
           *flags]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("plan", ["manual", "auto"])
def test_cli_long_sequence_flags(plan, tmp_path):
    """The levers given by hand are used as given, with --memory-plan manual and auto alike (auto fills in only what
    is not given, and all is given here)."""
    proc, result = run("finetune_optimized.py", tmp_path, "--steps", "2", "--seq-len", "24",
                       "--activation-checkpointing", "selective", "--checkpoint-layers", "2", "--offload-activations",
                       "2", "--tiled-mlp", "8", "--optimizer-in-backward", "--no-offload-optimizer",
                       "--optimizer", "adamw_fused", "--memory-plan", plan)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["memory_plan"]["activation_checkpointing"] == "selective" and result["memory_plan"]["tiled_mlp"] == 8
    assert result["memory_plan"]["optimizer_in_backward"] and not result["memory_plan"]["offload_optimizer"]
    assert result["offload"]["layers"] == 2 and result["offload"]["host_bytes"] == 2 * 24 * 64 * KERNEL_DTYPE.itemsize
    assert result["allocator_conf"] == os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "offload" in proc.stdout and "selective checkpointing on 2 layers" in proc.stdout


def test_cli_search_and_grad_accumulation(tmp_path):
    proc, result = run("finetune_optimized.py", tmp_path, "--seq-len-search", "16,32", "--activation-checkpointing",
                       "full", "--offload-activations", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    search = result["seq_len_search"]
    assert search["longest_trained"] == 32 and [r["status"] for r in search["results"]] == ["trained", "trained"]
    assert search["results"][1]["host_gib"] == pytest.approx(32 * 64 * KERNEL_DTYPE.itemsize / 2**30)
    # with the optimizer's moments on the host too, a row counts them beside the layer inputs
    proc, result = run("finetune_optimized.py", tmp_path, "--seq-len-search", "32", "--activation-checkpointing",
                       "full", "--offload-activations", "1", "--optimizer-in-backward", "--offload-optimizer")
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = finetune_optimized.AutoModelForCausalLM.from_config(finetune_optimized.builtin_config("tiny"))
    moments = 2 * sum(p.numel() for p in model.parameters()) * KERNEL_DTYPE.itemsize
    assert result["seq_len_search"]["results"][0]["host_gib"] * 2**30 == pytest.approx(32 * 64 * KERNEL_DTYPE.itemsize
                                                                                        + moments)
    proc, result = run("finetune_baseline.py", tmp_path, "--steps", "2", "--seq-len", "16", "--grad-accum-steps", "2",
                       "--activation-checkpointing", "full")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["tokens_per_step"] == 32 and len(result["losses"]) == 2


@pytest.mark.parametrize("flags,message", [
    (["--tiled-mlp", "0"], "--tiled-mlp must be positive"),
    (["--offload-activations", "1", "--memory-plan", "manual"], "need --activation-checkpointing"),
    (["--offload-activations", "1", "--activation-checkpointing", "none"], "need --activation-checkpointing"),
    (["--optimizer-in-backward", "--grad-accum-steps", "2"], "cannot be accumulated"),
    (["--activation-checkpointing", "full", "--offload-activations", "3"], "the model has 2 decoder layers"),
])
def test_contradictory_flags_are_one_clear_error(flags, message, tmp_path):
    proc, result = run("finetune_optimized.py", tmp_path, "--steps", "1", *flags)
    assert proc.returncode != 0 and result is None
    assert message in proc.stderr and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------------------------------
# OffloadedAdamW against torch.optim.AdamW

ADAMW = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def batches(n):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 96, (2, 16), generator=generator) for _ in range(n)]


def train(model, optimizer, scheduler, tokens):
    for input_ids in tokens:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()  # OffloadedAdamW in the backward: nothing left to do
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()


def assert_same(model_a, opt_a, model_b, opt_b):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name
    state_a, state_b = opt_a.state_dict(), opt_b.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    assert list(state_a["state"]) == list(state_b["state"])
    for key, per_param in state_a["state"].items():
        assert list(per_param) == list(state_b["state"][key])  # step, exp_avg, exp_avg_sq, in AdamW's order
        for name, value in per_param.items():
            other = state_b["state"][key][name]
            assert value.dtype == other.dtype and torch.equal(value.cpu(), other.cpu()), (key, name)


def halving_schedule(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)


@pytest.mark.parametrize("in_backward", [True, False])
def test_offloaded_adamw_equals_adamw_with_weight_decay_and_a_schedule(in_backward):
    plain_model, offloaded_model = tiny_llama(), tiny_llama()
    plain = torch.optim.AdamW(plain_model.parameters(), **ADAMW)
    offloaded = OffloadedAdamW(offloaded_model.parameters(), in_backward=in_backward, **ADAMW)
    plain_schedule, offloaded_schedule = halving_schedule(plain), halving_schedule(offloaded)
    tokens = batches(4)
    train(plain_model, plain, plain_schedule, tokens)
    train(offloaded_model, offloaded, offloaded_schedule, tokens)
    assert offloaded.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == ADAMW["lr"] * 0.5**4
    assert not torch.equal(next(plain_model.parameters()), next(tiny_llama().parameters()))  # it did train
    assert_same(plain_model, plain, offloaded_model, offloaded)
    assert offloaded.host_bytes() == sum(2 * p.numel() * 4 for p in offloaded_model.parameters())


def test_in_backward_frees_each_gradient_and_prefetches_the_next_parameter():
    model = tiny_llama()
    optimizer = OffloadedAdamW(model.parameters(), **ADAMW)
    original_fetch, found_prefetched = optimizer._fetch, []

    def recording_fetch(param):
        found_prefetched.append(param in optimizer._on_device)
        return original_fetch(param)
    optimizer._fetch = recording_fetch
    n_params = len(list(model.parameters()))
    for step, input_ids in enumerate(batches(2)):
        found_prefetched.clear()
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        assert all(p.grad is None for p in model.parameters())
        # the first backward learns the order (nothing to prefetch); after it every parameter but the first of
        # the backward finds its moments already fetched
        assert sum(found_prefetched) == (0 if step == 0 else n_params - 1)
    assert not optimizer._on_device  # nothing left on the device between steps


@pytest.mark.parametrize("direction", ["adamw_to_offloaded", "offloaded_to_adamw"])
def test_checkpoints_move_between_adamw_and_offloaded_adamw(direction):
    """Train 2 steps with one optimizer, save; a copy of the model continues with the other optimizer loaded from
    that state_dict, the original continues with its own: after 2 more steps both are the same."""
    first, second = ((torch.optim.AdamW, OffloadedAdamW) if direction == "adamw_to_offloaded"
                     else (OffloadedAdamW, torch.optim.AdamW))
    tokens = batches(4)
    model = tiny_llama()
    optimizer = first(model.parameters(), **ADAMW)
    train(model, optimizer, None, tokens[:2])
    saved = copy.deepcopy(optimizer.state_dict())
    model_copy = copy.deepcopy(model)
    other = second(model_copy.parameters(), **ADAMW)
    other.load_state_dict(saved)
    if isinstance(other, OffloadedAdamW):
        assert all(value.device.type == "cpu" for state in other.state.values() for value in state.values())
    train(model, optimizer, None, tokens[2:])
    train(model_copy, other, None, tokens[2:])
    assert_same(model, optimizer, model_copy, other)


# ----------------------------------------------------------------------------------------------------------------------
# With CUDA: the side-stream copies, pinned host memory, and the memory saved

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def linear_stack(width=1024, depth=6):
    torch.manual_seed(0)  # linear layers only: their backward is deterministic on the GPU, so bit for bit holds
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]).cuda()


def train_stack(model, optimizer, steps=3):
    generator = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(steps):
        x = torch.randn(512, model[0].in_features, device="cuda", generator=generator)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@needs_cuda
@pytest.mark.parametrize("implementation", [{"fused": True}, {"foreach": False}])
def test_cuda_offloaded_adamw_equals_adamw(implementation):
    plain_model, offloaded_model = linear_stack(), linear_stack()
    plain = torch.optim.AdamW(plain_model.parameters(), **ADAMW, **implementation)
    offloaded = OffloadedAdamW(offloaded_model.parameters(), **ADAMW, **implementation)
    train_stack(plain_model, plain)
    train_stack(offloaded_model, offloaded)
    assert_same(plain_model, plain, offloaded_model, offloaded)
    moments = [value for state in offloaded.state.values() for key, value in state.items() if key != "step"]
    assert all(value.device.type == "cpu" and value.is_pinned() for value in moments)


@needs_cuda
def test_cuda_offloaded_adamw_holds_less_gpu_memory():
    peaks = {}
    for name, make in (("adamw", torch.optim.AdamW), ("offloaded", OffloadedAdamW)):
        model = linear_stack(width=2048, depth=8)  # 128 MiB of fp32 weights, 256 MiB of moments
        optimizer = make(model.parameters(), **ADAMW, fused=True)
        train_stack(model, optimizer, steps=1)  # the state exists from here on
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        train_stack(model, optimizer, steps=2)
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated()
        del model, optimizer
        torch.cuda.empty_cache()
    moment_bytes = 2 * 8 * (2048 * 2048 + 2048) * 4
    # the moments and the gradients (which the backward frees one by one) are gone from the GPU
    assert peaks["offloaded"] < peaks["adamw"] - moment_bytes, peaks
