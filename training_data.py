"""Training data: a data set turned into batches of [3, rows, T], the token ids, the shifted labels (-100: not a
target) and the position ids, and the attention that keeps packed conversations apart.

Three kinds of rows, told apart by their fields (or --data-format):
  text ({"text": ...}, or --text-field): one token stream, documents joined by EOS, cut into --seq-len windows; every
      token is a target. Pre-training style: attention crosses documents.
  chat ({"messages": [{"role", "content"}, ...]}): rendered by the chat template (the tokenizer's, --chat-template,
      or without a tokenizer a built-in byte-level one); only the assistant turns are targets.
  prompt/completion ({"prompt": ..., "completion": ...}): text, or lists of turns; only the completion is a target.

What is masked: a token is a target when it starts inside an answer's span of the rendered text. The span of an
assistant turn is found by rendering the conversation twice, up to the turn before with the generation prompt (where
the answer starts) and through the answer (where it ends), so the turn's end-of-turn tokens are targets too and the
model learns to stop. --train-on-prompt makes every token a target.

Packing (the default for conversations): whole conversations placed first-fit into rows of --seq-len tokens, none
split (a longer one is cut to --seq-len, and counted). Each conversation's labels are shifted within it, so no
position predicts the next conversation's first token, and position ids restart at 0 at each conversation: RoPE sees
each token's own position, and transformers reads the boundaries from the position ids. Attention then stays inside
each conversation: flash-attn's or torch's variable-length kernel (cu_seqlens: only the blocks within conversations
are computed), FlexAttention with a document BlockMask (blocks across conversations are skipped), or sdpa with a dense
[rows, 1, T, T] mask (every block computed, the CPU's choice). --packing off pads instead: one conversation per row,
each step's rows padded at the end to its longest.

The loss of a step is the sum of its per-token losses over all its target tokens, divided by their count over every
micro-batch and rank (`targets_per_rank`), so micro-batches with more targets weigh more, exactly as one large batch.

Both fine-tune scripts read data the same way; finetune_optimized.py imports this module, finetune_baseline.py
carries the same code inline (it imports nothing of ours).
"""
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface, AutoTokenizer
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

HAS_CUDA = torch.cuda.is_available()


def first_line(err):
    """An error's message in one line: its first, or the error's type where it has no message."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


# A local data file is read by the datasets builder of its format, as load_dataset(<builder>, data_files=...) does.
DATA_FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
DATA_FORMATS = ["auto", "text", "chat", "prompt-completion"]
# Without a tokenizer (a built-in architecture, or a model whose tokenizer is not here) conversations are rendered
# with this template and their UTF-8 bytes are the token ids: each turn a "<|role|>" line closed by "<|end|>", which an
# answer's targets include, so the model learns where an answer ends.
BYTE_CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
                      "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def data_rows(source, offline):
    """The rows of a save_to_disk folder (its "train" split where it has several), a local data file (streamed: read
    only as far as the run needs; a .txt file is one document), a folder of data files, or a Hub data set (from the
    cache when offline)."""
    if offline:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read when datasets is imported
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its errors reach the user as our one line instead
    path, builder = Path(source), DATA_FILE_BUILDERS.get(Path(source).suffix.lower())
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():  # written by save_to_disk
        rows = datasets.load_from_disk(source)
        return rows["train"] if isinstance(rows, datasets.DatasetDict) else rows
    if path.is_file() and builder is None:
        raise SystemExit(f"error: data {source}: unknown file type {path.suffix or '(none)'}; data is read from "
                         f"{', '.join(DATA_FILE_BUILDERS)} files and save_to_disk folders")
    if builder is None:  # a folder of data files (datasets picks the builder), or a Hub data set
        return datasets.load_dataset(source, split="train", streaming=path.is_dir())
    if not path.is_file():
        raise SystemExit(f"error: data {source}: no such file or folder")
    options = {"sample_by": "document"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=source, split="train", streaming=True, **options)


def read_rows(args, source):
    """The rows of `source` one at a time (data_rows); data that cannot be read ends the run with one error line."""
    try:
        yield from data_rows(source, offline=not args.allow_download)
    except Exception as err:  # datasets raises many types for "not cached", "no network", "not JSON", ...
        cause = err
        while not isinstance(cause, UnicodeDecodeError) and (cause.__cause__ or cause.__context__):
            cause = cause.__cause__ or cause.__context__  # a decoding error arrives wrapped in datasets' own
        what = (f"not UTF-8 text (byte 0x{cause.object[cause.start]:02x}); re-encode it as UTF-8"
                if isinstance(cause, UnicodeDecodeError) else f"cannot be read: {first_line(err)}")
        if not args.allow_download and not Path(source).exists():  # a Hub data set name, read from the cache only
            what += "; --allow-download fetches it from the Hub"
        raise SystemExit(f"error: data {source}: {what}") from None


def row_format(row, text_field):
    """The format a row's fields say: chat (`messages`), prompt-completion, text (--text-field), or None."""
    if "messages" in row:
        return "chat"
    if "prompt" in row and "completion" in row:
        return "prompt-completion"
    return "text" if text_field in row else None


