"""hf_wide/versions.py: the transformers releases hf-wide follows; a newer one is refused at import, with the way out."""

import pytest
import transformers

from hf_wide.versions import require_supported_transformers


def test_the_installed_transformers_is_one_hf_wide_follows():
    require_supported_transformers()  # import hf_wide did this too
    assert transformers.__version__.startswith("5.")


@pytest.mark.parametrize("version", ["5.0.0", "5.23.0", "5.24.0", "5.24.3"])
def test_releases_it_follows(version):
    require_supported_transformers(version)


@pytest.mark.parametrize("version", ["5.25.0", "5.25.0.dev0", "5.30.1", "6.0.0"])
def test_newer_releases_are_refused_with_the_way_out(version):
    with pytest.raises(ImportError, match=r"not been run against.*pip install 'transformers>=5,<5\.25'"):
        require_supported_transformers(version)
