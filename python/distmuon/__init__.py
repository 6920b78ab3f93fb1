"""distmuon: the Muon optimizer as cheap as AdamW in distributed training.

The C++ engine is exposed as :mod:`distmuon._C` (types only); the PyTorch optimizer is
:class:`distmuon.torch.Muon`.
"""

from distmuon import _cuda_libs
from distmuon._version import __version__

# Before _C: its CUDA libraries must be the copies torch loads, in either import order.
_cuda_libs.load()

from distmuon._C import Error, TimeoutError, cuda_available  # noqa: E402

__all__ = ["Error", "TimeoutError", "__version__", "cuda_available"]
