"""Notifications: each event once, through outages, flood control and service restarts."""

from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest

from conftest import agent_wrappers, wait_for
from fakebot import TOKEN
from test_telegram_bot import ME, api, bot_up, reply, setup  # noqa: F401  (api is a fixture)


@pytest.fixture
def tmp_path(ram_path: Path) -> Path:
    """A test here writes a 200 MB log: in RAM (conftest.ram_path), not on the shared disk."""
    return ram_path


def once(api, needle: str) -> bool:
    found = api.with_text(ME, needle)
    assert len(found) <= 1, f"{needle!r} delivered {len(found)} times"
    return len(found) == 1


def test_started_finished_failed_expired_cancelled_each_once(kg, api):
    setup(kg, api, max_agents=1)
    bot_up(kg, api)
    kg.delegate("ok1", 0.1)
    kg.ok("delegate", "bad", "--", "sh", "-c", 'echo step one; echo "<boom> & fail"; exit 3')
    kg.delegate("hog", 30)
    kg.delegate("issue-16", 30, 0, "--expire-after", "1s")
    reply(api, ME, "issue-16</b> expired after")
    kg.ok("cancel", "hog")
    kg.delegate("last", 0)
    reply(api, ME, "<b>last</b> (#5) succeeded")  # delivery is in order: all before it are settled
    for needle in ("started <b>ok1</b>", "<b>ok1</b> (#1) succeeded after", "started <b>bad</b>",
                   "<b>bad</b> (#2) failed", "started <b>hog</b>", "issue-16</b> expired",
                   "<b>hog</b> (#3) cancelled by cli", "started <b>last</b>"):
        assert once(api, needle), needle
    failed = api.with_text(ME, "<b>bad</b> (#2) failed")[0].params["text"]
    assert "exit code 3" in failed and "step one" in failed and "&lt;boom&gt; &amp; fail" in failed
    assert "after" in failed  # the duration
    expired = api.with_text(ME, "issue-16</b> expired")[0].params["text"]
    assert expired.endswith("expired after 1s in the queue")
    assert not api.with_text(ME, "queued")  # not in the default telegram.events
    assert stat.S_IMODE(os.stat(kg.home.root / "telegram-cursor.json").st_mode) == 0o600
    assert TOKEN.split(":")[1] not in kg.home.service_log.read_text()


def test_outage_then_recovery_and_flood_control(kg, api):
    setup(kg, api)
    bot_up(kg, api)
    api.fail(500)  # every method, the polling too
    kg.delegate("a", 0.1)
    kg.delegate("b", 0.1)
    wait_for(lambda: len([c for c in api.calls_to("sendMessage", ok_only=False) if c.status == 500]) >= 3,
             10, "a few failed deliveries")
    kg.wait_state("b", "succeeded")
    api.recover()
    reply(api, ME, "<b>b</b> (#2) succeeded")
    reply(api, ME, "<b>a</b> (#1) succeeded")
    api.fail(429, count=1, methods={"sendMessage"}, retry_after=1)
    kg.delegate("c", 0)
    reply(api, ME, "<b>c</b> (#3) succeeded")
    for needle in ("started <b>a</b>", "started <b>b</b>", "<b>a</b> (#1) succeeded", "<b>b</b> (#2) succeeded",
                   "started <b>c</b>"):
        assert once(api, needle), needle
    flood = next(c for c in api.calls_to("sendMessage", ok_only=False) if c.status == 429)
    after = next(c for c in api.sent(ME) if c.at > flood.at)
    assert after.at - flood.at >= 1.0, "retry_after was not waited out"


