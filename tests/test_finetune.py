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
- The seq-len search reports the longest length that trained (its out-of-memory handling: test_memory_levers.py);
  without a GPU its peak memory is null and printed "n/a (CPU)", as the training summary does.
- --data reads each way datasets users keep a data set (save_to_disk folders, json/jsonl/parquet/csv/text files, a
  folder of data files), written by the test: the token stream must equal the reference, the UTF-8 bytes of every
  row's --text-field with EOS after each and empty rows skipped.
- A model saved with save_pretrained loads from its folder as "real weights", placed with device_map, bit-identical.
  A --model path that starts with ~ names the same folder for the weights and for the tokenizer.
- The default JSON names of runs that differ in data, optimizer, shape, variant or any other option differ.
- The code the scripts share (model, data, names, run information) is identical in both fine-tune scripts, and the
  model loading in profile_baseline.py too.
- Clipping inside the fused AdamW step equals clip_grad_norm_ + AdamW and leaves no clipping factor between steps;
  the peer (--liger) asks Liger's fused loss for the token accuracy, in training and evaluation.
"""
import inspect
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import finetune_optimized  # noqa: E402  (first: the kernel modules must set up Triton before transformers loads it)
import finetune_baseline  # noqa: E402
import memory_plan  # noqa: E402
import profile_baseline  # noqa: E402
import lora_adapters  # noqa: E402
import training_data  # noqa: E402
import transformers  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

# The kernels run on the GPU when there is one (the CPU interpreter otherwise): in-process models and inputs go there.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TEXT = "The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 30


def run_script(script, tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # fp32 on every device: the parity rule below is an fp32 rule (on a GPU the scripts default to bf16)
    cmd = [sys.executable, str(ROOT / script), "--model", "tiny", "--dtype", "fp32", "--out", str(out), *flags]
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
        assert len(result["losses"]) == len(result["token_accuracies"]) == len(result["grad_norms"]) == 5
        assert len(result["step_ms"]) == 4  # the first step is the warm-up, left out of the timing
        for key in ("device", "host_cpu", "torch", "triton", "transformers", "git_commit", "git_dirty", "command",
                    "date", "options", "avg_step_ms", "tokens_per_s", "peak_memory_gib", "evals", "checkpoints"):
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
    model = finetune_optimized.AutoModelForCausalLM.from_config(finetune_optimized.builtin_config("tiny"),
                                                                dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # a trained model's norm weights are not all ones; make sure dweight is exercised
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.uniform_(0.5, 1.5)
    return model.to(DEVICE)


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
    input_ids, labels = input_ids.to(DEVICE), labels.to(DEVICE)
    labels[1, :] = -100  # a fully ignored sequence must not change the denominator
    ref_loss, ref_grads = loss_and_grads(lambda: model(input_ids=input_ids, labels=labels).loss, model)

    # In place, reusing the same parameters (as the script does); the RoPE patch is process-wide: restored after.
    assert finetune_optimized.apply_rmsnorm(model) == 5
    assert finetune_optimized.apply_glu_mlp(model) == 2
    shift_labels = finetune_optimized.shift_labels_of(labels)
    original_rope = modeling_llama.apply_rotary_pos_emb
    assert finetune_optimized.apply_rope(model) == 2
    try:
        loss, grads = loss_and_grads(
            lambda: finetune_optimized.compute_loss(model, input_ids, shift_labels, loss_impl)[0], model)
    finally:
        modeling_llama.apply_rotary_pos_emb = original_rope

    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-5 * ref.abs().max().item(), msg=name)


def test_baseline_loss_matches_transformers_with_ignored_labels():
    model = tiny_model_with_random_norms(seed=3)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 9), device=DEVICE)
    labels = input_ids.clone()
    labels[0, :4] = -100
    ref = model(input_ids=input_ids, labels=labels).loss
    ours, _ = finetune_baseline.compute_loss(model, input_ids, finetune_baseline.shift_labels_of(labels), "eager")
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)


def test_seq_len_search_cli(tmp_path):
    result, stdout = run_script("finetune_baseline.py", tmp_path, "search", "--seq-len-search", "8,16")
    assert result["seq_len_search"]["longest_trained"] == 16
    assert [r["seq_len"] for r in result["seq_len_search"]["results"]] == [8, 16]
    assert [r["status"] for r in result["seq_len_search"]["results"]] == ["trained", "trained"]
    assert "longest batch-1 sequence that trained: 16" in stdout
    if not torch.cuda.is_available():  # no GPU memory was measured: null, not 0
        assert [r["peak_gib"] for r in result["seq_len_search"]["results"]] == [None, None]
        assert "seq_len      16: trained" in stdout and "peak n/a (CPU)" in stdout and "0.00 GiB" not in stdout


def test_liger_without_gpu_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "finetune_baseline.py"), "--model", "tiny", "--liger",
                           "--steps", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert proc.returncode != 0 and "--liger needs" in proc.stderr


# ----------------------------------------------------------------------------------------------------------------------
# --data, local models, default names, shared code

ROWS = ["First document.", "", "   ", "Zweites Dokument: gr\u00fc\u00dfe, caf\u00e9 \u2013 \u4e2d\u6587", "third"]
EOS = 2


def expected_stream(texts):
    """The reference: UTF-8 bytes of each row with text (the built-in tiny model has no tokenizer), EOS after each."""
    return [i for text in texts if text.strip() for i in [*text.encode("utf-8"), EOS]]


def write_data_set(kind, folder):
    """Writes ROWS the way `kind` keeps a data set; returns (the --data path, the --text-field, the texts in order)."""
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_dict({"body": ROWS, "id": list(range(len(ROWS)))})
    if kind == "save_to_disk":
        rows.rename_column("body", "text").save_to_disk(folder / "disk")
        return folder / "disk", "text", ROWS
    if kind == "save_to_disk_dict":  # the "train" split of a DatasetDict
        datasets.DatasetDict({"train": rows, "test": rows.select([0])}).save_to_disk(folder / "dict")
        return folder / "dict", "body", ROWS
    if kind == "json":  # one JSON array of objects
        (folder / "rows.json").write_text(json.dumps([{"text": text} for text in ROWS]), encoding="utf-8")
        return folder / "rows.json", "text", ROWS
    if kind == "jsonl":
        (folder / "rows.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in ROWS), encoding="utf-8")
        return folder / "rows.jsonl", "body", ROWS
    if kind == "parquet":
        rows.to_parquet(str(folder / "rows.parquet"))
        return folder / "rows.parquet", "body", ROWS
    if kind == "csv":
        # csv has no empty string (an empty cell reads back as None): only the rows with text are written
        rows.filter(lambda row: row["body"].strip() != "").rename_column("body", "text").to_csv(
            str(folder / "rows.csv"), index=False)
        return folder / "rows.csv", "text", ROWS
    if kind == "txt":  # one document: the whole file
        (folder / "doc.txt").write_text("\n".join(ROWS), encoding="utf-8")
        return folder / "doc.txt", "text", ["\n".join(ROWS)]
    if kind == "folder":  # a folder of data files: datasets picks the json builder
        (folder / "files").mkdir()
        for i, text in enumerate(ROWS):
            (folder / "files" / f"part{i}.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
        return folder / "files", "text", ROWS
    raise ValueError(kind)


@pytest.mark.parametrize("module", [finetune_baseline, training_data], ids=["baseline", "optimized"])
@pytest.mark.parametrize("kind", ["save_to_disk", "save_to_disk_dict", "json", "jsonl", "parquet", "csv", "txt",
                                  "folder"])
def test_data_formats(kind, module, tmp_path):
    data, field, texts = write_data_set(kind, tmp_path)
    args = finetune_baseline.parse_args(["--model", "tiny", "--data", str(data), "--text-field", field])
    stream = module.load_token_stream(args, args.data, EOS, None, tokens_needed=10**6)
    assert stream.tolist() == expected_stream(texts)
    # a run needs fewer tokens than the data set holds: reading stops once it has them
    assert len(module.load_token_stream(args, args.data, EOS, None, tokens_needed=5)) == \
        len(expected_stream(texts[:1]))


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny LLaMA with random weights, saved by save_pretrained: a local model folder."""
    folder = tmp_path_factory.mktemp("model") / "tiny-llama"
    model = tiny_model_with_random_norms(seed=5)
    model.save_pretrained(folder)
    return folder, model.state_dict()


