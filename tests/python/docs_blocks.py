"""The fenced code blocks of README.md and docs/*.md, for the tests that run them as written.

The convention (test_docs_code.py checks it):

* Every fenced block names its language: ``python``, ``cpp``, ``bash``, ``cmake``,
  ``text``, ...
* A ``python`` block is a complete program: test_docs_code.py runs each one on CPU in
  its own subprocess. A block that goes on from the python block before it in the same
  file starts with the visible line ``# (continued)`` and runs appended to it.
* A ``cpp`` block is a complete program with ``main()``: tests/install/consumer.sh
  compiles each one against the installed package (``find_package(dwgraph)``) and runs it.
* Blocks in any other language (shell commands, CMake, output, text) are shown, not run.

Run as a script it writes the blocks of one language to files, one per block:
``python tests/python/docs_blocks.py --lang cpp --out DIR`` (names like
``README_md_120.cpp``, the line the block starts on).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
from typing import List, Optional

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONTINUED = "# (continued)"
RUN = {"python", "cpp"}
SHOWN = {"bash", "sh", "console", "cmake", "text", "toml"}
_FENCE = re.compile(r"^(\s*)(```+|~~~+)(.*)$")


@dataclasses.dataclass
class Block:
    path: pathlib.Path  # the markdown file
    line: int  # 1-based line of the opening fence
    lang: str  # the info string's first word ("" when missing)
    code: str

    @property
    def where(self) -> str:
        return f"{_shown(self.path)}:{self.line}"

    @property
    def name(self) -> str:
        """A file and CMake target name: README_md_120."""
        return re.sub(r"[^A-Za-z0-9]+", "_", _shown(self.path)) + f"_{self.line}"


def _shown(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def documents() -> List[pathlib.Path]:
    """README.md and every markdown file under docs/."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def blocks(path: pathlib.Path) -> List[Block]:
    out: List[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.groups()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line)
            i += 1
        if i == len(lines):
            raise ValueError(f"{_shown(path)}:{start}: code block is never closed")
        out.append(Block(path, start, info.strip().split(" ")[0] if info.strip() else "", "\n".join(body) + "\n"))
        i += 1
    return out


def all_blocks() -> List[Block]:
    return [b for doc in documents() for b in blocks(doc)]


def python_programs(docs: Optional[List[pathlib.Path]] = None) -> List[Block]:
    """One Block per program: a python block with the continuations that follow it."""
    programs: List[Block] = []
    for doc in documents() if docs is None else docs:
        last = None
        for b in blocks(doc):
            if b.lang != "python":
                continue
            if b.code.startswith(CONTINUED):
                if last is None:
                    raise ValueError(f"{b.where}: starts with '{CONTINUED}' but no python block comes before it")
                last.code += b.code
            else:
                last = dataclasses.replace(b)
                programs.append(last)
    return programs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lang", required=True, choices=sorted(RUN))
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = python_programs() if args.lang == "python" else [b for b in all_blocks() if b.lang == args.lang]
    suffix = {"python": ".py", "cpp": ".cpp"}[args.lang]
    for b in chosen:
        (args.out / (b.name + suffix)).write_text(b.code, encoding="utf-8")
        print(f"{b.where} -> {b.name}{suffix}")


if __name__ == "__main__":
    main()
