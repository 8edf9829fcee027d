"""What every worker kind (vLLM, mocker, test engine) shares, so that no worker imports another: the canary
health payload (`health`) and the KV load report (`load`)."""
