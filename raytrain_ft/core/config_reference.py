"""The configuration reference of docs/configuration.md, generated from `raytrain_ft.core.config`'s dataclasses:
each key's type and default from the field, its meaning from the field's trailing `# comment` in the source,
so the reference cannot drift. `python -m raytrain_ft.core.config_reference` prints it.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize

from raytrain_ft.core.config import Config
from raytrain_ft.core.fault_spec import FaultSpec


def reference_rows(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every config key, the meaning read from the trailing
    `# comment` of the field in this module's source, so the reference in docs/configuration.md cannot drift."""
    comments = _field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            rows += reference_rows(f.default_factory, f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if callable(f.default_factory) else f.default
        type_name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append((f"{prefix}{f.name}", type_name, repr(default), comments.get(f.name, "")))
    return rows


def _field_comments(cls: type) -> dict[str, str]:
    comments, name = {}, None
    for tok in tokenize.generate_tokens(io.StringIO(inspect.getsource(cls)).readline):
        if tok.type == tokenize.NAME and tok.start[1] == 4 and name is None:
            name = tok.string
        elif tok.type == tokenize.COMMENT and name:
            comments[name] = tok.string.lstrip("# ")
        elif tok.type == tokenize.NEWLINE:
            name = None
    return comments


def reference_markdown() -> str:
    """The configuration reference as a markdown table (`python -m raytrain_ft.core.config_reference`)."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {t} | `{d}` | {m.replace('|', '/')} |" for k, t, d, m in reference_rows()]
    lines.append(
        "| `faults[].kind`, `.step`, `.rank`, `.steps`, `.factor`, `.seconds`, `.at`, `.jitter` | see `faults` | | "
        + "; ".join(f"`{k}`: {m}" for k, _, _, m in reference_rows(FaultSpec)).replace("|", "/")
        + " |"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference_markdown(), end="")
