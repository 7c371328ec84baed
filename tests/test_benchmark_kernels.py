"""Tests of benchmark_kernels.py, on the CPU interpreter (CI) and on a GPU alike.

The script's times mean nothing on the CPU; what is checked is that it runs every kernel end to end, that every
provider row carries its correctness verdict against the float64 reference (ours "pass", other providers never
"FAIL" but "above rule (peer)"), that the JSON and the plots are written, that the legend describes only what was
measured on this device, and that the default output lands in the git-ignored runs/ folder, never in results/.
A deliberately broken provider shows that the correctness check can fail; a toy kernel registered in-process shows
that the registry alone drives the loop, the rows, the table, the legend, the options and the output names.
"""
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmark_kernels.py"
KERNELS = ("rmsnorm", "cross_entropy", "linear_cross_entropy", "swiglu", "rope")
HEADER_KEYS = ("gpu", "host_cpu", "copy_gbps", "versions", "git_commit", "git_dirty", "command", "date", "rows")
ON_GPU = torch.cuda.is_available()
# On a GPU the playbook's sizes would take minutes: two small sizes and short timings keep the checks quick there.
GPU_QUICK = ["--tokens", "256", "512", "--rep-ms", "20", "--warmup-ms", "5", "--copy-gib", "0.5"] if ON_GPU else []
IN_PROCESS_QUICK = ["--rep-ms", "5", "--warmup-ms", "1", "--copy-gib", "0.1"]
PEER_LABELS = {"pass", "above rule (peer)", "failed (peer)", "unchecked"}


def run_script(*args, timeout=600):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("bench")
    result = run_script("--kernel", "all", "--out", str(out_dir / "bench.json"), "--plot", *GPU_QUICK)
    return result, out_dir


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    import benchmark_kernels
    return benchmark_kernels


def test_runs_and_passes(full_run):
    result, out_dir = full_run
    assert result.returncode == 0, f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    text = " ".join(result.stdout.split())
    assert "How to read this table" in text
    assert "SUMMARY: all correctness checks of our kernels PASSED" in text
    # The legend describes what happened on this device, and nothing else.
    if ON_GPU:
        assert "do_bench, L2 flushed" in text and "interpreter" not in text
    else:
        assert "time.perf_counter calls on the CPU, our kernels on the Triton interpreter" in text
        assert "not meaningful" in text
        assert "do_bench" not in text and "L2" not in text
    # A peer above the rule is labelled as a peer in the table, exactly when the JSON says so.
    rows = json.loads((out_dir / "bench.json").read_text())["rows"]
    assert any(row["check"] == "above rule (peer)" for row in rows) == ("above rule (peer)" in result.stdout)


