"""The error of a model description megarl cannot build (:class:`SpecError`), below :mod:`megarl.models.spec` and
the family modules it reads configs with, so that they raise it without importing the spec (imports run one way)."""


class SpecError(ValueError):
    """A model config that megarl cannot build, or a layout that does not fit the model."""
