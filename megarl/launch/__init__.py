"""Starting work: local worlds for single-node tools (:mod:`megarl.launch.convert`)."""
