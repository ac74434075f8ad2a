"""Counts code lines: non-blank lines that are neither comments nor docstrings (issue 40's measure).

    python scripts/code_lines.py [DIR ...]     # default: src/rewardstack, per top-level room and total
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections import Counter
from pathlib import Path


def code_lines(source: str) -> int:
    """Lines holding a token that is not a comment, a docstring or whitespace."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
        else:
            continue
        for i, stmt in enumerate(body):
            # The docstring, and the attribute docstrings that follow an assignment.
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
                if i == 0 or isinstance(body[i - 1], (ast.Assign, ast.AnnAssign)):
                    docstrings.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in skip:
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in docstrings:
                lines.add(line)
    return len(lines)


def main(argv: list[str]) -> None:
    roots = [Path(a) for a in argv] or [Path("src/rewardstack")]
    for root in roots:
        rooms: Counter[str] = Counter()
        files: Counter[str] = Counter()
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            room = rel.parts[0] if len(rel.parts) > 1 else "(top)"
            rooms[room] += code_lines(path.read_text(encoding="utf-8"))
            files[room] += 1
        for room, n in sorted(rooms.items(), key=lambda kv: -kv[1]):
            print(f"{room:24s} {files[room]:4d} files {n:6d} code lines")
        print(f"{str(root):24s} {sum(files.values()):4d} files {sum(rooms.values()):6d} code lines")


if __name__ == "__main__":
    main(sys.argv[1:])
