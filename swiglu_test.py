"""Correctness tests for swiglu_kernel.py: the fused silu(gate) * up forward and its backward, and the LlamaMLP swap;
GeGLU (the tanh GELU for silu) and Falcon-H1's gate multiplier in the same kernels, and the GemmaMLP swap.

How a result is judged: every check builds a float64 reference from the SAME rounded inputs the kernel sees, measures
PyTorch's own error in the kernel's dtype (eager `F.silu(gate) * up` and its autograd backward, i.e. what transformers
runs), and requires
    max|ours - reference| <= 2 * max|torch - reference| + eps(dtype) * max|reference|
(the last term is one unit in the last place at the tensor's largest magnitude: 0.8 % of it in bf16, so an all-zero or
wrongly-formulated result fails). The forward, dgate and dup are all checked. The same rule holds on the GPU and on
the CPU interpreter (the kernels round bf16 to nearest on both), and out and dup must equal eager's bit for bit except
for rare last-bit differences, which only transformers' cast order gives.

GeGLU and the gate multiplier are held to the same rule (against F.gelu(approximate="tanh") and act(gate * m) in float64
and in the kernel's dtype), each in fp32, bf16 and fp16, and to the same bits (transformers' GemmaMLP and FalconH1MLP
round the activation, and FalconH1MLP the scaled gate, to the dtype). TritonGemmaMLP and TritonLlamaMLP around a
FalconH1MLP are checked against transformers' modules with random weights.

`python swiglu_test.py` runs these tests with pytest and prints a PASSED/FAILED line per check. Without a GPU the
kernels run on the CPU interpreter, so CPU shapes are small; the GPU-only tests use LLaMA-3.1-8B's MLP shape.
"""
import argparse
import copy
import math
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

import swiglu_kernel  # sets TRITON_INTERPRET=1 before importing triton when there is no GPU
from swiglu_kernel import (TritonGemmaMLP, TritonLlamaMLP, geglu, replace_gemma_mlp, replace_llama_mlp, swiglu,
                           swiglu_backward, swiglu_forward, swiglu_gate_up)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The tanh GELU's sigmoid argument grows as g^3, so exp(-s) overflows to inf for gates below about -10, and g^3 itself
# past 1e13, as intended (the results are the correct limits); the CPU interpreter computes with numpy, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning",
                                        "ignore:overflow encountered in multiply:RuntimeWarning")
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}  # what transformers runs


def gelu_tanh_float64(t):
    """The tanh GELU as g * sigmoid(2z), the same function (1 + tanh(z) = 2 sigmoid(2z)), for float64 references:
    the tanh form loses every digit to 1 + tanh(z) cancelling below g = -6 even in float64, this form none."""
    return t * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3))


EXACT_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh_float64}


# ----------------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------------
def seed_for(*case):
    """A different but reproducible random stream for every case."""
    torch.manual_seed(zlib.crc32(repr(case).encode()))


def reference(gate, up, dy, activation="silu", gate_multiplier=1.0):
    """float64 act(gate * gate_multiplier) * up and its gradients from the same (already rounded) inputs: the exact
    math, no roundings. SwiGLU's in closed form; the others through float64 autograd."""
    g, u, d = gate.double(), up.double(), dy.double()
    if activation == "silu" and gate_multiplier == 1.0:
        sig = torch.sigmoid(g)
        return g * sig * u, d * u * sig * (1 + g * (1 - sig)), d * g * sig
    g, u = g.requires_grad_(), u.requires_grad_()
    out = EXACT_ACTIVATIONS[activation](g * gate_multiplier) * u
    out.backward(d)
    return out.detach(), g.grad, u.grad


def eager(gate, up, dy, activation="silu", gate_multiplier=1.0):
    """What transformers runs, in the inputs' dtype, and autograd's backward: LlamaMLP's F.silu(gate) * up, GemmaMLP's
    F.gelu(gate, approximate="tanh") * up, FalconH1MLP's up * F.silu(gate * gate_multiplier)."""
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    out = ACTIVATIONS[activation](gate * gate_multiplier if gate_multiplier != 1.0 else gate) * up
    out.backward(dy)
    return out.detach(), gate.grad, up.grad


