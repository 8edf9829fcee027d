"""The kernel every API of the frontend builds on: errors (`errors`), body decoding and the rule tables
(`validation`), JSON and SSE framing (`sse`), and the contract of an answer (`answer`). It imports nothing
else from the frontend."""