def test_restart_between_events_loses_and_repeats_nothing(kg, api):
    setup(kg, api)
    bot_up(kg, api)
    kg.delegate("a", 0.1)
    reply(api, ME, "<b>a</b> (#1) succeeded")
    go = kg.rec / "go"
    kg.delegate("b", 0, gate=go)
    reply(api, ME, "started <b>b</b>")
    kg.ok("shutdown")
    go.touch()
    wait_for(lambda: "end" in kg.times("b"), 10, "b to end while the service is down")
    kg.delegate("c", 0)  # autostarts the service again
    reply(api, ME, "<b>c</b> (#3) succeeded")
    # b is recorded once the restarted service has looked for what it left running (a /proc
    # scan in a worker thread): its message may come after c's.
    reply(api, ME, "<b>b</b> (#2) succeeded")
    for needle in ("started <b>a</b>", "<b>a</b> (#1) succeeded", "started <b>b</b>", "<b>b</b> (#2) succeeded",
                   "started <b>c</b>"):
        assert once(api, needle), needle

    kg.ok("config", "set", "telegram.notify_chat_ids", f"[{ME}, 222]")  # a new chat gets news, not history
    wait_for(lambda: "222" in (kg.home.root / "telegram-cursor.json").read_text(), 10, "the new chat's cursor")
    kg.delegate("d", 0)
    reply(api, 222, "<b>d</b> (#4) succeeded")
    assert [t for t in api.texts(222) if "<b>d</b>" not in t] == []


def test_html_telegram_cannot_parse_is_sent_again_as_plain_text(kg, api):
    setup(kg, api)
    bot_up(kg, api)
    api.fail(400, count=1, methods={"sendMessage"},
             description="Bad Request: can't parse entities: unsupported start tag at byte offset 9")
    kg.delegate("odd", 0)
    plain = reply(api, ME, "started odd")  # the refused HTML message, again without markup
    assert "<b>" not in plain
    sent = [c for c in api.sent(ME) if "started odd" in c.params["text"]]
    assert len(sent) == 1 and "parse_mode" not in sent[0].params
    reply(api, ME, "<b>odd</b> (#1) succeeded")  # and the next one is HTML again
    assert "can't parse" not in kg.home.service_log.read_text()  # not an error: handled


def test_an_agent_that_vanished_while_the_service_was_down_is_reported_lost(kg, api):
    setup(kg, api)
    bot_up(kg, api)
    go = kg.rec / "go"
    kg.delegate("doomed", 0, gate=go)
    reply(api, ME, "started <b>doomed</b>")
    wait_for(lambda: kg.index()["active"][0]["pid"], what="its pid to be committed")
    # Delivered and recorded as such: a kill -9 between the two would send it again (at least once).
    started = kg.events("started")[0]["seq"]
    cursor = kg.home.root / "telegram-cursor.json"
    wait_for(lambda: cursor.exists() and json.loads(cursor.read_text()).get(str(ME), 0) >= started, 10, "the cursor")
    os.kill(kg.service_pid(), signal.SIGKILL)
    for wrapper in agent_wrappers(kg.home):  # the agent dies too, before anyone records how
        os.killpg(wrapper, signal.SIGKILL)
    wait_for(lambda: not agent_wrappers(kg.home), 5, "the agent to die")
    kg.ok("queue")  # brings the service back
    lost = reply(api, ME, "<b>doomed</b> (#1) lost")
    assert "vanished" in lost
    assert once(api, "<b>doomed</b> (#1) lost") and once(api, "started <b>doomed</b>")


def test_notifications_and_the_feed_survive_the_rotation_of_events_jsonl(kg, api):
    setup(kg, api, max_agents=1, events_max_size="1KiB")  # a rotation every few events
    bot_up(kg, api)
    names = [f"r{i}" for i in range(6)]
    for i, name in enumerate(names, start=1):
        # One at a time (a task's three events are less than 1 KiB): the feed reads between
        # two rotations. Two rotations before it reads lose events: the next test.
        kg.delegate(name, 0)
        reply(api, ME, f"<b>{name}</b> (#{i}) succeeded")
    for name in names:
        assert once(api, f"started <b>{name}</b>"), name
    assert not api.with_text(ME, "left the event log")
    assert kg.home.events_old.exists() and "events.jsonl reached" in kg.home.service_log.read_text()
    current = kg.home.events.read_text() if kg.home.events.exists() else ""  # none until the next event
    assert len(current) + kg.home.events_old.stat().st_size < 4 * 1024
    tail = [json.loads(line)["seq"] for line in current.splitlines()]
    old = [json.loads(line)["seq"] for line in kg.home.events_old.read_text().splitlines()]
    assert old + tail == list(range(old[0], old[0] + len(old) + len(tail)))  # contiguous, nothing repeated


