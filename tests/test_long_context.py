"""The memory levers of finetune_optimized.py, on the tiny LLaMA in fp32 (CPU, Triton interpreter), with the fused
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
"""
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
        self.count += func in finetune_optimized.ATTENTION_KERNELS
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
        script.tile_mlps(model, tile)
    offloader = None
    if mode != "none":
        offloader = script.enable_activation_checkpointing(model, mode, offload, checkpoint_layers)
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
    stock.enable_activation_checkpointing(model, mode, 0)
    input_ids = torch.randint(0, 1000, (1, 24)).to(DEVICE)
    with AttentionCalls() as calls:
        loss_and_grads(stock, model, input_ids)
    assert calls.count == expected_calls  # 2 layers: one forward each, plus one recompute each under "full"


def test_tiled_mlp_keeps_one_weight_gradient_per_step():
    """The tiled MLP hands each weight's gradient to autograd once (a hook counting accumulations sees one)."""
    stock = SCRIPTS["stock"]
    model = tiny_model(stock)
    stock.tile_mlps(model, 8)
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
            script.optimizer_in_backward(model, make)
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
    requests, pinned_empty = [], finetune_optimized.pinned_empty
    monkeypatch.setattr(finetune_optimized, "pinned_empty",
                        lambda shape, dtype: requests.append((tuple(shape), dtype)) or pinned_empty(shape, dtype))
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)]
    offloader = finetune_optimized.ActivationOffloader(hidden_size=8)
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
        tensor = finetune_optimized.pinned_empty(shape, torch.float32)
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


def test_plot_of_peak_memory_against_length(tmp_path):
    search = {"script": "finetune_baseline.py", "variant": "liger", "options": {"activation_checkpointing": "full"},
              "seq_len_search": {"results": [
                  {"seq_len": 16, "status": "trained", "peak_gib": 1.0},
                  {"seq_len": 32, "status": "out of memory", "phase": "backward", "peak_gib": 2.0},
                  {"seq_len": 64, "status": "not tried"}]}}
    (tmp_path / "search.json").write_text(json.dumps(search))
    proc = subprocess.run([sys.executable, str(ROOT / "finetune_optimized.py"), "--plot", str(tmp_path / "search.json"),
                           str(ROOT / "results" / "long_sequences_h200" / "finetune_optimized_ckpt_1x131072_h200.json"),
                           "--out", str(tmp_path / "memory.png")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text("{}")
    proc = subprocess.run([sys.executable, str(ROOT / "finetune_optimized.py"), "--plot", str(tmp_path / "bad.json"),
                           "--out", str(tmp_path / "bad.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not a fine-tune results file" in proc.stderr and "Traceback" not in proc.stderr


def test_plot_leaves_out_runs_without_a_gpu_and_refuses_other_files(tmp_path, capsys):
    module = finetune_optimized
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

    module.main(["--plot", str(tmp_path / "cpu.json"), str(tmp_path / "gpu.json"), "--out", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"left out, no peak GPU memory (run without a GPU): {tmp_path / 'cpu.json'} (32 tokens)" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit, match="^error: --plot: nothing to plot: no run in these files measured its peak "
                                         "GPU memory$"):
        module.main(["--plot", str(tmp_path / "cpu.json"), str(tmp_path / "cpu_search.json"), "--out", str(png)])
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--plot", str(tmp_path / "gpu.json"), str(tmp_path / "profile.json"), "--out", str(png)])
    assert str(exit_info.value) == (f"error: --plot {tmp_path / 'profile.json'}: not a fine-tune results file (written "
                                    f"by profile_baseline.py); --plot reads the JSON of finetune_baseline.py and "
                                    f"finetune_optimized.py")
    # a search file of an older format (rows with "trained": true, no "status"): one line too, not a traceback
    older = {**gpu_search, "seq_len_search": {"results": [{"seq_len": 8, "trained": True, "peak_gib": 1.0}]}}
    (tmp_path / "older.json").write_text(json.dumps(older))
    with pytest.raises(SystemExit, match="older.json: not a fine-tune results file this version reads "
                                         r"\(KeyError: 'status'\)$"):
        module.main(["--plot", str(tmp_path / "older.json"), "--out", str(png)])