def ours(gate, up, dy, activation="silu", gate_multiplier=1.0):
    """The fused kernels through autograd. detach() keeps the inputs' strides, so views stay views."""
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    out = swiglu(gate, up, gate_multiplier=gate_multiplier) if activation == "silu" else geglu(gate, up)
    assert len(out.grad_fn.saved_tensors) == 2, "only gate and up should be saved (the activation is recomputed)"
    out.backward(dy)
    return out.detach(), gate.grad, up.grad


def assert_no_worse_than_torch(what, ours_val, torch_val, ref, k=2.0, terms=None):
    """ours' largest error at most k times PyTorch's plus a floor of two roundings at the size of the terms that make
    the value (terms: their absolute sum, elementwise; by default the value itself). A max over many elements always
    meets PyTorch's own rounding errors; over a few, PyTorch may round exactly where the kernel, rounding once more,
    does not, and a value that cancels (dgate near g = -1.28) carries the rounding of its terms, not of itself."""
    assert ours_val.shape == ref.shape and ours_val.dtype == torch_val.dtype, f"{what}: wrong shape or dtype"
    ref_max = ref.abs().max().item()
    assert ref_max > 0, f"{what}: the reference is all zeros, so this check could not fail"
    ours_err = (ours_val.double() - ref).abs().max().item()
    torch_err = (torch_val.double() - ref).abs().max().item()
    floor = 2 * torch.finfo(torch_val.dtype).eps * (ref.abs() if terms is None else terms).max().item()
    assert ours_err <= k * torch_err + floor, (
        f"{what}: max error {ours_err:.3e} > {k} x torch's {torch_err:.3e} + {floor:.3e} (max |ref| {ref_max:.3e})")


def check_against_reference(gate, up, dy, activation="silu", gate_multiplier=1.0):
    options = (activation, gate_multiplier)
    terms = [None, None, None]
    if activation == "silu" and gate_multiplier == 1.0:  # dgate = dy * up * sigmoid(g) * (1 + g * (1 - sigmoid(g)))
        g, sig = gate.double(), torch.sigmoid(gate.double())
        terms[1] = (dy.double() * up.double()).abs() * sig * (1 + g.abs() * (1 - sig))
    for what, o, t, r, s in zip(("out", "dgate", "dup"), ours(gate, up, dy, *options), eager(gate, up, dy, *options),
                                reference(gate, up, dy, *options), terms):
        assert_no_worse_than_torch(what, o, t, r, terms=s)


def assert_cast_order(gate, up, dy, activation="silu", gate_multiplier=1.0):
    """The error rule cannot tell one rounding from two, so compare bits with eager: with transformers' cast order
    (round silu to the dtype, multiply, round again) out and dup match `F.silu(gate) * up` and its autograd dup except
    for rare last-bit differences between exp implementations; skipping the intermediate rounding changes ~25 % of
    fp16 outputs. dgate is compared with the float64 dgate rounded to nearest once: autograd rounds dy * up before
    silu', we do not, so ours is that single rounding (a truncating cast would match only about half the values).
    With a gate multiplier, the scaled gate is rounded first in both (FalconH1MLP's gate * m is a tensor). PyTorch's
    tanh GELU loses digits where 1 + tanh(z) cancels (in fp32 up to 23 % off for g in (-5, -2], 0 below about -5.5),
    the kernel's sigmoid form does not: GeGLU's out and dup are compared with the exact GELU rounded where
    transformers rounds it instead of with eager's."""
    options = (activation, gate_multiplier)
    out, dgate, dup = ours(gate, up, dy, *options)
    out_eager, _, dup_eager = eager(gate, up, dy, *options)
    scaled = (gate.float() * gate_multiplier).to(gate.dtype) if gate_multiplier != 1.0 else gate
    g, u, d = (t.double().requires_grad_() for t in (scaled, up, dy))
    if activation == "gelu_tanh":
        act = gelu_tanh_float64(g.detach()).to(gate.dtype).double()
        out_eager, dup_eager = (act * u.detach()).to(gate.dtype), (d * act).to(gate.dtype)
    (dact,) = torch.autograd.grad(EXACT_ACTIVATIONS[activation](g).sum(), g)
    dgate_once = (d * u * dact * gate_multiplier).to(gate.dtype)
    for what, o, e in (("out", out, out_eager), ("dup", dup, dup_eager), ("dgate", dgate, dgate_once)):
        same = (o == e).float().mean().item()
        assert same > 0.99, f"{what}: only {same:.2%} of the values equal the expected bits: cast order differs?"


