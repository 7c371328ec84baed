"""memory_plan.py: the count, the estimate, the choice, the fallback, the command and the plot.

The plan is tested with Llama-3.1-8B's numbers, calibrated on the 80 GB H100 figures (bf16, batch 1, fused AdamW with
bf16 states, ours = fused kernels with the linear cross-entropy):
    1x4096 no lever 63.2 GiB; 1x8192 selective on the first 16 layers 65.3; 1x8192 full on all 32 layers 60.1;
    65536 full 72.3 (71.3 with the optimizer in the backward); 131072 and 262144 with full checkpointing, all 32
    layer inputs offloaded, MLP tiles of 16384 and the optimizer in the backward: 58.0 and 71.1 GiB.
Calibration: the probe's one measured number (what a decoder layer keeps per token without checkpointing) is not
available from those runs, so it is found by inverting the first figure through the estimate (bisection over the
forward peak the probe would have seen). Everything else comes from the config. The other six figures then test the
model: each estimate within 1.5 GiB of the measured peak. The count on fake tensors (no GPU, no weights) must land
within 3 % of that calibrated number and reproduce the same six figures: it is the number the command plans with.

Budgets: an 80 GB H100 shows 79.2 GiB; 76 GiB is what a step may allocate after the CUDA context, cuBLAS workspaces
and the allocator's fragmentation (3 GiB). A 141 GB H200: 139.8 GiB, so 136.8. Host: 110 of the box's 128 GiB.

With CUDA: the fake-tensor count and the real probe forwards agree within 3 % for Llama-3.1-8B and Qwen3-8B, and the
plans they give at 8192 and 65536 tokens on an 80 GB card are the same.
"""
import dataclasses
import json
import math
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import finetune_optimized  # noqa: E402  (first: the kernel modules must set up Triton before transformers loads it)
import memory_plan as plan_module  # noqa: E402
from memory_plan import (MemoryPlan, choose_plan, estimate_peak_bytes, fitting_plans, llama_param_counts,  # noqa: E402
                         probe_model_bytes)

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

    def forward_loss(model, input_ids):
        if memory["forwards"] == 0:
            memory["allocated"] += 32 * 2**20  # the workspace: allocated at the first matmul, never freed
        memory["forwards"] += 1
        peak = memory["allocated"] + fixed_bytes + input_ids.shape[-1] * per_token
        memory["peak"] = max(memory["peak"], peak)
        return torch.zeros(()), None

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: memory.update(peak=memory["allocated"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: memory["peak"])
    model_bytes = plan_module.measure_model_bytes(model, forward_loss, patch_model=None, on_gpu=True)
    assert model_bytes.layer_bytes_per_token == pytest.approx(layer_bytes)
    assert model_bytes.loss_fixed_bytes == pytest.approx(fixed_bytes, abs=1)


# ----------------------------------------------------------------------------------------------------------------------
# The count on fake tensors: no GPU, no weights

def test_storage_bytes_counts_what_an_allocator_would():
    """Created storages count until their last tensor dies; views add nothing; tensors from before count nothing."""
    weights = torch.empty(1000)
    with plan_module.StorageBytes() as counter:
        a = torch.empty(100, dtype=torch.float32) + 1  # two storages of 400 bytes: empty's (freed), add's (kept)
        assert counter.peak_bytes == 800 and counter.live_bytes == 400
        view = a.view(10, 10).t()
        b = weights * 2  # 4000 bytes
        del a
        assert counter.live_bytes == 4400  # `a` lives on through its view
        del view
        assert counter.live_bytes == 4000
        c = b[:10].clone()  # 40 bytes
    assert counter.peak_bytes == 4400 and counter.live_bytes == 4040
    del b, c


@pytest.fixture(scope="module")
def counted_llama8b():
    """Llama-3.1-8B's ModelBytes as the command counts them: bf16, our kernels and loss, on fake tensors."""
    config = AutoConfig.from_pretrained(ROOT / "configs" / "llama-3.1-8b")
    peaks, parameters = plan_module.count_forward_peaks(config, torch.bfloat16)
    return plan_module.model_bytes_from_peaks(config, peaks, 0, parameters, 2)


def test_the_count_agrees_with_the_h100_calibration(counted_llama8b, llama8b):
    assert counted_llama8b.param_count == llama8b.param_count == 8_030_261_248
    assert counted_llama8b.layer_bytes_per_token == pytest.approx(llama8b.layer_bytes_per_token, rel=0.03)
    errors = []
    for tokens, levers, measured_gib in MEASURED_H100:
        peak, _ = estimate_peak_bytes(MemoryPlan(**levers), counted_llama8b, 1, tokens)
        if abs(peak / GiB - measured_gib) > 1.5:
            errors.append(f"{tokens} {levers}: estimated {peak / GiB:.1f} GiB, measured {measured_gib}")
    assert not errors, errors


@pytest.mark.parametrize("name", ["tiny", "tiny-gemma3", "tiny-phi3"])
def test_the_count_reads_each_family_from_its_model(name):
    """Parameter counts come from the model the config builds (Phi-3's fused projections, Gemma 3's q/k norms and
    tied embedding included), and every layer keeps more than its input per token."""
    config = AutoConfig.from_pretrained(ROOT / "configs" / name)
    peaks, parameters = plan_module.count_forward_peaks(config, torch.float32)
    model = finetune_optimized.AutoModelForCausalLM.from_config(config)
    assert parameters == plan_module.parameters_of(model)
    assert parameters.count == parameters.trainable_count == sum(p.numel() for p in model.parameters())
    assert parameters.stored_bytes == parameters.trainable_bytes == 4 * parameters.count
    model_bytes = plan_module.model_bytes_from_peaks(config, peaks, 0, parameters, 4)
    assert model_bytes.layer_bytes_per_token > model_bytes.input_bytes_per_token


def run_command(*flags):
    proc = subprocess.run([sys.executable, str(ROOT / "memory_plan.py"), *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_command_plans_8192_on_an_80_gib_card_without_a_gpu(tmp_path):
    started = time.perf_counter()
    out = run_command("--model", "configs/llama-3.1-8b", "--seq-len", "8192", "--gpu-gib", "80", "--host-gib", "128",
                      "--out", str(tmp_path / "plan.json"))
    assert time.perf_counter() - started < 60
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["activation_checkpointing"] != "none"  # 8192 needs a lever on 80 GB (step 11)
    assert rows[0]["plan"] in out and "the candidates weighed:" in out and "counted on fake tensors" in out
    assert rows[0]["estimated_peak_gib"] <= rows[0]["budget_gib"]


def test_the_command_finds_the_longest_sequence_per_card(tmp_path):
    run_command("--model", "meta-llama/Llama-3.1-8B", "--longest", "--gpu-gib", "48", "80", "--host-gib", "128",
                "--out", str(tmp_path / "longest.json"))
    result = json.loads((tmp_path / "longest.json").read_text())
    assert result["config_source"] == "configs/llama-3.1-8b"  # not in the cache here: the built-in config
    small, large = result["rows"]
    assert large["seq_len"] >= 393216 and small["seq_len"] < large["seq_len"]
    assert large["estimated_host_gib"] <= plan_module.host_budget_bytes(128) / GiB
    assert large["estimated_peak_gib"] <= large["budget_gib"]


def test_the_longest_sequence_is_the_boundary():
    """longest_trainable's answer fits and one step more does not."""
    config = llama31_8b_config()
    model_bytes = model_bytes_from_probe(config, 138_000)
    budget, host = plan_module.card_budget_bytes(80), plan_module.host_budget_bytes(128)
    seq_len, plan = plan_module.longest_trainable(budget, model_bytes, 1, host, step=8192)
    assert plan is not None and plan.estimated_peak_bytes <= budget
    assert choose_plan(budget, model_bytes, 1, seq_len + 8192, host_budget_bytes=host)[0] is None


def test_a_config_it_cannot_find_is_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "memory_plan.py"), "--model", "nobody/no-such-model"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "error: --model nobody/no-such-model: no config.json there" in proc.stderr


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b"])
def test_cuda_count_and_probe_agree_and_plan_alike(name):
    """The fake-tensor count and the real probe forwards of the same model (random weights, bf16, our kernels and
    loss, as finetune_optimized.py runs it) within 3 % per token, and the same plan at 8192 and 65536 on 80 GB."""
    config = AutoConfig.from_pretrained(ROOT / "configs" / name)
    peaks, parameters = plan_module.count_forward_peaks(config, torch.bfloat16)
    counted = plan_module.model_bytes_from_peaks(config, peaks, 0, parameters, 2)
    with torch.device("cuda"):
        model = finetune_optimized.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                                    attn_implementation="sdpa")
    model.config.use_cache = False
    model.train()
    plan_module.our_kernels(model)
    probed = plan_module.measure_model_bytes(model, plan_module.linear_ce_loss, None, on_gpu=True)
    del model
    torch.cuda.empty_cache()
    print(f"{name}: counted {counted.layer_bytes_per_token:.0f}, probed {probed.layer_bytes_per_token:.0f} bytes per "
          f"token per layer; loss fixed {counted.loss_fixed_bytes} / {probed.loss_fixed_bytes}")
    assert counted.param_count == probed.param_count
    assert counted.layer_bytes_per_token == pytest.approx(probed.layer_bytes_per_token, rel=0.03)
    budget, host = plan_module.card_budget_bytes(80), plan_module.host_budget_bytes(128)
    for tokens in (8192, 65536):
        plans = [choose_plan(budget, model_bytes, 1, tokens, host_budget_bytes=host)[0].levers()
                 for model_bytes in (counted, probed)]
        assert plans[0] == plans[1], (tokens, plans)


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
# The plan inside finetune_optimized.py (tiny LLaMA on the CPU, a budget given with --memory-budget-gib)

def run_planned(tmp_path, *flags):
    """finetune_optimized.py in-process on the stock model (kernels off: the plan does not depend on them, and the
    stock path is the fastest on the Triton interpreter)."""
    out = tmp_path / "run.json"
    finetune_optimized.main(["--model", "tiny", "--dtype", "fp32", "--steps", "2", "--seq-len", "64", "--out", str(out),
                      "--no-rmsnorm", "--no-swiglu", "--no-rope", "--loss", "eager", *flags])
    return json.loads(out.read_text())


def test_a_step_out_of_memory_starts_over_with_a_leaner_plan(tmp_path, monkeypatch, capsys):
    """A fake allocator limit just under the first plan's estimate: its step runs out of memory, main frees it and
    starts over with the next plan, estimated under the one that failed, which trains."""
    plans, real_apply, real_train = [], finetune_optimized.apply_levers, finetune_optimized.train

    def recording_apply_levers(model, plan):
        plans.append(plan)
        return real_apply(model, plan)

    def limited_train(*args, **kwargs):
        if plans[-1].estimated_peak_bytes >= plans[0].estimated_peak_bytes:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")
        return real_train(*args, **kwargs)
    monkeypatch.setattr(finetune_optimized, "apply_levers", recording_apply_levers)
    monkeypatch.setattr(finetune_optimized, "train", limited_train)
    result = run_planned(tmp_path, "--memory-budget-gib", "0.01")
    assert len(plans) == 2 and plans[1].estimated_peak_bytes < plans[0].estimated_peak_bytes
    assert f"out of memory with the plan {plans[0].describe()}" in capsys.readouterr().out
    assert result["memory_plan"]["reason"] == plans[1].reason and len(result["losses"]) == 2


def test_levers_the_plan_picks_train_and_are_recorded(tmp_path, capsys):
    """A budget too small for the tiny model without levers: the plan takes some, the run trains with them, and the
    JSON records them under the flags' names (what --memory-plan manual repeats)."""
    result = run_planned(tmp_path, "--memory-budget-gib", "0.0055", "--seq-len", "256")
    plan = result["memory_plan"]
    assert plan["activation_checkpointing"] != "none" or plan["optimizer_in_backward"] or plan["tiled_mlp"]
    assert plan["estimated_peak_gib"] <= 0.0055 and "memory plan (auto):" in capsys.readouterr().out
    assert len(result["losses"]) == 2 and all(math.isfinite(loss) for loss in result["losses"])


def test_no_plan_fits_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: no memory plan fits 64 tokens per step in 0\.0 GiB of "
                                         r"--memory-budget-gib: the leanest \(.*\) needs about .* GiB \(weights .*\)"):
        run_planned(tmp_path, "--memory-budget-gib", "0.0001")
    assert not (tmp_path / "run.json").exists()


