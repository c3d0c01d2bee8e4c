"""The dashboard's Stats screen (key `s`): the last hour at a glance.

Queue depth and starts per minute as sparklines, and the figures of `kugetsu stats --since
1h` (the same pure code, kugetsu/app/stats.py, over the same bounded read of the home's files).
It re-reads every few seconds in a thread worker: a read never freezes the screen.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label, Sparkline, Static

from kugetsu.app import stats
from kugetsu.config.load import load_config
from kugetsu.paths import Home
from kugetsu.store.files import open_store

WINDOW = 3600.0
BUCKETS = 60  # one a minute
REFRESH = 5.0  # seconds


def figures(home: Home, now: datetime) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The report and the sparklines' series for the hour before `now`."""
    window = stats.load(home, load_config(home), open_store(home).read(), WINDOW, now)
    return stats.summarise(window), stats.timeline(window, BUCKETS)


def describe(report: dict[str, Any]) -> str:
    """The figures under the sparklines, as Rich markup."""
    t = report["total"]
    rate, util, _d = stats.percent(t["success_rate"]), stats.percent(t["utilisation"]), stats.seconds
    w, r = t["wait_seconds"], t["run_seconds"]
    lines = [  # lines that fit 80 columns
        f"[b]admitted[/b] {t['admitted']}  [b]started[/b] {t['started']}  [b]succeeded[/b] {t['succeeded']}"
        f"  [b]failed[/b] {t['failed']}  [b]cancelled[/b] {t['cancelled']}",
        f"[b]expired[/b] {t['expired']}  [b]lost[/b] {t['lost']}  [b]success rate[/b] {rate}"
        f"  [b]throughput[/b] {t['throughput_per_hour']:.1f}/h  [b]utilisation[/b] {util}",
        "",
        f"[b]wait[/b]  p50 {_d(w['p50'])}  p95 {_d(w['p95'])}  max {_d(w['max'])}  ({w['count']} started)",
        f"[b]run[/b]   p50 {_d(r['p50'])}  p95 {_d(r['p95'])}  max {_d(r['max'])}  ({r['count']} finished)",
    ]
    u = t.get("usage") or {}
    if u.get("input_tokens") or u.get("output_tokens") or u.get("cost_usd") or t.get("fallbacks"):
        cost = f", ${u['cost_usd']:.2f}" if u.get("cost_usd") is not None else ""
        lines += ["", f"[b]usage[/b]  {u['input_tokens']:,} tokens in, {u['output_tokens']:,} out{cost}"
                  f"  ({t['fallbacks']} on a fallback)"]
    waiting = report["longest_waiting"]
    if waiting:
        lines += ["", "[b]longest waiting[/b]  " + "  ".join(
            f"{x['name']} (#{x['id']}) {_d(x['waiting_seconds'])}" for x in waiting[:3])]
    return "\n".join(lines)


class StatsScreen(Screen[None]):
    BINDINGS = [Binding("escape,s", "app.pop_screen", "back"), Binding("r", "refresh", "refresh")]

    def __init__(self, home: Home, clock: Callable[[], datetime], refresh_every: float = REFRESH):
        super().__init__()
        self.home = home
        self.clock = clock
        self.refresh_every = refresh_every

    def compose(self) -> ComposeResult:
        yield Static("Stats · last hour", id="stats-title")
        with Vertical(id="stats-body"):
            yield Label("", id="depth-label", classes="spark-label")
            yield Sparkline([], id="depth")
            yield Label("", id="starts-label", classes="spark-label")
            yield Sparkline([], id="starts")
            yield Static("", id="stats-figures")
        yield Footer()

    def on_mount(self) -> None:
        try:  # at once, so the screen never opens empty (a small read: the last hour only)
            self.show(*figures(self.home, self.clock()))
        except Exception as err:
            self.failed(err)
        self.set_interval(self.refresh_every, self.action_refresh)

    def action_refresh(self) -> None:
        self._reload()

    @work(thread=True, exclusive=True, group="stats")
    def _reload(self) -> None:
        try:
            shown = figures(self.home, self.clock())
        except Exception as err:  # a damaged file: say so, keep the last figures
            self.app.call_from_thread(self.failed, err)
            return
        self.app.call_from_thread(self.show, *shown)

    def show(self, report: dict[str, Any], line: dict[str, list[float]]) -> None:
        depth, starts = line["queue_depth"], line["starts"]
        self.query_one("#depth", Sparkline).data = depth
        self.query_one("#starts", Sparkline).data = starts
        self.query_one("#depth-label", Label).update(
            f"Queue depth, most waiting each minute: {report['queued_now']} now, peak {max(depth):.0f}")
        self.query_one("#starts-label", Label).update(f"Starts per minute: {sum(starts):.0f} in the hour")
        self.query_one("#stats-figures", Static).update(describe(report))
        until = report["until"].astimezone(getattr(self.app, "tz", None))
        self.query_one("#stats-title", Static).update(
            f"Stats · last hour · max_agents {report['max_agents']} · as of {until:%H:%M:%S}")

    def failed(self, err: BaseException) -> None:
        from kugetsu.frontends.tui.screens import describe_error

        self.notify(describe_error(err), title="cannot read the stats", severity="error", timeout=8)
