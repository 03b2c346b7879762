"""The error every evaluation input problem raises, so the command line can report it without a traceback."""


class EvaluationError(ValueError):
    """A data set, label file or option that cannot be evaluated as given; the message says how to fix it."""