@pytest.mark.parametrize("module", [finetune_baseline, profile_baseline], ids=["finetune", "profile"])
def test_local_model_loads_real_weights_with_device_map(saved_model, module, monkeypatch):
    pytest.importorskip("accelerate")
    folder, state = saved_model
    calls = []
    from_pretrained = module.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(module.AutoModelForCausalLM, "from_pretrained", spy)
    args = module.parse_args(["--model", str(folder)])
    if module is finetune_baseline:  # the fine-tune scripts pick the attention once they know the data's format
        module.resolve_data_format(args)
        module.choose_attention(args)
    model, weights = module.load_model(args, DEVICE, torch.float32)
    assert weights == "real" and calls[0]["device_map"] == DEVICE
    loaded = model.state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[name], state[name]) for name in state)


@pytest.mark.parametrize("allow_download", [False, True], ids=["cache-only", "allow-download"])
@pytest.mark.parametrize("module", [finetune_baseline, finetune_optimized, profile_baseline],
                         ids=["baseline", "optimized", "profile"])
def test_the_hub_is_asked_only_with_allow_download(module, allow_download, monkeypatch):
    """Without a network huggingface_hub retries every file for ~20 s (seen on the GPU box: past 75 s before the first
    step), so the weights, the tokenizer and Hub data sets come from the local cache unless --allow-download."""
    asked = []

    def not_cached(name, **kwargs):
        asked.append((name, kwargs.get("local_files_only")))
        raise OSError(f"{name} is not cached")

    monkeypatch.setattr(module.AutoModelForCausalLM, "from_pretrained", not_cached)
    args = module.parse_args(["--model", "some-org/not-a-builtin"] + ["--allow-download"] * allow_download)
    with pytest.raises(SystemExit, match="not cached"):  # no config of that name either: the one error line
        module.load_model(args, DEVICE, torch.float32)
    expected = [("some-org/not-a-builtin", not allow_download)]
    load_tokenizer = training_data.load_tokenizer if module is finetune_optimized else getattr(module,
                                                                                                 "load_tokenizer", None)
    if load_tokenizer:
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", not_cached)
        assert load_tokenizer(args) is None  # UTF-8 bytes instead, said so
        expected.append(("some-org/not-a-builtin", not allow_download))
    assert asked == expected


