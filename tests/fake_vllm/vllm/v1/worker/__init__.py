"""The fake of ``vllm.v1.worker``."""
