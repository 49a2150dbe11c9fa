"""``python -m megarl.cli``: the ``megarl`` command (:func:`megarl.cli.entry`)."""

from megarl.cli import entry

if __name__ == "__main__":  # not in a multiprocessing spawn child, which imports this module as __mp_main__
    entry()