# ----------------------------------------------------------------------------------------------------------------------
# The kernels against the reference
# ----------------------------------------------------------------------------------------------------------------------
# Odd intermediate sizes (17, 1000, 1376 are not multiples of any block), a single element, 3-D input, and shapes
# whose default tiles overhang the last row tile (40 x 1000) or the last column tile (2 x 20000).
SHAPES = [(8, 17), (5, 1000), (3, 1376), (2, 3, 176), (1, 1), (40, 1000), (2, 20000)]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(shape, dtype_name):
    seed_for("fwd_bwd", shape, dtype_name)
    dtype = DTYPES[dtype_name]
    gate, up, dy = (torch.randn(shape, device=DEVICE).mul(3).to(dtype) for _ in range(3))
    check_against_reference(gate, up, dy)


def _layout(name, dtype):
    """(gate, up, dy) laid out as named; gate/up/dy carry random values in every case."""
    rows, n = 10, 176
    randn = lambda *s: torch.randn(*s, device=DEVICE).mul(3).to(dtype)  # noqa: E731
    if name == "chunked gate_up":   # halves of a fused [.., 2I] projection: row stride 2I, no copy
        gate, up = randn(2, 5, 2 * n).chunk(2, dim=-1)
        assert swiglu_kernel._as_rows(gate).data_ptr() == gate.data_ptr(), "a chunk view should not be copied"
        return gate, up, randn(2, 5, n)
    if name == "row-strided grad":  # dy is a slice of a wider buffer
        return randn(rows, n), randn(rows, n), randn(rows, n + 7)[:, :n]
    if name == "column-strided grad":  # dy's last-dim stride is 2: the launcher must copy it
        return randn(rows, n), randn(rows, n), randn(rows, 2 * n)[:, ::2]
    if name == "transposed inputs":  # last-dim stride != 1 for gate and up
        return randn(n, rows).t(), randn(n, rows).t(), randn(rows, n)
    if name == "broadcast gate":  # row stride 0: every row reads the same gate row
        return randn(1, n).expand(rows, n), randn(rows, n), randn(rows, n)
    raise KeyError(name)


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
@pytest.mark.parametrize("layout", ["chunked gate_up", "row-strided grad", "column-strided grad", "transposed inputs",
                                    "broadcast gate"])
def test_layout(layout, dtype_name):
    seed_for("layout", layout, dtype_name)
    check_against_reference(*_layout(layout, DTYPES[dtype_name]))


