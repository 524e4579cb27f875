"""Autograd pieces the distributed-autograd scenario scripts share (imported from the script's own directory)."""
from distlab.autograd import Function


class Boom(Function):
    """An identity whose backward raises ``ValueError("boom in backward")``: a failure inside a backward pass."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")
