"""Fine-tuning on conversations: chat and prompt/completion rows, the answers the only targets, packed rows.

- Targets: with the built-in byte-level template the target bytes of a chat row are exactly each assistant turn's
  content and its "<|end|>" line, and through a (locally trained) tokenizer's offsets its tokens; of a
  prompt/completion row the completion and EOS; --train-on-prompt makes every token a target; a conversation
  without an answer is skipped.
- Packing: first fit keeps every conversation whole and in one row; positions restart at each conversation.
- Packed = one at a time: for each family's tiny config (configs/tiny*), the loss and every parameter's gradient of
  three conversations packed into one row equal those of the three run one at a time, unpadded, with the same
  token-weighted normalisation (fp32, sdpa with transformers' document mask; eager for Gemma 2, whose softcap sdpa
  cannot apply). The stock model and loss (both scripts' shared code, the baseline's loss) and ours (the kernels
  patched in, the fused linear cross-entropy, so our RoPE gets each token's packed position). One at a time = each
  in a row of its own, right-padded, positions 0..n-1. Why the tolerance: both
  sides compute the same fp32 function and differ in summation order only (~1e-7 relative, measured); 2e-5 of each
  tensor's scale leaves a 100x margin. The check can fail: the same row with positions 0..T-1 (attention and
  positions crossing the conversations) is checked to differ by far more than the tolerance.
- torch_varlen (torch's variable-length attention, CUDA only): on the CPU a per-conversation SDPA stands in for the
  kernel, so the test checks what the scripts add: the conversations' boundaries (cu_seq_lens from the positions),
  the ragged layout, GQA and sliding windows; packed rows equal the stock sdpa model on each conversation alone.
- Masked tokens get no gradient: the final hidden state of every position whose label is ignored (prompts, each
  conversation's last token, the row's padding) gets an exactly-zero gradient.
- Accumulation: each script trains the same conversations packed (2 rows a step) and padded (4 a step), as one batch
  and as micro-batches of 1 with --grad-accum-steps; every run's per-step losses and gradient norms equal the first's
  (the token-weighted mean of the same targets), to the same fp32 tolerance. A loss averaged per micro-batch would
  miss by several percent, as the conversations' target counts differ.
- End to end, the optimized script with every kernel trains packed conversations as the baseline does.
"""
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import finetune_optimized  # noqa: E402  (first: the kernel modules set up Triton before transformers loads it)
import finetune_baseline  # noqa: E402
import training_data  # noqa: E402
from rmsnorm_kernel import apply_rmsnorm  # noqa: E402
from rope_kernel import apply_rope  # noqa: E402
from swiglu_kernel import apply_glu_mlp  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

SCRIPTS = {"baseline": finetune_baseline, "optimized": finetune_optimized}
# Where each script's data code lives: the baseline carries it inline, the optimized script imports training_data.
DATA_CODE = {"baseline": finetune_baseline, "optimized": training_data}
FAMILIES = ["tiny", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma2", "tiny-gemma3", "tiny-phi3"]
RTOL = 2e-5
CHAT = [{"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A colour?"},
                      {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
                      {"role": "assistant", "content": "Red."}]},
        {"messages": [{"role": "user", "content": "Nobody answers this."}]}]


def options(**overrides):
    args = finetune_baseline.parse_args([])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


@pytest.mark.parametrize("module", DATA_CODE.values(), ids=DATA_CODE)
def test_chat_targets_are_the_assistant_turns(module):
    args = options(data_format="chat", seq_len=512)
    targets = []
    for index, row in enumerate(CHAT):
        encoded = module.conversation_tokens(args, "chat.jsonl", index, row, module.BYTE_CHAT_TEMPLATE, None, 2)
        if encoded is None:
            targets.append(None)
            continue
        ids, flags = encoded
        text = bytes(ids).decode()
        assert text.startswith("<|user|>\nWhat is 2+2?") or text.startswith("<|system|>")
        # the target bytes, run by run
        runs, current = [], b""
        for token, flag in zip(ids, flags):
            if flag:
                current += bytes([token])
            elif current:
                runs.append(current.decode())
                current = b""
        targets.append(runs + ([current.decode()] if current else []))
    assert targets == [["4.<|end|>\n"], ["Blue.<|end|>\n", "Red.<|end|>\n"], None]
    ids, flags = module.conversation_tokens(options(data_format="chat", train_on_prompt=True), "chat.jsonl", 0,
                                            CHAT[0], module.BYTE_CHAT_TEMPLATE, None, 2)
    assert all(flags) and len(ids) == len(flags)