@pytest.mark.parametrize("block_size,block_rows", [(16, 4), (64, 1), (32, 16)])
def test_block_overrides(block_size, block_rows):
    """The launchers' tile overrides (which exist for this test) give the same bits as the defaults, here with tiles
    that overhang the tensor on both axes of a grid of several row and column blocks."""
    seed_for("overrides", block_size, block_rows)
    gate, up, dy = (torch.randn(9, 50, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    tile = dict(block_size=block_size, block_rows=block_rows)
    assert torch.equal(swiglu_forward(gate, up, **tile), swiglu_forward(gate, up))
    for tuned, default in zip(swiglu_backward(gate, up, dy, **tile), swiglu_backward(gate, up, dy)):
        assert torch.equal(tuned, default)
    check_against_reference(gate, up, dy)


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_cast_order(dtype_name):
    seed_for("cast_order", (64, 1376), dtype_name)
    gate, up, dy = (torch.randn(64, 1376, device=DEVICE).mul(3).to(DTYPES[dtype_name]) for _ in range(3))
    assert_cast_order(gate, up, dy)


# (activation, gate_multiplier): GeGLU, and SwiGLU with a multiplier that is not a power of two (its product rounds).
OPTIONS = [("gelu_tanh", 1.0), ("silu", 0.7)]


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("activation,gate_multiplier", OPTIONS, ids=str)
def test_options_forward_backward(activation, gate_multiplier, dtype_name):
    """An odd shape whose default tile overhangs the last row tile; gates up to about +-12, where the GELU's sigmoid
    argument (cubic in g) overflows exp."""
    seed_for("options", activation, gate_multiplier, dtype_name)
    gate, up, dy = (torch.randn(24, 1000, device=DEVICE).mul(3).to(DTYPES[dtype_name]) for _ in range(3))
    check_against_reference(gate, up, dy, activation, gate_multiplier)


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
@pytest.mark.parametrize("activation,gate_multiplier", OPTIONS, ids=str)
def test_options_cast_order(activation, gate_multiplier, dtype_name):
    seed_for("options_cast_order", activation, gate_multiplier, dtype_name)
    gate, up, dy = (torch.randn(16, 1376, device=DEVICE).mul(3).to(DTYPES[dtype_name]) for _ in range(3))
    assert_cast_order(gate, up, dy, activation, gate_multiplier)


def test_geglu_far_from_zero():
    """Gates so large that g^3 and g^2 overflow fp32: the GELU is g or -0 there and its slope 1 or 0 (float64 says so
    too), never NaN; PyTorch's own fp32 backward gives NaN at 1e30 (0 * inf)."""
    gate = torch.tensor([-1e30, -1e14, -30.0, -10.5, 10.5, 30.0, 1e14, 1e30], device=DEVICE)
    up = torch.full_like(gate, 0.75)
    dy = torch.full_like(gate, -2.0)
    out, dgate, dup = ours(gate, up, dy, "gelu_tanh")
    for what, o, r in zip(("out", "dgate", "dup"), (out, dgate, dup), reference(gate, up, dy, "gelu_tanh")):
        torch.testing.assert_close(o.double(), r, rtol=1e-6, atol=1e-30, msg=what)


@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 176), (4, 0)], ids=str)
def test_empty(shape):
    gate, up = (torch.randn(shape, device=DEVICE).requires_grad_() for _ in range(2))
    out = swiglu(gate, up)
    assert out.shape == shape
    out.backward(torch.randn(shape, device=DEVICE))
    assert gate.grad.shape == shape and up.grad.shape == shape


def _bad_inputs():
    """(name, call, expected exception, words the message must contain)."""
    x = torch.randn(4, 16, device=DEVICE)
    bf = x.bfloat16()
    return [
        ("shape mismatch", lambda: swiglu(x, torch.randn(4, 17, device=DEVICE)), ValueError, "same shape"),
        ("dtype mismatch", lambda: swiglu(bf, x), TypeError, "same dtype"),
        ("integer inputs", lambda: swiglu(x.int(), x.int()), TypeError, "dtype"),
        ("float64 inputs", lambda: swiglu(x.double(), x.double()), TypeError, "supported"),
        ("device mismatch", lambda: swiglu(x, torch.empty(4, 16, device="meta")), ValueError, "same device"),
        ("unsupported device", lambda: swiglu(*torch.empty(2, 4, 16, device="meta")), ValueError, "meta"),
        ("scalar inputs", lambda: swiglu(x[0, 0], x[0, 1]), ValueError, "at least one dimension"),
        ("not a tensor", lambda: swiglu([1.0], x), TypeError, "torch.Tensor"),
        ("dy shape", lambda: swiglu_backward(x, x, x[:, :8]), ValueError, "dy"),
        ("dy dtype", lambda: swiglu_backward(x, x, bf), TypeError, "dy"),
        ("block_size not 2^k", lambda: swiglu_forward(x, x, block_size=100), ValueError, "power of two"),
        ("gate_multiplier nan", lambda: swiglu(x, x, gate_multiplier=float("nan")), ValueError,
         "gate_multiplier must be a finite number"),
        ("gate_multiplier not a number", lambda: swiglu(x, x, gate_multiplier="2"), TypeError,
         "gate_multiplier must be a float"),
        ("down_multiplier inf", lambda: TritonLlamaMLP(4, 8, down_multiplier=float("inf")), ValueError,
         "down_multiplier must be a finite number"),
    ]


