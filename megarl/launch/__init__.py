"""Starting work: local worlds for single-node tools (:mod:`megarl.launch.convert`), and SLURM batch jobs:
``megarl submit`` (:mod:`megarl.launch.submit`) and ``megarl sweep`` (:mod:`megarl.launch.sweep`, with the
per-rank memory estimate of :mod:`megarl.launch.memory`).

The SLURM jobs build on SLURM and torchrun-style environment variables as they are: ``sbatch`` queues the job,
``srun`` starts one task per rank, and every rank finds its place from ``SLURM_PROCID``/``SLURM_NTASKS`` and
the ``MASTER_ADDR``/``MASTER_PORT`` that the batch script exports (:func:`megarl.parallel.mesh.launch_info`).
"""
