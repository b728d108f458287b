"""Streams completions from the token_budget example with httpx, 800 tokens at a time with one
API key, until its budget of 2 000 tokens per minute runs out.

    cargo run --example token_budget               # in another terminal
    pip install httpx
    python3 examples/token_budget_client.py [URL]  # default http://127.0.0.1:3000
"""

import json
import sys

import httpx

url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:3000"

with httpx.Client(base_url=url, headers={"x-api-key": "key-a"}) as client:
    for n in range(1, 6):
        with client.stream("GET", "/v1/complete", params={"tokens": 800}) as response:
            if response.status_code == 429:
                retry = response.headers["retry-after"]
                print(f"request {n}: 429, retry after {retry} s")
                break
            response.raise_for_status()
            print(f"request {n}: {response.status_code}", end="", flush=True)
            tokens, usage, event = 0, None, None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line.removeprefix("event: ")
                elif line.startswith("data: ") and event == "usage":
                    usage = json.loads(line.removeprefix("data: "))["total_tokens"]
                elif line.startswith("data: "):
                    tokens += 1
                    if tokens <= 5:  # the first words as they arrive, then a count
                        print(" " + line.removeprefix("data: "), end="", flush=True)
                elif not line:
                    event = None
            print(f" ... {tokens} tokens, usage {usage}")
