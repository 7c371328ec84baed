"""Correctness tests for rope_kernel.py: the fused rotary position embedding of q and k, its backward, and the patch
of transformers' LLaMA attention.

How a result is judged: every check builds a float64 reference from the SAME rounded inputs the kernel sees (the exact
formula q * cos + rotate_half(q) * sin, no roundings), measures PyTorch's own error in the kernel's dtype (transformers'
`apply_rotary_pos_emb` and its autograd backward, i.e. what LLaMA runs), and requires, for q_embed, k_embed, dq and dk,
    max|ours - reference| <= 2 * max|torch - reference| + eps(dtype) * max|reference|
(the last term is one unit in the last place at the tensor's largest magnitude: 0.8 % of it in bf16, so an all-zero or
wrongly-signed result fails by a factor of ~100). The same rule holds on the GPU and on the CPU interpreter (the kernel
rounds bf16 to nearest on both). The kernel's single rounding is also checked bit for bit against one fp32
computation rounded once, and, at LLaMA's shape on the GPU, to be no worse than eager's three roundings.

cos and sin come from transformers' own LlamaRotaryEmbedding (llama3 and yarn scaling, the latter multiplies them by
1.14) at random positions, or, to check the general backward formula, from random angles whose two halves differ.
q and k are the non-contiguous views LlamaAttention passes (`.view(B, T, heads, D).transpose(1, 2)`) or contiguous.
A 2-D [T, D] cos/sin table gives the same bits as the [1, T, D] table it stands for (whose results are checked as
above); an odd head_dim is refused with a message that says why.

`python rope_test.py` runs these tests with pytest and prints a PASSED/FAILED line per check. Without a GPU the kernel
runs on the CPU interpreter, so CPU shapes are small; the GPU-only tests use LLaMA-3.1-8B's attention shape.
"""
import argparse
import sys
import zlib

import pytest
import torch

import rope_kernel  # sets TRITON_INTERPRET=1 before importing triton when there is no GPU
from rope_kernel import apply_rope, apply_rotary_pos_emb, rope_backward, rope_forward, split_qkv

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402  (after the kernel module: Triton set-up)
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

HF_APPLY_ROPE = modeling_llama.apply_rotary_pos_emb  # transformers' own function (the eager path), never ours
assert HF_APPLY_ROPE is not apply_rotary_pos_emb, "rope_test must be imported before anything patches transformers"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROPE_PARAMETERS = {
    # Llama-3.1's: low frequencies divided by 8, attention_scaling 1.
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192),
    # YaRN: also rescales cos and sin themselves (attention_scaling = 0.1 ln 4 + 1 = 1.139), so |cos| exceeds 1.
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=2048),
}
MAX_POSITIONS = {"llama3": 131072, "yarn": 8192}  # consistent with each scaling (transformers warns otherwise)


# ----------------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------------
def seed_for(*case):
    """A different but reproducible random stream for every case."""
    torch.manual_seed(zlib.crc32(repr(case).encode()))


def llama_cos_sin(cos_batch, tokens, head_dim, dtype, rope_type):
    """cos, sin [cos_batch, tokens, head_dim] from transformers' LlamaRotaryEmbedding at random positions (a random
    start per sequence, as in a packed batch: no position 0, so cos is not all ones and sin not all zeros)."""
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                         max_position_embeddings=MAX_POSITIONS[rope_type],
                         rope_parameters=dict(ROPE_PARAMETERS[rope_type]))
    rotary = LlamaRotaryEmbedding(config).to(DEVICE)
    start = torch.randint(1, 4096, (cos_batch, 1), device=DEVICE)
    position_ids = start + torch.arange(tokens, device=DEVICE)
    cos, sin = rotary(torch.empty(1, device=DEVICE, dtype=dtype), position_ids)  # x only sets the output dtype
    if tokens > 1:
        assert (cos != 1).any() and (sin != 0).any() and (cos != cos[..., :1]).any()
    return cos, sin


