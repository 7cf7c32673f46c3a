"""workers/gguf_file.py reads what gguf.GGUFReader reads: the same key-values and the same
tensor bytes, shapes and dtypes (the loader and gguf.quants depend on GGUFReader's layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from pagebus.workers.gguf_file import read_gguf, read_gguf_fields


def _reader_fields(r: gguf.GGUFReader) -> dict[str, Any]:
    out = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        v = f.contents()
        out[key] = v
    return out


def _ours(fields: dict[str, Any]) -> dict[str, Any]:
    # arrays of strings come back as bytes (callers decode what they use)
    return {k: [x.decode() for x in v] if isinstance(v, list) and v and isinstance(v[0], bytes) else v
            for k, v in fields.items()}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.data_alignment = 64
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("some.flag", True)
    w.add_string("general.name", "tiny ✓")
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "<s>", "é"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3, 1])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 32)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_same(path: str) -> None:
    r = gguf.GGUFReader(path)
    ours = read_gguf(path)
    assert _ours(ours.fields) == _reader_fields(r)
    assert [t.name for t in ours.tensors] == [t.name for t in r.tensors]
    for a, b in zip(r.tensors, ours.tensors, strict=True):
        assert b.tensor_type == int(a.tensor_type), a.name
        assert (b.data.shape, b.data.dtype) == (a.data.shape, a.data.dtype), a.name
        assert np.array_equal(a.data, b.data), a.name


def test_a_written_file_reads_as_gguf_reader_reads_it(tiny_gguf: Path) -> None:
    _assert_same(str(tiny_gguf))
    f = read_gguf(str(tiny_gguf))
    assert f.fields["general.name"] == "tiny ✓"
    q = next(t for t in f.tensors if t.name == "q8")
    back = gguf.quants.dequantize(q.data, q.tensor_type)
    assert back.shape == (4, 64)


def test_keep_selects_fields_and_skips_the_rest(tiny_gguf: Path) -> None:
    fields = read_gguf_fields(str(tiny_gguf), lambda k: k.startswith("tokenizer.ggml."))
    assert fields == {"tokenizer.ggml.tokens": [b"a", b"bc", b"<s>", "é".encode()],
                      "tokenizer.ggml.token_type": [1, 1, 3, 1]}  # fmt: skip
    # the tensors still land at the right offsets without the alignment field being kept
    f = read_gguf(str(tiny_gguf), lambda k: False)
    assert f.fields == {}
    _assert_same(str(tiny_gguf))


def test_the_default_model_reads_as_gguf_reader_reads_it(default_model: str) -> None:
    _assert_same(default_model)


def test_not_a_gguf_file_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(str(p))
