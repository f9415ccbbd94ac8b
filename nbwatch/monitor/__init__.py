"""The `Monitor` and its parts: what it was given (setup), its run (session), the training
thread (background), the run's end with its process (exiting), the optimizer's hooks, the
options and the checks of what users pass in."""

from .monitor import Monitor

__all__ = ["Monitor"]
