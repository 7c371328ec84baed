"""A fine-tune you can keep: checkpoints, resume, the saved model, held-out evaluation, the schedule (tiny LLaMA, fp32,
CPU; both fine-tune scripts share this code as parallel text but for the checkpoint write, which is synchronous in the
baseline and in the background in ours, so most tests run the baseline, the faster of the two on the interpreter).

- A run killed with SIGKILL after a checkpoint resumes (--resume) to the same per-step losses and held-out losses as an
  uninterrupted run, bit for bit on the CPU (same data order: the batches are a function of the arguments).
- A run killed with SIGKILL while it writes a checkpoint (either script's writer) leaves the earlier checkpoint whole,
  and resumes from it.
- The final model (DIR/final) loads with AutoModelForCausalLM.from_pretrained and gives the run's last held-out loss.
- The optimizer state written with the optimizer in the backward (one AdamW per parameter) or offloaded to the host
  loads into a plain AdamW run, and the reverse: one layout, keyed by parameter name.
- Bad input: a checkpoint of another model, of another world size, a full disk: one line each, nothing lost.
"""
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import finetune_optimized  # noqa: E402  (first: the kernel modules must set up Triton before transformers loads it)
import finetune_baseline  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
TEXT = "def checkpoint(step):\n    return {'step': step, 'loss': 0.5 * step}\n" * 200


def command(script, data, output_dir, *flags, steps=6):
    return [sys.executable, str(ROOT / script), "--model", "tiny", "--dtype", "fp32", "--steps", str(steps),
            "--seq-len", "32", "--lr", "1e-3", "--data", str(data), "--eval-split", "0.1", "--eval-steps", "2",
            "--eval-batches", "2", "--lr-scheduler", "cosine", "--warmup-steps", "1", "--output-dir", str(output_dir),
            *flags]


def run(cmd):
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def results(output_dir):
    return json.loads((Path(output_dir) / "results.json").read_text())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "code.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    run(command("finetune_baseline.py", data, output_dir))
    return results(output_dir), output_dir


# Runs of finetune_optimized.py about what does not depend on the kernels (the optimizer's arrangement, the background
# checkpoint write) take the stock model (kernels off), the fastest path on the Triton interpreter. Clipping is off:
# with the optimizer in the backward it uses the previous step's norm, a different (documented) rule than the plain
# step's.
STOCK_PATH = ["--memory-plan", "manual", "--max-grad-norm", "0", "--no-rmsnorm", "--no-swiglu", "--no-rope", "--loss",
              "eager"]


