"""What the trainer and ``megarl bench`` measure with: model FLOPs and the peak rates behind MFU
(:mod:`~megarl.measure.flops`), the tokens, FLOPs, tokens/s/GPU and MFU of each phase of an RL step
(:mod:`~megarl.measure.throughput`), phase timers with peak memory (:mod:`~megarl.measure.timers`) and
utilisation and memory sampling, NVML on a GPU (:mod:`~megarl.measure.monitor`).

It sits below both of its users (``trainer`` and ``bench`` import it; it imports ``models`` for the model's
shape and nothing above), so the trainer no longer imports the ``bench`` commands, which import the trainer.
"""
