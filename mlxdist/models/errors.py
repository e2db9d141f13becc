"""The error both pretrained-model readers raise (pretrained.py, gguf.py), apart from either."""


class PretrainedError(ValueError):
    """A one-line, user-facing problem with a pretrained model path."""
