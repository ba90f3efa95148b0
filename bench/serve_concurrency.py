"""Benchmark: what batching the requests in flight buys `npuport serve` - the same greedy requests sent one after
another and all at once, against one server in this process, in the same run.

    python -P bench/serve_concurrency.py [--model DIR] [--requests 16] [--max-tokens 32] [--device cpu]
                                         [--dtype float32] [--out FILE]

Each request is one GSM8K question (the sglang protocol's 5-shot prompt); the answers of the two runs are checked
equal (greedy, float32: batching must not change them). Prints requests/s and output tokens/s of both and their
ratio; --out writes them as JSON. Default model: the trained tiny checkpoint shipped with npuport.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime.serving.serve import make_server
from npuport.runtime.text_completions import RuntimeCompletions
from npuport.runtime.validation.gsm8k import make_protocol


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def timed(url: str, bodies: list[dict], concurrent: bool) -> tuple[float, list[dict]]:
    start = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: post(url, b), bodies))
    else:
        answers = [post(url, b) for b in bodies]
    return time.perf_counter() - start, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or trained_tiny_path()
    runner = RuntimeCompletions.load(model, device=args.device, dtype=args.dtype, batch_size=args.requests)
    bodies = [{"prompt": p, "max_tokens": args.max_tokens, "temperature": 0}
              for p in make_protocol("sglang").prompts(args.requests)]
    server = make_server(runner, "bench")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        post(server.url, bodies[0])  # warm-up
        results = {}
        for name, concurrent in (("one after another", False), ("all at once", True)):
            seconds, answers = timed(server.url, bodies, concurrent)
            tokens = sum(a["usage"]["completion_tokens"] for a in answers)
            results[name] = {"seconds": seconds, "requests_per_s": len(bodies) / seconds,
                             "output_tokens_per_s": tokens / seconds,
                             "texts": [a["choices"][0]["text"] for a in answers]}
    finally:
        server.shutdown()
        server.server_close()
    one, many = results["one after another"], results["all at once"]
    same = one.pop("texts") == many.pop("texts")
    summary = {"model": str(model), "device": args.device, "dtype": args.dtype, "requests": args.requests,
               "max_tokens": args.max_tokens, "answers_equal": same, **results,
               "speed_up": one["seconds"] / many["seconds"]}
    print(json.dumps(summary, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
