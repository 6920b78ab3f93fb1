"""PyTorch front of distmuon: :class:`Muon`, a drop-in ``torch.optim.Optimizer``, and
:func:`dedicate`, the dedicated-ownership runtime (DMuon) for FSDP2 and HSDP."""

from distmuon.torch._params import default_muon_filter, is_embedding_or_head_name
from distmuon.torch.dedicate import Dedicated, dedicate
from distmuon.torch.optimizer import Muon

__all__ = ["Dedicated", "Muon", "dedicate", "default_muon_filter", "is_embedding_or_head_name"]
