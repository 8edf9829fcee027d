"""`tandem frontend` whose prompt preprocessing waits, for each request, until the file named by
TANDEM_TEST_GATE exists (tests/frontend/test_frontend_offloop.py): a request can be held inside its tokenization
for as long as a test needs."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from tandem.frontend import main, preprocess

GATE = os.environ["TANDEM_TEST_GATE"]
_chat_prompt, _completion_prompt = preprocess.Preprocessor.chat_prompt, preprocess.Preprocessor.completion_prompt


def _gated(original: Any) -> Any:
    def wait_then(self: preprocess.Preprocessor, request: Any) -> Any:
        with open(f"{GATE}.entered", "a") as f:  # tells the test a request is being tokenized
            f.write("x")
        while not os.path.exists(GATE):
            time.sleep(0.01)  # blocks whichever thread tokenizes: the event loop itself if it were that one
        return original(self, request)

    return wait_then


preprocess.Preprocessor.chat_prompt = _gated(_chat_prompt)  # type: ignore[method-assign]
preprocess.Preprocessor.completion_prompt = _gated(_completion_prompt)  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main.main())