@pytest.mark.parametrize("name", [name for name, *_ in _bad_inputs()])
def test_bad_input(name):
    _, call, error, words = next(case for case in _bad_inputs() if case[0] == name)
    with pytest.raises(error, match=words):
        call()


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--intermediate", "-3"]])
def test_kernel_script_refuses_bad_sizes(argv, capsys):
    """Run as a script, the kernel file answers a size it cannot run with one usage error (exit code 2)."""
    with pytest.raises(SystemExit) as exit_info:
        swiglu_kernel.main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_inplace_backward(dtype_name):
    """inplace_backward=True: the same bits as the default, the gradients written over gate and up (no new buffers,
    also for the two halves of one fused projection), a clear error on a second backward, and fresh buffers when gate
    and up are one tensor."""
    seed_for("inplace_backward", dtype_name)
    dtype = DTYPES[dtype_name]
    x = torch.randn(6, 40, device=DEVICE, dtype=dtype, requires_grad=True)
    w_gate, w_up = (torch.randn(40, 72, device=DEVICE, dtype=dtype) for _ in range(2))
    dy = torch.randn(6, 72, device=DEVICE, dtype=dtype)

    def run(inplace):
        x.grad = None
        gate, up = x @ w_gate, x @ w_up  # private intermediates, as inside an MLP
        pointers = (gate.data_ptr(), up.data_ptr())
        captured = {}
        gate.register_hook(lambda g: captured.setdefault("dgate", g))
        out = swiglu(gate, up, inplace_backward=inplace)
        out.backward(dy, retain_graph=True)
        return out.detach(), x.grad.clone(), captured["dgate"], pointers, out

    out_ref, dx_ref, dgate_ref, _, _ = run(False)
    out, dx, dgate, (gate_ptr, _), graph = run(True)
    assert torch.equal(out, out_ref) and torch.equal(dx, dx_ref) and torch.equal(dgate, dgate_ref)
    assert dgate.data_ptr() == gate_ptr, "in-place backward must write dgate into gate's own buffer"
    with pytest.raises(RuntimeError, match="retain_graph"):
        graph.backward(dy)
    w_both = torch.randn(40, 144, device=DEVICE, dtype=dtype)

    def run_halves(inplace):  # gate and up: the two halves of one fused projection, as in Phi-3's MLP
        x.grad = None
        both = x @ w_both
        gate, up = both.chunk(2, dim=-1)
        captured = {}
        gate.register_hook(lambda g: captured.setdefault("dgate", g))
        swiglu(gate, up, inplace_backward=inplace).backward(dy)
        return x.grad.clone(), captured["dgate"], both.data_ptr()

    dx_ref, dgate_ref, _ = run_halves(False)
    dx, dgate, both_ptr = run_halves(True)
    assert torch.equal(dx, dx_ref) and torch.equal(dgate, dgate_ref)
    assert dgate.data_ptr() == both_ptr, "the halves of one projection must take their gradients in place too"
    same = torch.randn(6, 72, device=DEVICE, dtype=dtype)  # swiglu(g, g): dgate and dup must not share a buffer
    gate = same.clone().requires_grad_()
    swiglu(gate, gate, inplace_backward=True).backward(dy)
    _, dgate_ref, dup_ref = ours(same, same, dy)
    assert torch.equal(gate.grad, dgate_ref + dup_ref)


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(6, 2 * 72), (2, 3, 2 * 1000)], ids=str)
def test_swiglu_gate_up(shape, dtype_name):
    """swiglu_gate_up(gate_up): the forward and gate_up's gradient against float64 and eager's chunk + silu * up, the
    gradient written over gate_up's own buffer (no cat of the halves' gradients), a clear error on a second backward,
    and a transposed gate_up (no row view to write through) still right, through fresh buffers."""
    seed_for("gate_up", shape, dtype_name)
    dtype = DTYPES[dtype_name]
    gate_up = torch.randn(shape, device=DEVICE).mul(3).to(dtype)
    dy = torch.randn(*shape[:-1], shape[-1] // 2, device=DEVICE).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out_ref, dgate_ref, dup_ref = reference(gate, up, dy)
    out_eager, dgate_eager, dup_eager = eager(gate, up, dy)

    leaf = gate_up.clone().requires_grad_()
    projected = leaf * 1  # a private intermediate, as the projection's output is inside the MLP
    captured = {}
    projected.register_hook(lambda g: captured.setdefault("grad", g))
    out = swiglu_gate_up(projected)
    out.backward(dy, retain_graph=True)
    dgate, dup = captured["grad"].chunk(2, dim=-1)
    for what, o, t, r in (("out", out.detach(), out_eager, out_ref), ("dgate", dgate, dgate_eager, dgate_ref),
                          ("dup", dup, dup_eager, dup_ref)):
        assert_no_worse_than_torch(what, o, t, r)
    assert captured["grad"].data_ptr() == projected.data_ptr(), "the gradient must lie in gate_up's own buffer"
    assert torch.equal(leaf.grad, captured["grad"])
    with pytest.raises(RuntimeError, match="retain_graph"):
        out.backward(dy)

    transposed = gate_up.transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
    swiglu_gate_up(transposed).backward(dy)
    assert torch.equal(transposed.grad, torch.cat([dgate, dup], dim=-1))
    with pytest.raises(ValueError, match="must be even"):
        swiglu_gate_up(torch.randn(4, 7, device=DEVICE))


# ----------------------------------------------------------------------------------------------------------------------
# The transformers integration, against a real LlamaMLP / LlamaForCausalLM with random weights
# ----------------------------------------------------------------------------------------------------------------------
def _tiny_config(**overrides):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, **overrides)


