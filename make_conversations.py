"""Writes a data set of conversations to measure fine-tuning on: JSON lines of chat rows (`messages`, role/content
turns) or prompt/completion rows, nothing downloaded.

What matters for speed is the spread of lengths, not the words: real instruction and chat data sets hold many short
conversations and a long tail (the shapes that make padding expensive and packing worth it). Each conversation's
length is drawn from a log-normal distribution (median --median-tokens, spread --sigma) and cut to [--min-tokens,
--max-tokens]; it then gets 1 to --max-turns user/assistant exchanges, the answers about twice as long as the
questions. Lengths count tokens of --tokenizer (a Hub id in the local cache, or a folder); without one, UTF-8 bytes,
the token ids the fine-tune scripts use when the model has no tokenizer, so the lengths are what they train on either
way. The words come from a fixed list of common English words (each one token for LLaMA-3's tokenizer).

    python make_conversations.py                                   # 2000 chat rows -> runs/conversations.jsonl
    python make_conversations.py --tokenizer meta-llama/Llama-3.1-8B --out runs/conversations_llama3.jsonl
    python finetune_optimized.py --data runs/conversations.jsonl --seq-len 8192
"""
import argparse
import json
import math
import random
import statistics
from pathlib import Path

WORDS = ("the of and to in is that it for on with as was be by this are from at or an have not but they which one you "
         "all were can there more will when what their has would each about how up out them then she many some so "
         "these her two other into time like him see could now than first been who its people may long down day did "
         "get come made part over new sound take only little work know place year live back give most very after "
         "thing our just name good sentence man think say great where help through much before line right too mean "
         "old any same tell boy follow came want show also around form three small set put end does another well "
         "large must big even such because turn here why ask went men read need land different home us move try "
         "kind hand picture again change off play spell air away animal house point page letter mother answer found "
         "study still learn should world high every near add food between own below country plant last school father "
         "keep tree never start city earth eye light thought head under story saw left few while along might close "
         "something seem next hard open example begin life always those both paper together got group often run "
         "important until children side feet car mile night walk white sea began grow took river four carry state "
         "once book hear stop without second later miss idea enough eat face watch far really almost let above girl "
         "sometimes mountain cut young talk soon list song being leave family model data train step memory kernel "
         "token answer question").split()


def build_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--out", default="runs/conversations.jsonl", help="the JSON lines file to write")
    add("--rows", type=int, default=2000, help="conversations")
    add("--format", choices=["chat", "prompt-completion"], default="chat", help="messages rows, or prompt and "
        "completion rows (one exchange each)")
    add("--median-tokens", type=float, default=400, help="median length of a conversation's text")
    add("--sigma", type=float, default=1.0, help="spread of the log-normal lengths (the log's standard deviation)")
    add("--min-tokens", type=int, default=50, help="shortest conversation")
    add("--max-tokens", type=int, default=4000, help="longest conversation")
    add("--max-turns", type=int, default=4, help="most user/assistant exchanges per conversation")
    add("--tokenizer", default=None, help="count lengths in this tokenizer's tokens (default: UTF-8 bytes)")
    add("--seed", type=int, default=0, help="seeds the lengths and the words")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.rows <= 0 or args.max_turns <= 0 or not 0 < args.min_tokens <= args.max_tokens:
        parser.error("--rows and --max-turns must be positive, and 0 < --min-tokens <= --max-tokens")
    if not (args.median_tokens > 0 and args.sigma >= 0):
        parser.error("--median-tokens must be positive and --sigma >= 0")
    return args


def word_cost(tokenizer):
    """The length of " word" for every word: tokens of the tokenizer, or UTF-8 bytes."""
    if tokenizer is None:
        return {word: len(f" {word}".encode()) for word in WORDS}
    return {word: len(tokenizer(f" {word}", add_special_tokens=False)["input_ids"]) for word in WORDS}


def text_of(length, rng, cost):
    """Random words adding up to about `length` tokens (at least one word)."""
    words, used = [], 0
    while used < length or not words:
        word = rng.choice(WORDS)
        words.append(word)
        used += cost[word]
    return " ".join(words).capitalize() + "."


def conversation(length, rng, cost, max_turns):
    """The turns of one conversation of about `length` tokens: questions a third of each exchange, answers the rest."""
    turns = rng.randint(1, max_turns)
    messages = []
    for _ in range(turns):
        exchange = length / turns
        messages += [{"role": "user", "content": text_of(exchange / 3, rng, cost)},
                     {"role": "assistant", "content": text_of(2 * exchange / 3, rng, cost)}]
    return messages


def main(argv=None):
    args = parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        except (OSError, ValueError) as err:
            raise SystemExit(f"error: --tokenizer {args.tokenizer}: {str(err).strip().splitlines()[0]}") from None
    cost, rng = word_cost(tokenizer), random.Random(args.seed)
    lengths = [min(args.max_tokens, max(args.min_tokens, round(rng.lognormvariate(math.log(args.median_tokens),
                                                                                  args.sigma))))
               for _ in range(args.rows)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as file:
        for length in lengths:
            turns = conversation(length, rng, cost, 1 if args.format == "prompt-completion" else args.max_turns)
            row = ({"messages": turns} if args.format == "chat" else
                   {"prompt": turns[0]["content"] + "\n", "completion": " " + turns[1]["content"]})
            file.write(json.dumps(row) + "\n")
    quantiles = statistics.quantiles(lengths, n=20)
    unit = "tokens" if tokenizer else "UTF-8 bytes"
    print(f"{out}: {args.rows} {args.format} rows; text lengths in {unit} (before the chat template): median "
          f"{statistics.median(lengths):.0f}, 5 % {quantiles[0]:.0f}, 95 % {quantiles[-1]:.0f}, longest "
          f"{max(lengths)}, {sum(lengths):,} in all")


if __name__ == "__main__":
    main()
