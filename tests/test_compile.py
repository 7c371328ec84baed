"""torch.compile around the kernels: their custom operators (torch.ops.playbook.*) against the eager path.

- Each functional API (rms_norm, swiglu, apply_rotary_pos_emb, cross_entropy, linear_cross_entropy)
  compiled with fullgraph=True gives the eager path's outputs and gradients, bit for bit: both run the same kernels on
  the same inputs, and fullgraph=True fails on any graph break, so the operator really is what ran. Random weights,
  fresh random inputs and upstream gradients, sizes that are not powers of two, and cross-entropy rows with ignore_index
  -100; the losses are also checked against F.cross_entropy in float64, so a compiled loss cannot be wrong the same
  way as an eager one.
- backend="aot_eager" keeps this fast on the CPU: it still traces with fake tensors (register_fake), builds the forward
  and backward graphs through register_autograd and runs them, but generates no code.
- torch.library.opcheck checks each operator's schema, fake implementation and autograd registration on small inputs.
- The tiny LLaMA with every kernel patched in (ModelWithLoss of finetune_optimized.py, both losses) compiles with
  fullgraph=True and matches the eager loss, token accuracy and every parameter's gradient; bad or uncompilable options
  are clear errors; `finetune_optimized.py --compile` runs end to end.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import finetune_optimized  # noqa: E402  (first: the kernel modules must set up Triton before transformers loads it)
from cross_entropy_kernel import cross_entropy  # noqa: E402
from linear_cross_entropy_kernel import linear_cross_entropy  # noqa: E402
from rmsnorm_kernel import rms_norm  # noqa: E402
from rope_kernel import apply_rotary_pos_emb  # noqa: E402
from swiglu_kernel import swiglu  # noqa: E402
from test_memory_levers import tiny_model  # noqa: E402  (the tiny LLaMA with the kernels patched in, as here)
from transformers.models.llama import modeling_llama  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: no cached graph from an earlier test, no recompile limit reached."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def leaf(*shape, scale=1.0):
    return (scale * torch.randn(*shape, device=DEVICE)).requires_grad_()


def outputs_and_grads(fn, inputs, upstream):
    """fn(*inputs) as a list of tensors, then the gradients of sum(<output, upstream>) for every input."""
    for t in inputs:
        t.grad = None
    outputs = fn(*inputs)
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    sum((out * up).sum() for out, up in zip(outputs, upstream) if up is not None).backward()
    return [out.detach() for out in outputs] + [t.grad for t in inputs]


def assert_compiled_matches_eager(fn, inputs, upstream):
    eager = outputs_and_grads(fn, inputs, upstream)
    ours = outputs_and_grads(compiled(fn), inputs, upstream)
    for index, (a, b) in enumerate(zip(ours, eager)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=f"result {index}")


# ----------------------------------------------------------------------------------------------------------------------
# One kernel at a time
# ----------------------------------------------------------------------------------------------------------------------
def test_rms_norm():
    torch.manual_seed(0)
    x, weight = leaf(3, 5, 37), leaf(37)
    with torch.no_grad():
        weight.add_(1.0)  # random, around 1 as a trained norm's
    dy = torch.randn(3, 5, 37, device=DEVICE)
    assert_compiled_matches_eager(lambda x, w: rms_norm(x, w, 1e-5), [x, weight], [dy])


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("layout", ["projections", "gate_up_halves"])
def test_swiglu(inplace_backward, layout):
    """gate and up as two projections' outputs (the in-place backward overwrites them), or as the strided halves of one
    fused projection (the in-place operator writes its results back into them)."""
    torch.manual_seed(1)
    x, w_gate, w_up = leaf(2, 7, 24), leaf(45, 24), leaf(45, 24)

    def mlp_middle(x, w_gate, w_up):
        if layout == "projections":
            gate, up = x @ w_gate.t(), x @ w_up.t()
        else:
            gate, up = (x @ torch.cat([w_gate, w_up]).t()).chunk(2, dim=-1)
        return swiglu(gate, up, inplace_backward=inplace_backward)
    assert_compiled_matches_eager(mlp_middle, [x, w_gate, w_up], [torch.randn(2, 7, 45, device=DEVICE)])


@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_rope(unsqueeze_dim):
    """q and k as LlamaAttention makes them (transposed views of [B, T, H, D]) or in the [B, T, H, D] layout."""
    torch.manual_seed(2)
    batch, tokens, q_heads, kv_heads, head_dim = 2, 11, 4, 2, 10
    q, k = leaf(batch, tokens, q_heads, head_dim), leaf(batch, tokens, kv_heads, head_dim)
    cos, sin = torch.randn(1, tokens, head_dim, device=DEVICE), torch.randn(1, tokens, head_dim, device=DEVICE)

    def rotate(q, k):
        if unsqueeze_dim == 1:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    upstream = [torch.randn_like(t.transpose(1, 2) if unsqueeze_dim == 1 else t) for t in (q, k)]
    assert_compiled_matches_eager(rotate, [q, k], upstream)


def targets_with_ignored_rows(shape, V, generator_seed):
    generator = torch.Generator().manual_seed(generator_seed)
    targets = torch.randint(0, V, shape, generator=generator)
    targets[torch.rand(shape, generator=generator) < 0.3] = -100
    targets.view(-1)[:2] = -100  # the first rows ignored whatever the draw
    return targets.to(DEVICE)


def assert_loss_is_torchs(loss, logits, targets, reduction, **options):
    """Our loss against F.cross_entropy in float64: a compiled and an eager loss that agree can still both be wrong."""
    reference = F.cross_entropy(logits.detach().double().flatten(0, -2), targets.flatten(), ignore_index=-100,
                                reduction=reduction, **options)
    torch.testing.assert_close(loss.double().flatten(), reference.flatten(), rtol=1e-5, atol=1e-6, equal_nan=True)


CE_CASES = {
    "mean": dict(reduction="mean"),
    "sum_3d_smoothing": dict(reduction="sum", label_smoothing=0.1),
    "none": dict(reduction="none"),
    "mean_all_ignored": dict(reduction="mean", all_ignored=True),  # NaN loss, zero gradient, as in PyTorch
    "extras": dict(reduction="mean", lse_square_scale=1e-3, softcap=5.0, class_weights=True, return_z_loss=True,
                   return_token_accuracy=True, return_predicted_tokens=True),
}


@pytest.mark.parametrize("case", CE_CASES)
def test_cross_entropy(case):
    options = dict(CE_CASES[case])
    torch.manual_seed(3)
    V = 200
    shape = (2, 9) if case == "sum_3d_smoothing" else (13,)
    logits = leaf(*shape, V, scale=3.0)
    targets = targets_with_ignored_rows(shape, V, generator_seed=4)
    if options.pop("all_ignored", False):
        targets.fill_(-100)
    if options.pop("class_weights", False):
        options["weight"] = torch.rand(V, device=DEVICE) + 0.5

    def loss_fn(logits):
        result = cross_entropy(logits, targets, **options)
        return tuple(value for value in result if value is not None) if isinstance(result, tuple) else result
    reduced = options["reduction"] != "none"
    upstream = [torch.tensor(0.7, device=DEVICE) if reduced else torch.randn(shape, device=DEVICE)]
    ours = outputs_and_grads(compiled(loss_fn), [logits], upstream)
    assert_compiled_matches_eager(loss_fn, [logits], upstream)
    if "lse_square_scale" not in options:  # F.cross_entropy has no z-loss or softcap
        assert_loss_is_torchs(ours[0], logits, targets, **options)


@pytest.mark.parametrize("reduction, frozen_weight", [("mean", False), ("none", True)])
def test_linear_cross_entropy(reduction, frozen_weight):
    """Chunks of 5 rows over 18 tokens (the last chunk partial); a frozen weight (LoRA-like) gets no dW; "none"
    recomputes the chunks in its backward operator."""
    torch.manual_seed(5)
    V, H = 200, 24
    hidden, weight, bias = leaf(2, 9, H), leaf(V, H, scale=0.3), leaf(V)
    weight.requires_grad_(not frozen_weight)
    targets = targets_with_ignored_rows((2, 9), V, generator_seed=6)

    def loss_fn(hidden, weight, bias):
        out = linear_cross_entropy(hidden, weight, targets, bias, reduction=reduction, chunk_size=5,
                                   return_token_accuracy=True)
        return out.loss, out.token_accuracy
    upstream = [torch.randn(2, 9, device=DEVICE) if reduction == "none" else torch.tensor(0.7, device=DEVICE), None]
    inputs = [hidden, weight, bias]
    ours = outputs_and_grads(compiled(loss_fn), inputs, upstream)
    assert (ours[3] is None) == frozen_weight  # outputs: loss, accuracy; gradients: hidden, weight, bias
    assert_compiled_matches_eager(loss_fn, inputs, upstream)
    assert_loss_is_torchs(ours[0], hidden @ weight.t() + bias, targets, reduction)


def test_opcheck():
    """Schema, fake implementation, autograd registration and (where opcheck can express it) the AOT-traced forward
    and backward of every operator. The fused losses return their gradient as an output that their backward scales in
    place; opcheck's AOT test returns every output to the caller, which a backward may then not overwrite, so for them
    the compiled-against-eager tests above cover that part."""
    torch.manual_seed(7)
    ops = torch.ops.playbook
    x, weight = leaf(3, 37), leaf(37)
    y, rstd = ops.rms_norm(x.detach(), weight.detach(), 1e-5)
    gate, up, dy = leaf(3, 45), leaf(3, 45), torch.randn(3, 45, device=DEVICE)
    q, k = leaf(2, 4, 5, 10), leaf(2, 2, 5, 10)
    cos, sin = torch.randn(1, 5, 10, device=DEVICE), torch.randn(1, 5, 10, device=DEVICE)
    dq_embed = torch.randn(2, 4, 5, 10, device=DEVICE)
    dk_embed = torch.randn(2, 5, 2, 10, device=DEVICE).transpose(1, 2)  # a strided upstream gradient
    logits, targets = leaf(6, 50), targets_with_ignored_rows((6,), 50, generator_seed=8)
    hidden, lm_weight = leaf(6, 12), leaf(50, 12)
    ce_flags = (False, True, False)  # return_z_loss, return_token_accuracy, return_predicted_tokens
    cases = [
        (ops.rms_norm, (x, weight, 1e-5), True),
        (ops.rms_norm_backward, (torch.randn_like(y), x.detach(), weight.detach(), rstd), True),
        (ops.rms_norm, (x, None, 1e-5, 1.0, "gemma"), True),  # the options: no weight, Gemma's offset and casting
        (ops.rms_norm_backward, (torch.randn_like(y), x.detach(), None, rstd, 1.0, "gemma"), True),
        (ops.swiglu, (gate, up, False), True),
        (ops.swiglu_backward, (gate.detach(), up.detach(), dy), True),
        (ops.swiglu_backward_, (gate.detach().clone(), up.detach().clone(), dy), True),
        (ops.swiglu, (gate, up, False, 0.7, "gelu_tanh"), True),  # the options: a gate multiplier, GeGLU
        (ops.swiglu_backward, (gate.detach(), up.detach(), dy, 0.7, "gelu_tanh"), True),
        (ops.rope, (q, k, cos, sin), True),
        (ops.rope_backward, (dq_embed, dk_embed, cos, sin), True),
        (ops.cross_entropy, (logits, targets, -100, "mean", 0.0, True, False, None, 0.0, None, *ce_flags), False),
        (ops.scale_rows_, (torch.randn(5, 7, device=DEVICE), torch.tensor(0.5, device=DEVICE)), True),
        (ops.linear_cross_entropy, (hidden, lm_weight, None, targets, -100, "mean", 0.0, 4, False, True, True, False,
                                    None, 0.0, None, *ce_flags), False),
        (ops.linear_cross_entropy_backward, (hidden.detach(), lm_weight.detach(), None, targets, dy[0, :6], -100,
                                             0.0, 4, True, True, False, None, 0.0, None), True),
    ]
    for op, args, aot in cases:
        utils = ("test_schema", "test_autograd_registration", "test_faketensor") + (("test_aot_dispatch_dynamic",)
                                                                                    if aot else ())
        results = torch.library.opcheck(op.default, args, test_utils=utils)
        assert set(results.values()) == {"SUCCESS"}, (op, results)


# ----------------------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------------------
def test_inplace_cross_entropy_is_refused_under_compile():
    logits, targets = leaf(4, 30), targets_with_ignored_rows((4,), 30, generator_seed=9)

    def loss_fn(logits):
        return cross_entropy(logits * 1.0, targets, inplace_backward=True)
    with pytest.raises(ValueError, match="inplace_backward=True cannot be compiled"):
        torch.compile(loss_fn, backend="aot_eager")(logits)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="inplace_backward=True cannot be compiled"):
        compiled(loss_fn)(logits)


def test_bad_input_under_compile_names_the_problem():
    x, weight = leaf(3, 37), leaf(36)
    with pytest.raises(Exception, match="does not match the last dimension of x"):
        compiled(lambda x, w: rms_norm(x, w, 1e-5))(x, weight)


# ----------------------------------------------------------------------------------------------------------------------
# The tiny LLaMA with every kernel, compiled whole
# ----------------------------------------------------------------------------------------------------------------------
@pytest.fixture
def patched_tiny_llama():
    """The tiny LLaMA as finetune_optimized.py runs it: fused RMSNorm, SwiGLU MLP and RoPE (the RoPE patch is
    process-wide: restored after the test)."""
    model = tiny_model(finetune_optimized, seed=10)
    original_rope = modeling_llama.apply_rotary_pos_emb
    assert finetune_optimized.apply_rope(model) == 2
    yield model
    modeling_llama.apply_rotary_pos_emb = original_rope


@pytest.mark.parametrize("loss_impl", ["linear_ce", "ce"])
def test_tiny_llama_compiles_whole(patched_tiny_llama, loss_impl):
    model = patched_tiny_llama
    generator = torch.Generator().manual_seed(11)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=generator).to(DEVICE)
    labels = input_ids.clone()
    labels[0, :6] = -100  # a masked prompt
    shift_labels = finetune_optimized.shift_labels_of(labels)
    model_with_loss = finetune_optimized.ModelWithLoss(model, loss_impl, lce_chunk_size=8)

    def step(module):
        model.zero_grad(set_to_none=True)
        loss, accuracy = module(input_ids, shift_labels)
        loss.backward()
        return loss.detach(), accuracy, {name: p.grad for name, p in model.named_parameters()}

    eager_loss, eager_accuracy, eager_grads = step(model_with_loss)
    loss, accuracy, grads = step(torch.compile(model_with_loss, backend="aot_eager", fullgraph=True))
    # The same ops in the same order, but AOT autograd may decompose a few of PyTorch's own (not ours): fp32 rounding.
    torch.testing.assert_close(loss, eager_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(accuracy, eager_accuracy, rtol=0, atol=0)
    reference = model(input_ids=input_ids, labels=labels).loss  # transformers' own loss, eager
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-5, atol=0)
    for name, eager_grad in eager_grads.items():
        torch.testing.assert_close(grads[name], eager_grad, rtol=1e-5, atol=1e-6 * eager_grad.abs().max().item(),
                                   msg=name)


@pytest.mark.parametrize("script, variant", [("finetune_optimized.py", "rmsnorm+linear_ce+swiglu+rope+compile"),
                                             ("finetune_baseline.py", "compile")])
def test_finetune_compile_end_to_end(script, variant, tmp_path):
    out = tmp_path / "compiled.json"
    cmd = [sys.executable, str(ROOT / script), "--model", "tiny", "--dtype", "fp32", "--steps", "1",
           "--seq-len", "16", "--compile", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["variant"] == variant
    assert result["options"]["compile"]
    assert result["compile_backend"] == ("inductor" if torch.cuda.is_available() else "aot_eager")
    assert "torch.compile: backend" in proc.stdout and len(result["losses"]) == 1


@pytest.mark.parametrize("flags, message", [
    (["--compile-mode", "reduce-overhead"], "--compile-mode goes with --compile"),
    (["--compile", "--fsdp"], "--fsdp cannot be combined with --compile"),
])
def test_compile_flag_errors(flags, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # past --fsdp's launcher check, to its combination check
    with pytest.raises(SystemExit):
        finetune_optimized.parse_args(["--model", "tiny", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's backend, aot_eager, is what has no modes")
def test_compile_mode_needs_a_gpu(capsys):
    with pytest.raises(SystemExit):
        finetune_optimized.parse_args(["--model", "tiny", "--compile", "--compile-mode", "reduce-overhead"])
    assert "--compile-mode goes with --compile, on a GPU" in capsys.readouterr().err


def test_compile_mode_is_in_the_default_json_name():
    """Parsed without parse_args's checks: on the CPU --compile-mode is an error, but the name is the same rule."""
    args = finetune_optimized.build_parser().parse_args(["--model", "tiny", "--seq-len", "32", "--compile",
                                                         "--compile-mode", "reduce-overhead"])
    name = finetune_optimized.default_out_path(args, "random", "float32", "rmsnorm+linear_ce+swiglu+rope+compile",
                                               1).name
    assert name == ("finetune_optimized_tiny-random_rmsnorm+linear_ce+swiglu+rope+compile_float32_1x32_"
                    "compile-mode=reduce-overhead.json")
