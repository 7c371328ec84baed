"""Every bad input a user tried ends with one clear error line, a non-zero exit code, and nothing written.

Each case runs a script as a user would (a subprocess, tiny LLaMA, CPU) and passes when: the exit code is not 0,
stderr holds no Python traceback, its last line is the error and contains the reference wording of the case, and no
output exists afterwards (no results JSON; no trace, no summary in the trace folder). The bad data sets are written
by the tests: an empty .txt, a .jsonl without a "text" field, a Latin-1 (not UTF-8) .txt, a .jsonl with a null text,
a file of an unknown type; --compare gets a missing file, a file that is not JSON, a trace instead of a summary, and
a CPU summary against a GPU one. Bad options are refused before the run starts: a learning rate that is not a positive
finite number, an attention implementation transformers does not have (or cannot use here), an output path that is a
directory (a trace folder that is a file), LoRA flags that make no adapters (--lora 0, a dropout of 1, --qlora or
--merge without what they need, --qlora with --fsdp or --fp8). A --lora-targets name the model lacks is refused once
the model is loaded, naming the Linears it has. (--resume with adapters of another base: test_lora.py.)
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
FINETUNE = ["finetune_baseline.py", "finetune_optimized.py"]


def write_bad_data(folder):
    folder.mkdir(exist_ok=True)
    files = {"empty.txt": b"", "blank.txt": b"  \n\n \n",
             "notext.jsonl": b'{"content": "hello"}\n{"content": "world"}\n',
             "latin1.txt": "caf\u00e9 au lait\n".encode("latin-1"),
             "nulltext.jsonl": b'{"text": "fine"}\n{"text": null}\n',
             "notes.xyz": b"some text",
             "chat-not-turns.jsonl": b'{"messages": "hello"}\n',
             "chat-no-answer.jsonl": b'{"messages": [{"role": "user", "content": "hi"}]}\n',
             "chat.jsonl": b'{"messages": [{"role": "user", "content": "hi"}, '
                           b'{"role": "assistant", "content": "yo"}]}\n',
             "broken-template.jinja": b"{% for message in messages %}{{ message['content'] }}",
             "prompt-mixed.jsonl": b'{"prompt": "hi", "completion": [{"role": "assistant", "content": "yo"}]}\n'}
    for name, content in files.items():
        (folder / name).write_bytes(content)
    return folder


def run_failing(cmd, tmp_path, expected):
    """Runs cmd, checks the failure is one clear line; returns stderr."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, *cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines and expected in lines[-1], proc.stderr[-3000:]
    return proc.stderr


