"""Federated methods as plain PyTorch/NumPy code: one module per method, registered in ``registry``."""
