"""The kernels on every supported model family: Llama, Mistral, Qwen2 (2.5), Qwen3, Gemma 2, Gemma 3 and Phi-3.

For each family's tiny config (configs/tiny-*: the family's structure at toy sizes: its norms, activation, GQA, tied
head, softcaps, sliding windows), the model with our kernels patched in by the kernel modules' entry points
(apply_rmsnorm, apply_glu_mlp, apply_rope) and its loss through the fused linear cross-entropy (with Gemma 2's final
logit softcap) gives the stock model's loss and every parameter's gradient. The rule is the project's: against the
same model in float64, our fp32 error is at most 4x stock fp32's own error, plus 1e-6 of the value's scale (the floor
keeps a parameter whose stock error happens to round to 0 from demanding exactness). An ignored option (Gemma's
offset, its GELU, a missed softcap, a norm left unswapped) moves the loss or a gradient by 1e-3 or more of its scale:
far outside that bound. The number of modules each entry point swaps is checked against the family's layout.

Also: an unsupported family is refused in one line naming the supported ones, before anything is swapped; the fine-tune
scripts build each family from its built-in config (random weights, the same for both scripts and one seed) and
refuse Gemma 2's attention softcapping on an attention implementation that cannot apply it.
"""
import copy
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
# the kernels first: they set Triton's interpreter flag before anything else imports triton
from linear_cross_entropy_kernel import linear_cross_entropy  # noqa: E402
from rmsnorm_kernel import RMSNORM_FAMILIES, TritonRMSNorm, apply_rmsnorm  # noqa: E402
from rope_kernel import ROPE_FAMILIES, apply_rope, apply_rotary_pos_emb  # noqa: E402
from swiglu_kernel import GLU_MLP_FAMILIES, apply_glu_mlp  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

# family (config.model_type) -> (tiny config folder, RMSNorms per layer, MLP class after the swap)
FAMILIES = {"llama": ("tiny", 2, "TritonLlamaMLP"), "mistral": ("tiny-mistral", 2, "TritonLlamaMLP"),
            "qwen2": ("tiny-qwen2", 2, "TritonLlamaMLP"), "qwen3": ("tiny-qwen3", 4, "TritonLlamaMLP"),
            "gemma2": ("tiny-gemma2", 4, "TritonGemmaMLP"), "gemma3_text": ("tiny-gemma3", 6, "TritonGemmaMLP"),
            "phi3": ("tiny-phi3", 2, "TritonPhi3MLP")}
BATCH, TOKENS = 2, 24  # 24 > the tiny Gemma/Phi-3 sliding windows (16): the windowed layers really mask
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernels run: the GPU when there is one


def build(folder, seed=0):
    """The family's tiny model in fp32 with random weights of a realistic spread: the init's all-ones (or Gemma's
    all-zeros) norm weights get noise, and the matrices unit-scale activations, so the logits reach a few units, where
    Gemma 2's final softcap (30) bends them measurably."""
    config = AutoConfig.from_pretrained(ROOT / "configs" / folder)
    # eager attention: Gemma 2 softcaps its attention logits, which sdpa cannot; the same for every family keeps the
    # comparison about our kernels only
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.rand(p.shape, generator=generator) - 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * 2 / p.shape[-1] ** 0.5)
    return model.to(DEVICE)


def stock_loss(model, input_ids, labels):
    # use_cache=False, as in training: a KV cache would hand attention its own copies of k and v
    logits = model(input_ids=input_ids, use_cache=False).logits  # transformers applies Gemma 2's final softcap here
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(torch.float64 if logits.dtype == torch.float64
                                                                      else torch.float32), labels.reshape(-1))


def our_loss(model, input_ids, labels):
    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    softcap = getattr(model.config, "final_logit_softcapping", None)
    return linear_cross_entropy(hidden, model.lm_head.weight, labels, softcap=softcap)


def gradients(model):
    return {name: p.grad.double().clone() for name, p in model.named_parameters()}


