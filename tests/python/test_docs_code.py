"""The README and docs/ run as written (convention in docs_blocks.py).

Every python program is run on CPU in its own subprocess, from a scratch directory, with
a timeout; the cpp blocks are compiled and run by tests/install/consumer.sh. Every block
must name its language, and every link must point at a file inside the repository.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import docs_blocks

TIMEOUT_S = 180
PROGRAMS = docs_blocks.python_programs()


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.where for p in PROGRAMS])
def test_python_block_runs(program, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(program.code, encoding="utf-8")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{program.where}: still running after {TIMEOUT_S} s")
    assert done.returncode == 0, f"{program.where} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def test_every_block_names_a_known_language():
    known = docs_blocks.RUN | docs_blocks.SHOWN
    bad = [f"{b.where}: '{b.lang}'" for b in docs_blocks.all_blocks() if b.lang not in known]
    assert not bad, f"blocks must name one of {sorted(known)}:\n" + "\n".join(bad)


def test_there_are_blocks_to_run():
    # The README's quick start and its C++ example at least: an empty extraction must fail.
    langs = [b.lang for b in docs_blocks.blocks(docs_blocks.ROOT / "README.md")]
    assert langs.count("python") >= 1 and langs.count("cpp") >= 1, langs


def test_cpp_blocks_are_programs():
    bad = [b.where for b in docs_blocks.all_blocks() if b.lang == "cpp" and not re.search(r"\bint main\(", b.code)]
    assert not bad, "cpp blocks are compiled as programs and need main():\n" + "\n".join(bad)


def test_continued_blocks_run_as_one_program(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("```python\nx = 1\n```\ntext\n```bash\nls\n```\n```python\n# (continued)\nprint(x)\n```\n"
                   "```python\ny = 2\n```\n", encoding="utf-8")
    programs = docs_blocks.python_programs([doc])
    assert [(p.line, p.code) for p in programs] == [(1, "x = 1\n# (continued)\nprint(x)\n"), (12, "y = 2\n")]
    doc.write_text("```python\n# (continued)\nprint(x)\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no python block comes before it"):
        docs_blocks.python_programs([doc])


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_links_stay_inside_the_repository():
    root = docs_blocks.ROOT
    bad = []
    for doc in docs_blocks.documents():
        text = doc.read_text(encoding="utf-8")
        for m in _LINK.finditer(text):
            target = m.group(1).split("#", 1)[0]
            line = text.count("\n", 0, m.start()) + 1
            where = f"{doc.relative_to(root)}:{line}: {m.group(1)}"
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                bad.append(f"{where} (a URL: outside the repository)")
            elif target:
                resolved = (doc.parent / target).resolve()
                if root not in resolved.parents and resolved != root:
                    bad.append(f"{where} (outside the repository)")
                elif not resolved.exists():
                    bad.append(f"{where} (no such file)")
    assert not bad, "\n".join(bad)


def test_main_sample_trains_its_graphed_copies_as_eager():
    """The README's main sample (scripts/sample): its three copies train bit for bit alike
    (the sample exits non-zero at the first difference) and it reports both graphed ratios.
    The ratios' values are the benchmarks' business, not a test's."""
    sample = docs_blocks.ROOT / "samples" / "python" / "train.py"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(sample), "--steps", "12"], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    rows = [line.split() for line in done.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert rows and all(r[-1] == "yes" for r in rows), done.stdout
    assert re.search(r"replay/eager: whole step \(@dwgraph\.graphed_step\) [0-9.]+, per module "
                     r"\(make_graphed_callables\) [0-9.]+", done.stdout), done.stdout
    assert "whole step: 1 graph(s), 1 capture(s)" in done.stdout, done.stdout