@pytest.mark.parametrize("module", [finetune_baseline, finetune_optimized, profile_baseline],
                         ids=["baseline", "optimized", "profile"])
def test_model_path_with_tilde_is_the_same_folder_for_weights_and_tokenizer(module, tmp_path, monkeypatch, capsys):
    """--model=~/tiny-llama (the shell expands a ~ only at the start of a word): the weights and, with --data, the
    tokenizer both come from $HOME/tiny-llama; a tokenizer that fails to load would silently mean UTF-8 bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = tmp_path / "tiny-llama"
    words = Tokenizer(models.WordLevel({"[UNK]": 3, "hello": 4, "world": 5}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(folder)
    args = module.parse_args(["--model=~/tiny-llama"])
    assert args.model == str(folder)
    if module is not profile_baseline:  # the profiler trains on random tokens: no tokenizer
        load_tokenizer = training_data.load_tokenizer if module is finetune_optimized else module.load_tokenizer
        assert load_tokenizer(args)("hello world")["input_ids"] == [4, 5]
        assert "no tokenizer" not in capsys.readouterr().out


def test_local_model_and_data_end_to_end(saved_model, tmp_path):
    data, field, _ = write_data_set("parquet", tmp_path)
    result, stdout = run_script("finetune_baseline.py", tmp_path, "local", "--model", str(saved_model[0]),
                                "--data", str(data), "--text-field", field, "--steps", "2", "--seq-len", "16")
    assert result["weights"] == "real" and "(real weights)" in stdout
    assert result["options"]["data"] == str(data) and result["options"]["text_field"] == "body"
    assert len(result["losses"]) == 2


def default_name(module, *flags, weights="random", variant="baseline", world_size=1):
    args = module.parse_args(["--model", "tiny", "--seq-len", "32", *flags])
    return module.default_out_path(args, weights, "float32", variant, world_size).name


def test_default_json_names_tell_runs_apart(monkeypatch):
    assert default_name(finetune_baseline) == "finetune_baseline_tiny-random_baseline_float32_1x32.json"
    assert (default_name(finetune_optimized, "--data", "/data/wiki.jsonl", "--lce-chunk-size", "256",
                         variant="rmsnorm+linear_ce+swiglu+rope")
            == "finetune_optimized_tiny-random_rmsnorm+linear_ce+swiglu+rope_float32_1x32_data=wiki.jsonl"
               "_lce-chunk-size=256.json")
    monkeypatch.setenv("WORLD_SIZE", "2")
    runs = [(), ("--data", "a.jsonl"), ("--data", "b.parquet"), ("--data", "org/corpus"), ("--data", "b.parquet",
            "--text-field", "body"), ("--optimizer", "adamw_foreach"), ("--batch-size", "2"), ("--seq-len", "64"),
            ("--lr", "1e-3"), ("--steps", "5"), ("--seed", "1"), ("--attn-implementation", "eager"),
            ("--seq-len-search", "8,16"), ("--fsdp",)]  # the dtype is in the name as the run resolves it
    names = [default_name(finetune_baseline, *flags) for flags in runs]
    names += [default_name(finetune_baseline, weights="real"), default_name(finetune_baseline, variant="compile")]
    assert len(set(names)) == len(names), names
    # what does not change the run does not change the name
    assert default_name(finetune_baseline, "--tensorboard", "runs/tb") == names[0]


# The stock parts both scripts keep as parallel text, so that `diff finetune_baseline.py finetune_optimized.py` shows
# only what is ours (our machinery exists once, in finetune_optimized.py).
SHARED = ["run_info", "first_line", "builtin_config", "load_model", "data_rows", "load_tokenizer", "load_token_stream",
          "make_batches", "load_data", "shift_labels_of", "default_out_path", "evaluate", "checkpoints", "resume",
          "save_final", "write_results", "seq_len_search", "read_rows", "row_format", "missing_fields",
          "resolve_data_format", "packed_documents", "choose_attention", "chat_template_of", "render_chat",
          "encode_with_offsets", "check_messages", "conversation_tokens", "load_conversations", "pack_conversations",
          "conversation_rows", "text_batch", "targets_per_rank", "token_share", "check_lora_flags", "lora_settings",
          "describe_lora", "quantize_to_nf4", "add_adapters", "apply_lora", "trainable_parameters", "lora_report",
          "describe_adapters", "dequantize_nf4", "torch_varlen_attention", "attention_inputs"]


def optimized_side(name):
    """Where the optimized script's copy of a shared part lives: the script, or a module it imports them from."""
    return next(getattr(module, name) for module in (finetune_optimized, training_data, lora_adapters)
                if hasattr(module, name))