def test_a_worktree_kept_is_told_after_the_task_s_end(kg, api, tmp_path):
    """The worktree is closed after its task ends (by the service's git worker), so what became
    of it is its own `worktree` event: sent to whoever is told of the task's end, when there is
    something to say (work kept); a clean removal says nothing."""
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (["init", "-q", "-b", "main"], ["config", "user.name", "T"], ["config", "user.email", "t@example.com"],
                 ["commit", "-q", "--allow-empty", "-m", "init"]):
        subprocess.run(["git", *args], cwd=repo, check=True)
    setup(kg, api)
    bot_up(kg, api)
    kg.ok("delegate", "w", "--worktree", "--cwd", str(repo), "--", "sh", "-c", "echo w > w.txt; git add w.txt; git commit -qm w; exit 1")
    kg.ok("delegate", "c", "--worktree", "--cwd", str(repo), "--", "true")
    kept = reply(api, ME, "🌿 <b>w</b> (#1)")
    assert kept.endswith("work kept on branch kugetsu/w (1 commit, 1 file changed)")
    assert once(api, "<b>w</b> (#1) failed")
    wait_for(lambda: [e for e in kg.events("worktree") if e["name"] == "c"], 10, "c's worktree to be removed")
    kg.delegate("last", 0)
    reply(api, ME, "<b>last</b> (#3) succeeded")  # in order: c's worktree event was settled before it
    assert once(api, "<b>c</b> (#2) succeeded") and not api.with_text(ME, "🌿 <b>c</b>")


def test_events_rotated_out_before_they_were_sent_are_said_not_skipped(kg, api):
    """The feed cannot deliver for a while (Telegram fails), and meanwhile events.jsonl
    rotates several times (1 KiB): the events gone before the feed read them are said, in
    the chat and the service log, and the feed goes on with what is left."""
    setup(kg, api, max_agents=1, events_max_size="1KiB")
    bot_up(kg, api)
    kg.delegate("first", 0)
    reply(api, ME, "<b>first</b> (#1) succeeded")
    api.fail(500, methods={"sendMessage"})
    kg.delegate("g0", 0)
    # The feed has read g0's start and retries its delivery: it reads nothing more until then.
    wait_for(lambda: [c for c in api.calls_to("sendMessage", ok_only=False) if c.status == 500], 10, "a failed delivery")
    names = [f"g{i}" for i in range(1, 9)]  # 24 events meanwhile: several rotations
    for name in names:
        kg.delegate(name, 0)
    for name in names:
        kg.wait_state(name, "succeeded")
    api.recover()
    said = reply(api, ME, "left the event log before they could be sent here", timeout=30)
    assert "raise events_max_size (now 1KiB) if this repeats" in said
    reply(api, ME, "<b>g8</b> (#10) succeeded", timeout=30)  # what was still there came after it
    assert once(api, "left the event log")
    assert "left the event log unsent" in kg.home.service_log.read_text()


def test_a_failure_notice_of_a_200mb_log_reads_only_its_end(kg, api):
    """Hostile output (issue 24 item 5): the bot's failure notice quotes the end of the log;
    the service reads a window for it, whatever the log's size (uncapped here)."""
    from test_big_logs import MB, big_agent

    setup(kg, api, log_max_size=None)
    bot_up(kg, api)
    pid = kg.service_pid()
    kg.ok("delegate", "spam", "--", *big_agent(200 * MB, then="exit 3"))
    failed = reply(api, ME, "<b>spam</b> (#1) failed", timeout=60)
    assert "the last line" in failed and len(failed) < 4096, failed  # Telegram's limit
    peak = int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmHWM")).split()[1]) // 1024
    assert peak < 100, f"the service reached {peak} MB"  # the bot's library loaded: ~60 MB; a whole read: ~680
