"""Tests of finetune_baseline.py and finetune_optimized.py on the tiny LLaMA (CPU, fp32, Triton interpreter).

- Both scripts run a few steps and write their JSON.
- Loss parity: same seed and data -> the optimized run's per-step losses equal the baseline's within rtol 2e-5.
  Why that tolerance: everything is fp32, and the kernels differ from eager PyTorch only in summation order (~1e-7
  relative per reduction); five AdamW steps at lr 1e-3 keep the runs within ~1e-7 relative of each other (measured),
  so 2e-5 leaves a 100x margin. A real defect is far larger: a wrong denominator (e.g. counting the ignored last
  position) moves the loss by ~3 %, a wrong gradient changes the loss curve by the size of its steps (~0.05-0.2 here;
  the test also checks that the loss really moves by more than 0.1).
- The optimized loss paths give transformers' own loss, model(input_ids, labels=labels).loss, with labels containing
  -100 (same shift, same denominator), and the same gradients.
- The seq-len search reports the longest length that trained (its out-of-memory handling: test_long_context.py).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import finetune_optimized  # noqa: E402  (first: the kernel modules must set up Triton before transformers loads it)
import finetune_baseline  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 30


def run_script(script, tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / script), "--model", "tiny", "--out", str(out), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    """Baseline, optimized (linear CE) and optimized (playbook CE) on the same text, 5 steps at a learning rate high
    enough that the loss visibly falls."""
    tmp_path = tmp_path_factory.mktemp("parity")
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    flags = ["--steps", "5", "--seq-len", "32", "--lr", "1e-3", "--data", str(data)]
    return {
        "baseline": run_script("finetune_baseline.py", tmp_path, "baseline", *flags),
        # 8-row chunks: the 32 tokens go through the linear cross-entropy in 4 chunks, as a long sequence would
        "linear_ce": run_script("finetune_optimized.py", tmp_path, "linear_ce", *flags, "--lce-chunk-size", "8"),
        "ce": run_script("finetune_optimized.py", tmp_path, "ce", *flags, "--loss", "ce"),
    }


def test_json_contents(parity_runs):
    for name, (result, stdout) in parity_runs.items():
        assert result["weights"] == "random" and "random weights" in stdout
        assert len(result["losses"]) == len(result["step_ms"]) == 5
        for key in ("device", "torch", "triton", "transformers", "git_commit", "git_dirty", "command", "date",
                    "options", "avg_step_ms", "tokens_per_s", "peak_memory_gib", "warmup_loss"):
            assert key in result, (name, key)
        assert result["tokens_per_step"] == 32 and result["tokens_per_s"] > 0
        assert "summary" in stdout and "tokens/s" in stdout


def test_replacement_counts(parity_runs):
    assert parity_runs["baseline"][0]["replaced"] == {}
    # tiny LLaMA: 2 layers -> 2 * 2 + 1 RMSNorms, 2 MLPs, 2 attention layers calling the patched RoPE
    assert parity_runs["linear_ce"][0]["replaced"] == {"rmsnorm": 5, "swiglu_mlp": 2, "rope_attention": 2}
    assert parity_runs["ce"][0]["variant"] == "rmsnorm+ce+swiglu+rope"


@pytest.mark.parametrize("variant", ["linear_ce", "ce"])
def test_loss_parity(parity_runs, variant):
    baseline = parity_runs["baseline"][0]["losses"]
    optimized = parity_runs[variant][0]["losses"]
    assert baseline[0] - baseline[-1] > 0.1  # the runs really train, so parity is not a flat line matching itself
    assert optimized == pytest.approx(baseline, rel=2e-5)


def test_no_swiglu_no_rope_and_synthetic_default(tmp_path):
    result, _ = run_script("finetune_optimized.py", tmp_path, "noswiglu", "--steps", "2", "--seq-len", "16",
                           "--no-swiglu", "--no-rope", "--optimizer", "adamw_fused")
    assert result["replaced"] == {"rmsnorm": 5} and result["options"]["data"] == "synthetic"
    assert result["variant"] == "rmsnorm+linear_ce" and result["options"]["rope"] is False


def tiny_model_with_random_norms(seed):
    torch.manual_seed(seed)
    model = finetune_optimized.LlamaForCausalLM._from_config(finetune_optimized.tiny_llama_config(),
                                                             dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # a trained model's norm weights are not all ones; make sure dweight is exercised
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.uniform_(0.5, 1.5)
    return model


def loss_and_grads(loss_fn, model):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("loss_impl", ["linear_ce", "ce"])
def test_optimized_loss_matches_transformers_with_ignored_labels(loss_impl):
    model = tiny_model_with_random_norms(seed=1)
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=generator)
    labels = input_ids.clone()
    labels[torch.rand(labels.shape, generator=generator) < 0.3] = -100  # masked prompt / padding tokens
    labels[1, :] = -100  # a fully ignored sequence must not change the denominator
    ref_loss, ref_grads = loss_and_grads(lambda: model(input_ids=input_ids, labels=labels).loss, model)

    # In place, reusing the same parameters (as the script does); the RoPE patch is process-wide: restored after.
    assert finetune_optimized.replace_rmsnorm(model, expected=5) == 5
    assert finetune_optimized.replace_llama_mlp(model, expected=2) == 2
    shift_labels = finetune_optimized.shift_labels_of(labels)
    original_rope = finetune_optimized.patch_llama_rope(model, expected=2)
    try:
        loss, grads = loss_and_grads(
            lambda: finetune_optimized.compute_loss(model, input_ids, shift_labels, loss_impl), model)
    finally:
        modeling_llama.apply_rotary_pos_emb = original_rope

    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item(), msg=name)


def test_baseline_loss_matches_transformers_with_ignored_labels():
    model = tiny_model_with_random_norms(seed=3)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 9))
    labels = input_ids.clone()
    labels[0, :4] = -100
    ref = model(input_ids=input_ids, labels=labels).loss
    ours = finetune_baseline.compute_loss(model, input_ids, finetune_baseline.shift_labels_of(labels), "eager")
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)


def test_seq_len_search_cli(tmp_path):
    result, stdout = run_script("finetune_baseline.py", tmp_path, "search", "--seq-len-search", "8,16")
    assert result["seq_len_search"]["longest_trained"] == 16
    assert [r["seq_len"] for r in result["seq_len_search"]["results"]] == [8, 16]
    assert [r["status"] for r in result["seq_len_search"]["results"]] == ["trained", "trained"]
    assert "longest batch-1 sequence that trained: 16" in stdout


def test_liger_without_gpu_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "finetune_baseline.py"), "--model", "tiny", "--liger",
                           "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert proc.returncode != 0 and "--liger needs" in proc.stderr