def test_json_rows(full_run):
    result, out_dir = full_run
    data = json.loads((out_dir / "bench.json").read_text())
    for key in HEADER_KEYS:
        assert key in data, key
    assert (data["gpu"] == "cpu (Triton interpreter)") != ON_GPU
    assert ("do_bench" in data["timing"]) == ON_GPU
    assert data["complete"] is True and data["passed"] is True and data["failures"] == []
    assert data["kernels"] == list(KERNELS)
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
            if row["check"] == "unchecked":  # a ceiling (the matmuls alone) is timed, not checked
                assert row["error"] is None and row["provider"] == "matmuls", row
            else:
                assert row["error"] and all(math.isfinite(value) for value in row["error"].values()), row
                assert all(value < 0.05 for value in row["error"].values()) or row["check"] != "pass", row
            assert row["median_ms"] >= 0 and row["dtype"] == "bf16"
            # host time of a whole call: measured for fwd and fwd+bwd, not for the backward alone
            assert (row["host_ms"] > 0) if row["phase"] != "bwd" else row["host_ms"] is None, row
            # peak memory is measured on a GPU only
            assert (row["peak_mb"] is not None and row["peak_mb"] >= 0) if ON_GPU else row["peak_mb"] is None, row
            assert row["judged"] == row["provider"].startswith("ours"), row
            if row["judged"]:
                assert row["check"] == "pass", row
            else:
                assert row["check"] in PEER_LABELS, row  # never "FAIL": that word is for ours
        # eager PyTorch is always there; torch.compile runs on a GPU and is reported as skipped on the CPU
        assert any(row["provider"] in ("eager", "torch_fp32") for row in timed), kernel
        compile_rows = [row for row in rows if row["kernel"] == kernel and row["provider"] == "torch_compile"]
        if kernel != "linear_cross_entropy":
            assert compile_rows and all(row["status"] == ("ok" if ON_GPU else "skipped on CPU")
                                        for row in compile_rows), kernel

    dims = data["dims"]
    by_phase = {(r["kernel"], r["provider"], r["tokens"], r["phase"]): r for r in rows if r.get("phase")}
    tokens = min(r["tokens"] for r in rows if r["kernel"] == "rmsnorm" and r.get("phase"))
    norm_row = by_phase[("rmsnorm", "ours", tokens, "fwd+bwd")]
    assert norm_row["bytes_formula"] == "5*N*H*s" and norm_row["bytes"] == 5 * tokens * dims["hidden"] * 2
    assert norm_row["gbps"] == pytest.approx(norm_row["bytes"] / norm_row["median_ms"] / 1e6)
    swiglu_row = by_phase[("swiglu", "ours", tokens, "fwd+bwd")]
    assert swiglu_row["bytes_formula"] == "8*N*I*s" and swiglu_row["bytes"] == 8 * tokens * dims["intermediate"] * 2
    rope_row = by_phase[("rope", "ours", tokens, "fwd+bwd")]
    assert rope_row["bytes_formula"] == "(4*(Hq+Hk)+4)*N*D*s"
    assert rope_row["bytes"] == (4 * (dims["heads"] + dims["kv_heads"]) + 4) * tokens * dims["head_dim"] * 2
    assert set(rope_row["error"]) == {"q_embed", "k_embed", "dq", "dk"}
    lce_row = by_phase[("linear_cross_entropy", "ours", tokens, "fwd+bwd")]
    assert lce_row["flops_formula"] == "6*N*H*V" and "gbps" not in lce_row
    assert lce_row["flops"] == 6 * tokens * dims["hidden"] * dims["vocab"]
    # the formulas of the JSON rows are the ones the legend prints
    for formula in ("5*N*H*s", "2*N*V*s", "6*N*H*V", "8*N*I*s", "(4*(Hq+Hk)+4)*N*D*s"):
        assert formula in result.stdout, formula


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
        png = out_dir / f"bench_{kernel}.png"  # named after the JSON path: bench.json -> bench_<kernel>.png
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_help_lists_the_registry(bench):
    result = run_script("--help", timeout=120)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "rmsnorm GPU tokens 256 512 1024 2048 4096 8192 16384 65536" in text
    assert "128256" in text and "14336" in text
    for spec in bench.KERNELS.values():
        assert f"{spec.name} GPU tokens {' '.join(map(str, spec.tokens_gpu))}" in text
        assert all(count.formula in text for count in [*spec.bytes.values(), *spec.flops.values()])
    assert "runs/bench_" in text and "<JSON path without .json>_<kernel>.png" in text


def test_broken_provider_fails_the_run(tmp_path, monkeypatch, bench):
    """A kernel that loses the weight gradient must be caught: FAIL in the JSON and exit code 1."""
    def no_weight_grad():
        return lambda x, weight: bench.llama_rmsnorm_math(x, weight.detach())

    spec = bench.KERNELS["rmsnorm"]
    broken = dataclasses.replace(spec, providers=(bench.Provider("ours", no_weight_grad, ours=True),
                                                  spec.provider("eager")))
    monkeypatch.setitem(bench.KERNELS, "rmsnorm", broken)
    out = tmp_path / "broken.json"
    assert bench.main(["--kernel", "rmsnorm", "--tokens", "4", "--out", str(out), *IN_PROCESS_QUICK]) == 1
    data = json.loads(out.read_text())
    rows = [row for row in data["rows"] if row["provider"] == "ours"]
    assert rows and all(row["check"] == "FAIL" for row in rows)
    assert math.isinf(rows[0]["error"]["dw"])
    assert data["passed"] is False and data["failures"]


