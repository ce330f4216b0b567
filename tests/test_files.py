"""Output files: written whole or not at all, and never through a path someone else put in the output directory."""

from __future__ import annotations

import os
import stat

import pytest

from qlora_train.files import fresh_dir, publish_dir, write_atomic


@pytest.fixture
def victim(tmp_path):
    """A file outside the output directory that a planted link points at."""
    path = tmp_path / "victim.txt"
    path.write_text("keep me")
    return path


@pytest.fixture
def out(tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    return path


def test_a_link_planted_at_the_old_temporary_name_is_not_written_through(out, victim):
    """On main, write_atomic wrote ``<name>.tmp`` with write_text, following a link planted there: the layout YAML
    landed in the link's target."""
    (out / "template_layout.yaml.tmp").symlink_to(victim)
    write_atomic(out / "template_layout.yaml", "model: {}\n")
    assert victim.read_text() == "keep me"
    assert (out / "template_layout.yaml").read_text() == "model: {}\n"
    assert sorted(p.name for p in out.iterdir()) == ["template_layout.yaml", "template_layout.yaml.tmp"]


def test_a_link_planted_at_the_name_itself_is_replaced_not_written_through(out, victim):
    (out / "stats.json").symlink_to(victim)
    write_atomic(out / "stats.json", b"{}")
    assert victim.read_text() == "keep me"
    assert not (out / "stats.json").is_symlink() and (out / "stats.json").read_bytes() == b"{}"


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(out, monkeypatch):
    (out / "stats.json").write_text("old")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(out / "stats.json", "new")
    assert [p.name for p in out.iterdir()] == ["stats.json"] and (out / "stats.json").read_text() == "old"


def test_text_that_cannot_be_encoded_creates_nothing(out):
    with pytest.raises(UnicodeEncodeError):
        write_atomic(out / "stats.json", "\udcff")
    assert list(out.iterdir()) == []


def test_the_file_gets_the_usual_mode(out):
    """Created with 0o666 less the umask, as ``open`` would (not mkstemp's 0o600)."""
    umask = os.umask(0o022)
    try:
        write_atomic(out / "a.json", "{}")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((out / "a.json").stat().st_mode) == 0o644


def test_fresh_dir_removes_a_planted_link_without_following_it(out, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious").write_text("keep me")
    (out / ".final.tmp").symlink_to(target, target_is_directory=True)
    staging = fresh_dir(out / ".final.tmp")
    assert staging.is_dir() and not staging.is_symlink() and list(staging.iterdir()) == []
    assert (target / "precious").read_text() == "keep me"


def test_fresh_dir_empties_a_leftover_staging_directory(out):
    (out / ".prepared.tmp" / "train").mkdir(parents=True)
    assert list(fresh_dir(out / ".prepared.tmp").iterdir()) == []


def test_publish_dir_with_a_link_planted_at_its_aside_name(out, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (out / "merged").mkdir()
    (out / "merged" / "v").write_text("1")
    staging = fresh_dir(out / ".merged.tmp")
    (staging / "v").write_text("2")
    (out / ".merged.old").symlink_to(target, target_is_directory=True)
    publish_dir(staging, out / "merged")
    assert (out / "merged" / "v").read_text() == "2" and sorted(p.name for p in out.iterdir()) == ["merged"]
    assert target.is_dir() and list(target.iterdir()) == []


def test_the_histogram_is_not_written_through_a_planted_link(out, victim):
    from qlora_train.diagnostics.stats import write_histogram

    (out / "token_lengths.png").symlink_to(victim)
    cols = {"num_tokens_before": [3, 5], "num_tokens": [3, 5], "drop_reason": ["", ""]}
    write_histogram(cols, max_length=8, path=out / "token_lengths.png")
    assert victim.read_text() == "keep me"
    assert (out / "token_lengths.png").read_bytes().startswith(b"\x89PNG")
