"""The docstring converter: the project's reST-ish dialect in, ExDoc Markdown out."""

from __future__ import annotations

import inspect

import pytest

from bridge_py.codegen.docstrings import DocstringError, inline, kept_lines, to_markdown

pytestmark = pytest.mark.timeout(30)

_NAMES = {
    "create": "`create/7`",
    "StatelessProcessGroup": "`Vllm.Distributed.StatelessProcessGroup`",
    "bridge_py.distributed.StatelessProcessGroup": "`Vllm.Distributed.StatelessProcessGroup`",
    "StatelessProcessGroup.create": "`Vllm.Distributed.StatelessProcessGroup.create/7`",
}


def resolve(role: str, target: str) -> str | None:
    """Resolves the names of ``_NAMES`` (as written, less ``~``, ``!`` and ``()``)."""
    return _NAMES.get(target)


def md(doc: str) -> str:
    """``doc`` (indented as in a test's source) as Markdown."""
    return to_markdown(inspect.cleandoc(doc), resolve).text


@pytest.mark.parametrize(
    ("rest", "markdown"),
    [
        (":attr:`auth_key`", "`auth_key`"),
        (":meth:`create`", "`create/7`"),
        (":meth:`create()`", "`create/7`"),
        (
            ":class:`~bridge_py.distributed.StatelessProcessGroup`",
            "`Vllm.Distributed.StatelessProcessGroup`",
        ),
        (
            ":meth:`StatelessProcessGroup.create`",
            "`Vllm.Distributed.StatelessProcessGroup.create/7`",
        ),
        (":py:meth:`create`", "`create/7`"),
        (":func:`~bridge_py.distributed.spg_board.post_value`", "`post_value`"),
        (":func:`bridge_py.distributed.spg_board.post_value`", "`post_value`"),
        (":mod:`bridge_py.distributed.spg_board`", "`spg_board`"),
        (":exc:`!TimeoutError`", "`TimeoutError`"),
        (":data:`VLLM_HOST_IP`", "`VLLM_HOST_IP`"),
        (":obj:`the group <StatelessProcessGroup>`", "`Vllm.Distributed.StatelessProcessGroup`"),
        (":obj:`the board <spg_board.Board>`", "`the board`"),
        (":envvar:`VLLM_BRIDGE_AUTH_KEY`", "`VLLM_BRIDGE_AUTH_KEY`"),
        ("``obj``", "`obj`"),
        ("``p2p/<src>/<dst>``", "`p2p/<src>/<dst>`"),
        ("`already markdown`", "`already markdown`"),
        (
            "`vLLM <https://github.com/vllm-project/vllm>`_",
            "[vLLM](https://github.com/vllm-project/vllm)",
        ),
        ("no code at all", "no code at all"),
    ],
)
def test_inline_roles_and_literals(rest: str, markdown: str) -> None:
    assert inline(f"see {rest}, then", resolve) == f"see {markdown}, then"


def test_several_on_a_line_and_literals_across_a_line_break() -> None:
    text = "Give ``auth_key`` (see :attr:`auth_key`) to :meth:`create`, as ``a\nb``."
    assert inline(text, resolve) == "Give `auth_key` (see `auth_key`) to `create/7`, as `a\nb`."


def test_a_literal_holding_a_backtick_is_refused_by_name() -> None:
    with pytest.raises(DocstringError, match="``a`b``"):
        inline("the ``a`b`` literal")


def test_the_summary_line_and_line_breaks_are_kept() -> None:
    doc = """A replacement for `torch.distributed.init_process_group` that does not
    pollute the global state.

    * ``one`` item,
      continued
    * two
    """
    assert md(doc) == (
        "A replacement for `torch.distributed.init_process_group` that does not\n"
        "pollute the global state.\n\n"
        "* `one` item,\n  continued\n* two"
    )


def test_literal_blocks_become_fenced_code() -> None:
    doc = """Use it like this::

        group = create(
            "h", 1)

    Or expanded ::

        x = 1

    ::

        y = 2

    Done."""
    assert md(doc) == (
        'Use it like this:\n\n```\ngroup = create(\n    "h", 1)\n```\n\n'
        "Or expanded\n\n```\nx = 1\n```\n\n"
        "```\ny = 2\n```\n\n"
        "Done."
    )


def test_a_literal_marker_without_a_block_is_just_punctuation() -> None:
    assert md("Ends so::") == "Ends so:"