def missing_fields(source, index, row, args):
    """The one error line for a row without the fields of --data-format."""
    wanted = {"text": repr(args.text_field), "chat": "'messages'", "prompt-completion": "'prompt' and 'completion'",
              "auto": f"{args.text_field!r}"}[args.data_format]
    return SystemExit(f"error: data {source}: no field {wanted} (its fields: {', '.join(map(str, row))}) in row "
                      f"{index}; name the text column with --text-field, or give chat rows ('messages') or "
                      f"prompt/completion rows ('prompt', 'completion')")


def resolve_data_format(args):
    """--data-format auto: the format of --data's first row (synthetic or empty data: text). Afterwards
    args.data_format is text, chat or prompt-completion; --eval-data must hold rows of the same format."""
    if args.data_format == "auto":
        first = None if args.data == "synthetic" else next(iter(read_rows(args, args.data)), None)
        if first is not None and row_format(first, args.text_field) is None:
            raise missing_fields(args.data, 0, first, args)
        args.data_format = "text" if first is None else row_format(first, args.text_field)
    return args.data_format


def packed_documents(args):
    """Whether rows hold several conversations, told apart by their position ids (which the model is then given)."""
    return args.data_format != "text" and args.packing == "on"


def choose_attention(args):
    """--attn-implementation auto: sdpa, but for packed conversations on a GPU, where attention must stay inside each
    conversation, the implementation that skips the work across them: flash_attention_2 where flash-attn is installed
    (transformers turns the restarting position ids into cu_seqlens, its variable-length kernel computes only the
    blocks within conversations), else flex_attention (a BlockMask of the documents: blocks across them are skipped).
    sdpa with packed rows gets a dense [rows, 1, T, T] document mask and runs its masked kernel over every block: the
    CPU's choice (correct; FlexAttention has no backward on the CPU). Returns why, for the header."""
    if args.attn_implementation != "auto":
        return "as given"
    if not (packed_documents(args) and HAS_CUDA):
        args.attn_implementation = "sdpa"
        return ("packed conversations on the CPU: a dense document mask" if packed_documents(args)
                else "no packed conversations: the causal kernel without a mask")
    import importlib.util
    has_flash = importlib.util.find_spec("flash_attn") is not None
    args.attn_implementation = "flash_attention_2" if has_flash else "flex_attention"
    return ("packed conversations: flash-attn's variable-length kernel" if has_flash else
            "packed conversations: FlexAttention with a document BlockMask (flash-attn is not installed)")

def torch_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cu_seq_lens_q=None,
                           max_length_q=None, **kwargs):
    """transformers' attention interface over torch's own variable-length attention (torch.nn.attention.varlen:
    FlashAttention inside torch, CUDA only): the rows' tokens become one ragged batch whose sequences start at
    cu_seq_lens_q (the packed conversations, from attention_inputs; without them each row is one sequence), each
    causal within itself, so nothing is computed across conversations. query [B, Hq, T, D], key and value
    [B, Hkv, T, D]; returns [B, T, Hq, D] and no weights, as transformers' attention functions do."""
    from torch.nn.attention.varlen import varlen_attn
    batch, heads, length, head_dim = query.shape
    if cu_seq_lens_q is None:
        cu_seq_lens_q = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=query.device)
        max_length_q = length
    window = getattr(module, "sliding_window", None)  # a sliding-window layer sees its last `window` tokens

    def ragged(x):  # [B, H, T, D] -> [B*T, H, D]
        return x.transpose(1, 2).reshape(batch * length, x.shape[1], head_dim)
    out = varlen_attn(ragged(query), ragged(key), ragged(value), cu_seq_lens_q, cu_seq_lens_q, max_length_q,
                      max_length_q, scale=scaling, window_size=(-1 if window is None else window - 1, 0),
                      enable_gqa=key.shape[1] != heads)
    return out.view(batch, length, heads, head_dim), None


