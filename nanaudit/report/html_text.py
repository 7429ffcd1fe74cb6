"""The escaping the HTML report lives by: every string a user's program named (module names,
batch keys, file paths, exception messages, source lines) goes through `esc` before it enters
the page, and the JSON report enters it only through `embed_json`, so that nothing the user
chose can become markup or script.

`esc` also makes text that a browser would show wrongly or that UTF-8 cannot encode visible
as escapes (control characters, lone surrogates from a bad file name), so the page always
encodes and a hostile name stays readable. `embed_json` escapes `<`, `>` and `&` (and U+2028,
U+2029) as JSON `\\uXXXX` escapes: the text stays the same JSON value, and `</script>` or `<!--`
inside a user's string can no longer end the script element. `json_text` is its exact inverse
for the JSON renderer's output (which is ASCII, so it never writes those escapes itself).
"""

from __future__ import annotations

import html
import re

_UNSHOWABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
_JSON_UNSAFE = re.compile("[<>&\u2028\u2029]")
# A backslash escape of the JSON text, read left to right so that `\\u003c` (a user's own
# backslash followed by the letters u003c) is never taken for one of ours.
_JSON_ESCAPE = re.compile(r"\\(u003c|u003e|u0026|[\s\S])")

EMBEDDED_JSON_ID = "nanaudit-report"
"""The id of the <script type="application/json"> element holding the JSON report."""


def _visible(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def esc(value: object) -> str:
    """`value` as HTML text or attribute value: markup characters and quotes escaped, control
    characters and lone surrogates shown as `\\xNN` / `\\uNNNN`."""
    return html.escape(_UNSHOWABLE.sub(_visible, str(value)), quote=True)


def embed_json(text: str) -> str:
    """The JSON text made safe inside <script type="application/json">: the same JSON value."""
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _unescape(match: re.Match) -> str:
    escape = match.group(1)
    return chr(int(escape[1:], 16)) if len(escape) == 5 else match.group()


def json_text(embedded: str) -> str:
    """The JSON renderer's text back from `embed_json`'s (what the page's download gives)."""
    return _JSON_ESCAPE.sub(_unescape, embedded)


def embedded_json(page: str) -> str:
    """The JSON report a rendered page carries, exactly as `--json` writes it."""
    start = page.index(f'<script type="application/json" id="{EMBEDDED_JSON_ID}">')
    body = page[page.index(">", start) + 1:page.index("</script>", start)]
    return json_text(body)


def number_text(value: object, digits: int = 4) -> str:
    """A measured value as plain text: `—` when absent, else `digits` significant digits."""
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.{digits}g}"


def number(value: object, digits: int = 4) -> str:
    """`number_text` as HTML."""
    return esc(number_text(value, digits))


def table(headers: tuple[str, ...], rows: list[list[str]], numeric: tuple[int, ...] = (),
          cls: str = "") -> str:
    """A table of cells that are already HTML (escaped by the caller); `numeric` columns align
    right."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join("<tr>" + "".join(
        f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>"
        for i, c in enumerate(row)) + "</tr>" for row in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def facts_table(pairs: list[tuple[str, str]]) -> str:
    """Label / value rows (both escaped here), the way the console lists a finding's facts."""
    rows = "".join(f"<tr><th>{esc(label)}</th><td>{esc(value)}</td></tr>"
                   for label, value in pairs)
    return f'<table class="kv"><tbody>{rows}</tbody></table>'
