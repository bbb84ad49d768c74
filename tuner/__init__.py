"""parallel-tuner: finds the fastest parallel layout to train a GPT on a cluster."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("parallel-tuner")
except PackageNotFoundError:  # a checkout without `pip install -e .`
    __version__ = "0+unknown"