def test_doctests_and_code_directives_are_fenced_with_their_language() -> None:
    doc = """Examples.

    >>> f(1)
    2

    .. code-block:: python

        print("x")
    """
    assert md(doc) == 'Examples.\n\n```python\n>>> f(1)\n2\n```\n\n```python\nprint("x")\n```'


def test_admonitions_become_block_quotes() -> None:
    doc = """Head.

    .. note:: Blocks while ``empty``.

    .. warning::
       Two
       lines.

    .. versionadded:: 0.2
    """
    assert md(doc) == (
        "Head.\n\n> **Note:** Blocks while `empty`.\n\n"
        "> **Warning:** Two\n> lines.\n\n"
        "> **Added in version 0.2:**"
    )


def test_comments_are_dropped_and_unknown_directives_refused_by_name() -> None:
    assert md("Kept.\n\n.. a comment\n   on two lines\n\nAlso kept.") == "Kept.\n\nAlso kept."
    with pytest.raises(DocstringError, match=r"'\.\. autofunction::'"):
        md("Head.\n\n.. autofunction:: f")


def test_note_lines_start_their_own_paragraph() -> None:
    doc = """Broadcast the input tensor.
    NOTE: `src` is the local rank of the source rank."""
    assert md(doc) == (
        "Broadcast the input tensor.\n\nNOTE: `src` is the local rank of the source rank."
    )


GOOGLE = """Do it.

Args:
    timeout: seconds to wait
        for each phase.
    other (int): not a parameter.

Returns:
    Whether it was done (``True``).

Raises:
    torch.distributed.DistError: when a rank
        is gone.
    ValueError: on bad input.
"""


def test_google_sections_are_lifted_for_functions() -> None:
    converted = to_markdown(GOOGLE, resolve, params=["timeout"], results=True)
    assert converted.params == {"timeout": "seconds to wait\nfor each phase."}
    assert converted.returns == "Whether it was done (`True`)."
    assert converted.raises == (
        ("DistError", "when a rank\nis gone."),
        ("ValueError", "on bad input."),
    )
    # What names no parameter stays where it was, as a Markdown list.
    assert converted.text == "Do it.\n\nArgs:\n\n  * `other` - not a parameter."


def test_google_sections_stay_in_place_as_lists_when_not_lifted() -> None:
    assert to_markdown(GOOGLE).text == (
        "Do it.\n\n"
        "Args:\n\n  * `timeout` - seconds to wait\n    for each phase.\n"
        "  * `other` - not a parameter.\n\n"
        "Returns:\n\nWhether it was done (`True`).\n\n"
        "Raises:\n\n  * `torch.distributed.DistError` - when a rank\n    is gone.\n"
        "  * `ValueError` - on bad input."
    )


def test_a_section_that_is_not_a_list_of_entries_is_kept_as_text() -> None:
    doc = "Head.\n\nExample:\n    Call it twice; the second call returns at once."
    assert md(doc) == "Head.\n\nExample:\n\nCall it twice; the second call returns at once."


IMPLEMENTATION = """Send an object to a destination rank.

Implementation: the object goes on the sender's board
and the receiver's doorbell is rung.

Sending never waits for the receiver.

Implementation:
    Large values take a segment under ``/dev/shm``.

    Which one is named in the store.

Raises RuntimeError when ``dst`` is gone.

Implementation: the reaper deletes read keys."""


def test_implementation_paragraphs_are_left_out() -> None:
    assert md(IMPLEMENTATION) == (
        "Send an object to a destination rank.\n\n"
        "Sending never waits for the receiver.\n\n"
        "Raises RuntimeError when `dst` is gone."
    )


def test_kept_lines_say_where_each_line_came_from() -> None:
    kept = kept_lines(IMPLEMENTATION)
    lines = IMPLEMENTATION.splitlines()
    assert all(lines[i] == line for i, line in kept)
    assert [line for _, line in kept if line] == [
        "Send an object to a destination rank.",
        "Sending never waits for the receiver.",
        "Raises RuntimeError when ``dst`` is gone.",
    ]


def test_the_marker_counts_only_at_the_start_of_a_paragraph() -> None:
    doc = "Summary.\nImplementation: is a word here, mid-paragraph."
    assert md(doc) == doc


def test_a_docstring_that_is_all_implementation_converts_to_nothing() -> None:
    assert md("Implementation: all of it.") == ""
