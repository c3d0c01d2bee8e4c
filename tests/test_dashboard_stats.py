"""The dashboard's Stats screen (key `s`): a screenshot on the fixture home with its fixed
clock, and its figures against `kugetsu stats` over the same hour."""

from __future__ import annotations

from dashboard_data import NOW, UTC, busy_home, clock, settled

from kugetsu.app import stats
from kugetsu.config.load import load_config
from kugetsu.store.files import Store
from kugetsu.frontends.tui.app import make_app
from kugetsu.frontends.tui.stats import StatsScreen, figures


def app_for(home):  # type: ignore[no-untyped-def]
    return make_app(home, clock=clock, tz=UTC, cwd="/")


async def open_stats(pilot) -> None:  # type: ignore[no-untyped-def]
    await pilot.press("s")
    await pilot.pause()


def test_stats_screen(snap_compare, tmp_path):
    assert snap_compare(app_for(busy_home(tmp_path / "home")), terminal_size=(100, 30), run_before=open_stats)


def test_stats_screen_at_80x24(snap_compare, tmp_path):
    assert snap_compare(app_for(busy_home(tmp_path / "home")), terminal_size=(80, 24), run_before=open_stats)


async def test_the_screen_shows_what_stats_computes_and_goes_back(tmp_path):
    home = busy_home(tmp_path / "home")
    app = app_for(home)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("s")
        await settled(pilot)
        screen = app.screen
        assert isinstance(screen, StatsScreen)
        report, line = figures(home, NOW)
        window = stats.load(home, load_config(home), Store(home).read(), 3600, NOW)
        assert report == stats.summarise(window) and line == stats.timeline(window)
        # busy_home: all six starts lie within the hour; 5 wait now, 6 did a minute ago (#6 started 40s ago)
        assert screen.query_one("#depth").data == line["queue_depth"] and line["queue_depth"][-1] == 6
        assert report["queued_now"] == 5 and sum(screen.query_one("#starts").data) == report["total"]["started"] == 5
        figures_text = str(screen.query_one("#stats-figures").render())
        assert "started 5" in figures_text and "failed 1" in figures_text
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, StatsScreen)


async def test_the_screen_shows_tokens_cost_and_fallbacks_of_the_hour(tmp_path):
    import msgspec

    from kugetsu.agents.report import Usage
    from kugetsu.core.models import Index
    from kugetsu.paths import atomic_write
    from kugetsu.store.protocol import encode_index

    home = busy_home(tmp_path / "home")
    index = msgspec.json.decode(home.index.read_bytes(), type=Index)
    ended = [t for t in index.finished if t.finished_at and (NOW - t.finished_at).total_seconds() < 3600]
    for t in ended:
        t.usage = Usage(input_tokens=1000, output_tokens=20, cost_usd=0.5)
    ended[0].fallback_from, ended[0].agent = ended[0].agent or "claude", "codex"
    atomic_write(home.index, encode_index(index))
    app = app_for(home)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("s")
        await settled(pilot)
        text = str(app.screen.query_one("#stats-figures").render())
    n = len(ended)
    assert f"usage  {1000 * n:,} tokens in, {20 * n:,} out, ${0.5 * n:.2f}  (1 on a fallback)" in text


async def test_the_summary_says_when_a_daily_budget_is_spent(tmp_path):
    import msgspec

    from kugetsu.core import budgets
    from kugetsu.agents.report import Usage
    from kugetsu.core.models import DaySpend, Index
    from kugetsu.paths import atomic_write
    from kugetsu.store.protocol import encode_index

    home = busy_home(tmp_path / "home", budgets={"sources": {"pm": {"usd": 20}}})
    index = msgspec.json.decode(home.index.read_bytes(), type=Index)
    index.spend = DaySpend(day=budgets.day_of(NOW), sources={"pm": Usage(cost_usd=21.5)})
    atomic_write(home.index, encode_index(index))
    app = app_for(home)
    async with app.run_test(size=(160, 30)) as pilot:
        await settled(pilot)
        text = str(app.summary.render())
    assert "budgets today: pm 21.50/20.00 USD (over: none starts until 00:00)" in text, text
