"""The dashboard's widgets: tables that update in place by row key, and a log tail."""

from __future__ import annotations

import codecs
import os
import re
from typing import Any
from pathlib import Path

from rich.text import Text
from textual.widgets import DataTable, Log

from kugetsu.paths import nofollow
from kugetsu.frontends.text import printable
from kugetsu.frontends.tui.view import Row


def plain(text: str, lines: bool = True, **style: object) -> Text:
    """Anyone's text (a task's reason, a preset's name, a path in an error, an agent's output)
    for a widget, as written: a Text is never read as markup (a `[/]` in a string was a
    MarkupError that closed the dashboard, a `[@click=app.quit]` a live action), and what a
    terminal would obey in it is shown escaped (text.printable; `lines` as there). Every
    widget that shows such text takes it from here; markup is for the app's own words only."""
    return Text(printable(text, lines), **style)  # type: ignore[arg-type]

STATES = ("queued", "running", "stopping", "paused", "succeeded", "failed", "cancelled", "expired", "lost",
          "started", "config")


class StateTable(DataTable):
    """A DataTable whose rows are replaced by `sync`: only cells that changed are touched, so
    the cursor, the scroll position and the rest of the screen stay put (no flicker).

    Row colours come from app.tcss through component classes (`state--failed` ...), so the
    palette lives with the rest of the styles.
    """

    COMPONENT_CLASSES = DataTable.COMPONENT_CLASSES | {f"state--{s}" for s in STATES}

    def __init__(self, columns: tuple[tuple[str, str], ...], *, key_column: str | None = None,
                 fill_column: str | None = None, squeeze_column: str | None = None, **kw: object):
        super().__init__(cursor_type="row", zebra_stripes=False, **kw)  # type: ignore[arg-type]
        self._columns = columns
        self._key_column = key_column  # a column whose text is the row key: lets `sort` reorder by key
        # A column (the last: a reason, a detail) that takes the width the others leave and cuts
        # its text with "…", rather than running past the pane's edge (cut mid-word, unseen).
        self._fill_column = fill_column
        # A column that gives up width (down to SQUEEZE_MIN, its cells cut with "…") when the
        # fill column would otherwise be too narrow to read.
        self._squeeze_column = squeeze_column
        self._shown: dict[str, Row] = {}

    FILL_MIN = 8  # the fill column never narrower than this: below it the table scrolls sideways
    FILL_WANTED = 16  # ... and a squeeze column gives up width until it has this much
    SQUEEZE_MIN = 10

    def on_resize(self) -> None:
        self.fit_fill_column()

    def fit_fill_column(self) -> None:
        if self._fill_column is None or self._fill_column not in self.columns:
            return
        fill = self.columns[self._fill_column]  # type: ignore[index]
        room = self.scrollable_content_region.width - 2 * self.cell_padding
        squeeze = self.columns.get(self._squeeze_column) if self._squeeze_column else None  # type: ignore[call-overload]
        if squeeze is not None:
            others = sum(c.get_render_width(self) for k, c in self.columns.items() if c not in (fill, squeeze))
            spare = room - others - 2 * self.cell_padding - self.FILL_WANTED
            width = max(self.SQUEEZE_MIN, min(squeeze.content_width, spare))
            if (squeeze.auto_width or squeeze.width != width) and not (squeeze.auto_width and width == squeeze.content_width):
                squeeze.auto_width, squeeze.width = width == squeeze.content_width, width
                self._require_update_dimensions = True
        others = sum(c.get_render_width(self) for k, c in self.columns.items() if c is not fill)
        width = max(self.FILL_MIN, room - others)
        if fill.auto_width or fill.width != width:
            fill.auto_width, fill.width = False, width
            self._require_update_dimensions = True
            self.refresh()

    @property
    def rows_hidden(self) -> int:
        """Rows that do not fit in the pane's height (the user scrolls to see them)."""
        visible = self.scrollable_content_region.height - (self.header_height if self.show_header else 0)
        return max(0, self.row_count - max(0, visible))

    def on_mount(self) -> None:
        for key, label in self._columns:
            self.add_column(label, key=key)

    @property
    def keys(self) -> list[str]:
        return [str(row.key.value) for row in self.ordered_rows]

    @property
    def cursor_key(self) -> str | None:
        if not self.row_count or not 0 <= self.cursor_row < self.row_count:
            return None
        return str(self.ordered_rows[self.cursor_row].key.value)

    def select_key(self, key: str) -> bool:
        """Put the cursor on `key`'s row, without scrolling away from what the user looks at."""
        if key not in self._shown:
            return False
        index = self.get_row_index(key)
        if index != self.cursor_row:
            self.move_cursor(row=index, scroll=False)
        return True

    def sync(self, rows: list[Row]) -> None:
        cursor = self.cursor_key
        wanted = {r.key for r in rows}
        for key in [k for k in self._shown if k not in wanted]:
            self.remove_row(key)
            del self._shown[key]
        for row in rows:
            old = self._shown.get(row.key)
            if old is None:
                self.add_row(*self._cells(row), key=row.key)
            elif old != row:
                for (col, _), new_text, old_text in zip(self._columns, row.cells, old.cells):
                    if new_text != old_text or row.style != old.style:
                        self.update_cell(row.key, col, self._cell(new_text, row.style), update_width=True)
            self._shown[row.key] = row
        order = [r.key for r in rows]
        if self.keys != order:
            self._reorder(order)
        if cursor is not None:
            self.select_key(cursor)
        self.fit_fill_column()  # the other columns may have grown or shrunk

    def _reorder(self, order: list[str]) -> None:
        if self._key_column is None:  # no key in the cells: rebuild (rare: these tables only append)
            rows = [self._shown[k] for k in order]
            self.clear()
            for row in rows:
                self.add_row(*self._cells(row), key=row.key)
            return
        rank = {k: i for i, k in enumerate(order)}
        self.sort(self._key_column, key=lambda cell: rank[str(cell)])

    def legend(self, states: tuple[str, ...]) -> Text:
        """The state names in their own colours, for the help screen."""
        return Text("  ").join(self._cell(state, state) for state in states)

    def _cells(self, row: Row) -> list[Text]:
        return [self._cell(text, row.style) for text in row.cells]

    def _cell(self, text: str, style: str) -> Text:
        name = f"state--{style}"
        rich_style: object = ""
        if name in self.COMPONENT_CLASSES:
            try:
                rich_style = self.get_component_rich_style(name, partial=True)
            except KeyError:  # not styled yet, or no longer (a refresh as the app mounts or closes)
                pass
        return plain(text, lines=False, style=rich_style, no_wrap=True, overflow="ellipsis")