def _snapshot(folder):
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_default_output_goes_to_runs(monkeypatch, capsys, bench):
    """Without --out the JSON lands in the git-ignored runs/ under a name that says what was run; results/ is
    untouched."""
    monkeypatch.chdir(REPO)
    args = ["--kernel", "rmsnorm", "--tokens", "3", "--providers", "ours", "eager"]
    expected = REPO / "runs" / f"bench_rmsnorm_{bench.device_slug()}_n3_ours+eager.json"
    before = expected.read_bytes() if expected.exists() else None
    results = _snapshot(REPO / "results")
    try:
        assert bench.main([*args, *IN_PROCESS_QUICK]) == 0
        written = [line.split(" ", 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
        assert written == [str(expected.relative_to(REPO))], written
        assert written[0].startswith("runs/")
        assert json.loads(expected.read_text())["kernels"] == ["rmsnorm"]
        assert _snapshot(REPO / "results") == results
        ignored = subprocess.run(["git", "check-ignore", "-q", str(expected)], cwd=REPO)
        assert ignored.returncode in (0, 128)  # 0: git ignores it; 128: not a git checkout (a copied tree)
    finally:
        if before is None:
            expected.unlink(missing_ok=True)
        else:
            expected.write_bytes(before)


def _toy_spec(bench, name):
    """y = scale * x, a kernel made of one registry entry: the benchmark must need nothing else."""
    def make_case(tokens, dims, dtype, gen):
        def randn():
            return torch.randn(tokens, dims["width"], generator=gen, device=bench.DEVICE).to(dtype)
        shape = {"tokens": tokens, "width": dims["width"]}
        return bench.Case([randn().requires_grad_()], {"dx": 0}, randn(), "y", shape)

    def reference(case, scale=2.0):
        x = case.args[0].detach().double().requires_grad_()
        y = scale * x
        y.backward(case.dy.double())
        return {"y": y.detach(), "dx": x.grad}

    def scaled(scale=2.0):
        return lambda x: scale * x

    def absent():
        import no_such_benchmark_package  # noqa: F401
        return scaled()

    return bench.KernelSpec(
        name=name, tokens_gpu=(64, 128), tokens_cpu=(3, 5), dims_gpu={"width": 256}, dims_cpu={"width": 8},
        make_case=make_case, reference=reference, rule_provider="eager",
        providers=(bench.Provider("ours", scaled, ours=True),
                   bench.Provider("eager", scaled),
                   bench.Provider("ours (x3)", scaled, "a variant: its option reaches the reference and eager too",
                                  ours=True, options={"scale": 3.0}),
                   bench.Provider("peer_off", lambda: scaled(2.5), "a peer with the wrong answer"),
                   bench.Provider("absent", absent)),
        bytes={"fwd": bench.Count("2*N*W*s", lambda d, s: 2 * d["tokens"] * d["width"] * s),
               "fwd+bwd": bench.Count("4*N*W*s", lambda d, s: 4 * d["tokens"] * d["width"] * s)},
        legend=("toy: one multiplication",))


def test_registry_drives_everything(tmp_path, monkeypatch, capsys, bench):
    for name in ("toy", "toy_copy"):
        monkeypatch.setitem(bench.KERNELS, name, _toy_spec(bench, name))
    out = tmp_path / "bench_{kernel}_x.json"
    code = bench.main(["--kernel", "toy", "toy_copy", "--width", "6", "--out", str(out), "--plot", *IN_PROCESS_QUICK])
    stdout = capsys.readouterr().out
    assert code == 0, stdout  # the peer above the rule is reported, not judged
    for name in ("toy", "toy_copy"):
        data = json.loads((tmp_path / f"bench_{name}_x.json").read_text())  # one file per kernel
        assert data["kernels"] == [name] and data["dims"] == {"width": 6} and data["passed"] is True
        assert (tmp_path / f"bench_{name}_x_{name}.png").exists()
        rows = data["rows"]
        assert {row["kernel"] for row in rows} == {name}
        timed = [row for row in rows if row.get("phase") == "fwd+bwd"]
        assert {row["tokens"] for row in timed} == set(_toy_spec(bench, name).tokens_gpu if bench.ON_GPU else (3, 5))
        for row in timed:
            assert row["shape"]["width"] == 6
            assert row["bytes_formula"] == "4*N*W*s" and row["bytes"] == 4 * row["tokens"] * 6 * 2
        checks = {row["provider"]: row["check"] for row in timed}
        assert checks == {"ours": "pass", "eager": "pass", "ours (x3)": "pass", "peer_off": "above rule (peer)"}
        variant = next(row for row in timed if row["provider"] == "ours (x3)")
        assert variant["options"] == {"scale": 3.0} and variant["error"]["y"] < 1e-2
        assert next(row for row in rows if row["provider"] == "absent")["status"].startswith("not installed")
        bwd = [row for row in rows if row.get("phase") == "bwd"]
        assert bwd and all("bytes" not in row for row in bwd)  # no count for that phase: no GB/s
    assert "=== toy (bf16) ===" in stdout and "toy: one multiplication" in stdout and "4*N*W*s" in stdout
    assert "above rule (peer)" in stdout


@pytest.mark.parametrize("runs_out_at", [5, 3], ids=["larger-size", "first-size"])
def test_rule_provider_out_of_memory_borrows_a_smaller_sizes_limits(runs_out_at, tmp_path, monkeypatch, capsys,
                                                                     bench):
    """The rule provider (here eager) runs out of memory at one size: where it ran at a smaller size of the run, its
    errors there set the limits, ours are still checked against the float64 reference, and the row says which size the
    limits come from; where it never ran, the case fails as before. A wrong provider still fails the borrowed rule."""
    spec = _toy_spec(bench, "toy")

    def eager(scale=2.0):
        def run(x):
            if x.shape[0] == runs_out_at:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return scale * x
        return run

    wrong = bench.Provider("ours_off", lambda: (lambda x: 2.5 * x), "ours, wrong", ours=True)
    providers = tuple(bench.Provider("eager", eager) if p.name == "eager" else p for p in spec.providers
                      if p.name in ("ours", "eager")) + (wrong,)
    monkeypatch.setitem(bench.KERNELS, "toy", dataclasses.replace(spec, tokens_cpu=(3, 5), tokens_gpu=(3, 5),
                                                                  providers=providers))
    out = tmp_path / "bench_{kernel}.json"
    code = bench.main(["--kernel", "toy", "--width", "6", "--out", str(out), *IN_PROCESS_QUICK])
    stdout = capsys.readouterr().out
    rows = [row for row in json.loads((tmp_path / "bench_toy.json").read_text())["rows"] if row["tokens"] == 5]
    ours = next(row for row in rows if row["provider"] == "ours")
    assert code == 1 and "ours_off" in stdout  # the wrong provider fails at every size
    if runs_out_at == 5:
        assert ours["check"] == "pass" and ours["error_baseline_tokens"] == 3
        assert next(row for row in rows if row["provider"] == "ours_off")["check"] == "FAIL"
        assert "eager out of memory here: the limits come from its errors at N=3" in stdout
    else:  # out of memory at the first size only: the larger size measures its own rule
        assert ours["check"] == "pass" and "error_baseline_tokens" not in ours
        assert "failed: reference/eager: OutOfMemoryError" in stdout


@pytest.mark.parametrize("flags, expected", [
    (["--tokens", "-4"], "argument --tokens: must be above 0, got -4"),
    (["--tokens", "0"], "argument --tokens: must be above 0, got 0"),
    (["--hidden", "-8"], "argument --hidden: must be above 0, got -8"),
    (["--hidden", "0"], "argument --hidden: must be above 0, got 0"),
    (["--chunk-sizes", "0"], "argument --chunk-sizes: must be above 0, got 0"),
    (["--copy-gib", "-1"], "argument --copy-gib: must be above 0, got -1"),
    (["--rep-ms", "-1"], "argument --rep-ms: must be above 0, got -1"),
    (["--warmup-ms", "nan"], "argument --warmup-ms: must be above 0, got nan"),
    (["--kernel", "rmsnorm", "--providers", "liger_softcap"],
     "--providers liger_softcap: not a provider of --kernel rmsnorm. The providers at --dtype bf16: rmsnorm: ours, "
     "eager, torch_compile, liger"),
    (["--kernel", "rmsnorm", "swiglu", "--providers", "ours_softcap"], "not a provider of --kernel rmsnorm swiglu"),
    (["--kernel", "rmsnorm", "linear_cross_entropy", "--providers", "cce"],
     "--providers cce: none is a provider of rmsnorm, which would time nothing"),
    (["--kernel", "rmsnorm", "--chunk-sizes", "256"], "--chunk-sizes times linear_cross_entropy"),
    (["--out", "{tmp}"], "is a directory: give the path of the JSON file to write"),
    (["--kernel", "rmsnorm", "swiglu", "--out", "{tmp}/{kernel}"], "swiglu is a directory"),
], ids=["tokens-negative", "tokens-0", "hidden-negative", "hidden-0", "chunk-sizes-0", "copy-gib-negative",
        "rep-ms-negative", "warmup-ms-nan", "provider-of-another-kernel", "provider-of-no-chosen-kernel",
        "kernel-without-provider", "chunk-sizes-without-its-kernel", "out-directory", "out-kernel-directory"])
def test_bad_options_are_one_error_line_before_the_run(flags, expected, tmp_path, capsys, bench):
    """Sizes, times and providers that would time nothing, or fail inside the run as if a kernel had failed (or, for
    an --out directory, after the first kernel), are refused by the parser: one line, exit code 2."""
    (tmp_path / "swiglu").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args([flag.format(tmp=tmp_path, kernel="{kernel}") for flag in flags])
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err.strip().splitlines()[-1]


def test_legend_says_mib(bench):
    """Peak memory is peak bytes / 2**20: the legend calls it MiB, as the table's column does."""
    for kernel in bench.KERNELS:
        text = bench.legend(kernel, "")
        assert "peak MiB" in text and "peak MB" not in text, kernel
