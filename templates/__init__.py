"""Jinja2 templates of the generated kernels (package data: losscodegen.templates)."""
