"""The one exception type the loaders raise for bad user input."""


class ModelLoadError(Exception):
    """One clear, user-facing message naming the file/value and what is wrong.

    Raised instead of the parsers' own exceptions, so a CLI or server can print
    it as is, without a traceback.
    """
