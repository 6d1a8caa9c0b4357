"""Reading safetensors checkpoints without mapping them (hf_wide.checkpoints): tensors, member slices, dtypes,
shards, and files that are cut short."""

import json

import pytest
import torch
from safetensors.torch import save_file

from hf_wide.checkpoints import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, Checkpoint, same_bytes


@pytest.fixture
def tensors():
    gen = torch.Generator().manual_seed(0)
    return {"stacked": torch.randn(3, 4, 5, generator=gen), "half": torch.randn(6, generator=gen).half(),
            "ids": torch.arange(7), "empty": torch.zeros(0, 2)}


def test_tensors_and_member_slices_read_as_saved(tensors, tmp_path):
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    with Checkpoint(tmp_path) as ckpt:
        assert set(ckpt.entries) == set(tensors) and "stacked" in ckpt and "missing" not in ckpt
        for key, want in tensors.items():
            assert ckpt.shape(key) == tuple(want.shape) and ckpt.dtype(key) == want.dtype
            got = torch.empty_like(want)
            ckpt.read_into(key, got)
            assert torch.equal(got, want)
        for i in range(3):  # member i's slice of a stacked tensor, straight into a view of a bigger one
            out = torch.zeros(3, 4, 5)
            ckpt.read_into("stacked", out[i], index=i)
            assert torch.equal(out[i], tensors["stacked"][i]) and not out[(i + 1) % 3].any()


def test_other_dtypes_and_layouts_go_through_one_temporary(tensors, tmp_path):
    save_file(tensors, str(tmp_path / WEIGHTS_NAME))
    with Checkpoint(tmp_path) as ckpt:
        into_float = torch.empty(6)  # float16 on disk
        ckpt.read_into("half", into_float)
        assert torch.equal(into_float, tensors["half"].float())
        strided = torch.empty(5, 4).t()  # (4, 5), not contiguous
        ckpt.read_into("stacked", strided, index=1)
        assert torch.equal(strided, tensors["stacked"][1])
        with pytest.raises(ValueError, match="shape"):
            ckpt.read_into("stacked", torch.empty(4, 4), index=0)


def test_shards_with_an_index(tensors, tmp_path):
    first, second = {"stacked": tensors["stacked"]}, {"ids": tensors["ids"]}
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {"stacked": "model-00001-of-00002.safetensors", "ids": "model-00002-of-00002.safetensors"}
    (tmp_path / WEIGHTS_INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with Checkpoint(tmp_path) as ckpt:
        got = torch.empty(7, dtype=torch.int64)
        ckpt.read_into("ids", got)
        assert torch.equal(got, tensors["ids"]) and ckpt.shape("stacked") == (3, 4, 5)


def test_a_folder_without_weights_and_a_truncated_file(tensors, tmp_path):
    with pytest.raises(FileNotFoundError, match=WEIGHTS_NAME):
        Checkpoint(tmp_path)
    path = tmp_path / WEIGHTS_NAME
    save_file(tensors, str(path))
    path.write_bytes(path.read_bytes()[:-8])  # the last tensor's data cut short: refused before any is read
    with pytest.raises(OSError, match=r"no safetensors file that can be read \(its tensors' data ends at byte "
                                      r"\d+, and it holds \d+\).*force_download=True"):
        Checkpoint(tmp_path)


def rewrite_header(path, edit) -> None:
    """``path``'s safetensors header changed by ``edit(header)``, its data as it was."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length:])


@pytest.mark.parametrize("edit, problem", [
    (lambda h: h["stacked"].update(dtype="F16"), r"'stacked', F16 of shape \[3, 4, 5\], spans 240 bytes"),
    (lambda h: h["stacked"].update(data_offsets=[h["stacked"]["data_offsets"][0], h["stacked"]["data_offsets"][0]
                                                 + 120], shape=[3, 2, 5]), r"where the tensor before it ends"),
    (lambda h: h["ids"].update(data_offsets=h["half"]["data_offsets"], shape=[1]), r"'ids', I64 of shape \[1\], "
                                                                                      r"spans 12 bytes"),
    (lambda h: h["ids"].pop("data_offsets"), r"malformed: KeyError\('data_offsets'\)"),
], ids=["dtype", "offsets", "overlap", "missing"])
def test_a_header_that_does_not_describe_its_data_is_refused_as_safetensors_refuses_it(tensors, tmp_path, edit,
                                                                                     problem):
    # each member's slice was taken from where the header said, so members after the first read another's bytes
    # (NaN, or 0.05 off), where the safetensors library (and so transformers) refuses the file
    import safetensors

    path = tmp_path / WEIGHTS_NAME
    save_file(tensors, str(path))
    rewrite_header(path, edit)
    with pytest.raises(OSError, match=problem):
        Checkpoint(tmp_path)
    with pytest.raises(Exception):  # noqa: B017 (the library's own error)
        safetensors.safe_open(str(path), "pt")


def test_same_bytes_compares_dtype_shape_and_data(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder, value in ((a, torch.ones(4)), (b, torch.ones(4)), (c, torch.tensor([1.0, 1.0, 1.0, 2.0]))):
        folder.mkdir()
        save_file({"w": value, "h": value.half(), "v": value[:3].clone()}, str(folder / WEIGHTS_NAME))
    ca, cb, cc = Checkpoint(a), Checkpoint(b), Checkpoint(c)
    assert same_bytes([ca, cb], ["w", "w"])
    assert not same_bytes([ca, cc], ["w", "w"])  # the last element differs
    assert not same_bytes([ca, cb], ["w", "h"])  # the same values in another dtype
    assert not same_bytes([ca, cb], ["w", "v"])  # another shape
    assert same_bytes([ca, cc], ["v", "v"])  # under other names, the same first three
