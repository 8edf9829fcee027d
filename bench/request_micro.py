"""The frontend's per-request steps timed alone, for changes too small for frontend_bench's spread: a chat body
parsed and templated, and the worker request encoded and decoded (msgpack, as the request plane sends it).
Best of --rounds; run it against two trees taking turns and compare:

    for tree in /tmp/base .; do (cd $tree && PYTHONPATH=$tree python bench/request_micro.py --label $tree); done
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import msgspec

from tandem.frontend.api.openai.protocol import parse_chat_request
from tandem.llm.chat_template import ChatTemplate
from tandem.llm.protocols import PreprocessedRequest, SamplingOptions, StopConditions

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Write one sentence about a quick brown fox."}],
                   "max_tokens": 32, "stream": True}).encode()
TEMPLATE = ChatTemplate("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}<|im_start|>assistant\n")


def best_us(step: Callable[[], object], count: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(count):
            step()
        times.append((time.perf_counter() - started) / count * 1e6)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default=".")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    request = PreprocessedRequest(model="m", token_ids=list(range(40)), stop_conditions=StopConditions(max_tokens=32),
                                  sampling_options=SamplingOptions(temperature=0.0), eos_token_ids=[2])
    encode = msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(PreprocessedRequest).decode
    wire = encode(request)
    figures = {
        "parse_and_template_us": best_us(lambda: TEMPLATE.render(parse_chat_request(BODY).messages), 20_000, args.rounds),
        "encode_ns": best_us(lambda: encode(request), 200_000, args.rounds) * 1000,
        "decode_ns": best_us(lambda: decode(wire), 200_000, args.rounds) * 1000,
    }
    print(args.label, " ".join(f"{name} {value:.2f}" for name, value in figures.items()))


if __name__ == "__main__":
    main()
