"""A report as sections of blocks, rendered to Markdown (images linked) and to one self-contained
HTML file (images embedded as base64), so the two never disagree."""

from __future__ import annotations

import base64
import html
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Table:
    headers: list[str]
    rows: list[list[object]]
    sortable: bool = False  # HTML: a click on a header sorts by that column


@dataclass
class Pre:
    text: str


@dataclass
class Image:
    path: Path
    caption: str


Block = str | Table | Pre | Image  # a str is a paragraph


@dataclass
class Section:
    title: str
    blocks: list[Block] = field(default_factory=list)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e-2 and value else f"{value:,.2f}"
    return str(value)


def to_markdown(title: str, sections: list[Section], relative_to: Path) -> str:
    lines = [f"# {title}", ""]
    for section in sections:
        lines += [f"## {section.title}", ""]
        for block in section.blocks:
            if isinstance(block, Table):
                lines.append("| " + " | ".join(block.headers) + " |")
                lines.append("|" + "---|" * len(block.headers))
                lines += [
                    "| " + " | ".join(_cell(v).replace("|", "\\|") for v in row) + " |" for row in block.rows
                ]
            elif isinstance(block, Pre):
                lines += ["```", block.text, "```"]
            elif isinstance(block, Image):
                lines.append(f"![{block.caption}]({os.path.relpath(block.path, relative_to)})")
            else:
                lines.append(block)
            lines.append("")
    return "\n".join(lines)


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; }
th { background: #f3f3f3; }
pre { background: #f7f7f7; padding: 0.8rem; overflow-x: auto; font-size: 0.8rem; }
img { max-width: 100%; border: 1px solid #eee; }
.failed { color: #b00020; font-weight: bold; }
table.sortable th { cursor: pointer; }
"""

# Sorts a sortable table's body by the clicked column: numbers as numbers ("1.5x", "-" last), the
# rest as text; a second click reverses.
SORT_SCRIPT = """<script>
document.querySelectorAll('table.sortable th').forEach((th, column) => th.addEventListener('click', () => {
  const body = th.closest('table').tBodies[0];
  const up = th.dataset.up !== '1'; th.dataset.up = up ? '1' : '0';
  const key = row => { const t = row.cells[column].textContent.replace(/[,x%]/g, '');
    const n = parseFloat(t); return isNaN(n) ? t : n; };
  [...body.rows].sort((a, b) => { const x = key(a), y = key(b);
    const order = typeof x === typeof y ? (x < y ? -1 : x > y ? 1 : 0) : (typeof x === 'number' ? -1 : 1);
    return up ? order : -order; }).forEach(row => body.appendChild(row));
}));
</script>"""


def to_html(title: str, sections: list[Section]) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    for section in sections:
        parts.append(f"<h2>{html.escape(section.title)}</h2>")
        for block in section.blocks:
            if isinstance(block, Table):
                head = "".join(f"<th>{html.escape(h)}</th>" for h in block.headers)
                body = "".join(
                    "<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>"
                    for row in block.rows
                )
                css = " class='sortable'" if block.sortable else ""
                parts.append(f"<table{css}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
            elif isinstance(block, Pre):
                parts.append(f"<pre>{html.escape(block.text)}</pre>")
            elif isinstance(block, Image):
                data = base64.b64encode(block.path.read_bytes()).decode()
                parts.append(
                    f"<figure><img alt='{html.escape(block.caption)}' src='data:image/png;base64,{data}'>"
                    f"<figcaption>{html.escape(block.caption)}</figcaption></figure>"
                )
            else:
                css = " class='failed'" if block.startswith("FAILED") else ""
                parts.append(f"<p{css}>{html.escape(block)}</p>")
    if any(isinstance(b, Table) and b.sortable for s in sections for b in s.blocks):
        parts.append(SORT_SCRIPT)
    parts.append("</body></html>")
    return "\n".join(parts)


def without_local_paths(sections: list[Section], root: Path) -> list[Section]:
    """The sections with this machine's paths written relative: the run folder as `.`, the
    repository as `<repo>`, the home folder as `~` (a report is shared; its paths are not)."""
    from pipeline import REPO_ROOT

    replacements = [(str(root.resolve()), "."), (str(REPO_ROOT), "<repo>"), (str(Path.home()), "~")]

    def clean(value: object) -> object:
        if not isinstance(value, str):
            return value
        for local, shown in replacements:
            value = value.replace(local, shown)
        return value

    def block(b: Block) -> Block:
        if isinstance(b, Table):
            return Table(
                [clean(h) for h in b.headers], [[clean(v) for v in row] for row in b.rows], b.sortable
            )
        if isinstance(b, Pre):
            return Pre(clean(b.text))
        return clean(b) if isinstance(b, str) else b

    return [Section(s.title, [block(b) for b in s.blocks]) for s in sections]


def write(
    folder: Path, name: str, title: str, sections: list[Section], root: Path | None = None
) -> tuple[Path, Path]:
    """folder/name.md and folder/name.html; with `root`, local paths made relative to it."""
    if root is not None:
        sections = without_local_paths(sections, root)
    folder.mkdir(parents=True, exist_ok=True)
    md, page = folder / f"{name}.md", folder / f"{name}.html"
    md.write_text(to_markdown(title, sections, folder))
    page.write_text(to_html(title, sections))
    return md, page
