"""A coding task asked the way HumanEval asks: the function's signature and a docstring to complete.

Code benchmarks give the model a stub (imports, ``def name(args):``, a docstring with the task and
``>>>`` examples) rather than an instruction; a drafter trained only on instructions drafts such
answers worse. `function_stub` builds that stub from a training row that has a reference solution
(MBPP ``code``, Code Alpaca ``output``) and, where given, its test asserts (MBPP ``test_list``).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

from blockspec.data.benchmarks import HUMANEVAL_TEMPLATE

MAX_EXAMPLES = 3

#: How a stub is put to the model (``{prompt}``): the benchmark's wording and a few others users write.
STUB_WRAPPERS = (
    HUMANEVAL_TEMPLATE,
    "Complete this Python function:\n```python\n{prompt}\n```",
    "```python\n{prompt}\n```\nImplement the function above.",
    "{prompt}",
)


def function_stub(task: str, solution: str, tests: Sequence[str] = ()) -> str | None:
    """The stub of the solution's function, its docstring the task and up to MAX_EXAMPLES examples from
    ``tests``; None when the solution is not Python that defines a top-level function."""
    try:
        tree = ast.parse(solution.replace("\r\n", "\n").replace("\t", "    "))
    except (SyntaxError, ValueError):
        return None
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    if not functions:
        return None
    parsed_tests = [module for module in map(_parse, tests) if module is not None]
    called = {node.func.id for module in parsed_tests for node in ast.walk(module)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    function = next((f for f in functions if f.name in called), functions[-1])
    imports = [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    examples = [e for e in (_doctest_example(m, function.name) for m in parsed_tests) if e][:MAX_EXAMPLES]
    docstring = _indented([task.strip(), *examples])
    head = "\n".join(imports) + "\n\n\n" if imports else ""
    return f'{head}{_signature(function)}\n    """ {docstring}\n    """\n'


def _signature(function: ast.FunctionDef) -> str:
    bare = ast.FunctionDef(name=function.name, args=function.args, body=[ast.Pass()], decorator_list=[],
                           returns=function.returns, type_params=[])
    return ast.unparse(ast.fix_missing_locations(bare)).splitlines()[0]


def _parse(test: str) -> ast.Module | None:
    try:
        return ast.parse(test.strip())
    except (SyntaxError, ValueError):
        return None


def _doctest_example(test: ast.Module, name: str) -> str | None:
    """A test ``assert name(args) == value`` as a doctest example; None for any other form of test."""
    node = test.body[0] if test.body else None
    if not isinstance(node, ast.Assert) or not isinstance(node.test, ast.Compare):
        return None
    compare = node.test
    call = compare.left
    if (len(compare.ops) != 1 or not isinstance(compare.ops[0], ast.Eq) or not isinstance(call, ast.Call)
            or not isinstance(call.func, ast.Name) or call.func.id != name):
        return None
    return f">>> {ast.unparse(call)}\n{ast.unparse(compare.comparators[0])}"


def _indented(parts: list[str]) -> str:
    """The docstring body: parts one per paragraph, every line after the first indented four spaces."""
    lines = "\n".join(parts).splitlines()
    return "\n".join([lines[0], *("    " + line if line.strip() else "" for line in lines[1:])])
