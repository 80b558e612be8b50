"""kvseal: prefill/decode disaggregated LLM serving where no request reads KV pages not written for it."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _installed

try:
    __version__ = _installed("kvseal")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown (not installed)"