def _run_mlp(mlp, x, dy):
    """Output, input gradient and every weight gradient (by name) of one forward/backward."""
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = mlp(x)
    out.backward(dy)
    return [("out", out.detach()), ("dx", x.grad)] + [(n, p.grad) for n, p in mlp.named_parameters()]


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_from_llama_mlp(dtype_name):
    from transformers.models.llama.modeling_llama import LlamaMLP
    seed_for("from_llama_mlp", dtype_name)
    dtype = DTYPES[dtype_name]
    mlp = LlamaMLP(_tiny_config()).to(DEVICE, dtype)  # nn.Linear's default init: random, never ones or zeros
    mlp_fp64 = copy.deepcopy(mlp).double()
    x, dy = torch.randn(2, 7, 64, device=DEVICE).to(dtype), torch.randn(2, 7, 64, device=DEVICE).to(dtype)

    params_before = dict(mlp.named_parameters())
    triton_mlp = TritonLlamaMLP.from_llama_mlp(mlp)
    assert dict(triton_mlp.named_parameters()) == params_before  # the SAME Parameter objects, same names
    assert all(triton_mlp.get_parameter(n) is p for n, p in params_before.items())
    assert list(triton_mlp.state_dict()) == list(mlp.state_dict()) == ["gate_proj.weight", "up_proj.weight",
                                                                       "down_proj.weight"]
    ref, torch_run, ours_run = _run_mlp(mlp_fp64, x.double(), dy.double()), _run_mlp(mlp, x, dy), \
        _run_mlp(triton_mlp, x, dy)
    for (what, r), (_, t), (_, o) in zip(ref, torch_run, ours_run):
        assert_no_worse_than_torch(what, o, t, r)