def general_cos_sin(cos_batch, tokens, head_dim, dtype):
    """Random angles and amplitudes in every column: the two halves differ, which LlamaRotaryEmbedding never makes
    but the function allows; it tells the exact backward (sin halves swapped) from 'the forward with sin negated'."""
    angle = torch.rand(cos_batch, tokens, head_dim, device=DEVICE) * 6.3
    amplitude = 0.5 + torch.rand(cos_batch, tokens, head_dim, device=DEVICE)
    return (amplitude * angle.cos()).to(dtype), (amplitude * angle.sin()).to(dtype)


def make_qk(batch, q_heads, kv_heads, tokens, head_dim, dtype, layout):
    """q [B, Hq, T, D], k [B, Hkv, T, D], random, laid out as LlamaAttention passes them or contiguous."""
    if layout == "llama":  # q_proj(x).view(B, T, heads, D).transpose(1, 2): non-contiguous views
        q = torch.randn(batch, tokens, q_heads, head_dim, device=DEVICE).mul(2).to(dtype).transpose(1, 2)
        k = torch.randn(batch, tokens, kv_heads, head_dim, device=DEVICE).mul(2).to(dtype).transpose(1, 2)
        assert tokens == 1 or q_heads == 1 or not q.is_contiguous()
        return q, k
    if layout == "contiguous":
        return (torch.randn(batch, heads, tokens, head_dim, device=DEVICE).mul(2).to(dtype)
                for heads in (q_heads, kv_heads))
    raise KeyError(layout)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(q, k, cos, sin, dq_embed, dk_embed, unsqueeze_dim=1):
    """float64 RoPE and its gradients from the same (already rounded) inputs: the exact math, no roundings."""
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    cos64, sin64 = cos.double().unsqueeze(unsqueeze_dim), sin.double().unsqueeze(unsqueeze_dim)
    q_embed, k_embed = q64 * cos64 + rotate_half(q64) * sin64, k64 * cos64 + rotate_half(k64) * sin64
    torch.autograd.backward((q_embed, k_embed), (dq_embed.double(), dk_embed.double()))
    return q_embed.detach(), k_embed.detach(), q64.grad, k64.grad


