"""LoRA and QLoRA (--lora R, --qlora) in both fine-tune scripts, on the CPU (fp32, Triton interpreter).

- Frozen weights get no gradient from our kernels, and no work is spent on one: the fused RMSNorm's backward sums no
  dweight for a frozen weight and the fused linear cross-entropy runs no dW matmul for a frozen lm_head, while the
  input gradient stays what it is with a trainable weight (against float64).
- Every supported family's tiny config with peft's LoRA on every decoder Linear (adapters A and B both random, so that
  every adapter gradient is non-zero): our kernels patched into the peft-wrapped model give the stock peft model's loss
  and adapter gradients, by test_families.py's rule (against the same model in float64, our fp32 error is at most 4x
  stock fp32's own error, plus 1e-6 of the value's scale); the frozen weights get no gradient in either.
- The scripts: ours with --lora gives the baseline's (stock peft) losses within rtol 2e-5, the reasoning of
  test_finetune.py's parity rule (fp32, kernels that differ from eager only in summation order; a real defect moves
  the loss by far more, and the test checks the loss really moves). A checkpoint holds the adapters and their AdamW
  state, nothing else; a resumed run continues with the uninterrupted run's losses, and --resume refuses adapters of
  another base, rank or a full fine-tune in one line; DIR/final holds adapter_model.safetensors and
  adapter_config.json, which PeftModel.from_pretrained loads onto the same base and which give the run's last
  held-out loss; DIR/final-merged (--merge) is a plain model whose weights are base + (alpha / R) B A and whose logits
  are the adapted model's.
- --qlora: every decoder Linear's weight is torchao's NF4Tensor (about a quarter of the bf16 bytes), ours gives the
  baseline's losses, and training moves the loss.
"""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import linear_cross_entropy_kernel  # noqa: E402  (the kernels first: they set Triton's interpreter flag)
import rmsnorm_kernel  # noqa: E402
from linear_cross_entropy_kernel import linear_cross_entropy  # noqa: E402
from rmsnorm_kernel import apply_rmsnorm, rms_norm  # noqa: E402
from rope_kernel import apply_rope  # noqa: E402
from swiglu_kernel import apply_glu_mlp  # noqa: E402
from test_families import FAMILIES, build, our_loss, stock_loss  # noqa: E402
from transformers import AutoConfig  # noqa: E402

peft = pytest.importorskip("peft")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 30


# ----------------------------------------------------------------------------------------------------------------------
# The kernels with a frozen weight

