"""Every script at the repository root answers --help (and exits 0) without running its job; the scripts' option
help wraps at 80 columns without cutting a word; no two modules at the root import each other, directly or round a
longer circle."""
import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = ["profile_baseline.py", "rmsnorm_kernel.py", "rmsnorm_test.py", "cross_entropy_kernel.py",
           "cross_entropy_test.py", "swiglu_kernel.py", "swiglu_test.py", "rope_kernel.py", "rope_test.py",
           "benchmark_kernels.py", "finetune_baseline.py", "finetune_optimized.py", "linear_cross_entropy_kernel.py",
           "float8_training.py", "memory_plan.py", "make_conversations.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    result = subprocess.run([sys.executable, script, "--help"], cwd=REPO, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"usage: {script}" in result.stdout
    # The test scripts' help is their docstring: how a check passes, not a bare usage line; a kernel file's help is
    # its docstring too: what the kernel computes.
    if script.endswith("_test.py"):
        assert "reference" in result.stdout.lower()
    if script.endswith("_kernel.py"):
        assert "What it computes" in result.stdout


@pytest.mark.parametrize("module_name", ["profile_baseline", "benchmark_kernels", "finetune_baseline",
                                         "finetune_optimized", "memory_plan"])
def test_help_wraps_between_words(module_name, monkeypatch, capsys):
    """argparse wraps each option's help to the terminal's width (COLUMNS) and cuts a word longer than the help column
    in two (a file-name pattern once read "<mode l>"): at 80 columns the help must hold the same words as unwrapped.
    In-process: the modules are imported once, not started twice per width."""
    monkeypatch.syspath_prepend(str(REPO))
    module = importlib.import_module(module_name)

    def words(columns):
        monkeypatch.setenv("COLUMNS", str(columns))
        with pytest.raises(SystemExit):
            module.parse_args(["--help"])
        return re.sub(r"-\s+", "-", capsys.readouterr().out).split()  # a break after a hyphen is no cut word
    assert words(80) == words(1000)


def test_no_circle_of_imports():
    """The root modules' imports (at any depth of the file: a function's lazy import counts too) form no cycle."""
    modules = {path.stem for path in REPO.glob("*.py")}
    imports = {}
    for name in modules:
        tree = ast.parse((REPO / f"{name}.py").read_text())
        found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        found |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imports[name] = found & modules - {name}
    done, path = set(), []

    def visit(name):  # depth-first: a module met again on the current path closes a circle
        assert name not in path, f"import circle: {' -> '.join(path[path.index(name):] + [name])}"
        if name in done:
            return
        path.append(name)
        for imported in sorted(imports[name]):
            visit(imported)
        path.pop()
        done.add(name)
    for name in sorted(modules):
        visit(name)
    assert imports["finetune_baseline"] == set()  # the baseline is stock PyTorch + transformers: none of ours
