"""finetune_optimized.py's memory plan: the estimate, the choice, the fallback, and AdamW with its state on the host.

The plan is tested with Llama-3.1-8B's numbers, calibrated on the 80 GB H100 figures (bf16, batch 1, fused AdamW with
bf16 states, ours = fused kernels with the linear cross-entropy):
    1x4096 no lever 63.2 GiB; 1x8192 selective on the first 16 layers 65.3; 1x8192 full on all 32 layers 60.1;
    65536 full 72.3 (71.3 with the optimizer in the backward); 131072 and 262144 with full checkpointing, all 32
    layer inputs offloaded, MLP tiles of 16384 and the optimizer in the backward: 58.0 and 71.1 GiB.
Calibration: the probe's one measured number (what a decoder layer keeps per token without checkpointing) is not
available from those runs, so it is found by inverting the first figure through the estimate (bisection over the
forward peak the probe would have seen). Everything else comes from the config. The other six figures then test the
model: each estimate within 1.5 GiB of the measured peak.

Budgets: an 80 GB H100 shows 79.2 GiB; 76 GiB is what a step may allocate after the CUDA context, cuBLAS workspaces
and the allocator's fragmentation (3 GiB). A 141 GB H200: 139.8 GiB, so 136.8. Host: 110 of the box's 128 GiB.

OffloadedAdamW: on the CPU (fp32, a tiny LLaMA) its parameters and moments equal torch.optim.AdamW's bit for bit over
several steps, with weight decay and an lr schedule, stepping in the backward or in step(); its state_dict has
AdamW's layout and either optimizer's checkpoint continues in the other. With CUDA: the same on the GPU (fused), the
moments pinned on the host, and a lower peak than AdamW's.
"""
import copy
import json
import math
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import finetune_optimized as plan_module  # noqa: E402
from finetune_optimized import (MemoryPlan, OffloadedAdamW, choose_plan, estimate_peak_bytes,  # noqa: E402
                                fitting_plans, llama_param_counts, probe_model_bytes)

GiB = 2**30
BUDGET_H100 = 76 * GiB
BUDGET_H200 = int(136.8 * GiB)
HOST_BUDGET = 110 * GiB
PROBE_TOKENS = 4096
# The fused linear cross-entropy's chunk of logits and its gradient, as the H100 measurements below had them (192 MiB).
LOSS_FIXED_BYTES = 2 * 192 * 2**20
MEASURED_H100 = [  # (tokens, levers, peak GiB)
    (4096, {}, 63.2),
    (8192, dict(activation_checkpointing="selective", checkpoint_layers=16), 65.3),
    (8192, dict(activation_checkpointing="full", checkpoint_layers=32), 60.1),
    (65536, dict(activation_checkpointing="full", checkpoint_layers=32), 72.3),
    (65536, dict(activation_checkpointing="full", checkpoint_layers=32, optimizer_in_backward=True), 71.3),
    (131072, dict(activation_checkpointing="full", checkpoint_layers=32, offload_layers=32, tiled_mlp=16384,
                  optimizer_in_backward=True), 58.0),
    (262144, dict(activation_checkpointing="full", checkpoint_layers=32, offload_layers=32, tiled_mlp=16384,
                  optimizer_in_backward=True), 71.1),
]


def llama31_8b_config():
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)


def model_bytes_from_probe(config, layer_bytes_per_token):
    """The ModelBytes a probe would give if a layer kept layer_bytes_per_token: bf16 weights and AdamW states, the
    forward peak the probe would measure at PROBE_TOKENS built from it."""
    param_count = llama_param_counts(config)[0]
    allocated_before = param_count * 2 + 2 * param_count * 2  # weights + two bf16 moments
    loss_bytes_per_token = 2 * config.hidden_size * 2 + 4
    forward_peak = (allocated_before + LOSS_FIXED_BYTES
                    + PROBE_TOKENS * (config.num_hidden_layers * layer_bytes_per_token + loss_bytes_per_token))
    return probe_model_bytes(config, forward_peak, allocated_before, PROBE_TOKENS, param_itemsize=2,
                             optimizer_state_itemsize=2, loss_fixed_bytes=LOSS_FIXED_BYTES)


