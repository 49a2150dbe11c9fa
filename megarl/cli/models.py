"""``megarl convert`` and ``megarl export``: checkpoints between Hugging Face (or GGUF) and megarl's layout."""

from __future__ import annotations

import argparse

from megarl.cli.args import OVERWRITE_HELP, command, positive_int


@command("convert", help="HF directory / GGUF -> megarl (Megatron dist) checkpoint")
def _convert(p: argparse.ArgumentParser):
    from megarl.config import DTYPES

    p.add_argument("src", help="Hugging Face directory, .gguf file, or 'default' (SmolLM2-135M-Instruct GGUF)")
    p.add_argument("out", help="output megarl checkpoint directory")
    p.add_argument("--tp", type=positive_int("--tp"), default=1, help="tensor-parallel size of the conversion world")
    p.add_argument("--pp", type=positive_int("--pp"), default=1,
                   help="pipeline-parallel size of the conversion world")
    p.add_argument("--vpp", type=positive_int("--vpp"), default=1,
                   help="virtual pipeline stages (model chunks) per pipeline rank of the conversion world")
    p.add_argument("--dtype", choices=DTYPES, default=None)
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.launch.convert import convert_to_megarl

        path = convert_to_megarl(None if a.src == "default" else a.src, a.out, tp=a.tp, pp=a.pp, vpp=a.vpp,
                                 dtype=a.dtype, overwrite=a.overwrite)
        print(f"wrote megarl checkpoint {path}")
        return 0
    return run


@command("export", help="megarl checkpoint -> Hugging Face directory")
def _export(p: argparse.ArgumentParser):
    p.add_argument("ckpt", help="megarl checkpoint directory (from `megarl convert` or `megarl train`)")
    p.add_argument("out", help="output Hugging Face directory")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)

    def run(a: argparse.Namespace) -> int:
        from megarl.launch.convert import export_to_hf

        print(f"wrote Hugging Face checkpoint {export_to_hf(a.ckpt, a.out, overwrite=a.overwrite)}")
        return 0
    return run
