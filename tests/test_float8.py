"""--fp8 (float8_training.py): torchao's float8 training Linear in every decoder layer, on the CPU.

The CPU has no FP8 tensor cores, so the script refuses --fp8 there; these tests run the same conversion with torchao's
emulation (Float8LinearConfig(emulate=True): the same scaled casts to float8, the matmul in high precision), on the
tiny LLaMA with our RMSNorm, SwiGLU and RoPE patched in and the loss through the fused linear cross-entropy.

- Module types: every Linear of every decoder layer is a Float8Linear of the recipe asked for (7 per layer for Llama,
  4 for Phi-3's fused projections), reusing the same weight Parameter; the lm_head stays a plain Linear.
- Every converted Linear, on the inputs the model feeds it, differs from F.linear on the same input by a relative
  RMS error between 2^-7 and 2^-3. Why: float8 e4m3 keeps 3 mantissa bits, so rounding each of the two operands
  errs by at most 2^-4 of the value (the unit roundoff), and the two roundings together by at most about 2^-3;
  random and independent, they add up to about 4 % RMS (measured 3.5-4 %). The floor fails a Linear that was left
  out or converted into something that does not cast (its error is then exactly 0 in fp32, ~2^-9 in bf16).
- The loss after forward and backward is within 2^-4 (e4m3's unit roundoff) of the same model's loss unconverted,
  in fp32 and in bf16. The float8 roundings are unbiased and average over the tokens, so the loss moves far less
  than one rounding (at most 0.7 % measured over seeds, recipes and dtypes, on weights scaled so the logits spread
  over a few units, where the loss is sensitive to the hidden states); a defect that skips a scale, casts to the
  wrong range or saturates moves it by far more. Every parameter gets a finite gradient within 1/2 relative error
  of the unconverted one (it points the same way; the gradients pass through float8 casts of dy in every layer
  above: measured at most 0.29).
- A conversion that silently does nothing is an error: torchao's swap replaced by a no-op ends in one line.
- The compile hook (each decoder layer compiled in place; aot_eager here) gives the eager float8 loss and gradients
  bit for bit, and one graph serves both layers; with inductor it asks for 2-D tiles and tuned blocks.
- The flag checks: --loss ce/eager, --fsdp, --cuda-graph, no GPU or compute capability 8.0, torchao missing or too
  old for the recipe, a layer whose sizes the FP8 matmul cannot take: each one line. The run's variant names the
  recipe. And end to end: finetune_optimized.py --fp8 rowwise trains 2 steps with the device check lifted (the CPU's
  own float8 matmul, torch._scaled_mm, stands in for the GPU's), its layers compiled, and reports the conversion.
- Loss parity (float8_training.py as a script): the trailing mean equals numpy's over every window; the largest
  smoothed relative gap of two runs' JSONs is the one computed by hand, at the step where it occurs, with the JSON
  and the PNG written; runs that differ in data, seed or another option that shapes the curve are refused; the
  corpus is the standard library's source. configs/llama-small's decoder Linears all suit the FP8 matmul.
"""
import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import finetune_optimized  # noqa: E402  (first: the kernel modules must set up Triton before transformers loads it)
import float8_training  # noqa: E402

try:
    import torchao.float8
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    TORCHAO_ERROR = None
except ImportError as err:
    TORCHAO_ERROR = err
needs_torchao = pytest.mark.skipif(TORCHAO_ERROR is not None, reason=f"torchao cannot be imported: {TORCHAO_ERROR}")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# family config folder -> Linear layers per decoder layer
LINEARS_PER_LAYER = {"tiny": 7, "tiny-phi3": 4}
MAX_LINEAR_ERROR, MIN_LINEAR_ERROR = 2 ** -3, 2 ** -7
MAX_LOSS_ERROR = 2 ** -4
MAX_GRAD_ERROR = 2 ** -1