def run(fn, q, k, cos, sin, dq_embed, dk_embed, unsqueeze_dim=1):
    """(q_embed, k_embed, dq, dk) of fn through autograd. detach() keeps the inputs' strides, so views stay views."""
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    q_embed, k_embed = fn(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    torch.autograd.backward((q_embed, k_embed), (dq_embed, dk_embed))
    return q_embed.detach(), k_embed.detach(), q.grad, k.grad


def assert_no_worse_than_torch(what, ours_val, torch_val, ref, k=2.0):
    assert ours_val.shape == ref.shape and ours_val.dtype == torch_val.dtype, f"{what}: wrong shape or dtype"
    ref_max = ref.abs().max().item()
    assert ref_max > 0, f"{what}: the reference is all zeros, so this check could not fail"
    ours_err = (ours_val.double() - ref).abs().max().item()
    torch_err = (torch_val.double() - ref).abs().max().item()
    floor = torch.finfo(torch_val.dtype).eps * ref_max  # one unit in the last place at the largest magnitude
    assert ours_err <= k * torch_err + floor, (
        f"{what}: max error {ours_err:.3e} (relative to max |ref| {ours_err / ref_max:.2e}) > {k} x torch's "
        f"{torch_err:.3e} + {floor:.3e}")


def check_against_reference(q, k, cos, sin, dq_embed, dk_embed, unsqueeze_dim=1):
    ref = reference(q, k, cos, sin, dq_embed, dk_embed, unsqueeze_dim)
    ours = run(apply_rotary_pos_emb, q, k, cos, sin, dq_embed, dk_embed, unsqueeze_dim)
    eager = run(HF_APPLY_ROPE, q, k, cos, sin, dq_embed, dk_embed, unsqueeze_dim)
    for what, o, t, r in zip(("q_embed", "k_embed", "dq", "dk"), ours, eager, ref):
        assert_no_worse_than_torch(what, o, t, r)
    return ours


def upstream_grads(q, k):
    """Random gradients for q_embed and k_embed, contiguous (attention's backward decides their layout)."""
    return (torch.randn(t.shape, device=DEVICE).to(t.dtype) for t in (q, k))


# ----------------------------------------------------------------------------------------------------------------------
# The kernel against the reference
# ----------------------------------------------------------------------------------------------------------------------
# (batch, q_heads, kv_heads, tokens, head_dim, cos_batch, rope_type): tokens never a power of two or a multiple of
# a token block; GQA (kv < q heads) and MHA; cos per sequence (cos_batch = batch) or broadcast over the batch (1);
# head_dim 64, 128 and 10 / 6 (halves of 5 and 3 columns: padded tiles); LLaMA-3.1-8B's 32 / 8 heads.
SHAPES = [
    (1, 4, 2, 13, 64, 1, "llama3"),
    (2, 4, 4, 7, 128, 2, "yarn"),
    (2, 6, 2, 5, 128, 1, "llama3"),
    (1, 3, 1, 9, 10, 1, "yarn"),
    (2, 2, 1, 3, 6, 2, "llama3"),
    (1, 32, 8, 3, 128, 1, "yarn"),
]
LAYOUTS = ["llama", "contiguous"]


def forward_backward_case(shape, dtype_name, layout):
    seed_for("fwd_bwd", shape, dtype_name, layout)
    batch, q_heads, kv_heads, tokens, head_dim, cos_batch, rope_type = shape
    dtype = DTYPES[dtype_name]
    q, k = make_qk(batch, q_heads, kv_heads, tokens, head_dim, dtype, layout)
    cos, sin = llama_cos_sin(cos_batch, tokens, head_dim, dtype, rope_type)
    q_embed, k_embed, dq, dk = check_against_reference(q, k, cos, sin, *upstream_grads(q, k))
    # The outputs keep the inputs' layout: SDPA sees the strides it sees in eager.
    assert q_embed.stride() == q.stride() and k_embed.stride() == k.stride()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_backward(shape, dtype_name, layout):
    forward_backward_case(shape, dtype_name, layout)


def test_forward_backward_fp16():
    forward_backward_case(SHAPES[0], "fp16", "llama")


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_general_cos_sin(dtype_name):
    """cos/sin halves that differ: only the exact backward formula passes (the 'negate sin' shortcut would not)."""
    seed_for("general", dtype_name)
    dtype = DTYPES[dtype_name]
    q, k = make_qk(2, 4, 2, 11, 64, dtype, "llama")
    cos, sin = general_cos_sin(2, 11, 64, dtype)
    check_against_reference(q, k, cos, sin, *upstream_grads(q, k))


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_cos_sin_broadcast_over_tokens_and_laid_out_apart(dtype_name):
    """cos and sin of one token ([B, 1, D]) broadcast over all tokens (their token stride must read as 0), and cos and
    sin laid out differently (sin a slice of a wider buffer): each is read through its own strides."""
    seed_for("cos_sin_layouts", dtype_name)
    dtype = DTYPES[dtype_name]
    q, k = make_qk(2, 4, 2, 7, 64, dtype, "llama")
    cos, sin = general_cos_sin(2, 1, 64, dtype)
    check_against_reference(q, k, cos, sin, *upstream_grads(q, k))
    cos, sin = general_cos_sin(2, 7, 64, dtype)
    wide = torch.randn(2, 7, 2 * 64, device=DEVICE).to(dtype)
    wide[..., 5:5 + 64] = sin
    sin = wide[..., 5:5 + 64]  # token stride 128, cos's is 64
    check_against_reference(q, k, cos, sin, *upstream_grads(q, k))


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_2d_cos_sin_table(unsqueeze_dim, dtype_name):
    """A [T, D] cos/sin table (vision RoPE's; Liger's LigerRopeFunction takes it) is shared by every sequence: the same
    bits as the [1, T, D] table, forward and backward, whose results test_forward_backward checks against float64.
    transformers' own function would broadcast a 2-D table over the heads axis instead, so it is no reference here."""
    seed_for("2d_cos_sin", unsqueeze_dim, dtype_name)
    dtype = DTYPES[dtype_name]
    q, k = make_qk(2, 4, 2, 7, 10, dtype, "llama")
    if unsqueeze_dim == 2:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos, sin = general_cos_sin(1, 7, 10, dtype)
    upstream = list(upstream_grads(q, k))
    table_2d = run(apply_rotary_pos_emb, q, k, cos[0], sin[0], *upstream, unsqueeze_dim=unsqueeze_dim)
    table_3d = run(apply_rotary_pos_emb, q, k, cos, sin, *upstream, unsqueeze_dim=unsqueeze_dim)
    for what, a, b in zip(("q_embed", "k_embed", "dq", "dk"), table_2d, table_3d):
        assert torch.equal(a, b), what


@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_unsqueeze_dim_2(dtype_name):
    """q, k as [B, T, heads, D] with unsqueeze_dim=2 (the layout before LLaMA's transpose)."""
    seed_for("unsqueeze2", dtype_name)
    dtype = DTYPES[dtype_name]
    q, k = (t.transpose(1, 2) for t in make_qk(2, 4, 2, 9, 64, dtype, "llama"))  # contiguous [B, T, H, D]
    cos, sin = llama_cos_sin(2, 9, 64, dtype, "llama3")
    q_embed, k_embed, _, _ = check_against_reference(q, k, cos, sin, *upstream_grads(q, k), unsqueeze_dim=2)
    assert q_embed.shape == q.shape and q_embed.is_contiguous()


def _grad_layout(name, shape, dtype):
    randn = lambda *s: torch.randn(*s, device=DEVICE).to(dtype)  # noqa: E731
    batch, heads, tokens, head_dim = shape
    if name == "like q":  # what attention's backward typically returns: the [B, T, H, D] memory order of q
        return randn(batch, tokens, heads, head_dim).transpose(1, 2)
    if name == "sliced":  # a slice of a wider buffer: odd token stride
        return randn(batch, heads, tokens, head_dim + 6)[..., 3:3 + head_dim]
    if name == "column-strided":  # last-dim stride 2: the launcher must copy it
        return randn(batch, heads, tokens, 2 * head_dim)[..., ::2]
    if name == "expanded":  # stride 0 over the heads (e.g. from a broadcast in the next op)
        return randn(batch, 1, tokens, head_dim).expand(shape)
    raise KeyError(name)


@pytest.mark.parametrize("grad_layout", ["like q", "sliced", "column-strided", "expanded"])
def test_grad_layout(grad_layout):
    seed_for("grad_layout", grad_layout, "bf16")
    dtype = torch.bfloat16
    q, k = make_qk(2, 4, 2, 6, 32, dtype, "llama")
    cos, sin = llama_cos_sin(1, 6, 32, dtype, "llama3")
    dq_embed, dk_embed = _grad_layout(grad_layout, q.shape, dtype), _grad_layout(grad_layout, k.shape, dtype)
    _, _, dq, dk = check_against_reference(q, k, cos, sin, dq_embed, dk_embed)
    if grad_layout == "like q":  # a dense gradient's layout is kept: q_proj's backward can view it without a copy
        assert dq.stride() == dq_embed.stride() and dk.stride() == dk_embed.stride()


@pytest.mark.parametrize("block_t,block_heads", [(2, 2), (8, 4), (1, 1)])
def test_block_overrides(block_t, block_heads):
    """The launchers' tile overrides (which exist for this test) give the same bits as the defaults, here with token
    tiles that overhang the sequence and head tiles that make the kernel loop over 3 head blocks with a partial last
    one (on the CPU the default tiles hold every token and head of these small inputs)."""
    seed_for("overrides", block_t, block_heads)
    q, k = make_qk(2, 6, 3, 7, 10, torch.bfloat16, "llama")
    cos, sin = llama_cos_sin(2, 7, 10, torch.bfloat16, "yarn")
    dq_embed, dk_embed = upstream_grads(q, k)
    knobs = dict(block_t=block_t, block_heads=block_heads)
    for tuned, default in zip(rope_forward(q, k, cos, sin, **knobs) + rope_backward(dq_embed, dk_embed, cos, sin,
                                                                                    **knobs),
                              rope_forward(q, k, cos, sin) + rope_backward(dq_embed, dk_embed, cos, sin)):
        assert torch.equal(tuned, default)
    check_against_reference(q, k, cos, sin, dq_embed, dk_embed)


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_cast_order(dtype_name):
    """The error rule above cannot tell one rounding from three, so compare bits: the kernel computes the whole
    expression in fp32 and rounds once, so its outputs and gradients equal that computation done with torch in fp32
    and cast once, except for rare last-bit differences (fused multiply-adds on the GPU). Eager's three roundings
    differ from it in ~20 % of the outputs."""
    seed_for("cast_order", dtype_name)
    dtype = DTYPES[dtype_name]
    q, k = make_qk(2, 8, 2, 33, 64, dtype, "llama")
    cos, sin = llama_cos_sin(2, 33, 64, dtype, "llama3")
    dq_embed, dk_embed = upstream_grads(q, k)
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    once = [(x.float() * c + rotate_half(x.float()) * s).to(dtype) for x in (q, k)]
    # The transpose of rotate_half is -rotate_half: y -> cat(y2, -y1).
    once += [(g.float() * c - rotate_half(g.float() * s)).to(dtype) for g in (dq_embed, dk_embed)]
    ours = run(apply_rotary_pos_emb, q, k, cos, sin, dq_embed, dk_embed)
    for what, o, e in zip(("q_embed", "k_embed", "dq", "dk"), ours, once):
        same = (o == e).float().mean().item()
        assert same > 0.99, f"{what}: only {same:.2%} of the values equal one fp32 computation rounded once"


@pytest.mark.parametrize("shape", [(1, 4, 2, 0, 16), (0, 4, 2, 5, 16)], ids=str)
def test_empty(shape):
    batch, q_heads, kv_heads, tokens, head_dim = shape
    q = torch.randn(batch, q_heads, tokens, head_dim, device=DEVICE, requires_grad=True)
    k = torch.randn(batch, kv_heads, tokens, head_dim, device=DEVICE, requires_grad=True)
    cos = sin = torch.randn(1, tokens, head_dim, device=DEVICE)
    q_embed, k_embed = apply_rotary_pos_emb(q, k, cos, sin)
    assert q_embed.shape == q.shape and k_embed.shape == k.shape
    (q_embed.sum() + k_embed.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_no_grad():
    """Inference (no_grad): works, builds no graph, and cos/sin that require grad are fine there."""
    seed_for("no_grad")
    q, k = make_qk(1, 4, 2, 5, 16, torch.float32, "llama")
    cos, sin = (t.requires_grad_() for t in llama_cos_sin(1, 5, 16, torch.float32, "llama3"))
    with torch.no_grad():
        q_embed, k_embed = apply_rotary_pos_emb(q.requires_grad_(), k, cos, sin)
        expected = HF_APPLY_ROPE(q, k, cos, sin)
    assert q_embed.grad_fn is None and k_embed.grad_fn is None
    torch.testing.assert_close((q_embed, k_embed), expected)


def _bad_inputs():
    """(name, call, expected exception, words the message must contain)."""
    def qkcs(batch=2, q_heads=4, kv_heads=2, tokens=5, head_dim=8, dtype=torch.float32):
        q = torch.randn(batch, q_heads, tokens, head_dim, device=DEVICE, dtype=dtype)
        k = torch.randn(batch, kv_heads, tokens, head_dim, device=DEVICE, dtype=dtype)
        cos = torch.randn(1, tokens, head_dim, device=DEVICE, dtype=dtype)
        return q, k, cos, cos.clone()

    q, k, cos, sin = qkcs()
    rope = apply_rotary_pos_emb
    meta = [t.to("meta") for t in (q, k, cos, sin)]
    return [
        ("q not 4-D", lambda: rope(q[0], k, cos, sin), ValueError, "q must be 4-D"),
        ("k not 4-D", lambda: rope(q, k[0], cos, sin), ValueError, "k must be 4-D"),
        ("cos 1-D", lambda: rope(q, k, cos[0, 0], sin), ValueError, "cos must be 3-D .* or 2-D"),
        ("cos 2-D tokens mismatch", lambda: rope(q, k, cos[0, :4], sin[0, :4]), ValueError, "does not broadcast"),
        ("odd head_dim", lambda: rope(*qkcs(head_dim=7)), ValueError, "even .* one column without a partner"),
        ("head_dim 0", lambda: rope(*qkcs(head_dim=0)), ValueError, "even and positive"),
        ("head_dim mismatch k", lambda: rope(q, qkcs(head_dim=6)[1], cos, sin), ValueError, "head_dim mismatch"),
        ("head_dim mismatch cos", lambda: rope(q, k, cos[..., :6], sin), ValueError, "head_dim mismatch"),
        ("batch mismatch", lambda: rope(q, qkcs(batch=3)[1], cos, sin), ValueError, "same batch"),
        ("tokens mismatch", lambda: rope(q, qkcs(tokens=6)[1], cos, sin), ValueError, "tokens"),
        ("cos tokens mismatch", lambda: rope(q, k, *qkcs(tokens=6)[2:]), ValueError, "does not broadcast"),
        ("cos batch mismatch", lambda: rope(q, k, cos.expand(3, 5, 8), sin), ValueError, "does not broadcast"),
        ("dtype mismatch", lambda: rope(q, k.bfloat16(), cos, sin), TypeError, "same dtype"),
        ("cos dtype mismatch", lambda: rope(q.bfloat16(), k.bfloat16(), cos, sin), TypeError, "same dtype"),
        ("integer inputs", lambda: rope(q.int(), k.int(), cos, sin), TypeError, "floating point"),
        ("float64 inputs", lambda: rope(*(t.double() for t in (q, k, cos, sin))), TypeError, "supported"),
        ("not a tensor", lambda: rope(q, k, 1.0, sin), TypeError, "torch.Tensor"),
        ("device mismatch", lambda: rope(q, meta[1], cos, sin), ValueError, "same device"),
        ("unsupported device", lambda: rope(*meta), ValueError, "meta"),
        ("unsqueeze_dim 0", lambda: rope(q, k, cos, sin, unsqueeze_dim=0), NotImplementedError, "unsqueeze_dim=0"),
        ("unsqueeze_dim 2, 3-D q", lambda: rope(q[0], k, cos, sin, unsqueeze_dim=2), ValueError, "unsqueeze_dim=2"),
        ("cos requires grad", lambda: rope(q, k, cos.requires_grad_(), sin), ValueError, "no gradient for cos"),
        ("block_t not 2^k", lambda: rope_forward(q, k, cos, sin, block_t=3), ValueError, "power of two"),
    ]


@pytest.mark.parametrize("name", [name for name, *_ in _bad_inputs()])
def test_bad_input(name):
    _, call, error, words = next(case for case in _bad_inputs() if case[0] == name)
    with pytest.raises(error, match=words):
        call()


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--head-dim", "0"], ["--head-dim", "7"]])
def test_kernel_script_refuses_bad_sizes(argv, capsys):
    """Run as a script, the kernel file answers a size it cannot run with one usage error (exit code 2)."""
    with pytest.raises(SystemExit) as exit_info:
        rope_kernel.main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# The transformers integration: a tiny LlamaForCausalLM with random weights, with and without the patch
# ----------------------------------------------------------------------------------------------------------------------
def _tiny_llama(dtype):
    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=131072,
                         rope_parameters=dict(ROPE_PARAMETERS["llama3"]))
    return LlamaForCausalLM._from_config(config, dtype=dtype, attn_implementation="sdpa").to(DEVICE)


def _loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return [("loss", loss.detach())] + [(n, p.grad.clone()) for n, p in model.named_parameters()]


def _relative_error(got, ref):
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_patch_llama(dtype_name):
    """Loss and every parameter gradient of a whole LLaMA forward+backward, with transformers' RoPE and with ours
    patched in; the patch really routes both layers through the kernel, and the original comes back afterwards.
    fp32: equal to rounding. bf16: both against a float64 copy of the model, ours no worse than eager x 2 (relative
    norm error; the bf16 matmuls dominate both)."""
    seed_for("patch_llama", dtype_name)
    dtype = DTYPES[dtype_name]
    model = _tiny_llama(dtype)
    input_ids = torch.randint(0, 128, (2, 12), device=DEVICE)
    eager = _loss_and_grads(model, input_ids)
    reference_run = None
    if dtype != torch.float32:  # a float64 copy holding the SAME weights, run before the patch (fp64 is eager-only)
        reference_model = _tiny_llama(torch.float64)
        reference_model.load_state_dict({n: p.double() for n, p in model.state_dict().items()})
        reference_run = dict(_loss_and_grads(reference_model, input_ids))

    launches = []
    original_forward = rope_kernel.rope_forward
    rope_kernel.rope_forward = lambda *a, **kw: launches.append(1) or original_forward(*a, **kw)  # counts calls
    # a count that does not match the config refuses to patch (a model whose attention would not call it)
    model.config.num_hidden_layers = 3
    with pytest.raises(ValueError, match="found 2 LlamaAttention modules in this llama model, expected 3"):
        apply_rope(model)
    model.config.num_hidden_layers = 2
    assert modeling_llama.apply_rotary_pos_emb is HF_APPLY_ROPE, "a refused patch must change nothing"
    try:
        assert apply_rope(model) == 2 and modeling_llama.apply_rotary_pos_emb is apply_rotary_pos_emb
        ours = _loss_and_grads(model, input_ids)
    finally:
        modeling_llama.apply_rotary_pos_emb = HF_APPLY_ROPE
        rope_kernel.rope_forward = original_forward
    assert modeling_llama.apply_rotary_pos_emb is HF_APPLY_ROPE
    assert len(launches) == 2, f"the patched model called the kernel {len(launches)} times, expected one per layer"

    assert [n for n, _ in ours] == [n for n, _ in eager] and len(ours) > 10
    for (name, o), (_, e) in zip(ours, eager):
        if dtype == torch.float32:
            torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6 * e.abs().max().item(), msg=name)
        else:
            r = reference_run[name]
            assert _relative_error(o, r) <= 2 * _relative_error(e, r) + 1e-3, (
                f"{name}: relative error {_relative_error(o, r):.2e} vs eager's {_relative_error(e, r):.2e}")