def test_stock_parts_are_parallel_text():
    for name in SHARED:
        assert inspect.getsource(getattr(finetune_baseline, name)) == inspect.getsource(optimized_side(name)), name
    for name in ["SOFTCAP_ATTENTION", "DATA_FILE_BUILDERS", "UNNAMED_OPTIONS", "DTYPES", "ATTN_IMPLEMENTATIONS",
                 "LR_SCHEDULERS", "SEARCH_RETIME_S", "DATA_FORMATS", "BYTE_CHAT_TEMPLATE"]:
        assert getattr(finetune_baseline, name) == optimized_side(name), name
    assert finetune_baseline.ATTN_IMPLEMENTATIONS == profile_baseline.ATTN_IMPLEMENTATIONS
    for name in ["run_info", "first_line", "builtin_config", "load_model"]:
        assert inspect.getsource(getattr(finetune_baseline, name)) == \
            inspect.getsource(getattr(profile_baseline, name)), name


@pytest.mark.parametrize("loss_impl", ["linear_ce", "ce", "eager"])
def test_token_accuracy_is_the_argmax_hit_rate_of_the_counted_positions(loss_impl):
    """The accuracy both scripts log: positions whose label is not -100 and whose largest logit is the label."""
    model = tiny_model_with_random_norms(seed=4)
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 21), generator=generator).to(DEVICE)
    labels = input_ids.clone()
    labels[0, :7] = -100
    shift_labels = finetune_optimized.shift_labels_of(labels)
    with torch.no_grad():
        predicted = model(input_ids=input_ids).logits.argmax(dim=-1)
    # A tiny random model rarely predicts its input: make some positions hits, so the fraction is not trivially 0.
    hits = (torch.rand(shift_labels.shape, generator=generator) < 0.5).to(DEVICE)
    shift_labels = torch.where(hits & (shift_labels != -100), predicted, shift_labels)
    counted = shift_labels != -100
    expected = ((predicted == shift_labels) & counted).sum().item() / counted.sum().item()
    assert 0.2 < expected < 0.9

    if loss_impl == "eager":
        _, accuracy = finetune_baseline.compute_loss(model, input_ids, shift_labels, "eager")
    else:
        assert finetune_optimized.apply_rmsnorm(model) == 5
        _, accuracy = finetune_optimized.compute_loss(model, input_ids, shift_labels, loss_impl)
    assert accuracy.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("module,advice", [(finetune_baseline, "--activation-checkpointing full"),
                                          (finetune_optimized, "--memory-plan auto")], ids=["baseline", "optimized"])
