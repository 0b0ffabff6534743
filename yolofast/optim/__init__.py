"""Optimizers that torch does not ship: ``MuSGD`` (SGD + Muon), a drop-in for Ultralytics' of the same name.

    from yolofast.optim import MuSGD      # was: from ultralytics.optim import MuSGD
    opt = MuSGD([{"params": convs, "use_muon": True, "lr": 0.01, "momentum": 0.9, "nesterov": True,
                  "weight_decay": 5e-4}, {"params": others, "lr": 0.01, ...}], muon=0.2, sgd=1.0)
"""

from yolofast.optim.musgd import MuSGD, default_ns_dtype, muon_sigma

__all__ = ["MuSGD", "default_ns_dtype", "muon_sigma"]
