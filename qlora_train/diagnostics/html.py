"""``debug_samples.html``: each sample with trained tokens highlighted and token boundaries on hover.

One self-contained page (inline CSS, no script, no network): every token is a
``<span class="tok on|off" title="#pos id … label …">``; trained tokens
(``on``) have a green background, masked ones (``off``) grey text. Hovering a
token outlines it and shows its position, id and label. Long samples wrap and
scroll inside their box (drag its corner to enlarge); each sample can be folded.
An image's run of image tokens is one span (``tok off image``): a thumbnail of the
image (a ``data:`` PNG, at most 96 px) and its marker ``[image WxH → N tokens]``, followed by where the row has it
(``src``: its file, or the images column and index of inline bytes).
"""

from __future__ import annotations

from html import escape as escape_html
from html.parser import HTMLParser

from qlora_train.diagnostics.images import ImageRun, thumbnail_uri
from qlora_train.diagnostics.samples import Sample, raw_preview, sample_summary
from qlora_train.terminal import visible

CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 120ch; padding: 0 1rem; color: #111; }
h1 { font-size: 1.4rem; } h2 { font-size: 1.05rem; margin: 0; display: inline; }
.legend span { padding: 0 .4em; }
section { border: 1px solid #ccc; border-radius: 6px; margin: 1.2rem 0; padding: .6rem 1rem; }
.meta { color: #444; font-size: .9rem; margin: .4rem 0; }
pre { white-space: pre-wrap; word-break: break-word; font-size: .85rem; line-height: 1.45; margin: .4rem 0;
      max-height: 40em; overflow-y: auto; resize: vertical; }
.tok.on { background: #c8f7c5; color: #0b3d0b; }
.tok.off { color: #777; }
.tok:hover { outline: 1px solid #c00; background: #ffe9a8; }
.tok.image { border: 1px dashed #999; border-radius: 3px; padding: 0 .2em; }
.thumb { max-height: 96px; max-width: 96px; vertical-align: middle; margin-right: .3em; }
.src { font-size: .75rem; color: #235; background: #e8eef7; border-radius: 3px; padding: 0 .3em; margin: 0 .3em; }
.refused { border-color: #d98; }
.reason { color: #a00; font-weight: 600; }
nav a { margin-right: .6em; }
"""


def escape(text: str) -> str:
    """Text for the page: control characters and bidirectional overrides shown as escapes, as on the terminal
    (``terminal.visible``), then HTML-escaped."""
    return escape_html(visible(text))


def _image_span(run: ImageRun, labels: list[int], on: bool) -> str:
    """An image's run of tokens as one span: its thumbnail (when its file can be read) and its marker."""
    uri = thumbnail_uri(run.ref) if run.ref and run.size else None
    img = f'<img class="thumb" src="{uri}" alt="image {run.size[0]}x{run.size[1]}">' if uri else ""
    shown = ",".join(map(str, sorted(set(labels[run.start:run.end]))))
    source = f'<span class="src" title="where the row has this image">{escape(run.source)}</span>' if run.source else ""
    return (f'<span class="tok {"on" if on else "off"} image" title="#{run.start}-{run.end - 1} {run.tokens} image '
            f'tokens label {shown}">{img}{escape(run.marker)}</span>{source}')


def _token_spans(sample: Sample) -> str:
    out = []
    runs = {run.start: run for run in sample.images}
    skip_to = 0
    for pos, (tid, label, piece, on) in enumerate(zip(sample.input_ids, sample.labels, sample.pieces, sample.trained)):
        if pos < skip_to:  # inside an image's run, shown once as its marker
            continue
        if (run := runs.get(pos)) is not None:
            out.append(_image_span(run, sample.labels, any(sample.trained[run.start:run.end])))
            skip_to = run.end
            continue
        if not piece:  # ends mid-character: its text shows with the token that completes it
            continue
        out.append(f'<span class="tok {"on" if on else "off"}" title="#{pos} id {tid} label {label}">'
                   f"{escape(piece)}</span>")
    return "".join(out)


def _section(sample: Sample) -> str:
    head = (f'<summary><h2>{escape(sample.name)}</h2> <span class="meta">(source {escape(sample.source)})</span>'
            "</summary>")
    if sample.drop_reason:
        return (f'<section class="refused" id="{sample.anchor}"><details open>{head}'
                f'<p class="meta"><span class="reason">refused: {escape(sample.drop_reason)}</span> '
                f"{escape(sample.drop_detail)}</p><pre>{escape(raw_preview(sample.raw))}</pre></details></section>")
    return (f'<section class="sample" id="{sample.anchor}"><details open>{head}'
            f'<p class="meta">{escape(sample_summary(sample))}</p>'
            f"<pre>{_token_spans(sample)}</pre></details></section>")


def debug_html(samples: list[Sample], *, title: str = "qlora-train debug samples") -> str:
    """Samples -> a complete HTML page."""
    nav = " ".join(f'<a href="#{s.anchor}">{escape(s.name)}</a>' for s in samples)
    legend = ('<p class="legend">legend: <span class="tok on">trained</span> <span class="tok off">masked</span> '
              "(hover a token for its position, id and label)</p>")
    body = "\n".join(_section(s) for s in samples)
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{CSS}</style></head>\n<body><h1>{escape(title)}</h1>{legend}<nav>{nav}</nav>\n{body}\n"
            "</body></html>\n")


class _TokenReader(HTMLParser):
    """Collects, per ``<section id>``, the token spans ``(trained, title, text)`` and the refused reasons."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.sections: dict[str, list[tuple[bool, str, str]]] = {}
        self._section: str | None = None
        self._token: list | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self._section = a.get("id", "")
            self.sections[self._section] = []
        elif tag == "span" and self._section is not None and "tok" in (a.get("class") or "").split():
            self._token = ["on" in a["class"].split(), a.get("title", ""), ""]

    def handle_endtag(self, tag):
        if tag == "span" and self._token is not None:
            self.sections[self._section].append(tuple(self._token))
            self._token = None
        elif tag == "section":
            self._section = None

    def handle_data(self, data):
        if self._token is not None:
            self._token[2] += data


def read_tokens(page: str) -> dict[str, list[tuple[bool, str, str]]]:
    """A debug page (as written, or as a browser's DOM dump) -> section id -> its token spans."""
    reader = _TokenReader()
    reader.feed(page)
    reader.close()
    return reader.sections