def test_out_of_memory_is_one_line(module, advice, monkeypatch, tmp_path):
    """A run too large for the GPU ends with one line that says what to change and writes no JSON (the optimized
    script's memory plan hands a plan that ran out of memory back to main, which tries the next: test_memory_plan)."""
    def too_large(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total capacity of "
                                     "139.80 GiB of which 3.12 MiB is free. Including non-PyTorch memory, this process "
                                     "has 139.79 GiB memory in use.")
    monkeypatch.setattr(module, "fine_tune", too_large)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--out", str(tmp_path / "run.json")])
    message = str(exit_info.value)
    assert message.startswith("error: out of memory on the GPU (CUDA out of memory. Tried to allocate 256.00 MiB.")
    assert "Including" not in message and advice in message and "\n" not in message
    assert not (tmp_path / "run.json").exists()


@pytest.mark.parametrize("variant", ["linear_ce"])
def test_cuda_graph_trains_like_the_eager_step(parity_runs, variant, tmp_path):
    """--cuda-graph replays one captured step: the same kernels on the same data, so the same losses as the eager run,
    step by step. A graph that left out the optimizer step would give a flat loss, one that kept the gradients between
    replays a different curve. Without a GPU the flag says so in one line and the steps run eagerly."""
    eager, _ = parity_runs[variant]
    script = "finetune_baseline.py" if variant == "baseline" else "finetune_optimized.py"
    flags = ["--steps", "5", "--seq-len", "32", "--lr", "1e-3", "--data", eager["options"]["data"],
             *(["--lce-chunk-size", "8"] if variant == "linear_ce" else []), "--cuda-graph"]
    graphed, stdout = run_script(script, tmp_path, "graphed", *flags)
    assert graphed["cuda_graph"] is torch.cuda.is_available()
    if torch.cuda.is_available():
        assert "the whole step replayed as one CUDA graph" in stdout
    else:
        assert "no CUDA device: --cuda-graph has no graph to capture, the steps run eagerly" in stdout
    assert graphed["losses"] == pytest.approx(eager["losses"], rel=2e-5)
    assert graphed["token_accuracies"] == pytest.approx(eager["token_accuracies"], abs=1e-6)


