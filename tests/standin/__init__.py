"""A test double for `vllm serve`: vLLM's CLI, startup lines and HTTP surface, without a GPU."""