def test_the_tables_name_the_same_families():
    assert set(RMSNORM_FAMILIES) == set(GLU_MLP_FAMILIES) == set(ROPE_FAMILIES) == set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_family_matches_stock(family, restore_rope, monkeypatch):
    folder, norms_per_layer, mlp_class = FAMILIES[family]
    torch.manual_seed(1)  # fresh inputs, no token the vocabulary lacks
    config = AutoConfig.from_pretrained(ROOT / "configs" / folder)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, TOKENS), device=DEVICE)
    labels = torch.randint(0, config.vocab_size, (BATCH, TOKENS), device=DEVICE)
    losses, grads, attention_strides, strides = {}, {}, {}, []

    def run(name, model, loss_fn):
        strides.clear()
        loss = loss_fn(model, input_ids, labels)
        loss.backward()
        losses[name], grads[name], attention_strides[name] = loss.double().item(), gradients(model), list(strides)

    # The stock runs first: apply_rope switches the whole family's attention, the float64 reference's too.
    stock = build(folder)
    ours = copy.deepcopy(stock)
    # Each attention call records the strides of its q, k and v (checked after our run).
    modeling = sys.modules[type(stock.model.layers[0].self_attn).__module__]
    eager_attention = modeling.eager_attention_forward

    def recording_attention(module, query, key, value, *args, **kwargs):
        strides.append([t.stride() for t in (query, key, value)])
        return eager_attention(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", recording_attention)
    run("reference", copy.deepcopy(stock).double(), stock_loss)  # the same weights in float64
    run("stock", stock, stock_loss)
    assert ours.config.model_type == family
    n_layers = ours.config.num_hidden_layers
    assert apply_rmsnorm(ours) == norms_per_layer * n_layers + 1
    assert apply_glu_mlp(ours) == n_layers
    assert apply_rope(ours) == n_layers
    assert not any(type(m).__name__.endswith("RMSNorm") and not isinstance(m, TritonRMSNorm) for m in ours.modules())
    assert sum(type(m).__name__ == mlp_class for m in ours.modules()) == n_layers
    assert modeling.apply_rotary_pos_emb is apply_rotary_pos_emb
    run("ours", ours, our_loss)
    # q and k reach attention token-major, as their projection lies ([B, T, heads, D] in memory, viewed as [B, heads,
    # T, D]): attention then writes its output in that order, and transformers' reshape of it to [B, T, hidden] needs
    # no copy (else one more [tokens, hidden] tensor is kept per layer). v is the projection's own view.
    assert len(attention_strides["ours"]) == n_layers
    for (q_strides, k_strides, v_strides), (_, _, stock_v_strides) in zip(attention_strides["ours"],
                                                                           attention_strides["stock"]):
        assert q_strides[2] > q_strides[1] and k_strides[2] > k_strides[1], (q_strides, k_strides)
        assert v_strides == stock_v_strides

    def within_rule(ours_value, stock_value, reference_value, scale):
        return abs(ours_value - reference_value) <= 4 * abs(stock_value - reference_value) + 1e-6 * scale

    assert within_rule(losses["ours"], losses["stock"], losses["reference"], abs(losses["reference"]))
    assert grads["ours"].keys() == grads["reference"].keys()
    for name, g64 in grads["reference"].items():
        scale = g64.abs().max().item()
        assert scale > 0, name  # every parameter takes part in the loss
        ours_error = (grads["ours"][name] - g64).abs().max().item()
        stock_error = (grads["stock"][name] - g64).abs().max().item()
        assert ours_error <= 4 * stock_error + 1e-6 * scale, (name, ours_error, stock_error, scale)


def test_an_unsupported_family_is_refused_before_anything_changes():
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=100)
    model = AutoModelForCausalLM.from_config(config)
    before = [type(m) for m in model.modules()]
    for apply in (apply_rmsnorm, apply_glu_mlp, apply_rope):
        with pytest.raises(ValueError, match="gpt2 models are not supported; supported: llama, mistral"):
            apply(model)
    assert [type(m) for m in model.modules()] == before


def test_odd_head_dim_and_partial_rotation_are_refused(restore_rope):
    config = AutoConfig.from_pretrained(ROOT / "configs" / "tiny-qwen3")
    config.head_dim = 15
    with pytest.raises(ValueError, match="head_dim 15 is odd"):
        apply_rope(AutoModelForCausalLM.from_config(config))
    config = AutoConfig.from_pretrained(ROOT / "configs" / "tiny-phi3")
    config.partial_rotary_factor = 0.5
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        apply_rope(AutoModelForCausalLM.from_config(config))


def run(script, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(ROOT / script), *flags], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("family", ["tiny-gemma2", "tiny-phi3"])
def test_both_scripts_train_a_family_from_its_builtin_config(family, tmp_path):
    """Gemma 2 (softcaps, tied head, four norms per layer) and Phi-3 (fused gate_up_proj): both scripts build the
    same random weights from the same seed, so their first losses agree; ours swaps every module of the layout."""
    results = {}
    for script in ("finetune_baseline.py", "finetune_optimized.py"):
        out = tmp_path / f"{script}.json"
        # fp32 on any device: in bf16 (the GPU's default) the fused kernels' first loss differs from stock's by more
        # than the bound below, by rounding alone
        proc = run(script, "--model", family, "--steps", "2", "--seq-len", "16", "--attn-implementation", "eager",
                   "--dtype", "fp32", "--out", str(out))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "RANDOM weights" in proc.stdout or "random weights" in proc.stdout
        results[script] = json.loads(out.read_text())
    assert results["finetune_optimized.py"]["losses"][0] == pytest.approx(results["finetune_baseline.py"]["losses"][0],
                                                                          rel=1e-5)
    config = AutoConfig.from_pretrained(ROOT / "configs" / family)
    norms_per_layer = FAMILIES[config.model_type][1]
    assert results["finetune_optimized.py"]["replaced"] == {
        "rmsnorm": norms_per_layer * config.num_hidden_layers + 1, "swiglu_mlp": config.num_hidden_layers,
        "rope_attention": config.num_hidden_layers}


def test_gemma2_attention_softcapping_needs_an_attention_that_applies_it():
    import finetune_baseline
    import finetune_optimized
    for module in (finetune_baseline, finetune_optimized):
        args = module.parse_args(["--model", "tiny-gemma2", "--attn-implementation", "sdpa"])
        expected = (r"^error: --attn-implementation sdpa cannot apply gemma2's attention logit softcapping \(50\.0\); "
                    r"use eager or flex_attention or flash_attention_2$")
        with pytest.raises(SystemExit, match=expected):
            module.load_model(args, "cpu", torch.float32)


def test_a_folder_with_only_a_config_builds_that_architecture(tmp_path):
    folder = tmp_path / "my-qwen3"
    folder.mkdir()
    (folder / "config.json").write_text((ROOT / "configs" / "tiny-qwen3" / "config.json").read_text())
    out = tmp_path / "run.json"
    proc = run("finetune_optimized.py", "--model", str(folder), "--steps", "1", "--seq-len", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(out.read_text())["weights"] == "random"
    assert "RANDOM weights" in proc.stdout
