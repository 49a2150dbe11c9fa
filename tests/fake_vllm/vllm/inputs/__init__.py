"""The fake of ``vllm.inputs``: ``tokens_input`` builds the already rendered token input (a ``TokensInput`` dict)."""


def tokens_input(prompt_token_ids, *, prompt=None, cache_salt=None):
    return {"type": "token", "prompt_token_ids": list(prompt_token_ids)}
