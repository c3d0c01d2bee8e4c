"""The dashboard's widgets: tables that update in place by row key, and a log tail."""

from __future__ import annotations

import codecs
import os
import re
from pathlib import Path

from rich.text import Text
from textual.widgets import DataTable, Log

from kugetsu.paths import nofollow
from kugetsu.tui.view import Row

STATES = ("queued", "running", "stopping", "succeeded", "failed", "cancelled", "expired", "lost",
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
        return Text(text, style=rich_style, no_wrap=True, overflow="ellipsis")  # type: ignore[arg-type]


class TaskTable(StateTable):
    """A table whose rows are tasks (keyed by id): its cursor selects the task the Output shows."""


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-_]|\r(?!\n)")
TAIL_BYTES = 64 * 1024


class LogView(Log):
    """The live tail of one log file: the last 64 KiB at first, then whatever is appended.

    Reads by offset, so a poll costs one stat when nothing changed; a file that shrinks or is
    replaced (clean) is read again from its tail.
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
        from kugetsu.agents import Renderer

        self._readable = Renderer(getattr(self, "_kind", "text"))
        self._empty = True

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
        if st.st_size == self._offset:
            if self._empty:
                self._show_placeholder()
            return
        try:
            with open(self.path, "rb", opener=nofollow) as f:  # never through a link planted in the home
                f.seek(self._offset)
                data = f.read(st.st_size - self._offset)
        except OSError:
            return
        mid_file = self._offset > 0 and self._empty
        self._offset += len(data)
        if mid_file and b"\n" in data:  # started mid-file: drop the partial first line
            data = data[data.find(b"\n") + 1 :]
        text = _ANSI.sub("", self._readable.feed(self._decoder.decode(data)))
        if not text:
            return
        if self._empty:
            self.clear()
            self._empty = False
        self.write(text)

    def _show_placeholder(self) -> None:
        if self._empty and self.lines != self._placeholder.split("\n"):
            self.clear()
            self.write(self._placeholder)