def test_offloads_leave_the_host_room_for_checkpoints(tmp_path, monkeypatch):
    """With --save-steps the host memory the offloads may take is less a checkpoint's weights and optimizer state,
    which async_save stages there."""
    monkeypatch.setattr(finetune_optimized, "host_memory_available", lambda: 10 * 2**30)
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
    result = run_planned(tmp_path, "--memory-budget-gib", "0.0055", "--seq-len-search", "64,256,4096,8192")
    rows = result["seq_len_search"]["results"]
    assert [row["status"] for row in rows] == ["trained", "trained", "no plan fits", "not tried"]
    assert rows[0]["memory_plan"]["reason"].startswith("no lever")
    assert not rows[1]["memory_plan"]["reason"].startswith("no lever")
    assert "no memory plan fits 4096 tokens" in rows[2]["reason"] and result["seq_len_search"]["longest_trained"] == 256


def test_plot_of_peak_memory_against_length(tmp_path):
    search = {"script": "finetune_baseline.py", "variant": "liger", "options": {"activation_checkpointing": "full"},
              "seq_len_search": {"results": [
                  {"seq_len": 16, "status": "trained", "peak_gib": 1.0},
                  {"seq_len": 32, "status": "out of memory", "phase": "backward", "peak_gib": 2.0},
                  {"seq_len": 64, "status": "not tried"}]}}
    (tmp_path / "search.json").write_text(json.dumps(search))
    proc = subprocess.run([sys.executable, str(ROOT / "memory_plan.py"), "--plot", str(tmp_path / "search.json"),
                           str(ROOT / "results" / "long_sequences_h200" / "finetune_optimized_ckpt_1x131072_h200.json"),
                           "--out", str(tmp_path / "memory.png")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text("{}")
    proc = subprocess.run([sys.executable, str(ROOT / "memory_plan.py"), "--plot", str(tmp_path / "bad.json"),
                           "--out", str(tmp_path / "bad.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not a fine-tune results file" in proc.stderr and "Traceback" not in proc.stderr


def test_plot_leaves_out_runs_without_a_gpu_and_refuses_other_files(tmp_path, capsys):
    """A run without a GPU writes peak memory null: --plot leaves it out and says so, and with nothing else to plot
    it ends with one line. A profile's .summary.json (it has a peak_memory_gib too) is not a fine-tune result."""
    cpu_run = {"script": "finetune_baseline.py", "variant": "baseline", "options": {"seq_len": 32},
               "peak_memory_gib": None, "offload": None}
    cpu_search = {"script": "finetune_optimized.py", "variant": "rmsnorm+linear_ce", "options": {},
                  "seq_len_search": {"results": [{"seq_len": 8, "status": "trained", "peak_gib": None}]}}
    gpu_search = {"script": "finetune_optimized.py", "variant": "rmsnorm+linear_ce", "options": {},
                  "seq_len_search": {"results": [{"seq_len": 8, "status": "trained", "peak_gib": 1.0}]}}
    profile = {"script": "profile_baseline.py", "variant": "baseline", "options": {"seq_len": 32},
               "peak_memory_gib": 2.0}
    for name, content in (("cpu", cpu_run), ("cpu_search", cpu_search), ("gpu", gpu_search), ("profile", profile)):
        (tmp_path / f"{name}.json").write_text(json.dumps(content))
    png = tmp_path / "memory.png"

    plan_module.main(["--plot", str(tmp_path / "cpu.json"), str(tmp_path / "gpu.json"), "--out", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"left out, no peak GPU memory (run without a GPU): {tmp_path / 'cpu.json'} (32 tokens)" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit, match="^error: --plot: nothing to plot: no run in these files measured its peak "
                                         "GPU memory$"):
        plan_module.main(["--plot", str(tmp_path / "cpu.json"), str(tmp_path / "cpu_search.json"), "--out", str(png)])
    with pytest.raises(SystemExit) as exit_info:
        plan_module.main(["--plot", str(tmp_path / "gpu.json"), str(tmp_path / "profile.json"), "--out", str(png)])
    assert str(exit_info.value) == (f"error: --plot {tmp_path / 'profile.json'}: not a fine-tune results file (written "
                                    f"by profile_baseline.py); --plot reads the JSON of finetune_baseline.py and "
                                    f"finetune_optimized.py")
    # a search file of an older format (rows with "trained": true, no "status"): one line too, not a traceback
    older = {**gpu_search, "seq_len_search": {"results": [{"seq_len": 8, "trained": True, "peak_gib": 1.0}]}}
    (tmp_path / "older.json").write_text(json.dumps(older))
    with pytest.raises(SystemExit, match="older.json: not a fine-tune results file this version reads "
                                         r"\(KeyError: 'status'\)$"):
        plan_module.main(["--plot", str(tmp_path / "older.json"), "--out", str(png)])


@pytest.mark.parametrize("nf4_base", [False, True], ids=["lora", "qlora"])
def test_the_count_knows_adapters(nf4_base):
    """Under LoRA only the adapters carry gradients and AdamW moments (peft keeps them in fp32), the frozen base is
    counted as stored (NF4: about half a byte a weight), and the same model built for real has the same Parameters."""
    config = AutoConfig.from_pretrained(ROOT / "configs" / "tiny")
    patch = plan_module.lora_and_our_kernels(4, nf4_base)
    peaks, parameters = plan_module.count_forward_peaks(config, torch.bfloat16, patch)
    torch.manual_seed(0)
    real = finetune_optimized.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    patch(real)
    assert parameters == plan_module.parameters_of(real)
    adapters = [p for name, p in real.named_parameters() if "lora_" in name]
    assert parameters.trainable_count == sum(p.numel() for p in adapters) > 0
    assert parameters.trainable_bytes == 4 * parameters.trainable_count
    model_bytes = plan_module.model_bytes_from_peaks(config, peaks, 0, parameters, 2)
    assert model_bytes.grad_bytes == parameters.trainable_bytes
    assert model_bytes.optimizer_state_bytes == 2 * parameters.trainable_bytes
    base = finetune_optimized.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    linear_weights = sum(m.weight.numel() for m in base.model.layers.modules() if isinstance(m, torch.nn.Linear))
    dense_bytes = plan_module.parameters_of(base).stored_bytes + parameters.trainable_bytes
    # NF4: a 4-bit code a weight, an 8-bit scale per block of 64, a factor per group of 256 scales: under 0.6 bytes
    saved = 2 * linear_weights - 0.6 * linear_weights if nf4_base else 0
    assert parameters.stored_bytes <= dense_bytes - saved and parameters.stored_bytes >= dense_bytes - 2 * saved


def test_lora_steps_cost_less_so_each_recompute_weighs_more(llama8b):
    """Without weight gradients a step is about two forwards' matmuls instead of three: the same lever is a larger
    share of a LoRA step."""
    lora = dataclasses.replace(llama8b, trainable_param_count=llama8b.param_count // 200)
    plan = MemoryPlan("full", 32)
    assert plan_module.plan_cost(plan, lora, 1, 8192) > 1.3 * plan_module.plan_cost(plan, llama8b, 1, 8192)


def test_a_lora_run_plans_with_its_adapters_only(tmp_path):
    """finetune_optimized.py --lora: the plan's optimizer state is the adapters' AdamW moments (fp32 in peft), not the
    whole model's."""
    result = run_planned(tmp_path, "--memory-budget-gib", "1", "--lora", "4")
    trainable = result["lora"]["trainable_params"]
    assert 0 < trainable < result["lora"]["total_params"] / 10
    parts = result["memory_plan"]["estimated_parts_gib"]
    assert parts["optimizer_state"] * 2**30 == pytest.approx(2 * 4 * trainable, rel=1e-6)


def test_the_count_leaves_the_process_as_it_was():
    """The fused RoPE patches the family's modeling module process-wide: after a count, transformers' own function is
    back (a stock model run later in the process computes without our kernels)."""
    from transformers.models.llama import modeling_llama
    stock = modeling_llama.apply_rotary_pos_emb
    plan_module.count_forward_peaks(AutoConfig.from_pretrained(ROOT / "configs" / "tiny"), torch.float32)
    assert modeling_llama.apply_rotary_pos_emb is stock