# Registered under its name with the mask function of transformers' FlashAttention (no mask tensor: the conversations'
# boundaries travel as cu_seq_lens), so --attn-implementation torch_varlen works like transformers' own names.
AttentionInterface.register("torch_varlen", torch_varlen_attention)
AttentionMaskInterface.register("torch_varlen", flash_attention_mask)
# The implementations that take packed rows as cu_seq_lens (transformers derives them from position ids in every layer
# unless they are given).
VARLEN_ATTENTION = ["flash_attention_2", "flash_attention_3", "torch_varlen"]


def attention_inputs(model, position_ids):
    """The model's keyword arguments for a micro-batch's packed rows (position_ids None: plain rows, nothing to add):
    the position ids, and for the variable-length kernels the conversations' boundaries (cu_seq_lens, the longest
    length), found once per micro-batch with transformers' own helper instead of once per layer. The longest length
    is a number on the host: one sync per micro-batch, which these kernels need to size their launch."""
    if position_ids is None:
        return {}
    if model.config._attn_implementation not in VARLEN_ATTENTION:
        return {"position_ids": position_ids}
    (cu_seq_lens_q, cu_seq_lens_k), (max_length_q, max_length_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    return {"position_ids": position_ids, "cu_seq_lens_q": cu_seq_lens_q, "cu_seq_lens_k": cu_seq_lens_k,
            "max_length_q": int(max_length_q), "max_length_k": int(max_length_k)}


def load_tokenizer(args):
    """The model's tokenizer, or None where it has none here (a built-in architecture, a Hub id not in the cache): the
    UTF-8 bytes of the text are then the token ids (0..255, valid for any vocabulary >= 256)."""
    try:
        return AutoTokenizer.from_pretrained(args.model, local_files_only=not args.allow_download)
    except (OSError, ValueError) as err:
        print(f"no tokenizer for {args.model} ({first_line(err)}): using UTF-8 bytes as token ids")


def load_token_stream(args, source, eos_id, tokenizer, tokens_needed):
    """The --text-field of each row tokenized, rows joined by EOS and empty ones skipped, as one 1-D tensor. Data that
    cannot be read, lacks the field, is not UTF-8 or holds no text ends the run with one error line."""
    encode = (lambda text: tokenizer(text)["input_ids"]) if tokenizer else (lambda text: list(text.encode("utf-8")))
    ids = []
    for index, row in enumerate(read_rows(args, source)):
        if args.text_field not in row:
            raise missing_fields(source, index, row, args)
        if not isinstance(text := row[args.text_field], str):
            raise SystemExit(f"error: data {source}: row {index}: field {args.text_field!r} holds {text!r:.40}, "
                             f"not text")
        ids += encode(text) + [eos_id] if text.strip() else []
        if len(ids) >= tokens_needed:  # stop early: a big corpus needs only as many tokens as the run trains on
            break
    if not ids:
        raise SystemExit(f"error: data {source}: contains no text in field {args.text_field!r}")
    return torch.tensor(ids, dtype=torch.long)


def chat_template_of(args, tokenizer):
    """The template conversations are rendered with: --chat-template FILE, else the tokenizer's, else (no tokenizer)
    the built-in byte-level one. A tokenizer without a template and no FILE is an error: guessing one would train a
    format the model is never prompted with."""
    if args.chat_template:
        try:
            return Path(args.chat_template).read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise SystemExit(f"error: --chat-template {args.chat_template}: {first_line(err)}") from None
    if tokenizer is None:
        return BYTE_CHAT_TEMPLATE
    if not tokenizer.chat_template:
        raise SystemExit(f"error: the tokenizer of {args.model} has no chat template: give one with --chat-template "
                         f"FILE (a Jinja template, as in a tokenizer_config.json)")
    return tokenizer.chat_template


def render_chat(messages, template, tokenizer, add_generation_prompt):
    """The conversation as text, through the chat template: the tokenizer's apply_chat_template, or without a
    tokenizer transformers' own Jinja renderer (the same function apply_chat_template calls)."""
    if tokenizer is not None:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    from transformers.utils.chat_template_utils import render_jinja_template
    return render_jinja_template([messages], chat_template=template, add_generation_prompt=add_generation_prompt)[0][0]


def encode_with_offsets(text, tokenizer, add_special_tokens):
    """(token ids, the character each token starts at): the tokenizer's offsets, or each UTF-8 byte and its char."""
    if tokenizer is None:
        return ([byte for char in text for byte in char.encode("utf-8")],
                [index for index, char in enumerate(text) for _ in char.encode("utf-8")])
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return encoded["input_ids"], [start for start, _ in encoded["offset_mapping"]]


def check_messages(source, index, messages):
    """A `messages` value must be a list of {"role": str, "content": str} turns: one error line otherwise."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)
            for turn in messages):
        raise SystemExit(f"error: data {source}: row {index}: 'messages' must be a list of turns like "
                         f"{{\"role\": \"user\", \"content\": \"...\"}}, got {messages!r:.60}")


def conversation_tokens(args, source, index, row, template, tokenizer, eos_id):
    """(token ids, target flags) of one chat or prompt/completion row; None where it has no answer to train on.

    Targets are the tokens of the answers: each assistant turn as the template renders it (its end-of-turn tokens
    included), or the completion followed by EOS; --train-on-prompt makes every token a target. An answer's span is
    found by rendering the conversation up to it twice: up to the turn before with the generation prompt (where the
    answer starts) and through the answer (where it ends); tokens starting inside a span are targets. This needs a
    template that renders a conversation turn by turn, as chat templates do for generation."""
    if args.data_format == "prompt-completion":
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):  # plain text: no template, EOS ends the answer
            if not completion.strip():
                return None
            ids, starts = encode_with_offsets(prompt + completion, tokenizer, add_special_tokens=True)
            targets = [args.train_on_prompt or start >= len(prompt) for start in starts]
            # a special token the tokenizer adds (BOS) has offset 0: part of the prompt
            return ids + [eos_id], targets + [True]
        messages, first_answer = ([*prompt, *completion], len(prompt)) if isinstance(prompt, list) and isinstance(
            completion, list) else (None, 0)
        if messages is None:
            raise SystemExit(f"error: data {source}: row {index}: 'prompt' and 'completion' must both be text or both "
                             f"lists of turns")
    else:
        messages, first_answer = row["messages"], 0
    check_messages(source, index, messages)
    try:
        text = render_chat(messages, template, tokenizer, add_generation_prompt=False)
        spans = []
        for turn in range(first_answer, len(messages)):
            if messages[turn]["role"] == "assistant":
                start = render_chat(messages[:turn], template, tokenizer, add_generation_prompt=True)
                end = render_chat(messages[:turn + 1], template, tokenizer, add_generation_prompt=False)
                if not (text.startswith(start) and text.startswith(end) and len(start) <= len(end)):
                    raise ValueError("it does not render a conversation turn by turn (a shorter conversation's "
                                     "text is not the start of a longer one's), so the answers cannot be located")
                spans.append((len(start), len(end)))
    except Exception as err:  # jinja2's errors, the template's own raise_exception, ours above
        raise SystemExit(f"error: data {source}: row {index}: the chat template does not render it: "
                         f"{first_line(err)}") from None
    if not spans:
        return None
    ids, starts = encode_with_offsets(text, tokenizer, add_special_tokens=False)  # the template writes BOS itself
    return ids, [args.train_on_prompt or any(a <= start < b for a, b in spans) for start in starts]


def load_conversations(args, source, eos_id, tokenizer, rows_needed):
    """[(token ids, shifted labels)] of the chat or prompt/completion rows of `source`, read until they fill
    rows_needed rows of --seq-len (packed: a quarter more tokens than the rows hold, as first fit leaves some room in
    each row) or give rows_needed conversations (padded). Each conversation's labels are
    shifted within it: its last position predicts nothing, so no position learns the next conversation's first token.
    A conversation longer than --seq-len is cut to it; one without an answer is skipped; both are counted."""
    template = chat_template_of(args, tokenizer)
    conversations, tokens, skipped, truncated = [], 0, 0, 0
    for index, row in enumerate(read_rows(args, source)):
        if row_format(row, args.text_field) != args.data_format:
            raise missing_fields(source, index, row, args)
        ids, targets = conversation_tokens(args, source, index, row, template, tokenizer, eos_id) or ([], [])
        truncated += len(ids) > args.seq_len
        ids, targets = ids[:args.seq_len], targets[:args.seq_len]
        if not any(targets[1:]):  # no answer (within --seq-len); the first token is never predicted
            skipped += 1
            continue
        labels = [token if target else -100 for token, target in zip(ids[1:], targets[1:])] + [-100]
        conversations.append((ids, labels))
        tokens += len(ids)
        if len(conversations) >= rows_needed and (args.packing == "off" or tokens >= 1.25 * rows_needed * args.seq_len):
            break
    what = ("an assistant turn" if args.data_format == "chat" else "a completion") + f" within {args.seq_len} tokens"
    if not conversations:
        raise SystemExit(f"error: data {source}: no row has {what} to train on ({skipped} read)")
    print(f"data {source}: {len(conversations)} conversations" + (f", {skipped} without {what} skipped" * bool(skipped))
          + (f", {truncated} longer than --seq-len {args.seq_len} truncated" * bool(truncated))
          + ("" if tokenizer else ", tokenized as UTF-8 bytes with the built-in chat template (no tokenizer)"))
    return conversations


def pack_conversations(conversations, seq_len):
    """Rows of whole conversations, each at most seq_len tokens: first fit, in order (each conversation goes into the
    first row with room for it, so short ones fill the gaps the long ones leave). Returns lists of indices."""
    rows, free = [], []
    for index, (ids, _) in enumerate(conversations):
        row = next((r for r, room in enumerate(free) if room >= len(ids)), None)
        if row is None:
            rows.append([])
            free.append(seq_len)
            row = len(rows) - 1
        rows[row].append(index)
        free[row] -= len(ids)
    return rows


def conversation_rows(conversations, groups, length, pad_id):
    """[3, len(groups), length] tensors: each group's conversations side by side, padded at the end. Positions restart
    at 0 at every conversation (and in the padding, which then counts as one more document): transformers sees
    the boundaries in them and keeps attention within each conversation, and RoPE gets each token's own position."""
    fields = torch.full((3, len(groups), length), -100, dtype=torch.long)
    fields[0] = pad_id
    for row, group in enumerate(groups):
        at = 0
        for ids, labels in (conversations[index] for index in group):
            fields[0, row, at:at + len(ids)] = torch.tensor(ids)
            fields[1, row, at:at + len(ids)] = torch.tensor(labels)
            fields[2, row, at:at + len(ids)] = torch.arange(len(ids))
            at += len(ids)
        fields[2, row, at:] = torch.arange(length - at)
    return fields


def make_batches(args, split, vocab_size, eos_id, tokenizer, device, rank=0, world_size=1):
    """The batches of "train" (--steps steps of --grad-accum-steps micro-batches of --data) or "eval" (--eval-batches
    of --eval-data, or of the end of --data with --eval-split), each [3, batch, T] (token ids, shifted labels,
    positions), and the real (not padding) tokens of each step over all ranks. The same arguments give the same
    batches: --resume continues the data where the checkpoint left it. --fsdp: rank r trains rows r::world_size."""
    resolve_data_format(args)
    n_batches = args.steps * args.grad_accum_steps if split == "train" else args.eval_batches
    per_step = args.grad_accum_steps if split == "train" else 1
    rows = world_size * args.batch_size
    tokens_needed = n_batches * rows * args.seq_len
    source = args.eval_data if split == "eval" and args.eval_data else args.data
    if args.data_format != "text":
        # --eval-split: read what training needs plus the held-out share, then hold out the last conversations
        rows_needed = math.ceil(args.steps * args.grad_accum_steps * rows / (1 - args.eval_split)) \
            if args.eval_split else n_batches * rows
        conversations = load_conversations(args, source, eos_id, tokenizer, rows_needed)
        if args.eval_split:
            cut = min(max(1, int(len(conversations) * (1 - args.eval_split))), len(conversations) - 1)
            conversations = conversations[:cut] if split == "train" else conversations[cut:]
        if max(max(ids) for ids, _ in conversations) >= vocab_size:
            raise SystemExit(f"error: data {source}: token ids outside the model's vocabulary ({vocab_size})")
        groups = (pack_conversations(conversations, args.seq_len) if args.packing == "on"
                  else [[index] for index in range(len(conversations))])
        if len(groups) < n_batches * rows:
            print(f"{split} data fills {len(groups)} rows, the run needs {n_batches * rows}: cycling through them")
            groups = (groups * -(-n_batches * rows // len(groups)))
        groups = groups[:n_batches * rows]
        steps = []
        for first in range(0, len(groups), per_step * rows):  # padded: each step to its longest conversation
            step_groups = groups[first:first + per_step * rows]
            length = args.seq_len if args.packing == "on" else max(
                sum(len(conversations[index][0]) for index in group) for group in step_groups)
            steps.append(conversation_rows(conversations, step_groups, length, eos_id).view(3, per_step, rows, length)
                         .transpose(0, 1)[:, :, rank::world_size].contiguous().to(device))
        real_tokens = [sum(len(conversations[index][0]) for group in groups[first:first + per_step * rows]
                           for index in group) for first in range(0, len(groups), per_step * rows)]
        fill = sum(real_tokens) / sum(step.shape[0] * rows * step.shape[-1] for step in steps)
        return {"steps": steps if split == "train" else [step[0] for step in steps], "real_tokens": real_tokens,
                "fill": fill, "conversations": len(conversations),
                "tokenized_by": "the built-in chat template over UTF-8 bytes" if tokenizer is None else "the tokenizer"}
    if source == "synthetic":  # what the playbook trains on: uniform random tokens (loss stays near ln V)
        generator = torch.Generator().manual_seed(args.seed + (split == "eval"))  # held-out tokens are others
        stream = torch.randint(0, vocab_size, (tokens_needed,), generator=generator)
    else:
        # --eval-split: read what training needs plus the held-out share, then hold out the end of what was read
        train_tokens = args.steps * args.grad_accum_steps * rows * args.seq_len
        stream = load_token_stream(args, source, eos_id, tokenizer, math.ceil(train_tokens / (1 - args.eval_split))
                                   if args.eval_split else tokens_needed)
        if args.eval_split:
            cut = int(stream.numel() * (1 - args.eval_split))
            stream = stream[:cut] if split == "train" else stream[cut:]
        if stream.numel() < 2 or int(stream.max()) >= vocab_size:
            raise SystemExit(f"error: data {source}: its {split} part has {stream.numel()} tokens, or ids outside the "
                             f"model's vocabulary ({vocab_size})")
        if stream.numel() < tokens_needed:
            print(f"{split} data has {stream.numel()} tokens, the run needs {tokens_needed}: cycling through it")
            stream = stream.repeat(-(-tokens_needed // stream.numel()))
    # Consecutive seq_len windows of the stream, every token a target (no padding; attention crosses document
    # boundaries, the usual simplification for pre-training-style text).
    input_ids = stream[:tokens_needed].view(n_batches, rows, args.seq_len)[:, rank::world_size]
    batches = text_batch(input_ids).view(n_batches // per_step, per_step, 3, *input_ids.shape[1:]).to(device)
    return {"steps": batches if split == "train" else batches[:, 0], "real_tokens": [per_step * rows * args.seq_len]
            * (n_batches // per_step), "fill": 1.0, "conversations": None,
            "tokenized_by": "random ids" if source == "synthetic" else "UTF-8 bytes" if tokenizer is None
            else "the tokenizer"}


def text_batch(input_ids):
    """[..., 3, rows, T] of text windows [..., rows, T]: the ids, their labels shifted, positions 0..T-1 in each row."""
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    return torch.stack([input_ids, shift_labels_of(input_ids), positions], dim=-3).contiguous()


def load_data(args, config, device, rank, world_size):
    """The tokenizer (None: synthetic data, or UTF-8 bytes as ids) and {"train": batches, "eval": batches or None}."""
    tokenizer = load_tokenizer(args) if args.data != "synthetic" or args.eval_data or args.output_dir else None
    eos_id = tokenizer.eos_token_id if tokenizer else config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id  # a config may list several (chat turn ends)
    wants_eval = args.eval_data or args.eval_split or args.eval_steps
    return tokenizer, {split: make_batches(args, split, config.vocab_size, eos_id, tokenizer, device, rank, world_size)
                       if split == "train" or wants_eval else None for split in ("train", "eval")}


def shift_labels_of(labels):
    """What transformers' ForCausalLMLoss does: position t predicts token t+1, the last position predicts nothing.
    Shifting the labels (instead of slicing the logits) keeps the [B, T, V] logits whole: no copy of them."""
    return F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()  # contiguous: [B, T] rows, viewable as [B*T]


def targets_per_rank(micro_batches, world_size):
    """The divisor of an optimizer step's (or an evaluation's) summed per-token losses: its target tokens over all
    micro-batches and ranks, divided by the number of ranks, because FSDP averages the ranks' gradients. Each
    micro-batch's sum over this divisor then adds up to the token-weighted mean of the whole step, however the targets
    fall between micro-batches and ranks. A device tensor: counting and the all-reduce need no host sync."""
    count = sum((labels != -100).sum() for _, labels, _ in micro_batches)
    if world_size > 1:
        dist.all_reduce(count)  # a collective on the device, not a host sync
    return count.float() / world_size
