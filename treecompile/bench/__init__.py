"""GPU benchmarks: ``python -m treecompile.bench <name>``."""


def failure_reason(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line, for a benchmark's progress line and table note when a variant fails.

    Every line of the message is kept, joined with ``; ``: a ``ValueError`` from ``resolve_tree_support`` names its
    blockers on the lines after the first, which alone says only how many. Not ``|``: the note lands in a markdown
    table cell. The whole is capped at ``limit`` characters, ending ``...`` where cut.
    """
    lines = [line.strip().removeprefix("- ") for line in str(exc).strip().splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {'; '.join(lines)}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
