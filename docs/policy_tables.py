"""The policy tables of the README and of the policies page, generated from the registry.

Run after adding or changing a policy (or its card)::

    python docs/policy_tables.py            # rewrite the tables that differ, atomically
    python docs/policy_tables.py --check    # only report them; exit status 1 if any

The README's table (under "What is implemented, against the papers") and the list-table of
``docs/policies/index.rst`` are written from each registered policy's
:class:`refkv.policies.PolicyCard` (``citation``, ``score_rule``, ``protects``,
``implements``, in ``table_order``) and its protocol (``needs``, ``evicts``,
``evict_before_attention``): a new policy appears in both by itself. The rest of either
file is left as it is. The forms table of ``docs/policies/index.rst`` is written from each
policy's declared forms (:func:`refkv.policies.policy_forms`, as ``refkv policies --forms``
prints them). ``tests/docs/test_docs.py`` fails while the files and the registry disagree.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from refkv.files import OutputFolder
from refkv.policies import Policy, available, policy_class, policy_forms

ROOT = Path(__file__).resolve().parent.parent

#: The first line of the docs table's directive; the block it opens is the table.
DOCS_TABLE_HEAD = ".. list-table:: Policies at a glance (scores: higher = keep)"
#: The first line of the forms table's directive (``refkv policies --forms`` as a table).
FORMS_TABLE_HEAD = ".. list-table:: Forms of every policy (``refkv policies --forms``)"
#: The README heading under which the first simple table is the policy table.
README_HEADING = "What is implemented, against the papers"


def ordered_classes() -> list[type[Policy]]:
    """Registered policy classes whose code is in refkv, in their card's ``table_order`` (then name)."""
    classes = [policy_class(name) for name in available()]
    ours = [cls for cls in classes if cls.__module__.startswith("refkv.")]
    return sorted(ours, key=lambda cls: (cls.card.table_order, cls.name))


def _evicts(cls: type[Policy]) -> str:
    if not cls.evicts:
        return "never"
    return "before" if cls.evict_before_attention else "after"


def docs_table(pages: Path) -> str:
    """The reST list-table of ``docs/policies/index.rst``; ``pages`` is that folder (a policy with
    a page ``NAME.rst`` there is linked to it)."""
    lines = [DOCS_TABLE_HEAD, "   :header-rows: 1", "   :widths: 12 22 30 18 9 9", ""]
    header = ["policy", "paper", "score", "protected", "reads attention", "evicts"]
    rows = [header]
    for cls in ordered_classes():
        link = f":doc:`{cls.name}`" if (pages / f"{cls.name}.rst").exists() else f"``{cls.name}``"
        card = cls.card
        rows.append([link, card.citation or card.paper, card.score_rule or "--", card.protects,
                     "yes" if "attention" in cls.needs else "no", _evicts(cls)])
    for row in rows:
        lines.append(f"   * - {row[0]}")
        lines.extend(f"     - {cell}" for cell in row[1:])
    return "\n".join(lines) + "\n"


def forms_table() -> str:
    """The reST list-table of every registered policy's forms (:func:`refkv.policies.policy_forms`):
    policy, form, source, how it is proven identical to that source."""
    lines = [FORMS_TABLE_HEAD, "   :header-rows: 1", "   :widths: 12 9 45 34", ""]
    rows = [["policy", "form", "source", "proven identical to the source"]]
    for name in available():
        for form, entry in policy_forms(policy_class(name)).items():
            rows.append([f"``{name}``", form, entry["source"].replace("*", "\\*"),
                         (entry["proven"] or "--").replace("*", "\\*")])
    for row in rows:
        lines.append(f"   * - {row[0]}")
        lines.extend(f"     - {cell}" for cell in row[1:])
    return "\n".join(lines) + "\n"


def readme_table() -> str:
    """The README's simple table: policy, what is implemented, module."""
    width = 45
    rows = [(cls.name, textwrap.wrap(cls.card.implements or cls.card.summary, width),
             f"``{cls.__module__.replace('.', '/')}.py``") for cls in ordered_classes()]
    w0 = max(len("policy"), *(len(r[0]) for r in rows)) + 2
    w2 = max(len("module"), *(len(r[2]) for r in rows))
    border = f"{'=' * (w0 - 2)}  {'=' * width}  {'=' * w2}"
    lines = [border, f"{'policy':{w0}}{'paper, what is implemented':{width}}  module", border]
    for name, text, module in rows:
        lines.append(f"{name:{w0}}{text[0]:{width}}  {module}".rstrip())
        lines.extend(f"{'':{w0}}{more}".rstrip() for more in text[1:])
    lines.append(border)
    return "\n".join(lines) + "\n"


def _block_span(text: str, start: int) -> int:
    """End of the reST block that starts at ``start``: the first non-indented line after it."""
    pos = text.index("\n", start) + 1
    while pos < len(text):
        end = text.find("\n", pos)
        end = len(text) if end < 0 else end + 1
        line = text[pos:end]
        if line.strip() and not line.startswith(" "):
            break
        pos = end
    return pos


def replace_block(text: str, which: str, table: str) -> str:
    """``text`` (index.rst for ``which="docs"`` or ``"forms"``, the README for ``"readme"``) with
    its table replaced."""
    if which in ("docs", "forms"):
        start = text.index(DOCS_TABLE_HEAD if which == "docs" else FORMS_TABLE_HEAD)
        return text[:start] + table + "\n" + text[_block_span(text, start):]
    start = text.index("=", text.index(README_HEADING) + 2 * len(README_HEADING) + 2)
    borders, pos = 0, start
    while borders < 3:
        end = text.index("\n", pos) + 1
        borders += text[pos:end].startswith("=")
        pos = end
    return text[:start] + table + text[pos:]


def update_files(root: Path = ROOT, *, write: bool = True) -> list[Path]:
    """Rewrite the two tables under the repository ``root``; the files that were (or would be) changed."""
    changed = []
    pages = root / "docs" / "policies"
    targets = {root / "README.rst": [("readme", readme_table())],
               pages / "index.rst": [("docs", docs_table(pages)), ("forms", forms_table())]}
    for path, tables in targets.items():
        old = new = path.read_text(encoding="utf-8")
        for which, table in tables:
            new = replace_block(new, which, table)
        if new != old:
            changed.append(path)
            if write:
                OutputFolder(root).write_text(path.relative_to(root).as_posix(), new)
    return changed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python docs/policy_tables.py", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a table differs from the registry")
    check = parser.parse_args(argv).check  # unknown arguments: exit 2; --help: exit 0, nothing written
    changed = update_files(write=not check)
    for path in changed:
        print(f"{'stale' if check else 'rewrote'}: the policy table of {path.relative_to(ROOT)}")
    if check and changed:
        print("run `python docs/policy_tables.py` to regenerate them")
        return 1
    if not changed:
        print("the policy tables match the registry")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
