"""Front ends: they parse, call the app layer, and render (cli, tui, telegram, mcp, web,
metrics, doctor, demo). No scheduling rule lives here."""