def trained_tokenizer():
    """A small byte-level BPE tokenizer (the tokenizers package, trained here: nothing downloaded) with special tokens
    and a chat template, as a Hub model's tokenizer has them: the path through the tokenizer's offsets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["What is 2+2? 4. A colour? Blue. Another? Red. Be brief."] * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
                          "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return fast


@pytest.mark.parametrize("module", DATA_CODE.values(), ids=DATA_CODE)
def test_chat_targets_through_a_tokenizer(module):
    tokenizer = trained_tokenizer()
    args = options(data_format="chat")
    template = module.chat_template_of(args, tokenizer)
    ids, flags = module.conversation_tokens(args, "chat.jsonl", 1, CHAT[1], template, tokenizer, 1)
    assert ids[0] == tokenizer.bos_token_id  # the template writes BOS; the tokenizer adds no second one
    answers = tokenizer.decode([token for token, flag in zip(ids, flags) if flag])
    assert answers == "Blue.<|end|>Red.<|end|>"
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(CHAT[1]["messages"], tokenize=False)


@pytest.mark.parametrize("module", DATA_CODE.values(), ids=DATA_CODE)
def test_prompt_completion_targets_are_the_completion_and_eos(module):
    args = options(data_format="prompt-completion")
    ids, flags = module.conversation_tokens(args, "pc.jsonl", 0, {"prompt": "Q: hi\nA:", "completion": " hello"},
                                            None, None, 7)
    assert ids == list(b"Q: hi\nA: hello") + [7]
    assert [token for token, flag in zip(ids, flags) if flag] == list(b" hello") + [7]
    assert module.conversation_tokens(args, "pc.jsonl", 0, {"prompt": "Q", "completion": " "}, None, None, 7) is None


def test_packing_keeps_conversations_whole_and_positions_restart():
    conversations = [([1] * n, [5] * (n - 1) + [-100]) for n in (5, 9, 3, 7, 2)]
    groups = finetune_baseline.pack_conversations(conversations, 10)
    assert groups == [[0, 2, 4], [1], [3]]  # first fit: 3 and 2 fill the room 5 left
    rows = finetune_baseline.conversation_rows(conversations, groups, 10, pad_id=0)
    assert rows[2, 0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert rows[2, 1].tolist() == list(range(9)) + [0]  # the padding starts a document of its own
    assert rows[1, 1, -1] == -100 and rows[0, 1, -1] == 0


def build(folder):
    """The family's tiny model in fp32 with fresh random weights of a realistic spread (norm weights with noise,
    unit-scale activations)."""
    config = AutoConfig.from_pretrained(ROOT / "configs" / folder)
    attention = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.rand(p.shape) - 0.5)
            else:
                p.copy_(torch.randn(p.shape) * 2 / p.shape[-1] ** 0.5)
    model.config.use_cache = False
    return model


def patch_our_kernels(model):
    apply_rmsnorm(model)
    apply_glu_mlp(model)
    apply_rope(model)


def random_conversations(vocab, lengths):
    """(ids, shifted labels) per conversation: random tokens, a random half of them targets, the last predicting
    nothing, as load_conversations builds them."""
    conversations = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,)).tolist()
        targets = (torch.rand(n) < 0.5).tolist()
        conversations.append((ids, [t if flag else -100 for t, flag in zip(ids[1:], targets[1:])] + [-100]))
    return conversations


def loss_and_gradients(model_with_loss, batches, documents, hidden_grads=None):
    """The token-weighted loss over batches ([3, rows, T] each), as the training step computes it, and every
    parameter's gradient."""
    model_with_loss.model.zero_grad(set_to_none=True)
    num_targets = finetune_baseline.targets_per_rank(batches, 1)
    total = 0.0
    for input_ids, labels, positions in batches:
        loss, _ = model_with_loss(input_ids, labels, positions if documents else None, num_targets)
        loss.backward()
        total += loss.detach()
    return total, {name: p.grad.clone() for name, p in model_with_loss.model.named_parameters() if p.grad is not None}


