"""Folders shipped as package data: the templates (read by the code generator) and the prebuilt
kernels (read at run time). A module of its own so that the compiler stages and the loader both
find them without importing each other."""
from __future__ import annotations

import importlib.resources
from pathlib import Path


def resource_dir(package: str) -> Path:
    """A folder shipped as package data (``templates``, ``generated``), wherever the package lives:
    the repository's folder for an editable install, site-packages for a wheel."""
    try:
        return Path(str(importlib.resources.files(f"losscodegen.{package}")))
    except ModuleNotFoundError as e:
        raise ImportError(f"losscodegen.{package} is not installed: losscodegen carries its templates and "
                          "prebuilt kernels as package data, so install it (pip install ., or -e .) "
                          "rather than putting its folder on sys.path") from e


TEMPLATES = resource_dir("templates")
GENERATED = resource_dir("generated")
