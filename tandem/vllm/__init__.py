"""The vLLM backend worker: tandem's counterpart of Dynamo's `python -m dynamo.vllm`.

`args` parses the command line into a `Config` (Dynamo flags plus vLLM's `AsyncEngineArgs`), `envs` holds
the worker's own environment variables. Importing this package does not import vLLM.
"""
