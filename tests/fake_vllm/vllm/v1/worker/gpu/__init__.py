"""The fake of ``vllm.v1.worker.gpu`` (vLLM 0.24.0's V2 model runner)."""
