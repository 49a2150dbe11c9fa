"""The fake of ``vllm.v1``: the model runners that :mod:`megarl.rollout.vllm_logprobs` hooks (:mod:`.worker`)."""
