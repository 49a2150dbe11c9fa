"""The fake of ``vllm.distributed.parallel_state``: the TP group of the engine built last on this rank."""


def get_tp_group():
    import vllm

    return vllm._TP_GROUP
