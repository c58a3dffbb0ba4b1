"""Every ```python block of README.md runs as written, from the repository root, on the CPU.

The rule: each ```python block of README.md is executed in a fresh namespace with the repository
root as the working directory (a reader's copy-paste into ``python`` there). A block whose first
line is ``# needs: <what>[, <what>]`` needs something this machine may lack: ``gpu`` (a CUDA
device) or ``vllm`` (vLLM installed); it is skipped, with that reason, where one is missing, and
run where all are present. Any other ``# needs:`` word fails the test, naming the block.

docs/*.md is not run: its python blocks are API sketches inside a larger program (they use names
such as ``job``, ``recipe``, ``token_lists`` from the surrounding text, or NCCL), so they do not
run as written. A docs block that should be checked belongs in the README or a unit test.
"""

from __future__ import annotations

import importlib.util
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```", re.MULTILINE | re.DOTALL)
NEEDS_MARK = re.compile(r"#\s*needs:\s*(?P<needs>.*)")
NEEDS = {
    "gpu": lambda: torch.cuda.is_available(),
    "vllm": lambda: importlib.util.find_spec("vllm") is not None,
}
"""What a block may need, and whether this machine has it."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the block's first code line
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def needs(self) -> list[str]:
        first = self.code.lstrip().splitlines()[0] if self.code.strip() else ""
        mark = NEEDS_MARK.fullmatch(first.strip())
        return [w.strip() for w in mark["needs"].split(",") if w.strip()] if mark else []


def python_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    return [Block(path, text.count("\n", 0, m.start("body")) + 1, textwrap.dedent(m["body"]))
            for m in FENCE.finditer(text)]


BLOCKS = python_blocks(README)


def test_every_python_fence_of_the_readme_is_collected():
    assert len(BLOCKS) == README.read_text().count("```python") > 0


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_readme_python_block_runs(block, monkeypatch):
    unknown = [n for n in block.needs() if n not in NEEDS]
    assert not unknown, f"{block.name}: unknown '# needs:' {unknown}; known: {sorted(NEEDS)}"
    missing = [n for n in block.needs() if not NEEDS[n]()]
    if missing:
        pytest.skip(f"{block.name} needs {', '.join(missing)}, which this machine lacks")
    monkeypatch.chdir(ROOT)
    # padded so that a traceback names the README's own line numbers
    code = compile("\n" * (block.line - 1) + block.code, str(block.path), "exec")
    exec(code, {"__name__": "__readme__"})