@pytest.mark.parametrize("flags", [["--compile"], ["--activation-checkpointing", "full"], ["--seq-len-search", "8,16"],
                                   ["--optimizer-in-backward"], ["--resume", "--output-dir", "."],
                                   ["--lr-scheduler", "cosine"]])
def test_cuda_graph_refuses_what_a_graph_cannot_replay(flags, capsys, monkeypatch):
    monkeypatch.setattr(finetune_optimized, "checkpoints", lambda output_dir: ["checkpoint-1"])  # --resume's check
    for module in (finetune_optimized,):
        with pytest.raises(SystemExit):
            module.parse_args(["--cuda-graph", *flags])
        assert f"--cuda-graph captures one plain step of one shape: it cannot be combined with {flags[0]}" in \
            capsys.readouterr().err


def test_causal_sdpa_without_mask_keeps_the_causal_flag_under_capture(monkeypatch):
    """During a CUDA-graph capture transformers treats the forward as tracing and hands SDPA a [T, T] mask tensor
    (a slower kernel); the implementation --cuda-graph switches to must still call SDPA with no mask and
    is_causal=True, and give the same logits. The capture is simulated by transformers' own tracing check."""
    from transformers import masking_utils
    model = tiny_model_with_random_norms(seed=6)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(7))
    input_ids = input_ids.to(DEVICE)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is not None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    monkeypatch.setattr(masking_utils, "is_tracing", lambda *args, **kwargs: True)
    with torch.no_grad():
        masked = model(input_ids=input_ids).logits
        assert calls == [(True, False)] * 2  # the stock path under capture: a mask tensor, in each of the 2 layers
        calls.clear()
        finetune_optimized.causal_sdpa_without_mask(model)
        causal = model(input_ids=input_ids).logits
    assert calls == [(False, True)] * 2
    torch.testing.assert_close(causal, masked, rtol=1e-5, atol=1e-5)


def test_causal_sdpa_without_mask_keeps_the_causal_flag_under_compile():
    """Under torch.compile transformers builds the [T, T] mask tensor too (its tracing check covers compiling), so
    --compile switches the attention as --cuda-graph does: in the traced graph every SDPA call then has no mask and
    is_causal=True (the stock model's has a mask, in each of the 2 layers)."""
    model = tiny_model_with_random_norms(seed=9)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(10))
    input_ids = input_ids.to(DEVICE)

    def traced_sdpa_calls():
        calls = []

        def inspecting_backend(graph_module, example_inputs):
            calls.extend((node.kwargs.get("attn_mask") is not None, node.kwargs.get("is_causal"))
                         for node in graph_module.graph.nodes
                         if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target))
            return graph_module.forward
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend=inspecting_backend, fullgraph=True)(input_ids=input_ids)
        return calls
    assert traced_sdpa_calls() == [(True, False)] * 2
    finetune_optimized.causal_sdpa_without_mask(model)
    assert traced_sdpa_calls() == [(False, True)] * 2