def differs(a, b):
    """The largest difference of two results relative to the scale of each tensor."""
    loss_a, grads_a = a
    loss_b, grads_b = b
    worst = abs(loss_a - loss_b) / abs(loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        scale = grads_b[name].abs().max().clamp_min(1e-30)
        worst = max(worst, ((grads_a[name] - grads_b[name]).abs().max() / scale).item())
    return float(worst)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_equals_each_conversation_alone(family, script, restore_rope):
    module = SCRIPTS[script]
    torch.manual_seed(0)
    model = build(family)
    if script == "optimized":  # our kernels, our loss: RoPE must take each token's position in the packed row
        patch_our_kernels(model)
        model_with_loss = module.ModelWithLoss(model, "linear_ce")
    else:
        model_with_loss = module.ModelWithLoss(model, "eager")
    # 20 > the tiny Gemma/Phi-3 sliding windows (16): the windowed layers really mask within a conversation too
    conversations = random_conversations(model.config.vocab_size, (20, 7, 9))
    packed = DATA_CODE[script].conversation_rows(conversations, [[0, 1, 2]], 40, pad_id=0)
    # each conversation in a row of its own, right-padded (causal attention never reaches the padding after it)
    alone = DATA_CODE[script].conversation_rows(conversations, [[0], [1], [2]], 20, pad_id=0)
    reference = loss_and_gradients(model_with_loss, [alone], documents=False)
    assert differs(loss_and_gradients(model_with_loss, [packed], documents=True), reference) < RTOL
    if script == "optimized":  # the check of the check below needs no kernels (and costs interpreter time)
        return
    # the same row read as one document (positions 0..T-1): attention and positions cross, and the test sees it
    crossing = packed.clone()
    crossing[2] = torch.arange(40)
    assert differs(loss_and_gradients(model_with_loss, [crossing], documents=True), reference) > 100 * RTOL


@pytest.mark.parametrize("script", SCRIPTS)
def test_ignored_positions_get_no_gradient(script, restore_rope):
    module = SCRIPTS[script]
    torch.manual_seed(1)
    model = build("tiny")
    if script == "optimized":
        patch_our_kernels(model)
    model_with_loss = module.ModelWithLoss(model, "linear_ce" if script == "optimized" else "eager")
    packed = DATA_CODE[script].conversation_rows(random_conversations(model.config.vocab_size, (9, 12)), [[0, 1]],
                                                 24, 0)
    final_hidden = []

    def keep_final_hidden(module, inputs, output):
        output.retain_grad()
        final_hidden.append(output)
    model.model.norm.register_forward_hook(keep_final_hidden)
    loss_and_gradients(model_with_loss, [packed], documents=True)
    grad = final_hidden[0].grad[0]  # [T, H]: position t's hidden state feeds only position t's prediction
    ignored = packed[1, 0] == -100
    assert ignored[:21].any() and (~ignored).any() and ignored[21:].all()  # prompts, last tokens, the padding
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
    assert (grad[~ignored].abs().sum(-1) > 0).all()


def write_conversations(path, n=8):
    """n chat rows of one length each (with the byte-level template: 2 fit a row of 112 tokens, 3 do not), with
    different numbers of answer tokens, so a per-micro-batch mean would weigh them unevenly."""
    rows = []
    for index in range(n):
        answer = "yes" if index % 2 else "a longer" + "x" * (index % 3)
        question = "q" * (10 - len(answer))
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.parametrize("script", SCRIPTS)
def test_accumulation_equals_the_larger_batch_packed_and_padded(script, tmp_path, restore_rope, capsys):
    module = SCRIPTS[script]
    data = tmp_path / "chat.jsonl"
    write_conversations(data)
    common = ["--model", "tiny", "--dtype", "fp32", "--data", str(data), "--seq-len", "112", "--steps", "2",
              "--lr", "1e-3", "--max-grad-norm", "1e9"]  # clipping off in effect, the norm still reported
    runs = {"packed 2 rows": ["--packing", "on", "--batch-size", "2"],
            "packed 1 row x 2": ["--packing", "on", "--batch-size", "1", "--grad-accum-steps", "2"],
            "padded 4": ["--packing", "off", "--batch-size", "4"],
            "padded 1 x 4": ["--packing", "off", "--batch-size", "1", "--grad-accum-steps", "4"]}
    # ours: the optimized script's own training step; its fused loss's sums and the kernels on packed rows are the
    # family test's (each kernel costs interpreter time)
    kernels = ["--no-rmsnorm", "--no-swiglu", "--no-rope", "--loss", "eager"] if script == "optimized" else []
    results = {}
    for name, flags in runs.items():
        out = tmp_path / f"{name}.json"
        module.main([*common, *flags, *kernels, "--out", str(out)])
        results[name] = json.loads(out.read_text())
    first = results["packed 2 rows"]
    assert "tokenized as UTF-8 bytes with the built-in chat template" in capsys.readouterr().out
    assert first["tokenized_by"] == "the built-in chat template over UTF-8 bytes"
    assert first["row_fill"] == pytest.approx(2 * 49 / 112)  # two conversations of 49 tokens a row
    for name, result in results.items():
        for key in ("losses", "grad_norms"):
            assert result[key] == pytest.approx(first[key], rel=RTOL), (name, key)
    # the learning rate moves the loss: the second step's equality is a check of the first step's gradients
    assert abs(first["losses"][1] - first["losses"][0]) > 100 * RTOL * first["losses"][0]


def varlen_on_the_cpu(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                      enable_gqa=False):
    """torch.nn.attention.varlen.varlen_attn's contract ([tokens, heads, D], sequences from cu_seq_q, causal within
    each, window_size (left, 0)) by SDPA on each sequence: the kernel itself needs CUDA."""
    outputs = []
    for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        position = torch.arange(end - start)
        allowed = position[None, :] <= position[:, None]
        if window_size[0] >= 0:
            allowed &= position[:, None] - position[None, :] <= window_size[0]
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa)
                       .transpose(0, 1))
    return torch.cat(outputs)


