"""Every cause we log or serve is bounded, wherever its text came from (issue 43, point 2)."""

import logging

from orchestrator.log import MAX_CAUSE_CHARS, MAX_MESSAGE_CHARS, BoundedFormatter, bounded, cause_chain


def test_a_cause_chain_is_bounded_and_keeps_each_cause_named():
    try:
        try:
            raise ValueError("x" * 20_000_000)
        except ValueError as inner:
            raise RuntimeError("the outer failure") from inner
    except RuntimeError as outer:
        chain = cause_chain(outer)
    assert len(chain) <= MAX_CAUSE_CHARS
    assert chain.startswith("RuntimeError: the outer failure <- ValueError: xxx") and "more characters" in chain


def test_a_long_chain_of_causes_stays_bounded():
    error: BaseException = KeyError("start")
    for n in range(200):
        try:
            raise RuntimeError(f"step {n} " + "y" * 500) from error
        except RuntimeError as exc:
            error = exc
    assert len(cause_chain(error)) <= MAX_CAUSE_CHARS


def test_a_log_line_is_bounded_whatever_its_arguments_carry():
    record = logging.LogRecord("w", logging.WARNING, __file__, 1, "worker %s said: %s", ("w1", "z" * 5_000_000),
                               None)
    line = BoundedFormatter("%(levelname)s %(message)s").format(record)
    assert len(line) <= MAX_MESSAGE_CHARS + 20 and line.startswith("WARNING worker w1 said: zzz")


def test_bounded_leaves_short_text_alone():
    assert bounded("short") == "short"
    assert len(bounded("a" * 5000, 100)) == 100
