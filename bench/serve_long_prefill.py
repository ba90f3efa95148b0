"""Benchmark: a long prompt's prefill does not hold up a short request in `npuport serve` (continuous batching,
issue 41's acceptance on the CPU), against a real `npuport serve` process of the shipped tiny model.

    python -P bench/serve_long_prefill.py [--model DIR] [--prompts 4] [--prompt-tokens 32768] [--probes 5]
                                          [--out FILE]

1. alone: one request of --prompts prompts of --prompt-tokens random token ids (8 tokens each, ignore_eos), timed;
2. together: the same request again, and while it prefills, --probes requests of 2 tokens one after another
   (each sent once the one before was answered, a second apart): each one's latency; then the long request's
   answer compared with the one it got alone;
3. cancelled: the long request again, its connection closed after a few seconds; then a 2-token request's
   latency, which tells whether the prefill went on.
Prints a JSON summary (--out writes it too).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engines.engine_servers import npuport_serving, post_json  # noqa: E402
from npuport.fixtures.train_tiny import trained_tiny_path  # noqa: E402

NEW_TOKENS = 8


def long_body(prompts: int, tokens: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 2000, (prompts, tokens), generator=g).tolist()
    return {"prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


SHORT = {"prompt": [[5, 6, 7, 8]], "max_tokens": 2, "temperature": 0, "ignore_eos": True}


def timed_post(url: str, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    answer = post_json(url + "/v1/completions", body, timeout_s=3600)
    return time.perf_counter() - start, answer


def send_and_drop(url: str, body: dict, after_s: float) -> None:
    """POST `body` over a raw socket and close the connection after_s seconds later, unanswered."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    with socket.create_connection((parts.hostname, parts.port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(after_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--probes", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or trained_tiny_path()
    body = long_body(args.prompts, args.prompt_tokens)
    summary: dict = {"model": str(model), "prompts": args.prompts, "prompt_tokens": args.prompt_tokens}
    with tempfile.TemporaryDirectory() as tmp, npuport_serving(model, "bench", Path(tmp) / "serve.log") as url:
        timed_post(url, SHORT)  # warm-up
        summary["alone_s"], alone = timed_post(url, body)
        together: dict = {}

        def long_request() -> None:
            together["seconds"], together["answer"] = timed_post(url, body)

        thread = threading.Thread(target=long_request)
        thread.start()
        probes = []
        for _ in range(args.probes):
            time.sleep(1.0)
            seconds, answer = timed_post(url, SHORT)
            probes.append({"seconds": seconds, "completion_tokens": answer["usage"]["completion_tokens"],
                           "long_still_running": thread.is_alive()})
        thread.join()
        summary["short_while_long_prefills"] = probes
        summary["together_s"] = together["seconds"]
        summary["long_answer_equal_to_alone"] = ([c["text"] for c in together["answer"]["choices"]]
                                                 == [c["text"] for c in alone["choices"]])
        send_and_drop(url, body, after_s=5.0)
        time.sleep(1.0)
        summary["short_after_cancel_s"], _ = timed_post(url, SHORT)
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
