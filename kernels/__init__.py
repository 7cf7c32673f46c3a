"""Compute kernels: one op per file, each with a public launcher, private Triton kernels and
a `*_ref` torch implementation that is its spec (and the CPU path).

Imports only torch and triton.
"""
