"""Smoke test of benchmark_kernels.py as CI runs it: no GPU, toy sizes on the Triton interpreter.

The script's times mean nothing here; what is checked is that it runs every kernel end to end, that every provider
row carries its correctness verdict, that our kernels pass it, and that the JSON and the plots are written. A second
test feeds the script a deliberately broken provider to show that its correctness check can fail.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmark_kernels.py"
KERNELS = ("rmsnorm", "cross_entropy", "linear_cross_entropy", "swiglu", "rope")
HEADER_KEYS = ("gpu", "copy_gbps", "versions", "git_commit", "git_dirty", "command", "date", "rows")


def run_script(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bench")
    result = run_script("--kernel", "all", "--out", str(out_dir / "bench.json"), "--plot", str(out_dir / "bench"))
    return result, out_dir


def test_runs_and_passes(full_run):
    result, _ = full_run
    assert result.returncode == 0, f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert "interpreter times" in result.stdout  # says its times are not meaningful
    assert "How to read this table" in result.stdout


def test_json_rows(full_run):
    _, out_dir = full_run
    data = json.loads((out_dir / "bench.json").read_text())
    for key in HEADER_KEYS:
        assert key in data, key
    assert data["gpu"] == "cpu (Triton interpreter)"
    assert data["complete"] is True and data["passed"] is True and data["failures"] == []
    for name in ("torch", "triton", "transformers", "liger", "cce"):
        assert name in data["versions"]

    rows = data["rows"]
    assert all("error" in row and "provider" in row and "status" in row for row in rows)
    for kernel in KERNELS:
        timed = [row for row in rows if row["kernel"] == kernel and row["status"] == "ok"]
        ours = [row for row in timed if row["provider"] == "ours"]
        # every size has the three phases for ours, each checked against the float64 reference
        assert {row["phase"] for row in ours} == {"fwd", "bwd", "fwd+bwd"}, kernel
        assert len({row["tokens"] for row in ours}) >= 2, kernel
        for row in timed:
            assert row["error"], row
            assert all(math.isfinite(value) and value < 0.05 for value in row["error"].values()) or \
                row["check"] == "FAIL", row
            assert row["median_ms"] >= 0 and row["dtype"] == "bf16"
            # host time of a whole call: measured for fwd and fwd+bwd, not for the backward alone
            assert (row["host_ms"] > 0) if row["phase"] != "bwd" else row["host_ms"] is None, row
            if row["provider"].startswith("ours"):
                assert row["check"] == "pass", row
        # eager PyTorch is always there, and torch.compile is reported as skipped rather than silently missing
        assert any(row["provider"] in ("eager", "torch_fp32") for row in timed), kernel
        compile_rows = [row for row in rows if row["kernel"] == kernel and row["provider"] == "torch_compile"]
        if kernel != "linear_cross_entropy":
            assert compile_rows and compile_rows[0]["status"] == "skipped on CPU"

    by_phase = {(r["kernel"], r["provider"], r["tokens"], r["phase"]): r for r in rows if r.get("phase")}
    tokens = min(r["tokens"] for r in rows if r["kernel"] == "rmsnorm" and r.get("phase"))
    norm_row = by_phase[("rmsnorm", "ours", tokens, "fwd+bwd")]
    assert norm_row["bytes_formula"] == "5*N*H*s" and norm_row["bytes"] == 5 * tokens * 64 * 2
    swiglu_row = by_phase[("swiglu", "ours", tokens, "fwd+bwd")]
    assert swiglu_row["bytes_formula"] == "8*N*I*s" and swiglu_row["bytes_formula_issue8"] == "6*N*I*s"
    rope_row = by_phase[("rope", "ours", tokens, "fwd+bwd")]  # CPU dims: 4 query heads, 2 kv heads, head_dim 16
    assert rope_row["bytes_formula"] == "(4*(Hq+Hk)+4)*N*D*s" and rope_row["bytes"] == (4 * 6 + 4) * tokens * 16 * 2
    assert set(rope_row["error"]) == {"q_embed", "k_embed", "dq", "dk"}
    lce_row = by_phase[("linear_cross_entropy", "ours", tokens, "fwd+bwd")]
    assert lce_row["flops_formula"] == "6*N*H*V" and "gbps" not in lce_row


def test_missing_packages_are_rows(full_run):
    _, out_dir = full_run
    data = json.loads((out_dir / "bench.json").read_text())
    for package, provider in (("liger", "liger"), ("cce", "cce")):
        if data["versions"][package] == "not installed":
            statuses = {row["status"] for row in data["rows"] if row["provider"] == provider}
            assert statuses and all(status.startswith("not installed") for status in statuses)


def test_plots_written(full_run):
    _, out_dir = full_run
    for kernel in KERNELS:
        png = out_dir / f"bench_{kernel}.png"
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_help_shows_per_kernel_defaults():
    result = run_script("--help", timeout=120)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "rmsnorm 256 512 1024 2048 4096 8192 16384 65536" in text
    assert "128256" in text and "14336" in text


def test_broken_provider_fails_the_run(tmp_path, monkeypatch):
    """A kernel that loses the weight gradient must be caught: FAIL in the JSON and exit code 1."""
    monkeypatch.syspath_prepend(str(REPO))
    import benchmark_kernels as bench

    def no_weight_grad(x, weight):
        return bench.llama_rmsnorm_math(x, weight.detach())

    monkeypatch.setattr(bench, "rmsnorm_providers",
                        lambda: {"ours": lambda: no_weight_grad, "eager": lambda: bench.llama_rmsnorm_math})
    out = tmp_path / "broken.json"
    assert bench.main(["--kernel", "rmsnorm", "--tokens", "4", "--out", str(out)]) == 1
    rows = [row for row in json.loads(out.read_text())["rows"] if row["provider"] == "ours"]
    assert rows and all(row["check"] == "FAIL" for row in rows)
    assert math.isinf(rows[0]["error"]["dw"])
