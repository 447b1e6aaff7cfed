"""pyproject.toml says what setuptools reads without warnings (issue 23, item 21)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.licenses import canonicalize_license_expression

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_license_is_an_spdx_expression_not_the_deprecated_table():
    # setuptools >= 77 warns (SetuptoolsDeprecationWarning, on every build) about the
    # `license = {text = ...}` table; PEP 639 wants the SPDX string.
    license = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["license"]
    assert isinstance(license, str), license
    assert canonicalize_license_expression(license) == license
