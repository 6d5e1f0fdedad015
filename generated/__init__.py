"""Kernels generated at build time from ./manifest (package data: losscodegen.generated)."""