# (flags, the reference wording of the error line); {data} is the folder of write_bad_data
FINETUNE_CASES = {
    "seq-len-1": (["--seq-len", "1"], "--seq-len must be at least 2"),
    "model-nonexistent": (["--model", "/nonexistent"], "error: --model /nonexistent: no such directory"),
    # a mistyped path whose last part names a built-in config is still an error, not that config's random weights
    "model-path-typo": (["--model", "/nonexistent/tiny"], "error: --model /nonexistent/tiny: no such directory"),
    "data-empty": (["--data", "{data}/empty.txt"], "empty.txt: contains no text"),
    "data-no-text-field": (["--data", "{data}/notext.jsonl"], "notext.jsonl: no field 'text' (its fields: content)"),
    "data-not-utf8": (["--data", "{data}/latin1.txt"], "latin1.txt: not UTF-8 text (byte 0xe9"),
    "lr-0": (["--lr", "0"], "--lr must be a positive finite number, got 0.0"),
    "lr-nan": (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    "lr-inf": (["--lr", "inf"], "--lr must be a positive finite number, got inf"),
    "attn-unknown": (["--attn-implementation", "flash"], "argument --attn-implementation: invalid choice: 'flash'"),
    # a directory as --out: refused before the run, not found out when the results are written at its end
    "out-directory": (["--out", "{data}"], "data is a directory: give the path of the file to write"),
    "resume-without-checkpoint": (["--output-dir", "{data}", "--resume"], "--resume: no complete checkpoint in"),
    "save-without-output-dir": (["--save-steps", "2"], "--save-steps and --resume need --output-dir"),
    "eval-split-of-synthetic": (["--eval-split", "0.1"], "--eval-split takes a fraction between 0 and 1 of --data"),
    "lora-0": (["--lora", "0"], "--lora takes the adapters' rank, a positive integer, got 0"),
    "lora-dropout-1": (["--lora", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1), got 1.0"),
    # a name peft would not find: the error lists the Linears the model has
    "lora-unknown-target": (["--lora", "4", "--lora-targets", "q_proj", "query"],
                            "error: --lora-targets query: no such Linear in llama's decoder layers; its Linears: "
                            "down_proj gate_proj k_proj o_proj q_proj up_proj v_proj"),
    "qlora-without-lora": (["--qlora"], "--qlora goes with --lora R"),
    "merge-without-output-dir": (["--lora", "4", "--merge"], "--merge writes DIR/final-merged: it needs --output-dir"),
    "qlora-fsdp": (["--lora", "4", "--qlora", "--fsdp"], "--qlora cannot be combined with --fsdp"),
}
# Code shared by both scripts (checked identical in test_finetune.py): these run on the baseline only.
BASELINE_CASES = {
    "seq-len-search-1": (["--seq-len-search", "1,8"], "--seq-len-search lengths must be at least 2"),
    "data-only-whitespace": (["--data", "{data}/blank.txt"], "blank.txt: contains no text"),
    "data-null-text": (["--data", "{data}/nulltext.jsonl"], "row 1: field 'text' holds None, not text"),
    "data-missing-file": (["--data", "{data}/missing.jsonl"], "missing.jsonl: no such file or folder"),
    "data-unknown-type": (["--data", "{data}/notes.xyz"], "notes.xyz: unknown file type .xyz"),
    # a Hub data set is read from the cache only: the error says how to fetch it
    "data-hub-not-cached": (["--data", "no-such-org/no-such-set"], "; --allow-download fetches it from the Hub"),
    "text-field-missing": (["--data", "{data}/notext.jsonl", "--text-field", "body"], "no field 'body'"),
    "attn-package-missing": (["--attn-implementation", "flash_attention_2"],
                             "error: --attn-implementation flash_attention_2: FlashAttention2 has been toggled on"),
    "flex-attention-on-cpu": (["--attn-implementation", "flex_attention"],
                              "--attn-implementation flex_attention needs a GPU"),
    "torch-varlen-on-cpu": (["--attn-implementation", "torch_varlen"],
                            "--attn-implementation torch_varlen needs a GPU"),
    # conversations: rows that are not turns, no answer anywhere, a template that does not render, the wrong format
    "chat-not-turns": (["--data", "{data}/chat-not-turns.jsonl"], "row 0: 'messages' must be a list of turns like"),
    "chat-no-answer": (["--data", "{data}/chat-no-answer.jsonl"],
                       "no row has an assistant turn within 32 tokens to train on (1 read)"),
    "chat-template-broken": (["--data", "{data}/chat.jsonl", "--chat-template", "{data}/broken-template.jinja"],
                             "row 0: the chat template does not render it: "),
    "chat-template-missing": (["--data", "{data}/chat.jsonl", "--chat-template", "{data}/missing.jinja"],
                              "error: --chat-template "),
    "chat-format-of-text": (["--data", "{data}/nulltext.jsonl", "--data-format", "chat"],
                            "no field 'messages' (its fields: text) in row 0"),
    "prompt-completion-mixed": (["--data", "{data}/prompt-mixed.jsonl"],
                                "'prompt' and 'completion' must both be text or both lists of turns"),
}
# What only the optimized script has: a captured step replays one shape; a compiled step with sdpa keeps the causal
# mask a flag, which packed conversations cannot use.
OPTIMIZED_CASES = {
    "cuda-graph-of-conversations": (["--data", "{data}/chat.jsonl", "--cuda-graph"],
                                    "error: --cuda-graph replays one step of one shape with no host work"),
    "compile-sdpa-of-packed": (["--data", "{data}/chat.jsonl", "--compile"],
                               "error: --compile with sdpa keeps the causal mask a flag"),
}
# Options of finetune_optimized.py alone.
OPTIMIZED_CASES = {
    "qlora-fp8": (["--lora", "4", "--qlora", "--fp8", "rowwise"], "--fp8 cannot be combined with --lora or --qlora"),
}
# Every data set is read through the datasets package.
NEEDS_DATASETS = {"data-empty", "data-no-text-field", "data-not-utf8", "data-only-whitespace", "data-null-text",
                  "data-missing-file", "data-unknown-type", "data-hub-not-cached", "text-field-missing",
                  "chat-not-turns", "chat-no-answer", "chat-template-broken", "chat-template-missing",
                  "chat-format-of-text", "prompt-completion-mixed", "cuda-graph-of-conversations",
                  "compile-sdpa-of-packed"}


@pytest.mark.parametrize("script, case", [(script, case) for script in FINETUNE for case in FINETUNE_CASES]
                         + [("finetune_baseline.py", case) for case in BASELINE_CASES]
                         + [("finetune_optimized.py", case) for case in OPTIMIZED_CASES])
def test_finetune_bad_input(script, case, tmp_path):
    if case in NEEDS_DATASETS:
        pytest.importorskip("datasets")
    if case == "attn-package-missing" and importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed")
    if case in ("flex-attention-on-cpu", "torch-varlen-on-cpu") and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    flags, expected = {**FINETUNE_CASES, **BASELINE_CASES, **OPTIMIZED_CASES}[case]
    data = write_bad_data(tmp_path / "data")
    out = tmp_path / "out.json"
    flags = [flag.format(data=data) for flag in flags]
    run_failing([str(ROOT / script), "--model", "tiny", "--steps", "1", "--out", str(out), *flags], tmp_path,
                expected)
    assert not out.exists()


def run_profile_failing(tmp_path, flags, expected):
    traces = tmp_path / "traces"
    summary = tmp_path / "summary.json"
    run_failing([str(ROOT / "profile_baseline.py"), "--trace-dir", str(traces), "--summary-out", str(summary),
                 *flags], tmp_path, expected)
    assert not summary.exists() and not (traces.exists() and any(traces.rglob("*")))


@pytest.mark.parametrize("flags, expected", [
    (["--model", "tiny", "--seq-len", "1"], "--seq-len must be at least 2"),
    (["--model", "/nonexistent"], "error: --model /nonexistent: no such directory"),
    (["--model", "./nonexistent/tiny"], "error: --model ./nonexistent/tiny: no such directory"),
    (["--lr", "0"], "--lr must be a positive finite number, got 0.0"),
    (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    (["--attn-implementation", "flash"], "argument --attn-implementation: invalid choice: 'flash'"),
    (["--summary-out", "{tmp}"], "is a directory: give the path of the JSON file to write"),
    (["--trace-dir", "{tmp}/file.txt"], "file.txt is a file: give a folder"),
], ids=["seq-len-1", "model-nonexistent", "model-path-typo", "lr-0", "lr-nan", "attn-unknown", "summary-out-directory",
        "trace-dir-file"])
def test_profile_bad_input(flags, expected, tmp_path):
    (tmp_path / "file.txt").write_text("not a folder")
    run_profile_failing(tmp_path, [flag.format(tmp=tmp_path) for flag in flags], expected)


def summary_like(time_unit):
    categories = ["matmul", "attention", "RMSNorm", "SwiGLU", "loss", "optimizer", "memory copies", "other elementwise"]
    return {"categories": {cat: {"ms": 1.0, "pct": 12.5} for cat in categories}, "step_ms": 8.0,
            "time_unit": time_unit, "variant": "baseline", "shape": "1x32", "weights": "random"}


@pytest.mark.parametrize("case, expected", [
    ("missing", "missing.json: no such file"),
    ("not-json", "not-json.json: not a JSON file"),
    ("trace", "trace.json: a trace; its summary is the .summary.json beside it"),
    ("other-json", "other-json.json: JSON, but not a summary written by profile_baseline.py"),
    ("units", "is in CPU self ms"),
])
def test_compare_bad_input(case, expected, tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(summary_like("CPU self ms")))
    bad = tmp_path / f"{case}.json"
    content = {"missing": None, "not-json": "step_ms: 8\n", "trace": json.dumps({"traceEvents": []}),
               "other-json": json.dumps({"step_ms": 8.0}), "units": json.dumps(summary_like("device ms"))}[case]
    if content is not None:
        bad.write_text(content)
    run_profile_failing(tmp_path, ["--compare", str(good), str(bad)], expected)
