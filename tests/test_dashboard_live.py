"""The dashboard against the real thing: a service, the CLI in another process, a real agent."""

from __future__ import annotations

import asyncio

from dashboard_data import until

from kugetsu.frontends.tui.app import make_app


async def test_a_task_delegated_from_the_cli_appears_and_finishes_in_the_dashboard(kg):
    kg.config(max_agents=2)
    app = make_app(kg.home, cwd=str(kg.home.root.parent))
    async with app.run_test() as pilot:
        assert "service not running" in str(app.summary.render())
        go = kg.rec / "go"  # the agent ends when the test has seen it running
        agent = ["sh", "-c", 'echo hello from the agent; while [ ! -e "$0" ]; do sleep 0.05; done; echo all done', str(go)]
        out = await asyncio.to_thread(kg.ok, "delegate", "live", "--", *agent)
        assert out.startswith("started live (#1), slot 1/2")

        # The first task to arrive in the focused table is selected, so its output shows.
        await until(pilot, lambda: app.running.keys == ["1"], timeout=10, what="the task in Running")
        await until(pilot, lambda: "hello from the agent" in app.output.lines, timeout=10, what="its output")
        await until(pilot, lambda: "service running" in str(app.summary.render()), timeout=10, what="the service")
        assert str(app.summary.render()).startswith("1/2 running · 0 queued")
        go.touch()

        await until(pilot, lambda: "1" in app.finished.keys, timeout=10, what="the task in Finished")
        assert app.running.keys == []
        assert [str(c) for c in app.finished.get_row("1")][:4] == ["1", "live", "succeeded", "0"]
        # It was selected while it ran, so the selection follows it into Finished (focus moves
        # on the next message cycle).
        await until(pilot, lambda: app.finished.has_focus, timeout=10, what="focus to follow the task")
        assert app.selected == 1
        await until(pilot, lambda: "all done" in app.output.lines, timeout=10, what="the end of its output")
        assert "live (#1) · succeeded" in str(app.output.border_title)


def test_other_commands_never_import_textual(kg):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "kugetsu", "capacity"],
                       env=kg.env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "textual" not in r.stderr
    from kugetsu.frontends.cli.main import COMMANDS, build_parser

    assert build_parser().parse_args(["dashboard"]).command == "dashboard" and "dashboard" in COMMANDS
