"""Kernel registry: one interface per op, a pure-torch reference always registered."""
