"""Benchmark: what streaming one answer's text costs the host, token by token, as `serve` streams it
(StreamedText with a stop string: its text so far, the part safe to send), against decoding the whole answer
again at every token (what it did before IncrementalText) in the same run, with the shipped model's tokenizer.

    python -P bench/stream_text.py [--lengths 256,1024,4096] [--out FILE]

For each answer length: host seconds per answer both ways and the ratio; the answer is the tokenizer's own
tokens of GSM8K-style text. The texts sent are checked equal both ways. Prints a JSON line per length.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from npuport.fixtures.train_tiny import trained_tiny_path  # noqa: E402
from npuport.runtime.completion import stop_at  # noqa: E402
from npuport.runtime.serving.api_answers import StreamedText  # noqa: E402

TEXT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May? Natalia sold 48/2 = 24 clips in May. ")
STOP = ["Question:"]


def whole_decode_stream(decode, tokens: list[int]) -> str:
    """The old way: the whole answer decoded at every token, the stop strings searched in all of it."""
    hold = max(map(len, STOP)) - 1
    sent = ""
    for n in range(1, len(tokens) + 1):
        text = decode(tokens[:n])
        found = stop_at(text, STOP)
        safe = (text[:found[0]] if found else text[:len(text) - hold]).rstrip("\ufffd")
        if safe.startswith(sent):
            sent = safe
    return sent


def incremental_stream(decode, tokens: list[int]) -> str:
    streamed = StreamedText(decode, STOP)
    return "".join(streamed.add([t]) for t in tokens)


def seconds(fn, *args) -> tuple[float, str]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(trained_tiny_path())

    def decode(ids):
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    pool = tokenizer.encode(TEXT * 400)
    results = []
    for length in map(int, args.lengths.split(",")):
        tokens = pool[:length]
        old_s, old_text = seconds(whole_decode_stream, decode, tokens)
        new_s, new_text = seconds(incremental_stream, decode, tokens)
        assert new_text == old_text, "the two ways sent different text"
        results.append({"tokens": length, "whole_decode_s": round(old_s, 4), "incremental_s": round(new_s, 4),
                        "incremental_us_per_token": round(new_s / length * 1e6, 1),
                        "speedup": round(old_s / new_s, 1)})
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