# apply_rope replaces a module-level function (process-wide): every test starts from the stock ones (conftest.py)
pytestmark = pytest.mark.usefixtures("restore_rope")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def patched_model(folder="tiny", dtype=torch.float32, seed=0):
    """The tiny model with unit-scale random weights (activations and logits of a few units, as in a trained model;
    the default init's 0.02 leaves the logits near 0, where the loss hardly depends on anything) and our kernels."""
    model = finetune_optimized.AutoModelForCausalLM.from_config(finetune_optimized.builtin_config(folder),
                                                                dtype=torch.float32, attn_implementation="sdpa")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.rand(param.shape, generator=generator) - 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    model.config.use_cache = False
    model.train()
    model.to(DEVICE, dtype)
    finetune_optimized.patch_kernels(finetune_optimized.build_parser().parse_args([]), model)
    return model


def loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    loss, _ = finetune_optimized.compute_loss(model, input_ids, finetune_optimized.shift_labels_of(input_ids),
                                              "linear_ce")
    loss.backward()
    return loss.detach().float(), {name: param.grad.float() for name, param in model.named_parameters()}


def input_ids(seed=10):
    return torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def relative_error(value, reference):
    return ((value.float() - reference.float()).norm() / reference.float().norm()).item()


@needs_torchao
@pytest.mark.parametrize("recipe", float8_training.RECIPES)
@pytest.mark.parametrize("folder", LINEARS_PER_LAYER)
def test_every_decoder_linear_is_converted_and_the_lm_head_is_not(folder, recipe):
    model = patched_model(folder)
    weights = {name: param for name, param in model.named_parameters()}
    assert float8_training.convert_decoder_linears(model, recipe, emulate=True) == \
        LINEARS_PER_LAYER[folder] * model.config.num_hidden_layers
    expected_config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    for layer in model.model.layers:
        linears = [module for module in layer.modules() if isinstance(module, torch.nn.Linear)]
        assert len(linears) == LINEARS_PER_LAYER[folder]
        assert all(type(module) is Float8Linear and module.config == expected_config for module in linears)
    assert type(model.lm_head) is torch.nn.Linear
    # the same Parameters: the optimizer, checkpoints and save_pretrained see the model they saw before
    assert all(param is weights[name] for name, param in model.named_parameters())


@needs_torchao
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", float8_training.RECIPES)
def test_forward_backward_within_float8_rounding(recipe, dtype):
    ids = input_ids()
    reference_loss, reference_grads = loss_and_grads(patched_model(dtype=dtype), ids)
    model = patched_model(dtype=dtype)
    float8_training.convert_decoder_linears(model, recipe, emulate=True)
    linear_errors = {}

    def record_error(module, inputs, output):
        linear_errors[module] = relative_error(output, F.linear(inputs[0], module.weight, module.bias))
    hooks = [module.register_forward_hook(record_error) for module in model.modules() if type(module) is Float8Linear]
    loss, grads = loss_and_grads(model, ids)
    for hook in hooks:
        hook.remove()
    assert len(linear_errors) == len(hooks) == 14
    assert all(MIN_LINEAR_ERROR < error < MAX_LINEAR_ERROR for error in linear_errors.values()), linear_errors
    assert abs(loss - reference_loss) <= MAX_LOSS_ERROR * reference_loss, (loss, reference_loss)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
        assert relative_error(grad, reference_grads[name]) < MAX_GRAD_ERROR, name


@needs_torchao
def test_a_conversion_that_does_nothing_is_an_error(monkeypatch):
    monkeypatch.setattr(torchao.float8, "convert_to_float8_training", lambda model, **kwargs: model)
    with pytest.raises(SystemExit, match=r"converted \[0, 0\] Linear layers per decoder layer, expected \[7, 7\]"):
        float8_training.convert_decoder_linears(patched_model(), "rowwise", emulate=True)


@needs_torchao
def test_compiled_layers_match_eager_with_one_graph(fresh_dynamo):
    ids = input_ids()
    runs = []
    for compiled in (False, True):
        model = patched_model()
        float8_training.convert_decoder_linears(model, "rowwise", emulate=True)
        if compiled:
            torch._dynamo.utils.counters.clear()
            float8_training.compile_decoder_layers(model, "aot_eager")
        runs.append(loss_and_grads(model, ids))
        assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in model.model.layers)  # compiled in place
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = runs
    assert torch.equal(eager_loss, compiled_loss)
    assert all(torch.equal(eager_grads[name], compiled_grads[name]) for name in eager_grads)


