"""Smoke tests of profile_baseline.py on the tiny LLaMA (CPU, Triton interpreter): it runs end to end with and without
the kernel flags, writes exactly one loadable Chrome trace and a summary whose categories are filled in, and
--compare prints a before/after table."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CATEGORIES = ["matmul", "attention", "RMSNorm", "SwiGLU", "loss", "optimizer", "memory copies", "other elementwise"]


def run_profile(tmp_path, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "profile_baseline.py"), "--model", "tiny", "--seq-len", "32",
           "--trace-dir", str(tmp_path), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def check_trace(path):
    trace = json.loads(Path(path).read_text())
    assert len(trace["traceEvents"]) > 100  # a whole training step, not an empty shell


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("baseline")
    out = run_profile(tmp_path, "--summary-out", str(tmp_path / "baseline.json"))
    return tmp_path, out, json.loads((tmp_path / "baseline.json").read_text())


@pytest.fixture(scope="module")
def kernels_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("kernels")
    out = run_profile(tmp_path, "--use-custom-rmsnorm", "--use-linear-ce", "--use-swiglu", "--use-rope",
                      "--summary-out", str(tmp_path / "kernels.json"))
    return tmp_path, out, json.loads((tmp_path / "kernels.json").read_text())


def test_baseline_writes_one_trace_and_a_summary(baseline_run):
    tmp_path, out, summary = baseline_run
    traces = [p for p in tmp_path.glob("profile_*.json") if not p.name.endswith(".summary.json")]
    assert len(traces) == 1 and summary["trace"] == str(traces[0])
    check_trace(traces[0])
    # The summary beside the trace is the same document as --summary-out.
    assert json.loads(traces[0].with_suffix(".summary.json").read_text()) == summary
    assert summary["weights"] == "random" and summary["variant"] == "baseline" and summary["replaced"] == {}
    for key in ("torch", "triton", "transformers", "git_commit", "device", "command", "date", "options"):
        assert key in summary
    assert "Command Buffer Full" not in out
    assert summary["top_ops"] and all(op["name"] != "Command Buffer Full" for op in summary["top_ops"])


def test_baseline_categories(baseline_run):
    _, _, summary = baseline_run
    cats = summary["categories"]
    assert list(cats) == CATEGORIES
    assert sum(c["ms"] for c in cats.values()) == pytest.approx(summary["step_ms"], rel=1e-6)
    assert sum(c["pct"] for c in cats.values()) == pytest.approx(100.0, abs=1e-6)
    # Every part of a LLaMA step is present and found: eager RMSNorm (pow/mean/rsqrt), the eager loss, AdamW...
    for cat in ("matmul", "attention", "RMSNorm", "SwiGLU", "loss", "optimizer"):
        assert cats[cat]["ms"] > 0, cat


def test_kernel_flags(kernels_run):
    tmp_path, out, summary = kernels_run
    # 2 * layers + 1 norms, one MLP and one attention (calling the patched RoPE) per layer
    assert summary["replaced"] == {"rmsnorm": 5, "swiglu_mlp": 2, "rope_attention": 2}
    assert summary["variant"] == "rmsnorm+linear_ce+swiglu+rope"
    check_trace(summary["trace"])
    # The Triton kernels and their backward are attributed to their categories.
    for cat in ("RMSNorm", "SwiGLU", "loss", "matmul", "optimizer"):
        assert summary["categories"][cat]["ms"] > 0, cat


def test_same_loss_with_and_without_kernels(baseline_run, kernels_run):
    # Same seed, same tokens, fp32 on CPU: the profiled step's loss agrees to rounding.
    assert kernels_run[2]["loss"] == pytest.approx(baseline_run[2]["loss"], rel=1e-5)


def test_compare(baseline_run, kernels_run):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "profile_baseline.py"), "--compare",
                           str(baseline_run[0] / "baseline.json"), str(kernels_run[0] / "kernels.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in CATEGORIES + ["step total"]:
        assert f"| {row}" in proc.stdout
    assert "rmsnorm+linear_ce+swiglu+rope" in proc.stdout


def test_custom_ce_and_tensorboard(tmp_path):
    run_profile(tmp_path, "--use-custom-ce", "--tensorboard", "--summary-out", str(tmp_path / "ce.json"))
    summary = json.loads((tmp_path / "ce.json").read_text())
    tb_traces = list((tmp_path / "tensorboard").glob("*.pt.trace.json"))
    assert len(tb_traces) == 1 and summary["trace"] == str(tb_traces[0])  # one trace, written by the handler only
    assert not [p for p in tmp_path.glob("profile_*.json") if not p.name.endswith(".summary.json")]
    check_trace(tb_traces[0])
    assert summary["variant"] == "ce" and summary["categories"]["loss"]["ms"] > 0


def test_bad_flags_fail():
    proc = subprocess.run([sys.executable, str(ROOT / "profile_baseline.py"), "--use-custom-ce", "--use-linear-ce"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not allowed with" in proc.stderr
