"""What a user sees on the console: megarl's own log lines, without the import-time chatter of the libraries
it drives (megatron-core's missing-TE/apex notices and deprecations, transformers' tokenizer notes)."""

from __future__ import annotations

import logging
import os
import warnings

QUIET_ENV = "MEGARL_QUIET"  # set by the CLI so that every process it starts (torchrun, spawn) is quiet too

_NOISE = [  # (message regex, category)
    (r".*(Transformer Engine|Apex|apex|absl|DTensor|ShardedTensor|MimoModelConfig|full scope is deprecated).*",
     UserWarning),
    (r".*\.grad attribute of a Tensor that is not a leaf.*", UserWarning),  # megatron reads .grad of views
    # megatron-core's dist_checkpointing.load reads the common state with torch DCP, no_dist=True and positional
    # arguments: torch warns of both on every resume
    (r"torch\.distributed is disabled, unavailable or uninitialized.*", UserWarning),
    (r"The argument order of load has been changed.*", UserWarning),
    (r".*", FutureWarning),
]
_LOGGERS = ("megatron", "megatron.core", "transformers", "torch.distributed", "torch.utils.cpp_extension",
            "accelerate")


def quiet_libraries() -> None:
    """Filter the known third-party warnings and raise third-party loggers to ERROR, in this process and (by
    :data:`QUIET_ENV`) in the processes it starts."""
    os.environ[QUIET_ENV] = "1"
    for message, category in _NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def quiet_other_ranks() -> None:
    """In a rank of a job other than rank 0 (``RANK``, else ``SLURM_PROCID``), megarl's own log lines below
    ERROR are dropped: rank 0 speaks for the job (a note such as a missing EOS id or removed validation prompts
    came once per rank), while every rank still reports its errors."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    if rank.isdigit() and int(rank) != 0:
        logging.getLogger("megarl").setLevel(logging.ERROR)
