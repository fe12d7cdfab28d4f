"""Text as the project writes it: one way to shorten text visibly, one way to write a plan.

Memory records, tool outputs, sandbox streams and the report all mark missing text the
same way ("...[cut N chars]"), so a reader of any prompt or page knows text is missing
and how much; evaluation summaries and the report name a trajectory's plan the same way.
"""


def cut(text: str, limit: int, keep_tail: bool = False, already_cut: int = 0) -> str:
    """`text` in at most `limit` characters, with a "...[cut N chars]" marker that counts
    what was removed. The one cutter of the project: memory records, tool outputs and the
    report all mark missing text the same way.

    keep_tail keeps both ends around the marker (a program prints its answer last);
    already_cut counts text that was dropped before this call (a stream read in part)."""
    if len(text) <= limit and not already_cut:
        return text
    longest = len(f"...[cut {len(text) + already_cut} chars]")  # the real marker is no longer
    keep = max(limit - longest, 0)
    marker = f"...[cut {len(text) - keep + already_cut} chars]"
    if not keep_tail:
        return text[:keep] + marker
    tail = keep // 2
    return text[:keep - tail] + marker + text[len(text) - tail:]


def plan_of(tools: list[str]) -> str:
    """The plan a trajectory carried out: the tools its memory records, in order
    ("Local_Search > Python_Coder"), as evaluation summaries and the report count them."""
    return " > ".join(tools) or "(no tool)"
