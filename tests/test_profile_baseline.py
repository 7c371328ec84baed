"""Smoke tests of profile_baseline.py on the tiny LLaMA (CPU, Triton interpreter): it runs end to end with and without
the kernel flags (and with --lora, the step of a LoRA fine-tune), writes exactly one loadable Chrome trace and a
summary whose categories are filled in, prints none of the profiler's noise lines, and --compare prints a before/after
table. The --tensorboard log is opened by the reader it is written for: TensorBoard with its PyTorch Profiler plugin
(torch-tb-profiler), served on localhost and asked for the run's views, overview, operator table and trace, as the
browser tab asks.
"""
import gzip
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CATEGORIES = ["matmul", "attention", "RMSNorm", "SwiGLU", "loss", "optimizer", "memory copies", "other elementwise"]
# What torch's C++ profiler prints on every run unless profile_baseline.py filters it out.
PROFILER_NOISE = ["profiler_start", "profiler_stop", "Memory block of unknown size"]


def run_profile(tmp_path, *flags):
    """Runs the profiler; returns (stdout, stderr)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # fp32 on every device: the same-loss rule is an fp32 rule (on a GPU the script defaults to bf16)
    cmd = [sys.executable, str(ROOT / "profile_baseline.py"), "--model", "tiny", "--dtype", "fp32", "--seq-len", "32",
           "--trace-dir", str(tmp_path), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def check_trace(path):
    trace = json.loads(Path(path).read_text())
    assert len(trace["traceEvents"]) > 100  # a whole training step, not an empty shell


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("baseline")
    out, err = run_profile(tmp_path, "--summary-out", str(tmp_path / "baseline.json"))
    return tmp_path, out, json.loads((tmp_path / "baseline.json").read_text()), err


@pytest.fixture(scope="module")
def kernels_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("kernels")
    out, err = run_profile(tmp_path, "--use-custom-rmsnorm", "--use-linear-ce", "--use-swiglu", "--use-rope",
                           "--summary-out", str(tmp_path / "kernels.json"))
    return tmp_path, out, json.loads((tmp_path / "kernels.json").read_text()), err


def test_baseline_writes_one_trace_and_a_summary(baseline_run):
    tmp_path, out, summary, _ = baseline_run
    traces = [p for p in tmp_path.glob("profile_*.json") if not p.name.endswith(".summary.json")]
    assert len(traces) == 1 and summary["trace"] == str(traces[0])
    check_trace(traces[0])
    # The summary beside the trace is the same document as --summary-out.
    assert json.loads(traces[0].with_suffix(".summary.json").read_text()) == summary
    assert summary["weights"] == "random" and summary["variant"] == "baseline" and summary["replaced"] == {}
    for key in ("torch", "triton", "transformers", "git_commit", "device", "host_cpu", "command", "date", "options"):
        assert key in summary
    assert "Command Buffer Full" not in out
    assert summary["top_ops"] and all(op["name"] != "Command Buffer Full" for op in summary["top_ops"])


def test_no_profiler_noise(baseline_run, kernels_run):
    for run in (baseline_run, kernels_run):
        assert not [noise for noise in PROFILER_NOISE if noise in run[1] + run[3]], run[3][-2000:]
    if not torch.cuda.is_available():  # TRITON_INTERPRET is set (conftest): not even the interpreter's notice
        assert baseline_run[3] == ""


def test_baseline_categories(baseline_run):
    _, _, summary, _ = baseline_run
    cats = summary["categories"]
    assert list(cats) == CATEGORIES
    assert sum(c["ms"] for c in cats.values()) == pytest.approx(summary["step_ms"], rel=1e-6)
    assert sum(c["pct"] for c in cats.values()) == pytest.approx(100.0, abs=1e-6)
    # Every part of a LLaMA step is present and found: eager RMSNorm (pow/mean/rsqrt), the eager loss, AdamW...
    for cat in ("matmul", "attention", "RMSNorm", "SwiGLU", "loss", "optimizer"):
        assert cats[cat]["ms"] > 0, cat


def test_python_between_the_ops_is_not_a_category(baseline_run):
    """Without a GPU the categories add up CPU self time. The profiler's ProfilerStep range encloses the whole step,
    and its own self time is the Python between the ops: it is reported on its own line, not in a category (it once
    inflated "other elementwise"). On a GPU the categories count kernel time, and there is nothing to set apart."""
    _, out, summary, _ = baseline_run
    if torch.cuda.is_available():
        assert summary["outside_ops_ms"] is None and "outside every op" not in out
        return
    assert summary["outside_ops_ms"] > 0
    assert f"not in the table: {summary['outside_ops_ms']:.3f} CPU ms of the step outside every op" in out
    # the step's whole CPU time, as the profiler's own table totals it, is the categories plus that line
    value, unit = re.search(r"Self CPU time total: ([\d.]+)(us|ms|s)\b", out).groups()
    total_ms = float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    assert summary["step_ms"] + summary["outside_ops_ms"] == pytest.approx(total_ms, rel=1e-3, abs=2e-3)


def test_kernel_flags(kernels_run):
    tmp_path, out, summary, _ = kernels_run
    # 2 * layers + 1 norms, one MLP and one attention (calling the patched RoPE) per layer
    assert summary["replaced"] == {"rmsnorm": 5, "swiglu_mlp": 2, "rope_attention": 2}
    assert summary["variant"] == "rmsnorm+linear_ce+swiglu+rope"
    check_trace(summary["trace"])
    # The Triton kernels and their backward are attributed to their categories.
    for cat in ("RMSNorm", "SwiGLU", "loss", "matmul", "optimizer"):
        assert summary["categories"][cat]["ms"] > 0, cat


def test_same_loss_with_and_without_kernels(baseline_run, kernels_run):
    # Same seed, same tokens, fp32: the profiled step's loss agrees to rounding.
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
    tb_traces = list((tmp_path / "tensorboard").glob("*/*.pt.trace.json"))  # one run folder per profiled step
    assert len(tb_traces) == 1 and summary["trace"] == str(tb_traces[0])  # one trace, written by the handler only
    assert not [p for p in tmp_path.glob("profile_*.json") if not p.name.endswith(".summary.json")]
    check_trace(tb_traces[0])
    assert summary["variant"] == "ce" and summary["categories"]["loss"]["ms"] > 0

    pytest.importorskip("torch_tb_profiler")
    run = tb_traces[0].parent.name
    answers = ask_tensorboard(tmp_path / "tensorboard", run)
    assert answers["runs"] == [run]
    assert {"Overview", "Operator", "Trace"} <= set(answers["views"])
    assert answers["overview"]["steps"]["rows"]  # the step-time breakdown of the profiled step
    ops = {row["name"] for row in answers["operators"]["data"]}
    assert {"aten::mm", "aten::_foreach_mul_"} & ops and len(ops) > 20
    assert len(answers["trace"]["traceEvents"]) > 100


def ask_tensorboard(logdir, run):
    """Serves logdir with TensorBoard on a free localhost port and asks its PyTorch Profiler plugin what the browser
    tab asks: the runs, the run's views, its overview, its operator table and its trace."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = logdir.parent / "tensorboard.log"
    with open(log, "w") as log_file:
        server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                                   "--host", "127.0.0.1", "--port", str(port)], stdout=log_file, stderr=log_file)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost: never through a proxy

    def get(route, **query):
        url = f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler/{route}?{urllib.parse.urlencode(query)}"
        with opener.open(url, timeout=30) as response:
            body = response.read()
            return json.loads(gzip.decompress(body) if response.headers.get("Content-Encoding") == "gzip" else body)

    try:
        deadline = time.monotonic() + 120
        while True:  # the server starts, then loads the run in the background
            try:
                runs = get("runs")
                if runs["runs"] and not runs["loading"]:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        worker = get("workers", run=run, view="Overview")[0]
        spans = get("spans", run=run, worker=worker)
        where = {"run": run, "worker": worker, **({"span": spans[0]} if spans else {})}
        return {"runs": runs["runs"], "views": get("views", run=run), "overview": get("overview", **where),
                "operators": get("operation/table", group_by="Operation", **where), "trace": get("trace", **where)}
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_lora_step_with_the_kernels(tmp_path):
    """--lora R profiles the step of a LoRA fine-tune: peft's adapters on every decoder Linear, our kernels around
    them, AdamW over the adapters alone."""
    out, _ = run_profile(tmp_path, "--lora", "4", "--use-custom-rmsnorm", "--use-linear-ce", "--use-swiglu",
                         "--use-rope", "--summary-out", str(tmp_path / "lora.json"))
    summary = json.loads((tmp_path / "lora.json").read_text())
    assert summary["variant"] == "rmsnorm+linear_ce+swiglu+rope+lora4" and summary["options"]["lora"] == 4
    assert summary["replaced"] == {"rmsnorm": 5, "swiglu_mlp": 2, "rope_attention": 2}
    for cat in ("matmul", "RMSNorm", "SwiGLU", "loss", "optimizer"):
        assert summary["categories"][cat]["ms"] > 0, cat
    check_trace(summary["trace"])


def test_bad_flags_fail():
    proc = subprocess.run([sys.executable, str(ROOT / "profile_baseline.py"), "--use-custom-ce", "--use-linear-ce"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "not allowed with" in proc.stderr