def test_inductor_compiles_the_layers_with_tiled_and_tuned_kernels(monkeypatch):
    """On the GPU (inductor) each layer's compile asks for 2-D tiles and block tuning, the options the float8 casts'
    speed rests on (rowwise's transposed column reductions); aot_eager, which generates no kernels, takes none."""
    model = patched_model()
    calls = []
    for layer in model.model.layers:
        monkeypatch.setattr(layer, "compile", lambda **kwargs: calls.append(kwargs))
    float8_training.compile_decoder_layers(model, "inductor")
    float8_training.compile_decoder_layers(model, "aot_eager")
    tiled_and_tuned = {"coordinate_descent_tuning": True, "triton.tile_reductions": True,
                       "triton.prefer_nd_tiling": True}
    assert calls == [{"backend": "inductor", "options": tiled_and_tuned}] * 2 + [{"backend": "aot_eager",
                                                                                 "options": None}] * 2


@needs_torchao
def test_sizes_the_fp8_matmul_cannot_take_are_refused():
    model = patched_model()
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(176, 72, bias=False)  # 72 is no multiple of 16
    with pytest.raises(SystemExit, match=r"model.layers.1.mlp.down_proj \(72, 176\): the FP8 matmul needs sizes that "
                                         r"are multiples of 16"):
        float8_training.convert_decoder_linears(model, "tensorwise")


def parse(*flags):
    return finetune_optimized.build_parser().parse_args(["--fp8", "rowwise", *flags])


@pytest.mark.parametrize("flags, capability, message", [
    (("--loss", "ce"), (9, 0), "--fp8 goes with --loss linear_ce: --loss ce runs the lm_head as a Linear outside"),
    (("--loss", "eager"), (9, 0), "--fp8 goes with --loss linear_ce: --loss eager"),
    (("--cuda-graph",), (9, 0), "it cannot be combined with --cuda-graph"),
    (("--fsdp",), (9, 0), "it cannot be combined with --fsdp"),
    ((), None, "compute capability 8.9 or higher (H100, L40S, RTX 4090); found no CUDA device"),
    ((), (8, 0), "found compute capability 8.0"),
])
def test_fp8_problems(flags, capability, message):
    assert message in float8_training.fp8_problem(parse(*flags), capability)


@needs_torchao
def test_a_gpu_with_fp8_and_the_pinned_torchao_pass():
    assert float8_training.fp8_problem(parse(), (9, 0)) is None
    assert float8_training.fp8_problem(parse(), (8, 9)) is None


def test_a_torch_older_than_the_pinned_torchao_needs(monkeypatch):
    monkeypatch.setattr(float8_training.torch, "__version__", "2.10.0a0+b4e4ee81d3")
    assert float8_training.fp8_problem(parse(), (9, 0)) == (
        "--fp8 needs torch 2.11 or newer for the pinned torchao; this is torch 2.10.0a0+b4e4ee81d3")


def test_torchao_missing_or_too_old(monkeypatch):
    monkeypatch.setattr(float8_training, "torchao_version", lambda: None)
    assert "needs torchao, which is not installed" in float8_training.fp8_problem(parse(), (9, 0))
    monkeypatch.setattr(float8_training, "torchao_version", lambda: "0.7.0")
    old = types.ModuleType("torchao.float8")  # an older torchao: other recipe names, no from_recipe_name
    old.Float8LinearConfig = type("Float8LinearConfig", (), {})
    old.Float8LinearRecipeName = [types.SimpleNamespace(value="all_tensorwise"),
                                  types.SimpleNamespace(value="all_axiswise")]
    monkeypatch.setitem(sys.modules, "torchao.float8", old)
    assert float8_training.fp8_problem(parse(), (9, 0)) == (
        "--fp8 rowwise: torchao 0.7.0 is too old for this recipe (its recipes: all_tensorwise, all_axiswise); "
        "pip install -r requirements.txt")
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import torchao.float8 raises ImportError
    assert "torchao 0.7.0 has no float8 recipes" in float8_training.fp8_problem(parse(), (9, 0))