@pytest.fixture(scope="module")
def llama8b():
    """Llama-3.1-8B's ModelBytes, its one probed number fitted to the 1x4096 no-lever peak (see the module doc)."""
    config = llama31_8b_config()
    low, high = config.hidden_size * 2, 10**6  # bytes per token per layer: at least its input
    for _ in range(50):
        middle = (low + high) / 2
        peak, _ = estimate_peak_bytes(MemoryPlan(), model_bytes_from_probe(config, middle), 1, 4096)
        low, high = (low, middle) if peak > 63.2 * GiB else (middle, high)
    return model_bytes_from_probe(config, low)


# ----------------------------------------------------------------------------------------------------------------------
# ModelBytes: the config's exact parts and the probe

def test_param_counts_match_a_real_llama():
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    total, layer, largest = llama_param_counts(config)
    assert total == sum(p.numel() for p in model.parameters())
    assert layer == sum(p.numel() for p in model.model.layers[0].parameters())
    assert largest == max(p.numel() for p in model.parameters())
    assert llama_param_counts(llama31_8b_config())[0] == 8_030_261_248  # Llama-3.1-8B's published count


def test_probe_recovers_layer_bytes_and_computes_the_exact_parts():
    config = llama31_8b_config()
    model_bytes = model_bytes_from_probe(config, 140_000)
    assert model_bytes.layer_bytes_per_token == pytest.approx(140_000)
    assert model_bytes.input_bytes_per_token == 4096 * 2
    assert model_bytes.attention_bytes_per_token == 4096 * 2 + 4 * 32
    assert model_bytes.mlp_bytes_per_token == 3 * 14336 * 2
    assert model_bytes.param_bytes == model_bytes.grad_bytes == 2 * 8_030_261_248
    assert model_bytes.optimizer_state_bytes == 2 * model_bytes.param_bytes
    with pytest.raises(ValueError, match="less than one layer's input"):  # e.g. a probe run with checkpointing
        probe_model_bytes(config, 10**9 + 4096 * 40_000, 10**9, 4096, param_itemsize=2, optimizer_state_itemsize=2)