def kill_when(proc, condition, timeout=300):
    """SIGKILL proc as soon as condition() holds (polled every 20 ms)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "timed out waiting to kill the run"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def test_uninterrupted_run_writes_model_results_and_keeps_the_limit(uninterrupted):
    result, output_dir = uninterrupted
    assert [c["step"] for c in result["checkpoints"]] == [] and result["final_model"] == str(output_dir / "final")
    assert [e["step"] for e in result["evals"]] == [2, 4, 6]
    assert len(result["losses"]) == 6 and result["losses"][-1] < result["losses"][0] - 0.1  # it learns the text
    assert (output_dir / "final" / "model.safetensors").is_file() and (output_dir / "final" / "config.json").is_file()


def test_resume_after_sigkill_gives_the_uninterrupted_losses(data, uninterrupted, tmp_path):
    reference, _ = uninterrupted
    cmd = command("finetune_baseline.py", data, tmp_path, "--save-steps", "2", "--save-total-limit", "2")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_when(proc, lambda: (tmp_path / "checkpoint-2").is_dir())
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "final").exists()
    run([*cmd, "--resume"])
    resumed = results(tmp_path)
    assert resumed["start_step"] >= 2
    first = resumed["start_step"]  # the checkpoint it resumed from: 2, or 4 if the kill came late
    assert resumed["losses"] == reference["losses"][first:]  # bit for bit on the CPU
    assert resumed["evals"] == [e for e in reference["evals"] if e["step"] > first]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]  # the limit: 2


@pytest.mark.parametrize("script, writer", [("finetune_baseline.py", "save"), ("finetune_optimized.py", "async_save")])
def test_sigkill_while_writing_keeps_the_earlier_checkpoint(data, uninterrupted, tmp_path, script, writer):
    """The run is killed inside torch.distributed.checkpoint's writer of step 4 (the baseline's dcp.save, our
    background async_save), after it has written part of it: the partial folder never takes the checkpoint's name,
    checkpoint-2 stays loadable, --resume continues from it (to the uninterrupted losses: the baseline's reference)."""
    reference, _ = uninterrupted
    killer = ("import os, signal, sys; sys.argv[0] = {script!r}; sys.path.insert(0, {root!r}); import {module} "
              "as script; save = script.dcp.{writer}\n"
              "def dying_save(state, checkpoint_id, **options):\n"
              "    if str(checkpoint_id).endswith('-4'):\n"
              "        os.makedirs(checkpoint_id, exist_ok=True)\n"
              "        open(os.path.join(checkpoint_id, 'half'), 'w').write('x')\n"
              "        os.kill(os.getpid(), signal.SIGKILL)\n"
              "    return save(state, checkpoint_id=checkpoint_id, **options)\n"
              "script.dcp.{writer} = dying_save; script.main(sys.argv[1:])")
    flags = STOCK_PATH if script == "finetune_optimized.py" else []
    cmd = command(script, data, tmp_path, "--save-steps", "2", *flags)
    code = killer.format(script=cmd[1], root=str(ROOT), module=Path(script).stem, writer=writer)
    proc = subprocess.run([sys.executable, "-c", code, *cmd[2:]], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert finetune_baseline.checkpoints(tmp_path) == [tmp_path / "checkpoint-2"]
    assert (tmp_path / ".partial-checkpoint-4" / "half").is_file()
    run([*cmd, "--resume"])
    resumed = results(tmp_path)
    assert resumed["start_step"] == 2 and len(resumed["losses"]) == 4
    if script == "finetune_baseline.py":
        assert resumed["losses"] == reference["losses"][2:]
    assert not (tmp_path / ".partial-checkpoint-4").exists()  # rewritten whole, then renamed


def test_final_model_reloads_and_gives_the_last_held_out_loss(uninterrupted):
    from transformers import AutoModelForCausalLM
    result, output_dir = uninterrupted
    model = AutoModelForCausalLM.from_pretrained(output_dir / "final", dtype=torch.float32)
    args = finetune_baseline.parse_args(result["command"][2:])
    batches = finetune_baseline.make_batches(args, "eval", model.config.vocab_size, model.config.eos_token_id, None,
                                             "cpu")
    loss, _ = finetune_baseline.evaluate(finetune_baseline.ModelWithLoss(model, "eager"), batches["steps"], 1,
                                         documents=False)
    assert loss == pytest.approx(result["evals"][-1]["loss"], rel=1e-6)


@pytest.fixture(scope="module")
def plain_losses(data, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("plain")
    run(command("finetune_optimized.py", data, output_dir, *STOCK_PATH, "--no-optimizer-in-backward", steps=3))
    return results(output_dir)["losses"]


@pytest.mark.parametrize("written,resumed", [(["--optimizer-in-backward"], ["--no-optimizer-in-backward"]),
                                             (["--offload-optimizer"], ["--no-optimizer-in-backward"]),
                                             (["--no-optimizer-in-backward"], ["--optimizer-in-backward"])],
                         ids=["in-backward->plain", "offloaded->plain", "plain->in-backward"])
def test_optimizer_state_has_one_layout(data, plain_losses, tmp_path, written, resumed):
    """A checkpoint written by one optimizer arrangement resumes under another to the plain run's losses."""
    run([*command("finetune_optimized.py", data, tmp_path, *STOCK_PATH, "--save-steps", "2", steps=2), *written])
    run([*command("finetune_optimized.py", data, tmp_path, *STOCK_PATH, "--save-steps", "2", steps=3), *resumed,
         "--resume"])
    assert results(tmp_path)["losses"] == pytest.approx(plain_losses[2:], rel=1e-6)


def test_resume_refuses_another_model_or_world_size(data, uninterrupted, tmp_path):
    run(command("finetune_baseline.py", data, tmp_path, "--save-steps", "2", steps=2))
    args = finetune_baseline.parse_args(["--model", "tiny", "--output-dir", str(tmp_path), "--resume"])
    config = finetune_baseline.builtin_config("tiny")
    config.hidden_size, config.intermediate_size = 96, 160  # another model: other shapes
    model = finetune_baseline.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizers = [torch.optim.AdamW(model.parameters())]
    with pytest.raises(SystemExit, match=r"^error: --resume: .*checkpoint-2 \(written for tiny\) does not fit this "
                                         r"model: ") as exit_info:
        finetune_baseline.resume(args, model, optimizers, [], 1)
    assert "\n" not in str(exit_info.value)
    state_path = tmp_path / "checkpoint-2" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=False)
    state["world_size"] = 2
    torch.save(state, state_path)
    with pytest.raises(SystemExit, match="was written by 2 ranks, this run has 1; resume with the same number"):
        finetune_baseline.resume(args, model, optimizers, [], 1)


def test_resume_without_a_checkpoint_and_a_full_disk_are_one_line(tmp_path, monkeypatch, capsys):
    for module in (finetune_baseline, finetune_optimized):
        with pytest.raises(SystemExit):
            module.parse_args(["--output-dir", str(tmp_path), "--resume"])
        assert "--resume: no complete checkpoint in" in capsys.readouterr().err
    (tmp_path / "checkpoint-1").mkdir()  # an earlier checkpoint: must survive
    model = finetune_baseline.AutoModelForCausalLM.from_config(finetune_baseline.builtin_config("tiny"))
    args = finetune_baseline.parse_args(["--model", "tiny", "--output-dir", str(tmp_path), "--save-steps", "1"])
    monkeypatch.setattr(finetune_baseline.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=1024))
    with pytest.raises(SystemExit, match=r"^error: checkpoint-2 needs 0\.\d+ GiB and .* has 0\.0 GiB free; the "
                                         r"earlier checkpoints are kept$"):
        finetune_baseline.save_checkpoint(args, 2, model, [torch.optim.AdamW(model.parameters())], [], 0, 1)
    assert (tmp_path / "checkpoint-1").is_dir() and not (tmp_path / ".partial-checkpoint-2").exists()


def test_tensorboard_scalars(data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run(command("finetune_baseline.py", data, tmp_path / "run", "--tensorboard", str(tmp_path / "tb"), steps=4))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/grad_norm", "eval/loss", "eval/token_accuracy"} <= set(tags)
    lrs = [event.value for event in events.Scalars("train/lr")]
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(0.0, abs=1e-9)  # cosine: warm-up 1, then to 0
    assert [event.step for event in events.Scalars("eval/loss")] == [2, 4]


def test_checkpoint_staging_pins_only_what_the_host_has_room_for():
    """Our background checkpoint stages into pinned host buffers where the host has room (a fifth to spare), else
    into pageable memory like async_save's own stager; without CUDA nothing can be pinned."""
    available = finetune_optimized.host_memory_available()
    assert available > 0  # Linux: /proc/meminfo
    assert not finetune_optimized.checkpoint_stager(10 * available).pinned
    assert finetune_optimized.checkpoint_stager(2**20).pinned == torch.cuda.is_available()


def test_pageable_staging_copies_every_checkpoint_afresh():
    """Without room to pin, each checkpoint gets its own host copy of the values at its step, as async_save's own
    stager gives; the stager stays usable for the next checkpoint (torch 2.11's DefaultStager does not)."""
    stager = finetune_optimized.CheckpointStager(pinned=False)
    state = {"w": torch.randn(64, 32), "step": 3}
    first = stager.stage(state)
    state["w"].mul_(2)
    second = stager.stage(state)
    assert torch.equal(first["w"] * 2, second["w"]) and torch.equal(second["w"], state["w"])
    assert second["w"].data_ptr() not in (first["w"].data_ptr(), state["w"].data_ptr()) and second["step"] == 3
    stager.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a CUDA GPU")
def test_pinned_staging_reuses_its_buffers_and_copies_the_values():
    state = {"w": torch.randn(1024, 1024, device="cuda"), "m": torch.randn(4096, device="cuda")}
    stager = finetune_optimized.checkpoint_stager(2**20)
    assert stager.pinned
    first = stager.stage(state)
    state["w"].mul_(2)  # the next checkpoint's values
    second = stager.stage(state)
    assert second["w"].is_pinned() and second["w"].data_ptr() == first["w"].data_ptr()  # the same host buffer
    assert torch.equal(second["w"], state["w"].cpu()) and torch.equal(second["m"], state["m"].cpu())
    stager.close()