@pytest.mark.parametrize("family", ["tiny", "tiny-gemma3"])  # Gemma 3: sliding windows of 16, GQA
@pytest.mark.parametrize("script", SCRIPTS)
def test_torch_varlen_keeps_packed_conversations_apart(family, script, monkeypatch):
    import torch.nn.attention.varlen
    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_on_the_cpu)
    module = SCRIPTS[script]
    torch.manual_seed(2)
    model = build(family)
    model_with_loss = module.ModelWithLoss(model, "eager")
    conversations = random_conversations(model.config.vocab_size, (20, 7, 9))
    alone = DATA_CODE[script].conversation_rows(conversations, [[0], [1], [2]], 20, pad_id=0)
    reference = loss_and_gradients(model_with_loss, [alone], documents=False)
    model.set_attn_implementation("torch_varlen")
    packed = DATA_CODE[script].conversation_rows(conversations, [[0, 1, 2]], 40, pad_id=0)
    assert differs(loss_and_gradients(model_with_loss, [packed], documents=True), reference) < RTOL
    assert DATA_CODE[script].attention_inputs(model, packed[2:3, 0])["cu_seq_lens_q"].tolist() == [0, 20, 27, 36, 40]


def test_ours_trains_packed_conversations_like_the_baseline(tmp_path, restore_rope):
    """End to end on packed chat rows: the optimized script with every kernel and the fused linear cross-entropy gives
    the baseline's per-step losses and gradient norms (fp32, the same tolerance)."""
    data = tmp_path / "chat.jsonl"
    write_conversations(data)
    flags = ["--model", "tiny", "--dtype", "fp32", "--data", str(data), "--seq-len", "112", "--steps", "2",
             "--lr", "1e-3", "--batch-size", "2"]
    results = {}
    for name, module in SCRIPTS.items():
        module.main([*flags, "--out", str(tmp_path / f"{name}.json")])
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert results["optimized"]["variant"] == "rmsnorm+linear_ce+swiglu+rope"
    for key in ("losses", "grad_norms"):
        assert results["optimized"][key] == pytest.approx(results["baseline"][key], rel=RTOL), key
