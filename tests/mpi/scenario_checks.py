"""Checks the scenario scripts share (imported from the script's own directory, as fakegpu is)."""


def expect(exc_type, call, *texts):
    """Call ``call()``; it must raise ``exc_type`` whose message contains every one of ``texts``. Returns it."""
    try:
        call()
    except exc_type as exc:
        for text in texts:
            assert text in str(exc), (text, str(exc))
        return exc
    raise AssertionError(f"{exc_type.__name__} not raised: {texts}")
