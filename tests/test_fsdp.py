"""--fsdp of finetune_baseline.py and finetune_optimized.py: two processes (gloo, CPU, fp32, Triton interpreter) on the
tiny LLaMA against one process on the same global data. Both launchers start them: torchrun, and accelerate launch
(--multi_gpu, which runs torch's own launcher underneath, so the script sees the same environment variables).

With --fsdp each rank trains rows rank::world_size of the global batches that one process with --batch-size
world_size x batch_size trains on; every row has the same number of labelled tokens, so the mean of the ranks' losses
is the single process's loss, and FSDP's averaged gradients are its gradients. The logged losses (warm-up + 3 steps at
lr 1e-3) must agree within rtol 1e-4. Why that tolerance: everything is fp32 and the runs differ only in summation order
(a reduce-scatter instead of one batched matmul sum, per-rank means averaged): measured ~1e-7 relative; 1e-4 leaves a
1000x margin. A real defect is far outside it (measured): logging rank 0's loss instead of the mean, or both ranks
training the same rows, moves the losses by 4e-3 to 2e-1 (>= 6x the tolerance); the loss falls by > 0.1 in 3 steps.
The same holds for --lora (the adapters sharded beside their frozen layers), whose adapters rank 0 saves in DIR/final.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import finetune_optimized  # noqa: E402  (first: the kernel modules must set up Triton before transformers loads it)
import finetune_baseline  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 30
WORLD_SIZE = 2
LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD_SIZE)],
    # --main_process_port 0: a free port, like torchrun's --standalone
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                   "--num_processes", str(WORLD_SIZE), "--num_machines", "1", "--mixed_precision", "no",
                   "--dynamo_backend", "no", "--main_process_port", "0"],
}


def run(launcher, script, out, *flags):
    # CPU on every machine (no GPU visible): gloo ranks, the kernels on the Triton interpreter.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [*launcher, str(ROOT / script), "--model", "tiny", "--steps", "4", "--seq-len", "16", "--lr", "1e-3",
           "--out", str(out), *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("script, launcher, lora", [("finetune_optimized.py", "torchrun", False),
                                                    ("finetune_baseline.py", "torchrun", False),
                                                    ("finetune_baseline.py", "accelerate", False),
                                                    ("finetune_optimized.py", "torchrun", True)])
def test_fsdp_two_ranks_match_one_process(script, launcher, lora, tmp_path):
    if launcher == "accelerate":
        pytest.importorskip("accelerate")
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    # LoRA: the adapters sharded with their frozen layers, at a rate that moves the loss as far in 4 steps; the
    # adapters gathered to rank 0 for DIR/final
    extra = ["--lora", "4", "--lr", "1e-2"] if lora else []
    sharded, stdout = run(LAUNCHERS[launcher], script, tmp_path / "fsdp.json", "--fsdp", "--data", str(data), *extra,
                          *(["--output-dir", str(tmp_path / "lora")] if lora else []))
    single, _ = run([sys.executable], script, tmp_path / "single.json", "--data", str(data),
                    "--batch-size", str(WORLD_SIZE), *extra)
    if lora:
        assert sharded["lora"]["trainable_params"] == single["lora"]["trainable_params"] > 0
        assert (tmp_path / "lora" / "final" / "adapter_model.safetensors").is_file()

    assert stdout.count("---- summary") == 1  # rank 0 alone prints
    assert sharded["world_size"] == WORLD_SIZE and single["world_size"] == 1
    assert sharded["tokens_per_step"] == single["tokens_per_step"] == WORLD_SIZE * 16
    assert len(sharded["peak_memory_gib_per_rank"]) == WORLD_SIZE

    sharded_losses, single_losses = sharded["losses"], single["losses"]
    assert single_losses[0] - single_losses[-1] > 0.1  # the run really trains: parity is not a flat line
    assert sharded_losses == pytest.approx(single_losses, rel=1e-4)


@pytest.mark.parametrize("module", [finetune_baseline, finetune_optimized])
def test_fsdp_bad_combinations_are_clear_errors(module, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        module.parse_args(["--fsdp"])
    err = capsys.readouterr().err
    assert "--fsdp needs a distributed launcher" in err and "torchrun" in err and "accelerate launch" in err

    monkeypatch.setenv("WORLD_SIZE", "2")
    combos = [["--seq-len-search", "8,16"]] + ([["--compile"], ["--liger"]] if module is finetune_baseline else [])
    for flags in combos:
        with pytest.raises(SystemExit):
            module.parse_args(["--fsdp", *flags])
        assert f"--fsdp cannot be combined with {flags[0]}" in capsys.readouterr().err
    if module is finetune_optimized:  # FSDP2 reduces the gradients after the backward: none to step on arrival
        with pytest.raises(SystemExit):
            module.parse_args(["--fsdp", "--optimizer-in-backward"])
        assert "--optimizer-in-backward cannot be combined with --fsdp" in capsys.readouterr().err


@pytest.mark.parametrize("module", [finetune_baseline, finetune_optimized])
def test_fsdp_run_ends_after_the_barrier_the_group_and_the_flush(module, monkeypatch):
    """An --fsdp run ends with os._exit (see end_distributed_run): the order is what keeps it safe. No rank leaves the
    group before every rank passes the barrier, and the output is flushed before os._exit, which skips the flush of
    the interpreter's shutdown (rank 0's summary would be lost in a pipe)."""
    calls = []

    class Ended(Exception):
        pass

    class Stream:
        def __init__(self, name):
            self.name = name

        def flush(self):
            calls.append(f"flush {self.name}")

    def exit_(code):
        calls.append(f"exit {code}")
        raise Ended

    monkeypatch.setattr(module.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(module.dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(sys, "stdout", Stream("stdout"))
    monkeypatch.setattr(sys, "stderr", Stream("stderr"))
    monkeypatch.setattr(os, "_exit", exit_)
    with pytest.raises(Ended):
        module.end_distributed_run()
    assert calls == ["barrier", "destroy", "flush stdout", "flush stderr", "exit 0"]


def test_fsdp_weighs_every_target_token_once_on_conversations(tmp_path):
    """Chat rows, one per rank and step (--packing off), whose answers differ in length: the ranks hold different
    numbers of targets, so only a step loss normalised by the count over both ranks (all-reduced) gives the single
    process's token-weighted loss; averaging the ranks' own means would miss it by several percent."""
    data = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": "q" * (index % 3 + 1)},
                          {"role": "assistant", "content": "a" * (3 + 9 * (index % 2))}]} for index in range(8)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = ["--data", str(data), "--packing", "off", "--seq-len", "64"]  # the longest conversation: 54 tokens
    sharded, _ = run(LAUNCHERS["torchrun"], "finetune_baseline.py", tmp_path / "fsdp.json", "--fsdp", *flags)
    single, _ = run([sys.executable], "finetune_baseline.py", tmp_path / "single.json", *flags,
                    "--batch-size", str(WORLD_SIZE))
    assert sharded["real_tokens_per_step"] == single["real_tokens_per_step"]
    assert single["losses"][0] - single["losses"][-1] > 0.1
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-4)
    assert sharded["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-4)