class TaskTable(StateTable):
    """A table whose rows are tasks (keyed by id): its cursor selects the task the Output shows."""


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]|\r(?!\n)")
TAIL_BYTES = 64 * 1024
LINE_SHOWN = 4096


class LogView(Log):
    """The live tail of one log file: the last 64 KiB at first, then whatever is appended.

    Reads by offset, so a poll costs one stat when nothing changed; a file that shrinks or is
    replaced (clean, the service's cap on a log) is read again from its tail. Bounded
    whatever the agent writes: a poll reads at most TAIL_BYTES (more appended since the last
    one is skipped, with a line that says so), and a line is shown up to LINE_SHOWN
    characters (the rest is cut, counted at its end): a flood must not stop the app.
    """

    def __init__(self, *, poll: float = 1.0, **kw: object):
        super().__init__(max_lines=5000, highlight=False, **kw)  # type: ignore[arg-type]
        self.path: Path | None = None
        self._poll = poll
        self._placeholder = ""
        self._reset()

    def on_mount(self) -> None:
        self.set_interval(self._poll, self.poll)

    def _reset(self) -> None:
        self._offset = 0
        self._inode = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._readable = self._renderer()
        self._empty = True
        self._mid_line = False  # reading from inside a line: drop up to its end
        self._col = 0  # characters of the current line shown
        self._cut = 0  # characters of the current line not shown
        self._open = False  # the last line shown has not ended yet

    def _renderer(self) -> Any:
        from kugetsu.agents import Renderer

        return Renderer(getattr(self, "_kind", "text"))

    def follow(self, path: Path | None, placeholder: str = "(no output yet)", kind: str = "text") -> None:
        """Show `path`; `kind`: its preset's output (a structured one is shown as text)."""
        self.path, self._placeholder, self._kind = path, placeholder, kind
        self._reset()
        self.clear()
        self.poll()

    def poll(self) -> None:
        if self.path is None:
            self._show_placeholder()
            return
        try:
            st = os.stat(self.path)
        except OSError:
            self._show_placeholder()
            return
        if st.st_ino != self._inode or st.st_size < self._offset:
            self._reset()
            self.clear()
            self._inode = st.st_ino
            self._offset = max(0, st.st_size - TAIL_BYTES)
            self._mid_line = self._offset > 0
        if st.st_size == self._offset:
            if self._empty:
                self._show_placeholder()
            return
        skipped = max(0, st.st_size - TAIL_BYTES - self._offset)
        try:
            with open(self.path, "rb", opener=nofollow) as f:  # never through a link planted in the home
                f.seek(self._offset + skipped)
                data = f.read(TAIL_BYTES)
        except OSError:
            return
        self._offset += skipped + len(data)
        if skipped:
            self._decoder.reset()
            self._readable = self._renderer()  # a structured line cut by the skip is no line
            self._mid_line = True
        if self._mid_line and b"\n" in data:  # started inside a line: drop the part of it read
            data = data[data.find(b"\n") + 1 :]
        self._mid_line = False
        # A structured output (its preset's `output`) as the text a person reads; colours and
        # cursor moves dropped quietly; any other control character shown escaped.
        text = printable(_ANSI.sub("", self._readable.feed(self._decoder.decode(data))))
        if not text and not skipped:
            return
        if self._empty:
            self.clear()
            self._empty = False
        if skipped:
            self._emit(("\n" if self._col or self._cut else "") + f"[\u2026 {skipped} bytes skipped]\n")
            self._col = self._cut = 0
        self._emit(self._bounded(text))

    def _emit(self, text: str) -> None:
        """Append `text` to the pane: the first piece continues the open line, whole lines go in
        with one write_lines (Log.write refreshes once per line: 64 KiB of short lines took
        half a second, a frozen app under a flood)."""
        parts = text.split("\n")
        if self._open:
            self.write(parts.pop(0), scroll_end=False)
        self._open = parts[-1] != ""
        if not self._open:
            parts.pop()
        if parts:  # write_lines drops an empty line: a blank shows as one space
            self.write_lines([p or " " for p in parts])

    def _bounded(self, text: str) -> str:
        """`text` with each line cut at LINE_SHOWN characters, across writes (a line may come
        in many); a cut line ends with how much of it was not shown."""
        out = []
        for i, part in enumerate(text.split("\n")):
            if i:
                if self._cut:
                    out.append(f" \u2026 [{self._cut} characters cut]")
                out.append("\n")
                self._col = self._cut = 0
            room = max(0, LINE_SHOWN - self._col)
            out.append(part[:room])
            self._col += min(room, len(part))
            self._cut += max(0, len(part) - room)
        return "".join(out)

    def _show_placeholder(self) -> None:
        if self._empty and self.lines != self._placeholder.split("\n"):
            self.clear()
            self.write(self._placeholder)
