// kugetsu's opencode plugin (README, "Agents"): the built-in opencode preset loads it through
// OPENCODE_CONFIG_CONTENT. opencode retries a refused request by itself and prints nothing
// meanwhile, waiting as long as the provider's retry-after says (a usage limit: hours). A
// retry that would wait longer than KUGETSU_OPENCODE_MAX_RETRY_WAIT seconds (default 30)
// ends the run at once instead, saying when opencode would have tried again, as a line of
// its JSON output (kugetsu/agents/opencode.py reads it); exit 75 (EX_TEMPFAIL). kugetsu then
// holds the preset until that time and resumes the session. Shorter waits (a burst of rate
// limiting) stay opencode's own business.
let givingUp = false

export const KugetsuGiveUp = async () => ({
  event: async ({ event }) => {
    if (givingUp || event?.type !== "session.status") return
    const status = event.properties?.status
    if (!status || status.type !== "retry") return
    const limit = Number(process.env.KUGETSU_OPENCODE_MAX_RETRY_WAIT ?? "30") * 1000
    const next = Number(status.next ?? 0)
    if (!(next - Date.now() > limit)) return
    const line = {
      type: "error", timestamp: Date.now(), sessionID: event.properties.sessionID,
      error: { name: "KugetsuGaveUp", data: { message: String(status.message ?? "retrying"), next, attempt: status.attempt } },
    }
    givingUp = true
    // `run` prints opencode's events from a stream of its own (cli/cmd/run.ts subscribes to
    // them), which may still hold those the bus sent before this one: the step that just ended,
    // with its tokens. Said and ended at once, that step's usage was lost now and then (a CI run
    // in fifteen). Half a second lets them out first; opencode itself would wait far longer.
    setTimeout(() => {
      setTimeout(() => process.exit(75), 1000)  // should the write's callback never come
      process.stdout.write(JSON.stringify(line) + "\n", () => process.exit(75))
    }, 500)
  },
})
