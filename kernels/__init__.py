"""Triton kernels of the hot ops, installed as ``yolofast.kernels``."""
