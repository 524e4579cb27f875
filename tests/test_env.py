"""``distlab._env.choice``: every one-of-a-few-words ``DISTLAB_*`` setting is read and refused the same way."""
import pytest

from distlab._env import choice


def test_unset_or_empty_gives_the_default(monkeypatch):
    monkeypatch.delenv("DISTLAB_TEST_SETTING", raising=False)
    assert choice("DISTLAB_TEST_SETTING", "keep", ("keep", "system")) == "keep"
    monkeypatch.setenv("DISTLAB_TEST_SETTING", "  ")
    assert choice("DISTLAB_TEST_SETTING", "keep", ("keep", "system")) == "keep"


def test_the_value_is_trimmed_and_case_folded(monkeypatch):
    monkeypatch.setenv("DISTLAB_TEST_SETTING", " System ")
    assert choice("DISTLAB_TEST_SETTING", "keep", ("keep", "system")) == "system"
    monkeypatch.setenv("DISTLAB_TEST_SETTING", "detail")
    assert choice("DISTLAB_TEST_SETTING", "OFF", ("OFF", "DETAIL"), upper=True) == "DETAIL"


def test_another_word_is_refused_with_the_variable_and_the_accepted_words(monkeypatch):
    monkeypatch.setenv("DISTLAB_TEST_SETTING", "always")
    with pytest.raises(ValueError, match=r"DISTLAB_TEST_SETTING='always' is not one of keep, system"):
        choice("DISTLAB_TEST_SETTING", "keep", ("keep", "system"))


def test_distlab_debug_is_read_through_it(monkeypatch):
    from distlab.comm.group import debug_level

    monkeypatch.setenv("DISTLAB_DEBUG", "loud")
    with pytest.raises(ValueError, match=r"DISTLAB_DEBUG='LOUD' is not one of OFF, INFO, DETAIL"):
        debug_level()
    monkeypatch.setenv("DISTLAB_DEBUG", "info")
    assert debug_level() == "INFO"