@pytest.mark.parametrize("cuda, message", [
    (None, "found no CUDA device"), ((8, 0), "found compute capability 8.0")])
def test_the_script_refuses_fp8_in_one_line(cuda, message, monkeypatch, capsys):
    """Before the model loads: parse_args is where the run stops."""
    monkeypatch.setattr(float8_training.torch.cuda, "is_available", lambda: cuda is not None)
    monkeypatch.setattr(float8_training.torch.cuda, "get_device_capability", lambda *device: cuda)
    with pytest.raises(SystemExit) as exit_info:
        finetune_optimized.parse_args(["--fp8", "tensorwise"])
    assert exit_info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(error_lines) == 1 and message in error_lines[0]


def test_variant_names_the_recipe():
    assert finetune_optimized.kernel_variant(parse()) == "rmsnorm+linear_ce+swiglu+rope+fp8-rowwise"
    assert finetune_optimized.kernel_variant(parse("--compile")) == "rmsnorm+linear_ce+swiglu+rope+fp8-rowwise+compile"
    assert finetune_optimized.kernel_variant(parse("--fp8-keep-bf16", "k_proj", "v_proj")) == \
        "rmsnorm+linear_ce+swiglu+rope+fp8-rowwise-k_proj-bf16-v_proj-bf16"


@needs_torchao
@pytest.mark.parametrize("folder", LINEARS_PER_LAYER)
def test_linears_kept_in_bf16_stay_plain_in_every_layer(folder):
    model = patched_model(folder)
    keep = ("k_proj", "v_proj") if "phi3" not in folder else ("o_proj",)
    converted = float8_training.convert_decoder_linears(model, "rowwise", emulate=True, keep_bf16=keep)
    assert converted == (LINEARS_PER_LAYER[folder] - len(keep)) * model.config.num_hidden_layers
    for fqn, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert (type(module) is torch.nn.Linear) == (fqn.rsplit(".", 1)[-1] in keep), fqn