def recorded_calls(monkeypatch, module, name):
    """Replaces module.name by a wrapper that records each call's bound arguments; returns the list of them."""
    import inspect
    original, calls = getattr(module, name), []
    signature = inspect.signature(original)

    def recording(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(bound.arguments)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return calls


@pytest.mark.parametrize("offset, casting_mode", [(0.0, "llama"), (1.0, "gemma")])
def test_rmsnorm_with_a_frozen_weight_sums_no_dweight(offset, casting_mode, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 48, generator=generator).to(DEVICE)
    weight = (torch.rand(48, generator=generator) + 0.5).to(DEVICE)  # frozen
    dy = torch.randn(5, 3, 48, generator=generator).to(DEVICE)
    calls = recorded_calls(monkeypatch, rmsnorm_kernel, "rmsnorm_backward")
    x_ours = x.clone().requires_grad_()
    rms_norm(x_ours, weight, 1e-6, offset, casting_mode).backward(dy)
    assert weight.grad is None and [call["want_dw"] for call in calls] == [False]
    x64 = x.double().requires_grad_()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    (normed * (weight.double() + offset)).backward(dy.double())
    torch.testing.assert_close(x_ours.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    # the same kernel with the weight trainable: dx does not depend on whether dweight is summed
    x_trained, weight_trained = x.clone().requires_grad_(), weight.clone().requires_grad_()
    rms_norm(x_trained, weight_trained, 1e-6, offset, casting_mode).backward(dy)
    assert calls[-1]["want_dw"] is True and weight_trained.grad is not None
    assert torch.equal(x_trained.grad, x_ours.grad)


def test_linear_cross_entropy_with_a_frozen_lm_head_runs_no_dw_matmul(monkeypatch):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 19, 32, generator=generator).to(DEVICE)
    weight = (torch.randn(300, 32, generator=generator) / 32 ** 0.5).to(DEVICE)  # frozen
    targets = torch.randint(0, 300, (2, 19), generator=generator).to(DEVICE)
    targets[0, :4] = -100
    calls = recorded_calls(monkeypatch, linear_cross_entropy_kernel, "_linear_cross_entropy_chunks")
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy(h, weight, targets, chunk_size=8)
    loss.backward()
    assert weight.grad is None and calls and all(not call["want_dw"] and call["want_dh"] for call in calls)
    h64 = hidden.double().requires_grad_()
    ref = F.cross_entropy((h64 @ weight.double().T).view(-1, 300), targets.view(-1), ignore_index=-100)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------------------------------
# Every family: our kernels on the peft-wrapped model give stock peft's loss and adapter gradients

def with_random_adapters(model, seed):
    """peft's LoRA on every decoder Linear with A and B both random (peft's default B = 0 would make every gradient of
    A zero, and a test of them unable to fail)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    peft.get_peft_model(model, config)
    with torch.no_grad():  # peft's kaiming init of B is far smaller than a trained B; give it the scale of A's
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    return model


@pytest.mark.usefixtures("restore_rope")
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_family_matches_stock_peft(family, monkeypatch):
    folder = FAMILIES[family][0]
    torch.manual_seed(1)
    config = AutoConfig.from_pretrained(ROOT / "configs" / folder)
    input_ids = torch.randint(0, config.vocab_size, (2, 24), device=DEVICE)
    labels = torch.randint(0, config.vocab_size, (2, 24), device=DEVICE)
    stock = with_random_adapters(build(folder), seed=2)
    reference, ours = copy.deepcopy(stock).double(), copy.deepcopy(stock)
    results = {}

    def run(name, model, loss_fn):
        loss = loss_fn(model, input_ids, labels)
        loss.backward()
        frozen = [param for param in model.parameters() if not param.requires_grad]
        assert frozen and all(param.grad is None for param in frozen), name  # no weight gradient for the frozen
        results[name] = loss.double().item(), gradients_of_trainable(model)

    # The stock runs first: apply_rope switches the whole family's attention, the float64 reference's too.
    run("reference", reference, stock_loss)
    run("stock", stock, stock_loss)
    n_layers = config.num_hidden_layers
    # the kernels go into the model peft has wrapped: peft's LoRA layers sit where the MLP's Linears were
    assert apply_rmsnorm(ours) == FAMILIES[family][1] * n_layers + 1
    assert apply_glu_mlp(ours) == n_layers and apply_rope(ours) == n_layers
    norm_calls = recorded_calls(monkeypatch, rmsnorm_kernel, "rmsnorm_backward")
    loss_calls = recorded_calls(monkeypatch, linear_cross_entropy_kernel, "_linear_cross_entropy_chunks")
    run("ours", ours, our_loss)
    # every norm but the first layer's input norm, whose input (the frozen embedding's output) needs no gradient
    assert len(norm_calls) == FAMILIES[family][1] * n_layers and not any(call["want_dw"] for call in norm_calls)
    assert loss_calls and not any(call["want_dw"] for call in loss_calls)

    def within_rule(ours_error, stock_error, scale):
        return ours_error <= 4 * stock_error + 1e-6 * scale

    (loss64, grads64), (stock_loss_value, stock_grads), (ours_loss, ours_grads) = (
        results["reference"], results["stock"], results["ours"])
    assert within_rule(abs(ours_loss - loss64), abs(stock_loss_value - loss64), abs(loss64))
    assert ours_grads.keys() == grads64.keys() and all("lora_" in name for name in grads64)
    for name, g64 in grads64.items():
        scale = g64.abs().max().item()
        assert scale > 0, name  # every adapter takes part in the loss
        ours_error = (ours_grads[name] - g64).abs().max().item()
        stock_error = (stock_grads[name] - g64).abs().max().item()
        assert within_rule(ours_error, stock_error, scale), (name, ours_error, stock_error, scale)


def gradients_of_trainable(model):
    return {name: p.grad.double().clone() for name, p in model.named_parameters() if p.requires_grad}


# ----------------------------------------------------------------------------------------------------------------------
# The scripts

def run_script(script, out, *flags, model="tiny"):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / script), "--model", model, "--dtype", "fp32", "--out", str(out), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(Path(out).read_text()), proc.stdout


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """Both scripts, LoRA rank 4 on the same text, 4 steps at a learning rate that visibly moves the loss, a held-out
    evaluation at the end, checkpoints at steps 2 and 4, the adapters and the merged model written."""
    tmp = tmp_path_factory.mktemp("lora")
    (tmp / "data.txt").write_text(TEXT)
    flags = ["--steps", "4", "--seq-len", "32", "--lr", "1e-2", "--lora", "4", "--data", str(tmp / "data.txt"),
             "--eval-split", "0.2", "--eval-batches", "2", "--save-steps", "2", "--save-total-limit", "2", "--merge"]
    runs = {}
    for script in ("finetune_baseline.py", "finetune_optimized.py"):
        folder = tmp / Path(script).stem
        runs[script] = (*run_script(script, tmp / f"{folder.name}.json", *flags, "--output-dir", str(folder)), folder)
    return runs, flags


def test_ours_gives_stock_peft_losses(lora_runs):
    runs, _ = lora_runs
    baseline, ours = runs["finetune_baseline.py"][0], runs["finetune_optimized.py"][0]
    assert baseline["losses"][0] - baseline["losses"][-1] > 0.1  # the adapters really train
    assert ours["losses"] == pytest.approx(baseline["losses"], rel=2e-5)
    assert ours["evals"][-1]["loss"] == pytest.approx(baseline["evals"][-1]["loss"], rel=2e-5)
    config = AutoConfig.from_pretrained(ROOT / "configs" / "tiny")
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    # rank 4 on q, k, v, o, gate, up, down of each layer: A is [4, in], B [out, 4]
    per_layer = 4 * ((h + h) + (h + kv) * 2 + (h + h) + (h + i) * 2 + (i + h))
    for result in (baseline, ours):
        assert result["lora"]["trainable_params"] == config.num_hidden_layers * per_layer
        assert "LoRA: rank 4" in runs["finetune_optimized.py"][1]


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_only(lora_runs):
    from torch.distributed.checkpoint import FileSystemReader
    for script in ("finetune_baseline.py", "finetune_optimized.py"):
        folder = lora_runs[0][script][2] / "checkpoint-4"
        keys = list(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
        model_keys = [key for key in keys if key.startswith("model.")]
        # A and B of the 7 Linears of each of the 2 layers, nothing of the frozen base
        assert len(model_keys) == 2 * 7 * 2 and all(".lora_A." in key or ".lora_B." in key for key in model_keys)
        # AdamW's step and moments of each adapter, keyed by the parameter's name, and no one else's
        assert {key for key in keys if key.startswith("optimizer.state.")} == {
            f"optimizer.state.{key[len('model.'):]}.{name}" for key in model_keys
            for name in ("step", "exp_avg", "exp_avg_sq")}


def test_resumed_lora_run_continues_with_the_same_losses(lora_runs, tmp_path):
    """Ours (its resume is the baseline's code, its checkpoints written in the background)."""
    script = "finetune_optimized.py"
    runs, flags = lora_runs
    uninterrupted, _, folder = runs[script]
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    import shutil
    shutil.copytree(folder / "checkpoint-2", resumed_dir / "checkpoint-2")
    flags = [flag for flag in flags if flag != "--merge"]
    resumed, stdout = run_script(script, tmp_path / "resumed.json", *flags, "--output-dir", str(resumed_dir),
                                 "--resume")
    assert "resumed from" in stdout and resumed["start_step"] == 2
    assert resumed["losses"] == pytest.approx(uninterrupted["losses"][2:], rel=1e-6)


def base_model(config_name="tiny", seed=0):
    """The base the scripts train on: the built-in config's random weights from the run's seed."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "configs" / config_name),
                                            dtype=torch.float32, attn_implementation="sdpa")


def held_out_batches(flags, output_dir):
    """The held-out token ids of the run, batch by batch, as the scripts make them (the end of the text, UTF-8 bytes
    as tokens; each batch holds the ids, the shifted labels and the positions)."""
    import finetune_baseline
    args = finetune_baseline.parse_args([*flags, "--output-dir", str(output_dir)])
    _, batches = finetune_baseline.load_data(args, base_model().config, "cpu", 0, 1)
    return [ids for ids, _, _ in batches["eval"]["steps"]]


def test_saved_adapters_reload_with_peft_and_give_the_held_out_loss(lora_runs):
    runs, flags = lora_runs
    for script in ("finetune_baseline.py", "finetune_optimized.py"):
        result, _, folder = runs[script]
        assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in (folder / "final").iterdir()}
        model = peft.PeftModel.from_pretrained(base_model(), folder / "final").eval()
        batches = held_out_batches(flags, folder)
        with torch.no_grad():
            losses = [model(input_ids=ids, labels=ids).loss for ids in batches]
        assert torch.stack(losses).mean().item() == pytest.approx(result["evals"][-1]["loss"], rel=1e-5)
        # the base alone gives another loss: the adapters were loaded and matter
        with torch.no_grad(), model.disable_adapter():
            base_loss = torch.stack([model(input_ids=ids, labels=ids).loss for ids in batches]).mean().item()
        assert abs(base_loss - result["evals"][-1]["loss"]) > 1e-3


def test_merged_model_is_the_base_plus_the_adapters(lora_runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    folder = lora_runs[0]["finetune_optimized.py"][2]
    merged = AutoModelForCausalLM.from_pretrained(folder / "final-merged", dtype=torch.float32).eval()
    base = base_model()
    adapters = load_file(folder / "final" / "adapter_model.safetensors")
    config = json.loads((folder / "final" / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    n_merged = 0
    for name, weight in base.named_parameters():
        prefix = "base_model.model." + name.removesuffix(".weight")
        if f"{prefix}.lora_A.weight" in adapters:
            delta = scale * adapters[f"{prefix}.lora_B.weight"] @ adapters[f"{prefix}.lora_A.weight"]
            assert delta.abs().max() > 1e-4, name  # trained: B has left zero
            weight = weight + delta
            n_merged += 1
        torch.testing.assert_close(merged.get_parameter(name), weight, rtol=1e-6, atol=1e-7)
    assert n_merged == 7 * base.config.num_hidden_layers
    adapted = peft.PeftModel.from_pretrained(base_model(), folder / "final").eval()
    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=1e-4,
                                   atol=1e-5)


def test_qlora_base_is_nf4_and_ours_gives_the_baseline_losses(tmp_path):
    from torchao.quantization import NF4Tensor
    import finetune_baseline
    args = finetune_baseline.parse_args(["--lora", "4", "--qlora"])
    model = base_model()
    dense_bytes = sum(p.numel() * 2 for p in model.model.layers.parameters() if p.dim() == 2)  # as bf16
    finetune_baseline.apply_lora(args, model)
    bases = [module.base_layer.weight for module in model.modules() if hasattr(module, "base_layer")]
    assert len(bases) == 7 * model.config.num_hidden_layers and all(isinstance(w, NF4Tensor) for w in bases)
    nf4_bytes = sum(w.quantized_data.nbytes + w.quantized_scalers.nbytes + w.quantization_factor.nbytes
                    for w in bases)
    assert nf4_bytes < 0.3 * dense_bytes
    (tmp_path / "data.txt").write_text(TEXT)
    flags = ["--steps", "3", "--seq-len", "32", "--lr", "1e-2", "--lora", "4", "--qlora", "--data",
             str(tmp_path / "data.txt")]
    baseline, _ = run_script("finetune_baseline.py", tmp_path / "b.json", *flags)
    ours, stdout = run_script("finetune_optimized.py", tmp_path / "o.json", *flags)
    assert "base in NF4" in stdout and ours["lora"]["base_format"] == "nf4"
    assert baseline["losses"][0] - baseline["losses"][-1] > 0.1
    assert ours["losses"] == pytest.approx(baseline["losses"], rel=2e-5)


@pytest.mark.parametrize("other, this_run", [
    (["--model", "tiny-mistral"], "LoRA adapters of rank 4 on all-linear of tiny-mistral"),
    (["--lora", "8"], "LoRA adapters of rank 8 on all-linear of tiny"),
    (["--no-lora"], "a full fine-tune (no LoRA)"),
], ids=["another-base", "another-rank", "full-fine-tune"])
def test_resume_refuses_adapters_of_another_run_in_one_line(lora_runs, other, this_run, tmp_path):
    """The check runs before anything of the checkpoint is loaded: in the process for each case, and once as a user
    runs the script (one line, no traceback, nothing written)."""
    import finetune_baseline
    from test_bad_inputs import run_failing
    runs, flags = lora_runs
    folder = runs["finetune_baseline.py"][2]
    flags = [flag for flag in flags if flag != "--merge"]
    if other == ["--no-lora"]:
        index = flags.index("--lora")
        flags, other = flags[:index] + flags[index + 2:], []
    flags = ["--model", "tiny", *flags, *other, "--output-dir", str(folder), "--resume"]
    expected = (f"error: --resume: {folder / 'checkpoint-4'} holds LoRA adapters of rank 4 on all-linear of tiny; "
                f"this run trains {this_run}:")
    with pytest.raises(SystemExit) as refused:
        finetune_baseline.resume(finetune_baseline.parse_args(flags), None, None, None, 1)
    assert str(refused.value).startswith(expected)
    if "--model" in other:
        out = tmp_path / "out.json"
        run_failing([str(ROOT / "finetune_baseline.py"), *flags, "--out", str(out)], tmp_path, expected)
        assert not out.exists()


def test_lora_on_packed_conversations_in_both_scripts(tmp_path):
    """LoRA and conversation data together: the same packed conversations, answers as the only targets, give the
    same losses in both scripts (our kernels under the adapters), and the loss moves."""
    rows = [{"messages": [{"role": "user", "content": f"question {i}: " + "why? " * (i % 5 + 1)},
                          {"role": "assistant", "content": f"answer {i}: " + "because. " * (i % 3 + 2)}]}
            for i in range(12)]
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--lora", "4", "--data", str(data), "--seq-len", "128", "--steps", "3", "--lr", "1e-2"]
    results = {script: run_script(script, tmp_path / f"{script}.json", *flags)[0]
               for script in ("finetune_baseline.py", "finetune_optimized.py")}
    baseline, ours = results["finetune_baseline.py"], results["finetune_optimized.py"]
    assert ours["lora"]["trainable_params"] == baseline["lora"]["trainable_params"] > 0
    assert ours["losses"] == pytest.approx(baseline["losses"], rel=2e-5)
    assert abs(ours["losses"][-1] - ours["losses"][0]) > 1e-3