def test_the_probe_leaves_one_time_allocations_out(monkeypatch):
    """On a GPU the first forward of a process also allocates what stays allocated for good (cuBLAS's workspace, 32 MiB
    on Hopper, at the first matmul). measure_model_bytes measures the forwards after an unmeasured one, so the
    per-token figure is what a layer keeps, also for a tiny model that keeps far less than 32 MiB per 1024 tokens.
    Simulated on the CPU: fake memory counters, and a forward that moves them as a model would."""
    config = AutoConfig.from_pretrained(ROOT / "configs" / "tiny")
    model = LlamaForCausalLM(config)
    itemsize = next(model.parameters()).element_size()
    layer_bytes, fixed_bytes = 40 * config.hidden_size * itemsize, 3 * 2**20
    per_token = config.num_hidden_layers * layer_bytes + 2 * config.hidden_size * itemsize + 4  # layers + the loss's
    memory = {"allocated": 10**9, "peak": 10**9, "forwards": 0}

    def forward(input_ids, shift_labels):
        if memory["forwards"] == 0:
            memory["allocated"] += 32 * 2**20  # the workspace: allocated at the first matmul, never freed
        memory["forwards"] += 1
        peak = memory["allocated"] + fixed_bytes + input_ids.shape[-1] * per_token
        memory["peak"] = max(memory["peak"], peak)
        return torch.zeros(()), None

    monkeypatch.setattr(plan_module, "HAS_CUDA", True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: memory.update(peak=memory["allocated"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: memory["peak"])
    args = types.SimpleNamespace(memory_plan="auto", cuda_graph=False)
    model_bytes = plan_module.measure_model_bytes(args, model, forward, "cpu")
    assert model_bytes.layer_bytes_per_token == pytest.approx(layer_bytes)
    assert model_bytes.loss_fixed_bytes == pytest.approx(fixed_bytes, abs=1)


def test_calibration_reproduces_the_h100_figures(llama8b):
    # the fitted number is what a hand count says a LLaMA layer keeps: about seven hidden-sized and three
    # intermediate-sized bf16 tensors per token (~140 KiB)
    assert 120 * 1024 < llama8b.layer_bytes_per_token < 160 * 1024
    errors = []
    for tokens, levers, measured_gib in MEASURED_H100:
        peak, parts = estimate_peak_bytes(MemoryPlan(**levers), llama8b, 1, tokens)
        assert peak == sum(parts.values())
        if abs(peak / GiB - measured_gib) > 1.5:
            errors.append(f"{tokens} {levers}: estimated {peak / GiB:.1f} GiB, measured {measured_gib}")
    assert not errors, errors


def test_each_lever_never_raises_the_estimate(llama8b):
    """More layers checkpointed or offloaded, tiles, the optimizer in the backward or on the host: each holds less."""
    for tokens in (8192, 131072):
        for mode in ("selective", "full"):
            peaks = [estimate_peak_bytes(MemoryPlan(mode, layers), llama8b, 1, tokens)[0] for layers in range(1, 33)]
            assert peaks == sorted(peaks, reverse=True), (tokens, mode)
        base = dict(activation_checkpointing="full", checkpoint_layers=32)
        for extra in ({"optimizer_in_backward": True}, {"tiled_mlp": 4096},
                      {"optimizer_in_backward": True, "offload_optimizer": True}):
            assert (estimate_peak_bytes(MemoryPlan(**base, **extra), llama8b, 1, tokens)[0]
                    <= estimate_peak_bytes(MemoryPlan(**base), llama8b, 1, tokens)[0]), extra


# ----------------------------------------------------------------------------------------------------------------------
# The choice

def cost_of(levers, model_bytes, tokens):
    return plan_module.plan_cost(MemoryPlan(**levers), model_bytes, 1, tokens)


def test_4096_on_80gb_needs_no_lever(llama8b):
    plan, _ = choose_plan(BUDGET_H100, llama8b, 1, 4096, host_budget_bytes=HOST_BUDGET)
    assert plan.describe() == "no lever" and plan.cost == 0


def test_8192_on_80gb_picks_something_cheaper_than_full_checkpointing_everywhere(llama8b):
    plan, _ = choose_plan(BUDGET_H100, llama8b, 1, 8192, host_budget_bytes=HOST_BUDGET)
    assert plan.activation_checkpointing != "none" and plan.estimated_peak_bytes <= BUDGET_H100
    full_everywhere = cost_of(dict(activation_checkpointing="full", checkpoint_layers=32), llama8b, 8192)
    assert plan.cost < full_everywhere / 2, plan.reason
    assert plan.checkpoint_layers < 32 and not plan.offload_optimizer


def test_8192_on_141gb_needs_no_lever(llama8b):
    plan, _ = choose_plan(BUDGET_H200, llama8b, 1, 8192, host_budget_bytes=HOST_BUDGET)
    assert plan.describe() == "no lever"


def test_262144_on_80gb_offloads_within_the_host_budget(llama8b):
    plan, _ = choose_plan(BUDGET_H100, llama8b, 1, 262144, host_budget_bytes=HOST_BUDGET)
    assert plan.offload_layers > 0 or plan.offload_optimizer, plan.reason
    assert plan.estimated_host_bytes <= HOST_BUDGET and plan.estimated_peak_bytes <= BUDGET_H100
    # without host memory nothing fits: 32 checkpointed inputs alone are 64 GiB
    nothing, leanest = choose_plan(BUDGET_H100, llama8b, 1, 262144, host_budget_bytes=0)
    assert nothing is None and leanest.estimated_host_bytes == 0


def test_cost_never_rises_with_the_budget(llama8b):
    for tokens in (8192, 65536, 262144):
        costs = []
        for budget_gib in range(16, 161, 2):  # from less than the weights alone
            plan, _ = choose_plan(budget_gib * GiB, llama8b, 1, tokens, host_budget_bytes=HOST_BUDGET)
            costs.append(float("inf") if plan is None else plan.cost)
        assert costs == sorted(costs, reverse=True), tokens
        assert costs[-1] < float("inf") and costs[0] == float("inf")  # the sweep crosses from nothing to a plan


def test_given_levers_are_kept(llama8b):
    given = {"activation_checkpointing": "full", "tiled_mlp": 4096}
    plan, _ = choose_plan(BUDGET_H100, llama8b, 1, 65536, given=given, host_budget_bytes=HOST_BUDGET)
    assert plan.activation_checkpointing == "full" and plan.tiled_mlp == 4096
    plan, _ = choose_plan(BUDGET_H100, llama8b, 1, 4096, given={"optimizer_in_backward": True})
    assert plan.optimizer_in_backward and plan.activation_checkpointing == "none"
    with pytest.raises(ValueError, match="unknown levers"):
        choose_plan(BUDGET_H100, llama8b, 1, 4096, given={"checkpointing": "full"})
    with pytest.raises(ValueError, match="only checkpointed layers"):
        estimate_peak_bytes(MemoryPlan(offload_layers=4), llama8b, 1, 4096)


def test_when_nothing_fits_the_leanest_plan_says_what_it_needs(llama8b):
    plan, leanest = choose_plan(18 * GiB, llama8b, 1, 8192, host_budget_bytes=HOST_BUDGET)
    assert plan is None
    assert leanest.estimated_peak_bytes == sum(leanest.estimated_parts.values()) > 18 * GiB
    assert set(leanest.estimated_parts) == {"weights", "gradients", "optimizer_state", "kept_activations",
                                            "recompute_transient", "loss"}
    assert leanest.offload_optimizer  # the leanest plan holds the 30 GiB of moments on the host
    assert "18.0 GiB" in leanest.reason and "weights 15.0" in leanest.reason
    every = fitting_plans(10**15, llama8b, 1, 8192, host_budget_bytes=HOST_BUDGET)
    assert leanest.estimated_peak_bytes == min(p.estimated_peak_bytes for p in every)


# ----------------------------------------------------------------------------------------------------------------------
# The fallback

def fake_step(true_limit_bytes, tried, held=None):
    """A step that runs out of memory whenever its plan's estimate exceeds the true limit (the estimate was low)."""
    def try_step(plan):
        tried.append(plan)
        if held is not None:
            assert all(ref() is None for ref in held), "the failed step's tensors are still alive"
            step_tensor = torch.empty(1024)  # what the failed step holds when it raises
            held.append(weakref.ref(step_tensor))
        if plan.estimated_peak_bytes > true_limit_bytes:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return "trained"
    return try_step


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


# ----------------------------------------------------------------------------------------------------------------------
# The plan inside finetune_optimized.py (tiny LLaMA on the CPU, a budget given with --memory-budget-gib)

def run_planned(tmp_path, *flags):
    """finetune_optimized.py in-process on the stock model (kernels off: the plan does not depend on them, and the
    stock path is the fastest on the Triton interpreter)."""
    out = tmp_path / "run.json"
    plan_module.main(["--model", "tiny", "--dtype", "fp32", "--steps", "2", "--seq-len", "64", "--out", str(out),
                      "--no-rmsnorm", "--no-swiglu", "--no-rope", "--loss", "eager", *flags])
    return json.loads(out.read_text())


def test_a_step_out_of_memory_starts_over_with_a_leaner_plan(tmp_path, monkeypatch, capsys):
    """A fake allocator limit just under the first plan's estimate: its step runs out of memory, main frees it and
    starts over with the next plan, estimated under the one that failed, which trains."""
    plans, real_apply, real_train = [], plan_module.apply_levers, plan_module.train

    def recording_apply_levers(model, plan):
        plans.append(plan)
        return real_apply(model, plan)

    def limited_train(*args, **kwargs):
        if plans[-1].estimated_peak_bytes >= plans[0].estimated_peak_bytes:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        return real_train(*args, **kwargs)
    monkeypatch.setattr(plan_module, "apply_levers", recording_apply_levers)
    monkeypatch.setattr(plan_module, "train", limited_train)
    result = run_planned(tmp_path, "--memory-budget-gib", "0.01")
    assert len(plans) == 2 and plans[1].estimated_peak_bytes < plans[0].estimated_peak_bytes
    assert f"out of memory with the plan {plans[0].describe()}" in capsys.readouterr().out
    assert result["memory_plan"]["reason"] == plans[1].reason and len(result["losses"]) == 2


def test_levers_the_plan_picks_train_and_are_recorded(tmp_path, capsys):
    """A budget too small for the tiny model without levers: the plan takes some, the run trains with them, and the
    JSON records them under the flags' names (what --memory-plan manual repeats)."""
    result = run_planned(tmp_path, "--memory-budget-gib", "0.0035", "--seq-len", "256")
    plan = result["memory_plan"]
    assert plan["activation_checkpointing"] != "none" or plan["optimizer_in_backward"] or plan["tiled_mlp"]
    assert plan["estimated_peak_gib"] <= 0.0035 and "memory plan (auto):" in capsys.readouterr().out
    assert len(result["losses"]) == 2 and all(math.isfinite(loss) for loss in result["losses"])


def test_no_plan_fits_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: no memory plan fits 64 tokens per step in 0\.0 GiB of "
                                         r"--memory-budget-gib: the leanest \(.*\) needs about .* GiB \(weights .*\)"):
        run_planned(tmp_path, "--memory-budget-gib", "0.0001")
    assert not (tmp_path / "run.json").exists()


def test_offloads_leave_the_host_room_for_checkpoints(tmp_path, monkeypatch):
    """With --save-steps the host memory the offloads may take is less a checkpoint's weights and optimizer state,
    which async_save stages there."""
    monkeypatch.setattr(plan_module, "host_memory_available", lambda: 10 * 2**30)
    real_fitting_plans, calls = plan_module.fitting_plans, []

    def spy(budget, model_bytes, batch, seq_len, given, host_budget_bytes):
        calls.append((model_bytes, host_budget_bytes))
        return real_fitting_plans(budget, model_bytes, batch, seq_len, given, host_budget_bytes)
    monkeypatch.setattr(plan_module, "fitting_plans", spy)
    run_planned(tmp_path, "--memory-budget-gib", "1")
    run_planned(tmp_path, "--memory-budget-gib", "1", "--output-dir", str(tmp_path / "ckpt"), "--save-steps", "3")
    (model_bytes, without), (_, with_checkpoints) = calls
    assert without == int(0.9 * 10 * 2**30)
    assert with_checkpoints == without - model_bytes.param_bytes - model_bytes.optimizer_state_bytes > 0


def test_search_plans_each_length(tmp_path):
    """--seq-len-search with the plan: each length gets its own plan (none at 64 tokens, levers at 256 within the
    same budget), and a length no plan fits is a row that ends the search, not an error."""
    result = run_planned(tmp_path, "--memory-budget-gib", "0.0035", "--seq-len-search", "64,256,4096,8192")
    rows = result["seq_len_search"]["results"]
    assert [row["status"] for row in rows] == ["trained", "trained", "no plan fits", "not tried"]
    assert rows[0]["memory_plan"]["reason"].startswith("no lever")
    assert not rows[1]["memory_plan"]["reason"].startswith("no lever")
    assert "no memory plan fits 4096 tokens" in rows[2]["reason"] and result["seq_len_search"]["longest_trained"] == 256
