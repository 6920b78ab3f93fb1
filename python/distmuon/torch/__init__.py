"""PyTorch front of distmuon: :class:`Muon`, a drop-in ``torch.optim.Optimizer``."""

from distmuon.torch._params import default_muon_filter, is_embedding_or_head_name
from distmuon.torch.optimizer import Muon

__all__ = ["Muon", "default_muon_filter", "is_embedding_or_head_name"]
