"""Each component's README.md, generated from its docstring and signature (the docstring is the
one place a component is described; `make compile` writes the READMEs and a test checks them)."""

from __future__ import annotations

import inspect
import re

import docstring_parser


def _type_name(spec) -> str:
    return spec.type.replace("system.", "").split("@")[0]


def _returns(docstring: str) -> dict[str, str]:
    """Google-style "Returns:" entries, one "name: text" per output (docstring_parser reads
    them as a single return value)."""
    found: dict[str, str] = {}
    current = None
    for line in docstring.split("\nReturns:", 1)[1].splitlines() if "\nReturns:" in docstring else []:
        match = re.match(r"^\s{4}(\w+): (.*)$", line)
        if match:
            current = match.group(1)
            found[current] = match.group(2).strip()
        elif current and line.strip():
            found[current] += " " + line.strip()
    return found


def component_readme(name: str, component) -> str:
    doc = docstring_parser.parse(inspect.getdoc(component.python_func) or "")
    described = {p.arg_name: " ".join(p.description.split()) for p in doc.params}
    described.update(_returns(inspect.getdoc(component.python_func) or ""))
    spec = component.component_spec
    prose = (inspect.getdoc(component.python_func) or "").split("\nArgs:")[0]
    lines = [f"# `{name}`", ""] + [" ".join(paragraph.split()) + "\n" for paragraph in prose.split("\n\n")]
    lines += ["## Inputs", "", "| name | type | default | description |", "|---|---|---|---|"]
    for arg, entry in spec.inputs.items():
        default = "" if entry.default is None else f"`{entry.default!r}`" if entry.default != "" else '`""`'
        lines.append(f"| `{arg}` | {_type_name(entry)} | {default} | {described.get(arg, '')} |")
    lines += ["", "## Outputs", "", "| name | type | description |", "|---|---|---|"]
    for arg, entry in (spec.outputs or {}).items():
        lines.append(f"| `{arg}` | {_type_name(entry)} | {described.get(arg, '')} |")
    lines += [
        "", "## Use", "", "```python",
        "from elastic_step.components import " + name, "```", "",
        f"or, without the Python package: `kfp.components.load_component_from_file(\"components/{name}/component.yaml\")`.",
        "", f"Image: `{spec.implementation.container.image}` (set `ELASTIC_STEP_IMAGE` when compiling to use your own).",
        "", "_Generated from the component's docstring by `make compile`; edit `component.py`, not this file._", "",
    ]
    return "\n".join(lines)