def test_from_gemma_mlp():
    """GemmaMLP (tanh GELU) in bf16: the same Parameters; output, input gradient and every weight gradient no worse
    than transformers' module against a float64 copy. The module's in-place backward runs here."""
    from transformers import GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    seed_for("from_gemma_mlp")
    config = GemmaConfig(hidden_size=64, intermediate_size=176, hidden_act="gelu_pytorch_tanh")
    mlp = GemmaMLP(config).to(DEVICE, torch.bfloat16)
    mlp_fp64 = copy.deepcopy(mlp).double()
    x, dy = (torch.randn(2, 7, 64, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    triton_mlp = TritonGemmaMLP.from_gemma_mlp(mlp)
    assert all(triton_mlp.get_parameter(n) is p for n, p in mlp.named_parameters())
    assert list(triton_mlp.state_dict()) == list(mlp.state_dict())
    ref, torch_run, ours_run = _run_mlp(mlp_fp64, x.double(), dy.double()), _run_mlp(mlp, x, dy), \
        _run_mlp(triton_mlp, x, dy)
    for (what, r), (_, t), (_, o) in zip(ref, torch_run, ours_run):
        assert_no_worse_than_torch(what, o, t, r)
    with pytest.raises(ValueError, match="gelu_tanh.*config.hidden_act must be 'gelu_pytorch_tanh'"):
        TritonGemmaMLP.from_gemma_mlp(GemmaMLP(GemmaConfig(hidden_size=64, intermediate_size=176, hidden_act="silu")))


def test_falcon_h1_multipliers():
    """FalconH1MLP: down_proj(up * silu(gate * m_gate)) * m_down, bf16. from_llama_mlp keeps its multipliers (the
    gate's in the kernel, the output's in torch); every result no worse than transformers' against float64."""
    from transformers import FalconH1Config
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1MLP
    seed_for("falcon_h1")
    config = FalconH1Config(hidden_size=64, intermediate_size=176, mlp_multipliers=[0.7, 1.3], mlp_bias=True)
    mlp = FalconH1MLP(config).to(DEVICE, torch.bfloat16)
    mlp_fp64 = copy.deepcopy(mlp).double()
    x, dy = (torch.randn(2, 7, 64, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    triton_mlp = TritonLlamaMLP.from_llama_mlp(mlp)
    assert (triton_mlp.gate_multiplier, triton_mlp.down_multiplier) == (0.7, 1.3)
    ref, torch_run, ours_run = _run_mlp(mlp_fp64, x.double(), dy.double()), _run_mlp(mlp, x, dy), \
        _run_mlp(triton_mlp, x, dy)
    for (what, r), (_, t), (_, o) in zip(ref, torch_run, ours_run):
        assert_no_worse_than_torch(what, o, t, r)


def test_replace_gemma_mlp():
    """GemmaMLP and Gemma2MLP are swapped, sharing their Linear layers; an MLP whose act_fn is not the tanh GELU
    refuses the whole swap."""
    from transformers import Gemma2Config, GemmaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP
    sizes = dict(hidden_size=64, intermediate_size=176, hidden_activation="gelu_pytorch_tanh")
    model = torch.nn.ModuleDict({"a": GemmaMLP(GemmaConfig(hidden_act="gelu_pytorch_tanh", **sizes)),
                                 "b": Gemma2MLP(Gemma2Config(**sizes))})
    params_before = dict(model.named_parameters())
    with pytest.raises(ValueError, match="found 2 GemmaMLP modules to replace, expected 3"):
        replace_gemma_mlp(model, expected=3)
    assert replace_gemma_mlp(model, expected=2) == 2
    assert all(isinstance(m, TritonGemmaMLP) for m in model.values())
    assert all(model.get_parameter(n) is p for n, p in params_before.items())
    model["c"] = GemmaMLP(GemmaConfig(hidden_act="gelu", **sizes))  # the exact GELU, not the tanh one
    with pytest.raises(ValueError, match="gelu_tanh"):
        replace_gemma_mlp(model)
    assert type(model["c"]).__name__ == "GemmaMLP", "a failed replace must change nothing"


def test_non_silu_rejected():
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaModel
    with pytest.raises(ValueError, match="silu"):
        TritonLlamaMLP.from_llama_mlp(LlamaMLP(_tiny_config(hidden_act="gelu")))
    model = LlamaModel(_tiny_config(hidden_act="gelu"))
    with pytest.raises(ValueError, match="silu"):
        replace_llama_mlp(model)
    assert all(type(layer.mlp).__name__ == "LlamaMLP" for layer in model.layers), "a failed replace must change nothing"


def test_replace_llama_mlp():
    from transformers import LlamaForCausalLM
    seed_for("replace_llama_mlp")
    model = LlamaForCausalLM(_tiny_config()).to(DEVICE)  # fp32: the swapped model must match almost exactly
    input_ids = torch.randint(0, 128, (2, 12), device=DEVICE)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    logits_before, grads_before = loss_and_grads()
    params_before, keys_before = dict(model.named_parameters()), list(model.state_dict())

    with pytest.raises(ValueError, match="found 2 LlamaMLP modules to replace, expected 3"):
        replace_llama_mlp(model, expected=3)
    assert not any(isinstance(layer.mlp, TritonLlamaMLP) for layer in model.model.layers), "refused: no change"
    assert replace_llama_mlp(model, expected=2) == 2
    assert all(isinstance(layer.mlp, TritonLlamaMLP) for layer in model.model.layers)
    params_after = dict(model.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[n] is p for n, p in params_before.items()), "parameters must be reused, not copied"
    assert list(model.state_dict()) == keys_before

    logits_after, grads_after = loss_and_grads()
    torch.testing.assert_close(logits_after, logits_before)  # fp32 defaults: rtol 1.3e-6, atol 1e-5
    for name, grad in grads_before.items():
        torch.testing.assert_close(grads_after[name], grad, msg=lambda m, name=name: f"{name}: {m}")


# ----------------------------------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------------------------------
@needs_cuda
def test_llama_shape_gpu():
    """LLaMA-3.1-8B's MLP at 4 x 512 tokens, bf16: error rule and bit-for-bit cast order."""
    seed_for("llama_shape")
    gate, up, dy = (torch.randn(4 * 512, 14336, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    check_against_reference(gate, up, dy)
    assert_cast_order(gate, up, dy)


@needs_cuda
def test_cpu_tensors_rejected_on_gpu():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="run on cuda"):
        swiglu(x, x)


@needs_cuda
def test_int64_offsets_gpu():
    """More than 2^31 elements per tensor: int32 offsets would wrap. Checks the last rows against eager."""
    n_cols = 14336
    n_rows = 2**31 // n_cols + 2  # 149797 rows; 4.3 GB per bf16 tensor, ~26 GB for the six tensors
    if torch.cuda.mem_get_info()[0] < 40 * 2**30:
        pytest.skip("needs 40 GiB of free GPU memory")
    gate, up, dy = (torch.randn(n_rows, n_cols, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = swiglu_forward(gate, up)
    dgate, dup = swiglu_backward(gate, up, dy)
    tail = slice(n_rows - 3, n_rows)  # these elements sit past 2^31
    check_against_reference(gate[tail], up[tail], dy[tail])
    assert torch.equal(out[tail], swiglu_forward(gate[tail], up[tail]))
    for full, part in zip((dgate, dup), swiglu_backward(gate[tail], up[tail], dy[tail])):
        assert torch.equal(full[tail], part)


if __name__ == "__main__":
    # `python x_test.py` runs pytest on this file and ends with one PASSED / FAILED / SKIPPED line per check (pytest's
    # -rA summary); other arguments go to pytest (e.g. -k bf16). --help prints what is checked and how it passes.
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _, pytest_args = parser.parse_known_args()
    sys.exit(pytest.main([__file__, "-q", "-rA", "-p", "no:cacheprovider", *pytest_args]))