@pytest.mark.parametrize("used", ["qkv", "qk", "v"])
def test_split_qkv(used):
    """split_qkv: the same views as indexing the fused projection's output, and the same gradient (a block whose
    output the loss does not use gets zeros, as indexing gives), through one cat instead of three zero-filled
    buffers; odd block sizes, a 3-D input."""
    seed_for("split_qkv", used)
    sizes = (24, 10, 10)
    qkv = torch.randn(2, 5, sum(sizes), device=DEVICE, dtype=torch.float64)
    weights = {name: torch.randn(2, 5, size, device=DEVICE, dtype=torch.float64) for name, size in zip("qkv", sizes)}

    def run(split):
        leaf = qkv.clone().requires_grad_()
        blocks = dict(zip("qkv", split(leaf)))
        sum((blocks[name] * weights[name]).sum() for name in used).backward()
        return [b.detach() for b in blocks.values()], leaf.grad

    blocks, grad = run(lambda t: split_qkv(t, sizes))
    blocks_ref, grad_ref = run(lambda t: (t[..., :24], t[..., 24:34], t[..., 34:]))
    assert all(torch.equal(b, r) for b, r in zip(blocks, blocks_ref))
    assert torch.equal(grad, grad_ref) and grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------------------------------
@needs_cuda
def test_llama_shape_gpu():
    """LLaMA-3.1-8B's attention, 2 x 1024 tokens, bf16, as LlamaAttention passes it: the error rule, and the kernel's
    single rounding no worse than eager's three."""
    seed_for("llama_shape")
    q, k = make_qk(2, 32, 8, 1024, 128, torch.bfloat16, "llama")
    cos, sin = llama_cos_sin(1, 1024, 128, torch.bfloat16, "llama3")
    dq_embed, dk_embed = upstream_grads(q, k)
    ours = check_against_reference(q, k, cos, sin, dq_embed, dk_embed)
    eager = run(HF_APPLY_ROPE, q, k, cos, sin, dq_embed, dk_embed)
    ref = reference(q, k, cos, sin, dq_embed, dk_embed)
    for what, o, e, r in zip(("q_embed", "k_embed", "dq", "dk"), ours, eager, ref):
        ours_err, eager_err = (o.double() - r).abs().max().item(), (e.double() - r).abs().max().item()
        assert ours_err <= eager_err, f"{what}: {ours_err:.3e} > eager's {eager_err:.3e}"


