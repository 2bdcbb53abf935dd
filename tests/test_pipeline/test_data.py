"""Calibration text: files of each kind, a directory, packing into disjoint calibration and held-out windows."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402

from quantlib.pipeline import PipelineError  # noqa: E402
from quantlib.pipeline.data import iter_texts, load_windows, pack  # noqa: E402
from quantlib.pipeline.model import EMBEDDED_DIR, EMBEDDED_TEXT  # noqa: E402
from tests.test_pipeline._models import stdlib_text, write_jsonl, write_text  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(EMBEDDED_DIR, local_files_only=True)


def test_byte_tokenizer_ids_are_bytes(tok):
    text = "def f(x):\n    return 'é'\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode())
    assert tok.decode(list(text.encode())) == text


def test_text_jsonl_and_directory_give_the_same_documents(tmp_path):
    (tmp_path / "d").mkdir()
    write_text(tmp_path / "d" / "a.txt", 1000)
    (tmp_path / "d" / "skip.bin").write_bytes(b"\x00\xff")
    assert list(iter_texts(str(tmp_path / "d"))) == [stdlib_text(1000)]
    docs = list(iter_texts(str(write_jsonl(tmp_path / "x.jsonl", n_docs=4))))
    assert len(docs) == 4 and "".join(docs) == stdlib_text()[: len("".join(docs))]


def test_parquet_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["one doc", "two doc"]}), tmp_path / "x.parquet")
    assert list(iter_texts(str(tmp_path / "x.parquet"), "body")) == ["one doc", "two doc"]
    with pytest.raises(PipelineError, match="no text column 'text' .*\\['body'\\]"):
        list(iter_texts(str(tmp_path / "x.parquet")))


def test_windows_are_disjoint_and_in_order(tok):
    w = load_windows(tok, None, EMBEDDED_TEXT, "text", 3, 2, 16)
    assert w.calib.shape == (3, 16) and w.held_out.shape == (2, 16)
    ids = open(EMBEDDED_TEXT, "rb").read()[: 5 * 16]
    assert w.calib.flatten().tolist() + w.held_out.flatten().tolist() == list(ids)
    assert [b.shape[0] for b in w.batches("calib", 2)] == [2, 1]


def test_documents_are_separated_by_eos(tok):
    w = pack(tok, iter(["ab", "cd"]), "mem", 1, 1, 3)
    assert w.calib.tolist() == [[97, 98, tok.eos_token_id]] and w.held_out.tolist() == [[99, 100, tok.eos_token_id]]