def test_a_step_that_cannot_be_captured_is_one_error_line(monkeypatch):
    """What torch raises when a captured step syncs with the host becomes one line; out of memory is left to main.
    The first call trains eagerly (on a side stream), the capture comes after it."""
    class FakeGraph:
        pass

    class FakeContext:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def wait_stream(self, other):
            pass
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeContext)
    monkeypatch.setattr(torch.cuda, "Stream", FakeContext)
    monkeypatch.setattr(torch.cuda, "stream", FakeContext)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeContext)
    batch = torch.zeros(1, 1, 4, dtype=torch.long)

    def step_failing_when(error, calls=[]):
        def step(micro_batches):
            calls.append(1)
            if len(calls) > 1:  # the eager first call passes, the captured second one fails
                raise error
            return torch.ones(()), None, None
        calls.clear()
        return step
    graphed = finetune_optimized.capture_step(step_failing_when(
        RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors ...")))
    with pytest.raises(SystemExit) as exit_info:
        graphed(batch)
    message = str(exit_info.value)
    assert message == ("error: the training step cannot be captured as a CUDA graph (CUDA error: operation not "
                       "permitted when stream is capturing): something in it waits for the GPU or copies from the "
                       "host; run without --cuda-graph")
    graphed = finetune_optimized.capture_step(step_failing_when(torch.OutOfMemoryError("CUDA out of memory.")))
    with pytest.raises(torch.OutOfMemoryError):
        graphed(batch)


def test_clipping_inside_the_fused_step_equals_clip_grad_norm_and_keeps_no_factor():
    """The optimized script clips inside fused AdamW (grad_scale = norm / max_norm, at least 1): over three steps the
    parameters equal those of clip_grad_norm_ + AdamW within fp32 rounding, and after each step the optimizer holds no
    clipping factor (the next step's peak memory has nothing of this step's)."""
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 7, generator=generator), torch.randn(7, generator=generator)]
    models = [torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in start]) for _ in range(2)]
    args = finetune_optimized.build_parser().parse_args(["--lr", "1e-2", "--max-grad-norm", "0.5"])
    plan = memory_plan.MemoryPlan()
    (fused,), _ = finetune_optimized.make_optimizers(args, models[0], plan)
    reference = torch.optim.AdamW(models[1].parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        grads = [10 * torch.randn(t.shape, generator=generator) for t in start]  # norms far above 0.5: clipping acts
        for model in models:
            for param, grad in zip(model, grads):
                param.grad = grad.clone()
        norm = finetune_optimized.clip_gradients(args, models[0], [fused], None)
        fused.step()
        assert getattr(fused, "grad_scale", None) is None
        reference_norm = torch.nn.utils.clip_grad_norm_(models[1].parameters(), 0.5)
        reference.step()
        torch.testing.assert_close(norm, reference_norm)
        for ours, theirs in zip(*models):
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert not torch.equal(models[0][0], start[0])


def test_the_peer_logs_the_token_accuracy_its_fused_loss_finds():
    """--liger: Liger's patched forward computes the loss (and with return_token_accuracy the accuracy) inside its
    fused linear cross-entropy only when asked for it with labels and skip_logits; the baseline asks for both, in
    training and in evaluation, so the peer logs what ours logs. (Liger's kernels need a GPU: a stand-in model checks
    the call here; the GPU tests run the real one.)"""
    calls = []

    def patched_forward(**kwargs):
        calls.append(kwargs)
        return types.SimpleNamespace(loss=torch.tensor(2.0), token_accuracy=torch.tensor(0.25))

    ids = torch.randint(0, 100, (1, 8))
    loss, accuracy = finetune_baseline.compute_loss(patched_forward, ids, finetune_baseline.shift_labels_of(ids),
                                                     "liger")
    assert (loss.item(), accuracy.item()) == (2.0, 0.25)
    assert calls[0]["skip_logits"] is True and calls[0]["return_token_accuracy"] is True
    assert torch.equal(calls[0]["shift_labels"], finetune_baseline.shift_labels_of(ids))
