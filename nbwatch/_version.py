"""The package version, in a leaf that anything may import (the run's environment, the CLI)."""

__version__ = "0.1.0"