@needs_torchao
@pytest.mark.parametrize("keep, message", [
    (("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), "name some of them, not all"),
    (("kv_proj",), "(kv_proj is none of them)")])
def test_keeping_unknown_or_all_linears_is_one_line(keep, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        float8_training.convert_decoder_linears(patched_model(), "rowwise", emulate=True, keep_bf16=keep)


def test_keep_bf16_goes_with_fp8(capsys):
    with pytest.raises(SystemExit):
        finetune_optimized.parse_args(["--fp8-keep-bf16", "k_proj"])
    assert "--fp8-keep-bf16 goes with --fp8" in capsys.readouterr().err


@needs_torchao
def test_finetune_fp8_end_to_end(monkeypatch, tmp_path, capsys, fresh_dynamo):
    monkeypatch.setattr(finetune_optimized, "check_fp8_flags", lambda parser, args: None)
    torch._dynamo.utils.counters.clear()
    out = tmp_path / "fp8.json"
    finetune_optimized.main(["--model", "tiny", "--fp8", "rowwise", "--steps", "2", "--seq-len", "16",
                             "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["variant"] == "rmsnorm+linear_ce+swiglu+rope+fp8-rowwise"
    assert result["replaced"]["float8_linear"] == 14
    assert result["torchao"] == float8_training.torchao_version()
    assert len(result["losses"]) == 2 and all(0 < loss < 10 for loss in result["losses"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the compiled decoder layers ran
    assert "float8_linear" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------------------
# Loss parity: float8_training.py as a script

def test_smoothed_is_the_trailing_mean():
    losses = torch.rand(57, generator=torch.Generator().manual_seed(3)).add(2).tolist()
    for window in (1, 5, 20, 80):
        expected = [sum(losses[max(0, i - window + 1):i + 1]) / min(i + 1, window) for i in range(len(losses))]
        assert float8_training.smoothed(losses, window) == pytest.approx(expected, rel=1e-12)


def parity_run(losses, variant, **options):
    base = {"model": "llama-small", "data": "stdlib.txt", "seed": 0, "steps": len(losses), "batch_size": 1,
            "seq_len": 2048, "grad_accum_steps": 1, "lr": 3e-4, "lr_scheduler": "cosine", "warmup_steps": 3,
            "max_grad_norm": 1.0, "dtype": "auto"}
    return {"variant": variant, "device": "NVIDIA H100 80GB HBM3", "git_commit": "abc1234", "start_step": 0,
            "losses": losses, "options": {**base, **options}}


def test_compare_reports_the_largest_smoothed_gap(tmp_path):
    generator = torch.Generator().manual_seed(4)
    reference = torch.linspace(8, 3, 60).add(0.1 * torch.rand(60, generator=generator)).tolist()
    candidate = [r * (1 + (0.05 if 30 <= i < 40 else 0.001)) for i, r in enumerate(reference)]  # a bump at 31..40
    paths = []
    for losses, variant in ((reference, "rmsnorm+linear_ce"), (candidate, "rmsnorm+linear_ce+fp8-rowwise")):
        paths.append(tmp_path / f"{variant}.json")
        paths[-1].write_text(json.dumps(parity_run(losses, variant)))
    out = tmp_path / "results" / "fp8_loss_parity.json"
    float8_training.main(["--compare", *map(str, paths), "--window", "5", "--out", str(out)])
    record = json.loads(out.read_text())
    smooth_r, smooth_c = float8_training.smoothed(reference, 5), float8_training.smoothed(candidate, 5)
    gaps = [abs(c - r) / r for r, c in zip(smooth_r, smooth_c)]
    assert record["max_smoothed_rel_gap"] == pytest.approx(max(gaps)) and 0.04 < record["max_smoothed_rel_gap"] < 0.05
    assert record["at_step"] == 1 + gaps.index(max(gaps)) and 35 <= record["at_step"] <= 40
    assert record["candidate"]["losses"] == candidate and record["window"] == 5
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.parametrize("option, value", [("data", "other.txt"), ("seed", 1), ("lr", 1e-4), ("steps", 10)])
def test_compare_refuses_runs_that_differ(tmp_path, option, value):
    losses = [5.0, 4.0, 3.5, 3.2, 3.0]
    runs = [parity_run(losses, "bf16"), parity_run(losses, "fp8", **{option: value})]
    with pytest.raises(SystemExit, match=f"^error: --compare: the runs differ in --{option.replace('_', '-')} "):
        float8_training.compare_runs(*runs, 2)


def test_corpus_is_the_standard_library_source_in_a_fixed_shuffled_order(tmp_path):
    first, again = tmp_path / "stdlib.txt", tmp_path / "again.txt"
    size = float8_training.write_corpus(first)
    float8_training.write_corpus(again)
    text = first.read_text(encoding="utf-8")
    assert size > 2**20 and "def " in text and "import " in text
    assert again.read_bytes() == first.read_bytes()  # the same order on every call: parity runs read the same text
    in_path_order = [p.read_text(encoding="utf-8", errors="replace") for p in float8_training.corpus_files()]
    starts = [text.find(source[:2000]) for source in in_path_order if len(source) > 2000][:50]
    assert starts != sorted(starts)  # not path order: the first files do not come first, in turn


@pytest.mark.parametrize("name", ["llama-small", "llama-3.2-1b"])
def test_parity_models_suit_the_fp8_matmul(name):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(ROOT / "configs" / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = [m.weight.shape for name, m in model.named_modules() if float8_training.is_decoder_linear(m, name)]
    assert len(shapes) == 7 * config.num_hidden_layers
    assert all(size % float8_training.FP8_MATMUL_MULTIPLE == 0 for shape in shapes for size in shape)
