"""The worker's size limits: no function or method in elastic_step/worker/ over 40 lines, and the
Worker class (worker/loop.py) under 200, so that the training seam stays readable in one sitting."""

import ast
import pathlib

import elastic_step.worker

WORKER_DIR = pathlib.Path(elastic_step.worker.__file__).parent
MAX_FUNCTION_LINES = 40
MAX_WORKER_CLASS_LINES = 199


def lines(node: ast.AST) -> int:
    """A definition's lines, from its `def`/`class` line to its last (decorators not counted)."""
    return node.end_lineno - node.lineno + 1


def long_functions(source: str, name: str) -> list[str]:
    functions = (n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return [f"{name}:{f.lineno} {f.name} ({lines(f)} lines)" for f in functions if lines(f) > MAX_FUNCTION_LINES]


def test_no_function_in_the_worker_package_is_over_40_lines():
    modules = sorted(WORKER_DIR.glob("*.py"))
    assert {"loop.py", "client.py"} <= {m.name for m in modules}  # the glob looks where the worker is
    too_long = [line for m in modules for line in long_functions(m.read_text(encoding="utf-8"), m.name)]
    assert not too_long, f"split these into helpers of at most {MAX_FUNCTION_LINES} lines: {too_long}"


def test_the_length_check_counts_a_method_body_to_its_last_line():
    body = "".join(f"        x = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    assert long_functions(f"class C:\n    def at_limit(self):\n{body}", "m.py") == []
    assert long_functions(f"class C:\n    def over(self):\n{body}        x = 0\n", "m.py") == ["m.py:2 over (41 lines)"]


def test_the_worker_class_is_under_200_lines():
    tree = ast.parse((WORKER_DIR / "loop.py").read_text(encoding="utf-8"))
    (worker,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Worker"]
    assert lines(worker) <= MAX_WORKER_CLASS_LINES, f"Worker is {lines(worker)} lines: move a part of it to its own module"