@needs_cuda
def test_cpu_tensors_rejected_on_gpu():
    q = torch.randn(1, 2, 3, 8)  # [batch, heads, tokens, head_dim] on the CPU
    cos = torch.randn(1, 3, 8)  # [batch, tokens, head_dim]: valid shapes, so the device check is what fails
    with pytest.raises(ValueError, match="run on cuda"):
        apply_rotary_pos_emb(q, q, cos, cos)


@needs_cuda
def test_int64_offsets_gpu():
    """More than 2^31 elements in q: int32 offsets would wrap. Checks the last tokens against a separate run."""
    tokens = 2**31 // (32 * 128) + 8  # 524296 tokens; q alone is 4.3 GB in bf16
    if torch.cuda.mem_get_info()[0] < 40 * 2**30:
        pytest.skip("needs 40 GiB of free GPU memory")
    q, k = make_qk(1, 32, 8, tokens, 128, torch.bfloat16, "llama")
    cos, sin = llama_cos_sin(1, tokens, 128, torch.bfloat16, "llama3")
    tail = slice(tokens - 5, tokens)  # these elements sit past 2^31
    parts = (q[:, :, tail], k[:, :, tail], cos[:, tail], sin[:, tail])
    for full, part in zip(rope_forward(q, k, cos, sin), rope_forward(*parts)):
        assert torch.equal(full[:, :, tail], part)
    for full, part in zip(rope_backward(q, k, cos, sin), rope_backward(*parts)):
        assert torch.equal(full[:, :, tail], part)
    check_against_reference(*parts, *upstream_grads(*parts[:2]))


if __name__ == "__main__":
    # `python x_test.py` runs pytest on this file and ends with one PASSED / FAILED / SKIPPED line per check (pytest's
    # -rA summary); other arguments go to pytest (e.g. -k bf16). --help prints what is checked and how it passes.
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _, pytest_args = parser.parse_known_args()
    sys.exit(pytest.main([__file__, "-q", "-rA", "-p", "no:cacheprovider", *pytest_args]))
