"""The supported torch range: stated once in code, the same in pyproject.toml, checked at import in one line."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from fp8train.torch_support import TORCH_REQUIREMENT, check_torch_version, torch_release

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_states_the_range_the_code_checks():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_lines = [d for d in dependencies if d.split(">")[0].split("=")[0].split("<")[0].strip() == "torch"]
    assert torch_lines == [TORCH_REQUIREMENT] == ["torch>=2.11,<2.15"]


@pytest.mark.parametrize("version, release", [("2.11.0+cu130", (2, 11)), ("2.13.0+cpu", (2, 13)), ("2.14.1", (2, 14)),
                                              ("2.15.0.dev20261101", (2, 15)), ("3.0.0a0", (3, 0))])
def test_release_is_read_from_the_version_string(version, release):
    assert torch_release(version) == release


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.13.0+cpu", "2.14.1"])
def test_versions_in_range_are_accepted(version):
    check_torch_version(version)


@pytest.mark.parametrize("version", ["2.10.1", "2.5.0", "2.15.0", "3.0.0"])
def test_versions_outside_are_refused_in_one_line(version):
    with pytest.raises(ImportError) as info:
        check_torch_version(version)
    message = str(info.value)
    assert "\n" not in message and version in message and "torch>=2.11,<2.15" in message


def test_the_installed_torch_is_in_range():
    check_torch_version(torch.__version__)


def test_import_refuses_an_unsupported_torch():
    code = "import torch; torch.__version__ = '2.10.0'; import fp8train"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1
    assert "ImportError: fp8train needs torch>=2.11,<2.15" in result.stderr and "torch 2.10.0" in result.stderr
