"""Flower strategies, one module per method; each is a thin ``MethodStrategy`` around the method's core."""
