"""hf_wide/__init__.py: the package's names come on first use, so that ``import hf_wide`` or a light module of it
(``hf_wide.cpu``) does not import torch and transformers' modelling code (ten seconds on a small machine)."""

import subprocess
import sys

import pytest

import hf_wide


def test_import_hf_wide_imports_no_model_code():
    code = "import sys, hf_wide, hf_wide.cpu; print('torch' in sys.modules, 'transformers.modeling_utils' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_names_and_submodules_come_on_first_use():
    from hf_wide.model import WideModel
    from hf_wide.pipelines import pipeline

    assert hf_wide.WideModel is WideModel and hf_wide.pipeline is pipeline
    assert set(hf_wide.__all__) <= set(dir(hf_wide))
    assert hf_wide.forward.__name__ == "hf_wide.forward"  # a submodule, as when `import hf_wide` imported them all
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        hf_wide.no_such_name
